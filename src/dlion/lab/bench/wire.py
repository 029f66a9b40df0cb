"""``dlion bench wire``: D-Lion's exchange alone, with the CPU idle and with every core busy.

How much of the link does a step's exchange really use? Each rank builds
``DistributedLion(comm="1bit", ties="random")`` over one flat parameter of ``--params``
values (the e2e CharGPT's count by default) in ``--bucket-mb`` buckets, and times ``--steps``
calls of ``step()`` on fresh random gradients (after ``--warmup`` untimed ones):

* ``idle``: nothing else runs on the machine;
* ``busy``: each rank first starts ``--load`` processes that multiply matrices in a loop (one
  torch thread each), so that, as in training, the ranks' communication threads compete with
  compute for the cores (4 ranks with one process each on 2 cores: the e2e benchmark's load).

For each link rate it prints the mean step time of both, the bytes one rank sends per step
(``comm_stats``), the ideal wire time (bytes × 8 / rate), and the *link use* = ideal wire time ÷
(step time − the same step's time on loopback, i.e. without the wire): 100 % would be the
link busy for the whole exchange. ``--loopback`` runs the ranks on 127.0.0.1 without shaping
(no root needed; the link use is then not defined).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

__all__ = ["main", "rank_fn"]


def _busy_loop(seconds: float) -> None:
    torch.set_num_threads(1)
    x = torch.randn(192, 192)
    end = time.time() + seconds
    while time.time() < end:
        x = torch.tanh(x @ x)


def _time_steps(opt, p, cfg) -> list:
    out = []
    g = torch.Generator().manual_seed(opt.rank)
    for it in range(cfg["warmup"] + cfg["steps"]):
        p.grad = torch.randn(p.shape, generator=g)
        t = time.perf_counter()
        opt.step()
        if it >= cfg["warmup"]:
            out.append(time.perf_counter() - t)
    return out


def rank_fn(rank: int, world: int, cfg: dict, emit) -> None:
    import torch.distributed as dist

    import dlion

    torch.set_num_threads(1)
    p = torch.zeros(cfg["params"], requires_grad=True)
    opt = dlion.DistributedLion([p], lr=1e-4, comm="1bit", ties="random", bucket_cap_mb=cfg["bucket_mb"])
    result = {"rank": rank}
    for mode in ("idle", "busy"):
        load = []
        if mode == "busy":
            ctx = mp.get_context("fork")
            load = [ctx.Process(target=_busy_loop, args=(600.0,), daemon=True) for _ in range(cfg["load"])]
            for proc in load:
                proc.start()
            time.sleep(0.5)
        dist.barrier()
        sent = opt.comm_stats.bytes_sent
        times = _time_steps(opt, p, cfg)
        result[mode] = {"step_s": times,
                        "bytes_sent_per_step": (opt.comm_stats.bytes_sent - sent) / (cfg["warmup"] + cfg["steps"])}
        for proc in load:
            proc.kill()
            proc.join()
        emit({"tick": 1})
    emit(result)


def summarize(link: str, per_rank: list, reference: dict | None) -> dict:
    from dlion.lab.cluster import parse_rate

    rows = {}
    rate = parse_rate(link) if link != "loopback" else None
    for mode in ("idle", "busy"):
        times = [t for r in per_rank for t in r[mode]["step_s"]]
        nbytes = statistics.mean(r[mode]["bytes_sent_per_step"] for r in per_rank)
        row = {"ms_mean": 1e3 * statistics.mean(times), "ms_median": 1e3 * statistics.median(times),
               "bytes_sent_per_step": nbytes}
        if rate:
            row["ideal_wire_ms"] = 1e3 * nbytes * 8 / rate
            if reference is not None:
                exchange = row["ms_mean"] - reference[mode]["ms_mean"]
                row["link_use"] = row["ideal_wire_ms"] / exchange if exchange > 0 else None
        rows[mode] = row
    return rows


def report(doc: dict) -> str:
    lines = [f"dlion bench wire: {doc['workers']} ranks, DistributedLion 1bit (random ties) on {doc['config']['params']:,} "
             f"values in {doc['config']['bucket_mb']} MB buckets, {doc['config']['steps']} steps; busy: "
             f"{doc['config']['load']} busy process(es) per rank on {doc['cores']} cores"]
    head = f"{'link':<10} {'mode':<5} {'ms/step':>8} {'median':>8} {'KB sent':>8} {'wire ms (ideal)':>16} {'link use':>9}"
    lines += [head, "-" * len(head)]
    for link, rows in doc["summary"].items():
        for mode, r in rows.items():
            use = r.get("link_use")
            wire = f"{r['ideal_wire_ms']:.1f}" if "ideal_wire_ms" in r else "-"
            share = f"{100 * use:.0f} %" if use else "-"
            lines.append(f"{link:<10} {mode:<5} {r['ms_mean']:>8.1f} {r['ms_median']:>8.1f} "
                         f"{r['bytes_sent_per_step'] / 1e3:>8.1f} {wire:>16} {share:>9}")
    lines.append("link use: ideal wire time / (step time - the loopback step time of the same mode): the share "
                 "of the exchange during which the link carried data at its full rate")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench wire", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="50mbit", help="link rates, comma separated (virtual cluster, root)")
    ap.add_argument("--loopback", action="store_true", help="loopback only (no shaping, no root)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--params", type=int, default=4_776_960, help="values (default: the e2e CharGPT's)")
    ap.add_argument("--bucket-mb", type=float, default=6.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--load", type=int, default=1, help="busy processes per rank in the busy mode")
    ap.add_argument("--out", default=os.path.join("runs", "bench-wire"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from .launch import env_worker, report_failure, run_cluster, run_loopback

    if args.worker is not None:
        return env_worker(rank_fn, json.loads(args.worker), timeout_s=900)
    if args.workers < 2 or args.steps < 1 or args.warmup < 0 or args.params < 1 or args.load < 0:
        ap.error("--workers >= 2, --steps >= 1, --warmup >= 0, --params >= 1 and --load >= 0 needed")
    cfg = {"params": args.params, "bucket_mb": args.bucket_mb, "steps": args.steps, "warmup": args.warmup,
           "load": args.load}
    doc = {"benchmark": "dlion bench wire", "command": "dlion bench wire " + " ".join(argv or sys.argv[1:]),
           "workers": args.workers, "cores": os.cpu_count() or 1, "config": cfg, "raw": {}, "summary": {}}
    t0 = time.time()
    per_rank = run_loopback(rank_fn, args.workers, cfg, timeout_s=900)
    doc["raw"]["loopback"] = [r[0] for r in per_rank]
    reference = summarize("loopback", doc["raw"]["loopback"], None)
    doc["summary"]["loopback"] = reference
    if not args.loopback:
        links = [t.strip() for t in args.link.split(",") if t.strip()]
        cmd = [sys.executable, "-m", "dlion", "bench", "wire", "--worker", json.dumps(cfg)]
        for link, got, results in run_cluster(cmd, args.workers, links, prefix=f"dlwr{os.getpid() % 10000}",
                                              timeout=1800):
            code = report_failure(results)
            if code:
                return code
            doc["raw"][link] = [g[0] for g in got]
            doc["summary"][link] = summarize(link, doc["raw"][link], reference)
    doc["wall_s"] = time.time() - t0
    os.makedirs(args.out, exist_ok=True)
    text = report(doc)
    print(text)
    with open(os.path.join(args.out, "wire.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "wire_table.txt"), "w") as f:
        f.write(text + "\n")
    print(f"wrote {os.path.join(args.out, 'wire.json')} and wire_table.txt ({doc['wall_s']:.0f} s)")
    return 0
