"""Run a function on N local worker processes joined in a Gloo process group.

A thin wrapper over ``torch.multiprocessing.spawn`` (the engine) used by the
demo, the benchmarks and the tests; real jobs use ``torchrun``.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _entry(rank: int, fn: Callable, world_size: int, store_path: str, timeout_s: float, args: tuple, results) -> None:
    # One thread per worker: N workers share the machine's cores.
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        out = fn(rank, world_size, *args)
        if results is not None:
            results[rank] = out
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0, collect: bool = True) -> list:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes with an
    initialised Gloo group and return their results in rank order (``fn`` and
    its results must be picklable). Raises if any worker fails."""
    fd, store_path = tempfile.mkstemp(prefix="dlion-store-")
    os.close(fd)
    os.unlink(store_path)  # FileStore wants to create it
    manager = mp.Manager() if collect else None
    try:
        results = manager.dict() if manager else None
        mp.spawn(_entry, args=(fn, world_size, store_path, timeout_s, args, results), nprocs=world_size, join=True)
        return [results[r] for r in range(world_size)] if results is not None else []
    finally:
        if manager:
            manager.shutdown()
        if os.path.exists(store_path):
            os.unlink(store_path)
