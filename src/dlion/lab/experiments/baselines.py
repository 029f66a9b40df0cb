"""Gradient-aggregation baselines for the convergence sweeps: those that "Communication
Efficient Distributed Training with Distributed Lion" (Liu et al. 2024, arXiv 2404.00438)
compares Distributed Lion with.

Every baseline here is an *aggregation rule on gradients*: it takes the N
workers' gradients of one step, stacked per parameter as tensors of shape
``(N, *param.shape)``, returns the gradient the (simulated) parameter server
hands back to every worker, and counts the bits that crossed the network in the
parameter-server accounting of the papers:

    bits per parameter per iteration = (bits a worker uploads + bits it downloads) / d

with d the number of parameters. A global optimizer (Lion, AdamW, SGD with
momentum) is then applied to the returned gradient; which one each baseline uses
is documented on the class and in ``docs/results.md``.

``MeanFP32``   G-Lion / G-AdamW: the fp32 mean of the gradients. 32 + 32 bits.
``TernGrad``   Wen et al. 2017: unbiased stochastic ternarisation with a shared
               per-tensor scale. log2(3) up, log2(2N+1) down (+ the scales).
``GradDrop``   Aji & Heafield 2017: keep the largest 1 % of |g + residual| per
               tensor, carry the rest to the next step. 64·k up, 64·nnz down.
``DGC``        Lin et al. 2018: top-0.1 % with momentum correction, local
               accumulation, momentum-factor masking and a sparsity warm-up.
               64·k up, 64·nnz down.

All state (residuals, momenta) is kept per worker, as on real workers. Index
and value are counted as 32 bits each for the sparse methods, as in the DGC
paper's accounting; the download is the server's sparse sum (values and
indices of the union of the workers' kept coordinates), capped at the 32·d of a
dense fp32 broadcast.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["BitCounter", "MeanFP32", "TernGrad", "GradDrop", "DGC", "topk_mask", "dgc_density"]


class BitCounter:
    """Bits uploaded and downloaded by one worker, summed over steps."""

    def __init__(self, num_params: int):
        self.num_params = int(num_params)
        self.up = 0.0
        self.down = 0.0
        self.steps = 0

    def add(self, up: float, down: float) -> None:
        self.up += float(up)
        self.down += float(down)

    def per_param_per_step(self) -> tuple[float, float]:
        """(up, down) bits per parameter per step."""
        if not self.steps or not self.num_params:
            return 0.0, 0.0
        n = self.num_params * self.steps
        return self.up / n, self.down / n


def _check(grads: Sequence[Tensor], world_size: int) -> None:
    for g in grads:
        if g.dim() < 1 or g.shape[0] != world_size:
            raise ValueError(f"expected stacked gradients of shape (N={world_size}, ...), got {tuple(g.shape)}")


class MeanFP32:
    """G-Lion / G-AdamW aggregation: ĝ = (1/N)·Σ_i g_i in fp32.

    Realised as an fp32 all-reduce (or a parameter server): every worker
    uploads its 32-bit gradient and downloads the 32-bit mean.
    Bits per parameter per iteration: 32 up + 32 down = 64.
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int):
        self.world_size = world_size
        self.bits = BitCounter(sum(math.prod(s) for s in shapes))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        d = self.bits.num_params
        self.bits.add(32 * d, 32 * d)
        self.bits.steps += 1
        return [g.float().mean(0) for g in grads]


class TernGrad:
    """TernGrad (Wen et al., NeurIPS 2017).

    Per tensor, worker i optionally clips its gradient to ±c·σ_i (σ_i the
    standard deviation of the tensor's entries; c = 2.5 in the paper, ``clip=None``
    turns it off), then with the scale s (``share_scale=True``: the paper's
    *scaler sharing*, s = max_i max|g_i| over all workers; else s_i = max|g_i|)
    sends

        t_i = sign(g_i) ∘ b_i,   b_i ~ Bernoulli(|g_i| / s)   (independent per entry)

    so that E[s·t_i] = g_i (unbiased). The server returns ĝ = s·(1/N)·Σ_i t_i.

    Bits per parameter per iteration: up log2(3) ≈ 1.585 (a ternary symbol,
    entropy-coded; 2 bits in a plain packing) plus 32 bits per tensor for the
    scale; down: with a shared scale the aggregate is s·(an integer in [−N, N]),
    log2(2N+1) bits per parameter plus 32 bits per tensor. (Without scale
    sharing the aggregate is not an integer combination and is counted as fp32,
    32 bits down.) The server-side optimizer in the sweeps is SGD with momentum
    0.9, as in the paper.
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, clip: Optional[float] = 2.5,
                 share_scale: bool = True, seed: int = 0):
        self.world_size = world_size
        self.clip = clip
        self.share_scale = share_scale
        self.num_tensors = len(shapes)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.bits = BitCounter(sum(math.prod(s) for s in shapes))

    def ternarize(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """(t, s): t ∈ {−1, 0, 1} of g's shape (N, ...), s the scale(s) broadcastable to t."""
        N = g.shape[0]
        flat = g.float().reshape(N, -1)
        if self.clip is not None:
            sigma = flat.std(dim=1, keepdim=True, unbiased=False)
            bound = self.clip * sigma
            flat = torch.maximum(torch.minimum(flat, bound), -bound)
        s = flat.abs().amax(dim=1, keepdim=True)  # per worker
        if self.share_scale:
            s = s.amax(dim=0, keepdim=True).expand_as(s)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        prob = flat.abs() / safe
        b = torch.rand(prob.shape, generator=self.generator) < prob
        t = torch.sign(flat) * b
        return t.reshape(g.shape), s.reshape((N,) + (1,) * (g.dim() - 1))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        out = []
        for g in grads:
            t, s = self.ternarize(g)
            out.append((s * t).mean(0))
        d, T, N = self.bits.num_params, self.num_tensors, self.world_size
        down = d * math.log2(2 * N + 1) if self.share_scale else 32 * d
        self.bits.add(d * math.log2(3) + 32 * T, down + 32 * T)
        self.bits.steps += 1
        return out


def topk_mask(x: Tensor, k: int) -> Tensor:
    """Boolean mask of exactly ``k`` largest-|x| entries in each row of x (shape (N, n))."""
    idx = x.abs().topk(k, dim=1).indices
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask.scatter_(1, idx, True)
    return mask


def _k(n: int, density: float) -> int:
    return max(1, min(n, math.ceil(density * n)))


def _sparse_bits(masks: list[Tensor], d: int, world_size: int) -> tuple[float, float]:
    """Up: 64 bits per kept entry of one worker (mean over workers); down: 64 bits
    per entry of the union of the kept sets, at most a dense fp32 broadcast."""
    up = sum(float(m.sum()) for m in masks) / world_size * 64
    union = sum(float(m.any(dim=0).sum()) for m in masks)
    return up, min(64 * union, 32 * d)


class GradDrop:
    """Gradient dropping (Aji & Heafield, EMNLP 2017).

    Worker i adds its residual, a_i = g_i + r_i, keeps the k = ⌈ρ·n⌉ entries of
    largest |a_i| of every tensor (ρ = 1 %, i.e. the paper's drop ratio R = 99 %;
    the paper picks a threshold from a sample, we take the exact top-k, per
    tensor), sends them as (index, value) pairs and keeps the rest,
    r_i ← a_i − sent_i, for the next step. The server returns the mean of the
    sparse gradients, ĝ = (1/N)·Σ_i sent_i. The server-side optimizer in the
    sweeps is AdamW (the paper's NMT experiments use Adam).

    Bits per parameter per iteration: up 64·k/n (32-bit value + 32-bit index,
    ≈ 0.64 at ρ = 1 %); down 64·|∪_i kept_i|/n (at most N·0.64, capped at 32).
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, density: float = 0.01):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        self.world_size, self.density = world_size, density
        self.residuals = [torch.zeros((world_size, math.prod(s))) for s in shapes]
        self.bits = BitCounter(sum(math.prod(s) for s in shapes))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        N = self.world_size
        out, masks = [], []
        for g, r in zip(grads, self.residuals):
            a = g.float().reshape(N, -1) + r
            mask = topk_mask(a, _k(a.shape[1], self.density))
            sent = a * mask
            r.copy_(a - sent)
            out.append(sent.mean(0).reshape(g.shape[1:]))
            masks.append(mask)
        self.bits.add(*_sparse_bits(masks, self.bits.num_params, N))
        self.bits.steps += 1
        return out


def dgc_density(step: int, final: float, warmup_steps: int, stages: int = 4) -> float:
    """DGC's sparsity warm-up: densities 25 %, 6.25 %, 1.5625 %, 0.39 %, … (×1/4 per
    stage, ``stages`` equal stages over the first ``warmup_steps`` steps), never
    below ``final``; ``final`` after the warm-up. ``step`` is 0-based."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return final
    stage = min(stages - 1, step * stages // warmup_steps)
    return max(final, 0.25 ** (stage + 1))


class DGC:
    """Deep Gradient Compression (Lin et al., ICLR 2018).

    Worker i, with momentum m = 0.9 (momentum correction, local accumulation):

        u_i ← m·u_i + g_i          # local momentum
        v_i ← v_i + u_i            # local accumulation of the velocity
        mask = top-k of |v_i|      # per tensor, k = ⌈ρ·n⌉, ρ = 0.1 % after warm-up
        send v_i[mask];  v_i[mask] ← 0;  u_i[mask] ← 0   # momentum-factor masking

    The server returns ĝ = (1/N)·Σ_i sent_i and the parameters take a plain SGD
    step x ← x − η·ĝ (the momentum already lives in u_i; weight decay is applied
    by the optimizer). Warm-up: the density follows :func:`dgc_density` over the
    first ``warmup_steps`` steps. Local gradient clipping from the paper is not
    used (our models train without clipping).

    Bits per parameter per iteration: up 64·k/n (≈ 0.064 at ρ = 0.1 %, more in
    the warm-up); down 64·|∪_i kept_i|/n, capped at 32.
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, density: float = 0.001,
                 momentum: float = 0.9, warmup_steps: int = 0):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        self.world_size, self.density, self.momentum = world_size, density, momentum
        self.warmup_steps = warmup_steps
        self.u = [torch.zeros((world_size, math.prod(s))) for s in shapes]
        self.v = [torch.zeros((world_size, math.prod(s))) for s in shapes]
        self.bits = BitCounter(sum(math.prod(s) for s in shapes))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        N = self.world_size
        rho = dgc_density(self.bits.steps, self.density, self.warmup_steps)
        out, masks = [], []
        for g, u, v in zip(grads, self.u, self.v):
            u.mul_(self.momentum).add_(g.float().reshape(N, -1))
            v.add_(u)
            mask = topk_mask(v, _k(v.shape[1], rho))
            sent = v * mask
            v.masked_fill_(mask, 0.0)
            u.masked_fill_(mask, 0.0)
            out.append(sent.mean(0).reshape(g.shape[1:]))
            masks.append(mask)
        self.bits.add(*_sparse_bits(masks, self.bits.num_params, N))
        self.bits.steps += 1
        return out
