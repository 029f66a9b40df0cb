"""Shared helpers of the tests that run DistributedLion on several Gloo ranks.

The ranks are forked processes (``dlion.lab.spawn.spawn``), so the functions they run are
module-level functions; tests import them with ``from conftest import ...``.

* ``SHAPES``, ``LR``, ``BETAS``, ``WD``, ``STEPS``: the parameter shapes and hyper-parameters;
* ``init_params(rank)``, ``grads_for(rank, step, dense)``: parameters and per-rank gradients;
* ``configs_worker(rank, world, configs)``: DistributedLion trained on them once per config.
"""

import torch
import torch._dynamo  # noqa: F401  torch.optim imports it lazily (~3 s); once here, not in every forked worker

import dlion

SHAPES = [((6, 5), torch.float32), ((17,), torch.float64), ((4,), torch.float32), ((3, 3), torch.float32),
          ((1,), torch.float32), ((50,), torch.float32), ((100, 50), torch.float32)]
LR, BETAS, WD = 0.01, (0.9, 0.99), 0.1
STEPS = 6


def init_params(rank):
    """The ``SHAPES`` parameters, different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)  # different on every rank: construction must broadcast rank 0's
    return [torch.randn(s, generator=g, dtype=d) for s, d in SHAPES]


def grads_for(rank, step, dense):
    """Rank ``rank``'s gradients at ``step``: a fixed function of both; unless ``dense``, with a
    padding row, dead units, a parameter without gradient anywhere and one with gradients only
    on even ranks."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    grads = [torch.randn(s, generator=g, dtype=d) for s, d in SHAPES]
    if dense:
        return grads
    grads[0][0] = 0.0       # padding row: zero everywhere, every step
    grads[6][10 + rank:13 + rank] = 0.0  # "dead units", partly shared between ranks: zero-run tables
    grads[2] = None         # no gradient on any rank
    if rank % 2:
        grads[3] = None     # gradient only on even ranks
    return grads


def configs_worker(rank, world, configs):
    """Each config of ``configs`` in turn: DistributedLion on this rank's ``init_params``, ``STEPS``
    steps of ``grads_for``; returns the parameters, the comm stats and the bucket layout of each."""
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, vote=cfg["vote"],
                                    ties=cfg.get("ties", "zero"), comm=cfg.get("comm", "1bit"),
                                    momentum_sync=cfg.get("momentum_sync", "none"),
                                    aggregate=cfg.get("aggregate", "sign"), quant_norm=cfg.get("quant_norm", "l1"),
                                    quant_bits=cfg.get("quant_bits", 8),
                                    bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0), seed=5,
                                    momentum_dtype=cfg.get("momentum_dtype"), maximize=cfg.get("maximize", False),
                                    fused=cfg.get("fused", False))
        for t in range(STEPS):
            for p, g in zip(params, grads_for(rank, t, cfg.get("dense", False))):
                p.grad = g
            opt.step()
        out.append(dict(params=[p.detach().clone() for p in params], stats=opt.comm_stats.state_dict(),
                        momenta=[opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else None
                                 for p in params],
                        layout=opt.bucket_layout() if world > 1 else None, algorithms=opt.algorithm_names,
                        steps=[float(opt.state[p]["step"]) if "step" in opt.state[p] else 0.0 for p in params]))
    return out
