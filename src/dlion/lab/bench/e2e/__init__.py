"""``dlion bench e2e``: end-to-end time per training step on an emulated slow network.

Every method trains the same workload — a character-level GPT (:class:`dlion.lab.models.CharGPT`)
on Shakespeare, each rank on its own random windows — for ``--warmup`` + ``--steps`` steps,
on ``--workers`` ranks, at each link rate of ``--link``:

references and peers (DistributedDataParallel: bucketed all-reduce overlapped with backward)
  ``compute``              DDP with a no-op hook (no communication) + Lion: the lower bound
  ``sync-only``            DDP whose hook all-reduces one value per bucket: synchronisation without
                           payload, i.e. what ranks waiting for each other costs on this machine
  ``g-adamw``              DDP + torch.optim.AdamW
  ``g-lion``               DDP + dlion.Lion (the reference for speedups)
  ``g-lion-bf16``          DDP with ``bf16_compress_hook`` + Lion
  ``g-{lion,adamw}-powersgd{1,2,4}``  DDP with ``powerSGD_hook`` (that rank, error feedback, warm start)
                           + Lion / AdamW, in one bucket (see docs/benchmarks.md: why not overlapped on Gloo)
ours (dlion.DistributedLion, no DDP)
  ``d-{mavo,avg}-{allgather,1bit,pbit}[-ov]``, ``d-mavo-quant[-ov]``, ``d-mavo-1bit-ov-rt`` and
  ``d-mavo-1bit-ov-pt`` (``comm=`` algorithm; ``quant`` = ``aggregate="quantized"``; ``-ov`` =
  ``overlap=True``; ``-rt`` / ``-pt`` = ``ties="random"`` / ``"previous"``, whatever ``--ties`` says)
  ``h-mavo-1bit``, ``h-mavo-allgather``, ``h-avg-1bit``: dlion.HierarchicalDistributedLion (needs
  ``--nodes K --per-node L``: the nodes vote, gradients are averaged in fp32 inside a node)
talking every H = ``--sync-every`` steps
  ``d-local-mavo``         dlion.LocalDistributedLion (MaVo, 1bit, ``--ties``); ``d-local-mavo-st`` with
                           ``streaming=True`` (round r's vote on the wire during round r+1)
  ``d-local-avg``          the same with ``vote="avg"`` (D-Lion Avg's rule: the sum of the signs back);
                           ``d-local-avg-st`` streamed
  ``diloco-{adamw,lion}[-bf16]``  DiLoCo (dlion.lab.diloco, torchft's update): H inner AdamW (10 × lr, as
                           G-AdamW) or Lion steps, the pseudo-gradients averaged by an fp32 (bf16) all-reduce,
                           ``diloco-adamw-fp8`` / ``-fp4``: by torchft's quantised all-reduce (row-scaled
                           fp8 E4M3, Streaming DiLoCo's fp4 E3M0), outer Nesterov SGD at ``--outer-lr`` (default 0.7); ``diloco-*-st``: Streaming
                           DiLoCo (torchft's): ``--fragments`` P, each fragment's exchange started
                           ``--stream-delay`` τ steps before its round ends (default H/P − 1), mixed back
                           with ``--fragment-alpha`` (default 0)
  any of these + ``-h<K>`` (``d-local-avg-h25``, ``diloco-adamw-bf16-h100``): every K steps instead, so
                           that one run times methods at their own H side by side
  ``--steps`` must be a multiple of H with these: the window (after any ``--warmup``) then holds exactly
  steps/H syncs, since it is ``steps`` consecutive steps and a sync ends every H-th step counted from the
  first. Bytes are those of the window's syncs ÷ ``--steps`` (streaming: from the end of the round in
  flight when the window opens to the end of the last round issued in it).

Groups for ``--methods``: ``all`` (every method but h-* and those talking every H steps), ``baselines``,
``peers``, ``powersgd``, ``dlion``, ``mavo``, ``avg``, ``overlap``, ``hier``, ``nodes`` (compute, G-Lion,
PowerSGD rank 4, flat and hierarchical MaVo), ``local`` (compute, D-Lion MaVo 1bit overlapped with random ties,
G-AdamW PowerSGD rank 4 overlapped, and every method talking every H steps but Streaming DiLoCo).

With ``--nodes K --per-node L`` the virtual cluster groups the ranks into K nodes (``dlion cluster
--nodes``): unshaped links inside a node, each node's uplink shaped to the ``--link`` rate. On rank 0,
each measured step is then followed by a barrier and a reading of the uplinks' tbf counters: the
bytes that really crossed between nodes (both directions, all nodes, TCP/IP headers and that one
barrier included) are reported per method as ``uplink_bytes_per_step``.

A step is timed on every rank as the wall time from ``zero_grad`` through
``optimizer.step()`` (forward, backward and all communication), with no barrier
inside the timed region; the figure reported is the median over all ranks' steps
after the warm-up. All methods are built first and then take turns step by step
(the order rotating every round, an untimed barrier before each step), so that
they all see the same machine load; ``--sequential`` runs them one after another
instead (less memory). After the measured steps, each D-Lion method runs a few
more steps under ``torch.profiler``, and the time inside the library's ranges
(``dlion.contribute``, ``dlion.exchange``, ``dlion.apply``) is reported.

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
import json
import os
import re
import sys
import time
from typing import Optional

from .instrument import Instrument
from .launch import e2e_env_worker, run_e2e_cluster, run_e2e_loopback, make_batches, run_methods
from .methods import (BASELINES, DLION, GROUPS, LABELS, METHODS, POWERSGD_START_ITER, MethodRun,
                      add_local_vote_args, label, methods_from_args, parse_methods, sync_every_of)
from .report import write_report, headline, overlap, overlap_lines, plot, profile_lines, summarize, table

# The package: methods (names, groups, labels, one method on one rank), instrument (byte
# counting of the DDP hooks' traffic), launch (the per-rank loop; loopback and virtual-cluster
# runs), report (summaries, tables, headline, plot, JSON); main() below drives them.

__all__ = ["main", "parse_methods", "label", "METHODS", "BASELINES", "DLION", "GROUPS", "LABELS", "MethodRun",
           "Instrument", "run_methods", "make_batches", "summarize", "table", "headline", "profile_lines", "plot"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dlion bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None, help="ranks (default 4, or --nodes × --per-node)")
    ap.add_argument("--nodes", type=int, default=None,
                    help="group the ranks into this many nodes (virtual cluster: fast links inside a node, "
                         "--link on each node's uplink); needed by the hierarchical methods h-*")
    ap.add_argument("--per-node", type=int, default=None, help="ranks per node (with --nodes)")
    ap.add_argument("--link", default="50mbit,100mbit,300mbit,1gbit",
                    help="link rates to sweep, comma separated (default 50mbit,100mbit,300mbit,1gbit)")
    ap.add_argument("--loopback", action="store_true",
                    help="plain 127.0.0.1, no namespaces, no shaping (no root needed); --link is ignored")
    ap.add_argument("--methods", default="all", help=f"comma list of methods or groups ({', '.join(GROUPS)}); "
                                                       "default all")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per method (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    ap.add_argument("--sync-every", type=int, default=10, metavar="H",
                    help="local steps per sync of d-local-* and diloco-* (default 10; a method named with -h<K>, "
                         "e.g. d-local-avg-h25, syncs every K instead); --steps must be a multiple of each")
    add_local_vote_args(ap)
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD lr (default 0.7)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=None, help="default n_embd/64")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    ap.add_argument("--bucket-mb", type=float, default=6.0,
                    help="bucket cap (MB of fp32 gradients) for DDP and DistributedLion alike (default 6: "
                         "4 buckets for the default model, so that overlap has something to overlap)")
    ap.add_argument("--quant-bits", type=int, default=8, help="field width of d-mavo-quant (default 8)")
    ap.add_argument("--lr", type=float, default=1e-4, help="Lion lr (AdamW gets 10×, its wd /10)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic", action="store_true", help="random tokens instead of Shakespeare")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per link rate (default 1800)")
    ap.add_argument("--prefix", default=None, help="virtual cluster namespace prefix (default dle<pid>)")
    ap.add_argument("--out", default=os.path.join("runs", "bench-e2e"),
                    help="directory for e2e_results.json, e2e_table.txt, e2e_step_time.png (default runs/bench-e2e)")
    ap.add_argument("--ties", default="zero", choices=("zero", "random", "previous"),
                    help="D-Lion tie rule (default zero; random makes MaVo's way back 1 bit for even N)")
    ap.add_argument("--sequential", action="store_true",
                    help="run the methods one after another (less memory) instead of taking turns step by step")
    ap.add_argument("--fused", action="store_true",
                    help="every optimizer's fused CPU kernel: dlion's fused=True (compute, G-Lion, D-Lion, the DDP "
                         "hook) and "
                         "torch.optim.AdamW(fused=True) (G-AdamW and its PowerSGD runs)")
    ap.add_argument("--compute-nice", type=int, default=0, metavar="K",
                    help="run each rank's training thread (forward, backward, optimizer) at nice K (0-19) once "
                         "every method is built, leaving the process groups' communication threads at 0: the "
                         "scheduling of a machine whose compute runs elsewhere (a GPU), for every method alike "
                         "(default 0: off)")
    ap.add_argument("--queue", default="50ms", metavar="TIME",
                    help="every link's tbf queue bound, as time at the link rate (default 50ms). To emulate a host "
                         "K times faster at compute (`dlion bench ttq --compute-speedup K`), run at rates K times "
                         "lower with a queue K times longer, so that it holds as many bytes (packets) as there")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="redraw e2e_step_time.png in --out from an earlier e2e_results.json, without running")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def queue_seconds(text: str):
    """``"50ms"`` → 0.05, ``"0.8s"`` → 0.8; None if it is not such a time."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?)(ms|s)", str(text).strip())
    return None if m is None else float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.worker is not None:
        return e2e_env_worker(json.loads(args.worker))
    if args.replot:
        with open(args.replot) as f:
            doc = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        cfg, n = doc["config"], doc["results"][0]["params"]
        plot(doc["results"], cfg["methods"], os.path.join(args.out, "e2e_step_time.png"),
             f"dlion bench e2e: {doc['workers']} ranks, CharGPT {n / 1e6:.1f} M params, batch "
             f"{cfg['batch_size']}×{cfg['block_size']}/rank, {doc['machine']['cpu_count']} shared CPU cores"
             + (f", {cfg['nodes']} nodes × {cfg['per_node']}" if cfg.get("nodes") else ""), nodes=bool(cfg.get("nodes")))
        print(f"wrote {os.path.join(args.out, 'e2e_step_time.png')}")
        for link in dict.fromkeys(r["link"] for r in doc["results"]):  # what overlap hid, from the stored rows
            rows = {r["method"]: r for r in doc["results"] if r["link"] == link}
            lines = overlap_lines(overlap(rows, rows[next(iter(rows))]["rate_bps"]))
            if lines:
                print(f"link {link}: overlap with backward (step − compute-only = communication left exposed):")
                print("\n".join(lines))
        return 0
    from dlion.lab.cluster import resolve_workers

    args.workers = resolve_workers(ap, args, default=4, minimum=2)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if queue_seconds(args.queue) is None:
        ap.error(f"--queue {args.queue!r}: give a time such as 50ms or 0.8s")
    if not 0 <= args.compute_nice <= 19:
        ap.error(f"--compute-nice must be in 0..19, got {args.compute_nice}")
    methods = methods_from_args(ap, args)
    for m in methods:
        h = sync_every_of(m, args.sync_every)
        if h is not None and args.steps % h:
            ap.error(f"--steps {args.steps} is not a multiple of {m}'s H = {h}: it syncs every H steps, and the "
                     "measured window must hold whole rounds (steps/H syncs)")
    if any(m.startswith("h-") for m in methods) and args.nodes is None:
        ap.error("the hierarchical methods (h-*) need --nodes K --per-node L")
    if any("powersgd" in m for m in methods) and args.warmup < POWERSGD_START_ITER:
        print(f"note: PowerSGD compresses from step {POWERSGD_START_ITER + 1}; with --warmup {args.warmup} "
              "some measured steps of the PowerSGD methods are uncompressed", file=sys.stderr)
    rounds = args.warmup + args.steps
    n_head = args.n_head or max(1, args.n_embd // 64)
    if args.n_embd % n_head:
        ap.error(f"--n-head {n_head} must divide --n-embd {args.n_embd}")
    cfg = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": n_head, "block_size": args.block_size,
           "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup, "bucket_mb": args.bucket_mb,
           "quant_bits": args.quant_bits, "lr": args.lr,
           "weight_decay": args.weight_decay, "seed": args.seed, "synthetic": args.synthetic,
           "ties": args.ties, "timeout": args.timeout, "sequential": args.sequential, "methods": methods,
           "nodes": args.nodes, "per_node": args.per_node, "fused": args.fused, "compute_nice": args.compute_nice,
           "queue": args.queue, "sync_every": args.sync_every, "outer_lr": args.outer_lr,
           "abstain_below": args.abstain_below, "outer_scale": args.outer_scale,
           "reset_momentum": args.reset_momentum, "stream_delay": args.stream_delay, "fragments": args.fragments,
           "fragment_alpha": args.fragment_alpha}
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
            failed = run_e2e_loopback(args, cfg, raw, bar)
        else:
            failed = run_e2e_cluster(args, cfg, links, raw, bar)
    finally:
        if bar is not None:
            bar.close()
    return write_report(args, cfg, methods, links, raw, failed, time.time() - t_start, argv)
