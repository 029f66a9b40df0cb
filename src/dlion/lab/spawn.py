"""Run a function on N local worker processes joined in a Gloo process group.

A thin wrapper over ``torch.multiprocessing.spawn`` (the engine) used by the
demo, the benchmarks and the tests; real jobs use ``torchrun``.
"""

from __future__ import annotations

import io
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _entry(rank: int, fn: Callable, world_size: int, store_path: str, timeout_s: float, args: tuple, results) -> None:
    # One thread per worker: N workers share the machine's cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        out = fn(rank, world_size, *args)
        # As plain bytes: torch's own queue pickling shares tensor memory with a
        # process that is about to exit.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, buf.getvalue()))
        # Leave together: a rank that returned at once would close its sockets while a peer is
        # still connecting a group it made (Gloo: "connectFullMesh ... Connection closed by peer").
        if dist.is_initialized():
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
          start_method: str = "fork" if hasattr(os, "fork") else "spawn") -> list:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes with an
    initialised Gloo group and return their results in rank order. Raises if
    any worker fails. ``fork`` (the default where available) skips re-importing
    torch in every worker, which dominates start-up on a small machine; the
    parent must not have used torch's thread pools in ways that break fork
    (CPU-only test and demo processes are fine)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # torch.optim imports torch._dynamo lazily (seconds); import it once here so
    # forked workers inherit it instead of each paying for it.
    import torch._dynamo  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="dlion-spawn-") as tmp:
        store_path = os.path.join(tmp, "store")
        ctx = mp.get_context(start_method)
        results = ctx.SimpleQueue()
        procs = mp.start_processes(_entry, args=(fn, world_size, store_path, timeout_s, args, results),
                                   nprocs=world_size, join=False, start_method=start_method)
        out: dict = {}

        def drain():  # read while waiting: a full pipe would block a worker forever
            while not results.empty():
                rank, value = results.get()
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)

        while not procs.join(timeout=0.05):
            drain()
        drain()
        return [out.get(r) for r in range(world_size)]
