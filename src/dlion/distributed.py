"""Distributed Lion (Liu et al. 2024) with Lion Cub's communication (Ishikawa et al. 2024).

Every rank runs Lion with its own momentum and sends only the sign of its update;
all ranks apply one aggregated Δ. Per step, on every rank i (papers.md §2)::

    δ_i = sign(β1·m_i + (1 − β1)·g_i)          # local, never leaves as floats
    m_i ← β2·m_i + (1 − β2)·g_i                # local momentum, never synchronised
    Δ   = rule(δ_1 … δ_N)                      # collective: majority vote or mean
    x   ← x·(1 − η·λ) − η·Δ                    # identical on every rank

Data flow, per bucket (a run of parameters laid end to end, ``bucket_cap_mb``
each, in reverse parameter order like DDP):

1. *local*: c per parameter → δ (or q for quantised aggregation) written into the
   bucket's int8 buffer; a small flag vector (who has a gradient, who abstains,
   bad or non-finite gradients);
2. *agree*: one tiny all-reduce of the flags, so every rank picks the same wire
   format and the same decision to skip;
3. *communicate*: one collective algorithm (:mod:`dlion.collectives`) → codes;
4. after all buckets: apply Δ, update the momenta, optionally synchronise
   momenta and check that replicas agree.

With ``overlap=True`` steps 1–3 of a bucket start from gradient hooks as soon
as its last gradient is accumulated, on a communication thread that handles
the buckets strictly in order (so every rank issues the same collectives in
the same order), while backward carries on.

Zero policy: a coordinate whose local update is exactly 0 — no gradient on that
rank, or c = 0 — *abstains* (see :mod:`dlion.aggregation`). A parameter with no
gradient on any rank is skipped on every rank (no decay, like ``torch.optim``).
A bucket in which some rank abstains somewhere travels as base-3 digits
(1.6 bits up) that step; buckets without abstentions cost 1 bit up.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .aggregation import VoteRule, coin_key
from .codec import ALIGN
from .collectives import (ALGORITHMS, CommStats, _all_gather, abstention_format, choose_algorithm, quantized_sum,
                          zero_runs)
from .lion import Lion, _LOW_PRECISION, _use_foreach, apply_update, check_grad, lion_momentum_update, lion_presign
from .quantize import NORMS, levels, quantize

__all__ = ["DistributedLion", "DesyncError", "Bucket", "layout_buckets", "momentum_sync_due"]

AGGREGATES = ("sign", "quantized")
NONFINITE = ("skip", "raise")


class DesyncError(RuntimeError):
    """Parameters differ between ranks (they must be bitwise identical)."""


class Bucket:
    """Parameters ``params`` (global indices) laid end to end in one flat int8 buffer,
    padded to a multiple of ALIGN·N so every rank's chunk encodes on its own."""

    def __init__(self, index: int, params: list[int], sizes: list[int], world: int, device):
        self.index = index
        self.params = params
        self.offsets, off = [], 0
        for n in sizes:
            self.offsets.append(off)
            off += n
        self.numel = off
        quantum = ALIGN * world
        self.padded = -(-off // quantum) * quantum
        self.device = device
        self.buffer = torch.zeros(self.padded, dtype=torch.int8, device=device)
        self.algorithm = "1bit"


def layout_buckets(params: list[Tensor], world: int, cap_mb: float) -> list[Bucket]:
    """Buckets in reverse parameter order (gradients arrive that way), per device;
    the cap counts fp32 parameters (``cap_mb``·2^20/4 coordinates) like DDP."""
    cap = max(1, int(cap_mb * 2**20 / 4))
    buckets: list[Bucket] = []
    pending: dict = {}
    for i in reversed(range(len(params))):
        p = params[i]
        idx, sizes = pending.setdefault(p.device, ([], []))
        if idx and sum(sizes) + p.numel() > cap:
            buckets.append(Bucket(len(buckets), idx, sizes, world, p.device))
            idx, sizes = pending[p.device] = ([], [])
        idx.append(i)
        sizes.append(p.numel())
    for dev, (idx, sizes) in pending.items():
        if idx:
            buckets.append(Bucket(len(buckets), idx, sizes, world, dev))
    return buckets


def momentum_sync_due(schedule: Union[str, int], step: int) -> bool:
    """Whether momenta are averaged after step ``step`` (1-based): every K steps for
    an int K, after steps 1, 2, 4, 8, … for ``"doubling"``, never for ``"none"``."""
    if schedule == "none" or schedule == 0:
        return False
    if schedule == "doubling":
        return step & (step - 1) == 0
    return step % int(schedule) == 0


class DistributedLion(Lion):
    """Distributed Lion: a drop-in ``torch.optim.Optimizer`` for data-parallel training.

    Use it *instead of* DDP's gradient all-reduce: each rank calls
    ``loss.backward(); opt.step()`` on its own batch. Parameters are broadcast
    from rank 0 at construction and stay bitwise identical on every rank.

    Args:
        vote: ``"mavo"`` (majority vote, Δ = sign Σδ) or ``"avg"`` (Δ = mean δ).
        ties: ``"zero"`` (a tie gives Δ = 0) or ``"random"`` (a shared coin).
        process_group: the group to aggregate over (default: the world).
        comm: collective algorithm for sign aggregation: ``"1bit"`` (all-to-all
            + all-gather), ``"allgather"`` (naive), ``"pbit"`` (packed-counter
            all-reduce) or ``"auto"`` (per bucket, see
            :func:`dlion.collectives.choose_algorithm`). All give the same Δ.
        aggregate: ``"sign"`` (vote on δ) or ``"quantized"`` (Lion Cub: Δ =
            sign Σ q_i of quantised c, see :mod:`dlion.quantize`; needs ``vote="mavo"``).
        quant_norm, quant_bits: the scale (``"l1"``, ``"linf"``, ``"l0"``) and field
            width (2, 4 or 8) of quantised aggregation.
        momentum_sync: ``"none"``, an int K (average momenta in fp32 every K
            steps) or ``"doubling"`` (after steps 1, 2, 4, 8, …).
        overlap: start each bucket's local math and communication from gradient
            hooks during backward. Use :meth:`no_sync` for all but the last
            micro-batch when accumulating gradients.
        bucket_cap_mb: bucket size, counted as fp32 parameters like DDP.
        seed: seeds the tie coins (``ties="random"``).
        check_every: every K steps compare a checksum of every parameter across
            ranks and raise :class:`DesyncError` naming the first that differs.
        nonfinite: a rank whose gradients contain inf/NaN makes every rank
            ``"skip"`` the step (counted in ``skipped_steps``) or ``"raise"``.
        sign_hook: ``sign_hook(step, delta) -> delta`` transforms this rank's int8
            signs of one bucket before they are sent (fault injection).

    Without an initialised process group, or with world size 1, it is exactly
    :class:`dlion.Lion`. ``comm_stats`` counts this rank's bytes per step.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
        bucket_cap_mb: float = 25.0,
        seed: int = 0,
        check_every: int = 0,
        nonfinite: str = "skip",
        sign_hook: Optional[Callable[[int, Tensor], Tensor]] = None,
        maximize: bool = False,
        foreach: Optional[bool] = None,
    ):
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if distributed else 1
        self.rule = VoteRule(vote, world, ties=ties, seed=seed)
        _check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                       check_every, nonfinite, sign_hook)
        self._ready = False
        super().__init__(params, lr, betas, weight_decay, maximize=maximize, foreach=foreach)
        self.process_group = process_group
        self.world_size = world
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.comm, self.aggregate = comm, aggregate
        self.quant_norm, self.quant_bits = quant_norm, quant_bits
        self.quant_levels = levels(quant_bits, world) if aggregate == "quantized" else 0
        self.momentum_sync, self.overlap, self.seed = momentum_sync, overlap, seed
        self.check_every, self.nonfinite, self.sign_hook = check_every, nonfinite, sign_hook
        self.comm_stats = CommStats()
        self.skipped_steps = 0
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self.num_params = sum(p.numel() for p in self._params)
        self._buckets: list[Bucket] = []
        self._sync = True
        self._pipeline: Optional[_Pipeline] = None
        self._hooks: list = []
        if world > 1:
            self._check_same_model()
            self._broadcast_parameters()
            self._buckets = layout_buckets(self._params, world, bucket_cap_mb)
            self._where = {i: (b, b.offsets[j]) for b in self._buckets for j, i in enumerate(b.params)}
            for b in self._buckets:
                b.algorithm = choose_algorithm(b.padded, world, self.rule) if comm == "auto" else comm
            if overlap:
                self._register_hooks()
        self._ready = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise RuntimeError(
                "DistributedLion lays out its communication buffers at construction; "
                "pass every parameter group to the constructor instead of add_param_group().")
        super().add_param_group(param_group)

    # -- construction ---------------------------------------------------------
    def _check_same_model(self) -> None:
        mine = [(tuple(p.shape), str(p.dtype).replace("torch.", "")) for p in self._params]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        ref = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if len(theirs) != len(ref):
                raise ValueError(
                    f"DistributedLion: ranks disagree on the model: rank {r} has {len(theirs)} parameters, "
                    f"rank 0 has {len(ref)}.")
            for i, (a, b) in enumerate(zip(ref, theirs)):
                if a != b:
                    raise ValueError(
                        f"DistributedLion: ranks disagree on the model at parameter {i}: rank {r} has shape "
                        f"{b[0]} dtype {b[1]}, rank 0 has shape {a[0]} dtype {a[1]}.")

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Start every rank from rank 0's parameters: one broadcast per (device, dtype)."""
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for ps in _by_device_dtype(self._params):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=src, group=self.process_group)
            _scatter_flat(flat, ps)

    def bucket_layout(self) -> list[tuple[int, int, int]]:
        """(bucket index, offset, padded bucket length) of every parameter, in
        parameter order: where its coordinates sit in the communication buffers
        (the tie coins are keyed by bucket and offset)."""
        return [(self._where[i][0].index, self._where[i][1], self._where[i][0].padded)
                for i in range(len(self._params))]

    # -- step 1: local math into a bucket's buffer -----------------------------
    def _local(self, b: Bucket) -> tuple[Tensor, Optional[Exception]]:
        """Fill ``b.buffer`` with this rank's δ (or q) and return the bucket's flags:
        [has_grad per param | bad gradient | non-finite | zero runs of rank 0 … N−1]
        (each rank fills its own run-count slot; the all-reduce sums them)."""
        k = len(b.params)
        flags = torch.zeros(k + 2 + self.world_size, dtype=torch.int32)  # filled on the CPU
        b.buffer.zero_()
        error = None
        by_group: dict = {}
        for j, i in enumerate(b.params):
            p = self._params[i]
            try:
                check_grad(i, p)
            except ValueError as e:
                error = error or e
                continue
            if p.grad is not None:
                by_group.setdefault(id(self._group_of[id(p)]), []).append(j)
        if error is not None:
            flags[k] = 1
            return flags, error
        for js in by_group.values():
            group = self._group_of[id(self._params[b.params[js[0]]])]
            ps, gs, ms = self._collect(group, [self._params[b.params[j]] for j in js])
            foreach = _use_foreach(group["foreach"], ps)
            cs = lion_presign(ms, gs, group["betas"][0], foreach=foreach)
            for j, c in zip(js, cs):
                view = b.buffer[b.offsets[j]:b.offsets[j] + c.numel()]
                if not _all_finite(c):
                    flags[k + 1] = 1
                if self.aggregate == "quantized":
                    view.copy_(quantize(c, self.quant_levels, self.quant_norm).reshape(-1))
                else:  # sign(c) as int8 without a float temporary: [c > 0] − [c < 0]
                    cf = c.reshape(-1)
                    torch.sub((cf > 0).view(torch.int8), (cf < 0).view(torch.int8), out=view)
                flags[j] = 1
        if self.sign_hook is not None:
            try:
                b.buffer[:b.numel] = _checked_hook_output(
                    self.sign_hook(self.comm_stats.steps, b.buffer[:b.numel].clone()), b.numel)
            except ValueError as e:  # like a bad gradient: every rank stops together
                flags[k] = 1
                return flags, e
        if self.aggregate == "sign":
            b.runs = zero_runs(b.buffer, b.numel) if not bool(b.buffer[:b.numel].all()) else None
            flags[k + 2 + self.rank] = 0 if b.runs is None else b.runs.shape[0]
        return flags, None

    # -- steps 2 and 3: agree on flags, run the collective ---------------------
    def _communicate(self, b: Bucket, flags: Tensor, step: int) -> None:
        flags = flags.to(b.device)  # NCCL only reduces device tensors
        self._all_reduce(flags, "flags")
        flags = flags.cpu()
        k = len(b.params)
        b.has_grad = flags[:k].tolist()
        b.failed = int(flags[k])
        b.nonfinite = int(flags[k + 1])
        b.codes = None
        if b.failed or b.nonfinite or not any(b.has_grad):
            return
        if self.aggregate == "quantized":
            total = quantized_sum(b.buffer, self.quant_levels, group=self.process_group, stats=self.comm_stats)
            b.codes = torch.sign(total).to(torch.int8)
            return
        zeros = self._agree_on_abstentions(b, flags[k + 2:].tolist())
        b.codes = ALGORITHMS[b.algorithm](b.buffer, zeros, self.rule, group=self.process_group,
                                          stats=self.comm_stats, key=coin_key(self.seed, step, b.index))

    def _agree_on_abstentions(self, b: Bucket, run_counts: list[int]):
        """The ``zeros`` argument of the collective: False, every rank's zero-run table
        (one small all-gather), or True (ternary), by :func:`abstention_format`."""
        fmt = abstention_format(run_counts, b.padded, self.world_size)
        if fmt != "runs":
            return fmt == "ternary"
        most = max(run_counts)
        mine = torch.zeros(most, 2, dtype=torch.int32, device=b.device)  # padded with empty runs
        if b.runs is not None:
            mine[:b.runs.shape[0]] = b.runs.to(b.device)
        everyone = torch.empty(self.world_size * most * 2, dtype=torch.int32, device=b.device)
        _all_gather(everyone, mine.view(-1), group=self.process_group)
        moved = mine.numel() * 4 * (self.world_size - 1)
        self.comm_stats.add("zero_runs", moved, moved)
        return everyone.view(self.world_size, most, 2)

    def _all_reduce(self, t: Tensor, kind: str) -> None:
        dist.all_reduce(t, group=self.process_group)
        moved = t.numel() * t.element_size() * 2 * (self.world_size - 1) / self.world_size
        self.comm_stats.add(kind, moved, moved)

    # -- the step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        if self.world_size == 1:
            loss = super().step(closure)
            self.comm_stats.steps += 1
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.comm_stats.steps
        if self._pipeline is not None:
            errors = self._pipeline.finish(self)
            self._pipeline = None
        else:
            errors = []
            for b in self._buckets:
                flags, err = self._local(b)
                errors.append(err)
                self._communicate(b, flags, step)
        self._finish(step, [e for e in errors if e is not None])
        return loss

    def _finish(self, step: int, errors: list) -> None:
        """Apply Δ and update momenta — or, if any rank failed, change nothing anywhere."""
        if errors:
            raise errors[0]
        failed = sum(b.failed for b in self._buckets)
        if failed:
            raise RuntimeError(f"DistributedLion: another rank rejected its gradients (its error says why); "
                               "no rank changed any parameter or momentum.")
        if any(b.nonfinite for b in self._buckets):
            if self.nonfinite == "raise":
                raise FloatingPointError(
                    f"DistributedLion: a rank has inf/NaN gradients at step {step}; no rank changed anything.")
            self.skipped_steps += 1
            self.comm_stats.steps += 1
            return
        active = {i for b in self._buckets for j, i in enumerate(b.params) if b.has_grad[j] > 0}
        for group in self.param_groups:
            ps, deltas = [], []
            for p in group["params"]:
                i = self._index[id(p)]
                if i not in active:
                    continue
                b, off = self._where[i]
                dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
                deltas.append(self.rule.delta(b.codes[off:off + p.numel()], dtype).view_as(p))
                ps.append(p)
            if ps:
                apply_update(ps, deltas, group["lr"], group["weight_decay"], foreach=_use_foreach(group["foreach"], ps))
            local = [p for p in group["params"] if p.grad is not None]
            if local:
                _, gs, ms = self._collect(group, local)
                lion_momentum_update(ms, gs, group["betas"][1], foreach=_use_foreach(group["foreach"], local))
            for p in ps:
                state = self._state(p)
                state["step"] += 1
        self.comm_stats.steps += 1
        if momentum_sync_due(self.momentum_sync, self.comm_stats.steps):
            self.synchronize_momenta()
        if self.check_every and self.comm_stats.steps % self.check_every == 0:
            self.check_replicas()

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:  # a gradient elsewhere but never here yet
            dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["step"] = torch.tensor(0.0)
        return state

    def _collect(self, group: dict, params: Optional[list] = None):
        if params is None:
            return super()._collect(group)
        sub = dict(group, params=params)
        return super()._collect(sub)

    # -- Lion Cub extras ---------------------------------------------------------
    @torch.no_grad()
    def synchronize_momenta(self) -> None:
        """Average every rank's momentum in fp32 (one all-reduce per device and dtype).
        Costs 2·(N−1)/N·32 bits per parameter each way when it runs."""
        if self.world_size == 1:
            return
        ms = [self._state(p)["exp_avg"] for p in self._params]
        for group in _by_device_dtype(ms):
            flat = torch.cat([m.reshape(-1) for m in group]).float()
            self._all_reduce(flat, "momentum_sync")
            flat.div_(self.world_size)
            _scatter_flat(flat, group)

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`DesyncError` unless every parameter is bitwise identical on all
        ranks: compares two 64-bit checksums of each parameter's bits (16 bytes per
        parameter per rank through an all-gather)."""
        if self.world_size == 1:
            return
        device = self._params[0].device  # NCCL only gathers device tensors
        mine = torch.stack([_checksum(p) for p in self._params]).view(torch.int32).reshape(-1).to(device)
        everyone = torch.empty(mine.numel() * self.world_size, dtype=torch.int32, device=device)
        _all_gather(everyone, mine, group=self.process_group)
        everyone = everyone.cpu()
        n = mine.numel() * 4
        self.comm_stats.add("check", n * (self.world_size - 1), n * (self.world_size - 1))
        table = everyone.view(self.world_size, len(self._params), 4)
        for i, p in enumerate(self._params):
            for r in range(1, self.world_size):
                if not torch.equal(table[r, i], table[0, i]):
                    raise DesyncError(
                        f"DistributedLion: parameter {i} (shape {tuple(p.shape)}) differs between rank 0 and "
                        f"rank {r} after step {self.comm_stats.steps}; replicas have diverged.")

    # -- overlap with backward ---------------------------------------------------
    def _register_hooks(self) -> None:
        for p in self._params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: Tensor) -> None:
        if not self._sync:
            return
        if self._pipeline is None:
            self._pipeline = _Pipeline(self, self.comm_stats.steps)
        self._pipeline.grad_ready(self._index[id(p)])

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
        sd = super().state_dict()
        sd["dlion"] = {"comm_stats": self.comm_stats.state_dict(), "world_size": self.world_size,
                       "rank": self.rank, "vote": self.rule.vote, "ties": self.rule.ties, "seed": self.seed,
                       "aggregate": self.aggregate, "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("dlion", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self.comm_stats.load_state_dict(extra["comm_stats"])
            self.skipped_steps = int(extra.get("skipped_steps", 0))


class _Pipeline:
    """One step's buckets in flight: gradient hooks mark parameters ready; a thread
    runs each bucket's local math and collectives strictly in bucket order."""

    def __init__(self, opt: DistributedLion, step: int):
        self.pending = [{i for i in b.params if opt._params[i].requires_grad} for b in opt._buckets]
        self.seen: set = set()
        self.ready = [threading.Event() for _ in opt._buckets]
        self.errors: list = [None] * len(opt._buckets)
        self.failure: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(opt, step), daemon=True)
        self.thread.start()

    def grad_ready(self, i: int) -> None:
        if i in self.seen:
            warnings.warn("DistributedLion(overlap=True): a gradient was accumulated again after its bucket "
                          "was sent; wrap all micro-batches but the last in opt.no_sync().", stacklevel=3)
            return
        self.seen.add(i)
        for k, pending in enumerate(self.pending):
            if i in pending:
                pending.discard(i)
                if not pending:
                    self.ready[k].set()
                return

    def _run(self, opt: DistributedLion, step: int) -> None:
        try:
            with torch.no_grad():
                for b, ready in zip(opt._buckets, self.ready):
                    ready.wait()
                    flags, self.errors[b.index] = opt._local(b)
                    opt._communicate(b, flags, step)
        except BaseException as e:  # surfaced by finish()
            self.failure = e

    def finish(self, opt: DistributedLion) -> list:
        for ev in self.ready:  # buckets whose parameters got no gradient this step
            ev.set()
        self.thread.join()
        if self.failure is not None:
            raise self.failure
        return self.errors


def _check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb,
                   check_every, nonfinite, sign_hook) -> None:
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
    if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"check_every must be an int >= 0, got {check_every!r}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"Unknown nonfinite {nonfinite!r}; choose one of {', '.join(map(repr, NONFINITE))}.")


def _all_finite(c: Tensor) -> bool:
    """One min/max reduction (NaN propagates, ±inf shows at an end): ~20× cheaper than isfinite().all()."""
    return bool(torch.isfinite(torch.stack(torch.aminmax(c.reshape(-1)))).all()) if c.numel() else True


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


def _checksum(p: Tensor) -> Tensor:
    """Two int64 sums of a tensor's raw bits (plain and position-weighted); wrap-around is fine."""
    bits = p.detach().reshape(-1).view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * pos).sum()]).cpu()
