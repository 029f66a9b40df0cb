"""The README's time-to-quality table and plot, from the committed ``dlion bench ttq`` results.

Reads, for each panel, the composed per-seed results (``ttq_results.json`` written by ``dlion
bench ttq --curves … --step-times …``: each method's validation-loss curve and its step times)
and the e2e result the step times came from (for the bits per parameter each method sends), and
writes to ``--out``:

* ``readme_ttq.png``: validation loss against wall-clock seconds at one link rate (default
  50 Mbit/s), one line per method: the **median** over the seeds that exist at each evaluated
  step, the min–max over those seeds shaded. Time = step × the method's mean step time.
* ``readme_ttq.json``: per panel and method, the seeds, the bits sent per parameter per step,
  the time to the target loss per seed and its **mean** over the seeds that reached it with the
  min and max (the statistic of ``dlion bench ttq --across``, whose code computes it), and the
  plotted curve (step, seconds, median, min, max, seeds);
* ``readme_ttq.csv``: the plotted points, one row per (panel, method, step);
* ``step_times_across_runs.json`` / ``.txt``: D-Lion's step against PowerSGD rank 1's and
  rank 4's in every ``--fused`` e2e run since the packed vote with both (``RUNS``), per link
  rate: the mean step of each (D-Lion: the faster of overlapped and one bucket; PowerSGD:
  the faster of Lion and AdamW, one bucket and overlapped), and the ratio D-Lion ÷ PowerSGD.

    python -m dlion.lab.bench.readme_plot --out docs/results/readme

Default panels, each method at the settings of the held-out rule except G-Lion (kept at its
stronger 30 % warm-up): this host (``docs/results/ttq-peers-ov`` and ``ttq-heldout/composed-*``,
step times of ``e2e-peers-ov``) and the emulated host 16× faster at compute
(``docs/results/ttq-heldout-x16``, step times of ``e2e-local-x16``), paths relative to ``--results``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from typing import Optional

from .ttq_seeds import summarize

#: (panel key, title, e2e result, [(method key, label, per-seed composed files, seeds[, extras])]); extras:
#: "e2e", the result a method's step times came from where it is not the panel's (another run of e2e,
#: e.g. with --abstain-below), "e2e_method" (the method's name in that result where it timed several H,
#: e.g. d-local-mavo-st-h16), "key" (the row's name where the method has two rows) and "color"
PANELS = (
    ("this-host", "this host: 4 ranks on 2 CPU cores", "e2e-peers-ov/e2e_results.json", [
        ("g-lion", "G-Lion (DDP, fp32 gradients)", "ttq-peers-ov/glion-seed{}/ttq_results.json", range(5)),
        ("g-adamw-powersgd4-ov", "PowerSGD rank 4 + AdamW", "ttq-heldout/composed-psgd4-w0.1-seed{}/ttq_results.json",
         range(5)),
        ("d-mavo-1bit-ov-rt", "D-Lion MaVo", "ttq-peers-ov/dlion-seed{}/ttq_results.json", range(5)),
    ]),
    ("x16", "emulated host 16× faster at compute", "e2e-local-x16/e2e_results.json", [
        ("g-adamw-powersgd4-ov", "PowerSGD rank 4 + AdamW", "ttq-heldout-x16/psgd4-w0.1-seed{}/ttq_results.json", range(5)),
        ("d-mavo-1bit-ov-rt", "D-Lion MaVo", "ttq-heldout-x16/dlion-seed{}/ttq_results.json", range(5)),
        ("d-local-mavo", "Local D-Lion MaVo, H = 10", "ttq-heldout-x16/dlocal-seed{}/ttq_results.json", range(5)),
        ("d-local-mavo", "Local D-Lion MaVo, H = 10, abstain_below 0.5", "ttq-heldout-x16/dlocal-ab0.5-seed{}/ttq_results.json",
         range(5), {"key": "d-local-mavo-ab0.5", "e2e": "e2e-local-x16-ab0.5/warmup13/e2e_results.json",
                    "color": "tab:olive"}),
        ("diloco-adamw", "DiLoCo AdamW, H = 10", "ttq-heldout-x16/diloco-seed{}/ttq_results.json", range(1)),
        ("d-local-avg", "Local D-Lion Avg, H = 50, momenta reset",
         "ttq-heldout-x16/dlocal-avg-h50-reset-seed{}/ttq_results.json", range(5),
         {"e2e": "e2e-local-x16-avg-h50/e2e_results.json", "color": "tab:brown"}),
        ("d-local-avg", "Local D-Lion Avg, H = 25, momenta reset",
         "ttq-heldout-x16/dlocal-avg-h25-reset-seed{}/ttq_results.json", range(5),
         {"key": "d-local-avg-h25", "e2e": "e2e-local-x16-avg-h25/e2e_results.json", "color": "tab:cyan"}),
        ("d-local-avg", "Local D-Lion Avg, H = 32, momenta reset: the defaults",
         "ttq-heldout-x16/dlocal-avg-h32-reset-seed{}/ttq_results.json", range(5),
         {"key": "d-local-avg-h32", "e2e": "e2e-local-x16-avg-h32/e2e_results.json", "color": "black"}),
        ("d-local-avg-st", "Local D-Lion Avg, H = 25, streamed in 3 fragments",
         "ttq-heldout-x16/dlocal-avg-st-h25-f3-rates-lr4e-4-seed{}/ttq_results.json", range(5),
         {"e2e": "e2e-local-x16-avg-st-h25-f3-rates/e2e_results.json", "color": "tab:gray"}),
        ("d-local-mavo-st", "Local D-Lion MaVo, H = 16, streamed in 2 fragments",
         "ttq-heldout-x16/mavo-st-h16-f2-seed{}/ttq_results.json", range(5),
         {"e2e": "e2e-local-x16-mavo-st-f2/e2e_results.json", "e2e_method": "d-local-mavo-st-h16",
          "color": "darkgoldenrod"}),
        ("diloco-adamw-bf16", "DiLoCo AdamW bf16, H = 100, outer lr 1.0",
         "ttq-heldout-x16/diloco-bf16-h100-olr1.0-seed{}/ttq_results.json", range(5),
         {"e2e": "e2e-local-x16-h100/e2e_results.json", "color": "tab:pink"}),
    ]),
)
#: the `--fused` e2e runs (6 MB buckets, every optimizer fused) since the packed vote that have both
#: D-Lion MaVo (random ties) and PowerSGD rank 1: interleaved, except e2e-nice10 (training threads at
#: nice 10) and e2e-native-seq-a / -b (each method's steps back to back)
RUNS = ("e2e-bitvote", "e2e-wordcoin", "e2e-nice10", "e2e-native", "e2e-native-bucket6", "e2e-native-seq-a",
        "e2e-native-seq-b", "e2e-peers-ov")
DLION_STEP = ("d-mavo-1bit-ov-rt", "d-mavo-1bit-rt-1b")
COLORS = {"g-lion": "tab:red", "g-adamw-powersgd4-ov": "tab:orange", "d-mavo-1bit-ov-rt": "tab:blue",
          "d-local-mavo": "tab:green", "diloco-adamw": "tab:purple"}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def bits_sent(e2e: dict, method: str, link: str) -> float:
    """Bits per parameter one rank sends per step, from an e2e result (its measured link rates:
    for an emulated host, the rate measured is the emulated one ÷ the speed-up)."""
    rows = [r for r in e2e["results"] if r["method"] == method]
    if not rows:
        raise ValueError(f"{method} is not in the e2e result")
    r = next((r for r in rows if r["link"] == link), rows[0])  # bytes per step do not depend on the rate
    return 8.0 * r["bytes_sent_per_rank_per_step"] / r["params"]


def curve_band(curves: list[list], step_ms: float) -> list[dict]:
    """Median, min and max of the validation loss over the seeds at each evaluated step (every
    seed evaluates at the same steps), with the wall-clock seconds step × step_ms."""
    steps = [s for s, _ in curves[0]]
    for c in curves[1:]:
        if [s for s, _ in c] != steps:
            raise ValueError("the seeds' curves were evaluated at different steps")
    out = []
    for i, s in enumerate(steps):
        losses = [c[i][1] for c in curves]
        out.append({"step": s, "seconds": s * step_ms / 1e3, "median": statistics.median(losses),
                    "min": min(losses), "max": max(losses), "seeds": len(losses)})
    return out


def panel(results: str, key: str, title: str, e2e_path: str, methods: list, link: str,
          target: Optional[float]) -> dict:
    groups: dict = {}  # e2e path -> the composed results whose step times came from it
    e2es: dict = {}    # e2e path -> its result, read once
    rows = []
    for method, label, pattern, seeds, *extras in methods:
        extra = extras[0] if extras else {}
        source = extra.get("e2e", e2e_path)
        if source not in e2es:
            e2es[source] = _load(os.path.join(results, source))
        e2e = e2es[source]
        files = [os.path.join(results, pattern.format(k)) for k in seeds]
        mdocs = [_load(p) for p in files]
        groups.setdefault(source, []).extend(mdocs)
        step_ms = {d["step_times_ms"][method][link] for d in mdocs}
        if len(step_ms) != 1:
            raise ValueError(f"{method}: the seeds were composed with different step times")
        ms = step_ms.pop()
        speedup = mdocs[0].get("compute_speedup") or 1
        timed_as = extra.get("e2e_method", method)
        measured = {r["link"]: r for r in e2e["results"] if r["method"] == timed_as}
        # the composed step time is the e2e mean (÷ the emulated speed-up): check it is this file's
        if not any(abs(r["ms_mean"] / speedup - ms) < 1e-6 * ms for r in measured.values()):
            raise ValueError(f"{method}: its composed step time {ms:.3f} ms is not in {source}")
        rows.append({"key": extra.get("key", method), "method": method, "label": label,
                     "seeds": [d["config"]["seed"] for d in mdocs],
                     "color": extra.get("color", COLORS.get(method)), "e2e": source,
                     "files": [os.path.relpath(p, results) for p in files], "step_ms": ms,
                     "bits_sent_per_param_per_step": bits_sent(e2e, timed_as, next(iter(measured))),
                     "curve": curve_band([d["curves"][method] for d in mdocs], ms)})
    # per seed: steps and time to the target (the code of `dlion bench ttq --across`), per step-time file
    by_e2e = {path: summarize(docs) for path, docs in groups.items()}
    summaries = [by_e2e[row["e2e"]] for row in rows]
    if len({s["target_loss"] for s in summaries}) != 1 or len({s.get("compute_speedup") for s in summaries}) != 1:
        raise ValueError(f"{title}: the methods were composed for different targets or hosts")
    if target is not None and abs(summaries[0]["target_loss"] - target) > 1e-12:
        raise ValueError(f"{title}: the runs were composed for target {summaries[0]['target_loss']}, not {target}")
    for row, s in zip(rows, summaries):
        (k,) = [k for k in s["methods"] if k.partition("@")[0].partition("|")[0] == row["method"]]
        m = s["methods"][k]
        idx = [s["seeds"].index(seed) for seed in row["seeds"]]
        steps = [m["steps_to_target"][i] for i in idx]
        times = [m["time_to_target_s"][link][i] for i in idx]
        reached = [t for t in times if t is not None]
        row["time_to_target"] = {
            "steps": steps, "seconds": times, "seeds_reaching": len(reached), "seeds_run": len(idx),
            "mean_s": statistics.mean(reached) if reached else None,
            "min_s": min(reached) if reached else None, "max_s": max(reached) if reached else None}
        row["final_loss"] = [m["final_loss"][i] for i in idx]
    return {"key": key, "title": title, "link": link, "target_loss": summaries[0]["target_loss"],
            "compute_speedup": summaries[0].get("compute_speedup"), "e2e": e2e_path, "methods": rows}


def across_runs(results: str, runs=RUNS) -> list[dict]:
    """Per run and link rate: the mean step (ms) of D-Lion and of PowerSGD ranks 1 and 4, each the
    fastest of its forms in that run, and D-Lion's ratio to them (< 1: D-Lion's step is shorter)."""
    out = []
    for run in runs:
        e2e = _load(os.path.join(results, run, "e2e_results.json"))
        by_link: dict = {}
        for r in e2e["results"]:
            by_link.setdefault(r["link"], {})[r["method"]] = r["ms_mean"]
        for link, ms in by_link.items():
            row = {"run": run, "link": link}
            for key, pick in (("dlion", lambda m: m in DLION_STEP), ("powersgd1", lambda m: "powersgd1" in m),
                              ("powersgd4", lambda m: "powersgd4" in m)):
                have = {m: v for m, v in ms.items() if pick(m)}
                best = min(have, key=have.get) if have else None
                row[key] = {"method": best, "mean_ms": have.get(best)}
            for key in ("powersgd1", "powersgd4"):
                row[f"dlion_over_{key}"] = (row["dlion"]["mean_ms"] / row[key]["mean_ms"]
                                            if row["dlion"]["mean_ms"] and row[key]["mean_ms"] else None)
            out.append(row)
    return out


def across_text(rows: list[dict]) -> str:
    lines = ["mean ms per step; D-Lion: the faster of overlapped and one bucket; PowerSGD: the fastest of its forms",
             f"{'run':<20} {'link':>8} {'D-Lion':>8} {'PSGD r1':>8} {'D/r1':>6} {'PSGD r4':>8} {'D/r4':>6}"]
    for r in rows:
        def cell(x, fmt):
            return f"{x:{fmt}}" if x is not None else "-"
        lines.append(f"{r['run']:<20} {r['link']:>8} {cell(r['dlion']['mean_ms'], '8.1f'):>8} "
                     f"{cell(r['powersgd1']['mean_ms'], '8.1f'):>8} {cell(r['dlion_over_powersgd1'], '6.3f'):>6} "
                     f"{cell(r['powersgd4']['mean_ms'], '8.1f'):>8} {cell(r['dlion_over_powersgd4'], '6.3f'):>6}")
    return "\n".join(lines)


def plot(panels: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 6.0), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for row in p["methods"]:
            pts = [c for c in row["curve"] if c["step"] > 0]  # log time axis: from the first evaluation
            x = [c["seconds"] for c in pts]
            n = row["time_to_target"]["seeds_run"]
            color = row.get("color")
            ax.plot(x, [c["median"] for c in pts], color=color, lw=1.8,
                    label=f"{row['label']} ({n} seed{'s' if n > 1 else ''})")
            if n > 1:
                ax.fill_between(x, [c["min"] for c in pts], [c["max"] for c in pts], color=color, alpha=0.2, lw=0)
        ax.axhline(p["target_loss"], color="black", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_ylim(1.85, 3.3)
        ax.set_xlabel("wall clock (s, log scale): steps × mean step time")
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(f"{p['title']}, {p['link'].replace('mbit', ' Mbit/s')}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)  # (below:
        # inside, the legend covered the curves where they reach the target)
    fig.suptitle("CharGPT 4.8 M, 4 ranks, 1000 steps: median over seeds (line), min–max (shaded); "
                 f"dotted: target {panels[0]['target_loss']:g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlion.lab.bench.readme_plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="docs/results", help="the folder of the committed results")
    ap.add_argument("--out", default="docs/results/readme")
    ap.add_argument("--link", default="50mbit", help="the link rate plotted (default 50mbit)")
    ap.add_argument("--target", type=float, default=2.1, help="the target loss the runs were composed for")
    args = ap.parse_args(argv)
    panels = [panel(args.results, key, title, e2e, methods, args.link, args.target)
              for key, title, e2e, methods in PANELS]
    os.makedirs(args.out, exist_ok=True)
    doc = {"what": "validation loss against wall-clock seconds; curves: median and min-max over seeds at each "
                   "evaluated step; time to target: mean over the seeds that reached it, with min and max",
           "command": "python -m dlion.lab.bench.readme_plot --out " + os.path.relpath(args.out),
           "panels": panels}
    with open(os.path.join(args.out, "readme_ttq.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "readme_ttq.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["panel", "method", "step", "seconds", "median_loss", "min_loss", "max_loss", "seeds"])
        for p in panels:
            for row in p["methods"]:
                for c in row["curve"]:
                    w.writerow([p["key"], row["method"], c["step"], f"{c['seconds']:.3f}", f"{c['median']:.6f}",
                                f"{c['min']:.6f}", f"{c['max']:.6f}", c["seeds"]])
    plot(panels, os.path.join(args.out, "readme_ttq.png"))
    rows = across_runs(args.results)
    with open(os.path.join(args.out, "step_times_across_runs.json"), "w") as f:
        json.dump({"runs": list(RUNS), "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "step_times_across_runs.txt"), "w") as f:
        f.write(across_text(rows) + "\n")
    for p in panels:
        print(f"{p['title']}, {p['link']}: time to {p['target_loss']:g}, mean over the seeds reaching it (min-max)")
        for row in p["methods"]:
            t = row["time_to_target"]
            fig = ("never" if t["mean_s"] is None
                   else f"{t['mean_s']:.0f} s ({t['min_s']:.0f}-{t['max_s']:.0f})")
            print(f"  {row['label']:<30} {row['bits_sent_per_param_per_step']:6.3f} bits/param  "
                  f"{fig:<18} reached on {t['seeds_reaching']} of {t['seeds_run']} seeds")
    print(across_text(rows))
    print(f"wrote {os.path.join(args.out, 'readme_ttq.png')}, readme_ttq.json, readme_ttq.csv, "
          "step_times_across_runs.json, step_times_across_runs.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
