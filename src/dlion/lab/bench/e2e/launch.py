"""Running ``dlion bench e2e``'s ranks: the per-rank loop that steps every method, and
launching it on loopback (forked local ranks) or on the virtual cluster (one process per
rank, one run per link rate) with the benchmarks' shared launcher (:mod:`dlion.lab.bench.launch`)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from typing import Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from ..launch import env_worker, report_failure, run_cluster, run_loopback
from .instrument import Instrument
from .methods import MethodRun, applies_next_step


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
    method sees the same machine load. Sequential: one method after another, no barriers.
    Methods with ``delay=1`` (``-dl``) always run as a block of their own steps, first: their
    exchange runs on into their next step, which another method's step must not stand in for."""
    torch.set_num_threads(1)
    inst = Instrument()
    inst.install()
    methods = cfg["methods"]
    uplinks = uplink_counter(cfg) if rank == 0 else None
    counting = cfg.get("nodes") and os.environ.get("DLION_CLUSTER_PREFIX") and \
        os.environ.get("DLION_CLUSTER_LINK") != "unlimited"

    def make(m: str) -> MethodRun:
        run = MethodRun(m, rank, cfg, vocab_size, inst)
        run.count_uplinks, run.uplink_counter = bool(counting), uplinks
        return run

    def build(fn):
        """``fn()`` (building methods, hence their process groups and threads) at nice 0, then this
        thread at ``--compute-nice`` for the steps."""
        nice = cfg.get("compute_nice", 0)
        if nice:
            set_priority(0)
        built = fn()
        if nice:
            set_priority(nice)
        return built

    try:
        batches = make_batches(train_ids, cfg, rank)
        # A delay=1 method's exchange runs on until its next step: another method's step in between
        # would hide it, so those methods always run as a block of their own steps.
        blocks = methods if cfg["sequential"] else [m for m in methods if applies_next_step(m)]
        for m in blocks:
            run = build(lambda: make(m))
            dist.barrier()
            for it, (x, y) in enumerate(batches):
                run.step(x, y, it >= cfg["warmup"])
                if rank == 0:
                    emit({"tick": 1})
            run.end_measure()
            run.profile(batches[:cfg.get("profile_steps", 3)])
            emit(run.result())
            del run
            gc.collect()  # free this method's model, DDP reducer and optimizer before the next
        methods = [m for m in methods if m not in blocks]
        if not methods:
            return
        runs = build(lambda: [make(m) for m in methods])
        for it, (x, y) in enumerate(batches):
            k = it % len(runs)
            for run in runs[k:] + runs[:k]:
                dist.barrier()
                run.step(x, y, it >= cfg["warmup"])
                if rank == 0:
                    emit({"tick": 1})
        dist.barrier()
        for run in runs:  # (a streaming local method's round in flight completes: its bytes are in the window)
            run.end_measure()
        for run in runs:  # every rank profiles the methods in the same order (D-Lion's steps are collective)
            run.profile(batches[:cfg.get("profile_steps", 3)])
        for run in runs:
            emit(run.result())
    finally:
        inst.uninstall()


def set_priority(nice: int) -> None:
    """This thread (the rank's training thread) at ``nice`` (``--compute-nice``). Threads that
    exist already (the process groups' communication threads, created with the groups) keep
    theirs; threads it starts later (DistributedLion's exchange thread) inherit it. Linux: the
    priority is per thread. Going back to 0 (before a later method builds its process groups)
    needs root, which the virtual cluster has."""
    import threading

    tid = threading.get_native_id()
    if os.getpriority(os.PRIO_PROCESS, tid) == nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        raise RuntimeError(f"--compute-nice: cannot set this thread's nice value to {nice} without root (a nice "
                           "value can only be raised); run the methods interleaved (no --sequential, no "
                           "delay=1 methods) or as root") from None


def uplink_counter(cfg: dict) -> Optional[Callable[[], int]]:
    """Inside a virtual cluster with nodes: () -> bytes the node uplinks have sent so far, both
    directions, summed over the nodes (tc's counters of the uplinks' tbf qdiscs, read from the
    switch namespace). None elsewhere."""
    prefix, nodes = os.environ.get("DLION_CLUSTER_PREFIX"), cfg.get("nodes")
    if not prefix or not nodes or os.environ.get("DLION_CLUSTER_LINK") == "unlimited":
        return None  # (an unshaped uplink has no tbf qdisc, hence no counter)
    import re
    import subprocess

    devs = [d for a in range(nodes) for d in (f"u{a}", f"c{a}")]

    def count() -> int:
        total = 0
        for dev in devs:
            out = subprocess.run(["tc", "-n", f"{prefix}-sw", "-s", "qdisc", "show", "dev", dev],
                                 capture_output=True, text=True, check=True).stdout
            total += int(re.search(r"Sent (\d+) bytes", out).group(1))
        return total

    return count


def _load_data(cfg: dict):
    if cfg.get("synthetic"):
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 84, (200_000,), generator=g), 84
    from dlion.lab.data import load_shakespeare

    train_ids, _, vocab = load_shakespeare()
    return train_ids, len(vocab)


def _cluster_rank(rank: int, world: int, cfg: dict, emit: Callable[[dict], None]) -> None:
    train_ids, vocab_size = _load_data(cfg)
    run_methods(rank, world, cfg, train_ids, vocab_size, emit)


def e2e_env_worker(cfg: dict) -> NoReturn:
    """One rank inside the virtual cluster (env:// rendezvous): prints a TICK line per step
    (rank 0) and a RESULT line with JSON per method."""
    return env_worker(_cluster_rank, cfg, timeout_s=cfg["timeout"])


def _by_method(per_rank: list[list[dict]]) -> dict:
    """Every rank's result dicts, grouped by method: method -> [per-rank dicts]."""
    got: dict = {}
    for results in per_rank:
        for d in results:
            got.setdefault(d["method"], []).append(d)
    return got


def run_e2e_loopback(args, cfg: dict, raw: dict, bar) -> Optional[str]:
    # Imported once here so that the forked ranks inherit them: DDP's hooks and the torch._dynamo
    # that DDP's constructor imports take seconds to import.
    import torch._dynamo  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import dlion.distributed  # noqa: F401

    train_ids, vocab_size = _load_data(cfg)
    if bar is not None:
        bar.set_postfix_str("loopback")
    per_rank = run_loopback(run_methods, args.workers, cfg, train_ids, vocab_size, timeout_s=args.timeout,
                            on_tick=None if bar is None else lambda: bar.update(1))
    raw["loopback"] = _by_method(per_rank)
    return None


def run_e2e_cluster(args, cfg: dict, links: list, raw: dict, bar) -> Optional[str]:
    from dlion.lab.cluster import ClusterError, RootRequiredError

    prefix = args.prefix or f"dle{os.getpid() % 100000}"
    cmd = [sys.executable, "-m", "dlion.lab.bench.e2e", "--worker", json.dumps(cfg)]
    try:
        with contextlib.closing(run_cluster(cmd, args.workers, [link for link, _ in links], prefix=prefix,
                                            timeout=args.timeout, nodes=cfg.get("nodes"), queue=args.queue,
                                            on_tick=None if bar is None else lambda: bar.update(1),
                                            on_link=None if bar is None else bar.set_postfix_str)) as runs:
            for link, per_rank, results in runs:
                raw[link] = _by_method(per_rank)
                code = report_failure(results)
                if code:
                    return f"link {link}: exit {code}"
    except RootRequiredError as e:
        print(f"dlion bench e2e: {e}\nUse --loopback to run without namespaces and shaping.", file=sys.stderr)
        return "no root"
    except ClusterError as e:
        print(f"dlion bench e2e: {e}", file=sys.stderr)
        return str(e)
    return None
