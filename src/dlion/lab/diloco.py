"""DiLoCo (Douillard et al., arXiv 2311.08105), written out as torchft's ``torchft.local_sgd.DiLoCo``
runs it (one fragment, ``fragment_sync_delay=0``, ``fragment_update_alpha=0``): the ``diloco-*``
methods of ``dlion bench e2e`` and ``dlion bench ttq``. A state object and pure functions, and
:class:`DiLoCo`, the optimizer-shaped wrapper the benchmarks step.

Per round, on every rank (θ: the global parameters, identical on every rank; x_i: rank i's own copy)::

    x_i ← H inner steps from θ             (AdamW or Lion; the inner optimizer's state kept across rounds)
    Δ_i = θ − x_i                          # pseudo-gradient
    Δ   = (Σ_i Δ_i) / N                    # one SUM all_reduce of the flat Δ_i (fp32, or bf16), then ÷ N
    θ   ← SGD(θ, grad Δ; lr = outer_lr, momentum 0.9, Nesterov)   # the outer optimizer, momentum kept
    x_i ← θ

torchft's ``_StreamingDiLoCoFragment`` does the same: ``_save_grads`` (original − local),
``Manager.allreduce`` (SUM, then ``/= num_participants``), ``restore_parameters``, ``p.grad = Δ``,
``outer_optimizer.step()``, ``save_parameters``, and ``lerp_(local, 0)`` (no change);
``tests/test_diloco.py`` checks the two against each other on the same pseudo-gradients.

Bytes: one ring all-reduce of the P parameters per round: 2(N−1)/N × 32 bits per parameter sent
(and as many received) per sync in fp32, 2(N−1)/N × 16 in bf16; per step, that ÷ H.

What differs from torchft: there is no ``Manager`` (no lighthouse, quorum or ``should_commit``:
every rank takes part in every sync, as in every other method of the benchmarks); the pseudo-gradients
go in one flat buffer (torchft's ``use_bucketization`` with a bucket larger than the model) instead
of one all-reduce per parameter: the same bytes in one call; and bf16, which torchft does not offer
(its ``should_quantize`` is fp8, on CUDA): Δ_i is cast to bf16, summed in bf16, cast back, then ÷ N.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dlion.collectives import CommStats, bytes_moved

__all__ = ["DiLoCoState", "make_state", "pseudo_gradients", "average", "outer_step", "sync", "after_inner_step",
           "DiLoCo", "OUTER_LR", "OUTER_MOMENTUM"]

OUTER_LR = 0.7        # DiLoCo's published outer learning rate (Nesterov momentum 0.9)
OUTER_MOMENTUM = 0.9


@dataclass
class DiLoCoState:
    """One rank's DiLoCo state: the model's parameters (x, stepped by the inner optimizer), θ,
    the outer optimizer (over the model's parameters, as in torchft), and the counters."""
    params: list[Tensor]
    original: list[Tensor]
    outer: torch.optim.Optimizer
    sync_every: int
    wire_dtype: torch.dtype = torch.float32
    group: object = None
    inner_steps: int = 0
    syncs: int = 0
    stats: CommStats = field(default_factory=CommStats)


def make_state(params: Iterable[Tensor], *, sync_every: int, outer_lr: float = OUTER_LR,
               wire_dtype: torch.dtype = torch.float32, group=None) -> DiLoCoState:
    """θ ← the parameters now (identical on every rank: the caller's job), and the outer
    ``torch.optim.SGD(lr=outer_lr, momentum=0.9, nesterov=True)`` over them."""
    params = list(params)
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16, got {wire_dtype}")
    outer = torch.optim.SGD(params, lr=outer_lr, momentum=OUTER_MOMENTUM, nesterov=True)
    return DiLoCoState(params, [p.detach().clone() for p in params], outer, sync_every, wire_dtype, group)


def pseudo_gradients(state: DiLoCoState) -> list[Tensor]:
    """Δ_i = θ − x_i, per parameter."""
    return [o - p.detach() for o, p in zip(state.original, state.params)]


def all_reduce_sum(state: DiLoCoState) -> Callable[[Tensor], None]:
    """The default reduction: an in-place SUM all-reduce on ``state.group``, counted in ``state.stats``."""
    def reduce(flat: Tensor) -> None:
        dist.all_reduce(flat, group=state.group)
        moved = bytes_moved("all_reduce", flat.numel() * flat.element_size(), dist.get_world_size(state.group))
        state.stats.add("all_reduce", moved, moved)
    return reduce


def average(deltas: list[Tensor], wire_dtype: torch.dtype, world: int, reduce: Callable[[Tensor], None]) -> list[Tensor]:
    """(Σ_i Δ_i) / N per parameter: the Δ_i flattened into one buffer of ``wire_dtype``, summed in
    place over the ranks by ``reduce``, back in Δ's dtype, ÷ N."""
    flat = torch.cat([d.reshape(-1) for d in deltas]).to(wire_dtype)
    reduce(flat)
    flat = flat.to(deltas[0].dtype)
    flat /= world
    return [v.view_as(d) for v, d in zip(flat.split([d.numel() for d in deltas]), deltas)]


@torch.no_grad()
def outer_step(state: DiLoCoState, avg: list[Tensor]) -> None:
    """x ← θ, the outer optimizer steps x with gradient Δ, θ ← x (so x = θ on every rank)."""
    for p, o, g in zip(state.params, state.original, avg):
        p.copy_(o)
        p.grad = g
    state.outer.step()
    state.outer.zero_grad()
    for p, o in zip(state.params, state.original):
        o.copy_(p)
    state.syncs += 1


def sync(state: DiLoCoState, reduce: Optional[Callable[[Tensor], None]] = None, world: Optional[int] = None) -> None:
    """One outer round: pseudo-gradients, their average, the outer step. ``reduce`` and ``world``
    default to a SUM all-reduce on ``state.group`` and its size."""
    reduce = reduce or all_reduce_sum(state)
    world = world or dist.get_world_size(state.group)
    outer_step(state, average(pseudo_gradients(state), state.wire_dtype, world, reduce))


def after_inner_step(state: DiLoCoState, reduce: Optional[Callable[[Tensor], None]] = None,
                     world: Optional[int] = None) -> bool:
    """Count an inner step; sync after every ``sync_every``-th. True when it synced."""
    state.inner_steps += 1
    if state.inner_steps % state.sync_every:
        return False
    sync(state, reduce, world)
    return True


class DiLoCo:
    """An inner optimizer plus DiLoCo's outer round every ``sync_every`` steps, shaped like a
    ``torch.optim`` optimizer for the benchmarks' loops: ``zero_grad``, ``step``, ``param_groups``
    (the inner optimizer's: an lr schedule schedules the inner lr; the outer lr is constant, as in
    DiLoCo), ``state`` (inner state, outer momentum and θ, for the state-size figures),
    ``comm_stats``, ``check_replicas`` and ``anchored`` (θ)."""

    def __init__(self, params: Iterable[Tensor], inner: torch.optim.Optimizer, *, sync_every: int,
                 outer_lr: float = OUTER_LR, wire_dtype: torch.dtype = torch.float32, group=None):
        self.inner = inner
        self.diloco = make_state(params, sync_every=sync_every, outer_lr=outer_lr, wire_dtype=wire_dtype, group=group)
        self.comm_stats = self.diloco.stats

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        s = self.diloco
        out = {("inner", i): st for i, st in enumerate(self.inner.state.values())}
        out.update({("outer", i): st for i, st in enumerate(s.outer.state.values())})
        out["original"] = {f"p{i}": o for i, o in enumerate(s.original)}
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        after_inner_step(self.diloco)
        return loss

    def flush(self) -> None:
        """Nothing is in flight between steps (the all-reduce is synchronous)."""

    @contextlib.contextmanager
    def anchored(self):
        """Within the block the parameters hold θ (identical on every rank)."""
        s = self.diloco
        saved = [p.detach().clone() for p in s.params]
        try:
            with torch.no_grad():
                for p, o in zip(s.params, s.original):
                    p.copy_(o)
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(s.params, saved):
                    p.copy_(x)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`dlion.DesyncError` unless θ is bitwise identical on every rank."""
        from dlion.replicas import checksum_table, raise_if_diverged

        s = self.diloco
        world = dist.get_world_size(s.group)
        if world == 1:
            return
        row = checksum_table(s.original)
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row, group=s.group)
        raise_if_diverged(torch.stack(rows), s.original, world, "DiLoCo", s.inner_steps)
