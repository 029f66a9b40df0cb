"""Aggregation algorithms: every rank's int8 contribution → the same codes on every rank.

One object per algorithm; each owns its wire format, the collectives it issues
and the bytes they move (:meth:`Algorithm.estimated_bytes`, computed from the
same block sizes the real run sends). The run itself is a generator,
``run(state, contribution, rank, key)``, that *yields* the collectives it needs
— ``(kind, send_tensor, label)`` — and receives their output; a driver decides
how they travel (asynchronously on a process group in :class:`dlion.DistributedLion`,
by concatenation in :class:`dlion.SimulatedDistributedLion`), so both run the
same code and count the same bytes.

Per bucket, a rank contributes δ ∈ {−1, 0, +1} (the sign of its Lion direction;
0 = *abstain*: no gradient there, or c = 0) or, for quantised aggregation,
q ∈ [−s, s]. A small header travels *inside* the first collective's payload —
every rank's status (bad or non-finite gradient), a digest of its
hyperparameters, which parameters it has gradients for, and where it abstains —
so no rank needs a separate agreement round: after the first collective every
rank knows every rank's header and takes the same decisions.

Algorithms (``comm=``):

* ``1bit`` — Lion Cub's 1-bit all-reduce: rank r receives chunk r of everyone's
  signs (``all_to_all``), votes on it, and the codes are ``all_gather``-ed.
  Per rank, each way: (1 + b)·(N−1)/N bits per coordinate (b: width of a code)
  plus one header per block.
* ``allgather`` — the naive reference: everyone's signs to everyone, count locally;
  (N−1) bits per coordinate.
* ``pbit`` — one SUM ``all_reduce`` of per-coordinate counters packed in fields
  that cannot carry; 2·w·(N−1)/N bits (w = 2, 4, 8 or 32).
* ``quantized`` — Lion Cub's quantised aggregation: Σ_i q_i by one packed-field
  ``all_reduce``; Δ = sign(Σ q).

Abstentions keep the 1-bit path: a sender lists its zero *runs* (``[start,
end)`` pairs, up to ``runs_capacity`` per block, a fixed part of the header);
receivers mask them out of the count. Where a rank has more runs than fit, every
rank sees its overflow bit after the first collective, the bucket is re-sent as
base-3 digits (1.6 bits) and stays so until everyone's runs fit again (half the
capacity). Off the CPU the runs are found and listed on the device (:func:`device_runs`,
:func:`_device_headers`) without the host reading their number — the header's room is
fixed — so the bytes are those the host builds on the CPU, with no host synchronisation.
The codes come back the same way: ±1 as 1 bit plus the zero runs of the result
(where every rank abstained, or a tie gave 0), base-3 only when those runs do not fit — unless every abstention is a whole parameter without
gradient: then every rank knows each coordinate's number of voters from the
headers' bitmaps and the codes come back in the bits that number allows
(:class:`_ByVoters`). :func:`run_compacted` leaves the parameters no rank had a
gradient for in the previous step out of the payload altogether.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import numpy as np
import torch
from torch import Tensor

from . import kernels
from .vote import VoteRule
from .bitvote import (compare_count, compare_count_torch, count_planes, count_planes_torch, equals_all_torch,
                      pack_bits_torch, popcount_prefix, popcount_prefix_torch, unpack_bits_torch)
from .codec import FieldCodec, SignCodec, TritCodec, bits_for, padded_length
from .collectives import bytes_moved, field_width, pack_fields, unpack_fields

__all__ = ["Contribution", "Outcome", "WireState", "Algorithm", "OneBit", "AllGather", "PBit", "Quantized",
           "ALGORITHMS", "make_algorithm", "choose_algorithm", "LATENCY_BYTES", "BAD", "NONFINITE",
           "zero_runs", "runs_mask", "padded_length", "run_compacted", "Request", "Received", "read_heads"]

BAD, NONFINITE = 1, 2          # status bits a rank reports for a bucket
_ABSTAINS, _FITS, _OVERFLOW = 4, 8, 16
_SCATTERED = 32                # many zeros besides the parameters the sender has no gradient for
_BITMAP_BITS = 16              # has-gradient bits per int32 header word (no sign-bit games)
_SIGN, _TRIT = SignCodec(), TritCodec()

#: The packed-bit majority vote (no abstention) runs in torch operations on the payload's device
#: (:meth:`OneBit._vote_packed_torch`) for every payload not on the CPU; True makes CPU payloads
#: take it too (tests compare it with the native/numpy vote the CPU takes otherwise).
TORCH_VOTE = False


def _torch_vote(payloads: Tensor) -> bool:
    return TORCH_VOTE or payloads.device.type != "cpu"


@dataclass
class Contribution:
    """One rank's input to one bucket's aggregation."""

    values: Tensor          # int8, the padded bucket: δ ∈ {−1, 0, 1} or q ∈ [−s, s]; padding is 0
    numel: int              # real coordinates (values[numel:] is padding)
    has_grad: Tensor        # bool, one per parameter of the bucket
    status: int = 0         # BAD | NONFINITE
    digest: int = 0         # hyperparameter digest (31 bits): must be equal on every rank
    #: int64, the bucket coordinate of each value when the values were gathered from parts of the
    #: bucket (:func:`run_compacted`): the tie coins follow it; None means values[i] is coordinate i
    positions: Optional[Tensor] = None
    #: the number of values of each parameter, in order (0 for one left out of ``values``); None if unknown
    sizes: Optional[list] = None
    #: called with the outcome as soon as its failure flags (``bad``, ``nonfinite``,
    #: ``digests_agree``) are final — after the first collective, before the codes exist —
    #: so that a driver may apply finished buckets while later ones are still on the wire
    on_flags: Optional[Callable[["Outcome"], None]] = None
    #: ``ties="previous"``: the whole bucket's codes of the last applied step (by bucket coordinate)
    previous: Optional[Tensor] = None
    #: the packed bits of values > 0 and how many of values[:numel] are 0, where whoever made
    #: ``values`` computed them on the way (:func:`dlion.buckets.contribute`, ``fused=True``);
    #: None: computed here from ``values``
    packed: Optional[Tensor] = None
    zeros: Optional[int] = None
    #: off the CPU, flags not read on the host (``DistributedLion(overlap=True)`` from backward's hooks):
    #: a 0-d bool tensor on the device, whether this rank's values are finite; ``status`` then lacks
    #: NONFINITE, ``zeros`` (if given) is a 0-d int64 tensor there too, and the algorithm builds its header
    #: on the device without reading either (:func:`_device_headers`, :func:`_fields`)
    finite: Optional[Tensor] = None

    def index(self, lo: int, n: int) -> Optional[Tensor]:
        return None if self.positions is None else self.positions[lo:lo + n]

    def flags_known(self, out: "Outcome") -> "Outcome":
        if self.on_flags is not None:
            self.on_flags(out)
        return out


@dataclass
class Outcome:
    """What every rank knows after a bucket's aggregation (identical on all ranks)."""

    _codes: Optional[Tensor]    # the rule's codes for the padded bucket (``codes``); None if the step must not apply
    has_grad: Tensor            # bool per parameter: a gradient on some rank
    bad: int = 0                # ranks that rejected their gradients
    nonfinite: int = 0          # ranks with inf/NaN
    digests_agree: bool = True  # every rank sent the same hyperparameter digest
    ranks_bad: list = field(default_factory=list)        # which ranks, where the wire format tells
    ranks_nonfinite: list = field(default_factory=list)
    #: int64 [coordinates voted on, unanimous (|s| = N), tied (s = 0, some vote)] over the coordinates
    #: this rank decided (its chunk for ``1bit``, the whole bucket otherwise); None for ``quantized``
    tally: Optional[Tensor] = None
    #: The codes as packed bits (1 = +1, little-endian bit order) where they came back as 1 bit: the
    #: native update reads these directly (:func:`dlion.buckets.apply_signs`), and ``codes`` is
    #: decoded from them only when something asks for it.
    signs: Optional[Tensor] = None

    @property
    def codes(self) -> Optional[Tensor]:
        if self._codes is None and self.signs is not None:
            self._codes = _SIGN.decode(self.signs, 8 * self.signs.numel())
        return self._codes

    @codes.setter
    def codes(self, value: Optional[Tensor]) -> None:
        self._codes, self.signs = value, None

    @property
    def failed(self) -> bool:
        """Some rank rejected or had inf/NaN gradients, or the hyperparameters differ: no rank applies."""
        return bool(self.bad or self.nonfinite or not self.digests_agree)


def row_sum(x: Tensor) -> Tensor:
    """Σ over dim 0 of an 8-bit (or bool) tensor as int16, accumulated row by row in 8 bits, which is
    exact while rows ≤ 127 (|sum| ≤ rows): ``sum(0, dtype=int16)`` widens every element first and
    is several times slower on the CPU."""
    if x.shape[0] > 127:
        return x.sum(0, dtype=torch.int16)
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    acc = x[0].clone()
    for row in x[1:]:
        acc.add_(row)
    return acc.to(torch.int16)


def vote_tally(s: Tensor, nz: Optional[Tensor], world: int, real: int) -> Tensor:
    """[voted, unanimous, tied] over the first ``real`` coordinates of (s, nz) (the rest is padding;
    ``nz`` None: every worker voted on every coordinate)."""
    s = s[:max(0, real)]
    if nz is None:
        if s.device.type == "cpu":  # numpy counts int16 several times faster than torch
            sn = s.numpy()
            voted, nonzero = sn.size, int(np.count_nonzero(sn))
            unanimous = int(np.count_nonzero(sn == world)) + int(np.count_nonzero(sn == -world))
            return torch.tensor([voted, unanimous, voted - nonzero], dtype=torch.int64)
        nz = torch.full_like(s, world)
    nz = nz[:max(0, real)]
    # count_nonzero, not sums of bools (those widen every element to int64 first: 10x slower).
    # A tie is a voted coordinate with s = 0, and s != 0 implies a vote: tied = voted - nonzero(s).
    voted = torch.count_nonzero(nz)
    return torch.stack([voted, torch.count_nonzero(s.abs() == world), voted - torch.count_nonzero(s)]).to(torch.int64)


@dataclass
class WireState:
    """Per-bucket wire formats agreed by every rank (changes only on information all ranks share)."""

    up: str = "runs"     # "runs" (1 bit + zero runs) or "ternary"; pbit: "narrow" or "wide"
    down: str = "runs"   # "runs" or "ternary" (sign votes with abstentions)


def zero_runs(values: Tensor, rows: int, numel: int) -> tuple[Tensor, Tensor, Tensor]:
    """Runs of 0 in values[:numel] (values viewed as ``rows`` equal rows, a run never
    crossing a row): (row, start, end) int64 tensors, start/end relative to the row.
    Costs one pass to find the zeros, then work in the number of zeros."""
    width = values.numel() // rows
    head = values[:numel]
    if not _has_zeros(head):
        empty = torch.zeros(0, dtype=torch.int64, device=values.device)
        return empty, empty, empty
    if head.device.type == "cpu":
        at = torch.from_numpy(np.flatnonzero(head.numpy() == 0))
    else:
        at = (head == 0).nonzero().view(-1)
    new_run = torch.ones(at.numel(), dtype=torch.bool, device=at.device)
    new_run[1:] = (at[1:] != at[:-1] + 1) | (at[1:] % width == 0)
    first = new_run.nonzero().view(-1)
    last = torch.cat([first[1:] - 1, first.new_tensor([at.numel() - 1])])
    row = at[first] // width
    return row, at[first] - row * width, at[last] + 1 - row * width


_NO_RUNS = (torch.zeros(0, dtype=torch.int64),) * 3


def _run_edges(values: Tensor, rows: int, numel: int, lasts: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """(rows, width) bool masks of the first and (``lasts``) of the last zero of every run of 0 in
    values[:numel]; None in place of the second without ``lasts``."""
    zero = values == 0
    if numel < values.numel():
        zero[max(0, numel):] = False  # padding is not a run
    zero = zero.view(rows, -1)
    edge = torch.zeros(rows, 1, dtype=torch.bool, device=values.device)  # a run never crosses a row
    firsts = zero & ~torch.cat([edge, zero[:, :-1]], 1)
    return firsts, (zero & ~torch.cat([zero[:, 1:], edge], 1)) if lasts else None


def device_runs(values: Tensor, rows: int, numel: int, capacity: int) -> tuple[Tensor, Tensor]:
    """:func:`zero_runs` for a header with room for ``capacity`` runs per row, found on ``values``' device
    with no host synchronisation: the host need not know how many runs there are, since the header's room
    is fixed. Returns (counts, table): int64 (rows,), each row's number of runs, and int32 (rows, capacity, 2),
    row r's first min(counts[r], capacity) runs' (start, end) in order, zeros in the other slots — what
    :func:`_headers` writes where no row has more than ``capacity`` runs (a caller flags an overflow
    otherwise, and lists none). Finds the runs' first and last zeros by comparing neighbours, then their
    positions with ``nonzero_static`` (fixed output size, no read of the count)."""
    n = values.numel()
    width = n // rows
    dev = values.device
    if width == 0:
        return (torch.zeros(rows, dtype=torch.int64, device=dev),
                torch.zeros(rows, capacity, 2, dtype=torch.int32, device=dev))
    firsts, lasts = _run_edges(values, rows, numel)
    counts = firsts.sum(1)
    room = rows * capacity  # more runs than that: some row has more than capacity (an overflow)
    at = torch.nonzero_static(firsts.view(-1), size=room, fill_value=-1).view(-1)
    to = torch.nonzero_static(lasts.view(-1), size=room, fill_value=-1).view(-1)  # (the same runs, in order)
    row = at.clamp(min=0) // width
    pos = torch.arange(room, device=dev) - (torch.cumsum(counts, 0) - counts)[row]
    ok = (at >= 0) & (pos < capacity)
    slot = torch.where(ok, row * capacity + pos, room)  # the rest to a spare slot, dropped
    pairs = torch.stack([at - row * width, to + 1 - row * width], 1).to(torch.int32)
    table = torch.zeros(room + 1, 2, dtype=torch.int32, device=dev)
    table.index_put_((slot,), pairs)
    return counts, table[:room].view(rows, capacity, 2)


def _device_within(contrib: Contribution) -> Tensor:
    """:func:`_zeros_within_parameters` as a 0-d int64 tensor on the values' device (no host read)."""
    dev = contrib.values.device
    if contrib.sizes is None:
        return torch.full((), contrib.numel, dtype=torch.int64, device=dev)
    zeros = contrib.zeros if contrib.zeros is not None else _device_zeros(contrib)
    extra = zeros - _absent_values(contrib)
    if not isinstance(extra, Tensor):  # (the zero count read already, with the finiteness flags)
        return torch.full((), extra if extra >= 0 else contrib.numel, dtype=torch.int64, device=dev)
    return torch.where(extra >= 0, extra, contrib.numel).to(torch.int64)


def _device_headers(contrib: Contribution, blocks: int, capacity: int, slots: bool, scattered: bool) -> Tensor:
    """:func:`_headers` of :func:`zero_runs` made on the values' device with no host synchronisation, the same
    bytes: the host writes what it knows (status, digest, bitmap) and one copy from pinned memory takes it
    to the device, where the runs (:func:`device_runs`) and the status bits they decide are written by
    tensor operations: _ABSTAINS where there is a run, _FITS where no block has more than ``capacity // 2``,
    _OVERFLOW (no run listed) where one has more than ``capacity``, _SCATTERED (with ``scattered``) where
    there is a run and :func:`_zeros_within_parameters` exceeds ``capacity // 2``; NONFINITE where
    ``contrib.finite`` (if given) is false."""
    host = _headers(contrib, blocks, capacity, _NO_RUNS, slots)
    host[:, 0] = contrib.status  # (without the _FITS of no runs: set below)
    values = contrib.values
    h = _host_to(host, values.device)
    counts, table = device_runs(values, blocks, contrib.numel, capacity)
    most = counts.max()
    runs, over = most > 0, most > capacity
    bits = (runs.to(torch.int32) * _ABSTAINS + (most <= capacity // 2).to(torch.int32) * _FITS
            + over.to(torch.int32) * _OVERFLOW)
    if scattered:
        bits = bits + (runs & (_device_within(contrib) > capacity // 2)).to(torch.int32) * _SCATTERED
    if contrib.finite is not None:
        bits = bits + (~contrib.finite).to(torch.int32) * NONFINITE
    h[:, 0] = h[:, 0] | bits
    if slots:
        keep = (~over).to(torch.int32)
        g = -(-contrib.has_grad.numel() // _BITMAP_BITS)
        h[:, 2] = counts.to(torch.int32) * keep
        h[:, 3 + g:] = table.view(blocks, -1) * keep
    return h


def _has_zeros(values: Tensor) -> bool:
    if values.device.type == "cpu" and values.dtype == torch.int8:
        return kernels.count_zeros(values) > 0
    if values.device.type == "cpu":
        return int(np.count_nonzero(values.numpy())) < values.numel()
    return not bool(values.all())


def runs_mask(rows: Tensor, starts: Tensor, ends: Tensor, shape: tuple[int, int]) -> Tensor:
    """Bool mask of shape (R, W): True inside the given runs."""
    r, w = shape
    edge = torch.zeros(r * (w + 1), dtype=torch.int32, device=rows.device)
    one = torch.ones(rows.numel(), dtype=torch.int32, device=rows.device)
    edge.index_add_(0, rows * (w + 1) + starts, one)
    edge.index_add_(0, rows * (w + 1) + ends, -one)
    return edge.view(r, w + 1).cumsum(1)[:, :w] > 0


def run_indices(starts: Tensor, ends: Tensor, total: Optional[int] = None) -> Tensor:
    """Every index inside the runs [starts[i], ends[i]), run after run: work in their total length
    (``total``, where the caller knows it: otherwise read from the runs, a host read off the CPU)."""
    lengths = ends - starts
    if total is None:
        total = int(lengths.sum())
    if total == 0:
        return starts.new_zeros(0)
    skip = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - skip, lengths, output_size=total) + torch.arange(
        total, dtype=starts.dtype, device=starts.device)


def _host_to(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device``; off the CPU from pinned memory, asynchronously (no host wait)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# -- the header that rides in front of a block ------------------------------------------

def _header_words(k: int, capacity: int) -> int:
    return 3 + -(-k // _BITMAP_BITS) + 2 * capacity


def _bitmap(has_grad: Tensor) -> Tensor:
    k = has_grad.numel()
    g = -(-k // _BITMAP_BITS)
    bits = torch.zeros(g * _BITMAP_BITS, dtype=torch.int32)
    bits[:k] = has_grad.to(torch.int32).cpu()
    return (bits.view(g, _BITMAP_BITS) << torch.arange(_BITMAP_BITS, dtype=torch.int32)).sum(1, dtype=torch.int32)


def _unbitmap(words: Tensor, k: int) -> Tensor:
    """(senders, G) words → (senders, k) bool."""
    bits = (words.unsqueeze(-1) >> torch.arange(_BITMAP_BITS, dtype=torch.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :k].bool()


def _headers(contrib: Contribution, blocks: int, capacity: int, runs, slots: bool,
             scattered: bool = False) -> Tensor:
    """(blocks, H) int32 headers of one sender: status, digest, run count, has-gradient bitmap
    and, with ``slots``, room for ``capacity`` zero runs, block r's runs in row r. Sets
    _ABSTAINS when the sender has zeros (and _SCATTERED with ``scattered``), _FITS when every
    block's runs fit half the capacity, _OVERFLOW (and lists no runs) when some block's runs
    exceed it."""
    k = contrib.has_grad.numel()
    g = -(-k // _BITMAP_BITS)
    h = torch.zeros(blocks, _header_words(k, capacity if slots else 0), dtype=torch.int32)
    status = contrib.status
    rows, starts, ends = runs
    if rows.numel():
        status |= _ABSTAINS
        if scattered:
            status |= _SCATTERED
        counts = torch.bincount(rows.cpu(), minlength=blocks)
        most = int(counts.max())
        if most <= capacity // 2:
            status |= _FITS
        if most > capacity:
            status |= _OVERFLOW
        elif slots:
            first = torch.cumsum(counts, 0) - counts
            pos = torch.arange(rows.numel()) - first[rows.cpu()]
            table = h[:, 3 + g:].view(blocks, capacity, 2)
            table[rows.cpu(), pos, 0] = starts.cpu().to(torch.int32)
            table[rows.cpu(), pos, 1] = ends.cpu().to(torch.int32)
            h[:, 2] = counts.to(torch.int32)
    else:
        status |= _FITS
    h[:, 0] = status
    h[:, 1] = contrib.digest
    h[:, 3:3 + g] = _bitmap(contrib.has_grad)
    return h


def _device_zeros(contrib: Contribution) -> Tensor:
    """How many of the values are 0, as a 0-d tensor on their device (``contrib.zeros`` where given)."""
    if isinstance(contrib.zeros, Tensor):
        return contrib.zeros
    return contrib.numel - torch.count_nonzero(contrib.values[:contrib.numel])


def _absent_values(contrib: Contribution) -> int:
    """How many of the sender's values belong to parameters it has no gradient for (its zeros by design)."""
    return sum(n for n, has in zip(contrib.sizes or [], contrib.has_grad.tolist()) if not has)


def _zeros_within_parameters(contrib: Contribution) -> int:
    """The sender's zeros besides the parameters it has no gradient for (c = 0, a sign hook's
    zeros); every coordinate where the parameter sizes are unknown or a hook voted where the
    rank has no gradient."""
    if contrib.sizes is None:
        return contrib.numel
    zeros = contrib.numel - int(torch.count_nonzero(contrib.values[:contrib.numel]))
    extra = zeros - _absent_values(contrib)
    return extra if extra >= 0 else contrib.numel


def _voters(contrib: Contribution, hdrs: Tensor, info: dict) -> Optional[Tensor]:
    """How many ranks have a gradient for each parameter (k,) — from the has-gradient bitmaps,
    which every rank has after the first collective: each coordinate's number of voters, but
    for the few zeros of c (:class:`_ByVoters` lists them). None when some rank has many."""
    if contrib.sizes is None or info["scattered"]:
        return None
    k = contrib.has_grad.numel()
    return _unbitmap(hdrs[:, 3:3 + -(-k // _BITMAP_BITS)], k).sum(0, dtype=torch.int16)


def _blocks(headers: Tensor, payload: Tensor, blocks: int) -> Tensor:
    """Header and payload of each block side by side, each block padded to 4 bytes, flat uint8."""
    p = payload.view(blocks, -1)
    pad = (-p.shape[1]) % 4
    h = headers.view(torch.uint8).view(blocks, -1)
    h = _host_to(h, p.device) if h.device.type == "cpu" else h.to(p.device)
    parts = [h, p]
    if pad:
        parts.append(p.new_zeros(blocks, pad))
    return torch.cat(parts, dim=1).reshape(-1)


class Request(tuple):
    """A collective an algorithm asks for, ``(kind, send, label)``. ``head``: ``(blocks, header
    words)`` when its result is blocks of a header and a payload (:func:`_blocks`) whose headers the
    algorithm reads on the host; a driver may then read the headers of several such results with
    one host synchronisation (:func:`read_heads`) and send the algorithm a :class:`Received`."""

    head: Optional[tuple] = None


def _request(kind: str, send: Tensor, label: str, head: Optional[tuple] = None) -> Request:
    r = Request((kind, send, label))
    r.head = head
    return r


@dataclass
class Received:
    """A collective's result whose headers a driver has already read on the host (:func:`read_heads`)."""

    data: Tensor
    headers: Tensor  # (blocks, header words) int32, on the CPU


def read_heads(results: list) -> list:
    """``results``: (received tensor, ``Request.head``) pairs. Their headers on the host, read with one
    copy per device (a host synchronisation each) instead of one per result: :class:`Received` each."""
    out: list = [None] * len(results)
    by_device: dict = {}
    for i, (data, _) in enumerate(results):
        by_device.setdefault(data.device, []).append(i)
    for idx in by_device.values():
        parts = []
        for i in idx:
            data, (blocks, words) = results[i]
            parts.append(data.view(blocks, -1)[:, :4 * words].reshape(-1))
        host = torch.cat(parts).cpu()
        at = 0
        for i, part in zip(idx, parts):
            data, (blocks, words) = results[i]
            out[i] = Received(data, host[at:at + part.numel()].view(torch.int32).view(blocks, words))
            at += part.numel()
    return out


def _split(received, blocks: int, header_words: int) -> tuple[Tensor, Tensor]:
    """Inverse of :func:`_blocks`: (blocks, H) int32 headers (on the CPU) and (blocks, P) payload bytes.
    ``received``: the collective's result, or a :class:`Received` whose headers were read already."""
    hb = 4 * header_words
    if isinstance(received, Received):
        return received.headers, received.data.view(blocks, -1)[:, hb:]
    b = received.view(blocks, -1)
    headers = b[:, :hb].contiguous().view(torch.int32).cpu()
    return headers, b[:, hb:]


def _read_headers(headers: Tensor, k: int) -> dict:
    status = headers[:, 0].tolist()
    return dict(
        status=status,
        bad=[i for i, s in enumerate(status) if s & BAD],
        nonfinite=[i for i, s in enumerate(status) if s & NONFINITE],
        abstains=any(s & _ABSTAINS for s in status),
        scattered=any(s & _SCATTERED for s in status),
        fit=all(s & _FITS for s in status),
        overflow=any(s & _OVERFLOW for s in status),
        digests_agree=len(set(headers[:, 1].tolist())) == 1,
        has_grad=_unbitmap(headers[:, 3:3 + -(-k // _BITMAP_BITS)], k).any(0),
    )


def _capacity(chunk: int) -> int:
    """Run slots per block: about 2 % of the block's 1-bit payload (8 bytes a run), at least 4."""
    return max(4, chunk // 3200)


# -- algorithms ---------------------------------------------------------------------------

class Algorithm:
    """Base: ``name``, the rule, the world size; subclasses implement :meth:`run`
    and :meth:`wire` (the collectives and their per-rank input bytes, without abstentions)."""

    name = ""
    calls = 1

    def __init__(self, rule: VoteRule):
        self.rule = rule
        self.world = rule.world_size

    def run(self, state: WireState, contrib: Contribution, rank: int, key: int) -> Generator:
        raise NotImplementedError

    def wire(self, n: int, k: int) -> list[tuple[str, int]]:
        raise NotImplementedError

    def estimated_bytes(self, n: int, k: int = 1) -> float:
        """Bytes one rank sends per step for a padded bucket of n coordinates and k
        parameters when no rank abstains: the sum over :meth:`wire` of :func:`bytes_moved`."""
        return sum(bytes_moved(kind, b, self.world) for kind, b in self.wire(n, k))

    def _codes_codec(self, abstains: bool, fmt: str):
        """Codec of the codes on the way back: None means "1 bit + zero runs"."""
        rule = self.rule
        if rule.vote == "avg":
            return rule.result_codec(abstains)
        if not abstains:
            return rule.result_codec(False)  # ±1 as 1 bit, or base-3 when an even N can tie
        return _TRIT if fmt == "ternary" else None

    def count_votes(self, payloads: Tensor, fmt: str, senders: int, width: int, runs_hdr: Optional[Tensor],
               capacity: int, lo: int, numel: int, abstains: bool) -> tuple[Tensor, Tensor]:
        """(s, nz) over ``senders`` payloads of ``width`` coordinates (the coordinates lo … lo+width−1)."""
        if fmt == "ternary":
            vals = _TRIT.decode(payloads.reshape(-1), senders * width).view(senders, width)
            return row_sum(vals), row_sum(vals.abs())
        bits = _SIGN.decode_bits(payloads.reshape(-1), senders * width).view(senders, width)
        if not abstains:  # every sender voted everywhere: nz is None (= senders)
            return row_sum(bits).mul_(2).sub_(senders), None
        counts = runs_hdr[:, 0]
        slots = runs_hdr[:, 1:].view(senders, capacity, 2)
        sel = torch.arange(capacity).view(1, -1) < counts.view(-1, 1)
        rows = torch.arange(senders).view(-1, 1).expand(-1, capacity)[sel]
        off = slots[sel].long()  # (on the host: the received headers)
        total = int((off[:, 1] - off[:, 0]).sum())
        rows, off = _host_to(rows, bits.device), _host_to(off, bits.device)
        # An abstention (δ = 0) travels as bit 0, so it adds nothing to the +1 count: only nz changes.
        plus = row_sum(bits)
        if total * 16 <= senders * width:  # a few zeros (c = 0 by rounding, ≤ 1/16): indices, no full mask
            nz = torch.full_like(plus, senders)
            at = run_indices(off[:, 0], off[:, 1], total)
            nz.index_add_(0, at, torch.full(at.shape, -1, dtype=nz.dtype, device=nz.device))
        else:
            nz = row_sum(~runs_mask(rows, off[:, 0], off[:, 1], (senders, width)))
        if lo + width > numel:
            nz[max(0, numel - lo):] = 0  # padding abstains everywhere
        return plus.mul_(2).sub_(nz), nz

    # the way back: one chunk's codes as "1 bit + its zero runs", or in a plain codec
    def _down_block(self, codes: Tensor, numel: int, lo: int, codec, capacity: int) -> Tensor:
        if codec is not None:
            return codec.encode(codes)
        real = max(0, min(numel - lo, codes.numel()))
        if codes.device.type != "cpu":  # the same header made on the device, with no host read (device_runs)
            counts, table = device_runs(codes, 1, real, capacity)
            over = counts > capacity
            h = torch.cat([torch.where(over, -1, counts).to(torch.int32),
                           table.view(-1) * (~over).to(torch.int32)]).view(1, -1)
            return _blocks(h, _SIGN.encode(codes), 1)
        rows, starts, ends = zero_runs(codes, 1, real)
        h = torch.zeros(1, 1 + 2 * capacity, dtype=torch.int32)
        if rows.numel() > capacity:
            h[0, 0] = -1  # overflow: every rank sees it and the codes are re-sent in base 3
        elif rows.numel():
            h[0, 0] = rows.numel()
            h[0, 1:1 + 2 * rows.numel()] = torch.stack([starts, ends], 1).reshape(-1).cpu().to(torch.int32)
        return _blocks(h, _SIGN.encode(codes), 1)

    def _down_decode(self, gathered: Tensor, blocks: int, width: int, codec, capacity: int) -> Optional[Tensor]:
        """All chunks' codes, or None when some chunk's zero runs overflowed."""
        if codec is not None:
            return codec.decode(gathered, blocks * width)
        headers, payload = _split(gathered, blocks, 1 + 2 * capacity)
        counts = headers[:, 0]
        if bool((counts < 0).any()):
            return None
        codes = _SIGN.decode(payload[:, :width // 8].reshape(-1), blocks * width).view(blocks, width).clone()
        sel = torch.arange(capacity).view(1, -1) < counts.view(-1, 1)
        if bool(sel.any()):
            rows = torch.arange(blocks).view(-1, 1).expand(-1, capacity)[sel]
            off = headers[:, 1:].view(blocks, capacity, 2)[sel].long()  # (on the host: the received headers)
            total = int((off[:, 1] - off[:, 0]).sum())
            dev = codes.device
            rows, off = _host_to(rows, dev), _host_to(off, dev)
            starts, ends = off[:, 0], off[:, 1]
            if total * 16 <= codes.numel():  # (few zeros: indices, no full mask)
                codes.view(-1).index_fill_(0, run_indices(rows * width + starts, rows * width + ends, total), 0)
            else:
                codes.masked_fill_(runs_mask(rows, starts, ends, (blocks, width)), 0)
        return codes.view(-1)

    @staticmethod
    def _runs_fit(codes: Tensor, blocks: int, numel: int, capacity: int) -> bool:
        if codes.device.type != "cpu":  # counted on the device: one read of the answer
            return bool(_run_edges(codes, blocks, numel, lasts=False)[0].sum(1).max() <= capacity // 2)
        rows, _, _ = zero_runs(codes, blocks, numel)
        return rows.numel() == 0 or int(torch.bincount(rows, minlength=blocks).max()) <= capacity // 2


class OneBit(Algorithm):
    """``all_to_all`` of 1-bit signs (+ header), vote per chunk, ``all_gather`` of the codes."""

    name = "1bit"
    calls = 2

    def _vote_packed(self, rows: Tensor, width: int, real: int, key: int, lo: int, contrib: Contribution):
        """MaVo of this rank's chunk straight from the senders' packed sign bits (no abstention, codes
        back as 1 bit): the packed codes (exactly ``_SIGN.encode(rule.decide(s, None, …))``) and the
        tally over the ``real`` coordinates that are not padding (:mod:`dlion.bitvote`)."""
        if _torch_vote(rows):
            return self._vote_packed_torch(rows, width, real, key, lo, contrib)
        N = self.world
        real = max(0, min(real, width))
        native = kernels.majority(rows.numpy(), real)
        if native is not None:  # the same bit-sliced count in one native pass
            gt, eq, unanimous, tied = native
        else:
            planes = count_planes(rows.numpy())
            gt, eq = compare_count(planes, N // 2)  # count > N/2: +1; count == N/2 (even N): a tie
            unanimous = sum(popcount_prefix(compare_count(planes, t)[1], real) for t in (0, N))
            tied = popcount_prefix(eq, real) if N % 2 == 0 else 0  # (padding has count 0: never a tie)
        if N % 2 == 0:
            if tied and contrib.positions is None:  # every coordinate's tie code at once, kept where tied
                gt |= eq & self.rule.tie_bits(key, lo, width, contrib.previous)
            elif tied:  # gathered coordinates (a compacted bucket): look up the tied ones only
                where = np.flatnonzero(np.unpackbits(eq, count=width, bitorder="little"))
                plus = np.zeros(width, dtype=np.uint8)
                codes = self.rule.tie_codes(key, contrib.index(lo, width)[torch.from_numpy(where)], contrib.previous)
                plus[where] = codes.numpy() > 0
                gt |= np.packbits(plus, bitorder="little")
        return torch.from_numpy(gt), torch.tensor([real, unanimous, tied], dtype=torch.int64)

    def _vote_packed_torch(self, rows: Tensor, width: int, real: int, key: int, lo: int, contrib: Contribution,
                           codes: bool = False) -> tuple[Tensor, Tensor]:
        """:meth:`_vote_packed` in torch operations on ``rows``' device, with no host synchronisation:
        the same packed codes, and the tally as an int64 tensor there (read once per step with the
        others). ``codes=True`` (``ties="zero"`` at even N, whose codes go back in base 3): the int8
        codes instead, 0 where tied (exactly ``rule.decide(s, None, …)``)."""
        N, dev = self.world, rows.device
        real = max(0, min(real, width))
        planes = count_planes_torch(rows)
        gt, eq = compare_count_torch(planes, N // 2)  # count > N/2: +1; count == N/2 (even N): a tie
        # unanimous: count 0 or N; the rest is "some but not all" = (count > 0) ^ (count == N)
        some = planes[0]
        for x in planes[1:]:
            some = some | x
        unanimous = real - popcount_prefix_torch(some ^ equals_all_torch(planes, N), real)
        tied = popcount_prefix_torch(eq, real) if N % 2 == 0 else torch.zeros((), dtype=torch.int64, device=dev)
        tally = torch.stack([unanimous.new_full((), real), unanimous, tied])
        if codes:  # +1 where gt, 0 where tied, −1 elsewhere (gt and eq never overlap)
            out = unpack_bits_torch(gt, width, torch.int8).mul(2).sub_(1)
            if N % 2 == 0 and self.rule.ties == "zero":
                out.add_(unpack_bits_torch(eq, width, torch.int8))
            return out, tally
        if N % 2 == 0:  # every coordinate's tie code, kept where tied: no host sync to find the ties
            if contrib.positions is None:
                bits = self.rule.tie_bits_torch(key, lo, width, contrib.previous, dev)
            else:  # gathered coordinates (a compacted bucket): each one's code at its bucket coordinate
                at = contrib.index(lo, width).to(dev)
                bits = pack_bits_torch(self.rule.tie_codes_torch(key, at, contrib.previous) > 0)
            gt = gt | (eq & bits)
        return gt, tally

    def wire(self, n: int, k: int) -> list[tuple[str, int]]:
        N, c = self.world, n // self.world
        up = N * (4 * _header_words(k, _capacity(c)) + _pad4(c // 8))
        codec = self._codes_codec(False, "runs")
        return [("all_to_all", up), ("all_gather", codec.nbytes(c))]

    def run(self, state, contrib, rank, key):
        N, n, numel = self.world, contrib.values.numel(), contrib.numel
        c, k = n // N, contrib.has_grad.numel()
        cap, lo = _capacity(c), rank * c
        packed = contrib.packed
        deferred = contrib.finite is not None  # the flags stay on the device: so does the header's status
        if deferred:
            runs = scattered = None  # (looked for on the device: _device_headers)
        elif packed is not None and contrib.zeros == 0:
            runs = _NO_RUNS
        elif contrib.values.device.type != "cpu":
            runs = scattered = None  # found and listed on the device, no host read (_device_headers)
        elif packed is not None and contrib.zeros is not None:
            runs = zero_runs(contrib.values, N, numel)
        elif contrib.values.dtype == torch.int8 and kernels.available():
            # the 1-bit payload and whether there is any zero to describe, in one pass over the signs
            packed, zeros = kernels.pack_positive_counting(contrib.values, numel)
            runs = zero_runs(contrib.values, N, numel) if zeros else _NO_RUNS
        else:
            runs = zero_runs(contrib.values, N, numel)
        # many zeros besides whole parameters without gradient: the codes come back without _ByVoters
        if runs is not None:
            scattered = bool(runs[0].numel()) and _zeros_within_parameters(contrib) > cap // 2
        # way up: block r = this rank's header (with its zero runs in chunk r) + its signs of chunk r
        while True:
            fmt = state.up
            if runs is None:
                headers = _device_headers(contrib, N, cap, slots=fmt == "runs", scattered=True)
            else:
                headers = _headers(contrib, N, cap, runs, slots=fmt == "runs", scattered=scattered)
            codec = _SIGN if fmt == "runs" else _TRIT
            body = packed if fmt == "runs" and packed is not None else codec.encode(contrib.values)
            received = yield _request("all_to_all", _blocks(headers, body, N), "signs", (N, headers.shape[1]))
            hdrs, payloads = _split(received, N, headers.shape[1])
            info = _read_headers(hdrs, k)
            if fmt == "runs" and info["overflow"]:
                state.up = "ternary"  # someone's runs did not fit: every rank re-sends this bucket in base 3
                continue
            if fmt == "ternary" and info["fit"]:
                state.up = "runs"     # from the next step on
            break
        out = contrib.flags_known(_outcome(info))
        if out.failed:
            return out
        down_codec = self._codes_codec(info["abstains"], state.down)
        dense = fmt == "runs" and not info["abstains"] and self.rule.vote == "mavo"  # every rank voted everywhere
        if dense and isinstance(down_codec, SignCodec):
            # the codes come back as 1 bit: vote on the packed bits (natively on the CPU, torch ops elsewhere)
            block, out.tally = self._vote_packed(payloads[:, :c // 8], c, numel - lo, key, lo, contrib)
            gathered = yield ("all_gather", block, "codes")
            out.signs = gathered.reshape(-1)[:n // 8]  # decoded only if asked for (Outcome.codes)
            return out
        if dense and _torch_vote(payloads):  # ties="zero" at even N (codes back in base 3): the same count
            mine, out.tally = self._vote_packed_torch(payloads[:, :c // 8], c, numel - lo, key, lo, contrib,
                                                      codes=True)
        else:
            s, nz = self.count_votes(payloads[:, :codec.nbytes(c)], fmt, N, c, _runs_table(hdrs, k, fmt, info), cap, lo,
                                numel, info["abstains"])
            mine = self.rule.decide(s, nz, key=key, start=lo, index=contrib.index(lo, c),
                                     previous=contrib.previous)
            out.tally = vote_tally(s, nz, N, numel - lo)
        voters = _voters(contrib, hdrs, info) if info["abstains"] else None
        if voters is not None:  # abstentions (nearly) only on whole parameters: every rank knows the voters
            down = _ByVoters(self.rule, voters, contrib.sizes, n, N, cap)
            plain = self._codes_codec(True, "ternary")
            codes = None
            if down.block < plain.nbytes(c):  # (blocks as long as the longest chunk's can cost more)
                codes = down.decode((yield _request("all_gather", down.encode(mine, rank), "codes",
                                                    (N, down.head // 4))))
            if codes is None:  # or some chunk had more exceptions than fit: a plain format
                codes = plain.decode((yield ("all_gather", plain.encode(mine), "codes")), n)
            out.codes = codes
            return out
        # way back: every rank gathers every chunk's codes
        codec = down_codec
        block = self._down_block(mine, numel, lo, codec, cap)
        gathered = yield _request("all_gather", block, "codes", (N, 1 + 2 * cap) if codec is None else None)
        codes = self._down_decode(gathered, N, c, codec, cap)
        if codes is None:  # some chunk has more zero runs than fit: everyone re-sends its codes in base 3
            state.down = "ternary"
            gathered = yield ("all_gather", _TRIT.encode(mine), "codes")
            codes = _TRIT.decode(gathered, n)
        elif codec is _TRIT and info["abstains"] and self._runs_fit(codes, N, numel, cap):
            state.down = "runs"
        out.codes = codes
        return out


def _padded(x: Tensor, align: int, fill: int) -> Tensor:
    pad = (-x.numel()) % align
    return torch.cat([x, x.new_full((pad,), fill)]) if pad else x


class _ByVoters:
    """The codes' way back when every rank knows how many ranks have a gradient for each
    coordinate (v, from :func:`_voters`), in the fewest bits v allows. MaVo: 1 bit where v
    is odd (no tie can happen), a base-3 digit where v is even (a tie gives 0; with
    ``ties="random"`` 1 bit there too), nothing where v = 0. Avg: the number of +1 votes,
    (s + v)/2 ∈ [0, v], in ⌈log2(N+1)⌉ bits where v > 0. A code these cannot hold (a rank's
    c = 0 made fewer than v vote: a 0 at odd v, another parity) travels in the block's
    exception list (offset, code), room for ``capacity``; when a chunk has more, every rank
    sees it and the codes are gathered again in base 3 (Avg: ⌈log2(2N+1)⌉ bits). Every
    chunk's block is as long as the longest one's, which every rank computes from v.

    When every parameter has the same number of voters (the usual case: a few coordinates
    with c = 0 by rounding, or none), each chunk's coordinates with voters are a prefix (the
    rest is padding) and are read and written as slices, not through per-coordinate masks.

    Off the CPU nothing here makes the host wait for the device: the per-coordinate formats (made on the
    host from the headers' bitmaps) go to the device once, from pinned memory, as index tensors
    (:meth:`_on`); a block's exceptions are found with ``nonzero_static`` in the list's fixed room and its
    header is written on the device (:meth:`encode`); the received exceptions, read on the host with the
    headers, go to the device in one copy from pinned memory (:meth:`decode`). The bytes are the host's."""

    def __init__(self, rule: VoteRule, per_param: Tensor, sizes: list[int], n: int, blocks: int, capacity: int):
        self.rule, self.capacity = rule, capacity
        self.avg = rule.vote == "avg"
        self.width = width = n // blocks
        counts = {v for v, size in zip(per_param.tolist(), sizes) if size}  # (left-out parameters have size 0)
        self.uniform = counts.pop() if len(counts) == 1 else None
        if self.uniform is not None:
            numel = sum(sizes)
            self.prefix = [max(0, min(width, numel - j * width)) for j in range(blocks)]
            v = self.uniform
            self.kind = None if v == 0 else ("three" if (not self.avg and rule.ties == "zero" and v % 2 == 0)
                                             else "one")
            self.n1 = [m if self.kind == "one" else 0 for m in self.prefix]
            self.n3 = [m if self.kind == "three" else 0 for m in self.prefix]
        else:
            v = torch.zeros(n, dtype=torch.int16)
            v[:sum(sizes)] = torch.repeat_interleave(per_param, torch.tensor(sizes, dtype=torch.int64))
            self.v = v.view(blocks, -1)
            if not self.avg and rule.ties == "zero":
                odd = self.v % 2 == 1
                self.one, self.three = odd, (self.v > 0) & ~odd
            else:
                self.one, self.three = self.v > 0, torch.zeros_like(self.v, dtype=torch.bool)
            self.n1, self.n3 = self.one.sum(1).tolist(), self.three.sum(1).tolist()
        self.codec = FieldCodec(bits_for(rule.world_size + 1)) if self.avg else _SIGN
        self.bytes1 = [self.codec.nbytes(m + (-m) % 8) for m in self.n1]
        self.bytes3 = [_TRIT.nbytes(m + (-m) % 5) for m in self.n3]
        self.head = 4 * (1 + 2 * capacity)
        self.block = self.head + max(a + b for a, b in zip(self.bytes1, self.bytes3))
        self._device: Optional[tuple] = None  # (device, per-chunk tensors there): :meth:`_on`

    def _on(self, device: torch.device) -> list:
        """Per chunk j, on ``device`` (mixed voter counts only): (v, one mask, indices of the 1-bit
        coordinates, of the base-3 ones, v at the 1-bit ones) — made on the host, where the voters are
        known, and taken to the device together in one copy from pinned memory (no host wait)."""
        if self._device is not None and self._device[0] == device:
            return self._device[1]
        blocks, parts, shapes = self.v.shape[0], [], []
        for j in range(blocks):
            one, three = self.one[j], self.three[j]
            for x in (self.v[j].to(torch.int64), one.to(torch.int64), one.nonzero().view(-1),
                      three.nonzero().view(-1), self.v[j][one].to(torch.int64)):
                parts.append(x)
                shapes.append(x.numel())
        flat = _host_to(torch.cat(parts), device)
        out, at = [], 0
        for j in range(blocks):
            got = []
            for i in range(5):
                size = shapes[5 * j + i]
                got.append(flat[at:at + size])
                at += size
            v, one, idx1, idx3, v1 = got
            out.append((v.to(self.v.dtype), one.bool(), idx1, idx3, v1.to(self.v.dtype)))
        self._device = (device, out)
        return out

    def _misfits(self, codes: Tensor, j: int) -> Tensor:
        """Where chunk j's codes do not fit their coordinate's format."""
        if self.uniform is not None:
            m, v = self.prefix[j], self.uniform
            head, tail = codes[:m], codes[m:] != 0
            if v == 0:
                head = head != 0
            elif self.avg:
                c = head.to(torch.int32)
                head = ((c + v) % 2 != 0) | (c.abs() > v)
            elif self.kind == "one":
                head = head == 0
            else:  # base 3 holds every MaVo code
                head = torch.zeros_like(head, dtype=torch.bool)
            return torch.cat([head, tail])
        if codes.device.type != "cpu":
            v, one = self._on(codes.device)[j][:2]
        else:
            v, one = self.v[j], self.one[j]
        if self.avg:
            c = codes.to(torch.int32)
            return (v == 0) & (c != 0) | (v > 0) & (((c + v) % 2 != 0) | (c.abs() > v))
        return (v == 0) & (codes != 0) | one & (codes == 0)

    def _parts(self, codes: Tensor, j: int) -> tuple[Tensor, Tensor, object]:
        """Chunk j's codes where 1 bit (or a count) goes, where a base-3 digit goes, and v there."""
        if self.uniform is not None:
            m = self.prefix[j]
            return codes[:m] if self.n1[j] else codes[:0], codes[:m] if self.n3[j] else codes[:0], self.uniform
        if codes.device.type != "cpu":  # (index tensors there: no boolean-mask indexing, no copy from the host)
            _, _, idx1, idx3, v1 = self._on(codes.device)[j]
            return codes[idx1], codes[idx3], v1
        one, three = self.one[j], self.three[j]
        return codes[one], codes[three], self.v[j][self.one[j]]

    def encode(self, codes: Tensor, j: int) -> Tensor:
        bad = self._misfits(codes, j)
        if codes.device.type != "cpu":
            h, codes = self._device_exceptions(codes, bad)
        else:
            h = torch.zeros(1 + 2 * self.capacity, dtype=torch.int32)
            where = bad.nonzero().view(-1)
            if where.numel() > self.capacity:
                h[0] = -1  # every rank sees it: the codes are gathered again in a plain format
            elif where.numel():
                h[0] = where.numel()
                pairs = torch.stack([where, codes[where].to(torch.int64)], 1).reshape(-1)
                h[1:1 + pairs.numel()] = pairs.cpu().to(torch.int32)
                codes = codes.index_fill(0, where, 0)
        one, three, v1 = self._parts(codes, j)
        if self.avg:
            one = (one.to(torch.int32) + v1) // 2
        else:
            one = torch.where(one == 0, torch.ones_like(one), one)
        parts = [h.view(torch.uint8).to(codes.device),
                 self.codec.encode(_padded(one, 8, 1 if not self.avg else 0)),
                 _TRIT.encode(_padded(three.to(torch.int8), 5, 0))]
        out = torch.cat(parts)
        return torch.cat([out, out.new_zeros(self.block - out.numel())])

    def _device_exceptions(self, codes: Tensor, bad: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`encode`'s exception list made on ``codes``' device with no host synchronisation: the
        header (count, then (offset, code) pairs, zeros in the other slots; −1 and no pair where more than
        ``capacity`` misfit) and the codes with the listed ones set to 0 — the host path's bytes. The
        misfits are found with ``nonzero_static`` in the list's fixed room (capacity), so the host need not
        know how many there are."""
        count = bad.sum()  # (int64, on the device)
        fits = count <= self.capacity
        where = torch.nonzero_static(bad, size=self.capacity, fill_value=-1).view(-1)
        listed = (where >= 0) & fits
        at = where.clamp(min=0)
        pairs = torch.stack([at, codes[at].to(torch.int64)], 1) * listed.view(-1, 1)
        h = torch.cat([torch.where(fits, count, -1).view(1), pairs.reshape(-1)]).to(torch.int32)
        return h, codes.masked_fill(bad & fits, 0)

    def decode(self, gathered: Tensor) -> Optional[Tensor]:
        """Every chunk's codes, or None when some chunk's exceptions did not fit."""
        blocks = len(self.n1)
        if isinstance(gathered, Received):  # (its headers read already, with other buckets')
            heads, g = gathered.headers, gathered.data.view(blocks, self.block)
        else:
            g = gathered.view(blocks, self.block)
            # (a fresh copy: with one block of a length not a multiple of 4, contiguous() keeps the row
            # stride, which view(int32) refuses)
            heads = g[:, :self.head].contiguous().view(-1).clone().view(torch.int32).view(blocks, -1).cpu()
        if bool((heads[:, 0] < 0).any()):
            return None
        codes = torch.zeros(blocks, self.width, dtype=torch.int16 if self.avg else torch.int8,
                            device=g.device)  # (a Received has no device: its data has)
        for j, (n1, n3, b1, b3) in enumerate(zip(self.n1, self.n3, self.bytes1, self.bytes3)):
            body = g[j, self.head:]
            a = self.codec.decode(body[:b1], n1)
            if self.uniform is not None:
                m = self.prefix[j]
                if n1:
                    codes[j, :m] = a * 2 - self.uniform if self.avg else a
                if n3:
                    codes[j, :m] = _TRIT.decode(body[b1:b1 + b3], n3)
            elif codes.device.type != "cpu":  # (index tensors there, :meth:`_on`)
                _, _, idx1, idx3, v1 = self._on(codes.device)[j]
                if self.avg:
                    a = a * 2 - v1
                codes[j][idx1] = a.to(codes.dtype)
                if n3:
                    codes[j][idx3] = _TRIT.decode(body[b1:b1 + b3], n3).to(codes.dtype)
            else:
                one, three = self.one[j], self.three[j]
                if self.avg:
                    a = a * 2 - self.v[j][self.one[j]]
                codes[j][one] = a.to(codes.dtype)
                if n3:
                    codes[j][three] = _TRIT.decode(body[b1:b1 + b3], n3).to(codes.dtype)
            if codes.device.type != "cpu":
                continue  # (the exceptions of every chunk at once, below)
            count = int(heads[j, 0])
            if count:
                pairs = heads[j, 1:1 + 2 * count].view(count, 2).to(torch.int64)
                codes[j][pairs[:, 0]] = pairs[:, 1].to(codes.dtype)
        if codes.device.type != "cpu":
            # every chunk's exceptions (read on the host with the headers) to the device in one copy
            # from pinned memory: (flat offset, code) pairs; chunks are disjoint, so the order is free
            lists = [heads[j, 1:1 + 2 * int(heads[j, 0])].view(-1, 2).to(torch.int64)
                     + torch.tensor([j * self.width, 0]) for j in range(blocks) if int(heads[j, 0])]
            if lists:
                pairs = _host_to(torch.cat(lists), codes.device)
                codes.view(-1)[pairs[:, 0]] = pairs[:, 1].to(codes.dtype)
        return codes.view(-1)


def _outcome(info: dict) -> Outcome:
    return Outcome(None, info["has_grad"], len(info["bad"]), len(info["nonfinite"]), info["digests_agree"],
                   info["bad"], info["nonfinite"])


def _runs_table(hdrs: Tensor, k: int, fmt: str, info: dict) -> Optional[Tensor]:
    """(senders, 1 + 2·capacity): each sender's run count and run slots, when they matter."""
    if fmt != "runs" or not info["abstains"]:
        return None
    g = -(-k // _BITMAP_BITS)
    return torch.cat([hdrs[:, 2:3], hdrs[:, 3 + g:]], dim=1)


class AllGather(Algorithm):
    """The naive reference: ``all_gather`` every rank's signs (+ header), count everything locally."""

    name = "allgather"

    def wire(self, n: int, k: int) -> list[tuple[str, int]]:
        return [("all_gather", 4 * _header_words(k, _capacity(n)) + _pad4(n // 8))]

    def run(self, state, contrib, rank, key):
        N, n, numel = self.world, contrib.values.numel(), contrib.numel
        k, cap = contrib.has_grad.numel(), _capacity(n)
        # (the zero count made with the signs, where known, spares the search for zeros when there are none)
        # (flags on the device, or values off the CPU: the header's runs are found and listed there)
        if contrib.finite is None and contrib.zeros == 0:
            runs = _NO_RUNS
        elif contrib.finite is not None or contrib.values.device.type != "cpu":
            runs = None
        else:
            runs = zero_runs(contrib.values, 1, numel)
        while True:
            fmt = state.up
            if runs is None:
                headers = _device_headers(contrib, 1, cap, slots=fmt == "runs", scattered=False)
            else:
                headers = _headers(contrib, 1, cap, runs, slots=fmt == "runs")
            codec = _SIGN if fmt == "runs" else _TRIT
            received = yield _request("all_gather", _blocks(headers, codec.encode(contrib.values), 1), "signs",
                                      (N, headers.shape[1]))
            hdrs, payloads = _split(received, N, headers.shape[1])
            info = _read_headers(hdrs, k)
            if fmt == "runs" and info["overflow"]:
                state.up = "ternary"
                continue
            if fmt == "ternary" and info["fit"]:
                state.up = "runs"
            break
        out = contrib.flags_known(_outcome(info))
        if out.failed:
            return out
        s, nz = self.count_votes(payloads[:, :codec.nbytes(n)], fmt, N, n, _runs_table(hdrs, k, fmt, info), cap, 0,
                            numel, info["abstains"])
        out.codes = self.rule.decide(s, nz, key=key, start=0, index=contrib.index(0, n),
                                     previous=contrib.previous)
        out.tally = vote_tally(s, nz, N, numel)
        return out


def _header_fields(contrib: Contribution, abstains: bool) -> Tensor:
    """The header as 0/1 counters appended to a SUM all-reduce: status bits, abstention,
    has-gradient per parameter and the 31 digest bits (whose sums must be 0 or N)."""
    digest_bits = (torch.tensor(contrib.digest, dtype=torch.int64) >> torch.arange(31)) & 1
    head = torch.tensor([contrib.status & BAD and 1, contrib.status & NONFINITE and 1, int(abstains)],
                        dtype=torch.int64)
    fields = torch.cat([head, contrib.has_grad.to(torch.int64).cpu(), digest_bits])
    pad = (-fields.numel()) % 8
    return torch.cat([fields, fields.new_zeros(pad)])


def _fields(contrib: Contribution, abstains, like: Tensor) -> Tensor:
    """:func:`_header_fields` on ``like``'s device (its dtype). With the flags on the device
    (:attr:`Contribution.finite`; ``abstains`` then a 0-d bool tensor there) the NONFINITE and abstention
    fields are set there, not read: the same counters, so the same bytes."""
    if contrib.finite is None:
        return _to_device(_header_fields(contrib, abstains), like)
    head = _to_device(_header_fields(contrib, False), like)  # (status lacks NONFINITE: set here)
    head[1] = (~contrib.finite).to(head.dtype)
    head[2] = abstains.to(head.dtype) if isinstance(abstains, Tensor) else int(abstains)
    return head


def _to_device(host: Tensor, like: Tensor) -> Tensor:
    """A small host tensor in ``like``'s dtype on its device; off the CPU from pinned memory, asynchronously
    (a copy from pageable memory waits for the device)."""
    return _host_to(host.to(like.dtype), like.device)


def _counter_wire(n: int, k: int, width: int) -> list[tuple[str, int]]:
    """One SUM all-reduce of n counters plus the header's fields (3 + k + 31, padded to 8),
    ``width`` bits each (16-bit fields travel as int32)."""
    fields = n + 3 + k + 31
    fields += (-fields) % 8
    return [("all_reduce", fields * (32 if width == 16 else width) // 8)]


def _read_fields(total: Tensor, k: int, world: int) -> dict:
    t = total.to(torch.int64).cpu()
    digest = t[3 + k:3 + k + 31]
    return dict(bad=int(t[0]), nonfinite=int(t[1]), abstains=int(t[2]) > 0, has_grad=t[3:3 + k] > 0,
                digests_agree=bool(((digest == 0) | (digest == world)).all()))


class PBit(Algorithm):
    """Lion Cub's p-bit all-reduce: one SUM ``all_reduce`` of per-coordinate counters.

    Without abstentions ("narrow") each rank contributes [δ > 0]; the sum P ∈ [0, N]
    gives s = 2P − N. With abstentions ("wide") it contributes [δ > 0] + (N+1)·[δ < 0],
    whose sum P + (N+1)·M ≤ N(N+1) gives both counts. Fields are 2, 4, 8 or 16 bits
    (16-bit fields travel as int32), the narrowest that cannot overflow.
    """

    name = "pbit"

    def _width(self, wide: bool) -> int:
        return field_width(self.world * (self.world + 1) if wide else self.world)

    def wire(self, n: int, k: int) -> list[tuple[str, int]]:
        return _counter_wire(n, k, self._width(False))

    def run(self, state, contrib, rank, key):
        N, n, numel = self.world, contrib.values.numel(), contrib.numel
        k = contrib.has_grad.numel()
        d = contrib.values
        if contrib.finite is not None:  # (left on the device: _fields)
            abstains = _device_zeros(contrib) > 0
        else:
            abstains = contrib.zeros > 0 if contrib.zeros is not None else bool((d[:numel] == 0).any())
        wide = state.up == "wide"
        while True:
            if wide:
                v = (d > 0).to(torch.int32) + (N + 1) * (d < 0).to(torch.int32)
            else:
                v = (d > 0).to(torch.int32)
            width = self._width(wide)
            head = _fields(contrib, abstains, v)
            words = pack_fields(torch.cat([v, head]), width)
            total = yield ("all_reduce", words, "counters")
            total = unpack_fields(total, width, n + head.numel())
            info = _read_fields(total[n:], k, N)
            if not wide and info["abstains"]:
                wide = True
                state.up = "wide"
                continue
            if wide and not info["abstains"]:
                state.up = "narrow"
            break
        out = contrib.flags_known(Outcome(None, info["has_grad"], info["bad"], info["nonfinite"],
                                          info["digests_agree"]))
        if out.failed:
            return out
        t = total[:n].to(torch.int32)
        if wide:
            plus, minus = t % (N + 1), t // (N + 1)
            s, nz = (plus - minus).to(torch.int16), (plus + minus).to(torch.int16)
        else:
            s, nz = t.to(torch.int16).mul_(2).sub_(N), None  # every rank voted everywhere
        out.codes = self.rule.decide(s, nz, key=key, start=0, index=contrib.index(0, n),
                                     previous=contrib.previous)
        out.tally = vote_tally(s, nz, N, numel)
        return out


class Quantized(Algorithm):
    """Lion Cub's quantised aggregation: Σ_i q_i (q ∈ [−s, s]) by one packed-field SUM
    ``all_reduce`` of q + s; codes = sign(Σ q). 2·w·(N−1)/N bits per coordinate, w the
    narrowest field holding 2·s·N."""

    name = "quantized"

    def __init__(self, rule: VoteRule, levels: int):
        super().__init__(rule)
        self.levels = levels

    def wire(self, n: int, k: int) -> list[tuple[str, int]]:
        return _counter_wire(n, k, field_width(2 * self.levels * self.world))

    def run(self, state, contrib, rank, key):
        N, n, s = self.world, contrib.values.numel(), self.levels
        k = contrib.has_grad.numel()
        width = field_width(2 * s * N)
        v = contrib.values.to(torch.int32) + s
        head = _fields(contrib, False, v)
        total = yield ("all_reduce", pack_fields(torch.cat([v, head]), width), "quantized")
        total = unpack_fields(total, width, n + head.numel())
        info = _read_fields(total[n:], k, N)
        out = contrib.flags_known(Outcome(None, info["has_grad"], info["bad"], info["nonfinite"],
                                          info["digests_agree"]))
        if not out.failed:
            out.codes = torch.sign(total[:n].to(torch.int32) - s * N).to(torch.int8)
        return out


def run_compacted(alg: Algorithm, state: WireState, contrib: Contribution, rank: int, key: int,
                  skipped: Tensor, kept: list[tuple[int, int]]) -> Generator:
    """``alg.run`` on the coordinates ``kept`` (ranges of the bucket) only, leaving out the
    parameters ``skipped`` (bool per parameter) that every rank expects no rank to have a
    gradient for — those with none on any rank in the previous step.

    A left-out parameter costs its bit in the header's has-gradient bitmap and nothing
    else. If some rank has a gradient for one after all, every rank sees it in that
    bitmap after the first collective, and the whole bucket is exchanged again (one more
    exchange of this bucket in this step). Either way the codes are those ``alg.run``
    gives on the whole bucket, bitwise: a coordinate no rank votes on gets 0, and the tie
    coins are drawn at the original coordinates."""
    if not bool(skipped.any()):
        return (yield from alg.run(state, contrib, rank, key))
    values, dev = contrib.values, contrib.values.device
    m = sum(hi - lo for lo, hi in kept)
    n = padded_length(m, alg.world)
    sub = values.new_zeros(n)
    positions = torch.arange(values.numel(), values.numel() + n, dtype=torch.int64, device=dev)  # padding: unused
    at = 0
    for lo, hi in kept:
        sub[at:at + hi - lo] = values[lo:hi]
        positions[at:at + hi - lo] = torch.arange(lo, hi, dtype=torch.int64, device=dev)
        at += hi - lo
    sizes = None
    if contrib.sizes is not None:
        sizes = [0 if left_out else size for size, left_out in zip(contrib.sizes, skipped.tolist())]
    # (flags on the device: the zero count of what is sent, counted there)
    zeros = m - torch.count_nonzero(sub[:m]) if contrib.finite is not None else None
    out = yield from alg.run(state, Contribution(sub, m, contrib.has_grad, contrib.status, contrib.digest,
                                                 positions, sizes, contrib.on_flags, contrib.previous,
                                                 zeros=zeros, finite=contrib.finite), rank, key)
    if bool((out.has_grad & skipped).any()):  # a rank has a gradient for a left-out parameter
        return (yield from alg.run(state, contrib, rank, key))
    if out.codes is not None:
        codes = out.codes.new_zeros(values.numel())
        at = 0
        for lo, hi in kept:
            codes[lo:hi] = out.codes[at:at + hi - lo]
            at += hi - lo
        out.codes = codes
    return out


def _pad4(nbytes: int) -> int:
    return nbytes + (-nbytes) % 4


ALGORITHMS = {"1bit": OneBit, "allgather": AllGather, "pbit": PBit}

#: A collective's fixed cost expressed in bytes (≈ 50 µs of latency at 10 Gbit/s):
#: what lets "auto" prefer one collective over two for small buckets.
LATENCY_BYTES = 64 * 1024


def make_algorithm(name: str, rule: VoteRule, levels: int = 0) -> Algorithm:
    if name == "quantized":
        return Quantized(rule, levels)
    return ALGORITHMS[name](rule)


def choose_algorithm(n: int, k: int, rule: VoteRule) -> str:
    """``comm="auto"``: the sign algorithm with the fewest bytes + LATENCY_BYTES per collective
    for a padded bucket of n coordinates and k parameters (deterministic: identical on all ranks)."""
    algs = {name: cls(rule) for name, cls in ALGORITHMS.items()}
    return min(algs, key=lambda a: (algs[a].estimated_bytes(n, k) + algs[a].calls * LATENCY_BYTES, algs[a].calls))
