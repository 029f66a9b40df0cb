"""Byte counting for ``dlion bench e2e``'s DDP methods: every tensor their comm hooks hand to
``torch.distributed.all_reduce``. D-Lion's own phases are read from the ``torch.profiler``
ranges the library records (``dlion.contribute``, ``dlion.exchange``, ``dlion.apply``), not by
patching it (see :meth:`dlion.lab.bench.e2e.methods.MethodRun.profile`)."""

from __future__ import annotations

import threading
from typing import Optional

import torch.distributed as dist


class Instrument:
    """A process-wide wrapper of ``torch.distributed.all_reduce``, installed once per worker;
    it records only while ``current`` names the DDP method whose measured step is running:
    2(N−1)/N × the tensor's bytes (a ring all-reduce) go to ``bytes_sent[current]`` — whatever
    the hook sends (fp32 buckets, bf16 copies, PowerSGD's P and Q, one element for sync-only)."""

    def __init__(self):
        self.current: Optional[str] = None
        self.count = False
        self.bytes_sent: dict[str, float] = {}
        self.all_reduce_calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._orig = None

    def install(self) -> None:
        orig = self._orig = dist.all_reduce

        def all_reduce(tensor, *a, **k):
            cur = self.current
            if cur is not None and self.count:
                group = k.get("group", a[1] if len(a) > 1 else None)
                n = dist.get_world_size(group)
                with self._lock:
                    self.bytes_sent[cur] = self.bytes_sent.get(cur, 0.0) + \
                        2 * (n - 1) / n * tensor.numel() * tensor.element_size()
                    self.all_reduce_calls[cur] = self.all_reduce_calls.get(cur, 0) + 1
            return orig(tensor, *a, **k)

        dist.all_reduce = all_reduce

    def uninstall(self) -> None:
        if self._orig is not None:
            dist.all_reduce = self._orig
            self._orig = None
