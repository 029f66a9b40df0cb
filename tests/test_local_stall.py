"""The local-vote stall experiment (dlion.lab.experiments.local_stall) on 2 ranks, 10 steps."""

import json

from dlion.lab.experiments.local_stall import main


def test_probe_holds_the_sync_back_and_the_modes_differ(tmp_path):
    assert main(["--seeds", "2", "--steps", "10", "--sync-first", "10", "--probe", "2:10", "--workers", "2",
                 "--out", str(tmp_path)]) == 0
    rows = {r["mode"]: r for r in json.load(open(tmp_path / "stall.json"))["rows"]}
    assert set(rows) == {"vote", "vote-h1-10", "vote-ab-0.5", "alone", "g-lion", "probe-10"}
    loss = {m: dict(rows[m]["curve"])[10] for m in ("vote", "vote-h1-10", "vote-ab-0.5", "alone", "g-lion")}
    probe = rows["probe-10"]["probe"]
    # the probe's rank 0 ran the same 10 local steps as "alone" and was not synced: the same loss, bitwise
    assert probe["rank0_local"] == loss["alone"]
    # the sync moved the parameters (the agreed anchor is not rank 0's copy); every mode is its own run
    assert len(set(loss.values())) == 5
    assert 0.0 < probe["mean_abs_progress_over_S"] <= 1.01  # a Lion step moves a coordinate by lr (plus its small decay)
    assert 0.0 <= probe["share_below_quarter_S"] < 1.0
    assert (tmp_path / "stall.png").stat().st_size > 10_000
    # bits rank 0 sent: 2 ranks, 1 bit to the other rank's half of each bucket, then a 1-bit result
    # (or a base-3 digit where ranks abstain) back: (N-1)/N·(1 + 1) = 1 bit per sync, plus headers
    bits = {m: rows[m]["bits_sent_per_param_per_step"] for m in ("vote", "vote-h1-10", "vote-ab-0.5", "alone")}
    assert bits["alone"] == 0.0
    assert 0.1 <= bits["vote"] < 0.105  # one sync in 10 steps
    assert 1.0 <= bits["vote-h1-10"] < 1.05  # ten
    # scattered abstentions: with abstain_below the bucket goes as base-3 digits (5 per byte) from the first
    # sync on, both ways: (N-1)/N·(1.6 + 1.6) = 1.6 bits for this sync (2.6 when it went as 1 bit first)
    assert 0.16 <= bits["vote-ab-0.5"] < 0.165
    # a later run of some modes replaces their rows and keeps the others
    assert main(["--seeds", "2", "--steps", "10", "--sync-first", "10", "--probe", "", "--workers", "2",
                 "--modes", "alone", "--out", str(tmp_path)]) == 0
    again = {r["mode"]: r for r in json.load(open(tmp_path / "stall.json"))["rows"]}
    assert set(again) == set(rows) and again["alone"]["curve"] == rows["alone"]["curve"]
