"""``DistributedLion(delay=1)``: each step's Δ applied one step later, on real Gloo groups.

The reference is written from the update rule (Distributed Lion, arXiv 2404.00438) with
the one-step delay of delayed gradient averaging: after the (t+1)-th ``step()`` call the
parameters hold Δ_0 … Δ_{t−1} (each with its weight decay), and every momentum holds
g_0 … g_t. ``grads_for`` does not depend on the parameters, so the delayed run's Δ_t are
those of the undelayed run, which makes every intermediate state exactly checkable.
"""

import io

import pytest
import torch

import dlion
from dlion.vote import coin_key, tie_coins
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, SHAPES, STEPS, WD, grads_for, init_params

NAN_RANK, NAN_STEP = 1, 2


def reference(world, cfg, layout, applied, seen, nan_step=None):
    """(parameters with the first ``applied`` Δ applied, every rank's momenta after ``seen``
    gradients). With ``nan_step``, rank ``NAN_RANK``'s gradient of that step is non-finite:
    that Δ is skipped everywhere (no decay either) and that rank's momentum skips the gradient."""
    x = [p.clone() for p in init_params(0)]
    m = [[torch.zeros(s, dtype=d) for s, d in SHAPES] for _ in range(world)]
    last = [torch.zeros(s, dtype=d) for s, d in SHAPES]  # the last applied update (ties="previous")
    for t in range(max(applied, seen)):
        grads = [grads_for(i, t, cfg.get("dense", False)) for i in range(world)]
        for k in range(len(SHAPES)):
            deltas = []
            for i in range(world):
                g = grads[i][k]
                if g is None:
                    deltas.append(torch.zeros_like(x[k]))
                    continue
                c = BETAS[0] * m[i][k] + (1 - BETAS[0]) * g
                deltas.append(torch.sign(c))
                if t < seen and not (t == nan_step and i == NAN_RANK):
                    m[i][k] = BETAS[1] * m[i][k] + (1 - BETAS[1]) * g
            if t < applied and t != nan_step and all(grads[i][k] is None for i in range(world)):
                last[k] = torch.zeros_like(x[k])
            if t >= applied or t == nan_step or all(grads[i][k] is None for i in range(world)):
                continue
            s = sum(deltas)
            nz = sum(d.abs() for d in deltas)
            if cfg["vote"] == "avg":
                update = s / world
            else:
                update = torch.sign(s)
                if cfg.get("ties") in ("random", "previous"):
                    bucket, offset, _ = layout[k]
                    coins = tie_coins(coin_key(5, t, bucket), offset, s.numel()).view(s.shape).to(s.dtype)
                    if cfg["ties"] == "previous":  # the last update applied, a step before this one's vote
                        coins = torch.where(last[k] != 0, last[k], coins)
                    update = torch.where((s == 0) & (nz > 0), coins, update)
            last[k] = update
            x[k] = x[k] * (1 - LR * WD) - LR * update
    return x, m


def _optimizer(params, cfg):
    return dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, vote=cfg["vote"],
                                 ties=cfg.get("ties", "zero"), comm=cfg.get("comm", "1bit"), seed=5,
                                 bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0), fused=cfg.get("fused", False),
                                 delay=1)


def _snapshot(params, opt):
    return dict(params=[p.detach().clone() for p in params],
                momenta=[opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else None for p in params],
                step_count=opt.step_count, skipped=opt.skipped_steps)


def delay_worker(rank, world, configs, nan):
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = _optimizer(params, cfg)
        states = []
        for t in range(STEPS):
            for p, g in zip(params, grads_for(rank, t, cfg.get("dense", False))):
                p.grad = g
            if nan and t == NAN_STEP and rank == NAN_RANK:
                params[6].grad[3, 4] = float("nan")
            opt.step()
            states.append(_snapshot(params, opt))
        opt.zero_grad()
        opt.flush()
        states.append(_snapshot(params, opt))
        out.append(dict(states=states, layout=opt.bucket_layout()))
    return out


CONFIGS = [
    dict(vote="mavo"),
    dict(vote="avg", dense=True),
    dict(vote="mavo", ties="random", fused=True),
    dict(vote="mavo", comm="allgather", bucket_cap_mb=40 * 4 / 2**20),  # many buckets, one exchange thread
    dict(vote="avg", comm="pbit"),
    dict(vote="mavo", ties="previous"),
]


def _check(world, results, nan):
    for c, cfg in enumerate(CONFIGS):
        layout = results[0][c]["layout"]
        for call in range(STEPS + 1):  # STEPS step() calls, then flush()
            applied = min(call, STEPS)
            seen = min(call + 1, STEPS)
            want_x, want_m = reference(world, cfg, layout, applied, seen, NAN_STEP if nan else None)
            for rank, res in enumerate(r[c] for r in results):
                st = res["states"][call]
                for k, (got, want) in enumerate(zip(st["params"], want_x)):
                    assert torch.equal(got, want), f"{cfg} rank {rank} after call {call + 1}: parameter {k}"
                for k, (got, want) in enumerate(zip(st["momenta"], want_m[rank])):
                    if got is not None:
                        assert torch.equal(got, want), f"{cfg} rank {rank} after call {call + 1}: momentum {k}"
                assert st["step_count"] == applied
                assert st["skipped"] == (1 if nan and applied > NAN_STEP else 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_delta_is_applied_one_step_later_and_momenta_at_once(world):
    _check(world, spawn(delay_worker, world, CONFIGS, False), nan=False)


def test_a_nonfinite_gradient_skips_that_delta_on_every_rank_one_step_later():
    _check(3, spawn(delay_worker, 3, CONFIGS, True), nan=True)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 64)
        self.b = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _batch(rank, t):
    g = torch.Generator().manual_seed(100 * rank + t)
    return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)


def resume_worker(rank, world, k):
    """A model whose gradients depend on its parameters: K steps, a checkpoint (which flushes),
    K more; then the same from the checkpoint in a fresh optimizer. Every rank's parameters
    gathered after every step."""
    def train(model, opt, steps, start):
        sums = []
        for t in range(start, start + steps):
            x, y = _batch(rank, t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            everyone = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(everyone, mine)  # on the default group, while Δ is in flight
            sums.append(all(torch.equal(e, everyone[0]) for e in everyone))
        return sums

    torch.manual_seed(rank)  # different initial weights: the optimizer broadcasts rank 0's
    model = _Net()
    opt = dlion.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=0.001, delay=1)
    agree = train(model, opt, k, 0)
    file = io.BytesIO()  # model first, as most training loops save it: Δ_{k-1} is not applied yet
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, file)
    at_save = [p.detach().clone() for p in model.parameters()]
    agree += train(model, opt, k, k)
    opt.flush()
    final = [p.detach().clone() for p in model.parameters()]
    opt.check_replicas()

    file.seek(0)
    saved = torch.load(file, weights_only=True)
    model2 = _Net()
    model2.load_state_dict(saved["model"])
    opt2 = dlion.DistributedLion(model2.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=0.001, delay=1)
    opt2.load_state_dict(saved["opt"])
    agree += train(model2, opt2, k, k)
    opt2.flush()
    resumed = [p.detach().clone() for p in model2.parameters()]
    return dict(agree=agree, final=final, resumed=resumed, at_save=at_save, buckets=len(opt.buckets),
                steps=(opt.step_count, opt2.step_count))


def test_ranks_agree_every_step_and_a_checkpoint_resumes_bitwise():
    results = spawn(resume_worker, 3, 4)
    for res in results:
        assert all(res["agree"])
        assert res["buckets"] > 1
        assert res["steps"] == (8, 8)
        for a, b in zip(res["final"], res["resumed"]):
            assert torch.equal(a, b)
        for a, b in zip(res["final"], res["at_save"]):  # training went on after the checkpoint
            assert not torch.equal(a, b)
        for a, b in zip(res["final"], results[0]["final"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(delay=2), "delay must be 0 or 1"),
    (dict(delay=True), "delay must be 0 or 1"),
    (dict(delay=1, overlap=True), "cannot be combined with overlap=True"),
])
def test_bad_delay_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dlion.DistributedLion([torch.zeros(3, requires_grad=True)], **kwargs)


def _train(model, opt, rank, start, steps):
    for t in range(start, start + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _fresh(rank, vote):
    torch.manual_seed(rank)
    model = _Net()
    return model, dlion.DistributedLion(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=0.001,
                                        ties="random", vote=vote, delay=1)


def checkpoint_save_worker(rank, world, path, k, sharded, vote):
    """2K steps without a checkpoint, and 2K steps with ``dlion.checkpoint.save`` (which checks the
    replicas) after step K: the checkpoint must not change the trajectory."""
    from dlion import checkpoint

    model, opt = _fresh(rank, vote)
    _train(model, opt, rank, 0, 2 * k)
    opt.flush()
    plain = [p.detach().clone() for p in model.parameters()]
    model, opt = _fresh(rank, vote)
    _train(model, opt, rank, 0, k)
    checkpoint.save(path, model, opt, sharded=sharded)
    _train(model, opt, rank, k, k)
    opt.flush()
    return dict(plain=plain, saved=[p.detach().clone() for p in model.parameters()])


def checkpoint_load_worker(rank, world, path, k, vote):
    from dlion import checkpoint

    model, opt = _fresh(rank, vote)
    checkpoint.load(path, model, opt)
    _train(model, opt, rank, k, k)
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("sharded, vote", [(False, "mavo"), (True, "mavo"), (False, "avg")])
def test_dlion_checkpoint_keeps_the_pending_delta_and_resumes_bitwise_or_resized(tmp_path, sharded, vote):
    path = str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))
    saved = spawn(checkpoint_save_worker, 3, path, 3, sharded, vote)
    for res in saved:
        for a, b, c in zip(res["plain"], res["saved"], saved[0]["plain"]):
            assert torch.equal(a, b) and torch.equal(a, c)
    resumed = spawn(checkpoint_load_worker, 3, path, 3, vote)
    for res in resumed:
        for a, b in zip(res, saved[0]["plain"]):
            assert torch.equal(a, b)
    # momenta averaged; the pending Δ still applied (Avg: a mean over 3 ranks, applied at load)
    resized = spawn(checkpoint_load_worker, 2, path, 3, vote)
    for a, b in zip(resized[0], resized[1]):
        assert torch.equal(a, b)


def scaler_worker(rank, world):
    p = torch.ones(8, requires_grad=True)
    opt = dlion.DistributedLion([p], lr=0.1, delay=1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p * (rank + 1)).sum()).backward()
    try:
        scaler.step(opt)
    except RuntimeError as e:
        return str(e)
    return None


def test_gradscaler_is_refused_with_delay_on_every_rank():
    for err in spawn(scaler_worker, 2):
        assert err is not None and "delay=1" in err and "GradScaler" in err
