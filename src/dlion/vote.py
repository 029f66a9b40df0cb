"""Aggregation rules: how N local Lion signs become one update Δ.

Each worker i contributes δ_i ∈ {−1, 0, +1} per coordinate. A collective
reduces them to two integers per coordinate,

    s  = Σ_i δ_i          (in [−N, N])
    nz = Σ_i |δ_i|        (how many workers did not abstain; N when no δ_i is 0)

and the rule turns (s, nz) into an integer *code* that travels back to every
rank and a float Δ that every rank applies:

* ``mavo``  (majority vote):  code = sign(s) ∈ {−1, 0, +1},       Δ = code
* ``avg``   (averaging):      code = s ∈ [−N, N],                 Δ = code / N

Zeros are abstentions: a worker whose local update is exactly 0 (no gradient,
or c = 0) votes for neither side, so a coordinate that is 0 on every worker gets
Δ = 0 and never drifts (encoding 0 as ±1 would make such parameters walk). Ties (s = 0 with nz > 0, only possible for even nz):

* ``ties="zero"``   Δ = 0, as sign(0) = 0 in the paper. The code then takes
  three values and travels as base-3 digits (1.6 bits).
* ``ties="random"`` Δ = ±1 by a coin that every rank computes identically from
  (seed, step, bucket, coordinate index): a hash, not a random generator, so
  the coin of a coordinate does not depend on which rank votes on it or how the
  buffer is chunked. When no worker abstains anywhere in the bucket the code is
  then ±1 and travels as 1 bit.
* ``ties="previous"`` Δ = the coordinate's previous Δ (the code of the last
  applied step, which every rank holds identically), the coin where that was 0
  (the first step, or a coordinate that did not move). A 2–2 split says little
  about the direction; the last agreed direction is the better guess, and the
  update no longer flips on every tie. Same wire format as ``"random"``. Not a
  rule from the papers: dlion's own, measured in docs/benchmarks.md.

The wire format of the code is chosen by :meth:`VoteRule.result_codec` from
what values are possible, which depends on N, the rule and whether any worker
abstained in this bucket this step (``zeros``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .bitvote import le_bytes_torch, pack_bits_torch, unpack_bits_torch
from .codec import FieldCodec, SignCodec, TritCodec, bits_for

__all__ = ["VoteRule", "tie_coins", "tie_coins_at", "coin_bits", "coin_bits_torch", "VOTES", "TIES"]

VOTES = ("mavo", "avg")
TIES = ("zero", "random", "previous")
_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x &= _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def coin_key(seed: int, step: int, bucket: int) -> int:
    """A 32-bit key for one (seed, step, bucket): identical on every rank."""
    return _mix32(_mix32(_mix32(seed) ^ step) ^ (bucket * 0x9E3779B1))


def tie_coins(key: int, start: int, n: int, device=None) -> Tensor:
    """±1 (int8) for coordinates start … start+n−1 (see :func:`tie_coins_at`)."""
    return tie_coins_at(key, torch.arange(start, start + n, dtype=torch.int64, device=device))


def tie_coins_at(key: int, index: Tensor) -> Tensor:
    """±1 (int8) for arbitrary (int64) coordinates ``index``: bit i mod 32 of a 32-bit integer
    hash of (key, ⌊i/32⌋). One hash serves 32 neighbouring coordinates, so the packed coins of
    a chunk (:func:`coin_bits`) are the hashes' own bytes. Uses only int64 products below 2^63,
    so CPU and CUDA agree; on the CPU the hash runs in numpy's uint32, whose products wrap
    modulo 2^32: the same bits as the int64 products masked to 32 bits."""
    if index.device.type == "cpu":
        i = index.numpy()
        x = _hash_words(key, (i >> 5).astype(np.uint32))
        return torch.from_numpy(((x >> (i & 31).astype(np.uint32)) & 1).astype(np.int8) * np.int8(2) - np.int8(1))
    return _tie_coins_at_torch(key, index)


def _hash_words(key: int, w: np.ndarray) -> np.ndarray:
    """The 32-bit hash of (key, word w) in numpy's uint32, in place on ``w``."""
    m = np.uint32(0x45D9F3B)
    w ^= np.uint32(key & _MASK32)
    w ^= w >> 16
    w *= m
    w ^= w >> 16
    w *= m
    w ^= w >> 16
    return w


def coin_bits(key: int, start: int, n: int) -> np.ndarray:
    """:func:`tie_coins` of coordinates start … start+n−1 as packed bits (1 = +1, little-endian bit
    order): the hashes of the 32-coordinate words they lie in, as little-endian bytes (one hash per
    32 coins), cut to the range."""
    first, last = start >> 5, (start + n + 31) >> 5
    words = _hash_words(key, np.arange(first, last, dtype=np.int64).astype(np.uint32))
    raw = words.astype("<u4", copy=False).view(np.uint8)
    skip = start - 32 * first
    if skip % 8 == 0 and n % 8 == 0:
        return raw[skip // 8:skip // 8 + n // 8].copy()
    bits = np.unpackbits(raw, bitorder="little")[skip:skip + n]
    return np.packbits(bits, bitorder="little")


def _hash_words_torch(key: int, w: Tensor) -> Tensor:
    """:func:`_hash_words` in int64 torch operations (products below 2^59, masked to 32 bits), in
    place on ``w`` (int64 word indices)."""
    w.bitwise_xor_(key & _MASK32).bitwise_and_(_MASK32)
    for _ in range(2):
        w.bitwise_xor_(w >> 16).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    return w.bitwise_xor_(w >> 16)


def coin_bits_torch(key: int, start: int, n: int, device=None) -> Tensor:
    """:func:`coin_bits` as a uint8 tensor on ``device``, computed there (torch operations only)."""
    first, last = start >> 5, (start + n + 31) >> 5
    raw = le_bytes_torch(_hash_words_torch(key, torch.arange(first, last, dtype=torch.int64, device=device)))
    skip = start - 32 * first
    if skip % 8 == 0 and n % 8 == 0:
        return raw[skip // 8:skip // 8 + n // 8]
    return pack_bits_torch(unpack_bits_torch(raw, skip + n)[skip:])


def _tie_coins_at_torch(key: int, index: Tensor) -> Tensor:
    x = ((index >> 5) ^ key) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (x >> 16) ^ x
    return (((x >> (index & 31)) & 1) * 2 - 1).to(torch.int8)


def _ties(s: Tensor, nz: Optional[Tensor]) -> Tensor:
    """Indices of the tied coordinates: s = 0 with at least one vote (nz None: all voted); CPU tensors
    (numpy's flatnonzero is several times faster than torch's nonzero here)."""
    tied = s.numpy() == 0
    if nz is not None:
        tied &= nz.numpy() > 0
    return torch.from_numpy(np.flatnonzero(tied))


@dataclass(frozen=True)
class VoteRule:
    """The aggregation rule: ``vote`` in {"mavo", "avg"}, ``ties`` in {"zero", "random", "previous"}."""

    vote: str
    world_size: int
    ties: str = "zero"
    seed: int = 0

    def __post_init__(self):
        if self.vote not in VOTES:
            raise ValueError(f"Unknown vote {self.vote!r}; choose one of {', '.join(map(repr, VOTES))}.")
        if self.ties not in TIES:
            raise ValueError(f"Unknown ties {self.ties!r}; choose one of {', '.join(map(repr, TIES))}.")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    # -- the rule -----------------------------------------------------------
    def decide(self, s: Tensor, nz: Optional[Tensor], *, key: int = 0, start: int = 0,
               index: Optional[Tensor] = None, previous: Optional[Tensor] = None) -> Tensor:
        """Codes for coordinates start … start+len(s)−1 (or ``index``, where the values
        were gathered from elsewhere in the bucket) from their (s, nz); ``nz`` None: every
        worker voted on every coordinate. ``previous`` (``ties="previous"``): the whole
        bucket's codes of the last applied step, indexed by bucket coordinate; None: all 0."""
        if self.vote == "avg":
            return s.to(torch.int16)
        code = torch.sign(s).to(torch.int8)
        if self.ties != "zero" and s.device.type != "cpu":
            # every coordinate's coin, kept where tied: finding the ties would make the host wait
            tied = s == 0
            if nz is not None:
                tied &= nz > 0
            at = torch.arange(start, start + s.numel(), device=s.device) if index is None else index.to(s.device)
            return torch.where(tied, self.tie_codes_torch(key, at, previous), code)
        if self.ties != "zero":
            where = _ties(s, nz)  # hash only the ties' coordinates (on the CPU: cheaper than every coin)
            if where.numel():
                at = where + start if index is None else index.to(s.device)[where]
                code[where] = self.tie_codes(key, at, previous)
        return code

    def tie_bits(self, key: int, start: int, n: int, previous: Optional[Tensor] = None) -> np.ndarray:
        """:meth:`tie_codes` of the contiguous coordinates start … start+n−1 as packed bits (1 = +1)
        for every one of them, tied or not (CPU)."""
        bits = coin_bits(key, start, n)
        if self.ties == "previous" and previous is not None:
            last = previous[start:start + n].numpy()
            moved = np.packbits(last != 0, bitorder="little")
            bits = (moved & np.packbits(last > 0, bitorder="little")) | (~moved & bits)
        return bits

    def tie_bits_torch(self, key: int, start: int, n: int, previous: Optional[Tensor] = None,
                       device=None) -> Tensor:
        """:meth:`tie_bits` as a uint8 tensor computed on ``device`` with torch operations (the
        previous codes are copied there if they live elsewhere)."""
        bits = coin_bits_torch(key, start, n, device)
        if self.ties == "previous" and previous is not None:
            last = previous[start:start + n].to(bits.device)
            moved, plus = pack_bits_torch(last != 0), pack_bits_torch(last > 0)
            bits = bits ^ (moved & (bits ^ plus))  # plus where moved, the coin elsewhere
        return bits

    def tie_codes_torch(self, key: int, at: Tensor, previous: Optional[Tensor] = None) -> Tensor:
        """:meth:`tie_codes` with torch operations on ``at``'s device, for every coordinate of ``at``
        (not only tied ones: no host synchronisation to find them); an ``at`` past the end of
        ``previous`` (padding, never tied) reads its last code instead of failing."""
        tied = _tie_coins_at_torch(key, at)
        if self.ties == "previous" and previous is not None:
            prev = previous.to(at.device)
            last = prev[at.clamp(max=prev.numel() - 1)].to(torch.int8)
            tied = torch.where(last != 0, last, tied)
        return tied

    def tie_codes(self, key: int, at: Tensor, previous: Optional[Tensor] = None) -> Tensor:
        """±1 (int8) for tied coordinates ``at`` (int64, bucket coordinates), ``ties`` "random"
        or "previous": the shared coin, or the previous code where that is not 0."""
        tied = tie_coins_at(key, at)
        if self.ties == "previous" and previous is not None:
            last = previous[at.to(previous.device)].to(device=tied.device, dtype=torch.int8)
            tied = torch.where(last != 0, last, tied)
        return tied

    def delta(self, code: Tensor, dtype: torch.dtype) -> Tensor:
        """Δ in ``dtype`` from codes: the update every rank applies."""
        if self.vote == "avg":
            return code.to(dtype).div_(self.world_size)
        return code.to(dtype)

    # -- its wire format ----------------------------------------------------
    def result_codec(self, zeros: bool):
        """Codec for the codes when ``zeros`` says whether any worker abstained."""
        n = self.world_size
        if self.vote == "avg":
            if zeros:
                return FieldCodec(bits_for(2 * n + 1), lo=-n)
            # No abstentions: s = 2·(#plus) − N has N's parity, so send #plus ∈ [0, N].
            return _PlusCountCodec(n)
        binary = not zeros and (self.ties != "zero" or n % 2 == 1)
        return SignCodec() if binary else TritCodec()

    def result_bits(self, zeros: bool = False) -> float:
        """Bits per coordinate on the way back (the b of (1 + b)(N−1)/N)."""
        return self.result_codec(zeros).bits


class _PlusCountCodec(FieldCodec):
    """avg without abstentions: code s ↔ (s + N)/2 = number of +1 votes, in ⌈log2(N+1)⌉ bits."""

    def __init__(self, n: int):
        super().__init__(bits_for(n + 1), lo=0)
        self.n = n

    def encode(self, values: Tensor) -> Tensor:
        return super().encode((values.to(torch.int32) + self.n) >> 1)

    def decode(self, packed: Tensor, n: int) -> Tensor:
        return super().decode(packed, n).mul_(2).sub_(self.n)
