"""Transports: the three collectives D-Lion uses, on a real process group or simulated.

An aggregation algorithm (:mod:`dlion.wire`) never calls
``torch.distributed`` itself: it asks a transport for one of three collectives on
uint8/int32 buffers. Two transports implement them:

* :class:`GroupTransport` — one rank of a ``torch.distributed`` process group,
  every collective issued with ``async_op=True`` (the caller decides when to wait);
* :func:`simulate_collective` — all N ranks in one process (the transport
  replaced by concatenation and slicing), for :class:`dlion.SimulatedDistributedLion`.

Both count bytes with :func:`bytes_moved`, the one place where the cost of a
collective is written down: the data a bandwidth-optimal implementation moves
over one rank's links, each way,

* ``all_to_all`` of B bytes (N blocks of B/N):   B·(N−1)/N
* ``all_gather`` of B bytes per rank:            B·(N−1)          (ring)
* ``all_reduce`` of B bytes:                     2·B·(N−1)/N      (ring: reduce-scatter + all-gather)
* ``reduce_scatter`` of B bytes (N blocks):      B·(N−1)/N        (ring; the hierarchical optimizer's gradients)

Never SUM-all-reduce bit-packed bytes: the bits would carry into each other;
:func:`pack_fields` leaves every counter a field wide enough for its sum.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommStats", "GroupTransport", "simulate_collective", "bytes_moved", "field_width", "pack_fields",
           "unpack_fields", "COLLECTIVES"]

COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter")


def bytes_moved(kind: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends (and receives) for one collective whose per-rank input is ``nbytes``."""
    if kind in ("all_to_all", "reduce_scatter"):
        return nbytes * (world - 1) / world
    if kind == "all_gather":
        return nbytes * (world - 1)
    if kind == "all_reduce":
        return 2 * nbytes * (world - 1) / world
    raise ValueError(f"unknown collective {kind!r}")


_ADD_LOCK = threading.Lock()


@dataclass(eq=False, repr=False)
class CommStats:
    """Cumulative traffic of one rank: bytes sent and received through collectives,
    the number of collective calls and of optimizer steps, a split by purpose, the
    time spent blocked on collectives, and how the votes this rank decided went
    (``voted``, ``unanimous``, ``tied``: see :meth:`tallies`)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    steps: int = 0
    by_kind: dict = field(default_factory=dict)
    wait_s: float = 0.0     # seconds step() spent blocked on collectives (not what overlap hid)
    #: [voted, unanimous, tied] read so far (see :meth:`tallies`)
    _read: list = field(default_factory=lambda: [0, 0, 0])
    #: tallies of votes decided on a device, not read yet: device -> int64 [voted, unanimous, tied] there
    _pending: dict = field(default_factory=dict)

    def add(self, kind: str, sent: float, received: float) -> None:
        with _ADD_LOCK:  # the exchange thread of overlap=True issues collectives too
            self.bytes_sent += int(round(sent))
            self.bytes_received += int(round(received))
            self.collectives += 1
            k = self.by_kind.setdefault(kind, [0, 0])
            k[0] += int(round(sent))
            k[1] += int(round(received))

    def add_tallies(self, tallies: list) -> None:
        """Add vote tallies ([voted, unanimous, tied] tensors, see ``wire.vote_tally``). Those on the
        CPU are added at once; those on a device are summed there and read only when the statistics
        are (:meth:`tallies`), so that a step makes no host synchronisation for them."""
        if not tallies:
            return
        by_device: dict = {}
        for t in tallies:
            by_device.setdefault(t.device, []).append(t)
        with _ADD_LOCK:
            for dev, ts in by_device.items():
                total = torch.stack(ts).sum(0)
                if dev.type == "cpu":
                    for i, v in enumerate(total.tolist()):
                        self._read[i] += v
                elif dev in self._pending:
                    self._pending[dev].add_(total)
                else:
                    self._pending[dev] = total

    def tallies(self) -> tuple[int, int, int]:
        """(voted, unanimous, tied): the coordinates this rank decided the vote of (its 1/N share with
        ``1bit``), those where every rank voted the same sign (|s| = N), and those where the votes
        cancelled (s = 0, some rank voted). Reads the tallies still on a device (one host
        synchronisation per device, here and not in the step)."""
        with _ADD_LOCK:
            pending, self._pending = self._pending, {}
            for total in pending.values():
                for i, v in enumerate(total.tolist()):
                    self._read[i] += v
            return tuple(self._read)

    def _set_tally(self, i: int, value: int) -> None:
        self.tallies()
        self._read[i] = int(value)

    voted = property(lambda self: self.tallies()[0], lambda self, v: self._set_tally(0, v),
                     doc="coordinates this rank decided the vote of (its 1/N share with 1bit)")
    unanimous = property(lambda self: self.tallies()[1], lambda self, v: self._set_tally(1, v),
                         doc="… where every rank voted the same sign (|s| = N)")
    tied = property(lambda self: self.tallies()[2], lambda self, v: self._set_tally(2, v),
                    doc="… where the votes cancelled (s = 0, some rank voted)")

    def bits_per_param_per_step(self, num_params: int) -> float:
        """(bytes sent + received)·8 / (params · steps)."""
        if not self.steps or not num_params:
            return 0.0
        return 8.0 * (self.bytes_sent + self.bytes_received) / (num_params * self.steps)

    def state_dict(self) -> dict:
        voted, unanimous, tied = self.tallies()
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "collectives": self.collectives, "steps": self.steps,
                "by_kind": {k: list(v) for k, v in self.by_kind.items()}, "wait_s": self.wait_s,
                "voted": voted, "unanimous": unanimous, "tied": tied}

    def load_state_dict(self, d: dict) -> None:
        self.bytes_sent = int(d["bytes_sent"])
        self.bytes_received = int(d["bytes_received"])
        self.collectives = int(d["collectives"])
        self.steps = int(d["steps"])
        self.by_kind = {k: list(v) for k, v in d.get("by_kind", {}).items()}
        self.wait_s = float(d.get("wait_s", 0.0))
        with _ADD_LOCK:
            self._pending = {}
            self._read = [int(d.get(k, 0)) for k in ("voted", "unanimous", "tied")]

    def __eq__(self, other) -> bool:
        return isinstance(other, CommStats) and self.state_dict() == other.state_dict()

    def __repr__(self) -> str:
        return "CommStats(" + ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items()) + ")"


def _all_gather(out: Tensor, inp: Tensor, **kw):
    # torch 2.13 renames all_gather_into_tensor to all_gather_single; accept both (looked up per call).
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, **kw)


def _reduce_scatter(out: Tensor, inp: Tensor, **kw):
    # torch 2.13 renames reduce_scatter_tensor to reduce_scatter_single; accept both (looked up per call).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, **kw)


class GroupTransport:
    """One rank's end of a process group: asynchronous collectives on flat tensors.

    ``issue(kind, send)`` returns ``(work, out)``: ``out`` holds the result once
    ``work.wait()`` returned. Every call is counted in ``stats`` under ``label``.
    """

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats

    def issue(self, kind: str, send: Tensor, label: Optional[str] = None):
        nbytes = send.numel() * send.element_size()
        if kind == "all_to_all":
            out = torch.empty_like(send)
            work = dist.all_to_all_single(out, send, group=self.group, async_op=True)
        elif kind == "all_gather":
            out = torch.empty(send.numel() * self.world, dtype=send.dtype, device=send.device)
            work = _all_gather(out, send, group=self.group, async_op=True)
        elif kind == "all_reduce":
            out = send
            work = dist.all_reduce(out, group=self.group, async_op=True)
        elif kind == "reduce_scatter":  # SUM; this rank gets block `rank` of N equal blocks
            out = torch.empty(send.numel() // self.world, dtype=send.dtype, device=send.device)
            work = _reduce_scatter(out, send, group=self.group, async_op=True)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        moved = bytes_moved(kind, nbytes, self.world)
        self.stats.add(label or kind, moved, moved)
        return work, out


def simulate_collective(kind: str, sends: list[Tensor], stats: Optional[CommStats] = None,
                        label: Optional[str] = None) -> list[Tensor]:
    """What every rank receives when rank i contributes ``sends[i]`` (all ranks in one process)."""
    world = len(sends)
    if kind == "all_to_all":
        blocks = [s.view(world, -1) for s in sends]
        outs = [torch.cat([blocks[i][r] for i in range(world)]) for r in range(world)]
    elif kind == "all_gather":
        cat = torch.cat(sends)
        outs = [cat.clone() for _ in range(world)]
    elif kind == "all_reduce":
        total = sends[0].clone()
        for s in sends[1:]:
            total += s  # same dtype arithmetic as a SUM all-reduce (uint8 would wrap, which pack_fields prevents)
        outs = [total.clone() for _ in range(world)]
    else:
        raise ValueError(f"unknown collective {kind!r}")
    if stats is not None:
        moved = bytes_moved(kind, sends[0].numel() * sends[0].element_size(), world)
        stats.add(label or kind, moved, moved)
    return outs


# -- packed counters for SUM all-reduces ---------------------------------------------

def field_width(max_sum: int) -> int:
    """Narrowest field in {2, 4, 8, 16} bits that holds 0 … max_sum."""
    for w in (2, 4, 8, 16):
        if max_sum < 2**w:
            return w
    raise ValueError(f"counters up to {max_sum} do not fit a 16-bit field")


def pack_fields(values: Tensor, width: int) -> Tensor:
    """Non-negative integers < 2^width (length a multiple of 8/width) → words:
    8/width fields per uint8 byte (width ≤ 8), or one field per int32 word (width 16)."""
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
    """Inverse of :func:`pack_fields` (as int16 for width ≤ 8): one table gather per byte."""
    if width == 16:
        return words[:n]
    key = (width, words.device)
    lut = _FIELD_LUTS.get(key)
    if lut is None:
        k, mask = 8 // width, (1 << width) - 1
        lut = (torch.arange(256).view(-1, 1) >> (width * torch.arange(k))) & mask
        lut = _FIELD_LUTS[key] = lut.to(torch.int16).to(words.device)
    return torch.index_select(lut, 0, words.to(torch.int32)).view(-1)[:n]
