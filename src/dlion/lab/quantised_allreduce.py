"""torchft's quantised all-reduce (``allreduce_quantized``), the mean of one tensor list over the ranks,
with the row-scaled fp8 or fp4 of :mod:`dlion.lab.float_wire` on the wire; DiLoCo's ``fp8`` / ``fp4`` wire.

The rows of all the tensors, in order, are cut into N contiguous groups of about equal size; rank r owns
group r. Every rank encodes its rows, an all-to-all sends group j to rank j, rank r decodes the N copies of
its group, adds them in fp32 in rank order and divides by N, encodes that mean, and a second all-to-all
gives every rank every group (an all-gather of unequal parts)::

    mean = Q( (Q(x_0) + Q(x_1) + … + Q(x_{N-1})) / N )      Q: encode then decode, row by row

Bytes one rank sends: the other ranks' groups of its rows, then its group to the N − 1 others: about
2(N−1)/N · (b/8 per value + 4 per row), b = 8 or 4 (fp4: two codes per byte, each group padded to a byte).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from dlion.collectives import CommStats

from . import float_wire as fw

__all__ = ["row_groups", "group_bytes", "quantised_mean"]


def row_groups(row_counts: list[int], row_sizes: list[int], world: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, its segments (tensor, first row, end row): the rows of the tensors (``row_counts[t]``
    rows of ``row_sizes[t]`` values each), in order, cut after the row where the running count of values
    first reaches (r + 1)/N of the total (a rank's group may be empty)."""
    total = sum(n * c for n, c in zip(row_counts, row_sizes))
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    seen, r = 0, 0
    for t, (n, c) in enumerate(zip(row_counts, row_sizes)):
        for i in range(n):
            g = groups[r]
            if g and g[-1][0] == t and g[-1][2] == i:
                g[-1] = (t, g[-1][1], i + 1)
            else:
                g.append((t, i, i + 1))
            seen += c
            while r < world - 1 and seen * world >= total * (r + 1):
                r += 1
    return groups


def _encode_group(segments: list[Tensor], fmt: str) -> Tensor:
    """One group's bytes from its segments (rows, columns): its codes (fp4 packed), then its scales (fp32)."""
    codes, scales = [], []
    for seg in segments:
        c, sc = fw.encode(seg, fmt)
        codes.append(c.reshape(-1))
        scales.append(sc)
    codes = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.uint8)
    if fmt == "fp4":
        codes = fw.pack4(codes)
    scales = torch.cat(scales) if scales else torch.zeros(0)
    return torch.cat([codes, scales.view(torch.uint8)])


def _decode_group(buf: Tensor, shapes: list[tuple[int, int]], fmt: str) -> list[Tensor]:
    """The segments of one group, (rows, columns) each, from :func:`_encode_group`'s bytes."""
    n_values, n_rows = sum(r * c for r, c in shapes), sum(r for r, _ in shapes)
    n_code_bytes = (n_values + 1) // 2 if fmt == "fp4" else n_values
    codes = buf[:n_code_bytes]
    codes = fw.unpack4(codes, n_values) if fmt == "fp4" else codes
    scales = buf[n_code_bytes:n_code_bytes + 4 * n_rows].clone().view(torch.float32)  # (aligned)
    out, v, k = [], 0, 0
    for r, c in shapes:
        out.append(fw.decode(codes[v:v + r * c].reshape(r, c), scales[k:k + r], fmt))
        v, k = v + r * c, k + r
    return out


def group_bytes(shapes: list[tuple[int, int]], fmt: str) -> int:
    """Bytes of one group of segments of (rows, columns) on the wire."""
    n_values, n_rows = sum(r * c for r, c in shapes), sum(r for r, _ in shapes)
    return ((n_values + 1) // 2 if fmt == "fp4" else n_values) + 4 * n_rows


def quantised_mean(tensors: list[Tensor], fmt: str, group=None, stats: Optional[CommStats] = None) -> list[Tensor]:
    """The mean of ``tensors`` over the ranks of ``group`` through the quantised all-reduce above, fp32,
    in each tensor's shape; the bytes counted in ``stats`` (kind ``all_to_all``)."""
    fw._check(fmt)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [fw.rows_of(t) for t in tensors]
    groups = row_groups([r.shape[0] for r in rows], [r.shape[1] for r in rows], world)
    shapes = [[(b - a, rows[t].shape[1]) for t, a, b in g] for g in groups]
    sizes = [group_bytes(s, fmt) for s in shapes]
    # 1. every rank's encoded rows of group j to rank j
    send = torch.cat([_encode_group([rows[t][a:b] for t, a, b in g], fmt) for g in groups])
    recv = torch.empty(world * sizes[rank], dtype=torch.uint8)
    dist.all_to_all_single(recv, send, [sizes[rank]] * world, sizes, group=group)
    # 2. this rank's group: the N decoded copies added in rank order, ÷ N, encoded again
    mine = None
    for i in range(world):
        parts = _decode_group(recv[i * sizes[rank]:(i + 1) * sizes[rank]], shapes[rank], fmt)
        mine = parts if mine is None else [m + p for m, p in zip(mine, parts)]
    mine_bytes = _encode_group([m / world for m in mine], fmt)
    # 3. every group to every rank
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.all_to_all_single(out, mine_bytes.repeat(world), sizes, [sizes[rank]] * world, group=group)
    if stats is not None:
        sent = sum(sizes) - sizes[rank] + (world - 1) * sizes[rank]
        stats.add("all_to_all", sent, sent)
    result = [torch.empty_like(r) for r in rows]
    offset = 0
    for g, s, n in zip(groups, shapes, sizes):
        for (t, a, b), v in zip(g, _decode_group(out[offset:offset + n], s, fmt)):
            result[t][a:b] = v
        offset += n
    return [r.reshape(t.shape) for r, t in zip(result, tensors)]
