"""`dlion demo` end to end on 2 local workers, 1 epoch (in-process; workers are forked)."""

import json
import math
import re
import sys

import pytest

from dlion.lab.demo import main

METHODS = ("G-Lion (DDP)", "D-Lion MaVo", "D-Lion Avg")


def test_demo_small(capsys):
    assert main(["--workers", "2", "--epochs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        for m in METHODS:
            if line.startswith(m):
                rows[m] = line
    assert set(rows) == set(METHODS), out

    # bits/param/step, sent + received, per method.
    bits = {}
    for m, line in rows.items():
        found = re.search(r"(\d+\.\d\d) \+ (\d+\.\d\d)\s+\d+\.\d s$", line)
        assert found, line
        bits[m] = float(found[1]) + float(found[2])
    # G-Lion: fp32 ring all-reduce, 2(N-1)/N x 32 bits each way = 32 + 32 for N = 2, exactly.
    assert bits["G-Lion (DDP)"] == 64.0
    # D-Lion MaVo: at most 1.6 bits up and 1.6 down, (N-1)/N each way, plus flags:
    # at least 20x fewer bytes than G-Lion with 1-bit signs, ~20x when dead ReLU
    # units make the buckets travel as base-3 digits (as they do for this CNN).
    assert bits["D-Lion MaVo"] < 64.0 / 18
    ratio = float(re.search(r"G-Lion moves (\d+\.\d)x the bytes of D-Lion MaVo", out)[1])
    assert ratio > 18

    for m in METHODS:  # a test accuracy per method, well above chance (10 %) after one epoch
        acc = float(re.search(r"(\d+\.\d) %", rows[m])[1])
        assert 50.0 < acc <= 100.0, rows[m]
    assert "parameters identical on all 2 ranks: yes" in out


def test_demo_rejects_one_worker(capsys):
    assert main(["--workers", "1"]) == 2


def test_demo_names_the_extra_when_scikit_learn_is_missing(monkeypatch, capsys):
    """A plain install lacks scikit-learn: the demo says which extra brings it, not a bare
    ModuleNotFoundError (None in sys.modules makes `import sklearn` fail as if absent)."""
    monkeypatch.setitem(sys.modules, "sklearn", None)
    assert main(["--workers", "2", "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "scikit-learn" in err and 'pip install "dlion[tools]"' in err, err
    assert "tqdm" not in err  # no progress bars asked for: tqdm is not needed


def test_demo_names_the_extra_when_tqdm_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["--workers", "2", "--epochs", "1"]) == 2  # progress bars on by default
    err = capsys.readouterr().err
    assert "tqdm" in err and 'pip install "dlion[tools]"' in err and "scikit-learn" not in err, err


def test_demo_out_writes_the_printed_figures(tmp_path, capsys):
    """--out DIR writes what the demo prints as JSON; its bits per parameter agree with a count
    made here from the wire formats (not with the library's counter)."""
    n = 2
    assert main(["--workers", str(n), "--epochs", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "demo_results.json").read_text())
    assert (tmp_path / "demo_table.txt").read_text().strip() in printed
    assert {"benchmark", "config", "methods", "glion_bytes_over_dlion_mavo_bytes", "counting", "dlion_version",
            "torch"} <= set(doc)
    assert doc["config"]["workers"] == n and doc["config"]["comm"] == "1bit"
    rows = {r["method"]: r for r in doc["methods"]}
    assert set(rows) == set(METHODS)
    keys = {"test_accuracy", "steps", "num_params", "bytes_sent_per_step", "bytes_received_per_step",
            "bits_per_param_sent_per_step", "bits_per_param_received_per_step", "wall_s", "replicas_identical"}
    for r in rows.values():
        assert keys <= set(r) and r["replicas_identical"] is True
        assert r["bytes_sent_per_step"] == r["bytes_received_per_step"]

    from dlion.lab.models import DigitsCNN

    params = sum(p.numel() for p in DigitsCNN(width=32).parameters())  # counted here
    assert all(r["num_params"] == params for r in rows.values())
    each_way = (n - 1) / n
    # G-Lion: a ring all-reduce of every fp32 gradient, 2(N-1)/N x 32 bits each way, exactly
    g = rows["G-Lion (DDP)"]
    assert g["bytes_sent_per_step"] == pytest.approx(2 * each_way * 4 * params)
    assert g["bits_per_param_sent_per_step"] == pytest.approx(64 * each_way)
    # D-Lion: (up + down) x (N-1)/N bits. This CNN's dead ReLU units abstain in scattered places,
    # so the signs go up as base-3 digits (5 trits a byte: 1.6 bits); at even N with zero ties
    # MaVo's result can be 0 (base-3 again), Avg's is one of 2N+1 values: ceil(log2(2N+1)) bits.
    # Headers (a few dozen bytes per bucket and step) add at most 5 % on these 58 k values.
    expected = {"D-Lion MaVo": (1.6 + 1.6) * each_way, "D-Lion Avg": (1.6 + math.ceil(math.log2(2 * n + 1))) * each_way}
    for m, bits in expected.items():
        got = rows[m]["bits_per_param_sent_per_step"]
        assert bits <= got <= 1.05 * bits, (m, got, bits)
    ratio = g["bytes_sent_per_step"] / rows["D-Lion MaVo"]["bytes_sent_per_step"]
    assert doc["glion_bytes_over_dlion_mavo_bytes"] == pytest.approx(ratio)
