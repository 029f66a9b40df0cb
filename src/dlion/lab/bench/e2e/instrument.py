"""Process-wide instrumentation of ``dlion bench e2e``: bytes handed to ``all_reduce`` by DDP's
comm hooks, and time spent inside D-Lion's phases, codec functions and collectives."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch.distributed as dist


class Instrument:
    """Process-wide wrappers, installed once per worker process; they record only while
    ``current`` names the method whose measured step is running (else they pass through).

    * DDP methods: every ``torch.distributed.all_reduce`` adds 2(N−1)/N × its tensor's
      bytes (a ring all-reduce) to ``bytes_sent[current]`` — this is how the comm hooks'
      traffic is counted, whatever the hook sends (bf16 copies, PowerSGD's P and Q...).
    * D-Lion methods: wall time inside DistributedLion's phases, the codec functions and
      the collectives is accumulated per function (inclusive, on whichever thread calls
      them) in ``times[current]``.
    """

    def __init__(self):
        self.current: Optional[str] = None
        self.count = False    # count all_reduce bytes for ``current``
        self.profile = False  # time dlion's functions for ``current``
        self.bytes_sent: dict[str, float] = {}
        self.all_reduce_calls: dict[str, int] = {}
        self.times: dict[str, dict[str, float]] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._undo: list[tuple[object, str, object]] = []

    def _timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*a, **k):
            cur = self.current
            if cur is None or not self.profile:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                with self._lock:
                    times, calls = self.times.setdefault(cur, {}), self.calls.setdefault(cur, {})
                    times[name] = times.get(name, 0.0) + dt
                    calls[name] = calls.get(name, 0) + 1
        wrapper.__wrapped__ = fn
        return wrapper

    def _patch(self, owner, attr: str, name: str) -> None:
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if orig is None:
            return
        self._undo.append((owner, attr, orig))
        setattr(owner, attr, self._timed(name, orig))

    def install(self) -> None:
        import dlion.aggregation as aggregation
        import dlion.codec as codec
        import dlion.collectives as collectives
        import dlion.distributed as distributed

        orig_all_reduce = dist.all_reduce

        def all_reduce(tensor, *a, **k):
            cur = self.current
            if cur is not None and self.count:
                group = k.get("group", a[1] if len(a) > 1 else None)
                n = dist.get_world_size(group)
                with self._lock:
                    self.bytes_sent[cur] = self.bytes_sent.get(cur, 0.0) + \
                        2 * (n - 1) / n * tensor.numel() * tensor.element_size()
                    self.all_reduce_calls[cur] = self.all_reduce_calls.get(cur, 0) + 1
            return orig_all_reduce(tensor, *a, **k)

        self._undo.append((dist, "all_reduce", orig_all_reduce))
        dist.all_reduce = all_reduce
        # Wire: the collectives dlion calls (synchronous: transfer time + waiting for the peers).
        self._patch(dist, "all_to_all_single", "wire: all_to_all_single")
        self._patch(collectives, "_all_gather", "wire: all_gather")
        self._patch(dist, "all_reduce", "wire: all_reduce")
        # DistributedLion's phases (1 local math, 2-3 flags + collective, 4 apply Δ and momenta).
        DL = distributed.DistributedLion
        self._patch(DL, "_local", "DistributedLion._local (presign, sign/quantize into bucket)")
        self._patch(DL, "_communicate", "DistributedLion._communicate (flags + collective)")
        self._patch(DL, "_finish", "DistributedLion._finish (apply Δ, momentum)")
        for algo in list(collectives.ALGORITHMS):
            collectives.ALGORITHMS[algo] = self._timed(f"collectives.{algo}", collectives.ALGORITHMS[algo])
        self._patch(distributed, "quantized_sum", "collectives.quantized_sum")
        # Local codec and optimizer arithmetic.
        for cls in (codec.SignCodec, codec.TritCodec, codec.FieldCodec, getattr(aggregation, "_PlusCountCodec", None)):
            for attr in ("encode", "decode", "decode_bits"):
                if cls is not None and attr in cls.__dict__:
                    self._patch(cls, attr, f"codec: {cls.__name__}.{attr}")
        self._patch(collectives, "reduce_counts", "codec: reduce_counts")
        self._patch(distributed, "zero_runs", "codec: zero_runs (abstention runs)")
        self._patch(collectives, "runs_mask", "codec: runs_mask")
        self._patch(collectives, "pack_fields", "codec: pack_fields")
        self._patch(collectives, "unpack_fields", "codec: unpack_fields")
        self._patch(aggregation.VoteRule, "decide", "codec: VoteRule.decide")
        self._patch(aggregation.VoteRule, "delta", "local: VoteRule.delta")
        self._patch(distributed, "quantize", "local: quantize")
        self._patch(distributed, "lion_presign", "local: lion_presign")
        self._patch(distributed, "apply_update", "local: apply_update")
        self._patch(distributed, "lion_momentum_update", "local: lion_momentum_update")

    def uninstall(self) -> None:
        import dlion.collectives as collectives

        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo = []
        for algo, fn in list(collectives.ALGORITHMS.items()):
            collectives.ALGORITHMS[algo] = getattr(fn, "__wrapped__", fn)
