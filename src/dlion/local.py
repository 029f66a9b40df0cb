"""Local steps with a 1-bit vote of the ranks' progress every H steps.

Every rank runs H plain Lion steps on its own copy of the parameters with its own
momentum, with no communication; then the ranks agree on one outer update from
their progress over the round, through the same algorithm objects, buckets and
failure flags as every-step :class:`dlion.DistributedLion`. Per round, on rank i
(A: the anchor, the parameters agreed at the last sync, identical on every rank)::

    x_i ← H Lion steps from A (lr η_t, weight decay λ, momentum m_i reset to 0 at each round's
                               start: reset_momentum=True, the default; or kept across rounds)
    S   = Σ η_t over the round's steps                      # identical on every rank
    e_i ← e_i + (A − x_i)                                   # error feedback (e_i = 0 at first)
    s_i = sign(e_i)·[|e_i| ≥ τ·S]                           # 1 bit per coordinate on the wire (τ = 0)
    e_i ← e_i − mean(|e_i|)·s_i                             # per tensor: what the sign kept leaves
    Δ   = rule(s_1 … s_N)                                   # mean (default) or majority vote, as every step
    A   ← A − α·S·Δ ;  x_i ← A                              # identical on every rank

A rank that had no gradient for a parameter during the whole round abstains on it
(sends 0, keeps its residual). With ``abstain_below=τ > 0`` a rank also abstains on the
coordinates it moved less than τ·S (its residual included): where its steps reversed within
the round. A full ±α·S there is what sets training back when the ranks' steps start to
oscillate (docs/results.md, "Why the local vote stalls on some seeds"). Abstentions scattered over a bucket
travel as base-3 digits (1.6 bits instead of 1, each way). Without error feedback s_i = sign(A − x_i) and
e_i stays 0.

With ``streaming=True`` a round's exchange runs behind the next local steps and its vote is applied
later (``stream_delay``); with ``fragments=P`` each of P parts of the model has its own rounds,
ending at staggered steps, so that an exchange of 1/P of the bytes leaves every H/P steps.

Bytes: what one :class:`DistributedLion` step of the same algorithm moves, once per round
(``comm_stats`` counts every step, so ``bits_per_param_per_step`` is the amortised figure): for
``comm="1bit"`` at N = 4, 3/H bits per parameter sent per step with ``vote="avg"`` (the default: 1 bit
up, the sum of 4 signs back in 3 bits, 3/4 of each), and with the majority vote about 1.52/H
(random ties) or 1.96/H (``ties="zero"``: trits back); in fragments, the same per round.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
import struct
import zlib
from typing import Iterable, Optional
import warnings

import torch
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook

from .buckets import Bucket, Contributed, all_finite, apply_codes, finite_flag
from .codec import SignCodec
from .distributed import DistributedLion, FlatBucket, _InFlight, _Step
from .lion import Lion, check_grad
from .quantize import quantize
from .wire import WireState

__all__ = ["LocalDistributedLion"]


_SIGNS = SignCodec()  # (one instance: it caches its lookup tables per device)

#: the options of :class:`DistributedLion` that :class:`LocalDistributedLion` takes as they are
_FORWARDED = ("vote", "ties", "process_group", "comm", "aggregate", "quant_norm", "quant_bits", "bucket_cap_mb", "seed",
              "check_every", "nonfinite", "maximize", "foreach", "momentum_dtype", "fused")
#: and those it refuses, with why
_NOT_APPLICABLE = {
    "overlap": "there is nothing to hide behind backward but one exchange per round (streaming=True hides it "
               "behind the next round).",
    "delay": "streaming=True applies each round's vote one round later (with stream_delay=τ, τ steps later).",
    "momentum_sync": "the momenta are never averaged (each rank's inner Lion keeps its own).",
    "sign_hook": "the vote is on the rounds' progress, not on the signs of a step.",
}


def fragments_ending(n: int, warmup: int, H: int, P: int) -> list[int]:
    """The fragments whose round ends at step n (counted from 1): all during the warm-up, then fragment
    f at the steps with n − warmup ≡ ⌊f·H/P⌋ (mod H), so that each round of H has P exchanges, evenly spread."""
    if n <= warmup:
        return list(range(P))
    return [f for f in range(P) if (n - warmup - f * H // P) % H == 0 and n - warmup >= max(1, f * H // P)]


def split_fragments(sizes: list[int], parts: int) -> list[tuple]:
    """``parts`` contiguous runs of the buckets (``sizes``: their numels), none empty, the largest as
    small as it can be (the smallest cap that a greedy fill, keeping a bucket for each run still to
    open, meets in ``parts`` runs)."""

    def fill(cap: int) -> list[list[int]]:
        runs: list[list[int]] = [[]]
        total = 0
        for i, n in enumerate(sizes):
            if runs[-1] and (total + n > cap or len(sizes) - i <= parts - len(runs)):
                runs.append([])
                total = 0
            runs[-1].append(i)
            total += n
        return runs

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # (more cap never needs more runs)
        mid = (lo + hi) // 2
        if len(fill(mid)) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return [tuple(run) for run in fill(lo)]


@dataclass
class LocalBucket(FlatBucket):
    """A bucket of :class:`LocalDistributedLion`: the flat record, plus the anchor (parameter dtype,
    identical on every rank), this rank's residual (error feedback), which parameters it touched this
    round, and with ``streaming=True`` where its round started and its progress in the round in flight."""

    anchor: Tensor = None
    residual: Tensor = None
    touched: list = None
    round_start: Optional[Tensor] = None
    progress: Optional[Tensor] = None


class LocalDistributedLion(DistributedLion):
    """Distributed Lion that talks every ``sync_every`` steps: H local Lion steps per rank, then a
    1-bit vote of the ranks' progress (module docstring). A drop-in ``torch.optim`` optimizer:
    each rank calls ``loss.backward(); opt.step()`` on its own batch.

    Between syncs the ranks' parameters differ (each holds its own local copy); after every sync
    they are bitwise identical. :meth:`check_replicas`, :func:`dlion.checkpoint.save` and
    :meth:`anchored` see the anchor, so a checkpoint may be taken at any step and resumes bitwise
    (each rank's local parameters, momentum and residual travel in its optimizer state).

    The defaults are the setting measured best for few bits at full quality (docs/results.md, "The
    defaults: H = 32"; G-Lion's loss there): the signs averaged (``vote="avg"``) every 32 steps,
    outer scale 0.83, the momenta reset where each round's step is applied, lr 3e-4: at N = 4
    3 bits per parameter per round, 0.094 per step. Averaged signs want about the lr of every-step
    averaged D-Lion, some 3× the majority vote's: give this lr, not single-worker Lion's, or choose
    ``vote="mavo", sync_every=10, outer_scale=1, reset_momentum=False`` (the defaults of 0.2) for Lion's.

    Args (beyond those of :class:`dlion.Lion`):
        lr: the inner Lion steps' lr; the outer step is α·S with S their sum over the round.
        sync_every: H, the local steps per round (1: every step, yet not every-step D-Lion:
            the vote is on the progress of one step, weight decay included).
        sync_warmup: the first ``sync_warmup`` steps each end a round (H = 1), then rounds of H:
            local steps only after the early phase, as post-local SGD (Lin et al. 2020, arXiv
            1808.07217; PyTorch's ``PostLocalSGDState(start_localSGD_iter=...)``). Early on each
            rank's small-batch Lion can stall where the mean of the ranks' gradients does not
            (docs/results.md, "Why the local vote stalls on some seeds"); each of these steps costs one exchange.
        outer_scale: α, the outer step is α·S·Δ with S the round's summed lr.
        error_feedback: carry what the sign dropped into the next round (module docstring).
        streaming: exchange each round's vote behind the next round and apply it one round later.
        stream_delay: with ``streaming=True``, apply the round in flight after this many steps of the
            next round instead of at its end (Streaming DiLoCo's overlap τ, arXiv 2501.18512): the ranks
            then carry their own unagreed progress for τ steps, not a whole round, and the exchange
            must fit in τ steps of compute to stay hidden. None (default) or τ ≥ H: at the next
            round's end. A round shorter than τ (``sync_warmup``) applies it at its end; with
            ``fragments``, the next exchange (of any fragment) applies it if that comes first.
        fragments: P ≥ 1, with ``streaming=True``: the buckets split into P contiguous fragments of
            about equal size, each with its own rounds of H, fragment f's ending ⌊f·H/P⌋ steps after
            fragment 0's (Streaming DiLoCo's fragments, arXiv 2501.18512): an exchange every H/P
            steps, each of 1/P of the bytes, so that a short ``stream_delay`` still hides it on a
            slow link. Needs at least P buckets (``bucket_cap_mb``); :meth:`fragment_of` tells
            which parameter is in which. 1 (default): the whole model at once.
        reset_momentum: every rank's Lion momentum back to 0 where a round's agreed step is applied
            (at the end of every round; ``streaming=True``: where the round in flight is applied, when
            the next round ends or ``stream_delay`` steps on, not where its exchange leaves: the
            momentum the steps in between build at the point left behind does not carry over), so that
            the local steps from the agreed point start from zero momentum. No bits. Each rank's
            momentum otherwise carries the direction it took in one round into the next, where the ranks
            then disagree more (docs/results.md, "The first syncs, traced"). The rounds of
            ``sync_warmup`` reset too: those steps are sign descent on the gradient. On one rank (no
            rounds: plain Lion) nothing is reset.
        abstain_below: τ ≥ 0; a rank abstains where |e + A − x| < τ·S (module docstring). 0: never.
        vote, ties, process_group, comm, aggregate, quant_norm, quant_bits, bucket_cap_mb, seed,
        check_every, nonfinite, momentum_dtype, fused: as :class:`dlion.DistributedLion`;
        ``aggregate="quantized"`` votes on Lion Cub's quantised residual instead of its sign
        (the residual update stays the sign one); ``check_every`` counts rounds' last steps (with
        ``fragments``, fragment 0's).

    A rank whose gradients are inf/NaN skips its own local step (its parameters and momentum
    stay; ``skipped_steps`` counts it on that rank); with ``nonfinite="raise"`` every rank raises
    at the next sync. An invalid gradient (sparse, integer) is reported the same way: every rank
    raises at the next sync, nothing of the round is applied. Under ``torch.amp.GradScaler`` each
    rank skips its own overflowing steps (its scale is its own: the inner loops are local).
    ``overlap``, ``delay`` and ``momentum_sync`` do not apply (there is nothing to hide
    behind backward but one exchange per round, and the momenta are never averaged).

    Uneven inputs: ``with torch.distributed.algorithms.Join([opt]):`` around the loop. Inside it
    every ``step()`` tells the context manager that this rank still trains (one small all-reduce
    per step, local steps included); a rank that has run out of batches answers each later step
    with a step without gradients: a local step that changes nothing (its lr still counts in the
    round's S), and at the end of the round the exchange, in which it votes on what it did in that
    round before it ran out (its progress from the anchor) and abstains on what it did not touch —
    in every later round on everything. It applies the same outer step, so the anchor and, after
    each sync, the parameters stay bitwise identical on every rank. ``streaming=True`` needs the
    default process group (``process_group=None``) for that.
    """

    def __init__(
        self, params: Iterable, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
        *,
        sync_every: int = 32,
        sync_warmup: int = 0,
        outer_scale: float = 0.83,
        error_feedback: bool = True,
        streaming: bool = False,
        stream_delay: Optional[int] = None,
        fragments: int = 1,
        reset_momentum: bool = True,
        abstain_below: float = 0.0,
        **options,
    ):
        for name in options:  # DistributedLion's options that a round of local steps has no use for
            if name in _NOT_APPLICABLE:
                raise TypeError(f"LocalDistributedLion does not take {name!r}: {_NOT_APPLICABLE[name]}")
            if name not in _FORWARDED:
                raise TypeError(f"LocalDistributedLion got an unexpected keyword argument {name!r}")
        # the averaged vote by default; Lion Cub's quantised aggregation is a majority vote
        options.setdefault("vote", "mavo" if options.get("aggregate", "sign") == "quantized" else "avg")
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(sync_warmup, int) or isinstance(sync_warmup, bool) or sync_warmup < 0:
            raise ValueError(f"sync_warmup must be an int >= 0, got {sync_warmup!r}")
        if (not isinstance(outer_scale, (int, float)) or isinstance(outer_scale, bool)
                or not 0.0 < float(outer_scale) < float("inf")):
            raise ValueError(f"outer_scale must be a number > 0, got {outer_scale!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if not isinstance(streaming, bool):
            raise ValueError(f"streaming must be True or False, got {streaming!r}")
        if stream_delay is not None:
            if not isinstance(stream_delay, int) or isinstance(stream_delay, bool) or stream_delay < 1:
                raise ValueError(f"stream_delay must be None or an int >= 1, got {stream_delay!r}")
            if not streaming:
                raise ValueError("stream_delay applies to streaming=True (the round in flight is applied that many "
                                 "steps into the next round); without streaming each round is applied at its end")
        if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
        if fragments > 1 and not streaming:
            raise ValueError("fragments apply to streaming=True (each fragment's exchange runs behind the local steps "
                             "that follow it); without streaming every exchange blocks, in one piece or in many")
        if fragments > sync_every:
            raise ValueError(f"fragments={fragments} must be <= sync_every={sync_every}: the fragments' rounds end "
                             "at distinct steps of each round of H")
        if not isinstance(reset_momentum, bool):
            raise ValueError(f"reset_momentum must be True or False, got {reset_momentum!r}")
        if (not isinstance(abstain_below, (int, float)) or isinstance(abstain_below, bool)
                or not 0.0 <= float(abstain_below) < float("inf")):
            raise ValueError(f"abstain_below must be a number >= 0, got {abstain_below!r}")
        if abstain_below and options.get("aggregate", "sign") != "sign":
            raise ValueError("abstain_below applies to the sign vote (aggregate='sign'), not to "
                             f"aggregate={options['aggregate']!r}")
        self.sync_every, self.outer_scale, self.error_feedback = sync_every, float(outer_scale), error_feedback
        self.sync_warmup, self.abstain_below = sync_warmup, float(abstain_below)
        self.reset_momentum = reset_momentum
        self.stream_delay, self.fragments = stream_delay, fragments
        self.streaming = streaming  # (read by DistributedLion.__init__: the exchange gets a thread and a group)
        super().__init__(params, lr, betas, weight_decay, **options)
        if self.world_size > 1 and fragments > len(self.buckets):
            raise ValueError(f"fragments={fragments} needs at least {fragments} buckets; the trainable parameters fill "
                             f"{len(self.buckets)} at bucket_cap_mb={options.get('bucket_cap_mb', 25.0)!r}: lower "
                             "bucket_cap_mb (about the model's fp32 MB / fragments)")
        #: per fragment: its buckets (contiguous, of about equal size)
        self._fragment_buckets = split_fragments([b.numel for b in self.buckets], fragments) if self.buckets else []
        self._fragment_of = {k: f for f, ks in enumerate(self._fragment_buckets) for k in ks}
        #: per fragment, per parameter group: S, the lr summed over the fragment's round so far
        self._round_lr = [[0.0] * len(self.param_groups) for _ in range(fragments)]
        #: per parameter group: S of the round being exchanged (its outer step is α·S)
        self._flight_lr = [0.0] * len(self.param_groups)
        #: what the codes of the round being exchanged are divided by: N for vote="avg" (the sum of the ranks'
        #: signs), 1 for the majority vote; a round in flight restored from another world size keeps its N
        self._flight_divisor = self._divisor()
        #: per fragment: an invalid gradient, or a skipped non-finite step, since its round started
        self._round_error: list[Optional[Exception]] = [None] * fragments
        self._round_nonfinite = [False] * fragments
        for s in self._slots:
            b = s.bucket
            s.anchor, s.residual, s.touched = b.flat(b.params[0].dtype), b.flat(), [False] * len(b.params)
            torch._foreach_copy_(b.views(s.anchor), [p.detach() for p in b.params])
            for p, av, ev in zip(b.params, b.views(s.anchor), b.views(s.residual)):
                self.state[p]["anchor"] = av
                self.state[p]["error"] = ev
            if streaming:
                s.round_start, s.progress = s.anchor.clone(), b.flat()
                for p, sv, dv in zip(b.params, b.views(s.round_start), b.views(s.progress)):
                    self.state[p]["round_start"] = sv
                    self.state[p]["progress_in_flight"] = dv

    # -- what differs from every-step D-Lion ----------------------------------------
    _STATE_KIND = "local"
    _bucket_record = LocalBucket

    def _options(self) -> dict:
        return {**super()._options(), "sync_every": self.sync_every, "sync_warmup": self.sync_warmup,
                "outer_scale": self.outer_scale, "abstain_below": self.abstain_below,
                "error_feedback": self.error_feedback, "streaming": self.streaming, "stream_delay": self.stream_delay,
                "fragments": self.fragments, "reset_momentum": self.reset_momentum}

    # the rule's defaults before 0.3, whose checkpoints record no settings
    _DEFAULTS_0_2 = {"vote": "mavo", "sync_every": 10, "outer_scale": 1.0, "reset_momentum": False}

    def _warn_if_options_changed(self, extra: dict) -> None:
        if "options" in extra or extra.get("local") is None:
            return super()._warn_if_options_changed(extra)
        mine = self._options()
        if any(mine[k] != v for k, v in self._DEFAULTS_0_2.items()):
            now = ", ".join(f"{k}={mine[k]!r}" for k in self._DEFAULTS_0_2)
            then = ", ".join(f"{k}={v!r}" for k, v in self._DEFAULTS_0_2.items())
            warnings.warn(f"LocalDistributedLion: this state was saved before dlion 0.3 and records no settings; it "
                          f"continues under this optimizer's ({now}). The defaults of 0.2 were {then}: pass the "
                          "saved run's settings (and its lr) to continue it unchanged.", UserWarning, stacklevel=4)

    def _accepts_kind(self, kind: str) -> bool:
        return kind == "local" or (kind == "flat" and self.world_size == 1)  # (one rank saves no round state)

    def _count_step(self) -> None:
        """The sync does not count a step: every local step already did (:meth:`_tick`)."""

    def _rounds_done(self) -> int:
        """Rounds ended after ``step_count`` steps: one per step of the warm-up, then one per H."""
        n, w = self.step_count, self.sync_warmup
        return n if n <= w else w + (n - w) // self.sync_every

    def _ending(self) -> list[int]:
        """The fragments whose round ends at this step (:func:`fragments_ending`)."""
        return fragments_ending(self.step_count, self.sync_warmup, self.sync_every, self.fragments)

    def fragment_of(self, p: Tensor) -> int:
        """The fragment (0 … fragments − 1) whose exchanges carry parameter ``p`` (0 on one rank)."""
        for k, b in enumerate(self.buckets):
            if any(q is p for q in b.params):
                return self._fragment_of[k]
        if self.world_size == 1 or any(q is p for q in self._params):
            return 0
        raise ValueError("fragment_of: not a parameter of this optimizer")

    def _tick(self) -> None:
        self.step_count += 1
        self.comm_stats.steps += 1

    def _outer_lr(self, group: dict) -> float:
        return self.outer_scale * self._flight_sum(group)

    def _flight_sum(self, group: dict) -> float:
        """S of the round being exchanged, for this parameter group."""
        return self._flight_lr[next(i for i, g in enumerate(self.param_groups) if g is group)]

    def _kept_signs(self, c: Tensor, group: dict) -> Tensor:
        """sign(c), 0 where |c| < τ·S (``abstain_below``)."""
        s = torch.sign(c)
        if self.abstain_below:
            s.mul_(c.abs() >= self.abstain_below * self._flight_sum(group))
        return s

    def _new_wire(self, algorithm) -> WireState:
        """With ``abstain_below`` the abstentions are scattered from the first sync on: the 1-bit
        algorithms start in base 3 both ways instead of sending 1 bit plus zero runs that overflow and
        then the bucket again (they go back to 1 bit as soon as everyone's runs fit)."""
        if self.abstain_below and algorithm.name in ("1bit", "allgather"):
            return WireState(up="ternary", down="ternary")
        return super()._new_wire(algorithm)

    _digested = ("lr, betas, weight_decay, maximize, sync_every, sync_warmup, abstain_below, reset_momentum, "
                 "stream_delay or fragments")

    def _digest(self, group: dict) -> int:
        """The outer step α·S, β, weight decay and the round's options must agree on every rank (e.g. one
        rank's lr schedule ahead, or ``sync_every`` changed on one rank: its rounds end elsewhere;
        ``reset_momentum``, ``stream_delay`` or ``fragments`` changed on one rank: the anchor would stay identical,
        its training would not)."""
        b1, b2 = group["betas"]
        raw = struct.pack("<ddddd?qqd?qq", self._outer_lr(group), float(b1), float(b2), float(group["weight_decay"]),
                          float(group["lr"]), bool(group["maximize"]), int(self.sync_every), int(self.sync_warmup),
                          float(self.abstain_below), bool(self.reset_momentum), int(self.stream_delay or 0),
                          int(self.fragments))
        return zlib.crc32(raw) & 0x7FFFFFFF

    def _input_error(self, k: int) -> Optional[Exception]:
        return self._round_error[self._fragment_of[k]]

    def _local_values(self, k: int) -> Contributed:
        """s = sign(e + A − x) (or Lion Cub's q of it) for the parameters this rank touched; e + A − x
        is kept in the bucket's gradient buffer until the outcome is applied (a failed sync changes nothing)."""
        b, buf = self.buckets[k], self._slots[k].buffers
        present = list(self._slots[k].touched)
        values = buf.values
        values.zero_()
        if not any(present):
            return Contributed(values, present, True)
        c = buf.grad  # this round's progress d (written by _measure_progress), then e + d
        if self.streaming:
            self._slots[k].progress.copy_(c)  # (its own progress, replaced by the agreed step one round later)
        if self.error_feedback:
            c.add_(self._slots[k].residual)
        skipped = self._round_nonfinite[self._fragment_of[k]]
        if c.device.type != "cpu":  # the flag stays on the device, read with the other buckets' (read_flags)
            finite = torch.zeros((), dtype=torch.bool, device=c.device) if skipped else finite_flag(c)
        else:
            finite = all_finite(c) and not skipped
        out = values[:b.numel]
        if self.aggregate == "quantized":
            for j, (o, n) in enumerate(zip(b.offsets, b.sizes)):
                if present[j]:
                    out[o:o + n].copy_(quantize(c[o:o + n], self.quant_levels, self.quant_norm))
        else:
            out.copy_(self._kept_signs(c, b.group))
        for j, ok in enumerate(present):
            if not ok:
                out[b.offsets[j]:b.offsets[j] + b.sizes[j]].zero_()
        if self.streaming:  # the residual now: c is overwritten by the next round before Δ is back
            self._update_residual(k, present)
        if isinstance(finite, Tensor) and self.aggregate != "quantized" and self.sign_hook is None:
            # as buckets.contribute off the CPU: the 1-bit payload, and the zero count read with the flag
            return Contributed(values, present, finite, _SIGNS.encode(values), b.numel - torch.count_nonzero(out))
        return Contributed(values, present, finite)

    def _measure_progress(self, ks, origin: str) -> None:
        """d = origin − x for the buckets ``ks``, in the work dtype, into each one's gradient buffer
        (``origin``: the slot's "anchor" or "round_start")."""
        for k in ks:
            b = self.buckets[k]
            xs = [p.detach() for p in b.params]
            starts = b.views(getattr(self._slots[k], origin))
            if b.low_precision:
                xs, starts = [x.float() for x in xs], [a.float() for a in starts]
            views = self._slots[k].buffers.grad_views
            torch._foreach_copy_(views, starts)
            torch._foreach_sub_(views, xs)

    def _update_residual(self, k: int, present: list[bool]) -> None:
        """e ← c − mean(|c|)·sign(c) per parameter this rank took part with (c = e + d)."""
        b, buf = self.buckets[k], self._slots[k].buffers
        if not self.error_feedback:
            return
        for j, ok in enumerate(present):
            if ok:
                c = buf.grad_views[j]
                b.views(self._slots[k].residual)[j].copy_(c - c.abs().mean() * self._kept_signs(c, b.group))

    def _apply(self, k: int, b: Bucket, o, present: list[bool], borrowed=None) -> None:
        """x ← A − α·S·Δ on the parameters some rank touched (A elsewhere: x = A there already on
        every rank but this one's untouched, unchanged ones), A ← x, and this rank's new residual."""
        buf, group = self._slots[k].buffers, b.group
        ps = [p.detach() for p in b.params]
        if self.streaming:  # keep what this rank did since the round in flight ended: s ← x − A + d,
            # and shift the current round's start alike, r ← r − A + d (then A' + s and A' + r)
            anchor, done, start = (b.views(t) for t in (self._slots[k].anchor, self._slots[k].progress,
                                                        self._slots[k].round_start))
            torch._foreach_sub_(start, anchor)
            torch._foreach_add_(start, done)
            torch._foreach_sub_(ps, anchor)
            torch._foreach_add_(done, ps)  # (d + (x − A): addition commutes bitwise)
        torch._foreach_copy_(ps, b.views(self._slots[k].anchor))
        active = o.has_grad.tolist()
        if any(active):
            apply_codes(b, o.codes, active, buf.work, buf.work_views, self._outer_lr(group), 0.0,
                        self._flight_divisor, fused=group.get("fused", False))
            torch._foreach_copy_(b.views(self._slots[k].anchor), ps)
        last = buf.last_vote
        if last is not None:  # ties="previous": this round's codes break the next round's ties
            if any(active):
                last.copy_(o.codes)
            else:
                last.zero_()
        if self.streaming:  # x ← A + s: the agreed step replaces this rank's own progress of that round
            torch._foreach_add_(ps, b.views(self._slots[k].progress))
            torch._foreach_add_(b.views(self._slots[k].round_start), b.views(self._slots[k].anchor))
            self._zero_momenta([k])  # (where x jumps: momentum built at the left point does not carry over)
        else:
            self._update_residual(k, present)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of data, once per step of the ranks still
        training: a step without gradients (the class docstring). With ``streaming=True`` the round's
        later collectives leave from the exchange thread, which shares no process group with ``Join``'s
        all-reduces only on the default group."""
        if self.streaming and self.process_group is not None and self.world_size > 1:
            raise NotImplementedError(
                "LocalDistributedLion(streaming=True): torch.distributed.algorithms.Join needs process_group=None "
                "(the exchange thread then sends on a process group of its own; on an explicit group its "
                "collectives could interleave with Join's all-reduces in another order on each rank).")
        return super().join_hook(**kwargs)

    # -- the step ----------------------------------------------------------------
    def _local_step(self, closure):
        """World size 1: plain Lion, counted."""
        loss = Lion.step(self, closure)
        self._tick()
        return loss

    def _step_ranks(self, closure):
        """A local step on every rank; after every H of them, the round's exchange."""
        return self._step_and_sync(closure)

    def _step_and_sync(self, closure, skip: bool = False):
        """One local step (``skip``: a GradScaler overflow), then the round's exchange when it ends;
        inside ``Join``, announced first (one all-reduce; nothing in a shadow step or outside Join)."""
        joined = self._announce()
        loss = self._evaluate(closure)
        self._check_frozen()
        self._inner_step(skip=skip)
        self._tick()
        ending = self._ending()
        if ending:
            self._end_round(ending)
        elif self._stream_due():
            self.flush()  # (waits for the exchange if it is still on the wire)
        if joined is not None:
            joined.wait()
        return loss

    def _stream_due(self) -> bool:
        """``stream_delay``: the round in flight has been on the wire for τ steps of this round."""
        flight = self._in_flight
        return (self.stream_delay is not None and flight is not None
                and self.step_count - flight.step_no >= self.stream_delay)

    def _end_round(self, ending: list[int]) -> None:
        if self.streaming:
            self._stream_round(ending)
        else:
            self._sync_round()
        if 0 in ending and self.check_every and self._rounds_done() % self.check_every == 0:
            self.check_replicas()

    def _buckets_of(self, fragments: list[int]) -> tuple:
        return tuple(k for f in fragments for k in self._fragment_buckets[f])

    def _zero_momenta(self, ks) -> None:
        """``reset_momentum``: the next round's local steps start from zero momentum (buckets ``ks``)."""
        if self.reset_momentum:
            for k in ks:
                self._slots[k].buffers.momentum.zero_()

    def _reset_round(self, fragments: list[int]) -> None:
        """The fragments' next round starts: no lr summed, nothing touched, no error recorded."""
        for f in fragments:
            self._round_lr[f] = [0.0] * len(self.param_groups)
            self._round_error[f], self._round_nonfinite[f] = None, False
        for k in self._buckets_of(fragments):
            self._slots[k].touched = [False] * len(self.buckets[k].params)

    def _inner_step(self, skip: bool = False) -> None:
        """One local Lion step on this rank's parameters, unless its gradients are invalid or non-finite."""
        grads = [p.grad for p in self._params if p.grad is not None]
        for i, group in enumerate(self.param_groups):
            for sums in self._round_lr:
                sums[i] += float(group["lr"])
        if None in self._round_error:
            for i, p in enumerate(self._params):
                try:
                    check_grad(i, p)
                except ValueError as e:
                    self._round_error = [e if r is None else r for r in self._round_error]
                    return
        if skip or (grads and not bool(torch.isfinite(torch.stack(
                [torch.stack(torch.aminmax(g.reshape(-1).float())) for g in grads if g.numel()] or
                [torch.zeros(2)])).all())):
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                self._round_nonfinite = [True] * self.fragments
            return
        Lion.step(self)
        for k, b in enumerate(self.buckets):
            t = self._slots[k].touched
            for j, p in enumerate(b.params):
                if p.grad is not None:
                    t[j] = True

    def _sync_round(self) -> None:
        skipped, every = self.skipped_steps, range(len(self.buckets))
        self._flight_lr, self._flight_divisor = list(self._round_lr[0]), self._divisor()
        try:
            self._measure_progress(every, "anchor")
            self._exchange(self.step_count)
        finally:
            self._reset_round([0])
        self._zero_momenta(every)  # (not where the exchange raised: nothing of the round was applied)
        if self.skipped_steps != skipped:
            # (only a non-finite residual gets here): every rank restarts the round from the anchor
            for k, b in enumerate(self.buckets):
                torch._foreach_copy_([p.detach() for p in b.params], b.views(self._slots[k].anchor))
                self._slots[k].residual.nan_to_num_(0.0, 0.0, 0.0)

    def _stream_round(self, ending: list[int]) -> None:
        """Streaming: the progress of the fragments whose round ends is measured, the round in flight
        is applied (its Δ was exchanged since), and these fragments' exchange starts on the exchange thread."""
        ks = self._buckets_of(ending)
        self._measure_progress(ks, "round_start")
        self.flush()
        for k in ks:  # their next round starts here (their momenta reset when this round is applied)
            b = self.buckets[k]
            torch._foreach_copy_(b.views(self._slots[k].round_start), [p.detach() for p in b.params])
        sums = {tuple(self._round_lr[f]) for f in ending}  # (several end together only in the warm-up: equal S)
        if len(sums) != 1:
            raise RuntimeError("LocalDistributedLion: internal error: fragments ending together with another S")
        self._flight_lr, self._flight_divisor = list(sums.pop()), self._divisor()
        st = self._step = _Step(self, ks)
        try:
            for pending in st.pending:
                pending.clear()
            self._issue_ready(self.step_count)
        finally:
            self._step = None
            self._reset_round(ending)
        self._in_flight = _InFlight(self.step_count, st)

    def _finish(self, step_no, st, outcomes) -> None:
        if any(o.nonfinite for o in outcomes) and self.nonfinite == "raise":
            raise FloatingPointError(
                f"LocalDistributedLion: a rank had inf/NaN gradients in the round ending at step {step_no}; "
                "no rank applied the round.")
        check, self.check_every = self.check_every, 0  # (checked per round in _sync)
        try:
            super()._finish(step_no, st, outcomes)
        finally:
            self.check_every = check

    def _scaled_step(self, closure, scaler):
        """Under ``torch.amp.GradScaler``: unscale, and skip this rank's local step on an overflow."""
        record = scaler._per_optimizer_states[id(self)]  # private: pinned by tests/test_misuse.py
        if record["stage"].name == "READY":
            scaler.unscale_(self)
        found = any(bool(f.item()) for f in record["found_inf_per_device"].values())
        if self.world_size == 1:
            if found:
                self.skipped_steps += 1
                self._tick()
                return None
            return self.step(closure)
        return self._step_and_sync(closure, skip=found)

    def _pending_state(self):
        """As :class:`DistributedLion`'s, with the divisor of the round in flight (a round restored from
        another world size keeps the saved ranks' count)."""
        pending = super()._pending_state()
        if pending is not None:
            pending["divisor"] = self._flight_divisor
        return pending

    def _load_pending(self, pending: dict) -> None:
        """Streaming: the round in flight when the state was saved is applied by the next round's end, as
        it would have been; at another world size with ``vote="avg"`` its codes (sums over the saved
        ranks) are divided by the saved count, so the step applied is the one the saved ranks agreed."""
        self._flight_divisor = int(pending["divisor"])
        super()._load_pending({**pending, "divisor": self._divisor()})  # (kept in flight, not applied at once)

    # -- replicas and checkpoints -------------------------------------------------
    @contextlib.contextmanager
    def anchored(self):
        """Within the block the parameters hold the anchor (identical on every rank); this rank's
        local parameters come back afterwards."""
        saved = [[p.detach().clone() for p in b.params] for b in self.buckets]
        outer, self._held_locals = getattr(self, "_held_locals", None), saved  # (state_dict() inside the block)
        try:
            with torch.no_grad():
                for k, b in enumerate(self.buckets):
                    torch._foreach_copy_([p.detach() for p in b.params], b.views(self._slots[k].anchor))
            yield
        finally:
            self._held_locals = outer
            with torch.no_grad():
                for b, xs in zip(self.buckets, saved):
                    torch._foreach_copy_([p.detach() for p in b.params], xs)

    def _replica_view(self):
        """The replica check compares the anchor (the local parameters differ between syncs by design)."""
        return self.anchored()

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if self.world_size > 1:
            ids = {id(p): i for i, p in enumerate(self._params)}
            held = getattr(self, "_held_locals", None)  # inside anchored(): the local parameters it holds back
            for k, b in enumerate(self.buckets):
                for j, p in enumerate(b.params):
                    local = held[k][j] if held is not None else p.detach()
                    sd["state"].setdefault(ids[id(p)], {})["local_param"] = local.clone()
            sd["dlion"]["local"] = {"sync_every": self.sync_every, "sync_warmup": self.sync_warmup,
                                    "round_lr": [list(r) for r in self._round_lr], "fragments": self.fragments,
                                    "flight_lr": list(self._flight_lr), "streaming": self.streaming,
                                    "touched": [list(s.touched) for s in self._slots],
                                    "round_nonfinite": list(self._round_nonfinite)}
        return sd

    def load_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        """As :class:`DistributedLion`, plus the anchor, the residual and this rank's local parameters
        (a state saved at another world size and merged by :func:`dlion.checkpoint.load`'s policy
        continues the round from the merged local parameters)."""
        if self.world_size == 1:
            return super().load_state_dict(state_dict, from_rank=from_rank)
        self.check_state_dict(state_dict, from_rank=from_rank)  # (before reading it)
        extra = state_dict["dlion"]
        saved_fragments = int(extra.get("local", {}).get("fragments", 1))
        if saved_fragments != self.fragments:
            raise ValueError(f"LocalDistributedLion: this state was saved with fragments={saved_fragments}; resume "
                             f"with the same (this optimizer has fragments={self.fragments}: its rounds end elsewhere)")
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved = {}  # before torch.optim casts them to the parameter's dtype
        for p, pid in zip(self._params, ids):
            st = state_dict["state"].get(pid, {})
            saved[id(p)] = {n: st[n] for n in ("anchor", "error", "local_param", "round_start", "progress_in_flight")
                            if isinstance(st.get(n), Tensor)}
        super().load_state_dict(state_dict, from_rank=from_rank)
        with torch.no_grad():
            for k, b in enumerate(self.buckets):
                for p, av, ev in zip(b.params, b.views(self._slots[k].anchor), b.views(self._slots[k].residual)):
                    s = saved.get(id(p), {})
                    if "anchor" in s:
                        av.copy_(s["anchor"].reshape(av.shape))
                    if "error" in s:
                        ev.copy_(s["error"].reshape(ev.shape))
                    else:
                        ev.zero_()
                    if "local_param" in s:
                        p.copy_(s["local_param"].reshape(p.shape))
                    st = self.state[p]
                    st["anchor"], st["error"] = av, ev
                    st.pop("local_param", None)
            for k, b in enumerate(self.buckets if self.streaming else []):
                for p, sv, dv in zip(b.params, b.views(self._slots[k].round_start), b.views(self._slots[k].progress)):
                    s = saved.get(id(p), {})
                    sv.copy_(s["round_start"].reshape(sv.shape) if "round_start" in s else self.state[p]["anchor"])
                    if "progress_in_flight" in s:
                        dv.copy_(s["progress_in_flight"].reshape(dv.shape))
                    else:
                        dv.zero_()
                    self.state[p]["round_start"], self.state[p]["progress_in_flight"] = sv, dv
        local = extra["local"]
        round_lr = local.get("round_lr", [])
        if round_lr and not isinstance(round_lr[0], (list, tuple)):  # (saved before fragments: one round)
            round_lr = [round_lr]
        if [len(r) for r in round_lr] == [len(r) for r in self._round_lr]:
            self._round_lr = [[float(x) for x in r] for r in round_lr]
            self._flight_lr = [float(x) for x in local.get("flight_lr", self._flight_lr)]
        touched = local.get("touched") or []
        if [len(t) for t in touched] == [len(b.params) for b in self.buckets]:
            for s, t in zip(self._slots, touched):
                s.touched = [bool(x) for x in t]
        else:  # another layout: every parameter counts as touched (a zero residual and x = A abstain anyway)
            for s in self._slots:
                s.touched = [True] * len(s.bucket.params)
        flags = local.get("round_nonfinite", False)
        self._round_nonfinite = ([bool(x) for x in flags] if isinstance(flags, (list, tuple)) and
                                 len(flags) == self.fragments else [bool(flags) if not isinstance(flags, (list, tuple))
                                                                    else any(flags)] * self.fragments)
