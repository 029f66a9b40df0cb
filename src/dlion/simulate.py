"""N Distributed-Lion workers in one process, for convergence sweeps up to N = 32.

Parameters are identical on every worker, so one copy is kept; each logical
worker has its own momentum and feeds its own gradients. Each step goes through
the same pieces as :class:`dlion.DistributedLion` — the Lion math of
:mod:`dlion.lion`, the bucket layout, the codecs, the counting and the vote rule
of :mod:`dlion.collectives` / :mod:`dlion.aggregation`, the quantiser of
:mod:`dlion.quantize` — with the network replaced by concatenation, so for the
same gradients it gives bitwise the same parameters as N real ranks
(``tests/test_simulate.py`` checks it against Gloo).

Traffic is not measured (nothing is sent) but counted from the wire formats:
``comm_stats`` holds what each rank would send and receive with the chosen
algorithm, including the per-step format switch when workers abstain.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .aggregation import VoteRule, coin_key
from .collectives import (CommStats, abstention_format, choose_algorithm, down_codec, field_width, simulated,
                          upload_codec, zero_runs)
from .distributed import _check_options, layout_buckets, momentum_sync_due
from .lion import _LOW_PRECISION, apply_update, check_hyperparameters, check_params, lion_momentum_update, lion_presign
from .quantize import levels, quantize

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
                 bucket_cap_mb: float = 25.0, seed: int = 0,
                 sign_hooks: Optional[Sequence[Optional[Callable[[int, Tensor], Tensor]]]] = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        check_hyperparameters(lr, betas, weight_decay)
        self.params = list(params)
        check_params(self.params)
        self.rule = VoteRule(vote, world_size, ties=ties, seed=seed)
        _check_options(comm, aggregate, vote, quant_norm, quant_bits, momentum_sync, bucket_cap_mb, 0, "skip",
                       None if sign_hooks is None else (sign_hooks if any(sign_hooks) else None))
        if sign_hooks is not None and len(sign_hooks) != world_size:
            raise ValueError(f"sign_hooks has {len(sign_hooks)} entries for {world_size} workers")
        self.world_size, self.lr, self.betas, self.weight_decay = world_size, lr, tuple(betas), weight_decay
        self.comm, self.aggregate, self.quant_norm = comm, aggregate, quant_norm
        self.quant_levels = levels(quant_bits, world_size) if aggregate == "quantized" else 0
        self.momentum_sync, self.seed = momentum_sync, seed
        self.sign_hooks = list(sign_hooks) if sign_hooks is not None else [None] * world_size
        self.buckets = layout_buckets(self.params, world_size, bucket_cap_mb)
        for b in self.buckets:
            b.algorithm = choose_algorithm(b.padded, world_size, self.rule) if comm == "auto" else comm
        self.momenta = [[torch.zeros_like(p, dtype=torch.float32 if p.dtype in _LOW_PRECISION else p.dtype)
                         for p in self.params] for _ in range(world_size)]
        self.comm_stats = CommStats()
        self.num_params = sum(p.numel() for p in self.params)

    @torch.no_grad()
    def step(self, grads: Sequence[Sequence[Optional[Tensor]]]) -> None:
        N = self.world_size
        if len(grads) != N or any(len(g) != len(self.params) for g in grads):
            raise ValueError(f"step() needs grads[worker][param] for {N} workers × {len(self.params)} parameters")
        step = self.comm_stats.steps
        beta1, beta2 = self.betas
        buffers = [[torch.zeros(b.padded, dtype=torch.int8) for b in self.buckets] for _ in range(N)]
        # Worker-local Lion math, into each worker's buckets.
        for i in range(N):
            ks = [k for k, g in enumerate(grads[i]) if g is not None]
            gs = [self._grad(grads[i][k], k) for k in ks]
            cs = lion_presign([self.momenta[i][k] for k in ks], gs, beta1, foreach=False)
            for k, c in zip(ks, cs):
                b, off = self._where(k)
                view = buffers[i][b.index][off:off + c.numel()]
                if self.aggregate == "quantized":
                    view.copy_(quantize(c, self.quant_levels, self.quant_norm).reshape(-1))
                else:
                    view.copy_(torch.sign(c).reshape(-1))
            if self.sign_hooks[i] is not None:
                for b in self.buckets:
                    buffers[i][b.index][:b.numel] = self.sign_hooks[i](step, buffers[i][b.index][:b.numel].clone())
            lion_momentum_update([self.momenta[i][k] for k in ks], gs, beta2, foreach=False)
        # Aggregation, per bucket, as the collectives would do it.
        has_grad = [sum(grads[i][k] is not None for i in range(N)) for k in range(len(self.params))]
        ps, deltas = [], []
        for b in self.buckets:
            active = [(j, k) for j, k in enumerate(b.params) if has_grad[k] > 0]
            self._count_flags(b)
            if not active:
                continue
            if self.aggregate == "quantized":
                total = sum(buffers[i][b.index].to(torch.int16) for i in range(N))
                codes = torch.sign(total).to(torch.int8)
                self._count_field_sum(b.padded, 2 * self.quant_levels * N)
            else:
                zeros = self._abstentions([buffers[i][b.index] for i in range(N)], b)
                codes = simulated([buffers[i][b.index] for i in range(N)], zeros, self.rule,
                                  key=coin_key(self.seed, step, b.index))
                self._count_algorithm(b, zeros)
            for j, k in active:
                p = self.params[k]
                dtype = torch.float32 if p.dtype in _LOW_PRECISION else p.dtype
                off = b.offsets[j]
                deltas.append(self.rule.delta(codes[off:off + p.numel()], dtype).view_as(p))
                ps.append(p)
        apply_update(ps, deltas, self.lr, self.weight_decay, foreach=False)
        self.comm_stats.steps += 1
        if momentum_sync_due(self.momentum_sync, self.comm_stats.steps):
            self.synchronize_momenta()

    def synchronize_momenta(self) -> None:
        """Every worker's momentum becomes the fp32 mean of all of them."""
        for k in range(len(self.params)):
            mean = sum(m[k].float() for m in self.momenta) / self.world_size
            for m in self.momenta:
                m[k].copy_(mean)
        b = 4 * self.num_params * 2 * (self.world_size - 1) / self.world_size
        self.comm_stats.add("momentum_sync", b, b)

    # -- helpers ----------------------------------------------------------------
    def _grad(self, g: Tensor, k: int) -> Tensor:
        p = self.params[k]
        if g.shape != p.shape:
            raise ValueError(f"gradient for parameter {k} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
        return g.float() if (g.dtype in _LOW_PRECISION or p.dtype in _LOW_PRECISION) else g

    def _where(self, k: int):
        for b in self.buckets:
            if k in b.params:
                return b, b.offsets[b.params.index(k)]
        raise KeyError(k)

    def _count_flags(self, b) -> None:
        n = (len(b.params) + 2 + self.world_size) * 4 * 2 * (self.world_size - 1) / self.world_size
        self.comm_stats.add("flags", n, n)

    def _abstentions(self, deltas: list[Tensor], b):
        """The ``zeros`` argument the ranks would agree on (see DistributedLion)."""
        runs = [zero_runs(d, b.numel) if not bool(d[:b.numel].all()) else None for d in deltas]
        counts = [0 if r is None else r.shape[0] for r in runs]
        fmt = abstention_format(counts, b.padded, self.world_size)
        if fmt != "runs":
            return fmt == "ternary"
        table = torch.zeros(self.world_size, max(counts), 2, dtype=torch.int32)
        for i, r in enumerate(runs):
            if r is not None:
                table[i, :r.shape[0]] = r
        moved = max(counts) * 8 * (self.world_size - 1)
        self.comm_stats.add("zero_runs", moved, moved)
        return table

    def _count_field_sum(self, n: int, max_sum: int) -> None:
        w = field_width(max_sum)
        moved = n * (32 if w == 16 else w) / 8 * 2 * (self.world_size - 1) / self.world_size
        self.comm_stats.add("all_reduce", moved, moved)

    def _count_algorithm(self, b, zeros) -> None:
        N, n = self.world_size, b.padded
        up = upload_codec(zeros).nbytes(n)
        if b.algorithm == "1bit":
            self.comm_stats.add("all_to_all", up * (N - 1) / N, up * (N - 1) / N)
            down = down_codec(self.rule, zeros)[0].nbytes(n // N)
            self.comm_stats.add("all_gather", down * (N - 1), down * (N - 1))
        elif b.algorithm == "allgather":
            self.comm_stats.add("all_gather", up * (N - 1), up * (N - 1))
        else:  # pbit
            self._count_field_sum(n, N * (N + 1) if zeros is not False else N)
