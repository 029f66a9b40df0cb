"""Lion Cub's quantised aggregation of the pre-sign vector c (Ishikawa et al. 2024, arXiv 2411.16462).

Instead of voting on signs, each rank sends a small integer per coordinate,

    q = clip(round(s/2 · c / scale), −s, s),   s = ⌊(2^(b−1) − 1) / N⌋,

with a per-tensor ``scale`` of its own c; the integers are summed by one
all-reduce in b-bit fields (|Σq| ≤ N·s ≤ 2^(b−1) − 1: no field can overflow)
and every rank applies Δ = sign(Σ_i q_i) — an approximation of sign(mean c)
rather than a vote of signs. A coordinate with Σq = 0 gets Δ = 0.

Scales (per tensor, per rank): ``l1`` = mean |c|, ``linf`` = max |c|,
``l0`` = geometric mean of the non-zero |c|. q is computed in fp32 as
round((c / scale) · (s/2)), with round-half-to-even.
Cost: 2·b·(N−1)/N bits per parameter each way (ring all-reduce of b-bit fields).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NORMS", "levels", "scale_of", "quantize"]

NORMS = ("l1", "linf", "l0")


def levels(bits: int, world_size: int) -> int:
    """s = ⌊(2^(b−1) − 1)/N⌋; raises if fewer than one level is left."""
    s = (2 ** (bits - 1) - 1) // world_size
    if s < 1:
        raise ValueError(f"quant_bits={bits} leaves no quantisation level for {world_size} workers: "
                         f"(2^{bits - 1} − 1) / {world_size} < 1; use more bits.")
    return s


def scale_of(c: Tensor, norm: str) -> Tensor:
    """The per-tensor scale of c (a 0-dim float32 tensor; 1 when c is all zero)."""
    a = c.detach().abs().float().reshape(-1)
    if norm == "l1":
        s = a.mean()
    elif norm == "linf":
        s = a.max()
    elif norm == "l0":
        nz = a[a > 0]
        s = nz.log().mean().exp() if nz.numel() else a.new_zeros(())
    else:
        raise ValueError(f"Unknown quant_norm {norm!r}; choose one of {', '.join(map(repr, NORMS))}.")
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize(c: Tensor, s: int, norm: str) -> Tensor:
    """q = clip(round(s/2 · c/scale), −s, s) as int8 (a flat view's worth of c)."""
    x = c.float() / scale_of(c, norm) * (s / 2)
    return torch.round(x).clamp_(-s, s).to(torch.int8)
