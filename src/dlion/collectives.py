"""Collective algorithms that turn every rank's local signs into the same codes.

Input on every rank: δ ∈ {−1, 0, +1} (int8), a flat buffer of ``n`` coordinates
with n a multiple of ``ALIGN·N``, and ``zeros``: whether any rank abstains
(has a 0) anywhere in this buffer this step — agreed on beforehand, so all
ranks pick the same wire format. Output on every rank: the same integer codes
of :class:`~dlion.aggregation.VoteRule` for all n coordinates.

The way up is 1 bit per coordinate (:class:`~dlion.codec.SignCodec`) when
``zeros`` is false and 1.6 bits (:class:`~dlion.codec.TritCodec`) when true;
the way back has b = ``rule.result_bits(zeros)`` bits per coordinate.

Bytes are counted per rank as the data a bandwidth-optimal implementation of
each collective moves over this rank's links (what `comm_stats` reports):

* all_to_all_single of B bytes:   sends and receives B·(N−1)/N
* all_gather of B bytes per rank: sends and receives B·(N−1)   (ring)
* all_reduce of B bytes:          sends and receives 2·B·(N−1)/N (ring)

Never SUM-all-reduce bit-packed bytes: the bits would carry into each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .aggregation import VoteRule
from .codec import SignCodec, TritCodec

__all__ = ["CommStats", "ALGORITHMS", "onebit", "allgather", "upload_codec", "reduce_counts"]


@dataclass
class CommStats:
    """Cumulative traffic of one rank: bytes sent and received through
    collectives, the number of collective calls and of optimizer steps."""

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    steps: int = 0
    by_kind: dict = field(default_factory=dict)

    def add(self, kind: str, sent: float, received: float) -> None:
        self.bytes_sent += int(round(sent))
        self.bytes_received += int(round(received))
        self.collectives += 1
        k = self.by_kind.setdefault(kind, [0, 0])
        k[0] += int(round(sent))
        k[1] += int(round(received))

    def bits_per_param_per_step(self, num_params: int) -> float:
        """(bytes sent + received)·8 / (params · steps)."""
        if not self.steps or not num_params:
            return 0.0
        return 8.0 * (self.bytes_sent + self.bytes_received) / (num_params * self.steps)

    def state_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "collectives": self.collectives, "steps": self.steps,
                "by_kind": {k: list(v) for k, v in self.by_kind.items()}}

    def load_state_dict(self, d: dict) -> None:
        self.bytes_sent = int(d["bytes_sent"])
        self.bytes_received = int(d["bytes_received"])
        self.collectives = int(d["collectives"])
        self.steps = int(d["steps"])
        self.by_kind = {k: list(v) for k, v in d.get("by_kind", {}).items()}


def upload_codec(zeros: bool):
    return TritCodec() if zeros else SignCodec()


def reduce_counts(payloads: Tensor, codec, ranks: int, n: int) -> tuple[Tensor, Tensor]:
    """(s, nz) over ``ranks`` encoded vectors of ``n`` coordinates laid end to end."""
    if isinstance(codec, SignCodec):
        bits = codec.decode_bits(payloads, ranks * n).view(ranks, n)
        plus = bits[0].to(torch.int16)
        for r in range(1, ranks):
            plus += bits[r]
        s = plus.mul_(2).sub_(ranks)
        return s, torch.full_like(s, ranks)
    vals = codec.decode(payloads, ranks * n).view(ranks, n)
    s = vals[0].to(torch.int16)
    nz = vals[0].abs().to(torch.int16)
    for r in range(1, ranks):
        s += vals[r]
        nz += vals[r].abs()
    return s, nz


# torch 2.13 renames all_gather_into_tensor to all_gather_single; accept both.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def onebit(delta: Tensor, zeros: bool, rule: VoteRule, *, group=None, stats: CommStats, key: int) -> Tensor:
    """Reduce-scatter pattern (Lion Cub's 1-bit all-reduce, without scales).

    1. encode δ (1 bit, or 1.6 if ``zeros``) and split it into N equal chunks;
    2. ``all_to_all_single``: rank r receives chunk r of every rank;
    3. rank r counts (s, nz) on its chunk and applies the rule: codes of chunk r;
    4. encode the codes (b bits) and ``all_gather`` them: every rank has all codes.

    Bytes per rank, each way: n·(u + b)/8·(N−1)/N, u = 1 (1.6 with zeros).
    """
    world, rank = _world(group)
    n = delta.numel()
    chunk = n // world
    up = upload_codec(zeros)
    payload = up.encode(delta)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    moved = payload.numel() * (world - 1) / world
    stats.add("all_to_all", moved, moved)

    s, nz = reduce_counts(received, up, world, chunk)
    codes = rule.decide(s, nz, key=key, start=rank * chunk)
    down = rule.result_codec(zeros)
    mine = down.encode(codes)
    gathered = torch.empty(mine.numel() * world, dtype=mine.dtype, device=mine.device)
    _all_gather(gathered, mine, group=group)
    stats.add("all_gather", mine.numel() * (world - 1), mine.numel() * (world - 1))
    return down.decode(gathered, n)


def allgather(delta: Tensor, zeros: bool, rule: VoteRule, *, group=None, stats: CommStats, key: int) -> Tensor:
    """The naive reference: all-gather every rank's encoded δ, count everything locally.

    Bytes per rank: sends n·u/8·(N−1), receives as much — grows with N.
    """
    world, _ = _world(group)
    n = delta.numel()
    up = upload_codec(zeros)
    payload = up.encode(delta)
    gathered = torch.empty(payload.numel() * world, dtype=payload.dtype, device=payload.device)
    _all_gather(gathered, payload, group=group)
    stats.add("all_gather", payload.numel() * (world - 1), payload.numel() * (world - 1))
    s, nz = reduce_counts(gathered, up, world, n)
    return rule.decide(s, nz, key=key, start=0)


ALGORITHMS = {"1bit": onebit, "allgather": allgather}
