"""Keeping replicas identical: the initial broadcast, checksums of every parameter's bits and
the error when they differ, and the fp32 averaging of momenta (Lion Cub's momentum sync).

Every distributed optimizer of dlion keeps its parameters bitwise identical on every rank;
these are the pieces they use to start that way and to check it.

Bytes moved: :func:`broadcast_parameters` sends every parameter once along each group (a
tree or ring broadcast inside the backend); a replica check gathers 16 bytes per parameter
per rank (:func:`checksum_table`); :func:`average_momenta` all-reduces 32 bits per
momentum value.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DesyncError", "bits_checksum", "checksum_table", "raise_if_diverged", "average_momenta",
           "broadcast_parameters"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DesyncError(RuntimeError):
    """Parameters differ between ranks (they must be bitwise identical)."""


@torch.no_grad()
def broadcast_parameters(params: list[Tensor], groups: list) -> None:
    """Start every rank from the first rank's parameters: one flat broadcast per (device, dtype)
    along each group in turn, from the group's rank 0 (``None``: the world; groups of one rank
    are passed over)."""
    by_kind: dict = {}
    for p in params:
        by_kind.setdefault((p.device, p.dtype), []).append(p)
    for ps in by_kind.values():
        flat = torch.cat([p.detach().reshape(-1) for p in ps])
        for g in groups:
            if dist.get_world_size(g) > 1:
                src = dist.get_global_rank(g, 0) if g is not None else 0
                dist.broadcast(flat, src=src, group=g)
        off = 0
        for p in ps:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()


@torch.no_grad()
def average_momenta(buffers: list, transport, count: int) -> None:
    """Every rank's flat momenta (``buffers[k].momentum``) become their fp32 mean over the
    transport's group of ``count`` ranks: one all-reduce per bucket, all in flight at once."""
    works = []
    for buf in buffers:
        flat = buf.momentum.float()
        works.append((transport.issue("all_reduce", flat, "momentum_sync"), buf))
    for (work, flat), buf in works:
        work.wait()
        flat.div_(count)
        if flat.data_ptr() != buf.momentum.data_ptr():
            buf.momentum.copy_(flat)


def bits_checksum(p: Tensor) -> Tensor:
    """Two int64 sums of a tensor's raw bits (plain and position-weighted); wrap-around is fine."""
    bits = p.detach().reshape(-1).view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return torch.stack([bits.sum(), (bits * pos).sum()]).cpu()


def _fingerprint(structure: str, count: int) -> Tensor:
    """A structure string and a parameter count as one checksum row (two int64)."""
    return torch.tensor([zlib.crc32(structure.encode()), count], dtype=torch.int64)


def checksum_table(params: list[Tensor], structure: Optional[str] = None) -> Tensor:
    """This rank's row for a replica check: two 64-bit checksums per parameter, as int32 words,
    on the parameters' device (NCCL only gathers device tensors); with ``structure`` (a string
    naming the model's structure) one more pair, its fingerprint."""
    rows = [bits_checksum(p) for p in params] + ([_fingerprint(structure, len(params))] if structure is not None
                                                  else [])
    return torch.stack(rows).view(torch.int32).reshape(-1).to(params[0].device)


def raise_if_diverged(gathered: Tensor, params: list[Tensor], world: int, who: str, step: int,
                      structure: Optional[str] = None) -> None:
    """Raise :class:`DesyncError` naming the first parameter whose checksums differ between
    rank 0 and another rank, given every rank's :func:`checksum_table` row gathered (with the
    same ``structure`` argument: first the structure fingerprints are compared)."""
    table = gathered.cpu().view(world, len(params) + (structure is not None), 4)
    if structure is not None:
        for r in range(1, world):
            if not torch.equal(table[r, -1], table[0, -1]):
                raise DesyncError(f"{who}: the model's structure (parameter names where given, shapes and dtypes, "
                                  f"in order) differs between rank 0 and rank {r} at step {step}.")
    for i, p in enumerate(params):
        for r in range(1, world):
            if not torch.equal(table[r, i], table[0, i]):
                raise DesyncError(f"{who}: parameter {i} (shape {tuple(p.shape)}) differs between rank 0 and "
                                  f"rank {r} after step {step}; replicas have diverged.")
