"""Majority vote on packed sign bits, without unpacking them.

With no abstention, MaVo's inputs are N rows of packed bits (1 = +1) and its
output is one packed row: +1 where more than N/2 rows have a 1, a tie where
exactly N/2 do (even N). Instead of unpacking N·c bits, summing and re-packing,
the count of ones per column is built as ⌈log2(N+1)⌉ packed *bit planes* by a
ripple-carry adder over whole bytes (bit-sliced addition), and compared with
N/2 bit by bit from the top. Every operation is a bitwise one on c/8 bytes,
O(N log N) of them: the same result as counting, in a fraction of the memory
traffic (``dlion bench codec`` measures it).
"""

from __future__ import annotations

import numpy as np

__all__ = ["count_planes", "compare_count", "popcount_prefix"]


def count_planes(rows: np.ndarray) -> list[np.ndarray]:
    """Bit k (k = 0, 1, …) of each column's number of set bits over the rows of ``rows``
    (uint8, one packed row per voter), as packed planes of the rows' shape."""
    planes: list[np.ndarray] = []
    for i, row in enumerate(rows):
        carry = row
        for k, plane in enumerate(planes):
            planes[k] = plane ^ carry
            carry = plane & carry
        if len(planes) < (i + 1).bit_length():  # the count can now reach 2^len(planes)
            planes.append(carry.copy())
    return planes


def compare_count(planes: list[np.ndarray], t: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed masks of (count > t, count == t) for the counts held in ``planes``."""
    if t >> len(planes):  # above every count the planes can hold
        zero = np.zeros_like(planes[0])
        return zero, zero.copy()
    gt = np.zeros_like(planes[0])
    eq = np.full_like(planes[0], 0xFF)
    for k in range(len(planes) - 1, -1, -1):
        x = planes[k]
        if (t >> k) & 1:
            eq &= x
        else:
            gt |= eq & x
            eq &= ~x
    return gt, eq


def _popcount(a: np.ndarray) -> int:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return int(np.bitwise_count(a).sum(dtype=np.int64))
    return int(np.unpackbits(a).sum(dtype=np.int64))


def popcount_prefix(mask: np.ndarray, n: int) -> int:
    """Set bits among the first ``n`` bits of a packed (little-endian bit order) mask."""
    full, rest = divmod(max(0, min(n, 8 * mask.size)), 8)
    total = _popcount(mask[:full])
    if rest:
        total += _popcount(mask[full:full + 1] & np.uint8((1 << rest) - 1))
    return total
