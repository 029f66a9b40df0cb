"""The optimizer reads lr and weight decay from ``param_groups`` as they are at each step —
also after ``load_state_dict``, which replaces every group dict (torch.optim does; Accelerate
calls it when it prepares an optimizer, and every resume does). An LR scheduler holds the
optimizer and writes into whatever ``opt.param_groups`` is now."""

import pytest
import torch

import dlion
from dlion.lab.spawn import spawn


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))


def worker(rank, world, kind, delay):
    p = torch.zeros(8, requires_grad=True)
    q = torch.ones(8, requires_grad=True)
    groups = [{"params": [p]}, {"params": [q], "weight_decay": 0.5}]
    if kind == "flat":
        opt = dlion.DistributedLion(groups, lr=0.1, weight_decay=0.0, comm="1bit", delay=delay)
    else:
        opt = dlion.HierarchicalDistributedLion(groups, lr=0.1, weight_decay=0.0, mesh=_mesh(), comm="1bit")
    seen = []
    for step in range(3):
        if step == 1:
            opt.load_state_dict(opt.state_dict())  # new group dicts
            for g in opt.param_groups:             # what a scheduler does after the load
                g["lr"] = 0.01
            opt.param_groups[1]["weight_decay"] = 0.0
        p.grad = torch.ones(8)  # every rank votes +1: Δ = +1
        q.grad = torch.ones(8)
        opt.step()
        seen.append((p.detach().clone(), q.detach().clone()))
    opt.flush() if delay else None
    seen.append((p.detach().clone(), q.detach().clone()))
    return seen


def literal(lrs, wds, x0):
    """x ← x·(1 − lr·wd) − lr·1, in float32, once per (lr, wd)."""
    x = torch.full((8,), x0)
    for lr, wd in zip(lrs, wds):
        x = x * (1 - lr * wd) - lr
    return x


@pytest.mark.parametrize("kind,delay", [("flat", 0), ("flat", 1), ("hierarchical", 0)])
def test_lr_and_weight_decay_set_after_load_state_dict_are_used(kind, delay):
    world = 4 if kind == "hierarchical" else 2
    res = spawn(worker, world, kind, delay, timeout_s=60)
    if delay:  # Δ_t is applied at step t + 1 (or by flush) with the lr the group holds then
        want_p = [literal([], [], 0.0), literal([0.01], [0.0], 0.0), literal([0.01] * 2, [0.0] * 2, 0.0),
                  literal([0.01] * 3, [0.0] * 3, 0.0)]
        want_q = [literal([], [], 1.0), literal([0.01], [0.0], 1.0), literal([0.01] * 2, [0.0] * 2, 1.0),
                  literal([0.01] * 3, [0.0] * 3, 1.0)]
    else:
        want_p = [literal([0.1], [0.0], 0.0), literal([0.1, 0.01], [0.0] * 2, 0.0),
                  literal([0.1, 0.01, 0.01], [0.0] * 3, 0.0)]
        want_q = [literal([0.1], [0.5], 1.0), literal([0.1, 0.01], [0.5, 0.0], 1.0),
                  literal([0.1, 0.01, 0.01], [0.5, 0.0, 0.0], 1.0)]
        want_p.append(want_p[-1])
        want_q.append(want_q[-1])
    for rank, seen in enumerate(res):
        for t, ((p, q), wp, wq) in enumerate(zip(seen, want_p, want_q)):
            assert torch.equal(p, wp), (kind, delay, rank, t, p[0].item(), wp[0].item())
            assert torch.equal(q, wq), (kind, delay, rank, t, q[0].item(), wq[0].item())
