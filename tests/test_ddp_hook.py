"""D-Lion as a DDP communication hook: bitwise equal to DistributedLion where the semantics
coincide (every parameter used, zero ties), several buckets, 2 and 3 Gloo ranks."""

import os

import pytest
import torch
from torch import nn

import dlion
from dlion.integrations.ddp import ApplyDelta, DLionHookState, dlion_hook
from dlion.lab.spawn import spawn

LR, WD, BETAS = 0.01, 0.1, (0.9, 0.99)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 400), nn.Tanh(), nn.Linear(400, 800), nn.Tanh(), nn.Linear(800, 5))


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(5)]


def hook_worker(rank, world, vote, comm, mdtype=None, fused=False):
    # reference: DistributedLion on the bare model
    ref = make_model()
    opt = dlion.DistributedLion(ref.parameters(), lr=LR, betas=BETAS, weight_decay=WD, vote=vote, comm="1bit",
                                momentum_dtype=mdtype)
    for x, y in batches(rank):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    # the same through DDP with the hook, in several buckets
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets (the first: 1 MB)
    state = DLionHookState(model, betas=BETAS, vote=vote, comm=comm, momentum_dtype=mdtype, bucket_cap_mb=0.5,
                           fused=fused)
    ddp.register_comm_hook(state, dlion_hook)
    opt2 = ApplyDelta(ddp.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches(rank):
        opt2.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt2.step()
    sd = state.state_dict()
    return ([p.detach().clone() for p in ref.parameters()], [p.detach().clone() for p in model.parameters()],
            [opt.state[p]["exp_avg"].clone() for p in ref.parameters()], [sd["momenta"][i] for i in range(6)],
            state.comm_stats.collectives, sd["steps"])


@pytest.mark.parametrize("world, vote, comm, mdtype, fused", [
    (2, "mavo", "allgather", None, False), (3, "mavo", "pbit", None, False), (3, "avg", "allgather", None, False),
    (2, "mavo", "allgather", torch.bfloat16, False),
    # two collectives per bucket, each bucket on its own group
    (3, "mavo", "1bit", None, False), (4, "mavo", "1bit", None, False), (4, "avg", "1bit", torch.bfloat16, False),
    # the local math in the native loops (fused=True): the same values
    (3, "mavo", "1bit", None, True), (2, "avg", "allgather", None, True)])
def test_ddp_hook_equals_distributed_lion_bitwise(world, vote, comm, mdtype, fused):
    results = spawn(hook_worker, world, vote, comm, mdtype, fused, timeout_s=60)
    for ref, hooked, m_ref, m_hook, calls, steps in results:
        # one collective per bucket (two with 1bit): one bucket in the first step, two after DDP's rebuild
        assert steps == 5 and calls >= (2 if comm == "1bit" else 1) * (1 + 2 * 4)
        for a, b in zip(ref, hooked):
            assert torch.equal(a, b)
        for a, b in zip(m_ref, m_hook):  # each rank's own momentum, the same in both
            assert a.dtype == b.dtype == (mdtype or torch.float32) and torch.equal(a, b)
    for r in results[1:]:
        for a, b in zip(r[1], results[0][1]):
            assert torch.equal(a, b)


def eager_hook_worker(rank, world, vote, comm):
    """hook_worker with the native loops off (``DLION_NATIVE=0``, read by dlion.kernels.available()
    at every call): the hook's eager fp32 path (torch ops) computes every contribution."""
    from dlion import kernels
    from dlion.integrations import ddp as ddp_module

    os.environ["DLION_NATIVE"] = "0"  # this worker process only
    assert not kernels.available()
    calls = {"eager": 0, "native": 0}
    eager, native = ddp_module._eager_contribution, ddp_module._native_contribution

    def counted(name, fn):
        def wrapper(*args):
            out = fn(*args)
            calls[name] += out is not None
            return out
        return wrapper

    ddp_module._eager_contribution = counted("eager", eager)
    ddp_module._native_contribution = counted("native", native)
    return hook_worker(rank, world, vote, comm), calls


@pytest.mark.parametrize("world, vote, comm", [(2, "mavo", "allgather"), (3, "mavo", "1bit")])
def test_ddp_hook_eager_fp32_path_equals_distributed_lion_bitwise(world, vote, comm):
    results = spawn(eager_hook_worker, world, vote, comm, timeout_s=60)
    for (ref, hooked, m_ref, m_hook, calls, steps), used in results:
        # one bucket in the first step, two after DDP's rebuild: 1 + 2·4 contributions, all eager
        assert used == {"eager": 1 + 2 * 4, "native": 0}, used
        assert steps == 5
        for a, b in zip(ref, hooked):
            assert torch.equal(a, b)
        for a, b in zip(m_ref, m_hook):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    for r in results[1:]:
        for a, b in zip(r[0][1], results[0][0][1]):
            assert torch.equal(a, b)


def test_hook_state_rejects_unknown_algorithms_and_caps():
    with pytest.raises(ValueError, match="comm must be one of '1bit', 'allgather', 'pbit'"):
        DLionHookState.__init__(object.__new__(DLionHookState), nn.Linear(2, 2), comm="quantized")
    with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
        DLionHookState.__init__(object.__new__(DLionHookState), nn.Linear(2, 2), bucket_cap_mb=0)


def test_hook_state_refuses_previous_vote_ties():
    with pytest.raises(ValueError, match="ties='previous' is implemented in DistributedLion"):
        DLionHookState.__init__(object.__new__(DLionHookState), nn.Linear(2, 2), ties="previous")
