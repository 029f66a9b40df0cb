"""``dlion bench comm``: each collective algorithm against an fp32 all-reduce of the
same parameters, on N local Gloo ranks (loopback, no shaping).

For every algorithm (``allgather``, ``1bit``, ``pbit``) and rule (``mavo``,
``avg``) it runs the aggregation of one flat buffer of ``--params`` random signs
``--steps`` times and prints the median time per step and the bytes per
parameter per rank counted by ``CommStats`` (sent; received is the same; the
headers included), next to the formula (1 + b)(N−1)/N bits of the reduce-scatter
pattern.
Loopback on a 2-core machine is CPU-bound: compare rows of one run as ratios.

``--models`` instead trains a new user's fine-tuning models with
``DistributedLion(comm="1bit")`` — a frozen backbone, a trainable head, a layer
with no gradient on any rank or on even ranks only — and prints the bytes a rank
sends per step against the bound over the coordinates some rank votes on.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist

from dlion.vote import VoteRule
from dlion.wire import ALGORITHMS, Contribution, WireState, make_algorithm, padded_length
from dlion.collectives import CommStats, GroupTransport
from dlion.pipeline import Flight
from dlion.lab.bench.codec import parse_count
from dlion.lab.spawn import spawn


def _worker(rank: int, world: int, n: int, steps: int, rules: list) -> list[dict]:
    g = torch.Generator().manual_seed(rank)
    delta = (torch.randint(0, 2, (n,), generator=g, dtype=torch.int8) * 2 - 1)
    rows = []

    def measure(fn) -> float:
        fn()
        times = []
        for _ in range(steps):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    flat = torch.randn(n, generator=g)
    t = measure(lambda: dist.all_reduce(flat))
    rows.append(dict(method="fp32 all_reduce", vote="-", seconds=t, bytes=4 * n * 2 * (world - 1) / world))
    contrib = Contribution(delta, n, torch.ones(1, dtype=torch.bool))
    for vote in rules:
        rule = VoteRule(vote, world)
        for name in ALGORITHMS:
            stats = CommStats()
            transport = GroupTransport(None, stats)
            alg = make_algorithm(name, rule)
            state = WireState(up="narrow" if name == "pbit" else "runs")

            def once():
                Flight(alg.run(state, contrib, rank, 0), transport).advance(transport, block=True)

            t = measure(once)
            calls = steps + 1  # measure() makes one warm-up call
            rows.append(dict(method=name, vote=vote, seconds=t, bytes=stats.bytes_sent / calls,
                             b=rule.result_bits(False)))
    return rows


#: the new user's fine-tuning models: which parts exist and which have gradients
SCENARIOS = {
    "head only": dict(backbone=False, extra=None),
    "frozen backbone + head": dict(backbone=True, extra=None),
    "+ unused layer (no grad anywhere)": dict(backbone=True, extra="none"),
    "+ layer with grads on even ranks": dict(backbone=True, extra="even"),
}


def _model_worker(rank: int, world: int, steps: int, rules: list, out: int) -> list[dict]:
    """Bytes per step of DistributedLion(comm="1bit") on a frozen 1000×1000 backbone, a
    1000→``out`` head and an ``out``→``out`` layer that has no gradient anywhere or on even ranks only."""
    import dlion

    rows = []
    for name, sc in SCENARIOS.items():
        for vote, ties in rules:
            torch.manual_seed(0)
            backbone, head, extra = torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, out), torch.nn.Linear(out, out)
            backbone.requires_grad_(False)
            mods = ([backbone] if sc["backbone"] else []) + [head] + ([extra] if sc["extra"] else [])
            opt = dlion.DistributedLion([(f"{i}.{n}", p) for i, m in enumerate(mods) for n, p in m.named_parameters()],
                                        lr=1e-3, vote=vote, ties=ties,
                                        comm="1bit")
            g = torch.Generator().manual_seed(rank)
            sent = []
            for _ in range(steps):
                x = torch.randn(8, 1000, generator=g)
                y = head(backbone(x) if sc["backbone"] else x)
                if sc["extra"] == "even" and rank % 2 == 0:
                    y = y + extra(y)
                before = opt.comm_stats.bytes_sent
                opt.zero_grad()
                y.pow(2).mean().backward()
                opt.step()
                sent.append(opt.comm_stats.bytes_sent - before)
            # (values, how many ranks vote on them) of the parts some rank has a gradient for
            parts = [(sum(p.numel() for p in head.parameters()), world)]
            if sc["extra"] == "even":
                parts.append((sum(p.numel() for p in extra.parameters()), (world + 1) // 2))
            rows.append(dict(scenario=name, vote=vote if ties == "zero" else f"{vote}, {ties} ties",
                             trainable=opt.num_params, voted=sum(n for n, _ in parts),
                             bound_bits=sum(n * (1 + _back_bits(vote, ties, v, world)) for n, v in parts),
                             first=sent[0], steady=statistics.median(sent[2:]),
                             buckets=len(opt.buckets)))
    return rows


def _back_bits(vote: str, ties: str, v: int, world: int) -> float:
    """Bits per coordinate of the codes' way back when v ranks vote on it: the width of the
    result — ⌈log2(N+1)⌉ for Avg, 1 bit for MaVo unless a tie can give 0 (v even, ties="zero")."""
    if vote == "avg":
        return math.ceil(math.log2(world + 1))
    return 1.0 if (ties == "random" or v % 2 == 1) else 1.6


def model_main(worlds: list[int], steps: int, out: int, doc: dict) -> None:
    for world in worlds:
        rows = spawn(_model_worker, world, steps, [("mavo", "zero"), ("mavo", "random"), ("avg", "zero")], out,
                     timeout_s=600)[0]
        doc["models"].append({"workers": world, "rows": rows})
        print(f"\ndlion bench comm --models --head {out}: N={world} ranks, DistributedLion(comm='1bit'), bytes one rank sends "
              f"per step (median of steps 3-{steps}; step 1 in brackets); bound = (1+b)(N-1)/N bits per coordinate "
              "some rank has a gradient for, b the width of its result (1, 1.6 where a tie can give 0, "
              "log2(N+1) for avg); excess B: the rest")
        print(f"{'model':<36} {'vote':<19} {'trainable':>9} {'voted':>7} {'bytes':>8} {'(step 1)':>10} {'bound':>8} "
              f"{'ratio':>6} {'excess B':>8}")
        for r in rows:
            bound = r["bound_bits"] * (world - 1) / world / 8
            print(f"{r['scenario']:<36} {r['vote']:<19} {r['trainable']:>9,} {r['voted']:>7,} {r['steady']:>8.0f} "
                  f"{'(' + format(r['first'], '.0f') + ')':>10} {bound:>8.0f} {r['steady'] / bound:>6.3f} "
                  f"{r['steady'] - bound:>8.0f}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench comm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="4", help="world sizes, comma separated (default 4; e.g. 3,4)")
    ap.add_argument("--params", type=parse_count, default=parse_count("16M"), help="coordinates (default 16M)")
    ap.add_argument("--steps", type=int, default=5, help="timed repetitions per row (median)")
    ap.add_argument("--json", default=None, help="also write every row to this JSON file")
    ap.add_argument("--models", action="store_true",
                    help="instead: bytes per step of DistributedLion on small fine-tuning models (frozen backbone, "
                         "a layer with no gradient anywhere or on some ranks only) against the bound")
    ap.add_argument("--head", type=int, default=10,
                    help="--models: outputs of the trainable head (1000 x HEAD values) and of the extra layer")
    args = ap.parse_args(argv)
    try:
        worlds = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if any(w < 2 for w in worlds):
        ap.error("--workers: every world size must be >= 2")
    if args.models:
        doc = {"benchmark": "dlion bench comm --models", "steps": args.steps, "head": args.head, "models": []}
        if args.steps < 4:
            ap.error("--models needs --steps >= 4 (the first steps learn which parameters have gradients)")
        model_main(worlds, args.steps, args.head, doc)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        return 0
    doc = {"benchmark": "dlion bench comm", "params": args.params, "steps": args.steps, "runs": []}
    for world in worlds:
        n = padded_length(args.params, world)
        rows = spawn(_worker, world, n, args.steps, ["mavo", "avg"], timeout_s=600)[0]
        doc["runs"].append({"workers": world, "params": n, "rows": rows})
        base = rows[0]["seconds"]
        print(f"\ndlion bench comm: N={world} ranks (Gloo, loopback), {n:,} parameters, median of {args.steps}")
        print(f"{'algorithm':<16} {'vote':<5} {'ms/step':>9} {'vs fp32':>8} {'bits/param/rank':>16} "
              f"{'(1+b)(N-1)/N':>13} {'ratio':>6}")
        for r in rows:
            bits = 8 * r["bytes"] / n
            formula = (1 + r["b"]) * (world - 1) / world if "b" in r else None
            ratio = f"{bits / formula:>6.3f}" if formula and r["method"] == "1bit" else f"{'':>6}"
            print(f"{r['method']:<16} {r['vote']:<5} {r['seconds'] * 1e3:>9.2f} {r['seconds'] / base:>8.3f} "
                  f"{bits:>16.3f} {formula if formula is not None else float('nan'):>13.3f} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
