"""Summaries (CSV / JSON / Markdown) and the paper-style figures of a sweep.

Figures, per task (``results_<task>_*.png``):

``curves``       the metric vs epoch (or step), one panel per N, mean over seeds;
``final_vs_N``   the final metric vs N, mean ± std over seeds;
``equivalent_workers``  G-Lion's final metric vs N with D-Lion MaVo's drawn at N and at
                 N' = κ_N² (:mod:`.vote_efficiency`), where G-Lion ran at two N or more;
``vs_bits``      test error (1 − accuracy) or validation loss vs the bits one rank
                 sends per parameter per step (counted; log x), one panel per N; the
                 settings of one compressor (densities, ranks) are joined by a line,
                 its frontier.

Bits are those of :func:`dlion.lab.experiments.runner.common_bits` (one axis for
every method, old records converted).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict

import numpy as np

from .vote_efficiency import equivalence, equivalence_lines
from .runner import ALL_METHODS, LOCAL_METHODS, beta2_of, canonical, common_bits, dgc_clip, is_legacy, label, parse_method, quant_bits_of

__all__ = ["summarize", "report", "markdown_tables"]

COLORS = {"glion": "#1f77b4", "gadamw": "#9467bd", "terngrad": "#8c564b", "graddrop": "#e377c2",
          "dgc": "#7f7f7f", "powersgd_lion": "#bcbd22", "powersgd_adamw": "#393b79", "dlion_avg": "#2ca02c",
          "dlion_mavo": "#d62728", "dlion_mavo_rties": "#ff9896", "lioncub_quant": "#ff7f0e", "lioncub_msync": "#17becf",
          "dlocal_mavo": "#a50f15", "diloco_adamw": "#54278f", "diloco_lion": "#006d2c",
          "diloco_adamw_bf16": "#9e9ac8", "diloco_lion_bf16": "#74c476"}
MARKERS = {"glion": "o", "gadamw": "s", "terngrad": "v", "graddrop": "^", "dgc": "<", "powersgd_lion": ">",
           "powersgd_adamw": "h", "dlion_avg": "D", "dlion_mavo": "*", "dlion_mavo_rties": "*", "lioncub_quant": "P", "lioncub_msync": "X",
           "dlocal_mavo": "*", "diloco_adamw": "s", "diloco_lion": "p", "diloco_adamw_bf16": "s", "diloco_lion_bf16": "p"}


def _base(m):
    return parse_method(m)[0]


def _line(m):
    """The settings joined into one frontier line: one per base method (and DGC clipping threshold)."""
    b = _base(m)
    if b in LOCAL_METHODS:  # one line over H per base and options: "diloco_lion" or "diloco_lion:outer_lr=0.1"
        return ":".join([b] + canonical(m).split(":")[2:])
    if beta2_of(m) is not None:
        return f"{b}:b2={beta2_of(m):g}"
    if quant_bits_of(m) is not None:
        return f"{b}:bits={quant_bits_of(m)}"
    clip = dgc_clip(m) if b == "dgc" else None
    return b if clip is None else f"{b}:clip={clip:g}"


def _ordered(methods):
    """Specs in the order of ALL_METHODS, then by parameter."""
    def key(m):
        base, arg = parse_method(m)
        return (ALL_METHODS.index(base), arg if arg is not None else 0, m)
    return sorted(methods, key=key)


def _source(rec):
    if not is_legacy(rec):
        return rec.get("bits_source", "")
    if _base(rec["method"]).startswith(("dlion", "lioncub")):
        return "counted (wire format)"
    return "counted (formula, from the stored counts)"


def _labels(runs):
    """Legend text per method spec (old records of DGC / GradDrop marked pre-audit)."""
    out = {}
    for r in runs:
        out[r["method"]] = label(r["method"], legacy=is_legacy(r) and ":" not in r["method"])
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (method, N): mean and std over seeds of the final metric and the bits."""
    groups = defaultdict(list)
    for r in runs:
        groups[(r["method"], r["workers"])].append(r)
    labels = _labels(runs)
    rows = []
    for m in _ordered({k[0] for k in groups}):
        for n in sorted({k[1] for k in groups if k[0] == m}):
            rs = sorted(groups[(m, n)], key=lambda r: r["seed"])
            finals = np.array([r["final"] for r in rs], dtype=float)
            bits = np.array([common_bits(r) for r in rs], dtype=float)
            rows.append({
                "task": rs[0]["task"], "method": m, "label": labels[m], "workers": n, "seeds": len(rs),
                "metric": rs[0]["metric"], "mean": float(np.mean(finals)),
                "std": float(np.std(finals, ddof=1)) if len(rs) > 1 else 0.0,
                "diverged": int(sum(r["diverged"] for r in rs)),
                "bits": float(np.mean(bits)),
                "bits_source": _source(rs[0]),
                "lr": rs[0]["lr"], "weight_decay": rs[0]["weight_decay"], "steps": rs[0]["steps"],
                "budget": rs[0]["budget"], "budget_unit": rs[0]["budget_unit"],
                "seconds_per_run": float(np.mean([r["seconds"] for r in rs])),
                **_agreement(rs),
            })
    return rows


def _agreement(rs: list[dict]) -> dict:
    """Unanimous and tied fractions of the voted coordinates over the second half of training
    (mean over the evaluation intervals and seeds); empty for methods without a sign vote."""
    tails = [[a for a in r["vote_agreement"] if a[0] > r["budget"] / 2] for r in rs if r.get("vote_agreement")]
    tails = [t for t in tails if t]
    if not tails:
        return {}
    return {"vote_unanimous": float(np.mean([a[1] for t in tails for a in t])),
            "vote_tied": float(np.mean([a[2] for t in tails for a in t]))}


def _fmt(mean, std, pct, seeds=2):
    if not math.isfinite(mean):
        return "diverged"
    if seeds < 2:  # one seed: no spread to show
        return f"{100 * mean:.1f}" if pct else f"{mean:.3f}"
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
    lines = ["| method | lr | wd | " + " | ".join(f"N={n} {name}" for n in ns) + " |",
             "|---|---|---|" + "---|" * len(ns)]
    for m in methods:
        any_r = next(by[(m, n)] for n in ns if (m, n) in by)
        cells = [(_fmt(by[(m, n)]["mean"], by[(m, n)]["std"], pct, by[(m, n)]["seeds"]) + f" ({by[(m, n)]['seeds']})")
                 if (m, n) in by else "–" for n in ns]
        lines.append(f"| {any_r['label']} | {any_r['lr']:g} | {any_r['weight_decay']:g} | " + " | ".join(cells) + " |")
    lines += ["", "| method | source | " + " | ".join(f"bits sent/param/step N={n}" for n in ns) + " |",
              "|---|---|" + "---|" * len(ns)]
    for m in methods:
        any_r = next(by[(m, n)] for n in ns if (m, n) in by)
        cells = [f"{by[(m, n)]['bits']:.3g}" if (m, n) in by else "–" for n in ns]
        lines.append(f"| {any_r['label']} | {any_r['bits_source']} | " + " | ".join(cells) + " |")
    if ("dlion_mavo", ns[0]) in by or any(("glion", n) in by for n in ns):
        lines += ["", "| N | D-Lion MaVo − G-Lion |", "|---|---|"]
        for n in ns:
            if ("dlion_mavo", n) in by and ("glion", n) in by:
                d = by[("dlion_mavo", n)]["mean"] - by[("glion", n)]["mean"]
                lines.append(f"| {n} | {100 * d:+.1f} points |" if pct else
                             f"| {n} | {d:+.3f} ({100 * d / by[('glion', n)]['mean']:+.1f} %) |")
    voting = [r for r in rows if "vote_unanimous" in r]
    if voting:
        lines += ["", "| method | N | unanimous (% of voted coordinates) | tied (%) | if the signs were coin "
                  "flips: unanimous / tied (%) |", "|---|---|---|---|---|"]
        for r in voting:
            n = r["workers"]
            flips = f"{100 * 2 / 2 ** n:.1f} / {100 * math.comb(n, n // 2) / 2 ** n if n % 2 == 0 else 0:.1f}"
            lines.append(f"| {r['label']} | {n} | {100 * r['vote_unanimous']:.1f} | {100 * r['vote_tied']:.1f} | "
                         f"{flips} |")
    return lines


def _mean_curve(rs):
    xs = [c[0] for c in rs[0]["curve"]]
    ys = []
    for r in rs:
        y = [c[1] for c in r["curve"]]
        y = y + [float("nan")] * (len(xs) - len(y))
        ys.append(y[: len(xs)])
    return np.array(xs), np.nanmean(np.array(ys, dtype=float), axis=0)


def _styles(methods):
    """(color, marker, linestyle) per spec: colour and marker by base method, line style
    by the spec's place among the specs of its base (density / rank)."""
    seen = defaultdict(int)
    out = {}
    for m in _ordered(methods):
        b = _base(m)
        out[m] = (COLORS[b], MARKERS[b], ["-", "--", ":", "-."][seen[b] % 4])
        seen[b] += 1
    return out


def _legend(axes, outside: bool = True) -> None:
    """One legend, on the last panel, of every panel's lines: a method may run at some N only."""
    entries = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(lab, h)
    axes[-1].legend(entries.values(), entries.keys(), fontsize=6, loc="center left" if outside else "best",
                    bbox_to_anchor=(1.0, 0.5) if outside else None)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(runs: list[dict], fig_dir: str, name: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    os.makedirs(fig_dir, exist_ok=True)
    task = runs[0]["task"]
    name = name or f"results_{task}"
    metric = runs[0]["metric"]
    acc = "accuracy" in metric
    groups = defaultdict(list)
    for r in runs:
        groups[(r["method"], r["workers"])].append(r)
    ns = sorted({r["workers"] for r in runs})
    methods = _ordered({r["method"] for r in runs})
    labels = _labels(runs)
    style = _styles(methods)
    ylabel = ("test accuracy (%)" if acc else "validation loss")
    scale = 100.0 if acc else 1.0
    many = len(methods) > 12
    paths = []

    # 1. metric vs epoch/step, one panel per N (the D-Lion paper's Fig. 2)
    fig, axes = plt.subplots(1, len(ns), figsize=(4.6 * len(ns) + (2.5 if many else 0), 3.8), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for m in methods:
            if (m, n) not in groups:
                continue
            x, y = _mean_curve(groups[(m, n)])
            c, _, ls = style[m]
            ax.plot(x, scale * y, color=c, ls=ls, label=labels[m], lw=1.6 if m.startswith("dlion") else 1.1)
        ax.set_title(f"{task}, N = {n} (local batch {runs[0]['local_batch']})")
        ax.set_xlabel("epochs (samples seen / training set)" if acc else "step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not acc:
            lo = min(np.nanmin(_mean_curve(groups[(m, n)])[1]) for m in methods if (m, n) in groups)
            ax.set_ylim(lo - 0.05, lo + 1.5)
    _legend(axes[0], outside=many)
    paths.append(_save(fig, os.path.join(fig_dir, f"{name}_curves.png")))

    rows = summarize(runs)
    by = {(r["method"], r["workers"]): r for r in rows}

    # 2. final metric vs N (Fig. 3)
    fig, ax = plt.subplots(figsize=(6.4 + (2.5 if many else 0), 4.4))
    for m in methods:
        pts = [(n, by[(m, n)]["mean"], by[(m, n)]["std"]) for n in ns if (m, n) in by]
        if not pts:
            continue
        x, y, e = map(np.array, zip(*pts))
        c, mk, ls = style[m]
        ax.errorbar(x, scale * y, yerr=scale * e, color=c, marker=mk, ls=ls, capsize=3, label=labels[m],
                    lw=1.6 if m.startswith("dlion") else 1.0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("workers N")
    ax.set_ylabel(("final " + ylabel) + " (mean ± std over seeds)")
    ax.set_title(f"{task}: final {'accuracy' if acc else 'validation loss'} vs N")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6 if many else 7, loc="center left" if many else "best",
              bbox_to_anchor=(1.0, 0.5) if many else None)
    paths.append(_save(fig, os.path.join(fig_dir, f"{name}_final_vs_N.png")))

    # 3. error vs bits sent per parameter per step (Fig. 4); one line per compressor's settings
    fig, axes = plt.subplots(1, len(ns), figsize=(4.6 * len(ns) + 2.5, 4.0), squeeze=False, sharey=True)
    lines = []
    for m in methods:
        if _line(m) not in lines:
            lines.append(_line(m))
    xs_all = [by[k]["bits"] for k in by if by[k]["bits"] > 0]
    for ax, n in zip(axes[0], ns):
        for ln in lines:
            b = ln.split(":", 1)[0]  # a line name is "base" or "base:setting"
            pts = sorted(((by[(m, n)]["bits"], by[(m, n)]["mean"], by[(m, n)]["std"], m) for m in methods
                          if _line(m) == ln and (m, n) in by))
            if not pts:
                continue
            x = [q[0] for q in pts]
            y = [100 * (1 - q[1]) if acc else q[1] for q in pts]
            e = [scale * q[2] for q in pts]
            legend = labels[pts[0][3]] if len(pts) == 1 else label(b) + (
                " (pre-audit)" if "pre-audit" in labels[pts[0][3]] else "") + (
                f", clip {dgc_clip(pts[0][3]):g}" if b == "dgc" and dgc_clip(pts[0][3]) is not None else "")
            ax.errorbar(x, y, yerr=e, color=COLORS[b], marker=MARKERS[b], ms=9 if b == "dlion_mavo" else 6,
                        capsize=3, ls=("--" if ln != b else "-") if len(pts) > 1 else "none", lw=0.9,
                        label=legend, mfc="none" if ln != b else None)
            if len(pts) > 1:
                for q, yy in zip(pts, y):
                    arg = parse_method(q[3])[1]
                    txt = f"r{arg}" if b.startswith("powersgd") else f"{100 * arg:g}%"
                    ax.annotate(txt, (q[0], yy), fontsize=6, xytext=(3, 3), textcoords="offset points",
                                color=COLORS[b])
        ax.set_xscale("log")
        if xs_all:
            lo, hi = min(xs_all) / 1.6, max(xs_all) * 1.6
            ax.set_xlim(lo, hi)
            ax.set_xticks([t for t in (0.01, 0.03, 0.1, 0.3, 1, 2, 4, 8, 16, 32, 64) if lo <= t <= hi])
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("bits sent per parameter per step, per rank (counted)")
        ax.set_title(f"N = {n}")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("test error (%)" if acc else "validation loss")
    _legend(axes[0])
    fig.suptitle(f"{task}: {'test error' if acc else 'validation loss'} vs communication")
    paths.append(_save(fig, os.path.join(fig_dir, f"{name}_vs_bits.png")))

    # 4. how the sign vote went over training: unanimous and tied fractions of the voted coordinates
    voting = [m for m in methods if any("vote_agreement" in r for n in ns for r in groups.get((m, n), []))]
    if voting:
        # the variants of one base (β2, ties) share its colour elsewhere; here each needs its own
        palette = ["#8c6d31", "#637939", "#7b4173", "#3182bd", "#e6550d", "#31a354"]  # none of COLORS
        vote_color = {}
        for m in sorted(voting, key=lambda m: ":" in m):  # a base method keeps its colour, a variant gets a new one
            c = style[m][0]
            if c in vote_color.values():
                c = next(p for p in palette if p not in vote_color.values())
            vote_color[m] = c
        vns = [n for n in ns if any("vote_agreement" in r for m in voting for r in groups.get((m, n), []))]
        fig, axes = plt.subplots(1, len(vns), figsize=(4.6 * len(vns) + 2.5, 3.6), squeeze=False)
        for ax, n in zip(axes[0], vns):
            for m in voting:
                recs = [r for r in groups.get((m, n), []) if "vote_agreement" in r]
                if not recs:
                    continue
                va = np.array([r["vote_agreement"] for r in recs], dtype=float)  # (seeds, points, 3)
                c = vote_color[m]
                ax.plot(va[0, :, 0], 100 * va[:, :, 1].mean(0), color=c, ls="-", label=f"{labels[m]}: unanimous")
                ax.plot(va[0, :, 0], 100 * va[:, :, 2].mean(0), color=c, ls=":", label=f"{labels[m]}: tied")
            ax.axhline(100 * 2 / 2 ** n, color="grey", lw=0.8, ls="--", label="unanimous if signs were coin flips")
            if n % 2 == 0:
                ax.axhline(100 * math.comb(n, n // 2) / 2 ** n, color="grey", lw=0.8, ls=":",
                           label="tied if signs were coin flips")
            ax.set_title(f"{task}, N = {n}")
            ax.set_xlabel("step")
            ax.set_ylabel("% of voted coordinates")
            ax.grid(alpha=0.3)
        _legend(axes[0])
        fig.suptitle(f"{task}: agreement of the workers' signs (mean over seeds)")
        paths.append(_save(fig, os.path.join(fig_dir, f"{name}_vote_agreement.png")))
    return paths


def equivalence_figure(rows: list[dict], eq: list[dict], path: str) -> str | None:
    """G-Lion's final metric against N, with MaVo's measured values drawn at N and at N' = κ_N²."""
    ref = sorted((r["workers"], r["mean"]) for r in rows if r["method"] == "glion")
    if len(ref) < 2 or not eq:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 4.0))
    ax.plot([n for n, _ in ref], [v for _, v in ref], "o-", color=COLORS["glion"], label="G-Lion at N workers")
    mavo = COLORS["dlion_mavo"]
    ax.plot([e["workers"] for e in eq], [e["measured"] for e in eq], "*", ms=11, mfc="none", color=mavo,
            label="D-Lion MaVo, drawn at its N")
    ax.plot([e["equivalent_workers"] for e in eq], [e["measured"] for e in eq], "*", ms=11, color=mavo,
            label="D-Lion MaVo, drawn at N' = κ_N²")
    for e in eq:
        ax.annotate("", xy=(e["equivalent_workers"], e["measured"]), xytext=(e["workers"], e["measured"]),
                    arrowprops=dict(arrowstyle="->", color=mavo, lw=0.8))
    ax.set_xscale("log")
    ns = sorted({n for n, _ in ref} | {e["workers"] for e in eq})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("workers N (log scale)")
    ax.set_ylabel(f"final {rows[0]['metric']}")
    ax.set_title("A majority vote of N signs is worth κ_N² workers' mean")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def report(runs: list[dict], out_dir: str, fig_dir: str, fig_name: str | None = None) -> list[str]:
    """Write summary.csv, summary.json and the figures; return the Markdown tables."""
    rows = summarize(runs)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    paths = figures(runs, fig_dir, fig_name)
    lines = markdown_tables(rows)
    eq = equivalence(rows)
    if len({r["workers"] for r in rows if r["method"] == "glion"}) >= 2 and eq:
        with open(os.path.join(out_dir, "equivalent_workers.json"), "w") as f:
            json.dump(eq, f, indent=1)
        name = fig_name or f"results_{runs[0]['task']}"
        paths.append(equivalence_figure(rows, eq, os.path.join(fig_dir, f"{name}_equivalent_workers.png")))
        lines += [""] + equivalence_lines(eq)
    return lines + [""] + [f"figure: {p}" for p in paths]
