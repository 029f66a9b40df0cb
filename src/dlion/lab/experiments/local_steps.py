"""Methods that talk every H steps: N simulated workers with their own parameters.

Every worker i holds its own parameters x_i and its own inner optimizer state, and
takes H local steps on its own batches (its gradients are computed at *its*
parameters: :meth:`Task.per_worker_grads` with the stacked worker copies). After
every H-th step (a *round*; the last round of a run is cut short if H does not
divide the number of steps) the workers agree on new *anchor* parameters A — the
model's own parameters, the ones evaluated — and every x_i ← A. Between rounds the
anchor does not move, so an evaluation inside a round sees the anchor of the last
round.

The worker copies are stacked per parameter as (N, *shape) tensors and one inner
optimizer steps them all: Lion and AdamW are elementwise (AdamW's bias correction
uses the step count, the same on every worker), so this is N independent
optimizers, one per worker, with their states kept across rounds.

``dlocal_mavo:H``  local steps of plain Lion, then a 1-bit majority vote on the
    displacements (:class:`LocalVote`).
``diloco_adamw:H``, ``diloco_lion:H`` (``_bf16``: pseudo-gradients sent in bf16;
    ``:wire=fp8`` / ``:wire=fp4``: a quantised all-reduce, :func:`quantize_rows`)
    DiLoCo (Douillard et al. 2023, arXiv 2311.08105) as ``torchft.local_sgd.DiLoCo``
    runs it: H inner steps, then the mean pseudo-gradient A − x_i steps the anchor
    with an outer SGD with Nesterov momentum (:class:`DiLoCo`).

Bits are what one rank sends per parameter per step, amortised over the run
(syncs × bits per sync / steps), counted from the formula on each class.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from dlion.buckets import layout_buckets
from dlion.lion import Lion
from dlion.local import fragments_ending, split_fragments
from dlion.vote import VoteRule

from .. import float_wire
from .baselines import TRIT_BITS, BitCounter, alltoall_bits, ring_allreduce_bits

__all__ = ["LocalMethod", "LocalVote", "DiLoCo", "vote_round", "local_vote_bits", "diloco_bits", "quantize_rows",
           "WIRE_BITS"]


def local_vote_bits(world_size: int, H: float, ties: str = "zero") -> float:
    """Bits one rank sends per parameter per step for ``dlocal_mavo:H``:

        ( (N−1)/N · 1  +  (N−1)/N · b_down ) / H

    the 1-bit all-to-all of the signs, then the all-gather of the voted chunk (each
    rank sends its 1/N of the result to the N−1 others); b_down = 1 bit where the
    result has no zeros (N odd, or ties broken by a coin), else log2 3 stored as
    5 trits per byte, 8/5 = 1.6 bits. At N = 4: (0.75 + 1.2)/H = 1.95/H."""
    b_down = 1.0 if (world_size % 2 == 1 or ties == "random") else TRIT_BITS
    return (alltoall_bits(1.0, world_size) + alltoall_bits(b_down, world_size)) / H


def diloco_bits(world_size: int, H: float, bits: int = 32) -> float:
    """Bits one rank sends per parameter per step for DiLoCo: a ring all-reduce of the
    pseudo-gradient, 2·(N−1)/N · ``bits`` (32, or 16 for bf16) per sync, / H."""
    return ring_allreduce_bits(1.0, bits, world_size) / H


#: bits per value of DiLoCo's wire formats; fp8 and fp4 add one fp32 scale per row (:func:`quantize_rows`)
WIRE_BITS = {"fp32": 32, "bf16": 16, **float_wire.VALUE_BITS}


def quantize_rows(d: Tensor, wire: str) -> Tensor:
    """``d`` as it arrives after a trip in ``wire`` format, in fp32: ``fp8`` / ``fp4`` row-wise scaled
    (:mod:`dlion.lab.float_wire`: torchft's fp8 E4M3, Streaming DiLoCo's fp4 E3M0); ``fp32``: d
    unchanged; ``bf16``: rounded to bf16."""
    if wire == "fp32":
        return d.float()
    if wire == "bf16":
        return d.to(torch.bfloat16).float()
    if wire not in float_wire.FORMATS:
        raise ValueError(f"wire must be one of {', '.join(WIRE_BITS)}, got {wire!r}")
    return float_wire.roundtrip(d, wire)


def _kept(c: Tensor, threshold: float) -> Tensor:
    """sign(c), 0 where |c| < threshold."""
    s = torch.sign(c)
    return s.mul_(c.abs() >= threshold) if threshold else s


def _signs(d: Tensor, e: Optional[Tensor], threshold: float) -> tuple:
    """Each worker's kept signs of its progress d (N, *S), and with error feedback (``e``, updated in
    place: e ← e + d, then e ← e − mean|e|·s per worker) of e + d, with those means (else None)."""
    if e is None:
        return _kept(d, threshold), None
    e.add_(d)
    s = _kept(e, threshold)
    mag = e.abs().mean(dim=tuple(range(1, e.dim())), keepdim=True) if e.dim() > 1 else e.abs()
    e.sub_(mag * s)
    return s, mag


def _combine(s: Tensor, vote: str, ties: str, generator: Optional[torch.Generator]) -> Tensor:
    """Δ of the workers' signs (N, *S): their mean (``avg``) or the sign of their sum, a tie 0 or a coin."""
    total = s.sum(0)
    delta = total / s.shape[0] if vote == "avg" else torch.sign(total)
    if ties == "random" and vote != "avg":
        coin = torch.randint(0, 2, total.shape, generator=generator).to(total.dtype).mul_(2).sub_(1)
        delta = torch.where(total == 0, coin, delta)
    return delta


def vote_round(anchor: Sequence[Tensor], workers: Sequence[Tensor], errors: Optional[Sequence[Tensor]],
               scale: float, ties: str = "zero", generator: Optional[torch.Generator] = None,
               outer: Optional[tuple] = None, abstain_below: float = 0.0,
               error_scale: Optional[float] = None, soft_outer: bool = False, vote: str = "mavo") -> None:
    """One sync of ``dlocal_mavo``, in place, per parameter tensor (A: shape S, x and e: (N, *S)):

        d_i = A − x_i
        e_i ← e_i + d_i;  s_i = sign(e_i);  e_i ← e_i − mean(|e_i|)·s_i   (``errors`` given: error feedback;
                                                                            the mean over the tensor's
                                                                            elements, before the subtraction)
        s_i = sign(d_i)                                                     (``errors`` None)
        Δ = sign(Σ_i s_i)   (a tie → 0, or ``ties="random"``: a shared ±1 coin from ``generator``)
        A ← A − scale·Δ;    x_i ← A

    ``scale`` = α·S with S the sum of the round's learning rates. A sign of 0 (only where
    e_i, or d_i, is exactly 0) counts as an abstention. ``abstain_below`` = τ·S > 0 (the library's
    ``LocalDistributedLion(abstain_below=τ)``): s_i = 0 also where |e_i| (or |d_i|) < τ·S, before the
    residual update, which then keeps e_i whole there.

    ``outer = (β1, β2, M)`` (an experiment: Lion's own rule on the votes, no extra bits): the step is
    u = sign(β1·M + (1 − β1)·Δ) instead of Δ, then M ← β2·M + (1 − β2)·Δ (M per tensor, identical on
    every rank since Δ is). ``soft_outer`` (an experiment): the step is u = β1·M + (1 − β1)·Δ, no sign,
    so a coordinate whose votes keep flipping moves less than one whose votes agree.

    ``error_scale`` = α (an experiment; needs ``errors``): the step is α·mean_i(mean|e_i|)·Δ per tensor
    instead of ``scale``·Δ: the anchor moves by what the ranks' error feedback assumes they sent
    (one fp32 per tensor per rank more, all-reduced).

    ``vote="avg"``: Δ = (Σ_i s_i)/N, D-Lion's averaging rule (``ties`` does not apply)."""
    for k, (a, x) in enumerate(zip(anchor, workers)):
        s, mag = _signs(a.unsqueeze(0) - x, errors[k] if errors is not None else None, abstain_below)
        step_scale = error_scale * float(mag.mean()) if error_scale is not None and mag is not None else scale
        delta = _combine(s, vote, ties, generator)
        if outer is not None:
            b1, b2, moms = outer
            m = moms[k]
            step = m * b1 + delta * (1.0 - b1)
            if not soft_outer:
                step = torch.sign(step)
            m.mul_(b2).add_(delta * (1.0 - b2))
            delta = step
        a.sub_(delta.mul_(step_scale))
        x.copy_(a.unsqueeze(0).expand_as(x))


#: the lab's votes on the progress's value rather than its sign (:func:`count_round`)
VALUE_VOTES = ("mean", "count")


def packed_bits(levels: int, word: int = 64) -> float:
    """Bits per value when values of ``levels`` levels are packed base-``levels`` into ``word``-bit
    words (as trits go 5 to a byte): word / ⌊word / log2 levels⌋."""
    return word / math.floor(word / math.log2(levels))


def count_round(anchor: Sequence[Tensor], workers: Sequence[Tensor], errors: Optional[Sequence[Tensor]],
                lr_sum: float, H: int, alpha: float, exact: bool = False) -> None:
    """One sync of the value votes (experiments, in place, per tensor; A: shape S, x and e: (N, *S)):

        ``exact`` (``vote=mean``): A ← A − α·mean_i(A − x_i)     (model averaging at α = 1; fp32, a bound)
        else      (``vote=count``): u = S/H, the round's mean lr (one Lion step without decay);
                  e_i ← e_i + (A − x_i);  k_i = clamp(round(e_i / u), −H, H);  e_i ← e_i − u·k_i
                  A ← A − α·u·mean_i k_i

    With momenta reset, H Lion steps move a coordinate by u times an integer count in [−H, H] (give or take
    the decay and the lr's drift in the round), so the count is Lion's progress nearly whole, in
    log2(2H + 1) bits; the error feedback keeps what the rounding dropped. Then every x_i ← A."""
    u = lr_sum / H
    for k, (a, x) in enumerate(zip(anchor, workers)):
        d = a.unsqueeze(0) - x
        if exact:
            step = d.mean(0)
        else:
            e = d if errors is None else errors[k].add_(d)
            q = torch.round(e / u).clamp_(-H, H)
            if errors is not None:
                e.sub_(q * u)
            step = q.mean(0).mul_(u)
        a.sub_(step.mul_(alpha))
        x.copy_(a.unsqueeze(0).expand_as(x))


class LocalMethod:
    """N worker copies of ``params`` (the anchor), an inner optimizer over the stacked
    copies, and a sync every H steps (and after the last step). With ``warmup_steps`` K > 0
    the first K steps run shorter rounds of ``warmup_H`` steps (a round also ends at step K),
    then rounds of H: the library's ``sync_warmup`` is ``warmup_H = 1``."""

    local = True

    def __init__(self, params, world_size: int, H: int, hp: dict, betas: dict, inner: str, total_steps: int,
                 warmup_steps: int = 0, warmup_H: int = 1):
        if H < 1:
            raise ValueError(f"H must be >= 1, got {H}")
        if warmup_steps < 0 or warmup_H < 1:
            raise ValueError(f"warmup_steps must be >= 0 and warmup_H >= 1, got {warmup_steps}, {warmup_H}")
        self.warmup_steps, self.warmup_H = int(warmup_steps), int(warmup_H)
        self.params = list(params)
        self.world_size = world_size
        self.H = int(H)
        self.total_steps = total_steps
        self.base_lr = hp["lr"]
        with torch.no_grad():
            self.workers = [p.detach().unsqueeze(0).repeat(world_size, *([1] * p.dim())).clone()
                            for p in self.params]
        if inner == "lion":
            # fused: the same roundings in the same order as the multi-tensor path (dlion.lion), ~20x faster here
            self.inner = Lion(self.workers, lr=hp["lr"], betas=betas["lion"], weight_decay=hp["weight_decay"],
                              fused=True)
        elif inner == "adamw":
            self.inner = torch.optim.AdamW(self.workers, lr=hp["lr"], betas=betas["adamw"],
                                           weight_decay=hp["weight_decay"])
        else:
            raise ValueError(inner)
        self.bits_counter = BitCounter(sum(p.numel() for p in self.params))
        self.step_count = 0
        self.round_steps = 0
        self.round_lr_sum = 0.0
        self.syncs = 0

    @property
    def worker_params(self) -> list[Tensor]:
        """The stacked worker copies, (N, *p.shape) per parameter: where the gradients are taken."""
        return self.workers

    def step(self, grads, lr_factor: float = 1.0):
        lr = self.base_lr * lr_factor
        for group in self.inner.param_groups:
            group["lr"] = lr
        for w, g in zip(self.workers, grads):
            w.grad = g.to(w.dtype)
        self.inner.step()
        for w in self.workers:
            w.grad = None
        self.step_count += 1
        self.round_steps += 1
        self.round_lr_sum += lr
        self.bits_counter.steps += 1
        self._end_of_step(lr)

    def _end_of_step(self, lr: float) -> None:
        """A sync where a round ends (:class:`LocalVote` with ``streaming``: its own rule)."""
        if self._round_ends():
            with torch.no_grad():
                self.sync()
            self.syncs += 1
            self.round_steps = 0
            self.round_lr_sum = 0.0

    def _round_ends(self) -> bool:
        n, k = self.step_count, self.warmup_steps
        if n == self.total_steps:
            return True
        if n <= k:
            return self.round_steps == self.warmup_H or n == k
        return self.round_steps == self.H

    def sync(self) -> None:
        raise NotImplementedError

    def bits(self) -> dict:
        return {"bits": self.bits_counter.per_param_per_step(), "bits_by_collective": self.bits_counter.breakdown(),
                "bits_axis": "per_rank_sent", "bits_source": "counted (formula)"}

    def record(self) -> dict:
        rec = {"H": self.H, "syncs": self.syncs, "evaluated": "anchor"}
        if self.warmup_steps:
            rec.update(warmup_steps=self.warmup_steps, warmup_H=self.warmup_H)
        return rec


class LocalVote(LocalMethod):
    """``dlocal_mavo:H`` — local Lion steps, then a 1-bit majority vote of the displacements.

    Every worker runs plain Lion (lr η_t = base lr · schedule, decoupled weight decay λ)
    on its own x_i with its own momentum m_i, never reset nor synchronised. After every
    H-th step, with S = Σ η_t over the round's steps, :func:`vote_round` with scale α·S:
    each worker sends sign(e_i) (error feedback on, the default) or sign(A − x_i), the
    anchor moves by −α·S·sign(Σ_i s_i) and every x_i ← A.

    Bits one rank sends per parameter per step (:func:`local_vote_bits`):
    ((N−1)/N · 1 + (N−1)/N · b_down) / H, b_down = 1 (N odd or random ties) or 1.6
    (5 trits per byte). With ``abstain_below`` τ > 0 (abstain where |e_i| < τ·S) the scattered
    abstentions go as base-3 digits both ways, 1.6 bits each (the library's steady state).

    ``streaming`` (the library's ``streaming=True``, and its ``stream_delay``; 0 here, a diagnostic only the
    lab has, applies each round at once: fragments synced in turn without a delay) with ``fragments`` P: the
    parameters in the library's P fragments of buckets (``bucket_mb``, as ``bucket_cap_mb``), fragment
    f's rounds ending ⌊f·H/P⌋ steps after fragment 0's; each round's vote is computed where it ends and
    applied when the next round (of any fragment) ends, or ``stream_delay`` steps on, replacing each
    worker's own progress of that round (:meth:`_apply_pending`, the library's operations in its order).
    After the last step the round in flight is applied, as the library's ``flush()``; the rounds
    unfinished then stay each worker's own (the anchor, evaluated, leaves them out, as ``anchored()`` does). With
    ``momentum_reset``, ``reset_at_apply`` resets the momenta where each vote is applied (the library's
    rule since 2026-11-28), else where its round ends (the rule before). Diagnostics of what the delay
    costs, not in the library: ``stream_delay=0`` (each vote applied at once), ``keep_delay`` K (keep only
    K of the progress made during the delay), ``restart`` (each round starts from the anchor, not from the
    worker's own end point) and ``mix`` M (x ← M·x + (1 − M)·(A' + s), Streaming DiLoCo's merge).

    ``inner="adamw"`` (an experiment, not in the library): each worker runs AdamW (bias-corrected, with its
    own moments) instead of Lion, the rest as above; S sums AdamW's lr, which bounds a step of AdamW
    rather than equals it, so ``error_scale`` (the step sized by the progress itself) is its natural
    partner. ``momentum_reset`` then zeroes AdamW's first moment only."""

    def __init__(self, params, world_size, H, hp, betas, seed, total_steps, *, alpha: float = 1.0,
                 error_feedback: bool = True, ties: str = "zero", outer_betas: tuple = (0.0, 0.0),
                 abstain_below: float = 0.0, error_scale: bool = False, soft_outer: bool = False,
                 vote: str = "mavo", warmup_steps: int = 0, warmup_H: int = 1, momentum_reset: bool = False,
                 streaming: bool = False, fragments: int = 1, bucket_mb: float = 25.0,
                 stream_delay: Optional[int] = None, keep_delay: float = 1.0, restart: bool = False,
                 mix: float = 0.0, reset_at_apply: bool = False, inner: str = "lion"):
        super().__init__(params, world_size, H, hp, betas, inner, total_steps, warmup_steps, warmup_H)
        if fragments != 1 and not streaming:
            raise ValueError("fragments need streaming")
        if stream_delay is not None and (not streaming or stream_delay < 0):
            raise ValueError("stream_delay needs streaming and must be >= 0")
        self.stream_delay, self.keep_delay, self.restart = stream_delay, float(keep_delay), bool(restart)
        self.mix, self.reset_at_apply = float(mix), bool(reset_at_apply)
        if streaming and (outer_betas[0] > 0 or error_scale or soft_outer or abstain_below or warmup_H != 1):
            raise ValueError("streaming takes none of the outer-step experiments, abstain_below or warmup_H != 1")
        self.streaming, self.fragments = bool(streaming), int(fragments)
        if streaming:
            group: dict = {}
            buckets = layout_buckets(self.params, [group] * len(self.params), world_size, bucket_mb,
                                     trainable_only=False)
            if len(buckets) < fragments:
                raise ValueError(f"fragments={fragments} needs at least {fragments} buckets, got {len(buckets)}")
            self.fragment_of = [0] * len(self.params)
            for f, ks in enumerate(split_fragments([b.numel for b in buckets], fragments)):
                for k in ks:
                    for j in buckets[k].indices:
                        self.fragment_of[j] = f
            self.round_start = [w.clone() for w in self.workers]
            self.progress = [torch.zeros_like(w) for w in self.workers]
            self.fragment_lr = [0.0] * fragments
            self.pending: Optional[tuple] = None  # (Δ per parameter index, α·S, the parameter indices)
            self.pending_step = 0
        self.momentum_reset = bool(momentum_reset)
        if vote not in ("mavo", "avg") + VALUE_VOTES:
            raise ValueError(f"vote must be 'mavo', 'avg', 'mean' or 'count', got {vote!r}")
        if vote in VALUE_VOTES and (streaming or outer_betas[0] > 0 or error_scale or abstain_below
                                          or inner != "lion"):
            raise ValueError(f"vote={vote!r} takes no streaming, outer-step experiments, abstain_below "
                             "or AdamW inner")
        self.vote = vote
        if error_scale and not error_feedback:
            raise ValueError("error_scale needs error feedback")
        if soft_outer and not outer_betas[0] > 0:
            raise ValueError("soft_outer needs an outer momentum (outer_betas[0] > 0)")
        self.error_scale, self.soft_outer = bool(error_scale), bool(soft_outer)
        if ties not in ("zero", "random"):
            raise ValueError(f"ties must be 'zero' or 'random', got {ties!r}")
        self.alpha = float(alpha)
        self.ties = ties
        self.errors = [torch.zeros_like(w) for w in self.workers] if error_feedback else None
        self.generator = torch.Generator().manual_seed(seed)
        self.outer_betas = tuple(float(b) for b in outer_betas)
        self.outer_moms = [torch.zeros_like(p) for p in self.params] if self.outer_betas[0] > 0 else None
        self.abstain_below = float(abstain_below)

    def _end_of_step(self, lr: float) -> None:
        if not self.streaming:
            return super()._end_of_step(lr)
        self.fragment_lr = [s + lr for s in self.fragment_lr]
        n = self.step_count
        ending = fragments_ending(n, self.warmup_steps, self.H, self.fragments)
        with torch.no_grad():
            if ending:
                self._stream_round(ending)
                self.syncs += 1
            if (self.stream_delay is not None and self.pending is not None
                    and n - self.pending_step >= self.stream_delay):
                self._apply_pending()  # (0: at once, synchronous fragments, a lab-only diagnostic)
            if n == self.total_steps:
                self._apply_pending()
        self.round_steps, self.round_lr_sum = 0, 0.0

    def _stream_round(self, ending: list) -> None:
        """The rounds of the fragments ``ending`` end: their progress measured, the round in flight
        applied, their vote computed (residuals updated) and left pending."""
        js = [j for j, f in enumerate(self.fragment_of) if f in ending]
        ds = {j: self.round_start[j] - self.workers[j] for j in js}
        self._apply_pending()
        if not self.reset_at_apply:
            self._zero_momenta(js)
        deltas = {}
        for j in js:
            if self.restart:  # the next round starts from the anchor, not from this worker's own end point
                self.workers[j].copy_(self.params[j].unsqueeze(0).expand_as(self.workers[j]))
            self.round_start[j].copy_(self.workers[j])
            self.progress[j].copy_(ds[j]) if not self.restart else self.progress[j].zero_()
            s, _ = _signs(ds[j], self.errors[j] if self.errors is not None else None, 0.0)
            deltas[j] = _combine(s, self.vote, self.ties, self.generator)
        if len({self.fragment_lr[f] for f in ending}) != 1:
            raise RuntimeError("fragments ending together with another S")
        self.pending = (deltas, self.alpha * self.fragment_lr[ending[0]], js)
        self.pending_step = self.step_count
        for f in ending:
            self.fragment_lr[f] = 0.0
        self._count_bits(sum(self.params[j].numel() for j in js))

    def _apply_pending(self) -> None:
        """A' = A − α·S·Δ replaces each worker's own progress d of the round in flight, as the library's
        streamed apply: r ← (r − A) + d, x ← x − A, d ← d + x, x ← A', x ← x + d, r ← r + A'."""
        if self.pending is None:
            return
        deltas, scale, js = self.pending
        for j in js:
            a, x, start, done = self.params[j], self.workers[j], self.round_start[j], self.progress[j]
            start.sub_(a).add_(done)
            x.sub_(a)
            done.add_(x)
            before = x.add(a.unsqueeze(0)) if self.mix else None  # (this worker's parameters before the apply)
            a.sub_(deltas[j].mul_(scale))
            if self.keep_delay != 1.0:  # a diagnostic: keep only this share of the progress since the round ended
                done.mul_(self.keep_delay)
            if self.mix:  # a diagnostic: x ← m·x + (1 − m)·(A' + s), Streaming DiLoCo's merge
                x.copy_(a.unsqueeze(0).expand_as(x)).add_(done).mul_(1 - self.mix).add_(before.mul_(self.mix))
            else:
                x.copy_(a.unsqueeze(0).expand_as(x)).add_(done)
            start.add_(a)
        if self.reset_at_apply:  # the library's rule: the momenta restart where x jumps
            self._zero_momenta(js)
        self.pending = None

    def _zero_momenta(self, js) -> None:
        """``momentum_reset``: the Lion momenta (AdamW: first moments) of the parameters ``js`` back to 0 on every
        worker."""
        if self.momentum_reset:
            for j in js:
                self.inner.state[self.workers[j]]["exp_avg"].zero_()

    def sync(self) -> None:
        if self.vote in VALUE_VOTES:
            count_round(self.params, self.workers, self.errors, self.round_lr_sum, self.round_steps, self.alpha,
                        exact=self.vote == "mean")
            self._zero_momenta(range(len(self.workers)))
            self._count_bits(self.bits_counter.num_params)
            return
        outer = (*self.outer_betas, self.outer_moms) if self.outer_moms is not None else None
        vote_round(self.params, self.workers, self.errors, self.alpha * self.round_lr_sum, self.ties,
                   self.generator, outer, abstain_below=self.abstain_below * self.round_lr_sum,
                   error_scale=self.alpha if self.error_scale else None, soft_outer=self.soft_outer, vote=self.vote)
        self._zero_momenta(range(len(self.workers)))  # at every sync (the library's reset_momentum=True)
        self._count_bits(self.bits_counter.num_params)

    def _count_bits(self, d: int) -> None:
        """The bits of one exchange of ``d`` parameters."""
        N = self.world_size
        if self.vote == "mean":
            self.bits_counter.add("all_reduce fp32", ring_allreduce_bits(d, 32, N))
            return
        if self.vote == "count":  # counts in [−H, H] to their chunk's rank, the sums in [−NH, NH] back
            up, down = packed_bits(2 * self.H + 1), packed_bits(2 * N * self.H + 1)
            self.bits_counter.add(f"all_to_all counts ({up:.3g} bits)", alltoall_bits(d * up, N))
            self.bits_counter.add(f"all_gather sums ({down:.3g} bits)", alltoall_bits(d * down, N))
            return
        b_up = TRIT_BITS if self.abstain_below else 1.0
        # the codes back as the library's rule sends them (MaVo: 1 bit, or base 3 with zeros; Avg: the sum of the signs)
        b_down = VoteRule(self.vote, N, self.ties).result_bits(zeros=bool(self.abstain_below))
        self.bits_counter.add(f"all_to_all signs ({b_up:g} bits)", alltoall_bits(d * b_up, N))
        self.bits_counter.add(f"all_gather vote ({b_down:g} bits)", alltoall_bits(d * b_down, N))
        if self.error_scale:
            self.bits_counter.add("all_reduce scales (fp32 per tensor)", ring_allreduce_bits(len(self.params), 32, N))

    def record(self) -> dict:
        return dict(super().record(), alpha=self.alpha, error_feedback=self.errors is not None, ties=self.ties,
                    outer_betas=list(self.outer_betas), abstain_below=self.abstain_below,
                    error_scale=self.error_scale, soft_outer=self.soft_outer, vote=self.vote,
                    momentum_reset=self.momentum_reset, streaming=self.streaming, fragments=self.fragments,
                    **({"stream_delay": self.stream_delay} if self.stream_delay is not None else {}),
                    **({"reset_at_apply": self.reset_at_apply, "keep_delay": self.keep_delay, "restart": self.restart,
                        "mix": self.mix} if self.streaming else {}))


class DiLoCo(LocalMethod):
    """``diloco_adamw:H`` / ``diloco_lion:H`` (``_bf16``) — DiLoCo as ``torchft.local_sgd.DiLoCo``.

    H inner steps of AdamW or Lion per worker (lr = base lr · schedule, weight decay;
    inner state kept across rounds); then the pseudo-gradient d_i = A − x_i (original
    minus local), its mean over the workers set as A's gradient, one step of
    ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)`` on A (the
    outer lr is constant, not scheduled), and every x_i ← A.

    bf16: each d_i is rounded to bf16 (what a rank would put on the wire), then the N
    rounded values are summed in fp32 and divided by N (a real bf16 ring all-reduce
    would also round its partial sums).

    ``wire="fp8"`` / ``"fp4"``: torchft's quantised all-reduce, whose partial sums are not
    rounded: each rank quantises d_i row-wise (:func:`quantize_rows`), an all-to-all gives
    each rank its 1/N of the rows from every rank, it sums them in fp32 and divides by N,
    quantises that mean again, and an all-gather returns it: mean = Q(Σ_i Q(d_i) / N).

    Bits one rank sends per parameter per step (:func:`diloco_bits`): a ring all-reduce,
    2·(N−1)/N · 32 (or 16) per sync, / H; quantised, the all-to-all and the all-gather send
    the same 2·(N−1)/N · (8 or 4) per value, plus 2·(N−1)/N · 32 per row for the scales."""

    def __init__(self, params, world_size, H, hp, betas, seed, total_steps, *, inner: str, bf16: bool = False,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, wire: Optional[str] = None):
        super().__init__(params, world_size, H, hp, betas, inner, total_steps)
        if wire is not None and (bf16 or wire not in WIRE_BITS):
            raise ValueError(f"wire must be one of {', '.join(WIRE_BITS)} (and not with bf16), got {wire!r}")
        self.wire = wire or ("bf16" if bf16 else "fp32")
        self.bf16 = self.wire == "bf16"
        self.rows = sum(float_wire.rows_of(p[0]).shape[0] for p in self.workers)  # (one fp32 scale each)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.outer = torch.optim.SGD(self.params, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)

    def sync(self) -> None:
        quantised = self.wire in float_wire.FORMATS
        for a, x in zip(self.params, self.workers):
            d = a.detach().unsqueeze(0) - x
            mean = torch.stack([quantize_rows(di, self.wire) for di in d]).sum(0).div_(self.world_size)
            a.grad = (quantize_rows(mean, self.wire) if quantised else mean).to(a.dtype)
        self.outer.step()
        for a, x in zip(self.params, self.workers):
            a.grad = None
            x.copy_(a.detach().unsqueeze(0).expand_as(x))
        d, N = self.bits_counter.num_params, self.world_size
        self.bits_counter.add(f"all_reduce {self.wire}", ring_allreduce_bits(d, WIRE_BITS[self.wire], N))
        if quantised:
            self.bits_counter.add("all_reduce scales", ring_allreduce_bits(self.rows, 32, N))

    def record(self) -> dict:
        return dict(super().record(), outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                    outer_nesterov=self.outer_momentum > 0, pseudo_gradient_dtype=self.wire)

