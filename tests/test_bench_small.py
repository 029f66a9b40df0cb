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
