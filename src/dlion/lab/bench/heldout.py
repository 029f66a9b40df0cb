"""The held-out rule for the time-to-quality settings, applied to ``dlion bench ttq`` runs.

Fixed before its runs (docs/benchmarks.md, "How the settings were chosen"): seed 100 only, never
an evaluation seed; the 30 % warm-up for every method; Lion lr in {1e-4, 2e-4, 3e-4} (AdamW at
10×); per method the lr with the fewest steps to the target loss, ties and misses broken by the
lowest validation loss. Reads ``DIR/lr{LR}-seed100/ttq_results.json`` and writes
``tune_seed100.json`` and ``tune_seed100.txt`` into DIR::

    python -m dlion.lab.bench.heldout docs/results/ttq-heldout
"""

from __future__ import annotations

import argparse
import json
import os

GRID = ("1e-4", "2e-4", "3e-4")
SEED = 100


def rows_of(root: str, target: float) -> list:
    """One row per (method, lr) run found under ``root``."""
    rows = []
    for lr in GRID:
        f = os.path.join(root, f"lr{lr}-seed{SEED}", "ttq_results.json")
        if not os.path.exists(f):
            continue
        with open(f) as fh:
            curves = json.load(fh)["curves"]
        for method, curve in curves.items():
            rows.append({"method": method, "lr": float(lr),
                         "steps_to_target": next((s for s, v in curve if v <= target), None),
                         "best_loss": min(v for _, v in curve), "final_loss": curve[-1][1],
                         "file": f"lr{lr}-seed{SEED}/ttq_results.json"})
    return rows


def choose(rows: list) -> dict:
    """Per method, the lr of the rule: fewest steps to the target; ties and misses by the lowest loss."""
    def rank(r):
        return (r["steps_to_target"] is None, r["steps_to_target"] or 0, r["best_loss"])

    return {m: min((r for r in rows if r["method"] == m), key=rank)["lr"] for m in sorted({r["method"] for r in rows})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlion.lab.bench.heldout", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--target", type=float, default=2.1)
    args = ap.parse_args(argv)
    rows = rows_of(args.dir, args.target)
    if not rows:
        ap.error(f"no lr{{{','.join(GRID)}}}-seed{SEED}/ttq_results.json under {args.dir}")
    chosen = choose(rows)
    doc = {"rule": "seed 100 only; warm-up 30 % for all; Lion lr in {1e-4, 2e-4, 3e-4} (AdamW 10x); per method "
                   "the lr with the fewest steps to the target, ties and misses broken by the lowest validation loss",
           "target": args.target, "rows": rows, "chosen_lion_lr": chosen}
    lines = [f"held-out rule, seed {SEED}, 30 % warm-up, target {args.target} (steps: first evaluation at or below "
             "it); lr is Lion's (AdamW runs at 10x)",
             f"{'method':24s} {'lr':>7s} {'steps to target':>16s} {'best loss':>10s} {'final':>8s}"]
    for r in sorted(rows, key=lambda r: (r["method"], r["lr"])):
        mark = "  <- chosen" if chosen[r["method"]] == r["lr"] else ""
        lines.append(f"{r['method']:24s} {r['lr']:7.0e} {str(r['steps_to_target'] or 'never'):>16s} "
                     f"{r['best_loss']:10.4f} {r['final_loss']:8.4f}{mark}")
    with open(os.path.join(args.dir, "tune_seed100.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(args.dir, "tune_seed100.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
