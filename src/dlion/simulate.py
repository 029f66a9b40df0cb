"""N Distributed-Lion workers in one process, for convergence sweeps up to N = 32.

Parameters are identical on every worker, so one copy is kept; each logical
worker has its own momentum and feeds its own gradients. Each step runs the
same code as :class:`dlion.DistributedLion` — the bucket layout and Lion math of
:mod:`dlion.buckets`, the algorithm objects of :mod:`dlion.wire` (wire
formats, votes, format switches) — with the collectives replaced by
:func:`dlion.collectives.simulate_collective`, so for the same gradients it gives
bitwise the same parameters as N real ranks, and ``comm_stats`` counts exactly
the bytes one real rank moves.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .vote import VoteRule, coin_key
from .wire import Contribution, WireState, choose_algorithm, make_algorithm, read_heads, run_compacted
from .buckets import (LeftOut, RankBuffers, Scratch, apply_codes, contribute, layout_buckets, read_flags,
                      update_momentum)
from .collectives import CommStats, simulate_collective
from .base import check_options, momentum_sync_due
from .lion import check_hyperparameters, check_momentum_dtype, check_params
from .quantize import levels

__all__ = ["SimulatedDistributedLion"]


class SimulatedDistributedLion:
    """Distributed Lion over ``world_size`` simulated workers.

    ``step(grads)`` takes ``grads[i][k]``: worker i's gradient of parameter k
    (``None`` = no gradient on that worker). Arguments mean what they mean for
    :class:`dlion.DistributedLion`; ``sign_hooks[i]`` (optional) is worker i's
    fault-injection hook. Single parameter group (one lr / weight decay).
    """

    def __init__(self, params: Sequence[Tensor], world_size: int, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 vote: str = "mavo", ties: str = "zero", comm: str = "1bit", aggregate: str = "sign",
                 quant_norm: str = "l1", quant_bits: int = 8, momentum_sync: Union[str, int] = "none",
                 bucket_cap_mb: Union[float, Sequence[float]] = 25.0, seed: int = 0, momentum_dtype: Optional[torch.dtype] = None,
                 sign_hooks: Optional[Sequence[Optional[Callable[[int, Tensor], Tensor]]]] = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        check_hyperparameters(lr, betas, weight_decay)
        self.params = list(params)
        check_params(self.params)
        self.rule = VoteRule(vote, world_size, ties=ties, seed=seed)
        check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb, 0, "skip",
                      None if sign_hooks is None else (sign_hooks if any(sign_hooks) else None))
        if sign_hooks is not None and len(sign_hooks) != world_size:
            raise ValueError(f"sign_hooks has {len(sign_hooks)} entries for {world_size} workers")
        self.world_size, self.lr, self.betas, self.weight_decay = world_size, lr, tuple(betas), weight_decay
        self.aggregate, self.quant_norm, self.momentum_sync, self.seed = aggregate, quant_norm, momentum_sync, seed
        self.quant_levels = levels(quant_bits, world_size) if aggregate == "quantized" else 0
        self.sign_hooks = list(sign_hooks) if sign_hooks is not None else [None] * world_size
        self.group = dict(lr=lr, betas=self.betas, weight_decay=weight_decay, maximize=False, foreach=False)
        self.buckets = layout_buckets(self.params, [self.group] * len(self.params), world_size, bucket_cap_mb,
                                      trainable_only=False)
        if aggregate == "quantized":
            self.algorithms = [make_algorithm("quantized", self.rule, self.quant_levels) for _ in self.buckets]
        else:
            self.algorithms = [make_algorithm(choose_algorithm(b.padded, len(b.params), self.rule)
                                              if comm == "auto" else comm, self.rule) for b in self.buckets]
        up = ["narrow" if a.name == "pbit" else "runs" for a in self.algorithms]
        self.wire = [[WireState(up=u) for _ in range(world_size)] for u in up]  # one per bucket per worker
        # as DistributedLion: parameters no worker had a gradient for last step are left out of the payload
        self.left_out = [LeftOut(b) for b in self.buckets]
        check_momentum_dtype(momentum_dtype)
        self.buffers = [[RankBuffers(b, momentum_dtype) for b in self.buckets] for _ in range(world_size)]
        self.updates = [b.flat() for b in self.buckets]
        # ties="previous": the last applied codes per bucket (the same on every worker: one copy)
        keeps = ties == "previous" and vote == "mavo" and aggregate == "sign"
        self.last_votes = [torch.zeros(b.padded, dtype=torch.int8, device=b.device) if keeps else None
                           for b in self.buckets]
        self.update_views = [b.views(u) for b, u in zip(self.buckets, self.updates)]
        self.scratch = Scratch()
        self.comm_stats = CommStats()
        self.step_count = 0
        self.num_params = sum(p.numel() for p in self.params)

    @property
    def momenta(self) -> list[list[Tensor]]:
        """momenta[i][k]: worker i's momentum of parameter k (views into its buffers)."""
        out = []
        for bufs in self.buffers:
            views = {}
            for b, buf in zip(self.buckets, bufs):
                views.update(zip(b.indices, buf.momentum_views))
            out.append([views.get(k) for k in range(len(self.params))])
        return out

    @torch.no_grad()
    def step(self, grads: Sequence[Sequence[Optional[Tensor]]]) -> None:
        N = self.world_size
        if len(grads) != N or any(len(g) != len(self.params) for g in grads):
            raise ValueError(f"step() needs grads[worker][param] for {N} workers × {len(self.params)} parameters")
        for i in range(N):
            for k, g in enumerate(grads[i]):
                if g is not None and g.shape != self.params[k].shape:
                    raise ValueError(f"gradient for parameter {k} has shape {tuple(g.shape)}, "
                                     f"expected {tuple(self.params[k].shape)}")
        step = self.step_count
        quant = (self.quant_levels, self.quant_norm) if self.aggregate == "quantized" else None
        # every bucket's contributions first (as the buckets of a real step are all issued before any is
        # waited for): off the CPU, their finiteness flags and zero counts are then read in one go
        made = []
        for kb, b in enumerate(self.buckets):
            made.append([])
            for i in range(N):
                m = contribute(b, self.buffers[i][kb], [grads[i][k] for k in b.indices], self.scratch,
                               beta1=self.betas[0], maximize=False, quant=quant, borrow=True, defer=True)
                if self.sign_hooks[i] is not None:
                    m.values[:b.numel] = self.sign_hooks[i](step, m.values[:b.numel].clone())
                made[kb].append(m)
        read_flags([m for ms in made for m in ms])
        runs, presents, borroweds = [], [], []
        for kb, b in enumerate(self.buckets):
            gens = []
            for i, m in enumerate(made[kb]):
                own = self.sign_hooks[i] is None  # (a hook changes the values: no payload of contribute's then)
                contrib = Contribution(m.values, b.numel, torch.tensor(m.present, dtype=torch.bool), 0, 0,
                                       sizes=b.sizes, previous=self.last_votes[kb], packed=m.packed if own else None,
                                       zeros=m.zeros if own else None)
                gens.append(run_compacted(self.algorithms[kb], self.wire[kb][i], contrib, i,
                                          coin_key(self.seed, step, kb), self.left_out[kb].skip,
                                          self.left_out[kb].kept))
            runs.append(gens)
            presents.append([m.present for m in made[kb]])
            borroweds.append([m.borrowed for m in made[kb]])
        outcomes = _lockstep_all(runs, self.comm_stats)
        for kb, outcome in enumerate(outcomes):
            self.left_out[kb].update(outcome.has_grad)
        for kb, (b, outcome, present, borrowed) in enumerate(zip(self.buckets, outcomes, presents, borroweds)):
            active = outcome.has_grad.tolist()
            if any(active):
                apply_codes(b, outcome.codes, active, self.updates[kb], self.update_views[kb], self.lr,
                            self.weight_decay, N if self.rule.vote == "avg" else 1)  # as DistributedLion applies it
            last = self.last_votes[kb]
            if last is not None and any(active):
                last.copy_(outcome.codes)
            elif last is not None:
                last.zero_()
            for i in range(N):
                if any(present[i]):
                    update_momentum(b, self.buffers[i][kb], present[i], self.betas[1], self.scratch,
                                    borrowed=borrowed[i])
        self.step_count += 1
        self.comm_stats.steps += 1
        if step == 0:  # DistributedLion's one-time check for identical gradients: 16 bytes per bucket and rank
            simulate_collective("all_gather", [torch.zeros(4 * len(self.buckets), dtype=torch.int32)] * N,
                                self.comm_stats, "check")
        if momentum_sync_due(self.momentum_sync, self.step_count):
            self.synchronize_momenta()

    def synchronize_momenta(self) -> None:
        """Every worker's momentum becomes the fp32 mean of all of them (one all-reduce per bucket)."""
        for kb in range(len(self.buckets)):
            flats = [self.buffers[i][kb].momentum.float() for i in range(self.world_size)]
            mean = simulate_collective("all_reduce", flats, self.comm_stats, "momentum_sync")[0]
            mean.div_(self.world_size)
            for i in range(self.world_size):
                self.buffers[i][kb].momentum.copy_(mean)


def _lockstep(gens: list, stats: CommStats):
    """Run every worker's algorithm generator, one collective at a time; return worker 0's outcome
    (all workers reach the same one)."""
    return _lockstep_all([gens], stats)[0]


def _lockstep_all(runs: list, stats: CommStats) -> list:
    """Run every bucket's workers' algorithm generators (``runs[bucket][worker]``); return worker 0's
    outcome per bucket (all workers reach the same one)."""
    done = lockstep_buckets(runs, stats)
    # with the chunked 1-bit all-reduce each worker decided its own chunk (together, every
    # coordinate once); where every worker decides every coordinate, the counts are N times
    # as large and the fractions the same
    stats.add_tallies([o.tally for outs in done for o in outs if o.tally is not None])
    return [outs[0] for outs in done]


def lockstep_outcomes(gens: list, stats: CommStats, on_collective: Optional[Callable] = None) -> list:
    """Every worker's outcome of its algorithm generator, the collectives simulated one at a time;
    ``on_collective(kind, worker 0's input)`` sees each of them."""
    return lockstep_buckets([gens], stats, on_collective)[0]


def lockstep_buckets(runs: list, stats: CommStats, on_collective: Optional[Callable] = None) -> list:
    """:func:`lockstep_outcomes` for several buckets (``runs[bucket][worker]``), advanced together one
    collective per bucket at a time, as a real step's buckets are all in flight together: the headers
    that the algorithms read on the host (off the CPU) are read for every bucket and worker of a
    round at once (:func:`dlion.wire.read_heads`). Every bucket's outcomes, per worker."""
    ops = [[next(g) for g in gens] for gens in runs]
    results: list = [None] * len(runs)
    while True:
        live = [kb for kb in range(len(runs)) if results[kb] is None]
        if not live:
            return results
        outs = {}
        for kb in live:
            kind, _, label = ops[kb][0]
            if any(op[0] != kind for op in ops[kb]):
                raise AssertionError("simulated workers disagree on the next collective")
            if on_collective is not None:
                on_collective(kind, ops[kb][0][1])
            outs[kb] = simulate_collective(kind, [op[1] for op in ops[kb]], stats, label)
        heads = [(kb, i) for kb in live for i, op in enumerate(ops[kb])
                 if getattr(op, "head", None) is not None and outs[kb][i].device.type != "cpu"]
        for (kb, i), got in zip(heads, read_heads([(outs[kb][i], ops[kb][i].head) for kb, i in heads])):
            outs[kb][i] = got
        for kb in live:
            done, nxt = [], []
            for g, out in zip(runs[kb], outs[kb]):
                try:
                    nxt.append(g.send(out))
                except StopIteration as stop:
                    done.append(stop.value)
            if done:
                if nxt:
                    raise AssertionError("simulated workers disagree on the number of collectives")
                results[kb] = done
            ops[kb] = nxt
