"""What every distributed Lion optimizer of dlion shares, and the options they take.

:class:`DistributedBase` is the common base of :class:`dlion.DistributedLion` (every rank a
voter), :class:`dlion.LocalDistributedLion` (its subclass: the vote on H local steps) and
:class:`dlion.HierarchicalDistributedLion` (every node a voter). It owns, once:

* the option checks (:func:`check_options`, :func:`reject_unsupported`) and the agreement of
  every rank on the model and the options at construction (``_check_same_model``: shapes,
  dtypes, ``requires_grad``, names where given, every option, whether the native kernels
  loaded), then the initial broadcast of rank 0's parameters;
* the per-step hyperparameter digest that rides in every bucket's header, the gradient and
  frozen-parameter checks, and the failure policy applied to what the exchange reports
  (a bad gradient or a digest that differs: every rank raises; inf/NaN: every rank skips or
  raises, ``nonfinite=``);
* the replica check (checksums of every parameter and of the model's structure);
* the checkpoint record (``state_dict()["dlion"]``) and the refusal of state it cannot take
  (another optimizer type, another rank's state unless ``from_rank="any"``);
* uneven inputs: ``torch.distributed.algorithms.Join`` (a rank that has run out of data answers
  the others' steps with steps without gradients until every rank is done).

A driver says how its ranks are arranged (``_groups``: the process groups, outermost first,
along which objects are gathered and parameters broadcast) and how a checksum row reaches
every rank (``_all_gather_rows``); the step itself is the driver's.
"""

from __future__ import annotations

import contextlib
import re
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, JoinHook, Joinable

from . import kernels
from .buckets import Bucket, RankBuffers, bucket_caps
from .collectives import CommStats
from .lion import Lion, check_grad, param_tensors
from .quantize import NORMS, levels
from .replicas import broadcast_parameters, checksum_table, raise_if_diverged
from .vote import VoteRule
from .wire import ALGORITHMS, WireState, choose_algorithm, make_algorithm

__all__ = ["DistributedBase", "BucketState", "check_options", "reject_unsupported", "momentum_sync_due",
           "order_warning_silenced", "ORDER_WARNING", "AGGREGATES", "NONFINITE_POLICIES"]

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


def momentum_sync_due(schedule: Union[str, int], step: int) -> bool:
    """Whether momenta are averaged after step ``step`` (1-based): every K steps for
    an int K, after steps 1, 2, 4, 8, … for ``"doubling"``, never for ``"none"``."""
    if schedule == "none" or schedule == 0:
        return False
    if schedule == "doubling":
        return step & (step - 1) == 0
    return step % int(schedule) == 0


def check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                  check_every, nonfinite, sign_hook) -> None:
    """Raise ``ValueError`` naming the first invalid option of a distributed optimizer."""
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


@dataclass
class BucketState:
    """Everything one bucket carries from step to step on this rank: its layout, the buffers of
    its Lion math (momentum, c, δ, codes), its collective algorithm and the wire format the ranks
    agreed on for it. Drivers add what is theirs (:class:`dlion.distributed.FlatBucket`,
    :class:`dlion.hierarchical.NodeBucket`)."""

    bucket: Bucket
    buffers: RankBuffers
    algorithm: object
    wire: WireState


#: what each kind of saved state is called in messages, and what it holds
_KINDS = {
    "flat": "a flat optimizer (dlion.DistributedLion), which keeps one momentum per rank",
    "hierarchical": "dlion.HierarchicalDistributedLion, which keeps one momentum per node, sharded across the "
                    "node's ranks",
    "local": "dlion.LocalDistributedLion, whose state holds an anchor, residuals and each rank's local parameters",
}


class _ShadowSteps(JoinHook):
    """``torch.distributed.algorithms.Join``: a rank that has run out of data answers each step of
    the ranks still training with a step of its own without gradients (it abstains on every
    parameter) and applies the same Δ, so the replicas stay bitwise identical."""

    def __init__(self, opt: "DistributedBase"):
        self.opt = opt

    def main_hook(self) -> None:
        self.opt._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.opt.check_every:  # (every rank runs the post-hooks, once all have joined)
            self.opt.check_replicas()


class DistributedBase(Lion, Joinable):
    """The common base of dlion's distributed optimizers (see the module's docstring).

    Subclasses call ``super().__init__`` with the shared options, set ``world_size``, ``rank``
    and ``_groups``, call :meth:`_start` with the number of voters (which builds the vote rule,
    checks that every rank agrees and broadcasts rank 0's parameters), lay out their buckets into
    ``buckets`` and ``_slots`` (one :class:`BucketState` each) and call :meth:`_laid_out`.
    """

    #: start every rank from rank 0's parameters (one broadcast at construction). A subclass whose ranks
    #: build the model from the same seed may set it False to skip that broadcast on a slow link (the
    #: benchmarks do); :meth:`check_replicas` then shows whether the replicas really start equal.
    broadcast_at_start = True
    #: the kind of state this optimizer saves and loads (a key of ``_KINDS``)
    _STATE_KIND = "flat"
    #: what ``load_state_dict``'s ``from_rank`` accepts
    FROM_RANK = ("own", "any")

    def __init__(
        self, params: Iterable, lr: float, betas: tuple[float, float], weight_decay: float, *,
        vote: str, ties: str, comm: str, aggregate: str, quant_norm: str, quant_bits: int,
        momentum_sync: Union[str, int], bucket_cap_mb: Union[float, Sequence[float]], seed: int,
        check_every: int, nonfinite: str, sign_hook: Optional[Callable], maximize: bool,
        foreach: Optional[bool], momentum_dtype: Optional[torch.dtype], fused: bool,
    ):
        check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                      check_every, nonfinite, sign_hook)
        Joinable.__init__(self)  # a disabled join config until a Join context manager sets one
        self._shadowing = False  # a Join shadow step is running (_shadow_step)
        params = reject_unsupported(params)
        self._agree_on_kernels = True  # (fused=True: in _start, on every rank at once)
        super().__init__(params, lr, betas, weight_decay, maximize=maximize, foreach=foreach,
                         momentum_dtype=momentum_dtype, fused=fused)
        #: why the native kernels did not load on this rank (fused=True only), else None
        self._kernels_error = kernels.load_error() if any(g.get("fused") for g in self.param_groups) else None
        self._vote, self._ties = vote, ties
        self.comm, self.aggregate = comm, aggregate
        self.quant_norm, self.quant_bits = quant_norm, quant_bits
        self.momentum_sync, self.seed = momentum_sync, seed
        self.check_every, self.nonfinite = check_every, nonfinite
        self.bucket_cap_mb = list(bucket_cap_mb) if isinstance(bucket_cap_mb, (list, tuple)) else bucket_cap_mb
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
        self.world_size, self.rank = 1, 0
        #: the process groups that join the ranks, outermost first (None: the world)
        self._groups: list = []
        self.buckets: list[Bucket] = []
        #: one record per bucket (a BucketState): what it carries from step to step
        self._slots: list = []
        self._frozen: list = []
        self._trainable: set = set()

    # -- construction -----------------------------------------------------------------
    def _start(self, voters: int) -> None:
        """Build the vote rule for ``voters`` voters; then, with several ranks, check that every rank
        has the same model and options (and, with ``fused=True``, loaded the kernels) and start every
        rank from rank 0's parameters."""
        self.rule = VoteRule(self._vote, voters, ties=self._ties, seed=self.seed)
        self.quant_levels = levels(self.quant_bits, voters) if self.aggregate == "quantized" else 0
        if self.world_size == 1:
            if self._kernels_error is not None:
                raise RuntimeError(kernels.fused_error({None: self._kernels_error}))
            return
        self._check_same_model(self._kernels_error)
        if self.broadcast_at_start:
            broadcast_parameters(self._params, self._groups)

    def _laid_out(self) -> None:
        """The buckets are laid out: remember which parameters travel and which are frozen."""
        self._trainable = {id(p) for b in self.buckets for p in b.params}
        self._frozen = [p for p in self._params if not p.requires_grad]
        self._ready = True

    def _make_algorithm(self, padded: int, num_params: int):
        """The collective algorithm of a bucket (or slice) of ``padded`` coordinates and ``num_params``
        parameters: the one ``comm`` names, or ``comm="auto"``'s choice for its size."""
        if self.aggregate == "quantized":
            return make_algorithm("quantized", self.rule, self.quant_levels)
        name = choose_algorithm(padded, num_params, self.rule) if self.comm == "auto" else self.comm
        return make_algorithm(name, self.rule)

    @staticmethod
    def _new_wire(algorithm) -> WireState:
        return WireState(up="narrow" if algorithm.name == "pbit" else "runs")

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise RuntimeError(
                f"{type(self).__name__} lays out its communication buffers at construction; "
                "pass every parameter group to the constructor instead of add_param_group().")
        super().add_param_group(param_group)

    def _options(self) -> dict:
        """The options every rank must share, by name (a subclass adds its own)."""
        return {"vote": self.rule.vote, "ties": self.rule.ties, "seed": self.seed, "comm": self.comm,
                "aggregate": self.aggregate, "quant_norm": self.quant_norm, "quant_bits": self.quant_bits,
                "momentum_sync": str(self.momentum_sync), "bucket_cap_mb": self.bucket_cap_mb,
                "check_every": self.check_every, "nonfinite": self.nonfinite,
                "momentum_dtype": str(self.momentum_dtype)}

    def _gather_objects(self, obj) -> list:
        """``obj`` of every rank, in rank order, identical on every rank: gathered along the innermost
        group first, then each list along the next group out (one small object all-gather per group)."""
        for g in reversed(self._groups):
            everyone: list = [None] * dist.get_world_size(g)
            dist.all_gather_object(everyone, obj, group=g)
            obj = everyone
        for _ in self._groups[1:]:
            obj = [x for inner in obj for x in inner]
        return obj

    def _check_same_model(self, kernels_error: Optional[str] = None) -> None:
        """Shapes, dtypes, requires_grad and, when the parameters were given with names
        (``model.named_parameters()``), names, in order, and the options: the same on every rank.
        Without names, two same-shape parameters in another order on one rank cannot be told
        apart (building the model the same way on every rank is the user's contract). With
        ``fused=True``, whether each rank loaded the native kernels (``kernels_error``: why not):
        where any could not, every rank raises the same error."""
        who = type(self).__name__
        names = self._param_names()
        self._warn_if_order_unchecked(names)
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", ""), bool(p.requires_grad), n)
                for p, n in zip(self._params, names)]
        everyone = self._gather_objects((mine, self._options(), kernels_error))
        failed = {r: e for r, (_, _, e) in enumerate(everyone) if e is not None}
        if failed:
            raise RuntimeError(kernels.fused_error(failed))
        ref, ref_cfg, _ = everyone[0]
        for r, (theirs, cfg, _) in enumerate(everyone[1:], start=1):
            if len(theirs) != len(ref):
                raise ValueError(
                    f"{who}: ranks disagree on the model: rank {r} has {len(theirs)} parameters, "
                    f"rank 0 has {len(ref)}.")
            for i, (a, b) in enumerate(zip(ref, theirs)):
                if a[3] is not None and b[3] is not None and a[3] != b[3]:
                    raise ValueError(
                        f"{who}: ranks disagree on the model at parameter {i}: it is {b[3]!r} on rank "
                        f"{r} and {a[3]!r} on rank 0 (parameters in another order, or another model); the initial "
                        "broadcast would copy one parameter's weights into another. Give the parameters in the "
                        "same order on every rank.")
                if a[:2] != b[:2]:
                    raise ValueError(
                        f"{who}: ranks disagree on the model at parameter {i}: rank {r} has shape "
                        f"{b[0]} dtype {b[1]}, rank 0 has shape {a[0]} dtype {a[1]}.")
                if a[2] != b[2]:
                    raise ValueError(
                        f"{who}: ranks disagree on the model at parameter {i}: requires_grad is "
                        f"{b[2]} on rank {r} and {a[2]} on rank 0.")
            if cfg != ref_cfg:
                diff = [f"{n}={cfg.get(n)!r} on rank {r}, {ref_cfg.get(n)!r} on rank 0"
                        for n in dict.fromkeys([*ref_cfg, *cfg]) if cfg.get(n) != ref_cfg.get(n)]
                raise ValueError(f"{who}: ranks disagree on the optimizer's options: " + "; ".join(diff))

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
                UserWarning, stacklevel=5)

    def _structure(self) -> str:
        """The model's structure as every rank must see it: names (where given), shapes and dtypes, in order."""
        return "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for p, n in zip(self._params, self._param_names()))

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
        return [s.algorithm.name for s in self._slots]

    # -- every step --------------------------------------------------------------------
    def _count_step(self) -> None:
        self.step_count += 1
        self.comm_stats.steps += 1

    def _refuse_late_process_group(self) -> None:
        """World size 1 at construction: raise if a process group of several ranks exists now."""
        group = getattr(self, "process_group", None)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            raise RuntimeError(
                f"{type(self).__name__} was built before torch.distributed.init_process_group(), so it is plain "
                f"Lion on one rank, but the process group now has {dist.get_world_size(group)} ranks: their replicas "
                "would diverge. Build the optimizer after init_process_group().")

    def _local_step(self, closure):
        """World size 1: exactly :class:`dlion.Lion`'s step, counted."""
        loss = Lion.step(self, closure)
        self._count_step()
        return loss

    #: what :meth:`_digest` covers, as the error names it
    _digested = "lr, betas, weight_decay or maximize"

    def _digest(self, group: dict) -> int:
        """31-bit digest of the per-step hyperparameters a rank applies to a group."""
        b1, b2 = group["betas"]
        raw = struct.pack("<dddd?", float(group["lr"]), float(b1), float(b2), float(group["weight_decay"]),
                          bool(group["maximize"]))
        return zlib.crc32(raw) & 0x7FFFFFFF

    @staticmethod
    def _grad_error(b: Bucket) -> Optional[Exception]:
        """The first invalid gradient of bucket ``b`` on this rank (sparse, another dtype …), or None."""
        error = None
        for i, p in zip(b.indices, b.params):
            try:
                check_grad(i, p)
            except ValueError as e:
                error = error or e
        return error

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.grad is not None and id(p) not in self._trainable:
                raise RuntimeError(
                    f"{type(self).__name__}: a parameter of shape {tuple(p.shape)} has a gradient but had "
                    "requires_grad=False when the optimizer was built, so it has no place in the communication "
                    "buffers; build the optimizer after unfreezing it.")

    def _skips(self, step_no: int, *, own_error: Optional[Exception], bad: bool, digests_agree: bool,
               nonfinite: bool, nonfinite_ranks: Optional[Sequence[int]] = None) -> bool:
        """The failure policy, applied to what the exchange reported (identical on every rank, so every
        rank takes the same branch): this rank's invalid gradient is raised; another rank's, or
        hyperparameters that differ between ranks, raise too; inf/NaN gradients skip the step (counted,
        with a warning after ``warn_after_skips`` in a row) or raise (``nonfinite="raise"``). Returns
        whether the step is skipped; nothing has been applied in either case."""
        who = type(self).__name__
        if own_error is not None:
            raise own_error
        if bad:
            raise RuntimeError(f"{who}: another rank rejected its gradients (its error says why); "
                               "no rank changed any parameter or momentum.")
        if not digests_agree:
            raise ValueError(
                f"{who}: ranks disagree on {self._digested} at step {step_no} (e.g. an "
                "LR scheduler stepped on one rank only); no rank changed anything.")
        if not nonfinite:
            self._skips_in_a_row = 0
            return False
        if self.nonfinite == "raise":
            raise FloatingPointError(f"{who}: a rank has inf/NaN gradients at step {step_no}; no rank changed "
                                     "anything.")
        self.skipped_steps += 1
        self._count_step()
        self._skips_in_a_row += 1
        if self._skips_in_a_row == self.warn_after_skips:
            if nonfinite_ranks is None:
                whose = "some rank"
            else:
                ranks = sorted(set(nonfinite_ranks))
                whose = (f"rank(s) {', '.join(map(str, ranks))}" if ranks
                         else "some rank (this comm does not say which)")
            warnings.warn(f"{who}: {self._skips_in_a_row} steps in a row skipped because {whose} had "
                          "inf/NaN gradients; training is not progressing (check that rank's data and loss "
                          "scale, or use nonfinite='raise').", RuntimeWarning, stacklevel=5)
        return True

    # -- uneven inputs: torch.distributed.algorithms.Join -------------------------------
    def _announce(self):
        """Inside ``Join``: tell the context manager that this rank is still training (one all-reduce on
        the join group, issued before the step's collectives); None outside a Join context and in a
        shadow step."""
        return None if self._shadowing else Join.notify_join_context(self)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` runs on a rank that has run out of data, once per step of the ranks still
        training: a step without gradients (:meth:`_shadow_step`). A driver refuses what it cannot shadow."""
        return _ShadowSteps(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        group = getattr(self, "process_group", None)
        return group if group is not None else dist.group.WORLD

    @torch.no_grad()
    def _shadow_step(self) -> None:
        """A step with no gradient on this rank: the same collectives as the other ranks' step, this rank
        abstaining everywhere (the hierarchical optimizer: a zero in its node's mean), then the agreed Δ
        like every rank. Its own ``.grad`` are put back afterwards."""
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

    # -- replicas ---------------------------------------------------------------------
    def _all_gather_rows(self, row: Tensor) -> Tensor:
        """Every rank's ``row`` stacked in rank order (the driver's transports count the bytes)."""
        raise NotImplementedError

    def _replica_view(self):
        """A context in which the parameters are what must be identical on every rank (the local-step
        optimizer's anchor; by default the parameters as they are)."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`dlion.DesyncError` unless every parameter is bitwise identical on all
        ranks: compares two 64-bit checksums of each parameter's bits (16 bytes per
        parameter per rank through an all-gather), and a fingerprint of the model's structure
        (names where given, shapes and dtypes, in order; 16 bytes more)."""
        if self.world_size == 1:
            return
        with self._replica_view():
            structure = self._structure()
            everyone = self._all_gather_rows(checksum_table(self._params, structure))
            raise_if_diverged(everyone, self._params, self.world_size, type(self).__name__, self.step_count,
                              structure)

    # -- checkpointing ------------------------------------------------------------------
    def _record(self) -> dict:
        """``state_dict()["dlion"]``: what a resumed run needs besides ``torch.optim``'s state (a
        driver adds its own entries)."""
        return {"step_count": self.step_count, "comm_stats": self.comm_stats.state_dict(),
                "world_size": self.world_size, "rank": self.rank, "vote": self.rule.vote, "ties": self.rule.ties,
                "seed": self.seed, "aggregate": self.aggregate, "skipped_steps": self.skipped_steps,
                # the settings of the rule (since 0.3), so a resume under other ones says so
                "options": self._options(),
                # the agreed wire formats (identical on every rank), so a resumed run sends the same bytes
                "wire": [(s.wire.up, s.wire.down) for s in self._slots]}

    def _load_record(self, extra: dict) -> None:
        self._warn_if_options_changed(extra)
        self.comm_stats.load_state_dict(extra["comm_stats"])
        self.step_count = int(extra.get("step_count", self.comm_stats.steps))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        wire = extra.get("wire") or []
        if len(wire) == len(self._slots):  # (another layout, e.g. another world size: start afresh)
            for s, (up, down) in zip(self._slots, wire):
                s.wire.up, s.wire.down = up, down

    def state_dict(self) -> dict:
        record = self._record()  # (first: a driver may complete an exchange in flight to record it)
        sd = super().state_dict()
        sd["dlion"] = record
        return sd

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

    @staticmethod
    def _saved_kind(extra: dict) -> str:
        if extra.get("hierarchical") is not None:
            return "hierarchical"
        return "local" if extra.get("local") is not None else "flat"

    def _accepts_kind(self, kind: str) -> bool:
        return kind == self._STATE_KIND

    def _check_position(self, extra: dict, from_rank: str) -> None:
        """Raise unless this rank may take the state that rank ``extra["rank"]`` saved."""
        saved_rank = extra.get("rank")
        if from_rank == "own" and saved_rank is not None and int(saved_rank) != self.rank:
            raise ValueError(
                f"{type(self).__name__}: this state was saved by rank {saved_rank} (of "
                f"{extra.get('world_size', '?')}); this is rank {self.rank} (of {self.world_size}). Each rank keeps "
                "its own momentum: load each rank's own state, or pass load_state_dict(sd, from_rank='any') (or use "
                "`with opt.accepting_any_rank():`) to start this rank from that rank's momenta on purpose "
                "(dlion.checkpoint.load does so when the world size changed).")

    def check_state_dict(self, state_dict: dict, *, from_rank: str = "own") -> None:
        """Raise ``ValueError`` if this rank should not load ``state_dict``: state of another optimizer
        type (no ``"dlion"`` record: a plain :class:`dlion.Lion`, ``torch.optim.Adam``, ...; or another
        distributed optimizer's), or another rank's state unless ``from_rank="any"``.
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
                f"distributed dlion optimizer; it looks like {what}. Loading it would take that optimizer's "
                "hyperparameters and momenta as this one's. Start this optimizer afresh (or load the model only).")
        kind = self._saved_kind(extra)
        if not self._accepts_kind(kind):
            raise ValueError(
                f"{name} cannot load this state: it was saved by {_KINDS[kind]}; this optimizer is "
                f"{_KINDS[self._STATE_KIND].split(',')[0]}. Resume with the optimizer that saved it.")
        self._check_position(extra, from_rank)

    def _option_changes(self, extra: dict) -> dict:
        """{option: (saved, this optimizer's)} for each setting that differs from those a state
        was saved with (since 0.3 a state records them all; before, none)."""
        saved = extra.get("options")
        if not isinstance(saved, dict):
            return {}
        mine = self._options()
        return {k: (saved[k], mine[k]) for k in mine if k in saved and saved[k] != mine[k]}

    def _warn_if_options_changed(self, extra: dict) -> None:
        """Warn (not raise: a new H or ties policy may be meant) when this optimizer's settings differ
        from those the state was saved with; they are not restored, only ``lr`` and the betas
        (``param_groups``) are. Quiet under :func:`dlion.checkpoint.load`, which reports the same
        changes itself (``LoadInfo.config_changes``, an error with ``strict=True``)."""
        changed = self._option_changes(extra)
        if changed and not getattr(self, "_options_reported", False):
            what = ", ".join(f"{k}={a!r} -> {b!r}" for k, (a, b) in changed.items())
            warnings.warn(f"{type(self).__name__}: this state was saved with other settings ({what}); it continues "
                          "under this optimizer's. Construct the optimizer with the saved ones to continue the same "
                          "run.", UserWarning, stacklevel=4)
