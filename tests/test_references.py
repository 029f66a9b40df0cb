"""After ``step()`` returns, no optimizer keeps a reference to the gradients it read.

A gradient the step still holds (directly, or through a reference cycle that only the garbage
collector frees) stays allocated into the next backward: one more gradient-sized block per step,
which on a busy host grew a rank's memory by a third and its step time under CPU contention by
1.2× (docs/benchmarks.md, "The refactor and the step"). The workers run with the collector off,
so a cycle counts as a leak, as it does between two collections in training.
"""

import gc
import weakref

import pytest
import torch

import dlion
from dlion.lab.spawn import spawn

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _make(kind: str, params, world: int):
    if kind.startswith("flat"):
        opts = dict(pair.split("=") for pair in kind.split(":")[1:])
        return dlion.DistributedLion(params, lr=1e-3, comm=opts.get("comm", "1bit"),
                                     overlap=opts.get("overlap") == "1", delay=int(opts.get("delay", 0)),
                                     fused=opts.get("fused") == "1")
    if kind == "hierarchical":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("node", "local"))
        return dlion.HierarchicalDistributedLion(params, lr=1e-3, mesh=mesh)
    if kind.startswith("local"):
        return dlion.LocalDistributedLion(params, lr=1e-3, sync_every=2, streaming=kind.endswith("-st"))
    raise ValueError(kind)


def held_worker(rank, world, kind):
    gc.disable()
    try:
        model = _model()
        opt = _make(kind, model.named_parameters(), world)
        g = torch.Generator().manual_seed(rank)
        alive = []
        for _ in range(STEPS):
            x = torch.randn(16, 64, generator=g)
            model(x).square().mean().backward()
            refs = [weakref.ref(p.grad) for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
            alive.append(sum(r() is not None for r in refs))
        if hasattr(opt, "flush"):
            opt.flush()
        return alive
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", [
    "flat", "flat:fused=1", "flat:comm=allgather", "flat:overlap=1", "flat:delay=1", "flat:delay=1:fused=1",
    "hierarchical", "local", "local-st"])
def test_step_keeps_no_gradient(kind):
    world = 4 if kind == "hierarchical" else 2
    for alive in spawn(held_worker, world, kind, timeout_s=120):
        assert alive == [0] * STEPS, f"{kind}: gradients still referenced after each step: {alive}"
