"""The held-out rule for the time-to-quality settings, applied to ``dlion bench ttq`` runs.

Fixed before its runs (docs/benchmarks.md, "How the settings were chosen"), in two stages, on
seed 100 only (never an evaluation seed):

1. **lr**: with the 30 % warm-up, Lion lr in {1e-4, 2e-4, 3e-4} (AdamW at 10×); per method the lr
   with the fewest steps to the target loss, ties and misses broken by the lowest validation loss.
2. **warm-up**: each method at its stage-1 lr also with a 10 % warm-up; 30 % is kept unless 10 %
   wins by the same ranking.
3. **abstain_below** (fixed 2026-11-27 before its runs; the local vote only): the ``d-local-*``
   method at its stage-1/2 lr and warm-up also with ``--abstain-below`` τ in {0.25, 0.5, 1}; τ = 0
   is kept unless a τ ranks better by the same ranking (the lowest-ranked τ wins).
4. **the grid's edges** (part 9, fixed 2026-11-28 before its runs; applied after stage 2): a method whose
   choice lies at an edge of the grid is run one lr further past it (5e-5 below, 4e-4 then 6e-4 above), at
   its chosen warm-up, as long as the new point wins; any run at the chosen warm-up with an lr off the grid
   is such a point, and the best of them replaces the choice if it ranks better.

Stages 1, 2 and 4 count only runs without abstentions, so a stage-3 run never moves an lr or warm-up.

Reads every ``DIR/*/ttq_results.json`` whose config has seed 100 (its lr, warm-up and method names
from the file itself; a method that talks every H steps run at another H than the default 10 is a
method of its own, ``NAME H=50``, and so is the local vote at another ``--outer-scale``, ``NAME H=50 α=0.67``,
and with ``--reset-momentum``, ``NAME H=50 α=0.83 reset``; streamed, with ``--stream-delay`` or ``--fragments``,
``NAME … τ=11`` or ``NAME … P=3``; DiLoCo at another ``--outer-lr`` than 0.7, ``NAME H=100 outer_lr=1``, and
Streaming DiLoCo with its ``--fragment-alpha``, ``NAME … τ=5 α=0.5``) and writes ``tune_seed100.json`` and
``tune_seed100.txt`` into DIR::

    python -m dlion.lab.bench.heldout docs/results/ttq-heldout
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

GRID = (1e-4, 2e-4, 3e-4)
DEFAULT_H = 10  # dlion bench ttq's --sync-every
LOCAL_PREFIXES = ("d-local-", "diloco-")
ABSTAIN_GRID = (0.25, 0.5, 1.0)
WARMUP, WARMUP_ALT = 0.3, 0.1
SEED = 100
OUTER_LR = 0.7  # dlion bench ttq's --outer-lr (DiLoCo's published value)


def _lr(x: float) -> str:
    """3e-04, but 1.5e-03 where one digit would print another lr."""
    return f"{x:.0e}" if float(f"{x:.0e}") == x else f"{x:.1e}"


def rows_of(root: str, target: float) -> list:
    """One row per (method, lr, warm-up) run of seed 100 found under ``root``."""
    from .e2e.methods import split_sync_every

    rows = []
    for f in sorted(glob.glob(os.path.join(root, "*", "ttq_results.json"))):
        with open(f) as fh:
            doc = json.load(fh)
        cfg = doc.get("config", {})
        if cfg.get("seed") != SEED:
            continue
        for method, curve in doc["curves"].items():
            method, own_h = split_sync_every(method)
            h = own_h or int(cfg.get("sync_every", DEFAULT_H))
            if method.startswith(LOCAL_PREFIXES) and h != DEFAULT_H:
                method = f"{method} H={h}"
            if method.startswith("d-local-") and float(cfg.get("outer_scale", 1.0)) != 1.0:
                method = f"{method} α={float(cfg['outer_scale']):g}"
            if method.startswith("d-local-") and cfg.get("reset_momentum"):
                method = f"{method} reset"
            if method.startswith("diloco-") and float(cfg.get("outer_lr", OUTER_LR)) != OUTER_LR:
                method = f"{method} outer_lr={float(cfg['outer_lr']):g}"
            if method.startswith(LOCAL_PREFIXES) and method.split()[0].endswith("-st"):  # (when the vote is applied)
                if cfg.get("stream_delay") is not None:
                    method = f"{method} τ={int(cfg['stream_delay'])}"
                if int(cfg.get("fragments", 1)) > 1:
                    method = f"{method} P={int(cfg['fragments'])}"
                if method.startswith("diloco-"):  # (Streaming DiLoCo's mixing of the outer result)
                    method = f"{method} α={float(cfg.get('fragment_alpha', 0.0)):g}"
            rows.append({"method": method, "lr": float(cfg["lr"]), "warmup": float(cfg["warmup_frac"]),
                         "abstain_below": float(cfg.get("abstain_below", 0.0)),
                         "steps_to_target": next((s for s, v in curve if v <= target), None),
                         "best_loss": min(v for _, v in curve), "final_loss": curve[-1][1],
                         "file": os.path.relpath(f, root)})
    return rows


def _rank(r):
    return (r["steps_to_target"] is None, r["steps_to_target"] or 0, r["best_loss"])


def _outer_base(method: str) -> str:
    """DiLoCo's label without its outer lr and α (the vote's α is its outer scale, a method of its own)."""
    return re.sub(r" (outer_lr|α)=\S+", "", method) if method.startswith("diloco-") else method


def choose(rows: list) -> dict:
    """Per method, ``{"lr": …, "warmup": …}`` by the rule: stage 1 picks the lr among the 30 %
    warm-up runs on the grid, stage 2 keeps 30 % unless the 10 % run at that lr ranks better. The
    ranking: fewest steps to the target; a miss loses to any hit; ties and misses by the lowest loss.
    Stage 4 (part 9, after stage 2): the best run at the chosen warm-up with an lr off the grid (one past
    its edge) replaces the choice if it ranks better (``beyond_grid``: those lrs). Stage 3, for
    ``d-local-*`` only: τ = 0 unless a run at the chosen lr and warm-up with ``abstain_below`` τ on its
    grid ranks better. DiLoCo's outer lr (parts 10 and 11) and Streaming DiLoCo's α (part 13): of the labels that
    differ only in those, only the one whose choice ranks best has ``best_outer`` (the others are not marked)."""
    out = {}
    plain = [r for r in rows if r["abstain_below"] == 0.0]
    for m in sorted({r["method"] for r in plain}):
        grid = [r for r in plain if r["method"] == m and r["warmup"] == WARMUP and r["lr"] in GRID]
        if not grid:
            continue
        best = min(grid, key=_rank)
        alt = [r for r in plain if r["method"] == m and r["warmup"] == WARMUP_ALT and r["lr"] == best["lr"]]
        if alt and _rank(alt[0]) < _rank(best):
            best = alt[0]
        beyond = [r for r in plain if r["method"] == m and r["warmup"] == best["warmup"] and r["lr"] not in GRID]
        top = min(beyond, key=_rank, default=None)
        if top is not None and _rank(top) < _rank(best):
            best = top
        out[m] = {"lr": best["lr"], "warmup": best["warmup"], "warmup_searched": bool(alt),
                  "beyond_grid": sorted(r["lr"] for r in beyond)}
        if m.startswith("d-local"):
            taus = [r for r in rows if r["method"] == m and r["abstain_below"] in ABSTAIN_GRID
                    and (r["lr"], r["warmup"]) == (best["lr"], best["warmup"])]
            top = min(taus, key=_rank, default=None)
            take = top is not None and _rank(top) < _rank(best)
            out[m].update(abstain_below=top["abstain_below"] if take else 0.0, abstain_searched=len(taus))
    # DiLoCo's outer lr (parts 10, 11) and Streaming DiLoCo's α (part 13): of the labels that differ only in
    # those, the one whose choice ranks best
    best_of = {}
    for m, c in out.items():
        row = next(r for r in plain if (r["method"], r["lr"], r["warmup"]) == (m, c["lr"], c["warmup"]))
        if _outer_base(m) not in best_of or _rank(row) < best_of[_outer_base(m)][1]:
            best_of[_outer_base(m)] = (m, _rank(row))
    for m, c in out.items():
        c["best_outer"] = best_of[_outer_base(m)][0] == m
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlion.lab.bench.heldout", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--target", type=float, default=2.1)
    args = ap.parse_args(argv)
    rows = rows_of(args.dir, args.target)
    if not rows:
        ap.error(f"no */ttq_results.json of seed {SEED} under {args.dir}")
    chosen = choose(rows)
    doc = {"rule": "seed 100 only; stage 1: warm-up 30 %, Lion lr in {1e-4, 2e-4, 3e-4} (AdamW 10x), per method the "
                   "lr with the fewest steps to the target, ties and misses broken by the lowest validation loss; "
                   "stage 2: the chosen lr with a 10 % warm-up, kept only if it ranks better; "
                   "stage 4 (after 2): an lr past the grid's edge at the chosen warm-up, taken if it ranks better; "
                   "DiLoCo's outer lr and alpha (parts 10, 11, 13): of the choices at each, the best ranked is marked; "
                   "stage 3 (d-local-* only): the chosen lr and warm-up with abstain_below in {0.25, 0.5, 1}, "
                   "taken only if it ranks better than 0",
           "target": args.target, "rows": rows, "chosen": chosen}
    lines = [f"held-out rule, seed {SEED}, target {args.target} (steps: first evaluation at or below it); "
             "lr is Lion's (AdamW runs at 10x)",
             f"{'method':24s} {'lr':>7s} {'warm-up':>8s} {'abstain':>8s} {'steps to target':>16s} {'best loss':>10s} "
             f"{'final':>8s}  run"]
    for r in sorted(rows, key=lambda r: (r["method"], -r["warmup"], r["lr"], r["abstain_below"])):
        c = chosen.get(r["method"], {})
        mark = "  <- chosen" if (c.get("lr"), c.get("warmup"), c.get("abstain_below", 0.0)) == (
            r["lr"], r["warmup"], r["abstain_below"]) and c["best_outer"] else ""
        lines.append(f"{r['method']:24s} {_lr(r['lr']):>7s} {r['warmup']:8.2f} {r['abstain_below']:8.2f} "
                     f"{str(r['steps_to_target'] or 'never'):>16s} {r['best_loss']:10.4f} {r['final_loss']:8.4f}"
                     f"  {os.path.dirname(r['file'])}{mark}")  # (the folder tells apart runs of one config)
    unsearched = [m for m, c in chosen.items() if not c["warmup_searched"]]
    if unsearched:
        lines.append(f"warm-up not searched yet (no 10 % run at the chosen lr): {', '.join(unsearched)}")
    unmarked = sorted({r["method"] for r in rows} - set(chosen))
    if unmarked:
        lines.append("no 30 % warm-up run on the lr grid, so no mark (a later rule part, rule_part*.txt, chose among "
                     f"them): {', '.join(unmarked)}")
    with open(os.path.join(args.dir, "tune_seed100.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(args.dir, "tune_seed100.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
