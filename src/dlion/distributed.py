"""Distributed Lion (Liu et al. 2024, arXiv 2404.00438) with Lion Cub's communication
(Ishikawa et al. 2024, arXiv 2411.16462).

Every rank runs Lion with its own momentum and sends only the sign of its update;
all ranks apply one aggregated Δ. Per step, on every rank i::

    δ_i = sign(β1·m_i + (1 − β1)·g_i)          # local, never leaves as floats
    Δ   = rule(δ_1 … δ_N)                      # collective: majority vote or mean
    x   ← x·(1 − η·λ) − η·Δ                    # identical on every rank
    m_i ← β2·m_i + (1 − β2)·g_i                # local momentum, never synchronised

Data flow of :meth:`DistributedLion.step`, per bucket (:mod:`dlion.buckets`):

1. *contribute*: gradients → the bucket's flat buffer → c → δ (int8), plus a header
   (status, hyperparameter digest, which parameters have gradients, zero runs);
2. *exchange*: the bucket's algorithm (:mod:`dlion.wire`) issues its
   collectives asynchronously — the header rides inside the first one, so no
   rank waits for a separate agreement round — and returns the same codes and
   flags on every rank;
3. *apply*: Δ from the codes, x·(1 − η·λ) − η·Δ for every parameter some rank had
   a gradient for, then the local momentum update;
4. optionally average momenta (Lion Cub) and compare replicas.

A step issues, per bucket, the algorithm's collectives (``1bit``: one
``all_to_all`` and one ``all_gather``; ``allgather``/``pbit``/``quantized``: one),
all with ``async_op=True``; a bucket is re-sent once in base 3 only when some
rank's abstentions stop fitting the run table. The first collective of every bucket is
issued before any is waited on. With ``overlap=True`` a bucket's contribution
and first collective start from gradient hooks as soon as backward has produced
its last gradient (off the CPU without reading anything on the host: the header's
status is completed on the device, :func:`dlion.wire._device_headers`), and, on
the default group, its later collectives go on a second process group so that
ranks never disagree on the order of collectives; an exchange thread issues them
as soon as they can go (:mod:`dlion.pipeline`).

With ``delay=1`` step t's Δ is applied in step t + 1, so its exchange runs
(on the exchange thread) during step t + 1's forward and backward; the local
momentum update happens at once, since c of the next step needs it::

    x_{t+1} = x_t·(1 − η·λ) − η·Δ_{t−1}        # Δ_t is still on the wire
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook
from torch.profiler import record_function

from .base import BucketState, DistributedBase, momentum_sync_due
from .buckets import (Bucket, Contributed, LeftOut, RankBuffers, Scratch, apply_codes, apply_signs, contribute, layout_buckets,
                      read_flags, rebind_groups, update_momentum)
from .collectives import GroupTransport
from .pipeline import Flight, Pipeline
from .replicas import average_momenta, bits_checksum
from .vote import coin_key
from .wire import BAD, NONFINITE, Contribution, Outcome, run_compacted

__all__ = ["DistributedLion"]


@dataclass
class FlatBucket(BucketState):
    """A bucket of :class:`DistributedLion`: the shared record, plus which parameters the next step
    leaves out of the payload (no gradient on any rank last step) and the per-parameter step
    counters (``state[p]["step"]`` are views of ``steps``)."""

    left_out: LeftOut = None
    steps: Tensor = None


@dataclass
class _InFlight:
    """``delay=1``: the step whose Δ is not applied yet — its number, its exchange, and its
    outcomes once the exchange has completed (None before)."""

    step_no: int
    step: object
    outcomes: Optional[list] = None


class _Step:
    """The buckets of one step (``ks``: those it exchanges, in bucket order; default all): which are
    issued, which are done. Per-bucket lists are indexed by bucket; ``issued`` and ``applied`` count
    positions in ``ks``."""

    def __init__(self, opt: "DistributedLion", ks: Optional[tuple] = None):
        self.ks = tuple(range(len(opt.buckets))) if ks is None else tuple(ks)
        self.pipeline = Pipeline(len(self.ks), opt._first, opt._second,
                                 threaded=opt._threaded,
                                 device=opt.buckets[0].device if opt.buckets else None)
        self.present: list = [None] * len(opt.buckets)
        # this rank's gradients of bucket k were all finite (a 0-d device tensor where a hook left the flag
        # unread: only delay=1 reads these, and it has no hooks)
        self.finite: list = [False] * len(opt.buckets)
        self.errors: list = [None] * len(opt.buckets)
        #: per bucket: the gradients its contribution read in place, for the momentum update (dropped
        #: with the step, so a skipped or failed step holds no reference to them)
        self.borrowed: list = [None] * len(opt.buckets)
        self.pending = [set(range(len(b.params))) for b in opt.buckets]
        self.seen: set = set()
        self.issued = 0    # buckets ks[0] … ks[issued−1] have their first collective in flight
        self.stale = False  # a gradient was accumulated again after its bucket was sent
        #: per bucket, once its first collective is read: may every rank apply (no failure flag)?
        self.flags_ok: list = [True if k not in self.ks else None for k in range(len(opt.buckets))]
        self.applied = 0    # buckets ks[0] … ks[applied−1] are applied (step() only, in bucket order)

    def read_flags(self, k: int, out: Outcome) -> None:
        """Bucket k's failure flags are known (``Contribution.on_flags``; the exchange thread may call it)."""
        self.flags_ok[k] = not out.failed


class _Settled:
    """A step restored from a checkpoint whose Δ is not applied yet (``delay=1``, or a streamed round
    of the buckets ``ks``); ``present`` per bucket."""

    def __init__(self, present: list, ks: tuple):
        self.present, self.errors, self.applied, self.ks = present, [None] * len(present), 0, ks
        self.borrowed = [None] * len(present)


class DistributedLion(DistributedBase):
    """Distributed Lion: a drop-in ``torch.optim.Optimizer`` for data-parallel training.

    Use it *instead of* DDP's gradient all-reduce: each rank calls
    ``loss.backward(); opt.step()`` on its own batch. Parameters are broadcast
    from rank 0 at construction and stay bitwise identical on every rank.

    Args:
        vote: ``"mavo"`` (majority vote, Δ = sign Σδ) or ``"avg"`` (Δ = mean δ).
        ties: ``"zero"`` (a tie gives Δ = 0), ``"random"`` (a shared coin) or
            ``"previous"`` (the coordinate's last Δ, a coin where that was 0; see
            :mod:`dlion.vote`). Only even vote counts tie; ``"random"`` and
            ``"previous"`` keep MaVo's way back at 1 bit.
        process_group: the group to aggregate over (default: the world).
        comm: collective algorithm for sign aggregation: ``"1bit"`` (all-to-all
            + all-gather), ``"allgather"`` (naive), ``"pbit"`` (packed-counter
            all-reduce) or ``"auto"`` (per bucket, see
            :func:`dlion.wire.choose_algorithm`). All give the same Δ.
        aggregate: ``"sign"`` (vote on δ) or ``"quantized"`` (Lion Cub: Δ =
            sign Σ q_i of quantised c, see :mod:`dlion.quantize`; needs ``vote="mavo"``).
        quant_norm, quant_bits: the scale (``"l1"``, ``"linf"``, ``"l0"``) and field
            width (2, 4 or 8) of quantised aggregation.
        momentum_sync: ``"none"``, an int K (average momenta in fp32 every K
            steps) or ``"doubling"`` (after steps 1, 2, 4, 8, …).
        overlap: start each bucket's local math and first collective from gradient
            hooks during backward. Use :meth:`no_sync` for all but the last
            micro-batch when accumulating gradients: a backward outside it sends the
            buckets, and a further backward before ``step()`` makes ``step()`` finish
            and drop that exchange and send the accumulated gradients again (the result
            of plain ``torch.optim``, at the cost of one wasted exchange). Every rank
            must run the same backwards between steps (as with DDP).
        bucket_cap_mb: bucket size, counted as fp32 parameters like DDP; or a list of caps,
            the first, second, … bucket's, the last repeating (``[1, 6]``: a small first
            bucket whose collectives leave early in backward, like DDP's first bucket).
        seed: seeds the tie coins (``ties="random"`` or ``"previous"``).
        check_every: every K steps compare a checksum of every parameter across
            ranks and raise :class:`DesyncError` naming the first that differs.
        nonfinite: a rank whose gradients contain inf/NaN makes every rank
            ``"skip"`` the step (counted in ``skipped_steps``) or ``"raise"``.
        sign_hook: ``sign_hook(step, delta) -> delta`` transforms this rank's int8
            signs of one bucket before they are sent (fault injection).
        momentum_dtype: storage dtype of the momenta (default: fp32 for bf16/fp16
            parameters, else the parameter's). ``torch.bfloat16`` halves the optimizer
            state; the math still runs in fp32 and the new momentum is rounded once.
        fused: CPU parameters only: the local Lion math of each bucket (c, its sign,
            the finiteness check; the update from the codes; the momentum update) as
            native loops over all its tensors at once (:mod:`dlion.kernels`), the same
            roundings, two to three times fewer passes over memory. Construction loads
            the library (building it on first use: under a second, once per machine and
            cache; needs a C compiler) on every rank; where any rank cannot, every rank
            raises the same error.
        delay: ``0`` (default) or ``1``: apply each step's Δ one step later, so that its
            communication runs during the next step's forward and backward instead of
            being waited for (one step of staleness, as in delayed gradient averaging).
            ``step()`` applies the previous step's Δ, then sends this one; each rank updates
            its momentum at once. Call :meth:`flush` after the last step (and before
            evaluating, if the last Δ matters). ``state_dict()`` carries the Δ not yet applied, so a
            checkpoint neither loses nor applies it early, and nothing but ``step()`` and
            :meth:`flush` applies it (checkpoints and replica checks do not change the
            trajectory). ``step_count`` counts applied steps. A
            step skipped for inf/NaN gradients leaves parameters unchanged on every rank, as
            without delay, but the ranks with finite gradients have already updated their
            momenta. Needs ``overlap=False`` (the whole exchange overlaps the next step
            already) and no ``GradScaler``. Collectives of your own on ``process_group``
            during a step are safe only on the default group (``process_group=None``),
            where the exchange thread uses a group of its own. The staleness is not free: on
            a small-batch 4-rank MaVo workload it slowed convergence badly (docs/benchmarks.md);
            check convergence on yours.

    Uneven inputs (one rank runs out of batches first): wrap the training loop in
    ``with torch.distributed.algorithms.Join([opt]):`` (``overlap=False``, ``delay=0``); a rank
    that has left the loop answers every later step as an abstainer (no gradient on any
    parameter) until every rank is done, so nothing hangs and the replicas stay identical.

    Parameters with ``requires_grad=False`` are never communicated and get no
    momentum. A parameter whose ``.grad`` is ``None`` on some ranks abstains there;
    one with no gradient on any rank is left untouched (no decay), like ``torch.optim``,
    and left out of the next step's payload (:func:`dlion.wire.run_compacted`).
    Without an initialised process group, or with world size 1, it is exactly
    :class:`dlion.Lion`. ``comm_stats`` counts this rank's bytes per step.
    """

    def __init__(
        self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
        *,
        vote: str = "mavo",
        ties: str = "zero",
        process_group=None,
        comm: str = "auto",
        aggregate: str = "sign",
        quant_norm: str = "l1",
        quant_bits: int = 8,
        momentum_sync: Union[str, int] = "none",
        overlap: bool = False,
        bucket_cap_mb: Union[float, Sequence[float]] = 25.0,
        seed: int = 0,
        check_every: int = 0,
        nonfinite: str = "skip",
        sign_hook: Optional[Callable[[int, Tensor], Tensor]] = None,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        momentum_dtype: Optional[torch.dtype] = None,
        fused: bool = False,
        delay: int = 0,
    ):
        if delay not in (0, 1) or isinstance(delay, bool):
            raise ValueError(f"delay must be 0 or 1, got {delay!r}")
        if delay and overlap:
            raise ValueError("delay=1 already overlaps each step's whole exchange with the next forward and "
                             "backward; it cannot be combined with overlap=True's gradient hooks.")
        super().__init__(params, lr, betas, weight_decay, vote=vote, ties=ties, comm=comm, aggregate=aggregate,
                         quant_norm=quant_norm, quant_bits=quant_bits, momentum_sync=momentum_sync,
                         bucket_cap_mb=bucket_cap_mb, seed=seed, check_every=check_every, nonfinite=nonfinite,
                         sign_hook=sign_hook, maximize=maximize, foreach=foreach, momentum_dtype=momentum_dtype,
                         fused=fused)
        distributed = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._groups = [process_group]
        self.overlap, self.sign_hook, self.delay = overlap, sign_hook, delay
        self._keeps_last_vote = ties == "previous" and vote == "mavo" and aggregate == "sign"
        #: the exchange runs on a thread of its own (overlap, delay, or a subclass that streams)
        self._threaded = overlap or bool(delay) or bool(getattr(self, "streaming", False))
        self._sync = True
        self._step: Optional[_Step] = None
        #: delay=1: the step not yet applied
        self._in_flight: Optional[_InFlight] = None
        self._hooks: list = []
        self._start(voters=self.world_size)
        if self.world_size > 1:
            self.buckets = layout_buckets(self._params, [g for g in self.param_groups for _ in g["params"]],
                                          self.world_size, bucket_cap_mb)
            self._scratch = Scratch()
            for b in self.buckets:
                algorithm = self._make_algorithm(b.padded, len(b.params))
                self._slots.append(self._bucket_record(b, RankBuffers(b, momentum_dtype), algorithm, self._new_wire(algorithm),
                                              left_out=LeftOut(b), steps=torch.zeros(len(b.params))))
            # Optimizer state as views of per-bucket flat tensors: momenta and step counters.
            for s in self._slots:
                for j, (p, m) in enumerate(zip(s.bucket.params, s.buffers.momentum_views)):
                    self.state[p]["exp_avg"] = m
                    self.state[p]["step"] = s.steps[j]
                if self._keeps_last_vote:  # ties="previous": the last applied Δ, identical on every rank
                    s.buffers.keep_last_vote(s.bucket)
                    for p, v in zip(s.bucket.params, s.buffers.last_vote_views):
                        self.state[p]["last_vote"] = v
            self._first = GroupTransport(process_group, self.comm_stats)
            # Hooks issue first collectives during backward; the later ones of each bucket go on a
            # second group, in bucket order, so the two streams can never interleave differently.
            second = dist.new_group(backend=None) if (self._threaded and process_group is None) else None
            self._second = GroupTransport(second, self.comm_stats) if second is not None else self._first
            if overlap:
                self._register_hooks()
        self._laid_out()

    #: the record of a bucket (a subclass extends it)
    _bucket_record = FlatBucket

    def _options(self) -> dict:
        return {**super()._options(), "overlap": self.overlap, "delay": self.delay}

    def _all_gather_rows(self, row: Tensor) -> Tensor:
        work, everyone = self._first.issue("all_gather", row, "check")
        work.wait()
        return everyone

    # -- step 1: this rank's contribution -----------------------------------------
    def _local_values(self, k: int) -> Contributed:
        """This rank's int8 values for bucket k (δ = sign(β1·m + (1 − β1)·g), or Lion Cub's q), which
        parameters take part, whether every value was finite, and what the momentum update will read
        (:class:`dlion.buckets.Contributed`; off the CPU the finiteness flag and the zero count may stay
        on the device: the caller reads them, with other buckets', by :func:`dlion.buckets.read_flags`):
        what a subclass changes to vote
        on something else (:class:`dlion.LocalDistributedLion` votes on its local progress)."""
        b, buf, group = self.buckets[k], self._slots[k].buffers, self.buckets[k].group
        quant = (self.quant_levels, self.quant_norm) if self.aggregate == "quantized" else None
        return contribute(b, buf, [p.grad for p in b.params], self._scratch, beta1=group["betas"][0],
                          maximize=group["maximize"], quant=quant, borrow=True, fused=group.get("fused", False),
                          defer=True)

    def _input_error(self, k: int) -> Optional[Exception]:
        """The first invalid gradient of bucket k on this rank (sent as BAD: every rank raises), or None."""
        return self._grad_error(self.buckets[k])

    def _contribution(self, k: int, step: int, error: Optional[Exception], made: Optional[Contributed]) -> Contribution:
        """Bucket k's :class:`Contribution` from its invalid gradient ``error`` or what :meth:`_local_values`
        made: its flags read (:func:`dlion.buckets.read_flags`), or still on the device, where the
        algorithm builds the header from them (:attr:`dlion.wire.Contribution.finite`; no ``sign_hook``)."""
        b, buf = self.buckets[k], self._slots[k].buffers
        status, group = 0, b.group
        packed = zeros = on_device = None
        if error is None:
            values, present, finite = made.values, made.present, made.finite
            self._step.borrowed[k] = made.borrowed
            if self.sign_hook is None:  # (a hook changes the values: no payload of contribute's then)
                packed, zeros = made.packed, made.zeros
            if isinstance(finite, Tensor):  # not read: NONFINITE is set on the device, in the header
                on_device = finite
            elif not finite:
                status |= NONFINITE
            self._step.finite[k] = finite
            if self.sign_hook is not None:
                try:
                    values[:b.numel] = _checked_hook_output(self.sign_hook(step, values[:b.numel].clone()), b.numel)
                except ValueError as e:  # like a bad gradient: every rank stops together
                    error = e
        if error is not None:
            buf.values.zero_()
            present = [False] * len(b.params)
            status |= BAD
        self._step.present[k] = present
        self._step.errors[k] = error
        if error is not None:
            packed = zeros = on_device = None
        return Contribution(buf.values, b.numel, torch.tensor(present, dtype=torch.bool), status,
                            self._digest(group), sizes=b.sizes, on_flags=functools.partial(self._step.read_flags, k),
                            previous=buf.last_vote, packed=packed, zeros=zeros, finite=on_device)

    def _issue_ready(self, step_no: int, in_hook: bool = False) -> None:
        """Start, in bucket order, every bucket whose gradients are all there. On the CPU each bucket's
        collective leaves as soon as its contribution is made; off the CPU every ready bucket's
        contribution is made first and their flags are read in one host synchronisation
        (:func:`dlion.buckets.read_flags`) — except from a gradient hook (``in_hook``, no ``sign_hook``):
        there nothing is read, each bucket leaves at once and its algorithm builds the header from the
        flags on the device (:func:`dlion.wire._device_headers`), so backward never waits for the device."""
        st = self._step
        ready, unread = [], False
        defer = in_hook and self.sign_hook is None  # (a sign hook's output is checked on the host)
        while st.issued + len(ready) < len(st.ks) and not st.pending[st.ks[st.issued + len(ready)]]:
            k = st.ks[st.issued + len(ready)]
            with record_function("dlion.contribute"):
                error = self._input_error(k)
                made = self._local_values(k) if error is None else None
            ready.append((k, error, made))
            unread = unread or (made is not None and isinstance(made.finite, Tensor) and not defer)
            if not unread:  # nothing left on a device to read (or nothing to be read): this bucket leaves now
                self._issue(*ready.pop(), step_no)
        read_flags([made for _, _, made in ready if made is not None])
        for k, error, made in ready:
            self._issue(k, error, made, step_no)

    def _issue(self, k: int, error: Optional[Exception], made: Optional[Contributed], step_no: int) -> None:
        """Bucket k's first collective (the step's buckets before it issued already)."""
        st = self._step
        with record_function("dlion.contribute"):
            contrib = self._contribution(k, step_no, error, made)
        with record_function("dlion.exchange"):
            slot = self._slots[k]
            left_out = slot.left_out
            gen = run_compacted(slot.algorithm, slot.wire, contrib, self.rank,
                                coin_key(self.seed, step_no, k), left_out.skip, left_out.kept)
            st.pipeline.add(Flight(gen, self._first))
        st.issued += 1

    # -- the step ---------------------------------------------------------------
    #: ``torch.amp.GradScaler.step(opt)`` hands itself to ``step`` (``grad_scaler=``): the gradients are
    #: unscaled here and the scaler's inf/NaN record becomes the decision of *all* ranks, so every rank
    #: skips together and the scales stay identical.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        if grad_scaler is not None:
            return self._scaled_step(closure, grad_scaler)
        if self.world_size == 1:
            self._refuse_late_process_group()
            return self._local_step(closure)
        return self._step_ranks(closure)

    def _step_ranks(self, closure):
        """A step of several ranks: contribute, exchange, apply (:class:`dlion.LocalDistributedLion`
        runs a local step instead, and a round's exchange after every H of them)."""
        # Inside torch.distributed.algorithms.Join: say "still training" (one all-reduce on the
        # process group, before this step's collectives; nothing outside a Join context)
        joined = self._announce()
        loss = self._evaluate(closure)
        self._check_frozen()
        if self.delay:
            return self._delayed_step(loss)
        step_no = self.step_count
        if self._step is not None and self._step.stale:
            # Another backward accumulated into gradients already sent (overlap=True without no_sync):
            # like torch.optim, step with the accumulated .grad — finish and drop the exchange, send again.
            self._discard_in_flight()
        self._exchange(step_no)
        if joined is not None:
            joined.wait()
        return loss

    # -- uneven inputs: torch.distributed.algorithms.Join ---------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of data, once per step of the ranks still
        training: a step without gradients (:meth:`_shadow_step`). Needs ``overlap=False`` and ``delay=0``."""
        if self.overlap or self.delay:
            raise NotImplementedError(
                f"{type(self).__name__}: torch.distributed.algorithms.Join needs overlap=False and delay=0 (with "
                "overlap=True a bucket's collectives start during backward, before step() can tell Join that this "
                "rank is still training; with delay=1 the exchange runs on a thread of its own).")
        return super().join_hook(**kwargs)

    def _exchange(self, step_no: int) -> None:
        """Contribute every bucket not yet issued, run the collectives, apply Δ (or raise on every rank)."""
        if self._step is None:
            self._step = _Step(self)
        st = self._step
        for pending in st.pending:  # buckets whose hooks did not all fire (unused parameters, no overlap)
            pending.clear()
        self._issue_ready(step_no)
        with record_function("dlion.exchange"):
            outcomes = st.pipeline.finish(progress=lambda: self._apply_finished(st))
        self.comm_stats.wait_s += st.pipeline.blocked
        self._step = None
        with record_function("dlion.apply"):
            self._finish(step_no, st, outcomes)

    def _delayed_step(self, loss):
        """delay=1: apply the step in flight (its exchange ran during this forward and backward),
        then contribute this one and leave its exchange to the exchange thread."""
        self.flush()
        step_no = self.step_count
        st = self._step = _Step(self)
        try:
            for pending in st.pending:
                pending.clear()
            self._issue_ready(step_no)
            if all(st.finite) and not any(e is not None for e in st.errors):
                # c of the next step needs this step's g in m, before Δ is known (non-finite: this rank
                # skips its momentum update, and every rank will skip Δ)
                for k, (b, buf) in enumerate((s.bucket, s.buffers) for s in self._slots):
                    if any(st.present[k]):
                        update_momentum(b, buf, st.present[k], b.group["betas"][1], self._scratch,
                                        fused=b.group.get("fused", False), borrowed=st.borrowed[k])
        finally:
            self._step = None
            st.borrowed = [None] * len(self.buckets)  # (the step stays in flight: it must not hold the gradients)
        self._in_flight = _InFlight(step_no, st)
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """``delay=1``: wait for the step in flight and apply its Δ on every rank (all ranks
        must call it at the same point). Call it after the last ``step()``; nothing to do
        without ``delay`` or when no step is in flight."""
        if self._in_flight is None:
            return
        self.settle()
        flight, self._in_flight = self._in_flight, None
        with record_function("dlion.apply"):
            self._finish(flight.step_no, flight.step, flight.outcomes)

    @property
    def in_flight_step(self) -> Optional[int]:
        """The step number whose exchange is still on the wire (``delay=1``, or a streamed round), or None."""
        flight = self._in_flight
        return flight.step_no if flight is not None and flight.outcomes is None else None

    def settle(self) -> None:
        """``delay=1`` (or a streamed round): wait until the exchange in flight has completed, without
        applying its Δ (``flush`` applies it). Nothing to do when no exchange is on the wire."""
        flight = self._in_flight
        if flight is None or flight.outcomes is not None:
            return
        with record_function("dlion.exchange"):
            flight.outcomes = flight.step.pipeline.finish()
        self.comm_stats.wait_s += flight.step.pipeline.blocked

    def _divisor(self) -> int:
        """What the codes of a step are divided by: the ranks' count for the mean of their signs, else 1."""
        return self.world_size if self.rule.vote == "avg" else 1

    def _pending_state(self) -> Optional[dict]:
        """The settled step not yet applied (delay=1), per parameter, so that a checkpoint taken
        between two steps loses nothing and resumes on any bucket layout: its codes (parameter
        shape; None where no rank had a gradient; only the parameters of the buckets it exchanged),
        whether it is skipped, and the vote's divisor."""
        if self._in_flight is None:
            return None
        self.settle()
        step_no, st, outcomes = self._in_flight.step_no, self._in_flight.step, self._in_flight.outcomes
        if any(e is not None for e in st.errors) or any(o.bad or not o.digests_agree for o in outcomes):
            self.flush()  # raises on every rank, as the next step() would
        codes, has_grad = {}, {}
        for b, o in zip((self.buckets[k] for k in st.ks), outcomes):
            for j, (i, off, n) in enumerate(zip(b.indices, b.offsets, b.sizes)):
                has_grad[i] = bool(o.has_grad[j])
                if has_grad[i] and o.codes is not None:
                    codes[i] = o.codes[off:off + n].view(b.params[j].shape).cpu().clone()
        return {"step": step_no, "skip": any(o.nonfinite for o in outcomes), "codes": codes, "has_grad": has_grad,
                "divisor": self._divisor()}

    def _load_pending(self, pending: dict) -> None:
        """Restore a saved :meth:`_pending_state`: with the same layout and divisor, as the step the
        next ``step()`` applies (bitwise the run that never stopped); otherwise (a resize) applied now."""
        step_no, codes = int(pending["step"]), pending["codes"]
        divisor = int(pending["divisor"])
        saved = set(pending["has_grad"])  # the parameters of the buckets it exchanged
        ks = tuple(k for k, b in enumerate(self.buckets) if saved & set(b.indices))
        if any(not set(self.buckets[k].indices) <= saved for k in ks):
            raise ValueError("the exchange in flight in this checkpoint covers part of a bucket only (it was saved "
                             "with another bucket layout); resume with the bucket_cap_mb it was saved with.")
        outcomes = []
        for b in (self.buckets[k] for k in ks):
            has = [bool(pending["has_grad"].get(i, False)) for i in b.indices]
            full = None
            if any(codes.get(i) is not None for i in b.indices) and not pending["skip"]:
                dtype = next(codes[i].dtype for i in b.indices if codes.get(i) is not None)
                full = torch.zeros(b.padded, dtype=dtype, device=b.device)
                for i, off, n, h in zip(b.indices, b.offsets, b.sizes, has):
                    if h and codes.get(i) is not None:
                        full[off:off + n] = codes[i].reshape(-1).to(b.device)
            outcomes.append(Outcome(full, torch.tensor(has, dtype=torch.bool),
                                    nonfinite=int(bool(pending["skip"]))))
        present = [[False] * len(b.params) for b in self.buckets]
        for k, o in zip(ks, outcomes):
            present[k] = o.has_grad.tolist()
        settled = _Settled(present, ks)
        if divisor == self._divisor():
            self._in_flight = _InFlight(step_no, settled, outcomes)
            return
        # another world size with vote="avg": the codes are sums over the saved ranks; apply them now
        for b, o in zip((self.buckets[k] for k in ks), outcomes):
            if o.codes is not None and bool(o.has_grad.any()):
                group = b.group
                scaled = o.codes[:b.numel].to(b.dtype).div_(divisor).mul_(group["lr"])
                for p, i, off, n, h in zip(b.params, b.indices, b.offsets, b.sizes, o.has_grad.tolist()):
                    if h and codes.get(i) is not None:
                        p.mul_(1.0 - group["lr"] * group["weight_decay"]).sub_(scaled[off:off + n].view(p.shape))
        self._count_step()

    def _apply_finished(self, st: "_Step") -> None:
        """Apply, in bucket order, the buckets whose codes are back, while later buckets' are still
        on the wire — once every bucket's first collective has shown that no rank failed (the
        failure flags travel there; a local error sends BAD), so every rank applies all buckets or none."""
        if not all(st.flags_ok):  # None: not known yet
            return
        flights = st.pipeline.flights
        while st.applied < len(flights) and flights[st.applied].outcome is not None:
            k = st.ks[st.applied]
            with record_function("dlion.apply"):
                self._apply(k, self.buckets[k], flights[st.applied].outcome, st.present[k], st.borrowed[k])
            st.applied += 1

    def _scaled_step(self, closure, scaler):
        """One step under ``torch.amp.GradScaler``: unscale, vote, and write the global
        found-inf decision into the scaler's record so that ``scaler.update()`` agrees."""
        if self.overlap and self.world_size > 1:
            raise RuntimeError("DistributedLion(overlap=True) sends each bucket during backward, before a "
                               "GradScaler can unscale the gradients; use overlap=False with GradScaler.")
        if self.delay and self.world_size > 1:
            raise RuntimeError("DistributedLion(delay=1) learns whether a step overflowed one step later, after "
                               "GradScaler.update() has run; use delay=0 with GradScaler.")
        record = scaler._per_optimizer_states[id(self)]  # private: pinned by tests/test_misuse.py
        if record["stage"].name == "READY":
            scaler.unscale_(self)
        found = list(record["found_inf_per_device"].values())
        if self.world_size == 1:
            if any(bool(f.item()) for f in found):
                self.skipped_steps += 1
                self._count_step()
                return None
            return self.step(closure)
        policy, self.nonfinite = self.nonfinite, "skip"  # an overflow is routine under a scaler: skip, never raise
        skipped_before = self.skipped_steps
        try:
            loss = self.step(closure)
        finally:
            self.nonfinite = policy
        inf = float(self.skipped_steps > skipped_before)  # every rank took the same decision
        for f in found:
            f.fill_(inf)
        return loss

    def _finish(self, step_no: int, st: _Step, outcomes: list[Outcome]) -> None:
        """Apply Δ and update momenta — or, if any rank failed, change nothing anywhere."""
        for k, o in zip(st.ks, outcomes):
            self._slots[k].left_out.update(o.has_grad)
        self.comm_stats.add_tallies([o.tally for o in outcomes if o.tally is not None])
        if st.applied and any(o.failed for o in outcomes):  # the flags are read before any bucket is applied
            raise RuntimeError("DistributedLion: internal error: buckets applied in a failed step")
        own_error = next((e for e in st.errors if e is not None), None)
        if self._skips(step_no, own_error=own_error, bad=any(o.bad for o in outcomes),
                       digests_agree=all(o.digests_agree for o in outcomes),
                       nonfinite=any(o.nonfinite for o in outcomes),
                       nonfinite_ranks=[r for o in outcomes for r in o.ranks_nonfinite]):
            return
        for k, o in zip(st.ks[st.applied:], outcomes[st.applied:]):
            self._apply(k, self.buckets[k], o, st.present[k], st.borrowed[k])
        self._count_step()
        if step_no == 0:
            self._warn_if_gradients_identical()
        if momentum_sync_due(self.momentum_sync, self.step_count):
            self.synchronize_momenta()
        if self.check_every and self.step_count % self.check_every == 0:
            self.check_replicas()

    def _apply(self, k: int, b: Bucket, o: Outcome, present: list[bool], borrowed: Optional[tuple] = None) -> None:
        """x ← x·(1 − η·λ) − η·Δ for the parameters some rank had a gradient for (two multi-tensor
        operations, :func:`dlion.buckets.apply_codes`), then this rank's momentum update."""
        group = b.group
        active = o.has_grad.tolist()
        if any(active):
            buf = self._slots[k].buffers
            fused = group.get("fused", False)
            if not (fused and o.signs is not None and apply_signs(b, o.signs, active, group["lr"],
                                                                   group["weight_decay"])):
                apply_codes(b, o.codes, active, buf.work, buf.work_views, group["lr"], group["weight_decay"],
                            self._divisor(), fused=fused)
            self._slots[k].steps.add_(o.has_grad.to(self._slots[k].steps.dtype))
        last = self._slots[k].buffers.last_vote
        if last is not None:  # ties="previous": this step's codes are the next step's tie-breakers
            if any(active):
                last.copy_(o.codes)
            else:
                last.zero_()
        if any(present) and not self.delay:  # (delay=1: updated when contributed)
            update_momentum(b, self._slots[k].buffers, present, group["betas"][1], self._scratch,
                            fused=group.get("fused", False), borrowed=borrowed)

    def _warn_if_gradients_identical(self) -> None:
        """After the first step: gradients bitwise equal on every rank mean that something
        (DistributedDataParallel, usually) already averaged them — paying for an fp32
        all-reduce *and* the vote. One small all-gather of checksums, once (none when nothing is trainable)."""
        if not self._slots:
            return
        mine = torch.stack([bits_checksum(_flat_grad(b)) for b in self.buckets]).view(torch.int32).reshape(-1)
        work, everyone = self._first.issue("all_gather", mine.to(self.buckets[0].device), "check")
        work.wait()
        table = everyone.cpu().view(self.world_size, -1)
        if bool((table == table[0]).all()) and bool(mine.any()):
            warnings.warn("DistributedLion: the gradients are identical on every rank. Is the model wrapped in "
                          "DistributedDataParallel (or are all ranks fed the same batch)? DistributedLion replaces "
                          "DDP's all-reduce: with both, every step pays for the fp32 all-reduce and the vote, and "
                          "the momenta of the ranks are identical. Use the bare model.", RuntimeWarning, stacklevel=5)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``torch.optim``; a step in flight (``overlap=True``: a backward without a
        ``step()``) is completed on every rank and discarded first."""
        if self._step is not None:
            warnings.warn("DistributedLion: zero_grad() discards the communication started by the last backward "
                          "(no step() followed it).", stacklevel=2)
            self._discard_in_flight()
        super().zero_grad(set_to_none=set_to_none)

    def _discard_in_flight(self) -> None:
        """Complete the step in flight on every rank (all buckets, in order) and drop its outcome."""
        for pending in self._step.pending:
            pending.clear()
        self._issue_ready(self.step_count)
        self._step.pipeline.finish()
        self._step = None

    # -- Lion Cub extras ---------------------------------------------------------
    @torch.no_grad()
    def synchronize_momenta(self) -> None:
        """Average every rank's momentum in fp32 (one all-reduce per bucket).
        Costs 2·(N−1)/N·32 bits per trainable parameter each way when it runs."""
        if self.world_size == 1:
            return
        self.settle()  # (delay=1: no collective of the exchange thread's may interleave; Δ stays pending)
        average_momenta([s.buffers for s in self._slots], self._first, self.world_size)

    @contextlib.contextmanager
    def _replica_view(self):
        self.settle()  # (delay=1: every rank has applied the same Δs; the one in flight stays pending)
        yield

    # -- overlap with backward ---------------------------------------------------
    def _register_hooks(self) -> None:
        where = {id(p): (k, j) for k, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        for b in self.buckets:
            for p in b.params:
                k, j = where[id(p)]
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, k=k, j=j: self._on_grad(k, j)))

    def _on_grad(self, k: int, j: int) -> None:
        if not self._sync:
            return
        if self._step is None:
            self._step = _Step(self)
        st = self._step
        if (k, j) in st.seen:
            # An extra backward without no_sync(): step() will exchange the accumulated gradients afresh.
            st.stale = True
            return
        st.seen.add((k, j))
        st.pending[k].discard(j)
        if k == st.issued:
            with torch.no_grad():
                self._issue_ready(self.step_count, in_hook=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- checkpointing ----------------------------------------------------------
    def _record(self) -> dict:
        return {**super()._record(),
                # which parameters the next step leaves out of the payload (no gradient anywhere last step)
                "skip": [s.left_out.skip.tolist() for s in self._slots],
                # delay=1: the step not yet applied travels with the checkpoint
                "pending": self._pending_state()}

    def load_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        """As ``torch.optim.Optimizer.load_state_dict`` (hyperparameters included), after
        :meth:`check_state_dict`: state of another optimizer type is refused, and so is another
        rank's unless ``from_rank="any"``."""
        self.check_state_dict(state_dict, from_rank=from_rank)
        state_dict = dict(state_dict)
        extra = state_dict.pop("dlion", None)
        super().load_state_dict(state_dict)
        rebind_groups(self.buckets, self.param_groups)
        # The momenta live in the buckets' flat buffers: copy the loaded values in and re-point the state.
        for slot in self._slots:
            b, buf = slot.bucket, slot.buffers
            for p, view in zip(b.params, buf.momentum_views):
                st = self.state[p]
                m = st.get("exp_avg")
                if m is None:
                    view.zero_()
                else:
                    view.copy_(m.reshape(view.shape))
                st["exp_avg"] = view
            for p, view in zip(b.params, buf.last_vote_views):
                st = self.state[p]
                v = st.get("last_vote")
                if v is None:  # (saved with another ties policy, or before any step)
                    view.zero_()
                else:
                    view.copy_(v.reshape(view.shape))
                st["last_vote"] = view
            if buf.last_vote is None:  # (a state saved with ties="previous" loaded under another policy)
                for p in b.params:
                    self.state[p].pop("last_vote", None)
            for j, p in enumerate(b.params):
                st = self.state[p]
                slot.steps[j] = float(st["step"]) if "step" in st else 0.0
                st["step"] = slot.steps[j]
        if extra is not None:
            self._load_record(extra)
            skips = extra.get("skip") or []
            if [len(s) for s in skips] == [len(b.params) for b in self.buckets]:
                for slot, skip in zip(self._slots, skips):
                    slot.left_out.update(~torch.tensor(skip, dtype=torch.bool))
            self._in_flight = None
            if extra.get("pending") is not None:
                with torch.no_grad():
                    self._load_pending(extra["pending"])


def _checked_hook_output(out, n: int) -> Tensor:
    if not isinstance(out, Tensor) or out.dtype != torch.int8 or out.shape != (n,):
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"sign_hook must return an int8 tensor of shape ({n},), got {got}.")
    if bool((out.abs() > 1).any()):
        raise ValueError("sign_hook returned values outside {-1, 0, 1}.")
    return out


def _flat_grad(b: Bucket) -> Tensor:
    """The gradients of a bucket's parameters end to end (those that have one)."""
    gs = [p.grad.reshape(-1) for p in b.params if p.grad is not None]
    return torch.cat(gs) if gs else torch.zeros(0, dtype=b.dtype, device=b.device)
