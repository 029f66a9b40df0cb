"""Byzantine workers: majority vote vs averaging when k of N workers send corrupted signs.

Real Gloo workers (``dlion.lab.spawn``, one process per worker) train a small MLP
(64-32-10) on scikit-learn's 8x8 digits with :class:`dlion.DistributedLion`.
Workers 0..k-1 are faulty: their sign hook (:mod:`dlion.lab.faults`) replaces the
signs they send — ``sign_flip`` sends −δ, ``random_signs`` sends random ±1.
Every worker still applies the aggregated Δ, so all replicas stay identical
(checked every 50 steps). We record the test accuracy of the shared model.

    python benchmarks/byzantine.py --out docs/figures/byzantine.png

Prints a table of final accuracies (mean and range over seeds) and writes a
two-panel figure: final accuracy vs k, and accuracy vs step at one k.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch._dynamo  # noqa: F401  imported once here instead of in every forked worker
from torch import nn

import dlion
from dlion.lab import faults
from dlion.lab.data import load_digits_split
from dlion.lab.spawn import spawn


def worker(rank, world, data, configs, steps, eval_every, lr, batch):
    xtr, ytr, xte, yte = data
    xtr, xte = xtr.flatten(1), xte.flatten(1)
    results = []
    for cfg in configs:
        torch.manual_seed(cfg["seed"])
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        hook = None
        if rank < cfg["k"]:
            hook = faults.random_signs(seed=1000 * cfg["seed"] + rank) if cfg["fault"] == "random_signs" \
                else faults.make(cfg["fault"])
        opt = dlion.DistributedLion(model.named_parameters(), lr=lr, vote=cfg["vote"], sign_hook=hook, check_every=50)
        g = torch.Generator().manual_seed(10_000 * cfg["seed"] + rank)
        curve = []
        for t in range(1, steps + 1):
            idx = torch.randint(0, len(xtr), (batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            if rank == 0 and (t % eval_every == 0 or t == steps):
                with torch.no_grad():
                    curve.append((t, (model(xte).argmax(1) == yte).float().mean().item()))
        results.append(curve)
    return results if rank == 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/figures/byzantine.png")
    ap.add_argument("--json", default=None, help="also write the raw curves here")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--faulty", default="0,1,2,3,4", help="values of k")
    ap.add_argument("--faults", default="sign_flip,random_signs")
    ap.add_argument("--votes", default="mavo,avg")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--curve-k", type=int, default=3, help="k whose accuracy-vs-step curves are plotted")
    args = ap.parse_args(argv)

    ks = [int(k) for k in args.faulty.split(",")]
    if max(ks) >= args.workers:
        ap.error("every k must be < --workers")
    configs = [dict(vote=v, fault=f, k=k, seed=s) for f in args.faults.split(",") for v in args.votes.split(",")
               for k in ks for s in range(args.seeds)]
    t0 = time.time()
    curves = spawn(worker, args.workers, load_digits_split(), configs, args.steps, args.eval_every, args.lr,
                   args.batch, timeout_s=600)[0]
    elapsed = time.time() - t0
    print(f"{len(configs)} runs x {args.steps} steps on {args.workers} Gloo workers in {elapsed:.0f} s "
          f"(lr {args.lr}, local batch {args.batch}, MLP 64-32-10, digits)")

    table: dict = {}
    for cfg, curve in zip(configs, curves):
        table.setdefault((cfg["fault"], cfg["vote"], cfg["k"]), []).append(curve)
    print(f"\nfinal test accuracy, mean [min, max] over {args.seeds} seeds, N = {args.workers}")
    print(f"{'fault':<13} {'vote':<5} " + " ".join(f"{'k=' + str(k):>19}" for k in ks))
    for fault in args.faults.split(","):
        for vote in args.votes.split(","):
            cells = []
            for k in ks:
                finals = [c[-1][1] for c in table[(fault, vote, k)]]
                cells.append(f"{sum(finals) / len(finals):.3f} [{min(finals):.3f},{max(finals):.3f}]")
            print(f"{fault:<13} {vote:<5} " + " ".join(f"{c:>19}" for c in cells))

    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(cfg, curve=c) for cfg, c in zip(configs, curves)], f)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"mavo": "tab:blue", "avg": "tab:orange"}
    styles = {"sign_flip": "-", "random_signs": "--", "stuck_at_zero": ":"}
    for fault in args.faults.split(","):
        for vote in args.votes.split(","):
            finals = [[c[-1][1] for c in table[(fault, vote, k)]] for k in ks]
            mean = [sum(f) / len(f) for f in finals]
            lo = [m - min(f) for m, f in zip(mean, finals)]
            hi = [max(f) - m for m, f in zip(mean, finals)]
            ax1.errorbar(ks, mean, yerr=[lo, hi], color=colors.get(vote), ls=styles.get(fault, "-"), marker="o",
                         capsize=3, label=f"{'MaVo' if vote == 'mavo' else 'Avg'}, {fault}")
    ax1.axhline(0.1, color="grey", lw=0.8, ls=":")
    ax1.set_xlabel(f"faulty workers k (of N = {args.workers})")
    ax1.set_ylabel(f"test accuracy after {args.steps} steps")
    ax1.set_xticks(ks)
    ax1.set_ylim(0, 1)
    ax1.set_title("final accuracy (mean, range over seeds)")
    ax1.legend(fontsize=8, loc="lower left")
    fault0 = args.faults.split(",")[0]
    for vote in args.votes.split(","):
        for k, alpha in ((0, 0.45), (args.curve_k, 1.0)):
            if (fault0, vote, k) not in table:
                continue
            runs = table[(fault0, vote, k)]
            steps = [t for t, _ in runs[0]]
            mean = [sum(r[i][1] for r in runs) / len(runs) for i in range(len(steps))]
            ax2.plot(steps, mean, color=colors.get(vote), alpha=alpha, ls="-" if k else "--",
                     label=f"{'MaVo' if vote == 'mavo' else 'Avg'}, k={k}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("test accuracy (mean over seeds)")
    ax2.set_ylim(0, 1)
    ax2.set_title(f"{fault0}: k = 0 vs k = {args.curve_k} of {args.workers}")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle("D-Lion with Byzantine workers (Gloo, digits MLP)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
