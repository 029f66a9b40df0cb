"""Collective algorithms that turn every rank's local signs into the same codes.

Input on every rank: δ ∈ {−1, 0, +1} (int8), a flat buffer of ``n`` coordinates
with n a multiple of ``ALIGN·N``, and ``zeros``, agreed on beforehand so that
all ranks pick the same wire format:

* ``False`` — no rank abstains (has a 0) anywhere in the buffer: signs travel
  as 1 bit (:class:`~dlion.codec.SignCodec`);
* a tensor of every rank's *zero runs* (N × R × 2 int32, [start, end) pairs,
  padded with empty runs; see :func:`zero_runs`) — abstentions are few and
  clustered (dead units, unused rows): signs still travel as 1 bit and every
  rank knows exactly where each rank abstained;
* ``True`` — abstentions are too scattered for run tables: signs travel as
  base-3 digits (1.6 bits, :class:`~dlion.codec.TritCodec`).

Output on every rank: the same integer codes of
:class:`~dlion.aggregation.VoteRule` for all n coordinates; the way back has
b = ``down_codec(rule, zeros).bits`` bits per coordinate.

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


def upload_codec(zeros) -> "SignCodec | TritCodec":
    return TritCodec() if zeros is True else SignCodec()


def down_codec(rule: VoteRule, zeros):
    """(codec for the codes on the way back, whether receivers restore the unanimous
    abstentions themselves). With run tables every rank knows where all ranks
    abstained, so a code that can only be 0 there need not travel as a 0."""
    if zeros is False:
        return rule.result_codec(False), False
    if isinstance(zeros, Tensor) and rule.vote == "mavo" and rule.ties == "random":
        return SignCodec(), True  # with random ties a 0 only arises where everyone abstained
    return rule.result_codec(True), False


def zero_runs(delta: Tensor, n: int) -> Tensor:
    """[start, end) pairs (int32, R × 2) of the maximal runs of δ == 0 in δ[:n]."""
    z = (delta[:n] == 0).to(torch.int8)
    edge = torch.diff(z, prepend=z.new_zeros(1), append=z.new_zeros(1))
    starts = (edge == 1).nonzero().view(-1)
    ends = (edge == -1).nonzero().view(-1)
    return torch.stack([starts, ends], dim=1).to(torch.int32)


def runs_mask(runs: Tensor, lo: int, hi: int) -> Tensor:
    """Bool mask of the coordinates lo … hi−1 covered by ``runs`` (empty runs ignored)."""
    start = runs[:, 0].long().clamp(lo, hi) - lo
    end = runs[:, 1].long().clamp(lo, hi) - lo
    keep = end > start
    edge = torch.zeros(hi - lo + 1, dtype=torch.int32, device=runs.device)
    one = torch.ones(int(keep.sum()), dtype=torch.int32, device=runs.device)
    edge.index_add_(0, start[keep], one)
    edge.index_add_(0, end[keep], -one)
    return edge.cumsum(0)[:-1] > 0


#: Abstentions travel as run tables while these (all-gathered, int32 pairs) cost
#: less than the ternary format's extra 0.6 bit per coordinate on the way up.
def abstention_format(run_counts: list[int], n: int, world: int):
    """"none", "runs" or "ternary", from every rank's number of zero runs (identical on all ranks)."""
    most = max(run_counts)
    if most == 0:
        return "none"
    runs_bytes = 8 * most * (world - 1)
    ternary_extra = (TritCodec().nbytes(n) - SignCodec().nbytes(n)) * (world - 1) / world
    return "runs" if runs_bytes < ternary_extra else "ternary"


def reduce_counts(payloads: Tensor, codec, ranks: int, n: int, runs: Tensor | None = None,
                  lo: int = 0) -> tuple[Tensor, Tensor]:
    """(s, nz) over ``ranks`` encoded vectors of ``n`` coordinates laid end to end;
    with ``runs``, rank r's coordinates lo … lo+n−1 inside its runs abstain."""
    if isinstance(codec, SignCodec):
        bits = codec.decode_bits(payloads, ranks * n).view(ranks, n)
        if runs is not None:
            plus = torch.zeros(n, dtype=torch.int16, device=bits.device)
            nz = torch.zeros(n, dtype=torch.int16, device=bits.device)
            for r in range(ranks):
                voting = ~runs_mask(runs[r], lo, lo + n)
                plus += bits[r] & voting
                nz += voting
            return plus.mul_(2).sub_(nz), nz
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


def _restore_unanimous(codes: Tensor, runs: Tensor) -> Tensor:
    everyone = runs_mask(runs[0], 0, codes.numel())
    for r in range(1, runs.shape[0]):
        everyone &= runs_mask(runs[r], 0, codes.numel())
    return codes.masked_fill_(everyone, 0)


def onebit(delta: Tensor, zeros, rule: VoteRule, *, group=None, stats: CommStats, key: int) -> Tensor:
    """Reduce-scatter pattern (Lion Cub's 1-bit all-reduce, without scales).

    1. encode δ (1 bit, or 1.6 with ternary abstentions) and split it into N equal chunks;
    2. ``all_to_all_single``: rank r receives chunk r of every rank;
    3. rank r counts (s, nz) on its chunk and applies the rule: codes of chunk r;
    4. encode the codes (b bits) and ``all_gather`` them: every rank has all codes.

    Bytes per rank, each way: n·(u + b)/8·(N−1)/N, u = 1 (1.6 with ternary abstentions).
    """
    world, rank = _world(group)
    n = delta.numel()
    chunk = n // world
    runs = zeros if isinstance(zeros, Tensor) else None
    up = upload_codec(zeros)
    payload = up.encode(delta)
    received = torch.empty_like(payload)
    dist.all_to_all_single(received, payload, group=group)
    moved = payload.numel() * (world - 1) / world
    stats.add("all_to_all", moved, moved)

    s, nz = reduce_counts(received, up, world, chunk, runs, lo=rank * chunk)
    codes = rule.decide(s, nz, key=key, start=rank * chunk)
    down, restore = down_codec(rule, zeros)
    mine = down.encode(codes)
    gathered = torch.empty(mine.numel() * world, dtype=mine.dtype, device=mine.device)
    _all_gather(gathered, mine, group=group)
    stats.add("all_gather", mine.numel() * (world - 1), mine.numel() * (world - 1))
    codes = down.decode(gathered, n)
    return _restore_unanimous(codes, runs) if restore else codes


def allgather(delta: Tensor, zeros, rule: VoteRule, *, group=None, stats: CommStats, key: int) -> Tensor:
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
    s, nz = reduce_counts(gathered, up, world, n, zeros if isinstance(zeros, Tensor) else None)
    return rule.decide(s, nz, key=key, start=0)


ALGORITHMS = {"1bit": onebit, "allgather": allgather}


# -- p-bit: one SUM all-reduce of counters packed in fields that cannot carry ---------

def field_width(max_sum: int) -> int:
    """Narrowest field in {2, 4, 8, 16} bits that holds 0 … max_sum."""
    for w in (2, 4, 8, 16):
        if max_sum < 2**w:
            return w
    raise ValueError(f"counters up to {max_sum} do not fit a 16-bit field")


def pack_fields(values: Tensor, width: int) -> Tensor:
    """Non-negative integers < 2^width → words: 8/width fields per uint8 byte
    (width ≤ 8), or one field per int32 word (width 16)."""
    if width == 16:
        return values.to(torch.int32)
    k = 8 // width
    v = values.to(torch.uint8).view(-1, k)
    out = v[:, 0].clone()
    for j in range(1, k):
        out |= v[:, j] << (width * j)
    return out


_FIELD_LUTS: dict = {}


def unpack_fields(words: Tensor, width: int, n: int) -> Tensor:
    """Inverse of :func:`pack_fields` (as int16): one table gather per byte."""
    if width == 16:
        return words[:n]
    key = (width, words.device)
    lut = _FIELD_LUTS.get(key)
    if lut is None:
        k, mask = 8 // width, (1 << width) - 1
        lut = (torch.arange(256).view(-1, 1) >> (width * torch.arange(k))) & mask
        lut = _FIELD_LUTS[key] = lut.to(torch.int16).to(words.device)
    return torch.index_select(lut, 0, words.long()).view(-1)[:n]


def field_sum(values: Tensor, max_sum: int, *, group=None, stats: CommStats) -> Tensor:
    """Σ over ranks of non-negative per-coordinate integers whose total is ≤ max_sum,
    by one SUM all-reduce of packed fields (a field's sum never reaches the next field).
    Bytes per rank each way: 2·(N−1)/N · n·w/8 (w = 32 when w = 16)."""
    world, _ = _world(group)
    width = field_width(max_sum)
    words = pack_fields(values, width)
    dist.all_reduce(words, group=group)
    moved = words.numel() * words.element_size() * 2 * (world - 1) / world
    stats.add("all_reduce", moved, moved)
    return unpack_fields(words, width, values.numel())


def pbit(delta: Tensor, zeros: bool, rule: VoteRule, *, group=None, stats: CommStats, key: int) -> Tensor:
    """Lion Cub's p-bit all-reduce: one SUM all-reduce of per-coordinate counters.

    Without abstentions each rank contributes [δ > 0] and the sum is the number of
    +1 votes P ∈ [0, N] (s = 2P − N); with abstentions it contributes
    [δ > 0] + (N+1)·[δ < 0], whose sum P + (N+1)·M ≤ N(N+1) gives both counts.
    Fields are 2, 4, 8 or 16 bits wide, the narrowest that cannot overflow.
    Bytes per rank each way: 2·w·(N−1)/N · n/8.
    """
    world, _ = _world(group)
    if zeros is False:  # (the counter encoding below is exact for any abstentions: no run tables needed)
        plus = field_sum((delta > 0).view(torch.uint8), world, group=group, stats=stats)
        s = plus.to(torch.int16).mul_(2).sub_(world)
        nz = torch.full_like(s, world)
    else:
        v = (delta > 0).to(torch.int32) + (world + 1) * (delta < 0).to(torch.int32)
        total = field_sum(v, world * (world + 1), group=group, stats=stats)
        plus, minus = total % (world + 1), total // (world + 1)
        s, nz = (plus - minus).to(torch.int16), (plus + minus).to(torch.int16)
    return rule.decide(s, nz, key=key, start=0)


ALGORITHMS["pbit"] = pbit


def quantized_sum(q: Tensor, s: int, *, group=None, stats: CommStats) -> Tensor:
    """Σ_i q_i for q ∈ [−s, s] (int8) by a packed-field all-reduce of q + s."""
    world, _ = _world(group)
    total = field_sum((q.to(torch.int16) + s), 2 * s * world, group=group, stats=stats)
    return (total - s * world).to(torch.int16)


# -- choosing an algorithm ------------------------------------------------------

#: A collective's fixed cost expressed in bytes (≈ 50 µs of latency at 10 Gbit/s):
#: what lets "auto" prefer one collective over two for small buckets.
LATENCY_BYTES = 64 * 1024


def estimated_bytes(name: str, n: int, world: int, rule: VoteRule) -> float:
    """Bytes one rank sends per step for a bucket of n coordinates without abstentions."""
    if name == "1bit":
        return (1 + rule.result_bits(False)) * (world - 1) / world * n / 8
    if name == "allgather":
        return (world - 1) * n / 8
    if name == "pbit":
        w = field_width(world)
        return 2 * (32 if w == 16 else w) * (world - 1) / world * n / 8
    raise ValueError(name)


def choose_algorithm(n: int, world: int, rule: VoteRule) -> str:
    """``comm="auto"``: the algorithm with the least bytes + LATENCY_BYTES per collective
    call, for this bucket size, world size and rule (deterministic: identical on all ranks)."""
    calls = {"1bit": 2, "allgather": 1, "pbit": 1}
    return min(calls, key=lambda a: (estimated_bytes(a, n, world, rule) + calls[a] * LATENCY_BYTES, calls[a]))


# -- all N ranks in one process (simulation) -----------------------------------------

def simulated(deltas: list[Tensor], zeros, rule: VoteRule, *, key: int) -> Tensor:
    """The codes the collectives would produce for these N ranks' δ, computed in one
    process with the same encode → count → decide → result encode/decode path
    (the transport replaced by concatenation)."""
    world, n = len(deltas), deltas[0].numel()
    runs = zeros if isinstance(zeros, Tensor) else None
    up = upload_codec(zeros)
    s, nz = reduce_counts(torch.cat([up.encode(d) for d in deltas]), up, world, n, runs)
    codes = rule.decide(s, nz, key=key, start=0)
    down, restore = down_codec(rule, zeros)
    codes = down.decode(down.encode(codes), n)
    return _restore_unanimous(codes, runs) if restore else codes
