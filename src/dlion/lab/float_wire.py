"""The narrow float wire formats of the DiLoCo peers, scaled row by row: what torchft's quantised
all-reduce (``should_quantize``: fp8 E4M3) and Streaming DiLoCo (arXiv 2501.18512: fp4 E3M0) put on
the wire. One fp32 scale per row (the last dimension; a 0-d or 1-d tensor is one row): the row's absmax.

``fp8``: E4M3 (``torch.float8_e4m3fn``) of x·448/scale, rounded to nearest even; one byte per value.
``fp4``: E3M0, a sign and 3 exponent bits, no mantissa: |x|/scale rounded to the nearest of 0 and
2^-6, …, 2^-1, 1 (ties away from zero); code = 8·sign + e, e = 0 for zero and 7 + log2(level) else;
two codes per byte (:func:`pack4`).

Bits on the wire per value: 8 or 4, plus 32 per row for its scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["FORMATS", "VALUE_BITS", "rows_of", "encode", "decode", "roundtrip", "pack4", "unpack4"]

FORMATS = ("fp8", "fp4")
VALUE_BITS = {"fp8": 8, "fp4": 4}
FP8_MAX = 448.0   # the largest float8_e4m3fn
E3M0_LOW = -6     # the smallest nonzero fp4 level: 2^-6


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"the wire format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def rows_of(x: Tensor) -> Tensor:
    """``x`` as (rows, last dimension), fp32; a 0-d or 1-d tensor as one row."""
    return x.float().reshape(-1, x.shape[-1]) if x.dim() > 1 else x.float().reshape(1, -1)


def _safe(scales: Tensor) -> Tensor:
    return torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale, its codes are 0


def encode(rows: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """Rows (R, C) fp32 → (codes (R, C) uint8, one per value; scales (R,) fp32)."""
    _check(fmt)
    scales = rows.abs().amax(dim=1)
    safe = _safe(scales)[:, None]
    if fmt == "fp8":
        return (rows * (FP8_MAX / safe)).to(torch.float8_e4m3fn).view(torch.uint8), scales
    m = rows.abs() / safe  # in [0, 1]
    lower = torch.floor(torch.log2(m.clamp(min=2.0 ** E3M0_LOW)))                # k: 2^k <= m (or -6)
    e = torch.where(m >= 1.5 * torch.exp2(lower), lower + 1, lower).clamp(max=0)  # the nearer of 2^k, 2^(k+1)
    e = torch.where(m >= 2.0 ** (E3M0_LOW - 1), e - E3M0_LOW + 1, torch.zeros_like(e))  # 1..7; below 2^-7: 0
    return (e.to(torch.uint8) | ((rows < 0) & (e > 0)).to(torch.uint8) << 3), scales


def decode(codes: Tensor, scales: Tensor, fmt: str) -> Tensor:
    """(codes (R, C) uint8, scales (R,)) → values (R, C) fp32."""
    _check(fmt)
    safe = _safe(scales)[:, None]
    if fmt == "fp8":
        return codes.view(torch.float8_e4m3fn).float() * (safe / FP8_MAX)
    e = (codes & 7).float()
    level = torch.where(e > 0, torch.exp2(e + (E3M0_LOW - 1)), torch.zeros_like(e))
    sign = 1.0 - 2.0 * (codes >> 3).float()
    return sign * level * safe


def roundtrip(x: Tensor, fmt: str) -> Tensor:
    """``x`` as it arrives after a trip in ``fmt``, fp32, in x's shape."""
    return decode(*encode(rows_of(x), fmt), fmt).reshape(x.shape)


def pack4(codes: Tensor) -> Tensor:
    """Flat 4-bit codes (uint8 < 16) → bytes, two per byte (low nibble first; an odd count padded with 0)."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack4(packed: Tensor, n: int) -> Tensor:
    """The first ``n`` 4-bit codes of :func:`pack4`'s bytes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]
