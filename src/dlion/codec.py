"""Bit codecs: pack small integers densely into uint8 buffers for the wire.

Three codecs, all lossless on their value sets and all usable on CPU and CUDA
tensors (on CPU the 1-bit codec's loops are :mod:`dlion.kernels`' native ones, else numpy's
packbits, several times faster than a torch multiply-and-sum there):

* :class:`SignCodec`   values in {−1, +1}          1 bit per value, 8 per byte
* :class:`TritCodec`   values in {−1, 0, +1}       1.6 bits per value, 5 per byte (3^5 = 243 ≤ 256)
* :class:`FieldCodec`  integers in [lo, lo + 2^b)  b bits per value, as b bit planes
                                                   (decoded as int16 where they fit, else int32)

A codec encodes a 1-D tensor whose length is a multiple of ``codec.align`` into
``codec.nbytes(n)`` bytes; encoding a concatenation of aligned pieces gives the
concatenation of their encodings, which is what lets the collectives split a
packed buffer into per-rank chunks without re-packing.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from . import kernels

__all__ = [
    "pack_bits",
    "unpack_bits",
    "SignCodec",
    "TritCodec",
    "FieldCodec",
    "ALIGN",
    "bits_for",
    "padded_length",
]

#: Every codec's alignment divides this, so chunks of a multiple of ALIGN values
#: can be encoded independently by any codec.
ALIGN = 40  # lcm(8, 5)

_BIT_WEIGHTS = {}


def bits_for(levels: int) -> int:
    """Fewest bits that hold ``levels`` distinct values (at least 1)."""
    return max(1, math.ceil(math.log2(levels)))


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a 1-D bool/uint8 tensor of 0/1 (length a multiple of 8), least significant bit first."""
    if bits.numel() % 8:
        raise ValueError(f"pack_bits needs a length that is a multiple of 8, got {bits.numel()}")
    if bits.device.type == "cpu":
        arr = bits.contiguous().view(torch.uint8).numpy() if bits.dtype == torch.bool else bits.contiguous().numpy()
        return torch.from_numpy(np.packbits(arr, bitorder="little"))
    b = bits.to(torch.uint8).view(-1, 8)
    w = _BIT_WEIGHTS.get(b.device)
    if w is None:
        w = _BIT_WEIGHTS[b.device] = (2 ** torch.arange(8, device=b.device)).to(torch.uint8)
    # Products are distinct powers of two, so the uint8 sum cannot carry.
    return (b * w).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a uint8 tensor of 0/1."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=n, bitorder="little"))
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n]


class SignCodec:
    """{−1, +1} ↔ 1 bit (1 means +1). Encoding maps every value > 0 to +1 and
    everything else to −1, so callers must only pass values known to be ±1."""

    bits = 1.0
    align = 8

    def nbytes(self, n: int) -> int:
        return n // 8

    def encode(self, values: Tensor) -> Tensor:
        if values.device.type == "cpu" and values.dtype == torch.int8:  # one native pass (numpy without it)
            return kernels.pack_positive(values)
        if values.device.type == "cpu":  # numpy's comparison of small ints is several times faster than torch's
            return pack_bits(torch.from_numpy(values.contiguous().numpy() > 0))
        return pack_bits(values > 0)

    def decode_bits(self, packed: Tensor, n: int) -> Tensor:
        """The raw 0/1 bits (1 = +1) as uint8: cheaper than ±1 when only counting."""
        return unpack_bits(packed, n)

    _luts: dict = {}

    def decode(self, packed: Tensor, n: int) -> Tensor:
        if packed.device.type == "cpu" and kernels.available():  # 8 bytes copied per packed byte
            return kernels.unpack_signs(packed, n)
        # A table of 256 int64 words, each the 8 ±1 bytes of one packed byte: one 8-byte gather per
        # byte (int32 indices) beats both unpack-then-convert and a gather of 8 one-byte columns.
        lut = self._luts.get(packed.device)
        if lut is None:
            bits = (torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1
            rows = (bits * 2 - 1).to(torch.int8).contiguous()
            lut = self._luts[packed.device] = rows.view(-1).view(torch.int64).to(packed.device)
        return torch.index_select(lut, 0, packed.to(torch.int32)).view(torch.int8)[:n]


class TritCodec:
    """{−1, 0, +1} ↔ base-3 digits, 5 per byte: byte = Σ_k (v_k + 1)·3^k ≤ 242."""

    bits = 8 / 5
    align = 5
    _luts: dict = {}

    def nbytes(self, n: int) -> int:
        return n // 5

    def encode(self, values: Tensor) -> Tensor:
        if values.numel() % 5:
            raise ValueError(f"TritCodec needs a length that is a multiple of 5, got {values.numel()}")
        d = (values.to(torch.int8) + 1).view(torch.uint8).view(-1, 5)
        out = d[:, 4].clone()
        for k in (3, 2, 1, 0):  # Horner: ((d4·3 + d3)·3 + d2)… stays ≤ 242 in uint8
            out.mul_(3).add_(d[:, k])
        return out

    def _lut(self, device) -> Tensor:
        lut = self._luts.get(device)
        if lut is None:
            codes = torch.arange(243)
            digits = torch.stack([(codes // 3**k) % 3 for k in range(5)], dim=1) - 1
            lut = self._luts[device] = digits.to(torch.int8).to(device)
        return lut

    def decode(self, packed: Tensor, n: int) -> Tensor:
        # int32 indices: half the index traffic of int64 and about twice as fast on the CPU
        return torch.index_select(self._lut(packed.device), 0, packed.to(torch.int32)).view(-1)[:n]


class FieldCodec:
    """Integers in [lo, lo + 2^width) as ``width`` bit planes (plane k holds bit k
    of every value), so any width costs exactly ``width`` bits per value."""

    align = 8

    def __init__(self, width: int, lo: int = 0):
        if not 1 <= width <= 15:
            raise ValueError(f"FieldCodec width must be in 1..15, got {width}")
        self.width = width
        self.lo = lo
        self.bits = float(width)
        #: dtype of decoded values: int16 where [lo, lo + 2^width) fits it (half the memory of int32)
        self.dtype = torch.int16 if -2**15 <= lo and lo + 2**width <= 2**15 else torch.int32

    def nbytes(self, n: int) -> int:
        return self.width * n // 8

    def _small(self) -> torch.dtype:
        return torch.uint8 if self.width <= 8 else torch.int16

    def encode(self, values: Tensor) -> Tensor:
        n = values.numel()
        if n % 8:
            raise ValueError(f"FieldCodec needs a length that is a multiple of 8, got {n}")
        # One byte (or two) per value before splitting into planes: 4× less memory traffic than int32
        # (the subtraction runs in int16 where every value and its offset from lo fit).
        v = (values.to(self.dtype) - self.lo).to(self._small())
        planes = [pack_bits((v >> k) & 1 if k else v & 1) for k in range(self.width)]
        # Interleave per aligned group of 8 values so that concatenated chunks stay chunk-contiguous.
        return torch.stack(planes, dim=1).view(-1)

    _luts: dict = {}

    def _lut(self, k: int, device) -> Tensor:
        """Row b: the 8 bits of byte b, each shifted to plane k's weight 2^k, as the whole words
        of those 8 small values (one int64 per row for uint8 values, two for int16)."""
        key = (k, self._small(), device)
        lut = self._luts.get(key)
        if lut is None:
            bits = (torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1
            lut = self._luts[key] = (bits << k).to(self._small()).contiguous().view(torch.int64).to(device)
        return lut

    def decode(self, packed: Tensor, n: int) -> Tensor:
        planes = packed.view(-1, self.width)
        out = None
        for k in range(self.width):
            # one word gather per byte: the 8 values' plane-k bits at once (as SignCodec.decode)
            part = torch.index_select(self._lut(k, packed.device), 0, planes[:, k].to(torch.int32))
            out = part if out is None else out.add_(part)  # planes never overlap: no carries, not even across values
        return out.view(self._small()).view(-1)[:n].to(self.dtype).add_(self.lo)

    def __repr__(self) -> str:
        return f"FieldCodec(width={self.width}, lo={self.lo})"


def padded_length(numel: int, world: int) -> int:
    """Bucket length padded so each of the N chunks encodes on its own with every codec."""
    quantum = ALIGN * world
    return max(quantum, -(-numel // quantum) * quantum)
