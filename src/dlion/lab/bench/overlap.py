"""``dlion bench overlap``: does ``overlap=True`` hide communication behind backward?

N ranks train the same MLP with several buckets (``--bucket-mb``) with
DistributedLion, alternating ``overlap=False`` and ``overlap=True`` step by
step in one run (so both see the same machine load), plus compute-only steps
(forward + backward, no optimizer) as the lower bound. Prints the median step
time of each and the share of communication hidden:

    hidden = (t_off − t_on) / (t_off − t_compute)

By default the ranks run in a virtual cluster with shaped links (root needed,
see ``dlion cluster``) so that communication waits on the network, not on the
two CPU cores; ``--loopback`` runs on plain loopback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

from .launch import env_worker, report_failure, run_cluster, run_loopback


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import dlion

    torch.set_num_threads(1)
    model = build_model(args.width, args.depth)
    opts = {ov: dlion.DistributedLion(model.named_parameters(), lr=1e-4, overlap=ov, bucket_cap_mb=args.bucket_mb,
                                      comm=args.comm)
            for ov in (False, True)}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    times: dict = {"off": [], "on": [], "compute": []}
    for it in range(args.warmup + args.steps):
        for kind in ("compute", "off", "on"):
            opt = opts[kind == "on"]
            torch.distributed.barrier()
            t = time.perf_counter()
            model.zero_grad(set_to_none=True)
            # The overlapping optimizer's hooks sit on the model: silence them unless it is its turn.
            with (opts[True].no_sync() if kind != "on" else contextlib.nullcontext()):
                nn.functional.cross_entropy(model(x), y).backward()
            if kind != "compute":
                opt.step()
            if it >= args.warmup:
                times[kind].append(time.perf_counter() - t)
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "buckets": len(opts[True].buckets), "params": opts[True].num_params,
            "bytes_per_step": opts[False].comm_stats.bytes_sent / max(1, opts[False].comm_stats.steps)}


def _rank(rank: int, world: int, args: argparse.Namespace, emit) -> None:
    out = worker(rank, world, args)
    if rank == 0:
        emit(out)


def report(out: dict, args: argparse.Namespace, where: str) -> None:
    m = out["median"]
    comm = m["off"] - m["compute"]
    hidden = (m["off"] - m["on"]) / comm if comm > 0 else float("nan")
    print(f"dlion bench overlap: {args.workers} ranks, {where}, MLP {out['params']:,} parameters in "
          f"{out['buckets']} buckets, comm={args.comm}, batch {args.batch}, median of {args.steps} steps")
    print(f"{'run':<28} {'ms/step':>9}")
    print(f"{'compute only (fwd+bwd)':<28} {m['compute'] * 1e3:>9.1f}")
    print(f"{'overlap=False':<28} {m['off'] * 1e3:>9.1f}")
    print(f"{'overlap=True':<28} {m['on'] * 1e3:>9.1f}")
    print(f"bytes sent per rank per step: {out['bytes_per_step']:,.0f}")
    print(f"communication hidden by overlap: {100 * hidden:.0f}%  (speedup {m['off'] / m['on']:.2f}×)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "dlion bench overlap", "where": where, "args": {
                k: v for k, v in vars(args).items() if k not in ("worker", "json")}, **out,
                "hidden": hidden, "speedup": m["off"] / m["on"]}, f, indent=1)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--link", default="200mbit", help="per-link rate in the virtual cluster (default 200mbit)")
    ap.add_argument("--loopback", action="store_true", help="plain loopback, no namespaces (no root needed)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--comm", default="1bit", choices=("auto", "1bit", "allgather", "pbit"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the medians and the settings to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers must be >= 2")
    if args.worker:
        return env_worker(_rank, args)
    if args.loopback:
        report(run_loopback(_rank, args.workers, args, timeout_s=900)[0][0], args, "loopback (no shaping)")
        return 0
    cmd = [sys.executable, "-m", "dlion", "bench", "overlap", "--worker"] + [a for a in argv if a != "--worker"]
    runs = list(run_cluster(cmd, args.workers, [args.link], prefix=f"dlov{os.getpid() % 10000}", timeout=1800))
    _, per_rank, results = runs[0]  # one link, one run; the cluster is torn down by now
    code = report_failure(results)
    if code:
        return code
    report(per_rank[0][0], args, f"virtual cluster, {args.link} links")
    return 0
