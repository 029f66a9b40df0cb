"""Final validation loss against bits sent, for the methods that talk every H steps.

    python -m dlion.lab.experiments.local_plot docs/results/charlm/runs.jsonl \\
        docs/results/charlm-local/runs.jsonl --out docs/results/charlm-local

Reads any number of ``runs.jsonl`` files (re-run it as more runs finish) and writes to
``--out``:

``final_vs_bits.png``  final validation loss (median over seeds, min–max bar where there are
                       several) against the bits one rank sends per parameter per step (log x),
                       two panels: left, only the settings run on three seeds or more (the
                       evidence); right, every setting run (one seed where there is no bar);
                       every local-step method (base and options) one curve over H, each point
                       marked with its H; the every-step methods (``--points``) as single points;
                       a dotted line at G-Lion's median + 1 %. On the right, a variant of a
                       local-step method run at one H only on fewer than three seeds (an
                       experiment) is left out unless ``--all-variants`` (it stays in the summary);
``final_vs_bits_main.png``  one panel for the README: the every-step points, the majority vote's
                       and the defaults' rule's curves over H (``MAIN_LINES``) and DiLoCo's,
                       every seed count (no bar: one seed), the defaults' point named; and, one
                       curve each, the defaults' rule and DiLoCo with AdamW at the settings a
                       held-out seed chose for each H (``HELD_OUT_PICKS``);
``summary.csv`` / ``summary.json``  one row per method spec: seeds, median / min / max / mean of
                       the final metric, bits, H, lr, weight decay, seconds per run.

Runs are filtered to one task, N (``--workers``) and step budget (``--steps``), tuning runs
left out; where one spec ran with several learning rates, each (spec, lr, wd) is its own row
(and the label says the lr); a local-step method's label also says its lr where it differs
from the lr of its every-step twin among the runs (``runner.twin``: G-Lion for the local vote,
G-AdamW for the vote with AdamW inside).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from collections import defaultdict

import numpy as np

from .plots import COLORS, MARKERS, _line, _ordered
from .runner import LOCAL_METHODS, canonical, common_bits, label, load_runs, local_options, parse_method, twin

__all__ = ["main", "summary_rows", "drawn_lines", "main_lines", "line_points"]

EVERY_STEP = ("glion", "dlion_mavo", "gadamw", "powersgd_adamw:4")
#: LocalDistributedLion's defaults since 0.3: the Avg vote, outer scale 0.83, the momenta reset, lr 3e-4, H = 32
DEFAULTS = ("dlocal_mavo:alpha=0.83:vote=avg:mr=1", 3e-4, 32)
#: the settings a held-out seed (100) chose at each H, one curve each in the README panel: the curve's line
#: (its colour, marker and name) -> {spec: lr}. The rules: docs/results/charlm-local-heldout/rule_*.txt; the runs:
#: docs/results.md, "The defaults' lr on a held-out seed", "Shorter rounds at a higher lr", "H = 16", "DiLoCo's lrs on a
#: held-out seed", "Between 0.75 and 4.8 bits", "Long rounds". DiLoCo's curve joins the pick at each H searched
#: (fp32 at H = 10, bf16 at H = 10, 25, 32, 50, 100, 250 and 500), also where a pick did worse on the evaluation seeds
#: (H = 250).
HELD_OUT_PICKS = {
    DEFAULTS[0]: {"dlocal_mavo:32:alpha=0.83:vote=avg:mr=1": 6e-4, "dlocal_mavo:16:alpha=0.83:vote=avg:mr=1": 1e-3,
                  "dlocal_mavo:8:alpha=0.83:vote=avg:mr=1": 3e-3,
                  "dlocal_mavo:4:alpha=0.83:vote=avg:mr=1": 4e-3, "dlocal_mavo:2:alpha=0.83:vote=avg:mr=1": 6e-3},
    "diloco_adamw": {"diloco_adamw:10:outer_lr=0.5": 4e-3, "diloco_adamw_bf16:10:outer_lr=0.5": 4e-3,
                     "diloco_adamw_bf16:25": 6e-3, "diloco_adamw_bf16:32": 6e-3,
                     "diloco_adamw_bf16:50": 6e-3, "diloco_adamw_bf16:100:outer_lr=1": 6e-3,
                     "diloco_adamw_bf16:250": 6e-3, "diloco_adamw_bf16:500:outer_lr=1": 3e-3},
    # DiLoCo with the quantised all-reduce (rule_diloco_quantised.txt): the fp32 / bf16 rows' picks, carried
    "diloco_adamw:wire=fp4": {"diloco_adamw:25:wire=fp4": 6e-3, "diloco_adamw:10:outer_lr=0.5:wire=fp4": 4e-3,
                              "diloco_adamw:100:outer_lr=1:wire=fp4": 6e-3,
                              "diloco_adamw:50:wire=fp4": 6e-3, "diloco_adamw:32:wire=fp4": 6e-3,
                              # searched on its own: below 0.062 bits (rule_low_budget.txt), and its outer lr at the
                              # defaults' budget, the inner lr carried (rule_defaults_budget.txt)
                              "diloco_adamw:200:outer_lr=1:wire=fp4": 6e-3,
                              "diloco_adamw:64:outer_lr=1:wire=fp4": 6e-3},
    "diloco_adamw:wire=fp8": {"diloco_adamw:25:wire=fp8": 6e-3},
    # the majority vote (1 bit back), momenta reset, at DiLoCo's 4-bit H = 100 and 200 budgets: its lr searched at
    # outer scale 0.83 (rule_mavo_h32.txt, rule_low_budget.txt), then its outer scale at that lr
    # (rule_mavo_h32_outer.txt), at H = 32 then its lr once more at that scale (rule_second_pass.txt); at DiLoCo's
    # 4-bit H = 64 budget its lr at outer scale 0.67 (rule_mavo_h20.txt)
    "dlocal_mavo:alpha=0.67:mr=1": {"dlocal_mavo:32:alpha=0.67:mr=1": 6e-4, "dlocal_mavo:65:alpha=0.67:mr=1": 3e-4,
                                    "dlocal_mavo:20:alpha=0.67:mr=1": 1e-3},
}
#: the curves of HELD_OUT_PICKS whose picks at some H were carried from another curve's, not searched on their own:
#: line -> (whose picks, the H values carried)
CARRIED = {"diloco_adamw:wire=fp4": ("DiLoCo's", (10, 25, 32, 50, 100)), "diloco_adamw:wire=fp8": ("DiLoCo's", (25,))}
#: colours of DiLoCo's lines with a quantised all-reduce (``wire=``), apart from its base method's
WIRE_COLORS = {"fp4": "#e6550d", "fp8": "#fd8d3c"}
#: colours of lines drawn apart from their base method's (a vote's other rule beside the defaults' picks)
LINE_COLORS = {"dlocal_mavo:alpha=0.67:mr=1": "#17becf"}
#: the lr of a drawn line that stands for "the held-out pick at each H" (HELD_OUT_PICKS[line])
HELD_OUT = "held-out"
#: (line, lr or None for any) drawn in final_vs_bits_main.png, besides the HELD_OUT curves (main_lines adds them)
MAIN_LINES = (("glion", None), ("gadamw", None), ("powersgd_adamw", None), ("dlion_mavo", None),
              ("dlocal_mavo", 1e-4), (DEFAULTS[0], DEFAULTS[1]),
              ("diloco_adamw", 3e-3), ("diloco_adamw_bf16", 3e-3),  # (G-AdamW's lr; the picks: HELD_OUT_PICKS)
              ("diloco_lion_bf16", None))


def _held_out(r: dict, line: str | None = None) -> bool:
    """Whether row ``r`` is a held-out pick (of the curve ``line``, or of any)."""
    return any(abs(r["lr"] - lr) < 1e-12 for ln, picks in HELD_OUT_PICKS.items() if line in (None, ln)
               for spec, lr in picks.items() if canonical(spec) == r["method"])


def line_points(rows: list[dict], key: tuple) -> list[dict]:
    """The rows of a drawn line: (line, lr, weight decay), or (a line of HELD_OUT_PICKS, HELD_OUT, wd)."""
    ln, lr, wd = key
    if lr == HELD_OUT:
        return [r for r in rows if _held_out(r, ln) and r["weight_decay"] == wd]
    return [r for r in rows if (r["line"], r["lr"], r["weight_decay"]) == key]


def summary_rows(runs: list[dict], points=EVERY_STEP) -> list[dict]:
    """One row per (spec, lr, weight decay): the local-step specs and the every-step ``points``."""
    keep = {canonical(p) for p in points}
    groups = defaultdict(list)
    for r in runs:
        spec = canonical(r["method"])
        if parse_method(spec)[0] in LOCAL_METHODS or spec in keep:
            groups[(spec, r["lr"], r["weight_decay"])].append(r)
    lrs = defaultdict(set)  # per spec (its rows) and per line (its label: a line at two lrs names both)
    for spec, lr, wd in groups:
        lrs[spec].add((lr, wd))
        lrs[_line(spec)].add((lr, wd))
    rows = []
    for spec in _ordered({k[0] for k in groups}):
        for lr, wd in sorted(lrs[spec]):
            rs = sorted(groups[(spec, lr, wd)], key=lambda r: r["seed"])
            finals = np.array([r["final"] for r in rs], dtype=float)
            base, arg = parse_method(spec)
            local = base in LOCAL_METHODS
            twin_lrs = lrs.get(twin(spec) or "", set())
            several = len(lrs[spec]) > 1 or (local and (len(lrs[_line(spec)]) > 1
                                                        or bool(twin_lrs and (lr, wd) not in twin_lrs)))
            text = label(spec) + (f" (lr {lr:g})" if several else "")
            rows.append({
                "method": spec, "label": text, "kind": "every H steps" if local else "every step",
                "line": _line(spec), "H": arg if local else 1, "workers": rs[0]["workers"],
                "seeds": [r["seed"] for r in rs], "metric": rs[0]["metric"],
                "median": float(np.median(finals)), "min": float(np.min(finals)), "max": float(np.max(finals)),
                "mean": float(np.mean(finals)), "diverged": int(sum(r["diverged"] for r in rs)),
                "bits": float(np.mean([common_bits(r) for r in rs])),
                "bits_source": rs[0].get("bits_source", ""), "lr": lr, "weight_decay": wd,
                "steps": rs[0]["steps"], "seconds_per_run": float(np.mean([r["seconds"] for r in rs])),
            })
    return rows


def drawn_lines(rows: list[dict], all_variants: bool = True) -> list[tuple]:
    """The (line, lr, weight decay) keys the figure draws, in order: a variant of a local-step
    method with one point only (one H) run on fewer than three seeds (an experiment, not an
    evaluated setting) is left out unless ``all_variants``."""
    lines = []
    for r in rows:
        key = (r["line"], r["lr"], r["weight_decay"])
        if key in lines:
            continue
        b = r["line"].split(":", 1)[0]
        if (not all_variants and b in LOCAL_METHODS and r["line"] != b and len(r["seeds"]) < 3
                and sum((q["line"], q["lr"], q["weight_decay"]) == key for q in rows) == 1):
            continue
        lines.append(key)
    return lines


def _precision(r: dict) -> str:
    """DiLoCo's all-reduce precision in row ``r``: fp32, bf16, fp8 or fp4."""
    return "bf16" if r["method"].split(":", 1)[0].endswith("_bf16") else local_options(r["method"])["wire"]


def _settings(r: dict) -> str:
    """What a held-out pick set: its lr, and DiLoCo's all-reduce precision and outer lr."""
    extra = [] if r["method"].startswith("dlocal_mavo") else [
        _precision(r), f"outer lr {local_options(r['method'])['outer_lr']:g}"]
    return ", ".join([f"lr {r['lr']:g}"] + extra)


def _draw(ax, rows: list[dict], drawn: list[tuple], min_seeds: int) -> None:
    """The lines ``drawn`` on ``ax``, each through its points run on ``min_seeds`` seeds or more."""
    # a pick is named on its held-out curve where one is drawn (the README panel), else on its own line
    picks_on_curves = any(k[1] == HELD_OUT for k in drawn)
    for ln, lr, wd in drawn:
        nth = [k for k in drawn if k[0] == ln].index((ln, lr, wd))  # the same line at other lrs: dotted, dash-dot
        pts = sorted((r for r in line_points(rows, (ln, lr, wd)) if len(r["seeds"]) >= min_seeds),
                     key=lambda r: r["bits"])
        if not pts:
            continue
        b = ln.split(":", 1)[0]
        x = [r["bits"] for r in pts]
        y = [r["median"] for r in pts]
        err = [[r["median"] - r["min"] for r in pts], [r["max"] - r["median"] for r in pts]]
        local = b in LOCAL_METHODS
        style = ("-" if ln == b else "--", ":", "-.")[min(nth, 2)]
        if lr == HELD_OUT:  # (each point names its settings)
            name = (label(f"{b}:1").split(" H=")[0] if ln == b  # (DiLoCo: fp32 or bf16 per point, named there)
                    else label(":".join([b, "1"] + ln.split(":")[1:])).split(" H=")[0] if ln in CARRIED
                    else pts[0]["label"].split(" (lr ")[0].replace(f" H={pts[0]['H']}", ""))
            whose, carried_hs = CARRIED.get(ln, (None, ()))
            hs = sorted({r["H"] for r in pts})
            carried, searched = [h for h in hs if h in carried_hs], [h for h in hs if h not in carried_hs]
            pick = ("at the held-out pick for each H" if not carried
                    else f"at {whose} held-out pick for each H, carried" if not searched
                    else f"at the held-out pick for each H ({whose} at H = {', '.join(map(str, carried))}, carried)")
            text = name + f" {pick}, H = " + ", ".join(
                str(r["H"]) for r in sorted(pts, key=lambda r: r["H"]))
        elif local:
            text = pts[0]["label"].replace(f" H={pts[0]['H']}", "") + ", H = " + ", ".join(
                str(r["H"]) for r in sorted(pts, key=lambda r: r["H"]))
        else:
            text = pts[0]["label"] + " (every step)"
        color = LINE_COLORS.get(ln) or next((c for w, c in WIRE_COLORS.items() if f":wire={w}" in ln), COLORS[b])
        ax.errorbar(x, y, yerr=err, color=color, marker=MARKERS[b], ms=9 if MARKERS[b] == "*" else 6,
                    capsize=3, lw=1.2, ls=style if local and len(pts) > 1 else "none",
                    mfc="none" if ln != b else None, label=text)
        if local:
            for r in pts:
                named = (ln, r["H"]) == (DEFAULTS[0], DEFAULTS[2]) and abs(r["lr"] - DEFAULTS[1]) < 1e-12
                vote = b == "dlocal_mavo"
                if named:
                    text, xytext, ha = f"H={r['H']}: the defaults", (-6, -13), "right"
                elif lr == HELD_OUT:  # both held-out curves pass 0.75 bits: short names (the legend says
                    # "held-out"), the vote's below left of its points but the last, DiLoCo's below right
                    text = f"H={r['H']}, " + (f"lr {r['lr']:g}" if vote else _precision(r))
                    xytext, ha = (((5, 5), "left") if ln in LINE_COLORS  # (a second vote curve: above its points)
                                  else ((-5, -10), "right") if vote and r is not pts[-1] else ((5, -9), "left"))
                else:
                    text, xytext, ha = f"H={r['H']}", (4, 4), "left"
                    if _held_out(r) and not picks_on_curves:
                        text += f", {_settings(r)} (held-out choice)"
                ax.annotate(text, (r["bits"], r["median"]), textcoords="offset points", xytext=xytext, ha=ha,
                            fontsize=8 if named else 6, color=color, fontweight="bold" if named else "normal")
    ref = [r for r in rows if r["method"] == "glion"]
    if ref:
        ax.axhline(ref[0]["median"] * 1.01, color=COLORS["glion"], ls=":", lw=1, label="G-Lion's median + 1 %")
    ax.set_xscale("log")
    ax.set_xlabel("bits one rank sends per parameter per step (counted; log)")
    ax.grid(alpha=0.3, which="both")


def figure(rows: list[dict], path: str, title: str, all_variants: bool = True) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 7.2))
    drawn = drawn_lines(rows, all_variants)
    _draw(left, rows, drawn, min_seeds=3)
    left.set_title("settings run on 3 seeds or more", fontsize=9)
    left.set_ylabel("final validation loss (median over seeds, min–max)")
    _draw(right, rows, drawn, min_seeds=1)
    right.set_title("every setting run (no bar: one seed)", fontsize=9)
    fig.suptitle(title, fontsize=10)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.019 * ((len(labels) + 1) // 2), 1, 1))  # (room for the legend's rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main_lines(rows: list[dict]) -> list[tuple]:
    """The (line, lr, weight decay) keys of ``MAIN_LINES`` among ``rows``, in ``drawn_lines``' order; each
    curve of ``HELD_OUT_PICKS`` as (line, HELD_OUT, wd), after that line's other keys."""
    keys = [k for k in drawn_lines(rows)
            if any(k[0] == ln and (lr is None or abs(k[1] - lr) < 1e-12) for ln, lr in MAIN_LINES)]
    for ln in HELD_OUT_PICKS:
        for wd in sorted({r["weight_decay"] for r in rows if _held_out(r, ln)}):
            at = [i for i, k in enumerate(keys) if k[0] == ln and k[2] == wd]
            keys.insert(at[-1] + 1 if at else len(keys), (ln, HELD_OUT, wd))
    return keys


def figure_main(rows: list[dict], path: str, title: str) -> str:
    """One panel: the lines of ``MAIN_LINES`` only, on every seed count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = main_lines(rows)
    fig, ax = plt.subplots(figsize=(8, 6.4))
    _draw(ax, rows, drawn, min_seeds=1)
    top = 2.1  # (DiLoCo's 4 outer steps at H = 500 end far above: named, not drawn to scale)
    off = [r for k in drawn for r in line_points(rows, k) if r["median"] > top]
    if off:
        ax.set_ylim(top=top)
        ax.text(0.02, 0.98, "off scale: " + "; ".join(f"{r['label']}: {r['median']:.3f}" for r in off),
                transform=ax.transAxes, fontsize=7, va="top")
    ax.set_ylabel("final validation loss (median over seeds, bar: min–max; no bar: one seed)")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.024 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # (a long legend entry widens it, never cut)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlion.lab.experiments.local_plot", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="runs.jsonl files (records of run_one)")
    p.add_argument("--out", required=True, help="directory for final_vs_bits.png and summary.{csv,json}")
    p.add_argument("--task", default="charlm")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000, help="the step budget of the runs")
    p.add_argument("--points", default=",".join(EVERY_STEP),
                   help="every-step methods drawn as points (comma-separated specs)")
    p.add_argument("--all-variants", action="store_true",
                   help="also draw the variants of a local-step method run at one H only")
    args = p.parse_args(argv)
    runs, seen = [], set()
    for path in args.runs:
        for r in load_runs(path):
            if (r["key"] not in seen and r["task"] == args.task and not r.get("tune") and r["workers"] == args.workers
                    and r["budget"] == args.steps and r.get("path") is None):
                seen.add(r["key"])
                runs.append(r)
    rows = summary_rows(runs, [s for s in args.points.split(",") if s])
    if not rows:
        print("no matching runs")
        return 1
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, seeds=" ".join(map(str, r["seeds"]))))
    title = (f"{args.task}, N = {args.workers}, {args.steps} steps: final validation loss vs bits sent "
             f"(local-step methods: one curve over H)")
    fig = figure(rows, os.path.join(args.out, "final_vs_bits.png"), title, args.all_variants)
    figure_main(rows, os.path.join(args.out, "final_vs_bits_main.png"),
                f"{args.task}, N = {args.workers}, {args.steps} steps: final validation loss vs bits sent")
    print(f"{'method':42s} {'seeds':>7s} {'median':>8s} {'min':>8s} {'max':>8s} {'bits':>9s}")
    for r in rows:
        print(f"{r['label']:42s} {len(r['seeds']):>7d} {r['median']:8.4f} {r['min']:8.4f} {r['max']:8.4f} "
              f"{r['bits']:9.4g}")
    print(f"wrote {fig}, final_vs_bits_main.png, summary.csv, summary.json in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
