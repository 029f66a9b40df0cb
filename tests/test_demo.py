"""`dlion demo` end to end on 2 local workers, 1 epoch (in-process; workers are forked)."""

import re

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
