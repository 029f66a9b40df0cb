"""``dlion bench e2e``: end-to-end time per training step on an emulated slow network.

Every method trains the same workload — a character-level GPT (:class:`dlion.lab.models.CharGPT`)
on Shakespeare, each rank on its own random windows — for ``--warmup`` + ``--steps`` steps,
on ``--workers`` ranks, at each link rate of ``--link``:

baselines (DistributedDataParallel: bucketed fp32 all-reduce overlapped with backward)
  ``g-adamw``          DDP + torch.optim.AdamW
  ``g-lion``           DDP + dlion.Lion (the reference for speedups)
  ``g-lion-bf16``      DDP with ``bf16_compress_hook`` + Lion
  ``g-lion-powersgd``  DDP with PowerSGD (rank ``--powersgd-rank``, error feedback) + Lion
  ``compute``          DDP with a no-op hook (no communication) + Lion: the lower bound
ours (dlion.DistributedLion, no DDP)
  ``d-{mavo,avg}-{allgather,1bit,pbit}[-ov]`` and ``d-mavo-quant[-ov]``
  (``comm=`` algorithm; ``quant`` = ``aggregate="quantized"``; ``-ov`` = ``overlap=True``)

Groups for ``--methods``: ``all``, ``baselines``, ``dlion``, ``mavo``, ``avg``, ``overlap``.

A step is timed on every rank as the wall time from ``zero_grad`` through
``optimizer.step()`` (forward, backward and all communication), with no barrier
inside the timed region; the figure reported is the median over all ranks' steps
after the warm-up. All methods are built first and then take turns step by step
(the order rotating every round, an untimed barrier before each step), so that
they all see the same machine load; ``--sequential`` runs them one after another
instead (less memory). D-Lion's steps are also profiled per function (where the
time goes: local math, codec, collectives).

Bytes are per rank per step, sent (received is the same for every collective
used): DistributedLion's ``comm_stats``; for DDP, every tensor that the comm hook
hands to ``torch.distributed.all_reduce`` (PowerSGD's P and Q matrices and its
uncompressed vectors included), counted as a ring all-reduce, 2(N−1)/N × bytes.

Each link rate is one run of the N ranks in a virtual cluster (``dlion cluster``:
one network namespace per rank, tbf-shaped full-duplex links; root needed). ``--loopback`` runs the ranks on 127.0.0.1
without shaping instead (no root needed).

Output: a table per link rate, ``e2e_results.json``, ``e2e_table.txt`` and
``e2e_step_time.png`` (step time against link rate) in ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

BASELINES = ("compute", "g-adamw", "g-lion", "g-lion-bf16", "g-lion-powersgd")
DLION = tuple(f"d-{vote}-{comm}{ov}" for vote in ("mavo", "avg") for comm in ("allgather", "1bit", "pbit")
              for ov in ("", "-ov")) + ("d-mavo-quant", "d-mavo-quant-ov")
METHODS = BASELINES + DLION
GROUPS = {
    "all": METHODS,
    "baselines": BASELINES,
    "dlion": DLION,
    "mavo": tuple(m for m in DLION if m.startswith("d-mavo")),
    "avg": tuple(m for m in DLION if m.startswith("d-avg")),
    "overlap": tuple(m for m in DLION if m.endswith("-ov")),
}
LABELS = {"compute": "compute only (no comm)", "g-adamw": "G-AdamW (DDP fp32)", "g-lion": "G-Lion (DDP fp32)",
          "g-lion-bf16": "G-Lion (DDP bf16 hook)", "g-lion-powersgd": "G-Lion (DDP PowerSGD)"}
POWERSGD_START_ITER = 2  # PowerSGD needs >= 2 uncompressed iterations (DDP rebuilds buckets after the first)
POWERSGD_BUCKET_MB = 1 << 16  # one bucket for PowerSGD (see MethodRun)


def label(method: str) -> str:
    if method in LABELS:
        return LABELS[method]
    parts = method.split("-")
    vote, comm, ov = parts[1], parts[2], len(parts) > 3
    comm = {"quant": "quantized int8", "allgather": "allgather (naive)"}.get(comm, comm)
    return f"D-Lion {'MaVo' if vote == 'mavo' else 'Avg'} {comm}{' +overlap' if ov else ''}"


def parse_methods(text: str) -> list[str]:
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        names = GROUPS.get(item, (item,))
        for n in names:
            if n not in METHODS:
                raise ValueError(f"unknown method {n!r}; choose from {', '.join(METHODS)} "
                                 f"or the groups {', '.join(GROUPS)}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError("no methods given")
    return out


# --------------------------------------------------------------------------- instrumentation


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


# --------------------------------------------------------------------------- one method on one rank


def _noop_hook(state, bucket):
    """No communication: hand DDP its own local gradient back as a completed future."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _counting(inner: Callable, tally: dict) -> Callable:
    """Wrap a DDP comm hook: tally the fp32 bucket bytes it is handed (the traffic it
    then sends is counted by :class:`Instrument` at ``all_reduce``)."""
    def hook(state, bucket):
        buf = bucket.buffer()
        tally["buckets"] += 1
        tally["bucket_bytes"] += buf.numel() * buf.element_size()
        return inner(state, bucket)
    return hook


def _build_model(cfg: dict, vocab_size: int):
    from dlion.lab.models import CharGPT

    torch.manual_seed(cfg["seed"])  # identical on every rank: no initial broadcast needed
    return CharGPT(vocab_size, block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                   n_head=cfg["n_head"], n_embd=cfg["n_embd"])


def _dlion_class():
    from dlion import DistributedLion

    class SeededDistributedLion(DistributedLion):
        """Every rank builds the model from the same seed, so rank 0's parameter broadcast
        (seconds of set-up on a slow link) is skipped; check_replicas() verifies it."""

        def _broadcast_parameters(self) -> None:
            pass

    return SeededDistributedLion


class MethodRun:
    """One method's model and optimizer on one rank, stepped by the driver loop."""

    def __init__(self, method: str, rank: int, cfg: dict, vocab_size: int, inst: Instrument):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        import dlion

        self.method, self.rank, self.inst = method, rank, inst
        self.model = model = _build_model(cfg, vocab_size)
        self.params = sum(p.numel() for p in model.parameters())
        lr, betas, wd = cfg["lr"], (0.9, 0.99), cfg["weight_decay"]
        self.tally = {"buckets": 0, "bucket_bytes": 0}
        self.is_ddp = method in BASELINES
        if self.is_ddp:
            # gradient_as_bucket_view: no copy between gradients and buckets (DDP's fastest setting).
            # PowerSGD gets a single bucket: its hook issues collectives from completion callbacks, so
            # with several buckets in flight the ranks issue them in different orders, which Gloo
            # (matching collectives by issue order) aborts on ("Received data size doesn't match").
            cap = POWERSGD_BUCKET_MB if method == "g-lion-powersgd" else cfg["bucket_mb"]
            self.net = DDP(model, init_sync=False, bucket_cap_mb=cap, gradient_as_bucket_view=True)
            if method == "compute":
                hook, state = _noop_hook, None
            elif method == "g-lion-bf16":
                hook, state = default_hooks.bf16_compress_hook, None
            elif method == "g-lion-powersgd":
                hook = powerSGD_hook.powerSGD_hook
                state = powerSGD_hook.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=cfg["powersgd_rank"],
                                                    start_powerSGD_iter=POWERSGD_START_ITER,
                                                    random_seed=cfg["seed"])
            else:
                hook, state = default_hooks.allreduce_hook, None
            self.net.register_comm_hook(state, _counting(hook, self.tally))
            if method == "g-adamw":
                self.opt = torch.optim.AdamW(model.parameters(), lr=10 * lr, weight_decay=wd / 10)
            else:
                self.opt = dlion.Lion(model.parameters(), lr=lr, betas=betas, weight_decay=wd)
        else:
            _, vote, comm, *rest = method.split("-")
            quant = comm == "quant"
            self.net = model
            self.opt = _dlion_class()(
                model.parameters(), lr=lr, betas=betas, weight_decay=wd, vote=vote, ties=cfg["ties"],
                comm="1bit" if quant else comm, aggregate="quantized" if quant else "sign",
                quant_bits=cfg["quant_bits"], overlap=bool(rest), bucket_cap_mb=cfg["bucket_mb"])
            self.opt.check_replicas()
        self.step_s: list[float] = []
        self.fwd_bwd_s: list[float] = []
        self.losses: list[float] = []
        self._start: Optional[tuple] = None

    def step(self, x, y, measure: bool) -> None:
        inst = self.inst
        if measure and self._start is None:  # first measured step: bytes and profile from here on
            self._start = ((self.opt.comm_stats.bytes_sent, self.opt.comm_stats.bytes_received)
                           if not self.is_ddp else None, dict(self.tally))
        inst.count, inst.profile = self.is_ddp, not self.is_ddp
        inst.current = self.method if measure else None
        try:
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            _, loss = self.net(x, y)
            loss.backward()
            t1 = time.perf_counter()
            self.opt.step()
            t2 = time.perf_counter()
        finally:
            inst.current = None
        if measure:
            self.step_s.append(t2 - t0)
            self.fwd_bwd_s.append(t1 - t0)
        self.losses.append(float(loss.detach()))

    def result(self) -> dict:
        steps = len(self.step_s)
        inst, m = self.inst, self.method
        if self.is_ddp:
            sent = received = inst.bytes_sent.get(m, 0.0) / steps
            t0 = self._start[1]
            extra = {"all_reduce_calls_per_step": inst.all_reduce_calls.get(m, 0) / steps,
                     "buckets_per_step": (self.tally["buckets"] - t0["buckets"]) / steps,
                     "bucket_bytes_per_step": (self.tally["bucket_bytes"] - t0["bucket_bytes"]) / steps}
        else:
            b0 = self._start[0]
            sent = (self.opt.comm_stats.bytes_sent - b0[0]) / steps
            received = (self.opt.comm_stats.bytes_received - b0[1]) / steps
            extra = {"buckets": len(self.opt._buckets),
                     "algorithms": sorted({b.algorithm for b in self.opt._buckets}),
                     "profile_ms_per_step": {k: 1e3 * v / steps for k, v in sorted(inst.times.get(m, {}).items())},
                     "profile_calls_per_step": {k: v / steps for k, v in sorted(inst.calls.get(m, {}).items())}}
            self.opt.check_replicas()  # the replicas must still be bitwise identical
        return {"method": m, "rank": self.rank, "params": self.params, "step_s": self.step_s,
                "fwd_bwd_s": self.fwd_bwd_s, "bytes_sent_per_step": sent, "bytes_received_per_step": received,
                "loss_first": self.losses[0], "loss_last": self.losses[-1], **extra}


def make_batches(train_ids, cfg: dict, rank: int) -> list:
    from dlion.lab.data import char_batches

    g = torch.Generator().manual_seed(1000 * cfg["seed"] + rank)
    return [char_batches(train_ids, cfg["block_size"], cfg["batch_size"], g)
            for _ in range(cfg["warmup"] + cfg["steps"])]


def run_methods(rank: int, world: int, cfg: dict, train_ids, vocab_size: int,
                emit: Callable[[dict], None]) -> None:
    """Train every method of ``cfg["methods"]`` on this rank; ``emit`` gets a ``{"tick": 1}``
    per step (rank 0) and one result dict per method.

    Interleaved (default): all methods are built first, then take turns step by step (the
    order rotating every round) with an untimed barrier before each step, so that every
    method sees the same machine load. Sequential: one method after another, no barriers."""
    torch.set_num_threads(1)
    inst = Instrument()
    inst.install()
    methods, rounds = cfg["methods"], cfg["warmup"] + cfg["steps"]
    try:
        batches = make_batches(train_ids, cfg, rank)
        if cfg["sequential"]:
            for m in methods:
                run = MethodRun(m, rank, cfg, vocab_size, inst)
                dist.barrier()
                for it, (x, y) in enumerate(batches):
                    run.step(x, y, it >= cfg["warmup"])
                    if rank == 0:
                        emit({"tick": 1})
                emit(run.result())
                del run
                gc.collect()  # free this method's model, DDP reducer and optimizer before the next
            return
        runs = [MethodRun(m, rank, cfg, vocab_size, inst) for m in methods]
        for it, (x, y) in enumerate(batches):
            k = it % len(runs)
            for run in runs[k:] + runs[:k]:
                dist.barrier()
                run.step(x, y, it >= cfg["warmup"])
                if rank == 0:
                    emit({"tick": 1})
        dist.barrier()
        for run in runs:
            emit(run.result())
    finally:
        inst.uninstall()


def _load_data(cfg: dict):
    if cfg.get("synthetic"):
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 84, (200_000,), generator=g), 84
    from dlion.lab.data import load_shakespeare

    train_ids, _, vocab = load_shakespeare()
    return train_ids, len(vocab)


def _env_worker(cfg: dict) -> int:
    """One rank inside the virtual cluster (env:// rendezvous): prints a TICK line per step
    (rank 0) and a RESULT line with JSON per method."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg["timeout"]))
    try:
        train_ids, vocab_size = _load_data(cfg)

        def emit(d: dict) -> None:
            print("TICK" if "tick" in d else "RESULT " + json.dumps(d), flush=True)

        run_methods(dist.get_rank(), dist.get_world_size(), cfg, train_ids, vocab_size, emit)
    finally:
        dist.destroy_process_group()
    return 0


def _spawn_entry(rank: int, world: int, cfg: dict, train_ids, vocab_size: int, ticks) -> list:
    got: list = []

    def emit(d: dict) -> None:
        if "tick" in d:
            ticks.put(1)
        else:
            got.append(d)

    run_methods(rank, world, cfg, train_ids, vocab_size, emit)
    return got


# --------------------------------------------------------------------------- summary


def summarize(per_rank: list[dict]) -> dict:
    """Pool one method's per-rank results: median over all ranks' measured steps."""
    steps = [t for r in per_rank for t in r["step_s"]]
    fb = [t for r in per_rank for t in r["fwd_bwd_s"]]
    ranks = sorted({r["rank"] for r in per_rank})
    by_rank = {k: statistics.median([t for r in per_rank if r["rank"] == k for t in r["step_s"]]) for k in ranks}
    r0 = [r for r in per_rank if r["rank"] == 0][0]
    out = {
        "ms_per_step": 1e3 * statistics.median(steps),
        "ms_per_step_by_rank": [1e3 * by_rank[k] for k in ranks],
        "ms_p10": 1e3 * _quantile(steps, 0.1), "ms_p90": 1e3 * _quantile(steps, 0.9),
        "fwd_bwd_ms": 1e3 * statistics.median(fb),
        "bytes_sent_per_rank_per_step": statistics.mean(r["bytes_sent_per_step"] for r in per_rank),
        "bytes_received_per_rank_per_step": statistics.mean(r["bytes_received_per_step"] for r in per_rank),
        "params": r0["params"],
        "loss_first": r0["loss_first"], "loss_last": r0["loss_last"],
        "samples": len(steps),
    }
    for k in ("all_reduce_calls_per_step", "buckets_per_step", "bucket_bytes_per_step", "buckets", "algorithms"):
        if k in r0:
            out[k] = r0[k]
    if "profile_ms_per_step" in r0:
        names = sorted({n for r in per_rank for n in r["profile_ms_per_step"]})
        out["profile_ms_per_step"] = {n: statistics.mean(r["profile_ms_per_step"].get(n, 0.0) for r in per_rank)
                                      for n in names}
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def table(link: str, bps: Optional[int], rows: dict, cfg: dict, world: int) -> str:
    """The text table of one link rate (rows: method -> summary)."""
    nparams = next(iter(rows.values()))["params"]
    comp = rows.get("compute", {}).get("ms_per_step")
    glion = rows.get("g-lion", {}).get("ms_per_step")
    lines = [f"link {link}: {world} ranks, CharGPT {nparams / 1e6:.2f} M parameters "
             f"(n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}), batch {cfg['batch_size']}×{cfg['block_size']} "
             f"tokens per rank, buckets of {cfg['bucket_mb']:g} MB, median of {cfg['steps']} steps × {world} ranks"]
    head = (f"{'method':<38} {'ms/step':>8} {'vs G-Lion':>9} {'×compute':>8} {'fwd+bwd':>8} "
            f"{'MB sent':>8} {'bits/param':>10} {'wire ms':>8}")
    lines += [head, f"{'':<38} {'':>8} {'(speedup)':>9} {'':>8} {'ms':>8} {'/rank/step':>8} {'sent':>10} "
                    f"{'(ideal)':>8}", "-" * len(head)]
    for m, r in rows.items():
        ms = r["ms_per_step"]
        speed = f"{glion / ms:>8.2f}×" if glion else f"{'-':>9}"
        frac = f"{ms / comp:>7.2f}×" if comp else f"{'-':>8}"
        sent = r["bytes_sent_per_rank_per_step"]
        bits = 8 * sent / r["params"]
        wire = f"{8e3 * sent / bps:>8.1f}" if bps else f"{'-':>8}"
        lines.append(f"{label(m):<38} {ms:>8.1f} {speed} {frac} {r['fwd_bwd_ms']:>8.1f} {sent / 1e6:>8.3f} "
                     f"{bits:>10.3f} {wire}")
    if comp and glion:
        comm = glion - comp
        ratio = comp / comm if comm > 0 else float("inf")
        lines.append(f"G-Lion step: compute (the compute-only step) {comp:.1f} ms, communication (G-Lion step − "
                     f"compute) {comm:.1f} ms: compute/communication = {ratio:.3f}; G-Lion step = "
                     f"{glion / comp:.1f}× compute-only")
    return "\n".join(lines)


def headline(rows: dict) -> Optional[dict]:
    """Best D-Lion MaVo method vs G-Lion and compute-only at one link rate."""
    mavo = {m: r for m, r in rows.items() if m.startswith("d-mavo")}
    if not mavo or "g-lion" not in rows or "compute" not in rows:
        return None
    best = min(mavo, key=lambda m: mavo[m]["ms_per_step"])
    comp, glion, ms = rows["compute"]["ms_per_step"], rows["g-lion"]["ms_per_step"], mavo[best]["ms_per_step"]
    return {"best_mavo": best, "glion_over_compute": glion / comp, "speedup_vs_glion": glion / ms,
            "over_compute": ms / comp,
            "criteria": {"glion_at_least_10x_compute": glion / comp >= 10, "speedup_at_least_5x": glion / ms >= 5,
                         "within_1.3x_compute": ms / comp <= 1.3}}


def profile_lines(rows: dict, methods: list[str]) -> list[str]:
    lines = []
    for m in methods:
        prof = rows.get(m, {}).get("profile_ms_per_step")
        if not prof:
            continue
        lines.append(f"  {label(m)}: step {rows[m]['ms_per_step']:.1f} ms; inside it (ms/step, inclusive, mean "
                     "over ranks):")
        for name, v in sorted(prof.items(), key=lambda kv: -kv[1]):
            if v >= 0.05:
                lines.append(f"    {v:>8.1f}  {name}")
    return lines


def plot(results: list[dict], methods: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(10, 6.5))
    rated = [r for r in results if r["rate_bps"]]
    colors = {"g-adamw": "tab:gray", "g-lion": "tab:red", "g-lion-bf16": "tab:orange",
              "g-lion-powersgd": "tab:brown", "allgather": "tab:purple", "1bit": "tab:blue", "pbit": "tab:green",
              "quant": "tab:olive"}
    if rated:
        for m in methods:
            pts = sorted((r["rate_bps"] / 1e6, r["ms_per_step"]) for r in rated if r["method"] == m)
            if not pts:
                continue
            xs, ys = zip(*pts)
            if m == "compute":
                style = dict(color="black", ls="--", lw=2)
            elif m in BASELINES:
                style = dict(color=colors[m], ls="-", lw=2, marker="o")
            else:  # D-Lion: colour = algorithm, marker = vote, dashed = overlap on
                parts = m.split("-")
                style = dict(color=colors[parts[2]], ls="--" if m.endswith("-ov") else ":", lw=1.3,
                             marker="s" if parts[1] == "mavo" else "^", ms=5,
                             fillstyle="full" if m.endswith("-ov") else "none")
            ax.plot(xs, ys, label=label(m), **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({r["rate_bps"] / 1e6 for r in rated})
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{x:g}" for x in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        lo, hi = min(r["ms_per_step"] for r in rated), max(r["ms_per_step"] for r in rated)
        yt = [v * 10 ** k for k in range(-1, 7) for v in (1, 2, 3, 5, 7) if lo / 1.2 <= v * 10 ** k <= hi * 1.2]
        ax.set_yticks(yt)
        ax.set_yticklabels([f"{y:g}" for y in yt])
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("link rate per rank (Mbit/s, full duplex)")
        ax.set_ylabel("time per step (ms, median, log scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    else:  # loopback only: one bar per method
        rows = [r for r in results if r["method"] in methods]
        ax.barh([label(r["method"]) for r in rows], [r["ms_per_step"] for r in rows])
        ax.set_xlabel("time per step (ms, median), loopback")
        ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- driver


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dlion bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="ranks (default 4)")
    ap.add_argument("--link", default="50mbit,100mbit,300mbit,1gbit",
                    help="link rates to sweep, comma separated (default 50mbit,100mbit,300mbit,1gbit)")
    ap.add_argument("--loopback", action="store_true",
                    help="plain 127.0.0.1, no namespaces, no shaping (no root needed); --link is ignored")
    ap.add_argument("--methods", default="all", help=f"comma list of methods or groups ({', '.join(GROUPS)}); "
                                                       "default all")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per method (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=None, help="default n_embd/64")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    ap.add_argument("--bucket-mb", type=float, default=6.0,
                    help="bucket cap (MB of fp32 gradients) for DDP and DistributedLion alike (default 6: "
                         "4 buckets for the default model, so that overlap has something to overlap)")
    ap.add_argument("--quant-bits", type=int, default=8, help="field width of d-mavo-quant (default 8)")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4, help="Lion lr (AdamW gets 10×, its wd /10)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic", action="store_true", help="random tokens instead of Shakespeare")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per link rate (default 1800)")
    ap.add_argument("--prefix", default=None, help="virtual cluster namespace prefix (default dle<pid>)")
    ap.add_argument("--out", default=os.path.join("runs", "bench-e2e"),
                    help="directory for e2e_results.json, e2e_table.txt, e2e_step_time.png (default runs/bench-e2e)")
    ap.add_argument("--ties", default="zero", choices=("zero", "random"),
                    help="D-Lion tie rule (default zero; random makes MaVo's way back 1 bit for even N)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the methods one after another (less memory) instead of taking turns step by step")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.worker is not None:
        return _env_worker(json.loads(args.worker))
    if args.workers < 2:
        ap.error("--workers must be >= 2")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    try:
        methods = parse_methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    if "g-lion-powersgd" in methods and args.warmup < POWERSGD_START_ITER:
        print(f"note: PowerSGD compresses from step {POWERSGD_START_ITER + 1}; with --warmup {args.warmup} "
              "some measured steps of g-lion-powersgd are uncompressed", file=sys.stderr)
    rounds = args.warmup + args.steps
    n_head = args.n_head or max(1, args.n_embd // 64)
    if args.n_embd % n_head:
        ap.error(f"--n-head {n_head} must divide --n-embd {args.n_embd}")
    cfg = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": n_head, "block_size": args.block_size,
           "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup, "bucket_mb": args.bucket_mb,
           "quant_bits": args.quant_bits, "powersgd_rank": args.powersgd_rank, "lr": args.lr,
           "weight_decay": args.weight_decay, "seed": args.seed, "synthetic": args.synthetic,
           "ties": args.ties, "timeout": args.timeout, "sequential": args.sequential, "methods": methods}
    if args.loopback:
        links = [("loopback", None)]
    else:
        from dlion.lab.cluster import parse_rate

        try:
            links = [(t.strip(), parse_rate(t.strip())) for t in args.link.split(",") if t.strip()]
        except ValueError as e:
            ap.error(str(e))
        if not links:
            ap.error("--link: no rate given")
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        tqdm = None
    bar = None if (tqdm is None or args.no_progress) else tqdm(total=len(methods) * len(links) * rounds,
                                                                unit="step",
                                                                desc="bench e2e", file=sys.stderr)
    raw: dict = {}  # link -> method -> [per-rank dicts]
    failed: Optional[str] = None
    t_start = time.time()
    try:
        if args.loopback:
            failed = _run_loopback(args, cfg, raw, bar)
        else:
            failed = _run_cluster(args, cfg, links, raw, bar)
    finally:
        if bar is not None:
            bar.close()
    return _report(args, cfg, methods, links, raw, failed, time.time() - t_start, argv)


def _run_loopback(args, cfg: dict, raw: dict, bar) -> Optional[str]:
    import torch.multiprocessing as mp

    from dlion.lab.spawn import spawn

    # Imported once here so that the forked ranks inherit them: DDP's hooks and the torch._dynamo
    # that DDP's constructor imports take seconds to import.
    import torch._dynamo  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import dlion.distributed  # noqa: F401

    train_ids, vocab_size = _load_data(cfg)
    ticks = mp.get_context("fork").SimpleQueue()
    done = threading.Event()

    def pump() -> None:
        while not done.is_set() or not ticks.empty():
            if ticks.empty():
                time.sleep(0.05)
                continue
            ticks.get()
            if bar is not None:
                bar.update(1)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if bar is not None:
        bar.set_postfix_str("loopback")
    try:
        per_rank = spawn(_spawn_entry, args.workers, cfg, train_ids, vocab_size, ticks, timeout_s=args.timeout)
    finally:
        done.set()
        reader.join()
    for got in per_rank:
        for d in got:
            raw.setdefault("loopback", {}).setdefault(d["method"], []).append(d)
    return None


def _run_cluster(args, cfg: dict, links: list, raw: dict, bar) -> Optional[str]:
    from dlion.lab.cluster import ClusterError, RootRequiredError, VirtualCluster, exit_code

    prefix = args.prefix or f"dle{os.getpid() % 100000}"
    cmd = [sys.executable, "-m", "dlion.lab.bench.e2e", "--worker", json.dumps(cfg)]
    try:
        with VirtualCluster(args.workers, link=links[0][0], prefix=prefix) as cluster:
            for link, _ in links:
                cluster.set_link(link)
                if bar is not None:
                    bar.set_postfix_str(link)
                got: dict = {}

                def on_line(rank: int, stream: str, line: str, link=link, got=got) -> None:
                    if stream != "stdout":
                        return
                    if line.startswith("RESULT "):
                        d = json.loads(line[len("RESULT "):])
                        got.setdefault(d["method"], []).append(d)
                    elif line == "TICK" and bar is not None:
                        bar.update(1)

                results = cluster.run(cmd, timeout=args.timeout, on_line=on_line)
                raw[link] = got
                if exit_code(results):
                    for r in results:
                        if not r.ok:
                            sys.stderr.write(f"[rank {r.rank}] exit {r.returncode}"
                                             f"{' (timed out)' if r.timed_out else ''}\n{r.stderr[-3000:]}\n")
                    return f"link {link}: exit {exit_code(results)}"
    except RootRequiredError as e:
        print(f"dlion bench e2e: {e}\nUse --loopback to run without namespaces and shaping.", file=sys.stderr)
        return "no root"
    except ClusterError as e:
        print(f"dlion bench e2e: {e}", file=sys.stderr)
        return str(e)
    return None


def _options_without_out(argv: list[str]) -> list[str]:
    """The command-line options, less ``--out DIR`` (a local path)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def _report(args, cfg: dict, methods: list[str], links: list, raw: dict, failed: Optional[str],
            elapsed: float, argv: list[str]) -> int:
    world = args.workers
    results, tables, heads = [], [], {}
    for link, bps in links:
        got = raw.get(link, {})
        rows = {m: summarize(got[m]) for m in methods if m in got}
        if not rows:
            continue
        for m, r in rows.items():
            results.append({"link": link, "rate_bps": bps, "method": m, "label": label(m), **r})
        tables.append(table(link, bps, rows, cfg, world))
        h = headline(rows)
        if h:
            heads[link] = h
            tables.append(f"best D-Lion MaVo: {label(h['best_mavo'])}: speedup over G-Lion "
                          f"{h['speedup_vs_glion']:.2f}×, {h['over_compute']:.2f}× the compute-only step (G-Lion: "
                          f"{h['glion_over_compute']:.1f}× compute-only)")
        ours = sorted((m for m in rows if m.startswith("d-")), key=lambda m: rows[m]["ms_per_step"])
        prof = profile_lines(rows, ours[:1])
        if prof:
            tables.append("profile of the fastest D-Lion method (where its step goes):\n" + "\n".join(prof))
        tables.append("")
    if heads:
        tables.append("summary (best D-Lion MaVo per link; done-when: G-Lion >= 10x compute-only, speedup >= 5x, "
                      "<= 1.3x compute-only):")
        for link, h in heads.items():
            tables.append(f"  {link:>10}: G-Lion {h['glion_over_compute']:5.1f}× compute-only; "
                          f"{label(h['best_mavo'])}: speedup {h['speedup_vs_glion']:.2f}×, "
                          f"{h['over_compute']:.2f}× compute-only")
        tables.append("")
    where = "loopback (no shaping)" if args.loopback else "virtual cluster (network namespaces, tbf-shaped links)"
    header = (f"dlion bench e2e: {world} ranks on one machine ({os.cpu_count()} CPU cores shared by all ranks, "
              f"1 torch thread per rank), {where}; torch {torch.__version__}; {elapsed / 60:.1f} min")
    text = header + "\n\n" + "\n".join(tables)
    print(text)
    if failed:
        print(f"dlion bench e2e: FAILED ({failed}); results above are partial", file=sys.stderr)
    if results and args.out:
        os.makedirs(args.out, exist_ok=True)
        doc = {"benchmark": "dlion bench e2e", "options": _options_without_out(argv), "config": cfg,
               "workers": world, "mode": "loopback" if args.loopback else "virtual-cluster",
               "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "python": platform.python_version(), "system": platform.system(),
                           "machine": platform.machine()},
               "elapsed_s": elapsed, "failed": failed, "headline": heads, "results": results,
               "counting": "bytes sent per rank per step. DistributedLion: comm_stats (bandwidth-optimal "
                           "counts of its all_to_all/all_gather/all_reduce, flags included). DDP: every tensor "
                           "the comm hook passes to torch.distributed.all_reduce, as a ring all-reduce "
                           "2(N-1)/N x bytes."}
        with open(os.path.join(args.out, "e2e_results.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "e2e_table.txt"), "w") as f:
            f.write(text + "\n")
        nparams = results[0]["params"]
        plot(results, methods, os.path.join(args.out, "e2e_step_time.png"),
             f"dlion bench e2e: {world} ranks, CharGPT {nparams / 1e6:.1f} M params, batch "
             f"{cfg['batch_size']}×{cfg['block_size']}/rank, {os.cpu_count()} shared CPU cores")
        print(f"wrote {os.path.join(args.out, 'e2e_results.json')}, e2e_table.txt, e2e_step_time.png")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
