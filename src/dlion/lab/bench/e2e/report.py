"""Reporting ``dlion bench e2e``: per-method summaries pooled over ranks, the text table
per link rate, the headline (fastest method; best D-Lion MaVo vs the fastest peer, G-Lion,
compute-only and sync-only), the D-Lion
profile lines, the plot and the JSON document."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from typing import Optional

import torch

from .methods import BASELINES, DDP_HOOKS, label, split_sync_every, talks_every_h


def summarize(per_rank: list[dict]) -> dict:
    """Pool one method's per-rank results: median over all ranks' measured steps."""
    steps = [t for r in per_rank for t in r["step_s"]]
    fb = [t for r in per_rank for t in r["fwd_bwd_s"]]
    ranks = sorted({r["rank"] for r in per_rank})
    by_rank = {k: statistics.median([t for r in per_rank if r["rank"] == k for t in r["step_s"]]) for k in ranks}
    r0 = [r for r in per_rank if r["rank"] == 0][0]
    out = {
        "ms_per_step": 1e3 * statistics.median(steps),
        "ms_per_step_by_rank": [1e3 * by_rank[k] for k in ranks],
        "ms_p10": 1e3 * _quantile(steps, 0.1), "ms_p90": 1e3 * _quantile(steps, 0.9),
        # what a run of many steps costs per step, slow steps included (time to quality uses it)
        "ms_mean": 1e3 * statistics.fmean(steps),
        "fwd_bwd_ms": 1e3 * statistics.median(fb),
        "bytes_sent_per_rank_per_step": statistics.mean(r["bytes_sent_per_step"] for r in per_rank),
        "bytes_received_per_rank_per_step": statistics.mean(r["bytes_received_per_step"] for r in per_rank),
        "params": r0["params"],
        "loss_first": r0["loss_first"], "loss_last": r0["loss_last"],
        "samples": len(steps),
    }
    for k in ("uplink_bytes_per_step",):  # measured on rank 0 only
        if k in r0:
            out[k] = r0[k]
    for k in ("inter_node_bytes_sent_per_step", "intra_node_bytes_sent_per_step"):
        if k in r0:
            out[k] = statistics.mean(r[k] for r in per_rank)
    for k in ("all_reduce_calls_per_step", "buckets_per_step", "bucket_bytes_per_step", "buckets", "algorithms",
              "sync_every", "outer_lr", "fragments", "sync_delay", "update_alpha"):
        if k in r0:
            out[k] = r0[k]
    if "profile_ms_per_step" in r0:
        names = sorted({n for r in per_rank for n in r["profile_ms_per_step"]})
        out["profile_ms_per_step"] = {n: statistics.mean(r["profile_ms_per_step"].get(n, 0.0) for r in per_rank)
                                      for n in names}
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def table(link: str, bps: Optional[int], rows: dict, cfg: dict, world: int) -> str:
    """The text table of one link rate (rows: method -> summary)."""
    nparams = next(iter(rows.values()))["params"]
    comp = rows.get("compute", {}).get("ms_per_step")
    glion = rows.get("g-lion", {}).get("ms_per_step")
    lines = [f"link {link}: {world} ranks, CharGPT {nparams / 1e6:.2f} M parameters "
             f"(n_layer {cfg['n_layer']}, n_embd {cfg['n_embd']}), batch {cfg['batch_size']}×{cfg['block_size']} "
             f"tokens per rank, buckets of {cfg['bucket_mb']:g} MB, median of {cfg['steps']} steps × {world} ranks"]
    w = max([38] + [len(label(m)) for m in rows])
    head = (f"{'method':<{w}} {'ms/step':>8} {'mean':>7} {'vs G-Lion':>9} {'×compute':>8} {'fwd+bwd':>8} "
            f"{'MB sent':>8} {'bits/param':>10} {'wire ms':>8}")
    lines += [head, f"{'':<{w}} {'':>8} {'ms':>7} {'(speedup)':>9} {'':>8} {'ms':>8} {'/rank/step':>8} {'sent':>10} "
                    f"{'(ideal)':>8}", "-" * len(head)]
    for m, r in rows.items():
        ms = r["ms_per_step"]
        speed = f"{glion / ms:>8.2f}×" if glion else f"{'-':>9}"
        frac = f"{ms / comp:>7.2f}×" if comp else f"{'-':>8}"
        sent = r["bytes_sent_per_rank_per_step"]
        bits = 8 * sent / r["params"]
        # hierarchical: only the bytes between nodes meet the shaped link (inside a node it is unshaped)
        wire = f"{8e3 * r.get('inter_node_bytes_sent_per_step', sent) / bps:>8.1f}" if bps else f"{'-':>8}"
        mean = f"{r['ms_mean']:>7.1f}" if "ms_mean" in r else f"{'-':>7}"
        lines.append(f"{label(m):<{w}} {ms:>8.1f} {mean} {speed} {frac} {r['fwd_bwd_ms']:>8.1f} {sent / 1e6:>8.3f} "
                     f"{bits:>10.3f} {wire}")
    if any("uplink_bytes_per_step" in r for r in rows.values()):
        lines.append("(hierarchical methods: 'MB sent' counts the bytes inside the node too; 'wire ms' only those "
                     "between nodes)")
        lines.append(f"bytes that crossed the node uplinks per step (kernel tbf counters, all {cfg['nodes']} "
                     "nodes, both directions, TCP/IP headers and one barrier included):")
        for m, r in rows.items():
            if "uplink_bytes_per_step" in r:
                split = (f"  (per rank: {r['inter_node_bytes_sent_per_step'] / 1e6:.3f} MB sent between nodes, "
                         f"{r['intra_node_bytes_sent_per_step'] / 1e6:.3f} MB inside its node)"
                         if "inter_node_bytes_sent_per_step" in r else "")
                lines.append(f"  {label(m):<{w}} {r['uplink_bytes_per_step'] / 1e6:>8.3f} MB "
                             f"{8 * r['uplink_bytes_per_step'] / r['params']:>7.3f} bits/param{split}")
    if comp and glion:
        comm = glion - comp
        ratio = comp / comm if comm > 0 else float("inf")
        lines.append(f"G-Lion step: compute (the compute-only step) {comp:.1f} ms, communication (G-Lion step − "
                     f"compute) {comm:.1f} ms: compute/communication = {ratio:.3f}; G-Lion step = "
                     f"{glion / comp:.1f}× compute-only")
    return "\n".join(lines)


def step_ms(r: dict) -> float:
    """A method's step time for the comparisons: the mean (what a run of many steps costs), or
    the median in result files written before the mean was recorded."""
    return r.get("ms_mean", r["ms_per_step"])


def headline(rows: dict) -> Optional[dict]:
    """The fastest method overall, and the best D-Lion MaVo method against the fastest peer
    (every DDP method that communicates), compute-only and sync-only, at one link rate; on
    :func:`step_ms` (``statistic`` says which)."""
    mavo = {m: r for m, r in rows.items() if m.startswith("d-mavo") or m in DDP_HOOKS}
    peers = {m: r for m, r in rows.items() if m in BASELINES and m not in ("compute", "sync-only") + DDP_HOOKS}
    if not mavo or "compute" not in rows:
        return None
    ms = {m: step_ms(r) for m, r in rows.items() if m not in ("compute", "sync-only")}
    best = min(mavo, key=lambda m: step_ms(mavo[m]))
    t, comp = step_ms(mavo[best]), step_ms(rows["compute"])
    out = {"statistic": "mean" if all("ms_mean" in r for r in rows.values()) else "median",
           "fastest_overall": min(ms, key=ms.get), "best_mavo": best, "best_mavo_ms": t, "over_compute": t / comp}
    if "g-lion" in rows:
        out["glion_over_compute"] = step_ms(rows["g-lion"]) / comp
        out["speedup_vs_glion"] = step_ms(rows["g-lion"]) / t
    if peers:
        peer = min(peers, key=lambda m: step_ms(peers[m]))
        out["fastest_peer"] = peer
        out["speedup_vs_fastest_peer"] = step_ms(peers[peer]) / t
    if "sync-only" in rows:
        out["sync_only_over_compute"] = step_ms(rows["sync-only"]) / comp
        out["over_sync_only"] = t / step_ms(rows["sync-only"])
    out["criteria"] = {"mavo_faster_than_every_peer": out.get("speedup_vs_fastest_peer", 0) > 1,
                       "within_1.25x_compute": t / comp <= 1.25, "within_1.10x_compute": t / comp <= 1.10,
                       "within_1.05x_sync_only": out.get("over_sync_only", float("inf")) <= 1.05}
    return out


def overlap(rows: dict, bps: Optional[int]) -> dict:
    """What overlap hid, per overlapped D-Lion method whose plain twin ran at the same link:
    communication exposed in the step (step − compute-only) without and with overlap, the
    difference (hidden), and the ideal wire time (bytes sent / link rate) for scale."""
    out = {}
    comp = rows.get("compute", {}).get("ms_per_step")
    for m in rows:
        twin = m.replace("-ov", "", 1)
        if not m.startswith("d-") or "-ov" not in m or twin not in rows or comp is None:
            continue
        plain, ov = rows[twin]["ms_per_step"], rows[m]["ms_per_step"]
        exposed = plain - comp
        out[m] = {"plain": twin, "exposed_ms_without": exposed, "exposed_ms_with": ov - comp,
                  "hidden_ms": plain - ov, "hidden_fraction": (plain - ov) / exposed if exposed > 0 else None,
                  "wire_ms_ideal": 8e3 * rows[m]["bytes_sent_per_rank_per_step"] / bps if bps else None}
    return out


def overlap_lines(ov: dict) -> list[str]:
    lines = []
    for m, o in ov.items():
        frac = "" if o["hidden_fraction"] is None else f" = {100 * o['hidden_fraction']:.0f} % of it"
        wire = "" if o["wire_ms_ideal"] is None else f" (ideal wire time {o['wire_ms_ideal']:.1f} ms)"
        lines.append(f"  {label(m)}: communication exposed in the step {o['exposed_ms_without']:.1f} ms without "
                     f"overlap, {o['exposed_ms_with']:.1f} ms with: hidden {o['hidden_ms']:.1f} ms{frac}{wire}")
    return lines


def profile_lines(rows: dict, methods: list[str]) -> list[str]:
    lines = []
    for m in methods:
        prof = rows.get(m, {}).get("profile_ms_per_step")
        if not prof:
            continue
        lines.append(f"  {label(m)}: step {rows[m]['ms_per_step']:.1f} ms; inside it (ms/step, inclusive, mean "
                     "over ranks):")
        for name, v in sorted(prof.items(), key=lambda kv: -kv[1]):
            if v >= 0.05:
                lines.append(f"    {v:>8.1f}  {name}")
    return lines


def plot(results: list[dict], methods: list[str], path: str, title: str, nodes: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(10, 6.5))
    rated = [r for r in results if r["rate_bps"]]
    colors = {"g-adamw": "tab:gray", "g-lion": "tab:red", "g-lion-bf16": "tab:orange", "sync-only": "black",
              "allgather": "tab:purple", "1bit": "tab:blue", "pbit": "tab:green", "quant": "tab:olive",
              "powersgd1": "#8c564b", "powersgd2": "#e377c2", "powersgd4": "#bcbd22"}
    if rated:
        for m in methods:
            pts = sorted((r["rate_bps"] / 1e6, r["ms_per_step"]) for r in rated if r["method"] == m)
            if not pts:
                continue
            xs, ys = zip(*pts)
            if m == "compute":
                style = dict(color="black", ls="--", lw=2)
            elif m in BASELINES:
                key = next((p for p in m.split("-") if p.startswith("powersgd")), m)
                style = dict(color=colors.get(key, "tab:gray"),
                             ls=":" if m == "sync-only" else "--" if m.endswith("-ov") else "-", lw=2,
                             marker="o" if "adamw" not in m else "s")
            elif talks_every_h(m):  # talking every H steps: local D-Lion dark blue, DiLoCo grey; bf16 / streaming dashed
                kind = split_sync_every(m)[0]
                style = dict(color="navy" if m.startswith("d-") else "dimgray" if "adamw" in m else "darkgoldenrod",
                             ls="--" if kind.endswith(("-st", "-bf16")) else "-", lw=1.8,
                             marker="P" if m.startswith("d-") else "X", ms=6)
            elif m.startswith("h-"):  # hierarchical D-Lion: solid, diamonds
                parts = m.split("-")
                style = dict(color="tab:cyan" if parts[2] == "1bit" else "tab:purple", ls="-", lw=2,
                             marker="D" if parts[1] == "mavo" else "v", ms=6)
            else:  # D-Lion: colour = algorithm, marker = vote, dashed = overlap on
                parts = m.split("-")
                style = dict(color=colors[parts[2]] if not m.endswith("-rt") else "tab:cyan",
                             ls="--" if "-ov" in m else ":", lw=1.8,
                             marker="s" if parts[1] == "mavo" else "^", ms=5,
                             fillstyle="full" if "-ov" in m else "none")
            ax.plot(xs, ys, label=label(m), **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({r["rate_bps"] / 1e6 for r in rated})
        ax.set_xticks(rates)
        ax.set_xticklabels([f"{x:g}" for x in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        lo, hi = min(r["ms_per_step"] for r in rated), max(r["ms_per_step"] for r in rated)
        yt = [v * 10 ** k for k in range(-1, 7) for v in (1, 2, 3, 5, 7) if lo / 1.2 <= v * 10 ** k <= hi * 1.2]
        ax.set_yticks(yt)
        ax.set_yticklabels([f"{y:g}" for y in yt])
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("link rate per node uplink (Mbit/s, full duplex; unshaped inside a node)" if nodes
                      else "link rate per rank (Mbit/s, full duplex)")
        ax.set_ylabel("time per step (ms, median, log scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    else:  # loopback only: one bar per method
        rows = [r for r in results if r["method"] in methods]
        ax.barh([label(r["method"]) for r in rows], [r["ms_per_step"] for r in rows])
        ax.set_xlabel("time per step (ms, median), loopback")
        ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _headline_text(h: dict) -> str:
    parts = [f"fastest overall: {label(h['fastest_overall'])}",
             f"best D-Lion MaVo: {label(h['best_mavo'])} {h['best_mavo_ms']:.0f} ms/step "
             f"({h.get('statistic', 'median')}) = "
             f"{h['over_compute']:.2f}× compute-only"]
    if "over_sync_only" in h:
        parts.append(f"{h['over_sync_only']:.2f}× sync-only (sync-only = {h['sync_only_over_compute']:.2f}× compute)")
    if "fastest_peer" in h:
        parts.append(f"{h['speedup_vs_fastest_peer']:.2f}× faster than the fastest peer, {label(h['fastest_peer'])}")
    if "speedup_vs_glion" in h:
        parts.append(f"{h['speedup_vs_glion']:.2f}× faster than G-Lion (G-Lion = {h['glion_over_compute']:.1f}× "
                     "compute-only)")
    return "; ".join(parts)


def _options_without_out(argv: list[str]) -> list[str]:
    """The command-line options, less ``--out DIR`` (a local path)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def write_report(args, cfg: dict, methods: list[str], links: list, raw: dict, failed: Optional[str],
            elapsed: float, argv: list[str]) -> int:
    world = args.workers
    results, tables, heads = [], [], {}
    for link, bps in links:
        got = raw.get(link, {})
        rows = {m: summarize(got[m]) for m in methods if m in got}
        if not rows:
            continue
        for m, r in rows.items():
            results.append({"link": link, "rate_bps": bps, "method": m, "label": label(m), **r})
        tables.append(table(link, bps, rows, cfg, world))
        h = headline(rows)
        ov = overlap(rows, bps)
        if h:
            h["overlap"] = ov
            heads[link] = h
            tables.append(_headline_text(h))
        if ov:
            tables.append("overlap with backward (step − compute-only = communication left exposed):\n"
                          + "\n".join(overlap_lines(ov)))
        ours = sorted((m for m in rows if m.startswith("d-")), key=lambda m: rows[m]["ms_per_step"])
        prof = profile_lines(rows, ours[:1])
        if prof:
            tables.append("profile of the fastest D-Lion method (where its step goes):\n" + "\n".join(prof))
        tables.append("")
    if heads:
        tables.append("summary per link (targets: best D-Lion MaVo faster than every peer; <= 1.25x compute-only "
                      "at 50 Mbit/s and <= 1.10x at 1 Gbit/s, or within 1.05x of sync-only):")
        for link, h in heads.items():
            tables.append(f"  {link:>10}: {_headline_text(h)}")
        tables.append("")
    where = "loopback (no shaping)" if args.loopback else "virtual cluster (network namespaces, tbf-shaped links)"
    if cfg.get("nodes"):
        where += (f", {cfg['nodes']} nodes × {cfg['per_node']} ranks" +
                  ("" if args.loopback else " (unshaped inside a node; the rate is each node uplink's)"))
    header = (f"dlion bench e2e: {world} ranks on one machine ({os.cpu_count()} CPU cores shared by all ranks, "
              f"1 torch thread per rank{', training threads at nice %d' % cfg['compute_nice'] if cfg.get('compute_nice') else ''}), "
              f"{where}; torch {torch.__version__}; {elapsed / 60:.1f} min")
    text = header + "\n\n" + "\n".join(tables)
    print(text)
    if failed:
        print(f"dlion bench e2e: FAILED ({failed}); results above are partial", file=sys.stderr)
    if results and args.out:
        os.makedirs(args.out, exist_ok=True)
        doc = {"benchmark": "dlion bench e2e", "options": _options_without_out(argv), "config": cfg,
               "workers": world, "mode": "loopback" if args.loopback else "virtual-cluster",
               "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                           "python": platform.python_version(), "system": platform.system(),
                           "machine": platform.machine()},
               "elapsed_s": elapsed, "failed": failed, "headline": heads, "results": results,
               "counting": "bytes sent per rank per step. DistributedLion: comm_stats (bandwidth-optimal "
                           "counts of its all_to_all/all_gather/all_reduce, headers included). DDP: every tensor "
                           "the comm hook passes to torch.distributed.all_reduce, as a ring all-reduce "
                           "2(N-1)/N x bytes."}
        with open(os.path.join(args.out, "e2e_results.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(args.out, "e2e_table.txt"), "w") as f:
            f.write(text + "\n")
        nparams = results[0]["params"]
        plot(results, methods, os.path.join(args.out, "e2e_step_time.png"),
             f"dlion bench e2e: {world} ranks, CharGPT {nparams / 1e6:.1f} M params, batch "
             f"{cfg['batch_size']}×{cfg['block_size']}/rank, {os.cpu_count()} shared CPU cores"
             + (f", {cfg['nodes']} nodes × {cfg['per_node']}" if cfg.get("nodes") else ""), nodes=bool(cfg.get("nodes")))
        print(f"wrote {os.path.join(args.out, 'e2e_results.json')}, e2e_table.txt, e2e_step_time.png")
    return 1 if failed else 0
