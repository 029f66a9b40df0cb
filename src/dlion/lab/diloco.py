"""DiLoCo (Douillard et al., arXiv 2311.08105), written out as torchft's ``torchft.local_sgd.DiLoCo``
runs it (one fragment, ``fragment_sync_delay=0``, ``fragment_update_alpha=0``): the ``diloco-*``
methods of ``dlion bench e2e`` and ``dlion bench ttq``. A state object and pure functions, and
:class:`DiLoCo`, the optimizer-shaped wrapper the benchmarks step, which also runs Streaming DiLoCo
(fragments, the exchange overlapped with τ inner steps, α-mixing: ``diloco-*-st``; its docstring).

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

``quantize="fp8"`` or ``"fp4"``: torchft's quantised all-reduce instead
(:mod:`dlion.lab.quantised_allreduce`: row-scaled fp8 E4M3, or Streaming DiLoCo's fp4 E3M0; two
all-to-alls, about 2(N−1)/N × (8 or 4) bits per parameter plus 32 per row). It runs in a thread beside
the inner steps, on a process group of its own (so that no other collective interleaves with it).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dlion.collectives import CommStats, bytes_moved

from . import float_wire
from .quantised_allreduce import quantised_mean

__all__ = ["DiLoCoState", "make_state", "pseudo_gradients", "average", "outer_step", "sync", "after_inner_step",
           "Exchange", "start_average", "finish_average", "split_fragments", "DiLoCo", "OUTER_LR", "OUTER_MOMENTUM"]

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
    quantize: Optional[str] = None
    inner_steps: int = 0
    syncs: int = 0
    stats: CommStats = field(default_factory=CommStats)


def make_state(params: Iterable[Tensor], *, sync_every: int, outer_lr: float = OUTER_LR,
               wire_dtype: torch.dtype = torch.float32, group=None, quantize: Optional[str] = None) -> DiLoCoState:
    """θ ← the parameters now (identical on every rank: the caller's job), and the outer
    ``torch.optim.SGD(lr=outer_lr, momentum=0.9, nesterov=True)`` over them. ``quantize``: None, or
    ``"fp8"`` / ``"fp4"`` for the quantised all-reduce (with ``wire_dtype`` fp32)."""
    params = list(params)
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    if wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16, got {wire_dtype}")
    if quantize is not None and (quantize not in float_wire.FORMATS or wire_dtype != torch.float32):
        raise ValueError(f"quantize must be None or one of {', '.join(float_wire.FORMATS)} (with wire_dtype "
                         f"torch.float32), got {quantize!r}")
    outer = torch.optim.SGD(params, lr=outer_lr, momentum=OUTER_MOMENTUM, nesterov=True)
    return DiLoCoState(params, [p.detach().clone() for p in params], outer, sync_every, wire_dtype, group, quantize)


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
    return finish_average(Exchange(deltas, flat), world)


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
    if state.quantize:
        outer_step(state, quantised_mean(pseudo_gradients(state), state.quantize, state.group, state.stats))
        return
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


@dataclass
class Exchange:
    """An average in flight (Streaming DiLoCo): the fragment's Δ_i, the flat ``wire_dtype`` buffer its
    SUM all-reduce works on in place, and the work to wait for (None: a reduction already done); for the
    quantised all-reduce no buffer, and ``result``, the mean, once the work (its thread) is done."""
    deltas: list[Tensor]
    flat: Optional[Tensor]
    work: object = None
    result: Optional[list] = None


class _Thread:
    """A quantised all-reduce running beside the inner steps; ``wait`` joins it (and raises its error)."""

    def __init__(self, ex: Exchange, state: DiLoCoState):
        self.error: Optional[BaseException] = None

        def run():
            try:
                ex.result = quantised_mean(ex.deltas, state.quantize, state.group, state.stats)
            except BaseException as e:  # (raised again in the caller's thread, at wait)
                self.error = e
        self.thread = threading.Thread(target=run, name="diloco-quantised-exchange", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def start_average(state: DiLoCoState, deltas: list[Tensor],
                  reduce: Optional[Callable[[Tensor], object]] = None) -> Exchange:
    """Start Σ_i Δ_i: the Δ_i flattened into one ``wire_dtype`` buffer and reduced in place by
    ``reduce`` (returns a work to wait for, or None); default an asynchronous SUM all-reduce on
    ``state.group``, counted in ``state.stats``. Quantised (``state.quantize``): the quantised all-reduce
    in a thread."""
    if state.quantize:
        ex = Exchange(deltas, None)
        ex.work = _Thread(ex, state)
        return ex
    flat = torch.cat([d.reshape(-1) for d in deltas]).to(state.wire_dtype)
    if reduce is None:
        work = dist.all_reduce(flat, group=state.group, async_op=True)
        moved = bytes_moved("all_reduce", flat.numel() * flat.element_size(), dist.get_world_size(state.group))
        state.stats.add("all_reduce", moved, moved)
    else:
        work = reduce(flat)
    return Exchange(deltas, flat, work)


def finish_average(ex: Exchange, world: int) -> list[Tensor]:
    """Wait for the exchange (if in flight); (Σ_i Δ_i) / N per parameter, back in Δ's dtype."""
    if ex.work is not None:
        ex.work.wait()
    if ex.flat is None:  # (the quantised all-reduce: its mean)
        return [r.to(d.dtype) for r, d in zip(ex.result, ex.deltas)]
    flat = ex.flat.to(ex.deltas[0].dtype)
    flat /= world
    return [v.view_as(d) for v, d in zip(flat.split([d.numel() for d in ex.deltas]), ex.deltas)]


def split_fragments(params: list[Tensor], fragments: int) -> list[list[Tensor]]:
    """The parameters in ``fragments`` contiguous runs of about equal size (a parameter is never split):
    fragment f ends at the first parameter whose running count of elements reaches (f + 1)/P of the total."""
    if not isinstance(fragments, int) or isinstance(fragments, bool) or not 1 <= fragments <= len(params):
        raise ValueError(f"fragments must be an int from 1 to the number of parameters ({len(params)}), "
                         f"got {fragments!r}")
    total, out, run, seen = sum(p.numel() for p in params), [], [], 0
    for i, p in enumerate(params):
        run.append(p)
        seen += p.numel()
        left_params, left_frags = len(params) - i - 1, fragments - len(out) - 1
        if left_frags and (seen * fragments >= total * (len(out) + 1) or left_params == left_frags):
            out.append(run)
            run = []
    out.append(run)
    return out


class DiLoCo:
    """An inner optimizer plus DiLoCo's outer round every ``sync_every`` steps, shaped like a
    ``torch.optim`` optimizer for the benchmarks' loops: ``zero_grad``, ``step``, ``param_groups``
    (the inner optimizer's: an lr schedule schedules the inner lr; the outer lr is constant, as in
    DiLoCo), ``state`` (inner state, outer momentum and θ, for the state-size figures),
    ``comm_stats``, ``check_replicas`` and ``anchored`` (θ).

    **Streaming DiLoCo** (Douillard et al., arXiv 2501.18512) as torchft's ``DiLoCo`` runs it with
    ``model_fragments`` (one outer Nesterov SGD per fragment), ``fragment_sync_delay=sync_delay`` and
    ``fragment_update_alpha=update_alpha``: the parameters in ``fragments`` = P contiguous runs
    (:func:`split_fragments`); every H/P steps one fragment, in turn, ends its round. τ = ``sync_delay``
    steps before that end, its Δ_i = θ_f − x_f is taken and its all-reduce started; the inner steps go on
    while it travels; at the end: x_f ← θ_f, the outer step with the average, θ_f ← x_f, and then
    x_f ← (1 − α)·θ_f + α·(x_f as it was just before), so α = 0 drops the τ steps of local progress
    the exchange overlapped. Each fragment still syncs every H steps; the bytes per H steps are one
    all-reduce of the whole model, as without fragments. P = 1, τ = 0: DiLoCo above, bitwise."""

    def __init__(self, params: Iterable[Tensor], inner: torch.optim.Optimizer, *, sync_every: int,
                 outer_lr: float = OUTER_LR, wire_dtype: torch.dtype = torch.float32, group=None,
                 quantize: Optional[str] = None, fragments: int = 1, sync_delay: int = 0, update_alpha: float = 0.0,
                 reduce: Optional[Callable[[Tensor], object]] = None, world: Optional[int] = None):
        params = list(params)
        if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
        if isinstance(sync_every, int) and not isinstance(sync_every, bool) and sync_every % fragments:
            raise ValueError(f"sync_every ({sync_every}) must be a multiple of fragments ({fragments}), as in torchft")
        if not isinstance(sync_delay, int) or isinstance(sync_delay, bool) or sync_delay < 0:
            raise ValueError(f"sync_delay must be an int >= 0, got {sync_delay!r}")
        if isinstance(sync_every, int) and sync_delay >= max(sync_every // fragments, 1):
            raise ValueError(f"sync_delay ({sync_delay}) must be < sync_every / fragments "
                             f"({sync_every} / {fragments}): a fragment is synced before its next exchange starts")
        if not 0.0 <= update_alpha <= 1.0:
            raise ValueError(f"update_alpha must be between 0 and 1, got {update_alpha!r}")
        self.inner = inner
        if quantize is not None and dist.is_initialized():
            # a group of its own: no other collective may interleave with the exchange's thread
            group = dist.new_group(dist.get_process_group_ranks(group) if group is not None else None)
        self.fragments = [make_state(run, sync_every=sync_every, outer_lr=outer_lr, wire_dtype=wire_dtype, group=group,
                                     quantize=quantize) for run in split_fragments(params, fragments)]
        self.comm_stats = self.fragments[0].stats
        for s in self.fragments:
            s.stats = self.comm_stats  # (one count for the model)
        self.sync_every, self.sync_delay, self.update_alpha = sync_every, sync_delay, update_alpha
        self._reduce, self._world = reduce, world
        self._local_step, self._syncs, self._steps = 0, 0, 0  # steps since the last sync; syncs (all fragments); steps
        self._flight: Optional[Exchange] = None

    @property
    def outer_lr(self) -> float:
        return self.fragments[0].outer.param_groups[0]["lr"]

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        out = {("inner", i): st for i, st in enumerate(self.inner.state.values())}
        k = 0
        for s in self.fragments:
            for st in s.outer.state.values():
                out[("outer", k)] = st
                k += 1
        out["original"] = {f"p{i}": o for i, o in enumerate(o for s in self.fragments for o in s.original)}
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self._after_inner_step()
        return loss

    def _after_inner_step(self) -> None:
        """torchft's schedule: fragment (syncs mod P) starts its exchange τ steps before the end of
        every H/P steps and ends its round at that end."""
        per = self.sync_every // len(self.fragments)
        self._local_step += 1
        s = self.fragments[self._syncs % len(self.fragments)]
        self._steps += 1
        if self._local_step == per - self.sync_delay:
            self._flight = start_average(s, pseudo_gradients(s), self._reduce)
        if self._local_step < per:
            return
        flight, self._flight = self._flight, None
        avg = finish_average(flight, self._world or dist.get_world_size(s.group))
        local = [p.detach().clone() for p in s.params] if self.update_alpha else None
        outer_step(s, avg)
        if local is not None:
            with torch.no_grad():
                for p, x in zip(s.params, local):
                    p.lerp_(x, self.update_alpha)
        self._local_step = 0
        self._syncs += 1

    def flush(self) -> None:
        """Wait for an exchange in flight (streaming; it is applied at its step as always)."""
        if self._flight is not None and self._flight.work is not None:
            self._flight.work.wait()

    @contextlib.contextmanager
    def anchored(self):
        """Within the block the parameters hold θ (identical on every rank)."""
        pairs = [(p, o) for s in self.fragments for p, o in zip(s.params, s.original)]
        saved = [p.detach().clone() for p, _ in pairs]
        try:
            with torch.no_grad():
                for p, o in pairs:
                    p.copy_(o)
            yield
        finally:
            with torch.no_grad():
                for (p, _), x in zip(pairs, saved):
                    p.copy_(x)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`dlion.DesyncError` unless θ is bitwise identical on every rank."""
        from dlion.replicas import checksum_table, raise_if_diverged

        s = self.fragments[0]
        world = dist.get_world_size(s.group)
        if world == 1:
            return
        theta = [o for f in self.fragments for o in f.original]
        row = checksum_table(theta)
        rows = [torch.empty_like(row) for _ in range(world)]
        dist.all_gather(rows, row, group=s.group)
        raise_if_diverged(torch.stack(rows), theta, world, "DiLoCo", self._steps)
