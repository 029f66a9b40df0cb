"""Running ``dlion bench e2e``'s ranks: the per-rank loop that steps every method, and
launching it on loopback (forked local ranks) or on the virtual cluster (one process per
rank, one run per link rate)."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .instrument import Instrument
from .methods import MethodRun


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
