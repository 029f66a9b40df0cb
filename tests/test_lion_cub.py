"""Lion Cub's levers and the optimizer's safety features, on real Gloo ranks."""

import pytest
import torch
from torch import nn

import dlion
from dlion import DesyncError
from dlion.base import momentum_sync_due
from dlion.quantize import levels, quantize, scale_of
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, SHAPES, STEPS, WD, grads_for, init_params


# -- quantised aggregation ----------------------------------------------------

def test_quantize_literal():
    c = torch.tensor([0.5, -0.25, 0.0, 2.0, -3.0, 0.125])
    s = levels(8, 4)
    assert s == 31  # ⌊127/4⌋
    l1 = c.abs().mean()
    assert torch.equal(quantize(c, s, "l1"), torch.clamp(torch.round(c / l1 * (s / 2)), -s, s).to(torch.int8))
    assert torch.equal(quantize(c, s, "linf"), torch.round(c / 3.0 * (s / 2)).to(torch.int8))
    nz = c[c != 0].abs()
    assert torch.allclose(scale_of(c, "l0"), nz.log().mean().exp())
    assert torch.equal(quantize(torch.zeros(4), s, "l1"), torch.zeros(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="quant_bits=2 leaves no quantisation level for 4 workers"):
        levels(2, 4)


def quant_worker(rank, world, norm, bits):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, aggregate="quantized",
                                quant_norm=norm, quant_bits=bits)
    for t in range(STEPS):
        for p, g in zip(params, grads_for(rank, t, False)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], opt.comm_stats.state_dict()


@pytest.mark.parametrize("norm, bits", [("l1", 8), ("linf", 8), ("l0", 4)])
def test_quantized_aggregation_matches_literal_reference(norm, bits):
    world = 3
    results = spawn(quant_worker, world, norm, bits)
    s = (2 ** (bits - 1) - 1) // world
    x = init_params(0)
    m = [[torch.zeros(sh, dtype=d) for sh, d in SHAPES] for _ in range(world)]
    for t in range(STEPS):
        grads = [grads_for(i, t, False) for i in range(world)]
        for k in range(len(SHAPES)):
            if all(grads[i][k] is None for i in range(world)):
                continue
            total = 0
            for i in range(world):
                g = grads[i][k]
                if g is None:
                    continue
                c = BETAS[0] * m[i][k] + (1 - BETAS[0]) * g
                a = c.abs().float()
                scale = {"l1": a.mean(), "linf": a.max(), "l0": a[a > 0].log().mean().exp()}[norm]
                scale = scale if scale > 0 else torch.tensor(1.0)
                total = total + torch.clamp(torch.round(c.float() / scale * (s / 2)), -s, s)
                m[i][k] = BETAS[1] * m[i][k] + (1 - BETAS[1]) * g
            x[k] = x[k] * (1 - LR * WD) - LR * torch.sign(total).to(x[k].dtype)
    for rank, (params, _) in enumerate(results):
        for k, (got, want) in enumerate(zip(params, x)):
            assert torch.equal(got, want), (norm, rank, k)
    stats = results[0][1]
    assert set(stats["by_kind"]) == {"quantized", "check"}  # packed-field all-reduces, no sign traffic


# -- momentum synchronisation ----------------------------------------------------

def sync_worker(rank, world, schedule):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, momentum_sync=schedule, comm="1bit")
    momenta_after = []
    for t in range(STEPS):
        for p, g in zip(params, grads_for(rank, t, True)):
            p.grad = g
        opt.step()
        momenta_after.append([opt.state[p]["exp_avg"].clone() for p in params])
    return [p.detach() for p in params], momenta_after, opt.comm_stats.state_dict()


@pytest.mark.parametrize("schedule, synced_steps", [(2, {2, 4, 6}), ("doubling", {1, 2, 4}), ("none", set())])
def test_momentum_sync_averages_momenta_and_ranks_still_agree(schedule, synced_steps):
    world = 3
    results = spawn(sync_worker, world, schedule)
    assert {t for t in range(1, STEPS + 1) if momentum_sync_due(schedule, t)} == synced_steps
    for rank in range(1, world):
        for a, b in zip(results[0][0], results[rank][0]):
            assert torch.equal(a, b)
    for t in range(STEPS):
        same = all(torch.equal(results[0][1][t][k], results[r][1][t][k])
                   for r in range(1, world) for k in range(len(SHAPES)))
        assert same == ((t + 1) in synced_steps), (schedule, t)
    # The synchronised momenta are the mean of every rank's (not, say, rank 0's broadcast): literal reference.
    m = [[torch.zeros(s, dtype=d) for s, d in SHAPES] for _ in range(world)]
    for t in range(STEPS):
        for i in range(world):
            m[i] = [BETAS[1] * mk + (1 - BETAS[1]) * g for mk, g in zip(m[i], grads_for(i, t, True))]
        if (t + 1) in synced_steps:
            mean = [sum(m[i][k].float() for i in range(world)) / world for k in range(len(SHAPES))]
            m = [[mk.to(d) for mk, (_, d) in zip(mean, SHAPES)] for _ in range(world)]
        for i in range(world):
            for k in range(len(SHAPES)):
                assert torch.allclose(results[i][1][t][k], m[i][k], rtol=1e-5, atol=1e-7), (schedule, t, i, k)
    stats = results[0][2]
    n_bytes = sum(torch.zeros(s, dtype=d).numel() * 4 for s, d in SHAPES)
    expected = len(synced_steps) * round(n_bytes * 2 * (world - 1) / world)
    assert stats["by_kind"].get("momentum_sync", [0, 0])[0] == pytest.approx(expected, abs=len(synced_steps))


# -- overlap with backward and gradient accumulation ---------------------------------

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def overlap_worker(rank, world, micro):
    out = {}
    for overlap in (False, True):
        model = make_model()
        opt = dlion.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, overlap=overlap,
                                    bucket_cap_mb=2000 * 4 / 2**20, comm="1bit")  # several buckets
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            opt.zero_grad()
            for k in range(micro):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
                ctx = opt.no_sync() if (overlap and k < micro - 1) else _null()
                with ctx:
                    nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[overlap] = ([p.detach().clone() for p in model.parameters()], len(opt.buckets))
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("micro", [1, 3])
def test_overlap_gives_identical_results(micro):
    results = spawn(overlap_worker, 3, micro)
    for rank, out in enumerate(results):
        (plain, nb), (overlapped, _) = out[False], out[True]
        assert nb >= 3
        for a, b in zip(plain, overlapped):
            assert torch.equal(a, b), rank
        for a, b in zip(overlapped, results[0][True][0]):
            assert torch.equal(a, b)


def double_backward_worker(rank, world):
    model = make_model()
    opt = dlion.DistributedLion(model.parameters(), lr=1e-2, overlap=True)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return [str(x.message) for x in w]


def test_accumulating_without_no_sync_is_not_an_error():
    """Two backwards then step() with overlap=True is legitimate (torch.optim semantics: the step uses
    the accumulated gradients, see tests/test_distributed.py); it warns no more."""
    msgs = spawn(double_backward_worker, 2)[0]
    assert not any("no_sync" in m for m in msgs)


# -- safety: desync, non-finite gradients, fault hooks ----------------------------------

def desync_worker(rank, world):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, check_every=2)
    for t in range(4):
        for p, g in zip(params, grads_for(rank, t, True)):
            p.grad = g
        if t == 2 and rank == 1:
            with torch.no_grad():
                params[3][1, 1] += 1e-6  # silent corruption on one rank
        try:
            opt.step()
        except DesyncError as e:
            return t, str(e)
    return None, None


def test_desync_check_names_the_first_diverging_parameter():
    for t, msg in spawn(desync_worker, 3):
        assert t == 3  # checked after steps 2 and 4: caught at the first check after the corruption
        assert "parameter 3 (shape (3, 3)) differs between rank 0 and rank 1 after step 4" in msg


def nonfinite_worker(rank, world, policy, at=1, fused=False):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, nonfinite=policy, fused=fused)
    outcome = []
    for t in range(3):
        grads = grads_for(rank, t, True)
        if t == 1 and rank == 2:
            grads[at].view(-1)[3] = float("nan")
        if t == 2 and rank == 2:
            grads[0] = None  # (a parameter without gradient right after a NaN in the same bucket)
        for p, g in zip(params, grads):
            p.grad = g
        before = [p.detach().clone() for p in params]
        try:
            opt.step()
            outcome.append("ok")
        except FloatingPointError as e:
            outcome.append(str(e))
        outcome.append(all(torch.equal(a, b) for a, b in zip(before, params)))
    return outcome, opt.skipped_steps, [p.detach() for p in params]


@pytest.mark.parametrize("at,fused", [(1, False), (0, False), (0, True), (1, True)])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(at, fused):
    """NaN in the fp64 bucket (gradients copied) or the fp32 one (read in place), or either through
    the fused kernel (which marks a non-finite c in its output)."""
    results = spawn(nonfinite_worker, 3, "skip", at, fused)
    for outcome, skipped, params in results:
        assert outcome == ["ok", False, "ok", True, "ok", False]  # step 1 left parameters unchanged
        assert skipped == 1
        for a, b in zip(params, results[0][2]):
            assert torch.equal(a, b)


def test_nonfinite_raise_policy_raises_on_every_rank():
    for outcome, skipped, _ in spawn(nonfinite_worker, 3, "raise"):
        assert "inf/NaN gradients at step 1" in outcome[2] and outcome[3] is True


def flip_worker(rank, world):
    params = [torch.zeros(40, requires_grad=True)]
    hook = (lambda step, d: -d) if rank == 0 else None
    opt = dlion.DistributedLion(params, lr=1.0, sign_hook=hook)
    params[0].grad = torch.ones(40)
    opt.step()
    return params[0].detach()


def test_sign_hook_changes_what_this_rank_sends():
    # 3 ranks all see +1 gradients; rank 0 flips: the majority still says +1 → x = −1.
    for x in spawn(flip_worker, 3):
        assert torch.equal(x, -torch.ones(40))


@pytest.mark.parametrize("kwargs, message", [
    (dict(comm="2bit"), "Unknown comm '2bit'"),
    (dict(aggregate="mean"), "Unknown aggregate 'mean'"),
    (dict(aggregate="quantized", vote="avg"), "needs vote='mavo'"),
    (dict(aggregate="quantized", quant_norm="l2"), "Unknown quant_norm 'l2'"),
    (dict(aggregate="quantized", quant_bits=3), "quant_bits must be 2, 4 or 8"),
    (dict(momentum_sync=0), "momentum_sync must be 'none', 'doubling' or a positive int"),
    (dict(momentum_sync="often"), "momentum_sync must be"),
    (dict(check_every=-1), "check_every must be an int >= 0"),
    (dict(nonfinite="ignore"), "Unknown nonfinite 'ignore'"),
])
def test_bad_lion_cub_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dlion.DistributedLion([torch.zeros(3, requires_grad=True)], **kwargs)


def test_add_param_group_after_construction_is_refused():
    opt = dlion.DistributedLion([torch.zeros(3, requires_grad=True)])
    with pytest.raises(RuntimeError, match="pass every parameter group to the constructor"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def bad_hook_worker(rank, world):
    params = [torch.zeros(40, requires_grad=True)]
    hook = (lambda step, d: d[:3]) if rank == 0 else None
    opt = dlion.DistributedLion(params, lr=1.0, sign_hook=hook)
    params[0].grad = torch.ones(40)
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        return str(e), params[0].detach().clone()
    return None, None


def test_bad_sign_hook_output_stops_every_rank_without_hanging():
    (e0, p0), (e1, p1) = spawn(bad_hook_worker, 2, timeout_s=20)
    assert "sign_hook must return an int8 tensor of shape (40,), got torch.int8 tensor of shape (3,)" in e0
    assert "another rank rejected its gradients" in e1
    assert torch.equal(p0, torch.zeros(40)) and torch.equal(p1, torch.zeros(40))
