"""``dlion bench ttq --across F1 F2 …``: time to quality over several seeds.

One seed's ranking can be an accident of that seed. This reads the composed results
(``ttq_results.json``) of runs that differ only in ``--seed`` — the same workload, target
L and step-time file, which it checks — and reports per method: steps to L and time to L
at each link rate for every seed ("never" where L was not reached), the mean time over
the seeds that reached L, and per rate which method was first in each seed.

Runs may also differ in ``--lr`` and ``--warmup-frac`` (each method at the settings tuned for
it): a seed can then come in several files, and every (method, lr) is a row of its own, e.g.
``d-mavo-1bit-ov-rt@lr=0.0004`` (``…@lr=0.0001,warmup=0.1`` where the warm-ups differ); the local
vote trained with ``--abstain-below`` τ is a row of its own (``…|abstain_below=0.5``), and so is
it with ``--reset-momentum`` (``…|reset_momentum``), at each ``--outer-scale`` where the runs differ
in it (``…|outer_scale=0.83``), and streamed with ``--stream-delay`` (``…|stream_delay=10``) or
``--fragments`` (``…|fragments=4``), Streaming DiLoCo also with ``--fragment-alpha`` (``…|fragment_alpha=0.5``). Methods
that talk every H steps trained at several H (each composed with one e2e run that timed them all,
``--methods d-local-avg-h25,…``) are a row per H (``d-local-avg-h25``). A (method, settings) given twice for one seed is refused.

Output in ``--out``: ``ttq_seeds.json``, ``ttq_seeds.txt`` and ``ttq_seeds.png`` (per link
rate, each seed's time to L per method; "never" at the right edge).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Optional

from dlion.lab.cluster import rate_key

from .e2e.methods import split_sync_every, sync_every_of, takes_ties, talks_every_h

#: what the runs must share (besides the seed, the lr and the warm-up) to be compared
SHARED = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "bucket_mb", "weight_decay", "betas",
          "ties", "quant_bits", "steps")


#: settings that results written before they were recorded had at these values
_BEFORE_RECORDED = {"betas": [0.9, 0.99]}


def _setting(doc: dict, key: str):
    return doc["config"].get(key, _BEFORE_RECORDED.get(key))


def _trained_h(doc: dict) -> int:
    return doc["config"].get("sync_every", 10)


def _same_step_times(a: dict, b: dict) -> bool:
    """Whether two composed runs took their step times from one e2e run: every method both list at
    the same H (a method that talks every H steps, trained at another H in one of them, was timed
    at that H) has the same step times in both, and they share at least one."""
    ta, tb = a.get("step_times_ms") or {}, b.get("step_times_ms") or {}
    common = [m for m in ta.keys() & tb.keys()
              if sync_every_of(m, _trained_h(a)) == sync_every_of(m, _trained_h(b))]
    return (not ta and not tb) or (bool(common) and all(ta[m] == tb[m] for m in common))


def summarize(docs: list[dict]) -> dict:
    """The per-seed figures of ``docs`` (composed ttq results) side by side; raises
    ``ValueError`` when they are not runs of one workload, target and step-time file."""
    ref = docs[0] if docs else None

    def ties_matter(doc: dict) -> bool:  # --ties is a setting of the methods that take it, not of the workload
        return any(takes_ties(m) for m in doc["config"].get("methods", doc["composed"]["methods"]))

    for d in docs[1:]:
        diff = [k for k in SHARED if _setting(d, k) != _setting(ref, k)
                and (k != "ties" or (ties_matter(d) and ties_matter(ref)))]
        if diff:
            raise ValueError(f"seed {d['config'].get('seed')} differs from seed {ref['config'].get('seed')} in "
                             + ", ".join(f"{k} ({_setting(d, k)!r} vs {_setting(ref, k)!r})" for k in diff))
        if d["composed"]["target_loss"] != ref["composed"]["target_loss"]:
            raise ValueError(f"targets differ: {d['composed']['target_loss']} vs {ref['composed']['target_loss']} "
                             "(re-compose every seed with the same --target)")
        if d.get("compute_speedup") != ref.get("compute_speedup"):
            raise ValueError(f"the runs emulate different hosts (--compute-speedup {d.get('compute_speedup')} vs "
                             f"{ref.get('compute_speedup')})")
        if not _same_step_times(d, ref):
            raise ValueError("the runs were composed with different step times (use one --step-times file)")
    seeds = list(dict.fromkeys(d["config"].get("seed") for d in docs))
    by_warmup = len({_setting(d, "warmup_frac") for d in docs}) > 1
    by_lr = by_warmup or len({_setting(d, "lr") for d in docs}) > 1
    # methods that talk every H steps, trained at several H: each H a row of its own, named <method>-h<H>
    by_h = len({_trained_h(d) for d in docs if any(talks_every_h(m) for m in d["composed"]["methods"])}) > 1
    # the local vote trained at several outer scales: each α a row of its own
    by_alpha = len({d["config"].get("outer_scale", 1.0) for d in docs
                    if any(m.startswith("d-local") for m in d["composed"]["methods"])}) > 1
    rows_of: dict = {}  # (method key) -> {seed index: composed row}
    for d in docs:
        i = seeds.index(d["config"].get("seed"))
        for m, row in d["composed"]["methods"].items():
            name = f"{m}-h{_trained_h(d)}" if by_h and talks_every_h(m) and split_sync_every(m)[1] is None else m
            key = f"{name}@lr={_setting(d, 'lr'):g}" if by_lr else name
            if by_warmup:
                key += f",warmup={_setting(d, 'warmup_frac'):g}"
            if m.startswith("d-local") and d["config"].get("abstain_below", 0.0):  # another rule: a row of its own
                key += f"|abstain_below={d['config']['abstain_below']:g}"
            if m.startswith("d-local") and by_alpha:
                key += f"|outer_scale={d['config'].get('outer_scale', 1.0):g}"
            if split_sync_every(m)[0].endswith("-st") and d["config"].get("stream_delay") is not None:
                key += f"|stream_delay={d['config']['stream_delay']}"
            if split_sync_every(m)[0].endswith("-st") and d["config"].get("fragments", 1) != 1:
                key += f"|fragments={d['config']['fragments']}"
            if split_sync_every(m)[0].endswith("-st") and d["config"].get("fragment_alpha", 0.0):
                key += f"|fragment_alpha={d['config']['fragment_alpha']:g}"
            if m.startswith("d-local") and d["config"].get("reset_momentum"):
                key += "|reset_momentum"
            if i in rows_of.setdefault(key, {}):
                raise ValueError(f"seed {seeds[i]} has {key} in two files (seeds repeat)")
            rows_of[key][i] = row
    if len(seeds) < 2:
        raise ValueError("give ttq_results.json files of at least two seeds")
    links = sorted({k for d in docs for r in d["composed"]["methods"].values() for k in r["time_to_target_s"]},
                   key=rate_key)
    out = {"target_loss": ref["composed"]["target_loss"], "seeds": seeds, "links": links, "methods": {},
           "first": {}, "compute_speedup": ref.get("compute_speedup")}
    for m, per_seed in rows_of.items():
        rows = [per_seed.get(i) for i in range(len(seeds))]
        times = {k: [None if r is None or r["steps_to_target"] is None else r["time_to_target_s"].get(k)
                     for r in rows] for k in links}
        reached = {k: [t for t in ts if t is not None] for k, ts in times.items()}
        out["methods"][m] = {
            "steps_to_target": [None if r is None else r["steps_to_target"] for r in rows],
            "final_loss": [None if r is None else r["final_loss"] for r in rows],
            "run": [r is not None for r in rows],
            "time_to_target_s": times,
            "mean_time_to_target_s": {k: (statistics.mean(v) if v else None) for k, v in reached.items()},
            "seeds_reaching_target": sum(1 for r in rows if r is not None and r["steps_to_target"] is not None),
        }
    for k in links:
        firsts: list[Optional[str]] = []
        for i in range(len(seeds)):
            t = {m: r["time_to_target_s"][k][i] for m, r in out["methods"].items()
                 if r["time_to_target_s"][k][i] is not None}
            firsts.append(min(t, key=t.get) if t else None)
        out["first"][k] = firsts
    return out


def label(key: str) -> str:
    """A row's label: the method's, with its lr (and warm-up) where the runs differ in them."""
    from .e2e.methods import label as method_label

    key, reset, _ = key.partition("|reset_momentum")
    key, _, mix = key.partition("|fragment_alpha=")
    key, _, fragments = key.partition("|fragments=")
    key, _, delay = key.partition("|stream_delay=")
    key, _, alpha = key.partition("|outer_scale=")
    key, _, tau = key.partition("|abstain_below=")
    m, _, lr = key.partition("@lr=")
    lr, _, warmup = lr.partition(",warmup=")
    settings = ([f"lr {lr}"] if lr else []) + ([f"warm-up {warmup}"] if warmup else []) + (
        [f"abstain_below {tau}"] if tau else []) + ([f"outer_scale {alpha}"] if alpha else []) + (
        [f"exchange started {delay} steps before its round ends" if m.startswith("diloco") else
         f"applied {delay} steps into the next round"] if delay else []) + (
        [f"in {fragments} fragments"] if fragments else []) + ([f"alpha {mix}"] if mix else []) + (
        ["momenta reset at each sync"] if reset else [])
    return method_label(m) + (f" ({', '.join(settings)})" if settings else "")


def table(s: dict) -> str:
    seeds = "/".join(str(x) for x in s["seeds"])
    lines = [f"target L = {s['target_loss']:.4f} nats/char; seeds {seeds}; "
             "time to L per seed, and the mean over the seeds that reached L"]
    if s.get("compute_speedup"):
        lines.insert(0, f"emulated host {s['compute_speedup']:g}× faster at compute (step times measured at links "
                        f"{s['compute_speedup']:g}× slower, divided by {s['compute_speedup']:g})")
    for m, r in s["methods"].items():
        steps = " / ".join("-" if not run else ("never" if st is None else str(st))
                           for st, run in zip(r["steps_to_target"], r["run"]))
        lines.append(f"{label(m)}: steps to L {steps}; reached in {r['seeds_reaching_target']} of {len(s['seeds'])}")
        for k in s["links"]:
            per = " / ".join(_cell(t, st) for t, st in zip(r["time_to_target_s"][k], r["steps_to_target"]))
            mean = r["mean_time_to_target_s"][k]
            lines.append(f"    {k:>8}: {per}" + ("" if mean is None else f"  (mean {mean:.0f} s)"))
    for k in s["links"]:
        firsts = s["first"][k]
        counts = {m: firsts.count(m) for m in dict.fromkeys(f for f in firsts if f)}
        lines.append(f"first at {k}: " + ", ".join(f"{label(m)} in {c} of {len(firsts)}" for m, c in counts.items()))
    return "\n".join(lines)


def _cell(t: Optional[float], steps: Optional[int]) -> str:
    """A seed's time to L: "never" only where L was not reached; "untimed" where it was but the
    step-time file has no time for the method at that rate."""
    return f"{t:.0f} s" if t is not None else "untimed" if steps is not None else "never"


def plot(s: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    methods = list(s["methods"])
    fig, axes = plt.subplots(1, len(s["links"]), figsize=(5.2 * len(s["links"]), 0.5 * len(methods) + 1.8),
                             sharey=True, squeeze=False)
    for ax, k in zip(axes[0], s["links"]):
        reached = [t for r in s["methods"].values() for t in r["time_to_target_s"][k] if t is not None]
        edge = max(reached) * 1.25 if reached else 1.0
        for y, m in enumerate(methods):
            ts = s["methods"][m]["time_to_target_s"][k]
            ax.scatter([t for t in ts if t is not None], [y] * sum(t is not None for t in ts), s=28, zorder=3)
            never = sum(1 for run, st in zip(s["methods"][m]["run"], s["methods"][m]["steps_to_target"])
                        if run and st is None)
            if never:
                ax.scatter([edge], [y], marker="x", color="k", zorder=3)
                ax.annotate(f"never ×{never}", (edge, y), textcoords="offset points", xytext=(-6, 6), fontsize=8,
                            ha="right")
            mean = s["methods"][m]["mean_time_to_target_s"][k]
            if mean is not None:
                ax.plot([mean, mean], [y - 0.3, y + 0.3], color="k", lw=1.5)
        ax.set_title(f"{k}: time to L = {s['target_loss']:.2f}")
        ax.set_xlabel("seconds (dots: seeds; bar: mean of those reaching L)")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_tick))
        ax.xaxis.set_minor_formatter(FuncFormatter(_tick))
        ax.grid(alpha=0.3)
    axes[0][0].set_yticks(range(len(methods)), [label(m) for m in methods], fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tick(v: float, _pos) -> str:
    """Label 1, 2 and 5 times a power of ten only (a log axis spanning less than a decade has few
    major ticks, and every minor label would overlap)."""
    lead = f"{v:.0e}"[0]
    return f"{v:g}" if lead in "125" else ""


def run(paths: list[str], out: str) -> int:
    docs = []
    for p in paths:
        try:
            with open(p) as f:
                docs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"dlion bench ttq --across: cannot read {p}: {e}")
    try:
        s = summarize(docs)
    except ValueError as e:
        raise SystemExit(f"dlion bench ttq --across: {e}")
    s["from"] = [os.path.relpath(p) for p in paths]
    text = table(s)
    print(text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ttq_seeds.json"), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(out, "ttq_seeds.txt"), "w") as f:
        f.write(text + "\n")
    plot(s, os.path.join(out, "ttq_seeds.png"),
         f"dlion bench ttq: {len(s['seeds'])} seeds, {docs[0]['workers']} ranks, {docs[0]['config']['steps']} steps"
         + (f"; emulated host {s['compute_speedup']:g}× faster at compute" if s.get("compute_speedup") else ""))
    print(f"wrote {os.path.join(out, 'ttq_seeds.json')}, ttq_seeds.txt, ttq_seeds.png")
    return 0
