"""Gradient-compression baselines for the convergence sweeps, over N simulated workers.

Every baseline here is an *aggregation rule on gradients*: it takes the N
workers' gradients of one step, stacked per parameter as tensors of shape
``(N, *param.shape)``, and returns the gradient every worker ends up with. A
global optimizer (Lion, AdamW, SGD) then steps on it; which one each method uses
is set in :mod:`dlion.lab.experiments.runner` and documented in
``docs/results.md``.

``MeanFP32``   G-Lion / G-AdamW: the fp32 mean (a ring all-reduce).
``TernGrad``   "TernGrad: Ternary Gradients to Reduce Communication in Distributed
               Deep Learning" (Wen et al. 2017, arXiv 1705.07878).
``GradDrop``   "Sparse Communication for Distributed Gradient Descent" (Aji &
               Heafield 2017, arXiv 1704.05021).
``DGC``        "Deep Gradient Compression" (Lin et al. 2018, arXiv 1712.01887),
               following its reference implementation (see the class).
``PowerSGD``   "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
               Optimization" (Vogels et al. 2019, arXiv 1905.13727), the algorithm
               of PyTorch's ``powerSGD_hook`` run over N simulated workers.

**Bit accounting: one axis for every method.** Each aggregator counts the bits
*one rank sends* per step under the collective that suits its wire format best
(the same axis as D-Lion's counts from its simulated collectives, whose
per-rank costs are :func:`dlion.collectives.bytes_moved`):

* ring all-reduce of n values of b bits: 2·(N−1)/N·n·b;
* all-gather of s bits from every rank: (N−1)·s;
* all-to-all of s bits held by every rank: (N−1)/N·s.

These are *counted* from the wire formats, not measured on a network. The
counts per method are spelled out on each class; ``bits.by_collective`` keeps
the split.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from dlion.codec import TritCodec, bits_for

__all__ = ["BitCounter", "MeanFP32", "TernGrad", "GradDrop", "DGC", "DGCSGD", "PowerSGD", "topk_mask",
           "dgc_density", "dgc_lr_factor", "ring_allreduce_bits", "allgather_bits", "alltoall_bits",
           "SPARSE_ENTRY_BITS", "TRIT_BITS"]

SPARSE_ENTRY_BITS = 64          # a sparse entry on the wire: 32-bit value + 32-bit index
TRIT_BITS = TritCodec.bits      # base-3 digits, 5 per byte (the format D-Lion uses for trits)


def ring_allreduce_bits(n: float, bits: float, world: int) -> float:
    """Bits one rank sends in a ring all-reduce of n values of ``bits`` bits."""
    return 2.0 * (world - 1) / world * n * bits


def allgather_bits(bits_per_rank: float, world: int) -> float:
    """Bits one rank sends in an all-gather where every rank contributes ``bits_per_rank``."""
    return float((world - 1) * bits_per_rank)


def alltoall_bits(bits_per_rank: float, world: int) -> float:
    """Bits one rank sends in an all-to-all of ``bits_per_rank`` bits per rank (it keeps its own chunk)."""
    return (world - 1) / world * bits_per_rank


class BitCounter:
    """Bits one rank sends, summed over steps, split by collective."""

    def __init__(self, num_params: int):
        self.num_params = int(num_params)
        self.sent = 0.0
        self.steps = 0
        self.by_collective: dict[str, float] = {}

    def add(self, collective: str, bits: float) -> None:
        self.sent += float(bits)
        self.by_collective[collective] = self.by_collective.get(collective, 0.0) + float(bits)

    def per_param_per_step(self) -> float:
        """Bits sent per parameter per step, mean over the steps so far."""
        if not self.steps or not self.num_params:
            return 0.0
        return self.sent / (self.num_params * self.steps)

    def breakdown(self) -> dict[str, float]:
        if not self.steps or not self.num_params:
            return {}
        n = self.num_params * self.steps
        return {k: v / n for k, v in self.by_collective.items()}


def _check(grads: Sequence[Tensor], world_size: int) -> None:
    for g in grads:
        if g.dim() < 1 or g.shape[0] != world_size:
            raise ValueError(f"expected stacked gradients of shape (N={world_size}, ...), got {tuple(g.shape)}")


class MeanFP32:
    """G-Lion / G-AdamW aggregation: ĝ = (1/N)·Σ_i g_i in fp32.

    Collective: one fp32 ring all-reduce, 2·32·(N−1)/N bits per parameter per rank
    (48 at N = 4, → 64 for large N).
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int):
        self.world_size = world_size
        self.bits = BitCounter(sum(math.prod(s) for s in shapes))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        self.bits.add("all_reduce fp32", ring_allreduce_bits(self.bits.num_params, 32, self.world_size))
        self.bits.steps += 1
        return [g.float().mean(0) for g in grads]


class TernGrad:
    """TernGrad (Wen et al., NeurIPS 2017, arXiv 1705.07878).

    Per tensor, worker i optionally clips its gradient to ±c·σ_i (σ_i the
    standard deviation of the tensor's entries; c = 2.5 in the paper, ``clip=None``
    turns it off), then with the scale s (``share_scale=True``: the paper's
    *scaler sharing*, s = max_i max|g_i| over all workers; else s_i = max|g_i|)
    sends

        t_i = sign(g_i) ∘ b_i,   b_i ~ Bernoulli(|g_i| / s)   (independent per entry)

    so that E[s·t_i] = g_i (unbiased). Every worker gets ĝ = s·(1/N)·Σ_i t_i.

    Bits one rank sends (T tensors, d parameters), in the wire formats D-Lion
    uses — trits as base-3 digits (8/5 bits), sums of N trits as fields of
    ⌈log2(2N+1)⌉ bits:

    * shared scale: a MAX all-reduce of the T scales, 2·32·T·(N−1)/N; then the
      cheaper of (a) the 1-bit-all-reduce pattern — all-to-all of the trits,
      (N−1)/N·1.6·d, and all-gather of the per-chunk sums, (N−1)/N·⌈log2(2N+1)⌉·d —
      and (b) an all-gather of the trits, (N−1)·1.6·d ((b) wins only at N = 2);
    * per-worker scales: the sum is no integer combination, so an all-gather of
      the trits and scales, (N−1)·(1.6·d + 32·T).

    The optimizer in the sweeps is SGD with momentum 0.9, as in the paper.
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

    def count_bits(self) -> dict[str, float]:
        """Bits one rank sends per step, by collective."""
        d, T, N = self.bits.num_params, self.num_tensors, self.world_size
        if not self.share_scale:
            return {"all_gather trits + scales": allgather_bits(TRIT_BITS * d + 32 * T, N)}
        out = {"all_reduce max scales": ring_allreduce_bits(T, 32, N)}
        onebit = alltoall_bits(TRIT_BITS * d, N) + alltoall_bits(bits_for(2 * N + 1) * d, N)
        gather = allgather_bits(TRIT_BITS * d, N)
        if onebit <= gather:
            out["all_to_all trits + all_gather sums"] = onebit
        else:
            out["all_gather trits"] = gather
        return out

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        out = []
        for g in grads:
            t, s = self.ternarize(g)
            out.append((s * t).mean(0))
        for k, v in self.count_bits().items():
            self.bits.add(k, v)
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


def _sparse_or_dense(kept: Tensor, n: int, world: int) -> tuple[str, float]:
    """The cheaper way for one rank to exchange a sparse tensor of n coordinates of which
    each rank keeps ``kept[i]``: an all-gather of (32-bit value, 32-bit index) pairs, or a
    dense fp32 ring all-reduce of the zero-filled tensor. Returns (collective, bits)."""
    sparse = float(kept.float().mean()) * SPARSE_ENTRY_BITS * (world - 1)
    dense = ring_allreduce_bits(n, 32, world)
    return ("all_gather sparse", sparse) if sparse <= dense else ("all_reduce fp32", dense)


class GradDrop:
    """Gradient dropping (Aji & Heafield, EMNLP 2017, arXiv 1704.05021).

    Worker i adds its residual, a_i = g_i + r_i, keeps the entries with |a_i| at
    or above the threshold that drops the fraction R = 1 − ρ of smallest absolute
    values (ρ = ``density``; the paper's R = 99 % is ρ = 1 %), sends them as
    (index, value) pairs, and keeps the rest as the next residual,
    r_i ← a_i − sent_i. Every worker gets ĝ = (1/N)·Σ_i sent_i.

    ``scope="global"`` (default) takes one threshold over all of a worker's
    parameters, as the authors' implementation in Marian does (it drops on the
    one flat gradient of the whole model); ``scope="tensor"`` takes one per
    tensor. Exception: the threshold is exact (the top ⌈ρ·d⌉ of |a_i|), where the
    paper and Marian sort a sample of at most 100 000 entries — the same thing
    for models of up to 100 000 parameters on Marian's GPU path.

    The paper exchanges gradients with a parameter server (asynchronously in its
    NMT runs, where the download is a dropped parameter delta); here the exchange
    is synchronous. Bits one rank sends: the cheaper of an all-gather of its
    kept (value, index) pairs, (N−1)·64·k, and a dense fp32 ring all-reduce,
    2·32·d·(N−1)/N. The optimizer in the sweeps is AdamW (the paper's NMT runs
    use Adam).
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, density: float = 0.01,
                 scope: str = "global"):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if scope not in ("global", "tensor"):
            raise ValueError(f"scope must be 'global' or 'tensor', got {scope!r}")
        self.world_size, self.density, self.scope = world_size, density, scope
        self.sizes = [math.prod(s) for s in shapes]
        self.residuals = [torch.zeros((world_size, n)) for n in self.sizes]
        self.bits = BitCounter(sum(self.sizes))

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        N = self.world_size
        acc = [g.float().reshape(N, -1) + r for g, r in zip(grads, self.residuals)]
        if self.scope == "global":
            flat = torch.cat(acc, 1)
            masks = list(topk_mask(flat, _k(flat.shape[1], self.density)).split(self.sizes, 1))
        else:
            masks = [topk_mask(a, _k(a.shape[1], self.density)) for a in acc]
        out = []
        for g, a, r, mask in zip(grads, acc, self.residuals, masks):
            sent = a * mask
            r.copy_(a - sent)
            out.append(sent.mean(0).reshape(g.shape[1:]))
        kept = torch.stack([m.sum(1) for m in masks]).sum(0)
        self.bits.add(*_sparse_or_dense(kept, self.bits.num_params, N))
        self.bits.steps += 1
        return out


def dgc_density(step: int, final: float, warmup_steps: int, stages: int = 4) -> float:
    """DGC's density warm-up as in its reference code: ``stages`` equal stages over the
    first ``warmup_steps`` steps; in stage s the density is max(c^(s+1), final) with
    c = final^(1/(stages+1)) — for final = 0.1 % and 4 stages 25 %, 6.3 %, 1.6 %, 0.4 %
    (the paper's 75 %, 93.75 %, 98.4 %, 99.6 % sparsity); ``final`` afterwards.
    ``step`` is 0-based."""
    if warmup_steps <= 0 or step >= warmup_steps or final >= 1:
        return final
    stage = min(stages - 1, step * stages // warmup_steps)
    c = final ** (1.0 / (stages + 1))
    return max(c ** (stage + 1), final)


def dgc_lr_factor(step: int, warmup_steps: int, world_size: int) -> float:
    """The learning-rate warm-up of DGC's reference training script (the gradual warm-up
    of "Accurate, Large Minibatch SGD", arXiv 1706.02677): the lr grows linearly from
    lr/N to lr over the first ``warmup_steps`` steps. ``step`` is 0-based."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return (step * (world_size - 1) / warmup_steps + 1) / world_size


class DGC:
    """Deep Gradient Compression (Lin et al., ICLR 2018, arXiv 1712.01887), after its
    reference implementation (``DGCCompressor`` + ``DGCSGDMemory`` + ``DGCSGD``).

    *Compressed* tensors — those with ``dim() > 1``, when the density is below 1 —
    on worker i, with momentum m (0.9):

        g_i ← clip(g_i)                       # local gradient clipping (optional)
        u_i ← m·u_i + g_i                      # momentum correction
        v_i ← v_i + u_i                        # local accumulation
        mask = top-k of |v_i|, k = ⌈ρ·n⌉       # per tensor
        send v_i[mask]; v_i[mask] ← 0; u_i[mask] ← 0   # momentum factor masking

    and the result is (1/N)·Σ_i sent_i. *Dense* tensors (``dim() <= 1``: biases
    and norms, or every tensor at density 1) are averaged first and get ordinary
    momentum, M ← m·M + (1/N)·Σ_i g_i, and M is the result — so at density 1 DGC
    is exactly momentum SGD on the mean gradient. The parameters then take the
    reference's SGD step (:class:`DGCSGD`: no further momentum on the gradient,
    its own momentum buffer on the weight-decay term).

    Warm-up: the density follows :func:`dgc_density` over ``warmup_steps`` (the
    reference's geometric schedule), and :func:`dgc_lr_factor` gives the
    reference script's lr warm-up over the same steps.

    Local gradient clipping (``clip_norm``): the paper clips each worker's
    gradient to the L2 norm ``clip_norm``·N^(−1/2) (its share of a global
    threshold) before accumulation; here the norm is over all of the worker's
    tensors. The reference code has the hook (``gradient_clipping``) but leaves it
    off by default.

    Exceptions: the top-k is exact where the reference picks a threshold from a
    1 % sample and adapts it; indices are counted as 32 bits (the reference's
    ``int32_indices`` option; 64 by default).

    Bits one rank sends: compressed tensors, the cheaper of an all-gather of
    its (value, index) pairs, (N−1)·64·k, and a dense fp32 ring all-reduce; dense
    tensors, a fp32 ring all-reduce, 2·32·n·(N−1)/N.
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, density: float = 0.001,
                 momentum: float = 0.9, warmup_steps: int = 0, warmup_stages: int = 4,
                 clip_norm: Optional[float] = None, momentum_masking: bool = True, dense_1d: bool = True):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        self.world_size, self.density, self.momentum = world_size, density, momentum
        self.warmup_steps, self.warmup_stages = warmup_steps, warmup_stages
        self.clip_norm, self.momentum_masking = clip_norm, momentum_masking
        self.sizes = [math.prod(s) for s in shapes]
        self.compressed = [density < 1 and (len(s) > 1 or not dense_1d) for s in shapes]
        self.u = [torch.zeros((world_size, n)) if c else None for n, c in zip(self.sizes, self.compressed)]
        self.v = [torch.zeros((world_size, n)) if c else None for n, c in zip(self.sizes, self.compressed)]
        self.dense_momentum = [None if c else torch.zeros(n) for n, c in zip(self.sizes, self.compressed)]
        self.bits = BitCounter(sum(self.sizes))

    def lr_factor(self, step: int) -> float:
        return dgc_lr_factor(step, self.warmup_steps, self.world_size)

    def clip(self, flats: list[Tensor]) -> list[Tensor]:
        """Each worker's gradient scaled to an L2 norm of at most clip_norm/√N."""
        if self.clip_norm is None:
            return flats
        norm = torch.sqrt(sum(f.pow(2).sum(1) for f in flats))
        coef = torch.clamp(self.clip_norm / math.sqrt(self.world_size) / (norm + 1e-6), max=1.0)
        return [f * coef.view(-1, 1) for f in flats]

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        N = self.world_size
        rho = dgc_density(self.bits.steps, self.density, self.warmup_steps, self.warmup_stages)
        flats = self.clip([g.float().reshape(N, -1) for g in grads])
        out, kept, sparse_n, dense_n = [], torch.zeros(N), 0, 0
        for g, f, c, u, v, mom in zip(grads, flats, self.compressed, self.u, self.v, self.dense_momentum):
            if c:
                u.mul_(self.momentum).add_(f)
                v.add_(u)
                mask = topk_mask(v, _k(v.shape[1], rho))
                sent = v * mask
                v.masked_fill_(mask, 0.0)
                if self.momentum_masking:
                    u.masked_fill_(mask, 0.0)
                out.append(sent.sum(0).div_(N).reshape(g.shape[1:]))
                kept += mask.sum(1)
                sparse_n += f.shape[1]
            else:
                mom.mul_(self.momentum).add_(f.mean(0))
                out.append(mom.clone().reshape(g.shape[1:]))
                dense_n += f.shape[1]
        if sparse_n:
            self.bits.add(*_sparse_or_dense(kept, sparse_n, N))
        if dense_n:
            self.bits.add("all_reduce fp32", ring_allreduce_bits(dense_n, 32, N))
        self.bits.steps += 1
        return out


class DGCSGD(torch.optim.Optimizer):
    """The parameter update of DGC's reference code: the gradient already carries the
    momentum, so p ← p − lr·(ĝ + B) with B ← m·B + λ·p the momentum of the weight-decay
    term alone (B = λ·p at the first step); with λ = 0 plain p ← p − lr·ĝ."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            wd, m = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d_p = p.grad
                if wd != 0:
                    state = self.state[p]
                    if "decay_buffer" not in state:
                        buf = state["decay_buffer"] = wd * p.detach().clone()
                    else:
                        buf = state["decay_buffer"].mul_(m).add_(p, alpha=wd)
                    d_p = d_p + buf
                p.add_(d_p, alpha=-group["lr"])


def _orthogonalize_fallback(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Gram–Schmidt on the columns of a batch of matrices (b, n, r), in place."""
    for i in range(matrices.shape[2]):
        col = matrices[:, :, i:i + 1]
        col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < matrices.shape[2]:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


try:  # the hook's own orthogonalisation (Gram–Schmidt for rank ≤ 2, QR above), for parity with it
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
except Exception:  # pragma: no cover - torch built without distributed
    _orthogonalize = _orthogonalize_fallback


class PowerSGD:
    """PowerSGD (Vogels et al., NeurIPS 2019, arXiv 1905.13727): the algorithm of
    PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, with the
    whole model as one bucket, over N simulated workers.

    Per step (after ``start_iter`` steps of plain fp32 averaging):

    1. error feedback: worker i compresses x_i = g_i + e_i;
    2. a tensor viewed as a matrix n × m (n = shape[0]) is compressed when
       (n + m)·r·``min_compression_rate`` < n·m (r = min(rank, n, m)); the others —
       every 1-D tensor among them — are averaged in fp32;
    3. Q (m × r): the previous step's Q (*warm start*) orthogonalised, or, on the
       first compressed step, a seeded Gaussian orthogonalised (the same seed
       stream as the hook's ``random_seed``);
    4. P = orth(Σ_i x_i·Q) (an all-reduce of the P_i), Q ← (1/N)·Σ_i x_iᵀ·P (an
       all-reduce of the Q_i);
    5. every worker gets x̂ = P·Qᵀ (and the fp32 mean of the uncompressed tensors),
       and keeps e_i ← x_i − x̂ for the next step (over every tensor, as the hook
       does: for uncompressed ones e_i = x_i − mean, whose mean over workers is 0).

    The optimizer (Lion or AdamW in the sweeps) then steps on x̂, as after the
    hook in DDP. With r ≥ min(n, m) (and ``min_compression_rate`` ≤ 0) P spans x̂'s
    column space and x̂ is the exact mean.

    Bits one rank sends: fp32 ring all-reduces of the P's (Σ n·r values), the Q's
    (Σ m·r) and the uncompressed tensors: 2·32·(N−1)/N·(Σ(n + m)·r + uncompressed).
    """

    def __init__(self, shapes: Sequence[torch.Size], world_size: int, *, rank: int = 1, start_iter: int = 0,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.world_size, self.rank, self.start_iter = world_size, rank, start_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback, self.warm_start = use_error_feedback, warm_start
        self.epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.bits = BitCounter(sum(self.sizes))
        self.iter = 0
        self.error: Optional[Tensor] = None           # (N, d): every worker's error
        self.q_memory: Optional[list[Tensor]] = None  # the Q's of the last step (identical on all workers)
        # which tensors are compressed: the hook's test on the matrix view (shape[0], rest)
        self.plan = []
        for s, n_el in zip(self.shapes, self.sizes):
            n = s[0] if len(s) else 1
            m = n_el // n if n else 0
            r = min(n, m, rank)
            self.plan.append((n, m, r, (n + m) * r * min_compression_rate < n * m))
        # the hook walks the compressed tensors grouped by shape, in order of first appearance
        groups: dict = {}
        for k, (n, m, r, c) in enumerate(self.plan):
            if c:
                groups.setdefault((n, m), []).append(k)
        self.order = [k for ks in groups.values() for k in ks]

    def count_bits(self) -> dict[str, float]:
        N = self.world_size
        if self.iter < self.start_iter:
            return {"all_reduce fp32": ring_allreduce_bits(self.bits.num_params, 32, N)}
        pq = sum((n + m) * r for n, m, r, c in self.plan if c)
        dense = sum(s for s, (_, _, _, c) in zip(self.sizes, self.plan) if not c)
        out = {}
        if pq:
            out["all_reduce fp32 P, Q"] = ring_allreduce_bits(pq, 32, N)
        if dense:
            out["all_reduce fp32"] = ring_allreduce_bits(dense, 32, N)
        return out

    def __call__(self, grads: Sequence[Tensor]) -> list[Tensor]:
        _check(grads, self.world_size)
        N = self.world_size
        for k, v in self.count_bits().items():
            self.bits.add(k, v)
        self.bits.steps += 1
        x = torch.cat([g.float().reshape(N, -1) for g in grads], 1)
        if self.iter < self.start_iter:
            self.iter += 1
            return [t.mean(0).reshape(s) for t, s in zip(x.split(self.sizes, 1), self.shapes)]
        if self.use_error_feedback:
            if self.error is not None:
                x = x + self.error
            x_cp = x.clone()
        parts = list(x.split(self.sizes, 1))
        out = [None] * len(parts)
        for k, (n, m, r, c) in enumerate(self.plan):
            if not c:
                out[k] = parts[k].mean(0)
        mats = {k: parts[k].reshape(N, self.plan[k][0], self.plan[k][1]) for k in self.order}
        if self.order:
            if not self.warm_start or self.q_memory is None:
                qs = []
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.rng.randint(1_000_000_000))
                    for k in self.order:
                        _, m, r, _ = self.plan[k]
                        qs.append(torch.randn(1, m, r, dtype=torch.float32))
            else:
                qs = self.q_memory
            for q in qs:
                _orthogonalize(q, self.epsilon)
            new_qs = []
            for k, q in zip(self.order, qs):
                M = mats[k]                            # (N, n, m)
                p = torch.bmm(M, q.expand(N, -1, -1))  # every worker's P_i = M_i·Q
                p = _sum_workers(p).unsqueeze(0)       # all-reduce (SUM) of the P's
                _orthogonalize(p, self.epsilon)
                qi = torch.bmm(M.transpose(1, 2), p.expand(N, -1, -1))
                qn = _sum_workers(qi).unsqueeze(0).div_(N)  # all-reduce of the Q's, / world size
                new_qs.append(qn)
                out[k] = torch.bmm(p, qn.transpose(1, 2))[0].reshape(-1)
            self.q_memory = new_qs if self.warm_start else None
        result = torch.cat([o.reshape(-1) for o in out])
        if self.use_error_feedback:
            self.error = x_cp - result
        self.iter += 1
        return [o.reshape(s) for o, s in zip(out, self.shapes)]


def _sum_workers(t: Tensor) -> Tensor:
    """Σ over dim 0, accumulated in rank order (as a ring or Gloo SUM would for two ranks)."""
    total = t[0].clone()
    for i in range(1, t.shape[0]):
        total += t[i]
    return total
