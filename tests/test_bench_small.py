"""Smoke tests of ``dlion bench codec`` and ``dlion bench comm`` on tiny inputs: they run on
the library's algorithm objects and print the figures their docs describe."""

import re

from dlion.lab.bench import codec, comm


def test_codec_bench_prints_every_stage_and_the_ratios(capsys):
    assert codec.main(["--params", "20K", "--workers", "3", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for stage in ("lion step", "contribute", "exchange", "apply"):
        assert re.search(rf"^{stage}\s+[\d.]+\s+[\d.]+$", out, re.M), stage
    assert "× the local Lion step" in out


def test_comm_bench_counts_one_bit_near_the_formula(capsys):
    assert comm.main(["--workers", "3", "--params", "30K", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^1bit\s+mavo\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    bits, formula, ratio = map(float, row.groups())
    assert formula == round(2 * 2 / 3, 3) and 1.0 <= ratio <= 1.05  # 1 bit up, 1 bit back (odd N), + headers


def test_comm_bench_models_a_layer_without_gradient_costs_nothing_after_the_first_step(tmp_path, capsys):
    out_json = tmp_path / "models.json"
    assert comm.main(["--models", "--workers", "3", "--steps", "4", "--json", str(out_json)]) == 0
    import json
    rows = {(r["scenario"], r["vote"]): r for r in json.loads(out_json.read_text())["models"][0]["rows"]}
    for vote in ("mavo", "mavo, random ties", "avg"):
        frozen = rows[("frozen backbone + head", vote)]
        unused = rows[("+ unused layer (no grad anywhere)", vote)]
        assert frozen["trainable"] == 1000 * 10 + 10  # the 1 M frozen values do not count ...
        assert unused["trainable"] == frozen["trainable"] + 10 * 10 + 10  # ... the unused layer does
        assert unused["first"] > frozen["first"]  # the first step cannot know it is unused
        assert unused["steady"] == frozen["steady"]  # after that it costs nothing on the wire
    assert "+ layer with grads on even ranks" in capsys.readouterr().out
