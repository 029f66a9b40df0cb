"""Summaries (CSV / JSON / Markdown) and the paper-style figures of a sweep.

Figures, per task (``results_<task>_*.png``):

``curves``       the metric vs epoch (or step), one panel per N, mean over seeds;
``final_vs_N``   the final metric vs N, mean ± std over seeds;
``vs_bits``      test error (1 − accuracy) or validation loss vs bits per
                 parameter per iteration (log x), one panel per N.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict

import numpy as np

from .runner import LABELS, METHODS

__all__ = ["summarize", "report", "markdown_tables"]

COLORS = {"glion": "#1f77b4", "gadamw": "#9467bd", "terngrad": "#8c564b", "graddrop": "#e377c2",
          "dgc": "#7f7f7f", "dlion_avg": "#2ca02c", "dlion_mavo": "#d62728", "lioncub_quant": "#ff7f0e",
          "lioncub_msync": "#17becf"}
MARKERS = {"glion": "o", "gadamw": "s", "terngrad": "v", "graddrop": "^", "dgc": "<", "dlion_avg": "D",
           "dlion_mavo": "*", "lioncub_quant": "P", "lioncub_msync": "X"}


def _ordered(methods):
    return [m for m in METHODS if m in methods]


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (method, N): mean and std over seeds of the final metric and the bits."""
    groups = defaultdict(list)
    for r in runs:
        groups[(r["method"], r["workers"])].append(r)
    rows = []
    for m in _ordered({k[0] for k in groups}):
        for n in sorted({k[1] for k in groups if k[0] == m}):
            rs = sorted(groups[(m, n)], key=lambda r: r["seed"])
            finals = np.array([r["final"] for r in rs], dtype=float)
            bits = np.array([r["bits"] for r in rs], dtype=float)
            rows.append({
                "task": rs[0]["task"], "method": m, "label": LABELS[m], "workers": n, "seeds": len(rs),
                "metric": rs[0]["metric"], "mean": float(np.mean(finals)),
                "std": float(np.std(finals, ddof=1)) if len(rs) > 1 else 0.0,
                "diverged": int(sum(r["diverged"] for r in rs)),
                "bits": float(np.mean(bits)), "bits_source": rs[0].get("bits_source", ""),
                "bits_up": float(np.mean([r.get("bits_up", float("nan")) for r in rs])),
                "bits_down": float(np.mean([r.get("bits_down", float("nan")) for r in rs])),
                "lr": rs[0]["lr"], "weight_decay": rs[0]["weight_decay"], "steps": rs[0]["steps"],
                "budget": rs[0]["budget"], "budget_unit": rs[0]["budget_unit"],
                "seconds_per_run": float(np.mean([r["seconds"] for r in rs])),
            })
    return rows


def _fmt(mean, std, pct):
    if not math.isfinite(mean):
        return "diverged"
    return f"{100 * mean:.1f} ± {100 * std:.1f}" if pct else f"{mean:.3f} ± {std:.3f}"


def markdown_tables(rows: list[dict]) -> list[str]:
    """The metric table and the bits table, as Markdown lines."""
    if not rows:
        return []
    ns = sorted({r["workers"] for r in rows})
    pct = "accuracy" in rows[0]["metric"]
    by = {(r["method"], r["workers"]): r for r in rows}
    methods = _ordered({r["method"] for r in rows})
    name = rows[0]["metric"] + (" (%)" if pct else "")
    lines = [f"| method | lr | wd | " + " | ".join(f"N={n} {name}" for n in ns) + " |",
             "|---|---|---|" + "---|" * len(ns)]
    for m in methods:
        any_r = next(by[(m, n)] for n in ns if (m, n) in by)
        cells = [(_fmt(by[(m, n)]["mean"], by[(m, n)]["std"], pct) + f" ({by[(m, n)]['seeds']})")
                 if (m, n) in by else "–" for n in ns]
        lines.append(f"| {LABELS[m]} | {any_r['lr']:g} | {any_r['weight_decay']:g} | " + " | ".join(cells) + " |")
    lines += ["", "| method | source | " + " | ".join(f"bits/param/iter N={n}" for n in ns) + " |",
              "|---|---|" + "---|" * len(ns)]
    for m in methods:
        any_r = next(by[(m, n)] for n in ns if (m, n) in by)
        cells = [f"{by[(m, n)]['bits']:.3g}" if (m, n) in by else "–" for n in ns]
        lines.append(f"| {LABELS[m]} | {any_r['bits_source']} | " + " | ".join(cells) + " |")
    if ("dlion_mavo", ns[0]) in by or any(("glion", n) in by for n in ns):
        lines += ["", "| N | D-Lion MaVo − G-Lion |", "|---|---|"]
        for n in ns:
            if ("dlion_mavo", n) in by and ("glion", n) in by:
                d = by[("dlion_mavo", n)]["mean"] - by[("glion", n)]["mean"]
                lines.append(f"| {n} | {100 * d:+.1f} points |" if pct else f"| {n} | {d:+.3f} |")
    return lines


def _mean_curve(rs):
    xs = [c[0] for c in rs[0]["curve"]]
    ys = []
    for r in rs:
        y = [c[1] for c in r["curve"]]
        y = y + [float("nan")] * (len(xs) - len(y))
        ys.append(y[: len(xs)])
    return np.array(xs), np.nanmean(np.array(ys, dtype=float), axis=0)


def figures(runs: list[dict], fig_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(fig_dir, exist_ok=True)
    task = runs[0]["task"]
    metric = runs[0]["metric"]
    acc = "accuracy" in metric
    unit = runs[0]["budget_unit"]
    groups = defaultdict(list)
    for r in runs:
        groups[(r["method"], r["workers"])].append(r)
    ns = sorted({r["workers"] for r in runs})
    methods = _ordered({r["method"] for r in runs})
    ylabel = ("test accuracy (%)" if acc else "validation loss")
    scale = 100.0 if acc else 1.0
    paths = []

    # 1. metric vs epoch/step, one panel per N
    fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.6), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for m in methods:
            if (m, n) not in groups:
                continue
            x, y = _mean_curve(groups[(m, n)])
            ax.plot(x, scale * y, color=COLORS[m], label=LABELS[m], lw=1.6 if m.startswith("dlion") else 1.1)
        ax.set_title(f"{task}, N = {n} (local batch {runs[0]['local_batch']})")
        ax.set_xlabel("epochs (samples seen / training set)" if acc else "step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not acc:
            lo = min(np.nanmin(_mean_curve(groups[(m, n)])[1]) for m in methods if (m, n) in groups)
            ax.set_ylim(lo - 0.05, lo + 1.5)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    p = os.path.join(fig_dir, f"results_{task}_curves.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    rows = summarize(runs)
    by = {(r["method"], r["workers"]): r for r in rows}

    # 2. final metric vs N
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for m in methods:
        pts = [(n, by[(m, n)]["mean"], by[(m, n)]["std"]) for n in ns if (m, n) in by]
        if not pts:
            continue
        x, y, e = map(np.array, zip(*pts))
        ax.errorbar(x, scale * y, yerr=scale * e, color=COLORS[m], marker=MARKERS[m], capsize=3, label=LABELS[m],
                    lw=1.6 if m.startswith("dlion") else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("workers N")
    ax.set_ylabel(("final " + ylabel) + " (mean ± std over seeds)")
    ax.set_title(f"{task}: final {'accuracy' if acc else 'validation loss'} vs N")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = os.path.join(fig_dir, f"results_{task}_final_vs_N.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    # 3. error vs bits per iteration
    fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.8), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], ns):
        for m in methods:
            if (m, n) not in by:
                continue
            r = by[(m, n)]
            y = 100 * (1 - r["mean"]) if acc else r["mean"]
            ax.errorbar([r["bits"]], [y], yerr=[scale * r["std"]], color=COLORS[m], marker=MARKERS[m],
                        ms=9 if m == "dlion_mavo" else 7, capsize=3, ls="none", label=LABELS[m])
        ax.set_xscale("log")
        ax.set_xlim(1, 100)
        ax.set_xticks([1, 2, 4, 8, 16, 32, 64])
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("bits per parameter per iteration (up + down)")
        ax.set_title(f"N = {n}")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("test error (%)" if acc else "validation loss")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{task}: {'test error' if acc else 'validation loss'} vs communication")
    fig.tight_layout()
    p = os.path.join(fig_dir, f"results_{task}_vs_bits.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def report(runs: list[dict], out_dir: str, fig_dir: str) -> list[str]:
    """Write summary.csv, summary.json and the figures; return the Markdown tables."""
    rows = summarize(runs)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    paths = figures(runs, fig_dir)
    return markdown_tables(rows) + [""] + [f"figure: {p}" for p in paths]
