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
2. *exchange*: the bucket's algorithm (:mod:`dlion.algorithms`) issues its
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
its last gradient, and, on the default group, its later collectives go on a
second process group so that ranks never disagree on the order of collectives;
an exchange thread issues them as soon as they can go (:mod:`dlion.pipeline`).

With ``delay=1`` step t's Δ is applied in step t + 1, so its exchange runs
(on the exchange thread) during step t + 1's forward and backward; the local
momentum update happens at once, since c of the next step needs it::

    x_{t+1} = x_t·(1 − η·λ) − η·Δ_{t−1}        # Δ_t is still on the wire
"""

from __future__ import annotations

import contextlib
import functools
import re
import struct
import warnings
import zlib
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, JoinHook, Joinable
from torch.profiler import record_function

from . import kernels
from .aggregation import VoteRule, coin_key
from .algorithms import (ALGORITHMS, BAD, NONFINITE, Contribution, Outcome, WireState, choose_algorithm,
                         make_algorithm, run_compacted)
from .buckets import (Bucket, LeftOut, RankBuffers, Scratch, apply_codes, apply_signs, bucket_caps, contribute,
                      layout_buckets, rebind_groups, update_momentum)
from .collectives import CommStats, GroupTransport
from .pipeline import Flight, Pipeline
from .lion import Lion, param_tensors, check_grad
from .quantize import NORMS, levels

__all__ = ["DistributedLion", "DesyncError", "momentum_sync_due", "reject_unsupported", "bits_checksum",
           "average_momenta", "checksum_table", "raise_if_diverged"]

AGGREGATES = ("sign", "quantized")
NONFINITE_POLICIES = ("skip", "raise")


#: the end of the warning for unnamed parameters that share a shape and dtype (filters match it)
ORDER_WARNING = "Pass model.named_parameters() so the order is checked."


@contextlib.contextmanager
def order_warning_silenced():
    """No warning for unnamed same-shape parameters while constructing here: for integrations whose
    framework builds the parameter list itself, from ``model.named_parameters()`` in the model's order
    (the Trainer's groups; Accelerate's prepared model), so a user cannot pass the names."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*" + re.escape(ORDER_WARNING), category=UserWarning)
        yield


class DesyncError(RuntimeError):
    """Parameters differ between ranks (they must be bitwise identical)."""


def momentum_sync_due(schedule: Union[str, int], step: int) -> bool:
    """Whether momenta are averaged after step ``step`` (1-based): every K steps for
    an int K, after steps 1, 2, 4, 8, … for ``"doubling"``, never for ``"none"``."""
    if schedule == "none" or schedule == 0:
        return False
    if schedule == "doubling":
        return step & (step - 1) == 0
    return step % int(schedule) == 0


class _Step:
    """The buckets of one step: which are issued, which are done."""

    def __init__(self, opt: "DistributedLion"):
        self.pipeline = Pipeline(len(opt.buckets), opt._first, opt._second,
                                 threaded=opt._threaded,
                                 device=opt.buckets[0].device if opt.buckets else None)
        self.present: list = [None] * len(opt.buckets)
        self.finite = [False] * len(opt.buckets)  # this rank's gradients of bucket k were all finite
        self.errors: list = [None] * len(opt.buckets)
        self.pending = [set(range(len(b.params))) for b in opt.buckets]
        self.seen: set = set()
        self.issued = 0    # buckets 0 … issued−1 have their first collective in flight
        self.stale = False  # a gradient was accumulated again after its bucket was sent
        #: per bucket, once its first collective is read: may every rank apply (no failure flag)?
        self.flags_ok: list = [None] * len(opt.buckets)
        self.applied = 0    # buckets 0 … applied−1 are applied (step() only, in bucket order)

    def read_flags(self, k: int, out: Outcome) -> None:
        """Bucket k's failure flags are known (``Contribution.on_flags``; the exchange thread may call it)."""
        self.flags_ok[k] = not out.failed


class _Settled:
    """A step restored from a checkpoint whose Δ is not applied yet (``delay=1``)."""

    def __init__(self, buckets: int, present: list):
        self.present, self.errors, self.applied = present, [None] * buckets, 0


class _ShadowSteps(JoinHook):
    """``torch.distributed.algorithms.Join``: a rank that has run out of data answers each step of
    the ranks still training with a step of its own without gradients (it abstains on every
    parameter) and applies the same Δ, so the replicas stay bitwise identical."""

    def __init__(self, opt: "DistributedLion"):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.opt.check_every:  # (every rank runs the post-hooks, once all have joined)
            self.opt.check_replicas()


class DistributedLion(Lion, Joinable):
    """Distributed Lion: a drop-in ``torch.optim.Optimizer`` for data-parallel training.

    Use it *instead of* DDP's gradient all-reduce: each rank calls
    ``loss.backward(); opt.step()`` on its own batch. Parameters are broadcast
    from rank 0 at construction and stay bitwise identical on every rank.

    Args:
        vote: ``"mavo"`` (majority vote, Δ = sign Σδ) or ``"avg"`` (Δ = mean δ).
        ties: ``"zero"`` (a tie gives Δ = 0), ``"random"`` (a shared coin) or
            ``"previous"`` (the coordinate's last Δ, a coin where that was 0; see
            :mod:`dlion.aggregation`). Only even vote counts tie; ``"random"`` and
            ``"previous"`` keep MaVo's way back at 1 bit.
        process_group: the group to aggregate over (default: the world).
        comm: collective algorithm for sign aggregation: ``"1bit"`` (all-to-all
            + all-gather), ``"allgather"`` (naive), ``"pbit"`` (packed-counter
            all-reduce) or ``"auto"`` (per bucket, see
            :func:`dlion.algorithms.choose_algorithm`). All give the same Δ.
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
    and left out of the next step's payload (:func:`dlion.algorithms.run_compacted`).
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
        Joinable.__init__(self)  # a disabled join config until a Join context manager sets one
        self._shadowing = False  # a Join shadow step is running (_shadow_step)
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if distributed else 1
        self.rule = VoteRule(vote, world, ties=ties, seed=seed)
        self._keeps_last_vote = ties == "previous" and vote == "mavo" and aggregate == "sign"
        check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                      check_every, nonfinite, sign_hook)
        params = reject_unsupported(params)
        self._agree_on_kernels = True  # (fused=True: below, on every rank at once)
        super().__init__(params, lr, betas, weight_decay, maximize=maximize, foreach=foreach,
                         momentum_dtype=momentum_dtype, fused=fused)
        kernels_error = kernels.load_error() if any(g.get("fused") for g in self.param_groups) else None
        if kernels_error is not None and world == 1:
            raise RuntimeError(kernels.fused_error({None: kernels_error}))
        self.process_group = process_group
        self.world_size = world
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.comm, self.aggregate = comm, aggregate
        self.quant_norm, self.quant_bits = quant_norm, quant_bits
        self.quant_levels = levels(quant_bits, world) if aggregate == "quantized" else 0
        self.momentum_sync, self.overlap, self.seed = momentum_sync, overlap, seed
        self.check_every, self.nonfinite, self.sign_hook = check_every, nonfinite, sign_hook
        self.bucket_cap_mb = list(bucket_cap_mb) if isinstance(bucket_cap_mb, (list, tuple)) else bucket_cap_mb
        self.delay = delay
        #: the exchange runs on a thread of its own (overlap, delay, or a subclass that streams)
        self._threaded = overlap or bool(delay) or bool(getattr(self, "streaming", False))
        self.comm_stats = CommStats()
        #: completed ``step()`` calls, skipped ones included: keys the tie coins and the momentum-sync
        #: schedule (``comm_stats`` only counts traffic and may be reset by the user)
        self.step_count = 0
        self.skipped_steps = 0
        self.warn_after_skips = 10
        self._skips_in_a_row = 0
        self._any_rank = 0  # depth of accepting_any_rank()
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.num_params = sum(p.numel() for p in self._params if p.requires_grad)
        self.buckets: list[Bucket] = []
        self._algorithms: list = []
        self._buffers: list[RankBuffers] = []
        self._wire: list[WireState] = []
        self._left_out: list[LeftOut] = []
        self._sync = True
        self._step: Optional[_Step] = None
        #: delay=1: (step number, its exchange, its outcomes once completed) of the step not yet applied
        self._in_flight: Optional[tuple] = None
        self._hooks: list = []
        if world > 1:
            self._check_same_model(kernels_error)
            self._broadcast_parameters()
            self.buckets = layout_buckets(self._params, [g for g in self.param_groups for _ in g["params"]], world,
                                          bucket_cap_mb)
            self._buffers = [RankBuffers(b, momentum_dtype) for b in self.buckets]
            self._scratch = Scratch()
            self._algorithms = [self._algorithm_for(b) for b in self.buckets]
            self._wire = [WireState(up="narrow" if a.name == "pbit" else "runs") for a in self._algorithms]
            self._left_out = [LeftOut(b) for b in self.buckets]
            self._trainable = {id(p) for b in self.buckets for p in b.params}
            # Optimizer state as views of per-bucket flat tensors: momenta and step counters.
            self._steps = [torch.zeros(len(b.params)) for b in self.buckets]
            for b, buf, steps in zip(self.buckets, self._buffers, self._steps):
                for j, (p, m) in enumerate(zip(b.params, buf.momentum_views)):
                    self.state[p]["exp_avg"] = m
                    self.state[p]["step"] = steps[j]
            if self._keeps_last_vote:  # ties="previous": the last applied Δ, identical on every rank
                for b, buf in zip(self.buckets, self._buffers):
                    buf.keep_last_vote(b)
                    for p, v in zip(b.params, buf.last_vote_views):
                        self.state[p]["last_vote"] = v
            self._frozen = [p for p in self._params if not p.requires_grad]
            self._first = GroupTransport(process_group, self.comm_stats)
            # Hooks issue first collectives during backward; the later ones of each bucket go on a
            # second group, in bucket order, so the two streams can never interleave differently.
            second = dist.new_group(backend=None) if (self._threaded and process_group is None) else None
            self._second = GroupTransport(second, self.comm_stats) if second is not None else self._first
            if overlap:
                self._register_hooks()
        self._ready = True

    def _count_step(self) -> None:
        self.step_count += 1
        self.comm_stats.steps += 1

    def _local_step(self, closure):
        """World size 1: exactly :class:`dlion.Lion`'s step, counted."""
        loss = Lion.step(self, closure)
        self._count_step()
        return loss

    def _algorithm_for(self, b: Bucket):
        if self.aggregate == "quantized":
            return make_algorithm("quantized", self.rule, self.quant_levels)
        name = choose_algorithm(b.padded, len(b.params), self.rule) if self.comm == "auto" else self.comm
        return make_algorithm(name, self.rule)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise RuntimeError(
                "DistributedLion lays out its communication buffers at construction; "
                "pass every parameter group to the constructor instead of add_param_group().")
        super().add_param_group(param_group)

    # -- construction ---------------------------------------------------------
    def _config(self) -> tuple:
        return (self.rule.vote, self.rule.ties, self.seed, self.comm, self.aggregate, self.quant_norm,
                self.quant_bits, str(self.momentum_sync), self.bucket_cap_mb, self.overlap, self.check_every,
                self.nonfinite, str(self.momentum_dtype), self.delay)

    def _check_same_model(self, kernels_error: Optional[str] = None) -> None:
        """Shapes, dtypes, requires_grad and, when the parameters were given with names
        (``model.named_parameters()``), names, in order, and the options: the same on every rank.
        Without names, two same-shape parameters in another order on one rank cannot be told
        apart (building the model the same way on every rank is the user's contract). With
        ``fused=True``, whether each rank loaded the native kernels (``kernels_error``: why not):
        where any could not, every rank raises the same error."""
        names = self._param_names()
        self._warn_if_order_unchecked(names)
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad), n)
                for p, n in zip(self._params, names)]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, (mine, self._config(), kernels_error), group=self.process_group)
        failed = {r: e for r, (_, _, e) in enumerate(everyone) if e is not None}
        if failed:
            raise RuntimeError(kernels.fused_error(failed))
        everyone = [(m, cfg) for m, cfg, _ in everyone]
        ref, ref_cfg = everyone[0]
        for r, (theirs, cfg) in enumerate(everyone[1:], start=1):
            if len(theirs) != len(ref):
                raise ValueError(
                    f"DistributedLion: ranks disagree on the model: rank {r} has {len(theirs)} parameters, "
                    f"rank 0 has {len(ref)}.")
            for i, (a, b) in enumerate(zip(ref, theirs)):
                if a[3] is not None and b[3] is not None and a[3] != b[3]:
                    raise ValueError(
                        f"DistributedLion: ranks disagree on the model at parameter {i}: it is {b[3]!r} on rank "
                        f"{r} and {a[3]!r} on rank 0 (parameters in another order, or another model); the initial "
                        "broadcast would copy one parameter's weights into another. Give the parameters in the "
                        "same order on every rank.")
                if a[:2] != b[:2]:
                    raise ValueError(
                        f"DistributedLion: ranks disagree on the model at parameter {i}: rank {r} has shape "
                        f"{b[0]} dtype {b[1]}, rank 0 has shape {a[0]} dtype {a[1]}.")
                if a[2] != b[2]:
                    raise ValueError(
                        f"DistributedLion: ranks disagree on the model at parameter {i}: requires_grad is "
                        f"{b[2]} on rank {r} and {a[2]} on rank 0.")
            if cfg != ref_cfg:
                names = ("vote", "ties", "seed", "comm", "aggregate", "quant_norm", "quant_bits", "momentum_sync",
                         "bucket_cap_mb", "overlap", "check_every", "nonfinite", "momentum_dtype", "delay")
                diff = [f"{n}={x!r} on rank {r}, {y!r} on rank 0" for n, x, y in zip(names, cfg, ref_cfg) if x != y]
                raise ValueError("DistributedLion: ranks disagree on the optimizer's options: " + "; ".join(diff))

    def _param_names(self) -> list:
        """Each parameter's name, in order (None where the parameters were given without names)."""
        return [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]

    def _warn_if_order_unchecked(self, names: list) -> None:
        """Warn (once, on every rank) when unnamed trainable parameters share a shape and dtype: two
        of them in another order on one rank would pass every check and train the wrong weights."""
        seen: dict = {}
        for p, n in zip(self._params, names):
            if n is None and p.requires_grad:
                key = (tuple(p.shape), p.dtype)
                seen[key] = seen.get(key, 0) + 1
        shared = [(s, d) for (s, d), count in seen.items() if count > 1]
        if shared:
            s, d = shared[0]
            warnings.warn(
                f"{type(self).__name__}: the parameters were given without names and several share a shape and "
                f"dtype (e.g. {len(shared)} such group(s), shape {s} {str(d).replace('torch.', '')}), so a rank that "
                "lists them in another order cannot be told apart: its replicas would stay equal position by "
                "position while the models differ. " + ORDER_WARNING,
                UserWarning, stacklevel=4)

    def _structure(self) -> str:
        """The model's structure as every rank must see it: names (where given), shapes and dtypes, in order."""
        return "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for p, n in zip(self._params, self._param_names()))

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Start every rank from rank 0's parameters: one broadcast per (device, dtype)."""
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for ps in _by_device_dtype(self._params):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=src, group=self.process_group)
            _scatter_flat(flat, ps)

    def bucket_layout(self) -> list[Optional[tuple[int, int, int]]]:
        """(bucket index, offset, padded bucket length) of every parameter, in parameter
        order (None for frozen ones): where its coordinates sit in the communication
        buffers (the tie coins are keyed by bucket and offset)."""
        where: dict = {}
        for b in self.buckets:
            for i, off in zip(b.indices, b.offsets):
                where[i] = (b.index, off, b.padded)
        return [where.get(i) for i in range(len(self._params))]

    @property
    def algorithm_names(self) -> list[str]:
        """The collective algorithm of each bucket (``comm="auto"`` chooses per bucket); empty
        without a process group or at world size 1."""
        return [a.name for a in self._algorithms]

    # -- step 1: this rank's contribution -----------------------------------------
    def _digest(self, group: dict) -> int:
        """31-bit digest of the per-step hyperparameters a rank applies to a group."""
        b1, b2 = group["betas"]
        raw = struct.pack("<dddd?", float(group["lr"]), float(b1), float(b2), float(group["weight_decay"]),
                          bool(group["maximize"]))
        return zlib.crc32(raw) & 0x7FFFFFFF

    def _local_values(self, k: int) -> tuple[Tensor, list[bool], bool]:
        """This rank's int8 values for bucket k (δ = sign(β1·m + (1 − β1)·g), or Lion Cub's q), which
        parameters take part, and whether every value was finite: what a subclass changes to vote
        on something else (:class:`dlion.LocalDistributedLion` votes on its local progress)."""
        b, buf, group = self.buckets[k], self._buffers[k], self.buckets[k].group
        quant = (self.quant_levels, self.quant_norm) if self.aggregate == "quantized" else None
        return contribute(b, buf, [p.grad for p in b.params], self._scratch, beta1=group["betas"][0],
                          maximize=group["maximize"], quant=quant, borrow=True, fused=group.get("fused", False))

    def _input_error(self, k: int) -> Optional[Exception]:
        """The first invalid gradient of bucket k on this rank (sent as BAD: every rank raises), or None."""
        b, error = self.buckets[k], None
        for i, p in zip(b.indices, b.params):
            try:
                check_grad(i, p)
            except ValueError as e:
                error = error or e
        return error

    def _contribute(self, k: int, step: int) -> Contribution:
        b, buf = self.buckets[k], self._buffers[k]
        status, error = 0, self._input_error(k)
        group = b.group
        if error is None:
            values, present, finite = self._local_values(k)
            if not finite:
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
        packed = buf.packed if error is None and self.sign_hook is None else None  # (a hook changes the values)
        return Contribution(buf.values, b.numel, torch.tensor(present, dtype=torch.bool), status,
                            self._digest(group), sizes=b.sizes, on_flags=functools.partial(self._step.read_flags, k),
                            previous=buf.last_vote, packed=packed, zeros=buf.zeros if packed is not None else None)

    def _issue_ready(self, step_no: int) -> None:
        """Start, in bucket order, every bucket whose gradients are all there."""
        st = self._step
        while st.issued < len(self.buckets) and not st.pending[st.issued]:
            k = st.issued
            with record_function("dlion.contribute"):
                contrib = self._contribute(k, step_no)
            with record_function("dlion.exchange"):
                left_out = self._left_out[k]
                gen = run_compacted(self._algorithms[k], self._wire[k], contrib, self.rank,
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
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
                raise RuntimeError(
                    "DistributedLion was built before torch.distributed.init_process_group(), so it is plain Lion "
                    f"on one rank, but the process group now has {dist.get_world_size(self.process_group)} ranks: "
                    "their replicas would diverge. Build the optimizer after init_process_group().")
            return self._local_step(closure)
        # Inside torch.distributed.algorithms.Join: say "still training" (one all-reduce on the
        # process group, before this step's collectives; nothing outside a Join context)
        joined = None if self._shadowing else Join.notify_join_context(self)
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
        return _ShadowSteps(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @torch.no_grad()
    def _shadow_step(self) -> None:
        """A step with no gradient on this rank: the same buckets, algorithms and collectives as
        the other ranks' step, contributing nothing (``has_grad`` all False: it abstains on every
        parameter), then applying the agreed Δ (weight decay included) like every rank. Its own
        ``.grad`` are put back afterwards; its momenta do not change."""
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        self._shadowing = True
        try:
            self.step()
        finally:
            self._shadowing = False
            for p, g in zip(self._params, saved):
                p.grad = g

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
        try:
            with record_function("dlion.apply"):
                self._finish(step_no, st, outcomes)
        finally:
            for buf in self._buffers:  # a skipped or failed step leaves no reference to this step's gradients
                buf.borrowed = None

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
                for k, (b, buf) in enumerate(zip(self.buckets, self._buffers)):
                    if any(st.present[k]):
                        update_momentum(b, buf, st.present[k], b.group["betas"][1], self._scratch,
                                        fused=b.group.get("fused", False))
        finally:
            self._step = None
            for buf in self._buffers:  # (a rank with non-finite gradients did not consume them)
                buf.borrowed = None
        self._in_flight = (step_no, st, None)
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """``delay=1``: wait for the step in flight and apply its Δ on every rank (all ranks
        must call it at the same point). Call it after the last ``step()``; nothing to do
        without ``delay`` or when no step is in flight."""
        if self._in_flight is None:
            return
        self._settle()
        step_no, st, outcomes = self._in_flight
        self._in_flight = None
        with record_function("dlion.apply"):
            self._finish(step_no, st, outcomes)

    def _settle(self) -> None:
        """delay=1: complete the exchange in flight, without applying its Δ yet."""
        if self._in_flight is None or self._in_flight[2] is not None:
            return
        step_no, st, _ = self._in_flight
        with record_function("dlion.exchange"):
            outcomes = st.pipeline.finish()
        self.comm_stats.wait_s += st.pipeline.blocked
        self._in_flight = (step_no, st, outcomes)

    def _pending_state(self) -> Optional[dict]:
        """The settled step not yet applied (delay=1), per parameter, so that a checkpoint taken
        between two steps loses nothing and resumes on any bucket layout: its codes (parameter
        shape; None where no rank had a gradient), whether it is skipped, and the vote's divisor."""
        if self._in_flight is None:
            return None
        self._settle()
        step_no, st, outcomes = self._in_flight
        if any(e is not None for e in st.errors) or any(o.bad or not o.digests_agree for o in outcomes):
            self.flush()  # raises on every rank, as the next step() would
        codes, has_grad = {}, {}
        for b, o in zip(self.buckets, outcomes):
            for j, (i, off, n) in enumerate(zip(b.indices, b.offsets, b.sizes)):
                has_grad[i] = bool(o.has_grad[j])
                if has_grad[i] and o.codes is not None:
                    codes[i] = o.codes[off:off + n].view(b.params[j].shape).cpu().clone()
        return {"step": step_no, "skip": any(o.nonfinite for o in outcomes), "codes": codes, "has_grad": has_grad,
                "divisor": self.world_size if self.rule.vote == "avg" else 1}

    def _load_pending(self, pending: dict) -> None:
        """Restore a saved :meth:`_pending_state`: with the same layout and divisor, as the step the
        next ``step()`` applies (bitwise the run that never stopped); otherwise (a resize) applied now."""
        step_no, codes = int(pending["step"]), pending["codes"]
        divisor = int(pending["divisor"])
        outcomes = []
        for b in self.buckets:
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
        settled = _Settled(len(self.buckets), [o.has_grad.tolist() for o in outcomes])
        if divisor == (self.world_size if self.rule.vote == "avg" else 1):
            self._in_flight = (step_no, settled, outcomes)
            return
        # another world size with vote="avg": the codes are sums over the saved ranks; apply them now
        for b, o in zip(self.buckets, outcomes):
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
            k = st.applied
            with record_function("dlion.apply"):
                self._apply(k, self.buckets[k], flights[k].outcome, st.present[k])
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
        for left_out, o in zip(self._left_out, outcomes):
            left_out.update(o.has_grad)
        self.comm_stats.add_tallies([o.tally for o in outcomes if o.tally is not None])
        errors = [e for e in st.errors if e is not None]
        if errors:
            raise errors[0]
        if st.applied and any(o.failed for o in outcomes):  # the flags are read before any bucket is applied
            raise RuntimeError("DistributedLion: internal error: buckets applied in a failed step")
        if any(o.bad for o in outcomes):
            raise RuntimeError("DistributedLion: another rank rejected its gradients (its error says why); "
                               "no rank changed any parameter or momentum.")
        if not all(o.digests_agree for o in outcomes):
            raise ValueError(
                f"DistributedLion: ranks disagree on lr, betas, weight_decay or maximize at step {step_no} (e.g. an "
                "LR scheduler stepped on one rank only); no rank changed anything.")
        if any(o.nonfinite for o in outcomes):
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"DistributedLion: a rank has inf/NaN gradients at step {step_no}; no rank changed anything.")
            self.skipped_steps += 1
            self._count_step()
            self._skips_in_a_row += 1
            if self._skips_in_a_row == self.warn_after_skips:
                ranks = sorted({r for o in outcomes for r in o.ranks_nonfinite})
                who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "some rank (this comm does not say which)"
                warnings.warn(f"DistributedLion: {self._skips_in_a_row} steps in a row skipped because {who} had "
                              "inf/NaN gradients; training is not progressing (check that rank's data and loss "
                              "scale, or use nonfinite='raise').", RuntimeWarning, stacklevel=4)
            return
        self._skips_in_a_row = 0
        for k in range(st.applied, len(self.buckets)):
            self._apply(k, self.buckets[k], outcomes[k], st.present[k])
        self._count_step()
        if step_no == 0:
            self._warn_if_gradients_identical()
        if momentum_sync_due(self.momentum_sync, self.step_count):
            self.synchronize_momenta()
        if self.check_every and self.step_count % self.check_every == 0:
            self.check_replicas()

    def _apply(self, k: int, b: Bucket, o: Outcome, present: list[bool]) -> None:
        """x ← x·(1 − η·λ) − η·Δ for the parameters some rank had a gradient for (two multi-tensor
        operations, :func:`dlion.buckets.apply_codes`), then this rank's momentum update."""
        group = b.group
        active = o.has_grad.tolist()
        if any(active):
            buf = self._buffers[k]
            fused = group.get("fused", False)
            if not (fused and o.signs is not None and apply_signs(b, o.signs, active, group["lr"],
                                                                   group["weight_decay"])):
                apply_codes(b, o.codes, active, buf.work, buf.work_views, group["lr"], group["weight_decay"],
                            self.world_size if self.rule.vote == "avg" else 1, fused=fused)
            self._steps[k].add_(o.has_grad.to(self._steps[k].dtype))
        last = self._buffers[k].last_vote
        if last is not None:  # ties="previous": this step's codes are the next step's tie-breakers
            if any(active):
                last.copy_(o.codes)
            else:
                last.zero_()
        if any(present) and not self.delay:  # (delay=1: updated when contributed)
            update_momentum(b, self._buffers[k], present, group["betas"][1], self._scratch,
                            fused=group.get("fused", False))

    def _warn_if_gradients_identical(self) -> None:
        """After the first step: gradients bitwise equal on every rank mean that something
        (DistributedDataParallel, usually) already averaged them — paying for an fp32
        all-reduce *and* the vote. One small all-gather of checksums, once (none when nothing is trainable)."""
        if not self._buffers:
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

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.grad is not None and id(p) not in self._trainable:
                raise RuntimeError(
                    f"DistributedLion: a parameter of shape {tuple(p.shape)} has a gradient but had "
                    "requires_grad=False when the optimizer was built, so it has no place in the communication "
                    "buffers; build the optimizer after unfreezing it.")

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
        for buf in self._buffers:
            buf.borrowed = None

    # -- Lion Cub extras ---------------------------------------------------------
    @torch.no_grad()
    def synchronize_momenta(self) -> None:
        """Average every rank's momentum in fp32 (one all-reduce per bucket).
        Costs 2·(N−1)/N·32 bits per trainable parameter each way when it runs."""
        if self.world_size == 1:
            return
        self._settle()  # (delay=1: no collective of the exchange thread's may interleave; Δ stays pending)
        average_momenta(self._buffers, self._first, self.world_size)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`DesyncError` unless every parameter is bitwise identical on all
        ranks: compares two 64-bit checksums of each parameter's bits (16 bytes per
        parameter per rank through an all-gather), and a fingerprint of the model's structure
        (names where given, shapes and dtypes, in order; 16 bytes more)."""
        if self.world_size == 1:
            return
        self._settle()  # (delay=1: every rank has applied the same Δs; the one in flight stays pending)
        structure = self._structure()
        work, everyone = self._first.issue("all_gather", checksum_table(self._params, structure), "check")
        work.wait()
        raise_if_diverged(everyone, self._params, self.world_size, "DistributedLion", self.step_count, structure)

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
                self._issue_ready(self.step_count)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # -- checkpointing ----------------------------------------------------------
    def state_dict(self) -> dict:
        pending = self._pending_state()  # delay=1: the step not yet applied travels with the checkpoint
        sd = super().state_dict()
        sd["dlion"] = {"step_count": self.step_count, "comm_stats": self.comm_stats.state_dict(),
                       "world_size": self.world_size,
                       "rank": self.rank, "vote": self.rule.vote, "ties": self.rule.ties, "seed": self.seed,
                       "aggregate": self.aggregate, "skipped_steps": self.skipped_steps,
                       # the agreed wire formats (identical on every rank), so a resumed run sends the same bytes
                       "wire": [(w.up, w.down) for w in self._wire],
                       # which parameters the next step leaves out of the payload (no gradient anywhere last step)
                       "skip": [left_out.skip.tolist() for left_out in self._left_out],
                       "pending": pending}
        return sd

    #: what ``load_state_dict``'s ``from_rank`` accepts
    FROM_RANK = ("own", "any")

    @contextlib.contextmanager
    def accepting_any_rank(self):
        """Within this block ``load_state_dict(sd)`` acts as ``load_state_dict(sd, from_rank="any")``:
        for code that calls ``load_state_dict`` itself (a stock HF Trainer's single ``optimizer.pt``,
        Lightning's or Accelerate's one-rank state), where every rank deliberately loads one rank's state."""
        self._any_rank = getattr(self, "_any_rank", 0) + 1
        try:
            yield self
        finally:
            self._any_rank -= 1

    def check_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        """Raise ``ValueError`` if this rank should not load ``state_dict``: state of another optimizer
        type (no ``"dlion"`` record: a plain :class:`dlion.Lion`, ``torch.optim.Adam``, ...; or a
        hierarchical / local optimizer's), or another rank's state unless ``from_rank="any"``.
        :func:`dlion.checkpoint.load` calls this before it changes anything."""
        if from_rank not in self.FROM_RANK:
            raise ValueError(f"from_rank must be one of {', '.join(map(repr, self.FROM_RANK))}, got {from_rank!r}")
        if getattr(self, "_any_rank", 0):
            from_rank = "any"
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise ValueError(f"{name} cannot load this state: it is not an optimizer state_dict() "
                             "(no 'param_groups' list).")
        extra = state_dict.get("dlion")
        if not isinstance(extra, dict):
            keys = sorted({str(k) for st in (state_dict.get("state") or {}).values() if isinstance(st, dict)
                           for k in st})
            hyper = sorted({str(k) for g in state_dict["param_groups"] for k in g if k != "params"})
            if "exp_avg_sq" in keys or "eps" in hyper:
                what = "an Adam-style optimizer's (state 'exp_avg_sq' / hyperparameter 'eps')"
            elif set(keys) <= {"exp_avg", "step"} and "betas" in hyper:
                what = "a single-process dlion.Lion's (or another Lion's)"
            else:
                what = f"another optimizer's (state entries {keys}, hyperparameters {hyper})"
            raise ValueError(
                f"{name} cannot load this state: it has no 'dlion' record, so it was not saved by a "
                f"DistributedLion; it looks like {what}. Loading it would take that optimizer's "
                "hyperparameters and momenta as this one's. Start this optimizer afresh (or load the model only).")
        if extra.get("hierarchical") is not None:
            raise ValueError(
                f"{name} cannot load this state: it was saved by dlion.HierarchicalDistributedLion, which "
                "keeps one momentum per node, sharded across the node's ranks; DistributedLion keeps one per rank. "
                "Resume with HierarchicalDistributedLion on the same mesh.")
        if extra.get("local") is not None and "local" not in name.lower():
            raise ValueError(
                f"{name} cannot load this state: it was saved by dlion.LocalDistributedLion, whose state "
                "holds an anchor, residuals and each rank's local parameters. Resume with LocalDistributedLion.")
        saved_rank = extra.get("rank")
        if from_rank == "own" and saved_rank is not None and int(saved_rank) != self.rank:
            raise ValueError(
                f"{name}: this state was saved by rank {saved_rank} (of {extra.get('world_size', '?')}); this is "
                f"rank {self.rank} (of {self.world_size}). Each rank keeps its own momentum: load each rank's own "
                "state, or pass load_state_dict(sd, from_rank='any') (or use `with opt.accepting_any_rank():`) to "
                "start this rank from that rank's momenta on purpose (dlion.checkpoint.load does so when the "
                "world size changed).")

    def load_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        """As ``torch.optim.Optimizer.load_state_dict`` (hyperparameters included), after
        :meth:`check_state_dict`: state of another optimizer type is refused, and so is another
        rank's unless ``from_rank="any"``."""
        self.check_state_dict(state_dict, from_rank=from_rank)
        state_dict = dict(state_dict)
        extra = state_dict.pop("dlion", None)
        if extra is not None and extra.get("hierarchical") is not None:
            raise ValueError(
                "DistributedLion cannot load this state: it was saved by dlion.HierarchicalDistributedLion, which "
                "keeps one momentum per node, sharded across the node's ranks; DistributedLion keeps one per rank. "
                "Resume with HierarchicalDistributedLion on the same mesh.")
        if extra is not None and extra.get("local") is not None and "local" not in type(self).__name__.lower():
            raise ValueError(
                "DistributedLion cannot load this state: it was saved by dlion.LocalDistributedLion, whose state "
                "holds an anchor, residuals and each rank's local parameters. Resume with LocalDistributedLion.")
        super().load_state_dict(state_dict)
        rebind_groups(self.buckets, self.param_groups)
        # The momenta live in the buckets' flat buffers: copy the loaded values in and re-point the state.
        for b, buf in zip(self.buckets, self._buffers):
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
        for b, steps in zip(self.buckets, getattr(self, "_steps", [])):
            for j, p in enumerate(b.params):
                st = self.state[p]
                steps[j] = float(st["step"]) if "step" in st else 0.0
                st["step"] = steps[j]
        if extra is not None:
            self.comm_stats.load_state_dict(extra["comm_stats"])
            self.step_count = int(extra.get("step_count", self.comm_stats.steps))
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            wire = extra.get("wire") or []
            if len(wire) == len(self._wire):  # (another layout, e.g. another world size: start afresh)
                for w, (up, down) in zip(self._wire, wire):
                    w.up, w.down = up, down
            skips = extra.get("skip") or []
            if [len(s) for s in skips] == [len(b.params) for b in self.buckets]:
                for left_out, skip in zip(self._left_out, skips):
                    left_out.update(~torch.tensor(skip, dtype=torch.bool))
            self._in_flight = None
            if extra.get("pending") is not None:
                with torch.no_grad():
                    self._load_pending(extra["pending"])


def check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                  check_every, nonfinite, sign_hook) -> None:
    """Raise ``ValueError`` naming the first invalid option of :class:`DistributedLion`."""
    if comm not in ("auto", *ALGORITHMS):
        raise ValueError(f"Unknown comm {comm!r}; choose one of {', '.join(map(repr, ('auto', *ALGORITHMS)))}.")
    if aggregate not in AGGREGATES:
        raise ValueError(f"Unknown aggregate {aggregate!r}; choose one of {', '.join(map(repr, AGGREGATES))}.")
    if aggregate == "quantized":
        if vote != "mavo":
            raise ValueError("aggregate='quantized' computes Δ = sign(Σ q); it needs vote='mavo'.")
        if quant_norm not in NORMS:
            raise ValueError(f"Unknown quant_norm {quant_norm!r}; choose one of {', '.join(map(repr, NORMS))}.")
        if quant_bits not in (2, 4, 8):
            raise ValueError(f"quant_bits must be 2, 4 or 8, got {quant_bits!r}")
        if sign_hook is not None:
            raise ValueError("sign_hook applies to sign aggregation; it cannot be used with aggregate='quantized'.")
    if not (momentum_sync in ("none", "doubling") or (isinstance(momentum_sync, int)
                                                     and not isinstance(momentum_sync, bool) and momentum_sync > 0)):
        raise ValueError(f"momentum_sync must be 'none', 'doubling' or a positive int K, got {momentum_sync!r}")
    caps = bucket_caps(bucket_cap_mb)
    if not caps or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in caps):
        raise ValueError(f"bucket_cap_mb must be > 0, or a non-empty list of caps > 0, got {bucket_cap_mb!r}")
    if not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"check_every must be an int >= 0, got {check_every!r}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"Unknown nonfinite {nonfinite!r}; choose one of {', '.join(map(repr, NONFINITE_POLICIES))}.")


def reject_unsupported(params: Iterable) -> list:
    """``params`` as a list, after checking that it holds no meta tensor or DTensor: those cannot
    be replicated by a broadcast; say so at construction."""
    params = list(params)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        DTensor = ()
    for i, p in enumerate(param_tensors(params)):
        if DTensor and isinstance(p, DTensor):
            raise ValueError(
                f"DistributedLion: parameter {i} (shape {tuple(p.shape)}) is a DTensor (FSDP2 fully_shard or tensor "
                "parallel). DistributedLion replicates whole parameters across the data-parallel group and would "
                "overwrite every rank's shard with rank 0's; use it on plain, replicated parameters.")
        if isinstance(p, Tensor) and p.is_meta:
            raise ValueError(
                f"DistributedLion: parameter {i} (shape {tuple(p.shape)}) is on the meta device (no data). "
                "Materialise the model first (e.g. model.to_empty(device=...) and initialise it), then build the "
                "optimizer.")
    return params


def _checked_hook_output(out, n: int) -> Tensor:
    if not isinstance(out, Tensor) or out.dtype != torch.int8 or out.shape != (n,):
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"sign_hook must return an int8 tensor of shape ({n},), got {got}.")
    if bool((out.abs() > 1).any()):
        raise ValueError("sign_hook returned values outside {-1, 0, 1}.")
    return out


def _by_device_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _scatter_flat(flat: Tensor, tensors: list[Tensor]) -> None:
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def average_momenta(buffers: list, transport: GroupTransport, count: int) -> None:
    """Every rank's flat momenta (``buffers[k].momentum``) become their fp32 mean over the
    transport's group of ``count`` ranks: one all-reduce per bucket, all in flight at once."""
    works = []
    for buf in buffers:
        flat = buf.momentum.float()
        works.append((transport.issue("all_reduce", flat, "momentum_sync"), buf))
    for (work, flat), buf in works:
        work.wait()
        flat.div_(count)
        if flat.data_ptr() != buf.momentum.data_ptr():
            buf.momentum.copy_(flat)


def _fingerprint(structure: str, count: int) -> Tensor:
    """A structure string and a parameter count as one checksum row (two int64)."""
    return torch.tensor([zlib.crc32(structure.encode()), count], dtype=torch.int64)


def checksum_table(params: list[Tensor], structure: Optional[str] = None) -> Tensor:
    """This rank's row for a replica check: two 64-bit checksums per parameter, as int32 words,
    on the parameters' device (NCCL only gathers device tensors); with ``structure`` (a string
    naming the model's structure) one more pair, its fingerprint."""
    rows = [bits_checksum(p) for p in params] + ([_fingerprint(structure, len(params))] if structure is not None
                                                  else [])
    return torch.stack(rows).view(torch.int32).reshape(-1).to(params[0].device)


def raise_if_diverged(gathered: Tensor, params: list[Tensor], world: int, who: str, step: int,
                      structure: Optional[str] = None) -> None:
    """Raise :class:`DesyncError` naming the first parameter whose checksums differ between
    rank 0 and another rank, given every rank's :func:`checksum_table` row gathered (with the
    same ``structure`` argument: first the structure fingerprints are compared)."""
    table = gathered.cpu().view(world, len(params) + (structure is not None), 4)
    if structure is not None:
        for r in range(1, world):
            if not torch.equal(table[r, -1], table[0, -1]):
                raise DesyncError(f"{who}: the model's structure (parameter names where given, shapes and dtypes, "
                                  f"in order) differs between rank 0 and rank {r} at step {step}.")
    for i, p in enumerate(params):
        for r in range(1, world):
            if not torch.equal(table[r, i], table[0, i]):
                raise DesyncError(f"{who}: parameter {i} (shape {tuple(p.shape)}) differs between rank 0 and "
                                  f"rank {r} after step {step}; replicas have diverged.")


def _flat_grad(b: Bucket) -> Tensor:
    """The gradients of a bucket's parameters end to end (those that have one)."""
    gs = [p.grad.reshape(-1) for p in b.params if p.grad is not None]
    return torch.cat(gs) if gs else torch.zeros(0, dtype=b.dtype, device=b.device)


def bits_checksum(p: Tensor) -> Tensor:
    """Two int64 sums of a tensor's raw bits (plain and position-weighted); wrap-around is fine."""
    bits = p.detach().reshape(-1).view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * pos).sum()]).cpu()

