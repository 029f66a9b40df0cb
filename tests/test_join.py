"""Uneven inputs: ``torch.distributed.algorithms.Join`` around the training loop, on real Gloo ranks.

Rank 2 has two batches fewer than ranks 0 and 1. Inside ``Join([opt])`` the rank that runs out
answers the others' remaining steps as an abstainer (no gradient on any parameter); every rank
finishes with bitwise-equal parameters, equal to a run without Join in which rank 2's missing
steps are steps with every gradient None. Without Join every rank would wait in the next
collective until the process-group timeout.
"""

import pytest
import torch
from torch.distributed.algorithms import Join
from torch.distributed.algorithms.join import Joinable

import dlion
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, WD, grads_for, init_params

BATCHES = 5     # ranks 0 and 1; rank 2 has BATCHES - SHORT
SHORT = 2
CONFIGS = [dict(vote="mavo", comm="1bit", check_every=1),
           dict(vote="avg", comm="allgather", momentum_sync=2),
           dict(vote="mavo", comm="pbit", ties="random")]


def build(rank, cfg):
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, seed=5, **cfg)
    return params, opt


def batches(rank):
    return BATCHES - SHORT if rank == 2 else BATCHES


def join_worker(rank, world, joined):
    """Each config: with ``joined``, the uneven loop inside Join; otherwise every rank runs BATCHES
    steps, rank 2's last SHORT ones with every gradient None (the same abstention, spelled out)."""
    out = []
    for cfg in CONFIGS:
        params, opt = build(rank, cfg)
        assert isinstance(opt, Joinable)
        if joined:
            with Join([opt]):
                for t in range(batches(rank)):
                    for p, g in zip(params, grads_for(rank, t, False)):
                        p.grad = g
                    opt.step()
        else:
            for t in range(BATCHES):
                grads = grads_for(rank, t, False) if t < batches(rank) else [None] * len(params)
                for p, g in zip(params, grads):
                    p.grad = g
                opt.step()
        opt.check_replicas()
        out.append(dict(params=[p.detach().clone() for p in params], steps=opt.step_count,
                        momenta=[opt.state[p]["exp_avg"].clone() for p in params if "exp_avg" in opt.state[p]],
                        grads=[None if p.grad is None else p.grad.clone() for p in params]))
    return out


def test_join_lets_a_rank_with_fewer_batches_abstain_until_every_rank_is_done():
    joined = spawn(join_worker, 3, True, timeout_s=120)
    plain = spawn(join_worker, 3, False, timeout_s=120)
    for c in range(len(CONFIGS)):
        ref = joined[0][c]
        assert ref["steps"] == BATCHES
        for rank in range(3):
            got, want = joined[rank][c], plain[rank][c]
            assert got["steps"] == BATCHES
            assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"]))   # replicas equal
            assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"]))  # = abstention run
            assert all(torch.equal(a, b) for a, b in zip(got["momenta"], want["momenta"]))
        # the shadow steps put the joined rank's own gradients back (its last batch's)
        last = grads_for(2, BATCHES - SHORT - 1, False)
        assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(joined[2][c]["grads"], last))


def unsupported_worker(rank, world):
    errors = []
    for make in (lambda ps: dlion.DistributedLion(ps, lr=LR, overlap=True),
                 lambda ps: dlion.DistributedLion(ps, lr=LR, delay=1),
                 lambda ps: dlion.LocalDistributedLion(ps, lr=LR, sync_every=2)):
        opt = make([p.requires_grad_() for p in init_params(rank)])
        with pytest.raises(NotImplementedError) as e:
            Join([opt])
        errors.append(str(e.value))
    return errors


def test_join_is_refused_where_a_step_cannot_be_shadowed():
    """overlap=True, delay=1 and LocalDistributedLion: Join([opt]) raises NotImplementedError on
    every rank, before any collective (nothing hangs)."""
    for errors in spawn(unsupported_worker, 2, timeout_s=60):
        assert "needs overlap=False and delay=0" in errors[0] and "needs overlap=False and delay=0" in errors[1]
        assert "LocalDistributedLion does not support torch.distributed.algorithms.Join" in errors[2]


def schedule_worker(rank, world):
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    opt = dlion.DistributedLion(model.named_parameters(), lr=0.1)
    try:
        with Join([opt]):
            for _ in range(4 - 2 * rank):  # rank 1: two batches fewer
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                for group in opt.param_groups:  # a per-step schedule: not stepped once a rank has joined
                    group["lr"] *= 0.5
    except ValueError as e:
        return str(e)
    return None


def test_a_per_step_schedule_not_stepped_on_the_joined_rank_raises_on_every_rank():
    """The finished rank's shadow steps use its own lr: once it differs from the others', the step's
    hyperparameter digest disagrees and every rank raises (nothing changed), instead of applying
    Δ with two different lrs."""
    for err in spawn(schedule_worker, 2, timeout_s=60):
        assert err is not None and "ranks disagree on lr, betas, weight_decay or maximize at step 3" in err
