"""``dlion bench timeline``: where a training step's time goes — the wire or the CPU.

Runs methods of ``dlion bench e2e`` (same workload, same names) one after another on
the virtual cluster and records, per rank and measured step:

* wall time of forward, backward and ``optimizer.step()`` (from ``zero_grad``);
* the CPU time the rank's process used in the step (all its threads, user and system,
  ``os.times``);
* every collective DistributedLion hands to ``torch.distributed``: when it was issued and
  when it completed (a callback on its future), its bytes, the thread that issued it.

Then, untimed, a few more steps under ``cProfile`` with a per-thread CPU clock on rank 0:
the CPU milliseconds per step inside the library's functions (the training thread only).

The table compares each method's mean step with its **CPU floor**: the CPU time of all
ranks in a step divided by the cores they share. A step near its floor is bound by the
CPU, not by the network: sending fewer bytes or overlapping better cannot shorten it,
only less work per step can. Writes ``timeline.json`` and ``timeline.png`` (one step of
rank 0 per method: phases and collectives) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

from .launch import env_worker, report_failure, run_cluster

_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce")
#: the library's functions whose CPU time the report lists (cumulative: callees included)
_SHOWN = ("distributed.step", "buckets.contribute", "wire.run", "vote.decide", "vote.tie_coins_at",
          "wire.vote_tally", "wire.count_votes", "codec.encode", "codec.decode", "buckets.apply_codes",
          "buckets.update_momentum", "buckets.all_finite")


class _Recorder:
    """Wraps torch.distributed's collectives process-wide: issue and completion times of each."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.events, self.t0, self.on = dist, [], 0.0, False
        self._orig = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
        for name, fn in self._orig.items():
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            work = fn(*a, **k)
            if self.on:
                sent = a[1] if name != "all_reduce" and len(a) > 1 else a[0]
                rec = {"op": name, "issue": t - self.t0, "bytes": sent.numel() * sent.element_size(),
                       "thread": "training" if threading.current_thread() is threading.main_thread() else "exchange"}
                self.events.append(rec)
                if work is not None and hasattr(work, "get_future"):
                    work.get_future().then(lambda _f, rec=rec: rec.__setitem__("done", time.perf_counter() - self.t0))
            return work
        return wrapper

    def close(self):
        for name, fn in self._orig.items():
            setattr(self.dist, name, fn)


def _profile_ms(prof, steps: int) -> dict:
    """CPU ms per step inside the library functions of ``_SHOWN`` (cumulative: callees included)."""
    import pstats

    out = {}
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():
        parts = path.replace("\\", "/").split("/")
        key = f"{parts[-1][:-3]}.{func}"
        if len(parts) >= 2 and parts[-2] == "dlion" and key in _SHOWN:
            out[key] = out.get(key, 0.0) + ct * 1e3 / steps
    return {k: out[k] for k in _SHOWN if k in out}


def rank_fn(rank: int, world: int, cfg: dict, emit) -> None:
    import cProfile

    import torch.distributed as dist

    from .e2e.instrument import Instrument
    from .e2e.launch import _load_data, make_batches
    from .e2e.methods import MethodRun, applies_next_step

    torch.set_num_threads(1)
    train_ids, vocab = _load_data(cfg)
    inst = Instrument()
    inst.install()
    rec = _Recorder()
    batches = make_batches(train_ids, cfg, rank)
    try:
        for method in cfg["methods"]:
            run = MethodRun(method, rank, cfg, vocab, inst)
            steps = []
            # delay=1: the exchange runs on into the next step; a barrier or a pause between steps would hide it
            back_to_back = applies_next_step(method)
            for it, (x, y) in enumerate(batches):
                if not back_to_back or it == 0:
                    dist.barrier()
                rec.events, rec.on = [], it >= cfg["warmup"]
                rec.t0 = t0 = time.perf_counter()
                c0, p0 = os.times(), time.process_time()
                run.opt.zero_grad(set_to_none=True)
                _, loss = run.net(x, y)
                t_fwd = time.perf_counter() - t0
                loss.backward()
                t_bwd = time.perf_counter() - t0
                run.opt.step()
                t_step = time.perf_counter() - t0
                p1, c1 = time.process_time(), os.times()
                if not back_to_back:
                    time.sleep(0.02)  # let the completion callbacks of this step land before the next
                if rec.on:
                    steps.append({"t0": t0, "fwd": t_fwd, "bwd_end": t_bwd, "step": t_step, "cpu": p1 - p0,
                                  "sys": c1.system - c0.system, "events": rec.events})
            rec.on = False
            prof = cProfile.Profile(time.thread_time)
            profiled = batches[:cfg["profile_steps"]]
            for x, y in profiled:
                dist.barrier()
                if rank == 0:
                    prof.enable()
                run.opt.zero_grad(set_to_none=True)
                _, loss = run.net(x, y)
                loss.backward()
                run.opt.step()
                if rank == 0:
                    prof.disable()
            result = {"method": method, "rank": rank, "params": run.params, "steps": steps}
            if rank == 0 and profiled:
                import pstats

                total = sum(tt for (_cc, _nc, tt, _ct, _c) in pstats.Stats(prof).stats.values())
                result["training_thread_cpu_ms_per_step"] = total * 1e3 / len(profiled)
                result["library_cpu_ms_per_step"] = _profile_ms(prof, len(profiled))
            emit(result)
            del run
    finally:
        rec.close()
        inst.uninstall()


def summarize(per_rank: list[dict], cores: int) -> dict:
    """One method at one link: means over steps (pooled over ranks where per rank)."""
    steps = list(zip(*[r["steps"] for r in per_rank]))  # step -> per-rank records
    wall = [s["step"] for r in per_rank for s in r["steps"]]
    cpu = [sum(x["cpu"] for x in st) for st in steps]
    # perf_counter is CLOCK_MONOTONIC, one clock for every process of this machine: the span of a
    # step runs from the first rank's zero_grad to the last rank's return from step()
    span = [max(x["t0"] + x["step"] for x in st) - min(x["t0"] for x in st) for st in steps]
    # the tail: from the last rank's end of backward to the last rank's return from step(), what
    # no overlap with backward hid (the slowest rank's last gradients exist only from then on)
    tail = [max(x["t0"] + x["step"] for x in st) - max(x["t0"] + x["bwd_end"] for x in st) for st in steps]
    sys_ = [sum(x["sys"] for x in st) for st in steps]
    firsts = [min(e["issue"] for e in s["events"]) for r in per_rank for s in r["steps"] if s["events"]]
    lasts = [max(e.get("done", e["issue"]) for e in s["events"]) for r in per_rank for s in r["steps"] if s["events"]]
    out = {"step_ms_mean": 1e3 * statistics.mean(wall), "step_ms_median": 1e3 * statistics.median(wall),
           "fwd_bwd_ms_mean": 1e3 * statistics.mean(s["bwd_end"] for r in per_rank for s in r["steps"]),
           "cpu_ms_per_step_all_ranks": 1e3 * statistics.mean(cpu),
           "sys_ms_per_step_all_ranks": 1e3 * statistics.mean(sys_), "cores": cores}
    out["cpu_floor_ms"] = out["cpu_ms_per_step_all_ranks"] / cores
    out["step_over_floor"] = out["step_ms_mean"] / out["cpu_floor_ms"]
    out["span_ms_mean"] = 1e3 * statistics.mean(span)
    out["tail_ms_mean"] = 1e3 * statistics.mean(tail)
    out["cpu_busy"] = statistics.mean(c / (cores * w) for c, w in zip(cpu, span))
    if firsts:
        out["first_issue_ms_mean"] = 1e3 * statistics.mean(firsts)
        out["last_done_ms_mean"] = 1e3 * statistics.mean(lasts)
        out["collectives_per_step"] = len(per_rank[0]["steps"][0]["events"])
        out["bytes_issued_per_step_rank0"] = statistics.mean(sum(e["bytes"] for e in s["events"])
                                                             for s in per_rank[0]["steps"])
    r0 = next((r for r in per_rank if r["rank"] == 0), per_rank[0])
    for k in ("training_thread_cpu_ms_per_step", "library_cpu_ms_per_step"):
        if k in r0:
            out[k] = r0[k]
    return out


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(link, m) for link in doc["links"] for m in doc["methods"]]
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.2 + 0.9 * len(rows)), squeeze=False, sharex=True)
    right = 0.0
    colors = {"all_to_all_single": "tab:blue", "all_gather_into_tensor": "tab:orange",
              "all_gather_single": "tab:orange", "all_reduce": "tab:green"}
    for ax, (link, m) in zip(axes[:, 0], rows):
        r0 = next(r for r in doc["raw"][link][m] if r["rank"] == 0)
        walls = [s["step"] for s in r0["steps"]]
        s = r0["steps"][walls.index(sorted(walls)[len(walls) // 2])]  # rank 0's median step
        ax.barh(0, s["fwd"] * 1e3, color="0.75", label="forward")
        ax.barh(0, (s["bwd_end"] - s["fwd"]) * 1e3, left=s["fwd"] * 1e3, color="0.5", label="backward")
        ax.barh(0, (s["step"] - s["bwd_end"]) * 1e3, left=s["bwd_end"] * 1e3, color="0.25", label="step()")
        for i, e in enumerate(sorted(s["events"], key=lambda e: e["issue"])):
            done = e.get("done", s["step"])
            ax.barh(1 + i, (done - e["issue"]) * 1e3, left=e["issue"] * 1e3, color=colors.get(e["op"], "tab:red"))
        summary = doc["summary"][link][m]
        ax.set_yticks([])
        right = max(right, s["step"] * 1e3, summary["cpu_floor_ms"])
        ax.axvline(summary["cpu_floor_ms"], color="tab:red", ls="--", lw=1)
        ax.set_title(f"{m} @ {link}: step {summary['step_ms_mean']:.0f} ms (mean), CPU floor "
                     f"{summary['cpu_floor_ms']:.0f} ms (dashed)", fontsize=9, loc="left")
    axes[-1, 0].set_xlim(0, right * 1.03)
    axes[-1, 0].set_xlabel("ms since zero_grad (rank 0, its median step); bars above the step: collectives, "
                           "issue → done (blue all-to-all, orange all-gather, green all-reduce)", fontsize=8)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(path: str, out: str) -> None:
    with open(path) as f:
        doc = json.load(f)
    report(doc)
    plot(doc, out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="50mbit,1gbit", help="comma list of link rates (default 50mbit,1gbit)")
    ap.add_argument("--methods", default="compute,g-adamw-powersgd1,d-mavo-1bit-ov-rt,d-mavo-1bit-rt-1b",
                    help="comma list of dlion bench e2e methods")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=5, help="untimed steps under cProfile (rank 0)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--fused", action="store_true", help="every optimizer's fused CPU kernel (as dlion bench e2e --fused)")
    ap.add_argument("--bucket-mb", type=float, default=6.0)
    ap.add_argument("--out", default=os.path.join("runs", "bench-timeline"))
    ap.add_argument("--replot", default=None, metavar="JSON", help="print and redraw a stored timeline.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return env_worker(rank_fn, json.loads(args.worker), timeout_s=900)
    if args.replot:
        os.makedirs(args.out, exist_ok=True)
        replot(args.replot, os.path.join(args.out, "timeline.png"))
        return 0
    from .e2e.methods import is_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if not is_method(m)]
    if unknown:
        ap.error(f"unknown methods {unknown}; see dlion bench e2e --help")
    if args.steps < 1 or args.warmup < 0 or args.workers < 2:
        ap.error("--steps >= 1, --warmup >= 0 and --workers >= 2 needed")
    links = [t.strip() for t in args.link.split(",") if t.strip()]
    cfg = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": max(1, args.n_embd // 64),
           "block_size": args.block_size, "batch_size": args.batch_size, "steps": args.steps,
           "warmup": args.warmup, "bucket_mb": args.bucket_mb, "quant_bits": 8, "lr": 1e-4, "weight_decay": 0.1,
           "seed": 0, "synthetic": False, "ties": "zero", "timeout": 900, "sequential": True, "methods": methods,
           "nodes": None, "per_node": None, "profile_steps": args.profile_steps, "fused": args.fused}
    cmd = [sys.executable, "-m", "dlion", "bench", "timeline", "--worker", json.dumps(cfg)]
    cores = os.cpu_count() or 1
    doc = {"benchmark": "dlion bench timeline", "command": "dlion bench timeline " + " ".join(argv),
           "workers": args.workers, "cores": cores, "links": links, "methods": methods, "config": cfg,
           "raw": {}, "summary": {}}
    t_start = time.time()
    for link, per_rank, results in run_cluster(cmd, args.workers, links, prefix=f"dltl{os.getpid() % 10000}",
                                               timeout=1800):
        code = report_failure(results)
        if code:
            return code
        by_method: dict = {}
        for rank_results in per_rank:
            for d in rank_results:
                by_method.setdefault(d["method"], []).append(d)
        doc["raw"][link] = by_method
        doc["summary"][link] = {m: summarize(by_method[m], cores) for m in methods}
    doc["wall_s"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(doc, f, indent=1)
    report(doc)
    plot(doc, os.path.join(args.out, "timeline.png"))
    print(f"wrote {os.path.join(args.out, 'timeline.json')} and timeline.png ({doc['wall_s']:.0f} s)")
    return 0


def report(doc: dict) -> None:
    print(f"dlion bench timeline: {doc['workers']} ranks on {doc['cores']} shared cores, CharGPT, "
          f"{doc['config']['steps']} measured steps per method")
    head = (f"{'link':<8} {'method':<22} {'step ms':>8} {'CPU ms':>8} {'floor ms':>9} {'step/floor':>10} "
            f"{'span ms':>8} {'CPU busy':>8} {'sys ms':>7} {'1st coll.':>9} {'last done':>9} {'tail ms':>8}")
    print(head)
    print("-" * len(head))
    for link in doc["links"]:
        for m in doc["methods"]:
            s = doc["summary"][link][m]
            first = f"{s['first_issue_ms_mean']:.0f}" if "first_issue_ms_mean" in s else "-"
            last = f"{s['last_done_ms_mean']:.0f}" if "last_done_ms_mean" in s else "-"
            tail = f"{s['tail_ms_mean']:.0f}" if "tail_ms_mean" in s else "-"  # (files written before it)
            print(f"{link:<8} {m:<22} {s['step_ms_mean']:>8.0f} {s['cpu_ms_per_step_all_ranks']:>8.0f} "
                  f"{s['cpu_floor_ms']:>9.0f} {s['step_over_floor']:>10.2f} {s['span_ms_mean']:>8.0f} "
                  f"{100 * s['cpu_busy']:>7.0f}% {s['sys_ms_per_step_all_ranks']:>7.0f} "
                  f"{first:>9} {last:>9} {tail:>8}")
    print("CPU ms: all ranks' process CPU time in a step (every thread); floor: that / cores; span: first rank's "
          "start to last rank's end of a step; CPU busy: CPU ms / (cores × span), the machine's load in the step; "
          "tail: from the last rank's end of backward to the last rank's end of step()")
    link = doc["links"][0]
    for m in doc["methods"]:
        s = doc["summary"][link][m]
        if "training_thread_cpu_ms_per_step" in s:
            lib = s.get("library_cpu_ms_per_step", {})
            top = ", ".join(f"{k} {v:.1f}" for k, v in lib.items())
            print(f"{m} @ {link}, rank 0 training thread: {s['training_thread_cpu_ms_per_step']:.0f} ms CPU per step"
                  + (f"; inside the library (cumulative ms): {top}" if top else ""))
