"""Distributed Lion (Liu et al. 2024): every rank runs Lion with its own momentum
and sends only the sign of its update; all ranks apply one aggregated Δ.

Per step, on every rank i (papers.md §2)::

    δ_i = sign(β1·m_i + (1 − β1)·g_i)          # local, never leaves as floats
    m_i ← β2·m_i + (1 − β2)·g_i                # local momentum, never synchronised
    Δ   = rule(δ_1 … δ_N)                      # collective: majority vote or mean
    x   ← x·(1 − η·λ) − η·Δ                    # identical on every rank

Data flow: parameters are laid out once in a few flat buckets (per device,
``bucket_cap_mb`` each); each step writes the local signs of a bucket into one
int8 buffer, agrees on a tiny flag vector (which parameters have a gradient
anywhere, which buckets contain an abstention), runs one collective algorithm
per bucket (:mod:`dlion.collectives`) and applies the codes it returns.

Zero policy (documented contract): a coordinate whose local update is exactly 0
— no gradient on that rank, or c = 0 — *abstains* (see
:mod:`dlion.aggregation`). A parameter with no gradient on any rank is skipped
entirely on every rank (no decay, like ``torch.optim``); a parameter with a
gradient on some ranks counts the others as abstentions. Because the wire
format must say "abstain", a bucket in which some rank abstains somewhere is
sent as base-3 digits (1.6 bits up) that step instead of 1 bit; buckets without
abstentions — the usual case once momenta are non-zero — cost 1 bit up.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .aggregation import VoteRule, coin_key
from .codec import ALIGN
from .collectives import ALGORITHMS, CommStats
from .lion import Lion, apply_update, check_grad, lion_momentum_update, lion_presign, _use_foreach, _LOW_PRECISION

__all__ = ["DistributedLion"]


class _Bucket:
    """A run of parameters laid end to end in one flat int8 sign buffer."""

    def __init__(self, index: int, params: list[int], sizes: list[int], world: int, device):
        self.index = index
        self.params = params  # global parameter indices
        self.offsets = []
        off = 0
        for n in sizes:
            self.offsets.append(off)
            off += n
        self.numel = off
        quantum = ALIGN * world
        self.padded = -(-off // quantum) * quantum
        self.device = device
        self.signs = torch.zeros(self.padded, dtype=torch.int8, device=device)


class DistributedLion(Lion):
    """Distributed Lion: a drop-in ``torch.optim.Optimizer`` for data-parallel training.

    Use it *instead of* DDP's gradient all-reduce: each rank calls
    ``loss.backward(); opt.step()`` on its own batch. Parameters are broadcast
    from rank 0 at construction and stay bitwise identical on every rank.

    Args:
        vote: ``"mavo"`` (majority vote, Δ = sign Σδ) or ``"avg"`` (Δ = mean δ).
        ties: ``"zero"`` (a tie gives Δ = 0) or ``"random"`` (a shared coin).
        process_group: the group to aggregate over (default: the world).
        comm: collective algorithm, ``"1bit"`` (all-to-all + all-gather) or
            ``"allgather"`` (naive reference).
        bucket_cap_mb: bucket size, counted as fp32 parameters like DDP.
        seed: seeds the tie coins (``ties="random"``).

    Without an initialised process group, or with world size 1, it is exactly
    :class:`dlion.Lion`. ``comm_stats`` counts this rank's bytes sent and received.
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
        comm: str = "1bit",
        bucket_cap_mb: float = 25.0,
        seed: int = 0,
        maximize: bool = False,
        foreach: Optional[bool] = None,
    ):
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if distributed else 1
        self.rule = VoteRule(vote, world, ties=ties, seed=seed)
        if comm not in ALGORITHMS:
            raise ValueError(f"Unknown comm {comm!r}; choose one of {', '.join(map(repr, ALGORITHMS))}.")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self._ready = False
        super().__init__(params, lr, betas, weight_decay, maximize=maximize, foreach=foreach)
        self.process_group = process_group
        self.world_size = world
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.comm = comm
        self._algorithm = ALGORITHMS[comm]
        self.seed = seed
        self.comm_stats = CommStats()
        self._params = [p for g in self.param_groups for p in g["params"]]
        self.num_params = sum(p.numel() for p in self._params)
        self._buckets: list[_Bucket] = []
        if world > 1:
            self._check_same_model()
            self._broadcast_parameters()
            self._buckets = self._make_buckets(bucket_cap_mb)
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
        groups: dict = {}
        for p in self._params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        for ps in groups.values():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=src, group=self.process_group)
            off = 0
            for p in ps:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def _make_buckets(self, cap_mb: float) -> list[_Bucket]:
        """Buckets in reverse parameter order (gradients arrive that way), per device."""
        cap = max(1, int(cap_mb * 2**20 / 4))
        buckets: list[_Bucket] = []
        pending: dict = {}
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            idx, sizes = pending.setdefault(p.device, ([], []))
            if idx and sum(sizes) + p.numel() > cap:
                buckets.append(_Bucket(len(buckets), idx, sizes, self.world_size, p.device))
                idx, sizes = pending[p.device] = ([], [])
            idx.append(i)
            sizes.append(p.numel())
        for dev, (idx, sizes) in pending.items():
            if idx:
                buckets.append(_Bucket(len(buckets), idx, sizes, self.world_size, dev))
        self._where = {}
        for b in buckets:
            for j, i in enumerate(b.params):
                self._where[i] = (b, b.offsets[j])
        return buckets

    def bucket_layout(self) -> list[tuple[int, int, int]]:
        """(bucket index, offset, padded bucket length) of every parameter, in
        parameter order: where its coordinates sit in the communication buffers
        (the tie coins are keyed by bucket and offset)."""
        return [(self._where[i][0].index, self._where[i][1], self._where[i][0].padded) for i in range(len(self._params))]

    # -- the step -------------------------------------------------------------
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
        index = {id(p): i for i, p in enumerate(self._params)}
        T = len(self._params)
        # [has_grad | has_zero] per parameter, then how many ranks rejected their gradients.
        flags = torch.zeros(2 * T + 1, dtype=torch.int32)
        try:
            for i, p in enumerate(self._params):
                check_grad(i, p)
        except ValueError:
            # Still join the flag all-reduce, so the other ranks stop too instead of hanging.
            flags[-1] = 1
            self._all_reduce_flags(flags)
            raise
        for b in self._buckets:
            b.signs.zero_()
        local = []  # (group, params, grads, momenta) for the momentum update later
        for group in self.param_groups:
            ps, gs, ms = self._collect(group)
            if not ps:
                continue
            foreach = _use_foreach(group["foreach"], ps)
            c = lion_presign(ms, gs, group["betas"][0], foreach=foreach)
            signs = torch._foreach_sign(c) if foreach else [torch.sign(x) for x in c]
            for p, sg in zip(ps, signs):
                i = index[id(p)]
                b, off = self._where[i]
                view = b.signs[off:off + p.numel()]
                view.copy_(sg.reshape(-1))
                flags[i] = 1
                flags[T + i] = int(not bool(view.all()))
            local.append((group, gs, ms, foreach))

        self._all_reduce_flags(flags)
        if flags[-1] > 0:
            raise RuntimeError(f"DistributedLion: {int(flags[-1])} other rank(s) rejected their gradients "
                               "(their error says why); no rank changed any parameter or momentum.")
        has_grad = flags[:T].tolist()
        has_zero = flags[T:].tolist()

        for group, gs, ms, foreach in local:
            lion_momentum_update(ms, gs, group["betas"][1], foreach=foreach)

        step = self.comm_stats.steps
        codes = {}
        for b in self._buckets:
            active = [i for i in b.params if has_grad[i] > 0]
            if not active:
                continue
            zeros = any(has_zero[i] > 0 or has_grad[i] < self.world_size for i in active)
            codes[b.index] = self._algorithm(b.signs, zeros, self.rule, group=self.process_group,
                                             stats=self.comm_stats, key=coin_key(self.seed, step, b.index))

        for group in self.param_groups:
            ps, deltas = [], []
            for p in group["params"]:
                i = index[id(p)]
                if has_grad[i] == 0:
                    continue
                b, off = self._where[i]
                dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
                deltas.append(self.rule.delta(codes[b.index][off:off + p.numel()], dtype).view_as(p))
                ps.append(p)
                state = self.state[p]
                if "exp_avg" not in state:  # a gradient elsewhere but never here yet
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
            if ps:
                apply_update(ps, deltas, group["lr"], group["weight_decay"],
                             foreach=_use_foreach(group["foreach"], ps))
        self.comm_stats.steps += 1
        return loss

    def _all_reduce_flags(self, flags: Tensor) -> None:
        dist.all_reduce(flags, group=self.process_group)
        moved = flags.numel() * 4 * 2 * (self.world_size - 1) / self.world_size
        self.comm_stats.add("all_reduce", moved, moved)

    # -- checkpointing ----------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["dlion"] = {"comm_stats": self.comm_stats.state_dict(), "world_size": self.world_size,
                       "rank": self.rank, "vote": self.rule.vote, "ties": self.rule.ties, "seed": self.seed}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("dlion", None)
        super().load_state_dict(state_dict)
        if extra is not None:
            self.comm_stats.load_state_dict(extra["comm_stats"])
