"""``dlion bench ttq``: how long until the model reaches validation loss L on this link?

1. **Curves** (real ranks, loopback): every method of ``--methods`` trains the same
   CharGPT on Shakespeare for ``--steps`` steps on ``--workers`` Gloo ranks (each rank its
   own random windows, the same seeds for every method), with ``--warmup-frac`` linear lr
   warm-up then cosine decay to 10 %, and rank 0 evaluates the validation loss every
   ``--eval-every`` steps on ``--eval-batches`` fixed held-out batches. The methods are the
   e2e benchmark's (:mod:`dlion.lab.bench.e2e.methods`): DDP + Lion / AdamW with fp32, bf16
   or PowerSGD communication, DistributedLion, and the methods that talk every H =
   ``--sync-every`` steps (LocalDistributedLion ``d-local-mavo[-st]``, ``d-local-avg[-st]``, DiLoCo ``diloco-*`` with
   ``--outer-lr``, Streaming DiLoCo ``diloco-*-st``), evaluated at their agreed parameters (``opt.anchored()``; a streaming round
   in flight is applied after the last step only; an evaluation at bitwise the parameters of the
   last one reuses its loss, :class:`CachedEvaluate`). Each method's ``runs`` entry records the
   bits rank 0 sent per parameter per step over the whole run (``bits_sent_per_param_per_step``:
   the library's byte counters, the DDP methods' all-reduces as e2e counts them).
2. **Target**: L = G-Lion's validation loss at its last evaluation; each method's
   steps-to-L is its first evaluation at or below L (a method that never gets there is
   reported with its best loss).
3. **Time**: time-to-L at each link rate = steps-to-L × the method's mean step time at
   that rate (slow steps count: a run's wall clock is their sum), read from a ``dlion bench
   e2e`` result (``--step-times``) measured on the virtual cluster with the *same* model,
   batch and rank count (checked). Results written before e2e recorded means give medians;
   the output says which (``step_time_statistic``).
   ``--extend FILE`` adds methods to an earlier run: only the methods of ``--methods`` that
   FILE lacks are trained, with FILE's workload (model, batch, lr, steps, seed), and their
   curves join FILE's (G-Lion's included), so one slow method need not re-run the others.
4. **Check** (``--check-link RATE``, root needed): train ``--check-methods`` for
   ``--check-steps`` steps end to end on the shaped links and compare the measured wall
   time with steps × the e2e step time (the composition above is trusted if they agree).

Output in ``--out``: ``ttq_results.json`` (every curve, steps- and time-to-L, speedups),
``ttq_table.txt`` and ``ttq_loss_vs_time.png`` (validation loss against wall clock, one
panel per link rate). ``--across F1 F2 …`` puts the composed results of several seeds side
by side instead (:mod:`dlion.lab.bench.ttq_seeds`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import torch

from dlion.lab.cluster import rate_key

from .e2e.methods import add_local_vote_args, takes_ties

DEFAULT_METHODS = ("g-lion,g-adamw,g-lion-bf16,g-lion-powersgd1,g-lion-powersgd2,g-lion-powersgd4,"
                   "g-adamw-powersgd1,g-adamw-powersgd2,g-adamw-powersgd4,d-mavo-1bit-ov,d-avg-1bit-ov,"
                   "d-mavo-quant-ov")
CHECK_SKIP = 3
MODEL_KEYS = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "ties", "quant_bits", "bucket_mb")


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10 % at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _val_batches(val_ids, cfg: dict) -> list:
    from dlion.lab.data import char_batches

    g = torch.Generator().manual_seed(12345)
    return [char_batches(val_ids, cfg["block_size"], 32, g) for _ in range(cfg["eval_batches"])]


@torch.no_grad()
def evaluate(model, batches: list) -> float:
    losses = [float(model(x, y)[1]) for x, y in batches]
    return sum(losses) / len(losses)


class CachedEvaluate:
    """:func:`evaluate`, reusing the last loss while the model's parameters and buffers are bitwise
    those it was computed at. Methods that talk every H steps move their agreed parameters only at
    a sync, so at H = 100 nine of every ten evaluations would recompute the same loss (on this
    host most of such a run's time). The comparison is exact, so the curve is unchanged."""

    def __init__(self, batches: list):
        self.batches, self.seen, self.loss = batches, None, None

    @torch.no_grad()
    def __call__(self, model) -> float:
        now = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.seen is None or not all(torch.equal(a, b) for a, b in zip(self.seen, now)):
            self.loss = evaluate(model, self.batches)
            self.seen = [t.clone() for t in now]
        return self.loss


def train_rank(rank: int, world: int, cfg: dict, emit: Callable[[dict], None]) -> None:
    """Train every method in turn on this rank; rank 0 emits each method's curve."""
    import torch.distributed as dist

    from dlion.lab.data import char_batches, load_shakespeare

    from .e2e.instrument import Instrument
    from .e2e.methods import MethodRun, talks_every_h

    torch.set_num_threads(1)
    train_ids, val_ids, vocab = load_shakespeare()
    val = _val_batches(val_ids, cfg) if rank == 0 else []
    inst = Instrument()
    inst.install()  # counts the DDP methods' all-reduce bytes (the others count their own)
    for method in cfg["methods"]:
        run = MethodRun(method, rank, cfg, len(vocab), inst)
        every_h = talks_every_h(method)
        base = [g["lr"] for g in run.opt.param_groups]
        g = torch.Generator().manual_seed(1000 * cfg["seed"] + rank)
        warm = max(1, int(cfg["warmup_frac"] * cfg["steps"]))
        curve, train_s = [], 0.0
        # methods talking every H steps: evaluate the agreed parameters (the anchor, DiLoCo's θ), not
        # rank 0's local ones; a streaming round in flight is applied after the last step only
        agreed = run.opt.anchored if every_h else contextlib.nullcontext
        if rank == 0:
            evaluate_now = CachedEvaluate(val)
            with agreed():
                curve.append((0, evaluate_now(run.model)))
        dist.barrier()
        for step in range(cfg["steps"]):
            for grp, lr in zip(run.opt.param_groups, base):
                grp["lr"] = lr * lr_factor(step, cfg["steps"], warm)
            x, y = char_batches(train_ids, cfg["block_size"], cfg["batch_size"], g)
            t = time.perf_counter()
            run.step(x, y, measure=True)
            train_s += time.perf_counter() - t
            if every_h and step + 1 == cfg["steps"]:
                run.opt.flush()  # every rank (untimed, like the evaluations)
            if rank == 0:
                emit({"tick": 1})
                if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
                    with agreed():
                        curve.append((step + 1, evaluate_now(run.model)))
        dist.barrier()
        run.end_measure()  # a last exchange in flight counts too
        sent = run.result()["bytes_sent_per_step"]  # this rank's, over every step of the run (every rank calls it)
        if not every_h and hasattr(run.opt, "check_replicas"):  # (result() checked the others)
            run.opt.check_replicas()
        if rank == 0:
            emit({"method": method, "curve": curve, "train_s": train_s, "params": run.params,
                  "optimizer_state_bytes": _state_bytes(run.opt), "bytes_sent_per_step": sent,
                  "median_step_ms": 1e3 * sorted(run.step_s)[len(run.step_s) // 2], "step_s": run.step_s})
        del run


def _state_bytes(opt) -> int:
    """Bytes of this rank's optimizer state tensors (momenta; step counters excluded). The
    hierarchical optimizer keeps its momentum slices outside ``opt.state``: it reports them."""
    if hasattr(opt, "momentum_numel"):
        return opt.momentum_numel * torch.empty(0, dtype=opt.momentum_dtype or torch.float32).element_size()
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if isinstance(v, torch.Tensor) and k != "step")


def steps_to(curve: list, target: float) -> Optional[int]:
    """First evaluated step whose loss is at or below ``target`` (None if never)."""
    for step, loss in curve:
        if loss <= target:
            return step
    return None


def seconds_at(steps: int, ms: float, warm_ms: Optional[float] = None, warm_steps: int = 0) -> float:
    """Wall time of ``steps`` steps of ``ms`` each, the first ``warm_steps`` of them ``warm_ms`` each."""
    if warm_ms is None:
        return steps * ms / 1e3
    return (min(steps, warm_steps) * warm_ms + max(steps - warm_steps, 0) * ms) / 1e3


def compose(curves: dict, step_ms: dict, reference: str = "g-lion", target: Optional[float] = None,
            warmup: Optional[tuple[int, dict]] = None) -> dict:
    """Steps-to-L and time-to-L (per link) of every method; L = ``target``, by default the
    reference's final loss. ``warmup = (K, {method: {link: ms}})``: those methods' first K steps
    take the warm-up step time, the rest ``step_ms``'s (``--sync-warmup K``)."""
    target = curves[reference][-1][1] if target is None else target
    out = {"target_loss": target, "reference": reference, "methods": {}}
    K, warm_ms = warmup if warmup is not None else (0, {})
    for m, curve in curves.items():
        s = steps_to(curve, target)
        row = {"steps_to_target": s, "best_loss": min(loss for _, loss in curve), "final_loss": curve[-1][1],
               "time_to_target_s": {}}
        for link, ms in step_ms.get(m, {}).items():
            row["time_to_target_s"][link] = None if s is None else seconds_at(s, ms, warm_ms.get(m, {}).get(link), K)
        out["methods"][m] = row
    links = sorted({link for m in step_ms.values() for link in m})
    out["speedups"] = {}
    for link in links:
        times = {m: r["time_to_target_s"].get(link) for m, r in out["methods"].items()}
        reached = {m: t for m, t in times.items() if t is not None}
        if not reached:
            continue
        fastest = min(reached, key=reached.get)
        peers = {m: t for m, t in reached.items() if "powersgd" in m}
        best_psgd = min(peers, key=peers.get) if peers else None
        out["speedups"][link] = {
            "fastest": fastest,
            "best_powersgd": best_psgd,
            "vs_glion": {m: (times[reference] / t if times.get(reference) else None) for m, t in reached.items()},
            "vs_best_powersgd": {m: (peers[best_psgd] / t) for m, t in reached.items()} if best_psgd else {},
        }
    return out


def table(comp: dict, links: list[str]) -> str:
    from .e2e.methods import label

    lines = [f"target L = {comp['target_loss']:.4f} nats/char"
             + (" (G-Lion's final validation loss)" if comp.get("target_is_reference") else " (given)"),
             f"{'method':<36} {'steps→L':>8} {'best loss':>9} " + " ".join(f"{'t→L @' + k:>14}" for k in links)]
    lines.append("-" * len(lines[-1]))
    for m, r in comp["methods"].items():
        s = r["steps_to_target"]
        cells = []
        for k in links:
            t = r["time_to_target_s"].get(k)
            cells.append(f"{'never' if s is None else ('-' if t is None else f'{t:.1f} s'):>14}")
        lines.append(f"{label(m):<36} {('never' if s is None else str(s)):>8} {r['best_loss']:>9.4f} " + " ".join(cells))
    for k in links:
        sp = comp["speedups"].get(k)
        if not sp:
            continue
        f = sp["fastest"]
        txt = f"  {k}: fastest to L: {label(f)}"
        if sp["vs_glion"].get(f):
            txt += f", {sp['vs_glion'][f]:.2f}× faster than G-Lion"
        if sp["best_powersgd"]:
            txt += f"; best PowerSGD: {label(sp['best_powersgd'])}"
            mavo = [m for m in sp["vs_best_powersgd"] if m.startswith("d-mavo")]
            for m in mavo:
                txt += f"; {label(m)} {sp['vs_best_powersgd'][m]:.2f}× vs it"
        lines.append(txt)
    return "\n".join(lines)


def plot_steps(curves: dict, comp: dict, path: str, title: str) -> None:
    """Validation loss against steps (no step times given: nothing to put on a time axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .e2e.methods import label

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m, curve in curves.items():
        ax.plot([s for s, _ in curve if s > 0], [loss for s, loss in curve if s > 0], label=label(m),
                lw=2.5 if m == "g-lion" else 1.5)
    ax.axhline(comp["target_loss"], color="black", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def state_text(runs: dict) -> str:
    """Per method: its optimizer state per rank and, where recorded, the bits one rank sent per
    parameter per step over the whole run."""
    from .e2e.methods import label

    rows = [(m, r["optimizer_state_bytes"], r.get("bits_sent_per_param_per_step")) for m, r in runs.items()
            if "optimizer_state_bytes" in r]
    if not rows:
        return ""
    return "optimizer state per rank (and bits one rank sent per parameter per step, over the run):\n" + "\n".join(
        f"  {label(m):<44} {b / 2**20:8.2f} MiB" + ("" if bits is None else f"  {bits:7.3f} bits") for m, b, bits in rows)


def plot(curves: dict, step_ms: dict, comp: dict, links: list[str], path: str, title: str,
         warmup: Optional[tuple[int, dict]] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    from .e2e.methods import label

    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 5), squeeze=False)
    K, warm = warmup if warmup is not None else (0, {})
    for ax, link in zip(axes[0], links):
        palette = itertools.cycle(["tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                                   "tab:gray", "gold", "navy", "teal", "crimson", "darkkhaki"])
        for m, curve in curves.items():
            ms = step_ms.get(m, {}).get(link)
            if ms is None:
                continue
            warm_ms = warm.get(m, {}).get(link)
            pts = [(seconds_at(s, ms, warm_ms, K), loss) for s, loss in curve if s > 0]  # log axis: from the first evaluation
            if m == "g-lion":
                style = dict(lw=2.5, color="tab:red")
            elif m == "d-mavo-1bit-ov":
                style = dict(lw=2.5, color="tab:blue")
            elif m == "g-adamw":
                style = dict(lw=2, color="tab:orange")
            else:
                style = dict(lw=1.3, color=next(palette), ls="--" if "powersgd" in m else "-")
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=label(m), **style)
        ax.axhline(comp["target_loss"], color="black", ls=":", lw=1)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # a narrow range labels every minor tick
        ax.set_xlabel("wall clock (s, log scale): steps × measured step time")
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(f"link {link}")
        ax.grid(True, alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:  # methods without step times draw nothing
        axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dlion bench ttq", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-node", type=int, default=0,
                    help="ranks per node for the hierarchical methods h-* (loopback: nodes are only a grouping)")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches of 32 windows (default 8)")
    ap.add_argument("--warmup-frac", type=float, default=0.05)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-3, help="Lion lr (AdamW gets 10x, its wd /10)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.99), metavar=("BETA1", "BETA2"),
                    help="Lion's and D-Lion's betas (default 0.9 0.99; AdamW keeps its own defaults)")
    ap.add_argument("--ties", default="zero", choices=("zero", "random", "previous"))
    ap.add_argument("--sync-every", type=int, default=10, metavar="H",
                    help="local steps per sync of d-local-* and diloco-* (default 10; --step-times must have it too)")
    ap.add_argument("--sync-warmup", type=int, default=0, metavar="K",
                    help="d-local-*: the first K steps each end a round (LocalDistributedLion(sync_warmup=K)); "
                         "such curves are composed with --step-times only together with --warmup-step-times")
    ap.add_argument("--warmup-step-times", default=None, metavar="E2E_RESULTS",
                    help="with --sync-warmup K: e2e_results.json of `dlion bench e2e --sync-every 1` (same model "
                         "and options); the d-local-* methods' first K steps take its step times")
    add_local_vote_args(ap)
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer Nesterov SGD lr (default 0.7)")
    ap.add_argument("--quant-bits", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-times", default=None, help="e2e_results.json of `dlion bench e2e` with this model")
    ap.add_argument("--compute-speedup", type=float, default=None, metavar="K",
                    help="emulate a host K times faster at compute: the step times of --step-times, measured at "
                         "link rates K times slower, are divided by K and labelled with K × their rate")
    ap.add_argument("--links", default=None, help="compose only these link rates of --step-times (after "
                                                  "--compute-speedup), comma separated")
    ap.add_argument("--target", type=float, default=None,
                    help="target validation loss L (default: G-Lion's final validation loss, and G-Lion is "
                         "then trained whether listed or not)")
    ap.add_argument("--curves", default=None, help="re-compose the curves of an earlier ttq_results.json (its workload; no training)")
    ap.add_argument("--extend", default=None,
                    help="train only the --methods missing from this earlier ttq_results.json, with its workload, "
                         "and merge the curves")
    ap.add_argument("--across", nargs="+", default=None, metavar="TTQ_RESULTS",
                    help="summarize composed results of several seeds (same workload, --target and --step-times): "
                         "time to L per seed, means, who is first (writes ttq_seeds.* to --out; no training)")
    ap.add_argument("--borrow-curve", action="append", default=[], metavar="METHOD=FROM",
                    help="compose METHOD (with its own step times) from FROM's curve, e.g. "
                         "g-adamw-powersgd4-ov=g-adamw-powersgd4: PowerSGD compresses each tensor whatever the "
                         "bucketing, only the random starting Q of each matrix differs (repeatable; the output "
                         "says which curves are borrowed)")
    ap.add_argument("--check-link", default=None, help="also train --check-methods end to end at this rate")
    ap.add_argument("--check-methods", default="d-mavo-1bit-ov,g-lion-powersgd2")
    ap.add_argument("--check-steps", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=os.path.join("runs", "bench-ttq"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def _step_times(path: str, cfg: dict, workers: int, phase: str = "rounds") -> tuple[dict, str]:
    """(method -> {link: ms per step}, "mean" or "median") from an e2e result, refusing one of
    another workload. The mean where the result has it (a run's time is the sum of its steps).
    ``phase``: "rounds" (the step times of rounds of H, ``--step-times``; curves trained with
    ``--sync-warmup`` are then refused), "rounds+warmup" (the same, their warm-up timed apart) or
    "warmup" (``--warmup-step-times``: the d-local-* methods measured with ``--sync-every 1``)."""
    with open(path) as f:
        doc = json.load(f)
    other = doc["config"]
    # --ties matters only to the methods that take it (not to -rt / -pt methods, nor to DDP's)
    ties_matter = any(takes_ties(m) for m in cfg.get("methods", ()))
    diff = [k for k in MODEL_KEYS if k in other and other[k] != cfg[k] and (k != "ties" or ties_matter)]
    if diff or doc["workers"] != workers:
        raise SystemExit(f"dlion bench ttq: {path} was measured with another workload "
                         f"({', '.join(f'{k}={other[k]!r}' for k in diff) or 'workers=' + str(doc['workers'])}); "
                         f"run `dlion bench e2e` with the same model, batch and ranks")
    from .e2e.methods import split_sync_every, sync_every_of, talks_every_h

    # the step time of a method talking every H steps is the mean over whole rounds of that H: each such
    # method trained here takes the e2e result of the same method at the same H (its own name, or its
    # name + "-h<H>" from a run that timed several H side by side)
    default_h = other.get("sync_every", 10)
    measured_h = {r["method"]: r.get("sync_every", sync_every_of(r["method"], default_h)) for r in doc["results"]}
    local = [m for m in cfg.get("methods", ()) if talks_every_h(m)
             and any(split_sync_every(r)[0] == split_sync_every(m)[0] for r in measured_h)]
    vote = [m for m in local if m.startswith("d-local")]  # (LocalDistributedLion's options)
    if vote and cfg.get("sync_warmup", 0) and phase == "rounds":
        raise SystemExit(f"dlion bench ttq: these curves were trained with --sync-warmup {cfg['sync_warmup']}: "
                         f"their first {cfg['sync_warmup']} steps sync every step and the rest every "
                         f"{cfg.get('sync_every', 10)}, which one measured step time per method does not cover: "
                         "give --warmup-step-times, measured with `dlion bench e2e --sync-every 1`")
    if phase == "warmup" and not vote:
        raise SystemExit(f"dlion bench ttq: --warmup-step-times {path} has no step times of the d-local-* "
                         f"methods trained here ({', '.join(cfg.get('methods', ()))})")
    if vote and cfg.get("abstain_below", 0.0) != other.get("abstain_below", 0.0):
        raise SystemExit(f"dlion bench ttq: these curves were trained with --abstain-below {cfg.get('abstain_below', 0.0)}, "
                         f"{path} measured d-local-* with {other.get('abstain_below', 0.0)}: abstentions change the bytes")
    streamed = any(split_sync_every(m)[0].endswith("-st") for m in local) and phase == "rounds"
    for flag, key, default in (("--stream-delay", "stream_delay", None), ("--fragments", "fragments", 1),
                               ("--fragment-alpha", "fragment_alpha", 0.0)):
        if streamed and cfg.get(key, default) != other.get(key, default):  # (each decides what hides behind compute)
            raise SystemExit(f"dlion bench ttq: these curves were trained with {flag} {cfg.get(key, default)}, "
                             f"{path} timed the streamed vote with {other.get(key, default)}: it decides how much "
                             "of the exchange hides behind compute")
    source = {}  # method trained here -> the e2e result timed at its H
    for m in local:
        want_h = 1 if phase == "warmup" else sync_every_of(m, cfg.get("sync_every", 10))
        base = split_sync_every(m)[0]
        found = [r for r in (m, f"{base}-h{want_h}", base) if measured_h.get(r) == want_h]
        if not found:
            timed = sorted(f"{r} (H = {h})" for r, h in measured_h.items() if split_sync_every(r)[0] == base)
            raise SystemExit(f"dlion bench ttq: {path} measured {', '.join(timed)}, not {m} at H = {want_h}: "
                             "its step times depend on H; run "
                             + ("`dlion bench e2e --sync-every 1` for the warm-up" if phase == "warmup" else
                                f"`dlion bench e2e --methods {base}-h{want_h}` or train with that H"))
        source[m] = found[0]
    stat = "mean" if all("ms_mean" in r for r in doc["results"]) else "median"
    out: dict = {}
    for r in doc["results"]:
        if r["method"] not in source and phase != "warmup":  # (those trained here at another H: below)
            out.setdefault(r["method"], {})[r["link"]] = r["ms_mean" if stat == "mean" else "ms_per_step"]
    for m, r_name in source.items():
        if phase != "warmup" or m in vote:
            for r in doc["results"]:
                if r["method"] == r_name:
                    out.setdefault(m, {})[r["link"]] = r["ms_mean" if stat == "mean" else "ms_per_step"]
    return out, stat


EMULATED_QUEUE_S = 0.05  # `dlion bench e2e`'s default link queue, which an emulated host's links must have


def faster_compute(step_ms: dict, k: float) -> dict:
    """Step times of a host ``k`` times faster at compute, from those measured on this one at a
    link ``k`` times slower: a step's compute and its wire both take ``k`` times longer here than
    there, so ``ms / k`` at rate ``k`` × the measured rate. ``{"m": {"12500kbit": 400.0}}`` with
    ``k = 4`` → ``{"m": {"50mbit": 100.0}}``. (The host's CPU work that a faster accelerator would
    not speed up is scaled too: optimistic for the method with the most of it.)"""
    from dlion.lab.cluster import format_rate, parse_rate

    if not k > 0:
        raise ValueError(f"--compute-speedup must be > 0, got {k}")
    out: dict = {}
    for m, per_link in step_ms.items():
        for link, ms in per_link.items():
            bps = parse_rate(link)
            if bps is None:
                raise ValueError(f"--compute-speedup: {m} was measured on an unshaped link ({link}); "
                                 "only shaped link rates scale")
            out.setdefault(m, {})[format_rate(round(bps * k))] = ms / k
    return out


def emulated_step_times(path: str, step_ms: dict, k: float) -> dict:
    """:func:`faster_compute` of ``step_ms`` (read from the e2e result ``path``), refusing a
    result whose links' queue, at the emulated rates, is not the default 50 ms: only then do the
    queues hold as many packets as on the host emulated."""
    from .e2e import queue_seconds

    with open(path) as f:
        queue = json.load(f)["config"].get("queue", "50ms")
    if k > 0 and not math.isclose(queue_seconds(queue) / k, EMULATED_QUEUE_S):
        raise ValueError(f"--compute-speedup {k:g}: {path} was measured with a {queue} link queue, "
                         f"{queue_seconds(queue) / k * 1e3:g} ms at the emulated rates; run `dlion bench e2e "
                         f"--queue {EMULATED_QUEUE_S * k * 1e3:g}ms` so that the queues hold as many packets "
                         "as the default 50 ms does at the emulated rates")
    return faster_compute(step_ms, k)


def only_links(step_ms: dict, links: list[str]) -> dict:
    """The step times at ``links`` only (rates compared as rates: ``1000mbit`` is ``1gbit``)."""
    from dlion.lab.cluster import parse_rate

    want = {parse_rate(k.strip()) for k in links if k.strip()}
    have = {parse_rate(k) for per_link in step_ms.values() for k in per_link}
    missing = sorted(want - have, key=lambda r: r or 0)
    if missing:
        raise ValueError(f"--links: no step times at {', '.join(str(r) + ' bit/s' for r in missing)} "
                         f"(have: {', '.join(sorted({k for v in step_ms.values() for k in v}))})")
    return {m: {k: ms for k, ms in per_link.items() if parse_rate(k) in want} for m, per_link in step_ms.items()}


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.worker is not None:
        from .launch import env_worker

        cfg = json.loads(args.worker)
        return env_worker(train_rank, cfg, timeout_s=cfg["timeout"])
    if args.across:
        from .ttq_seeds import run

        return run(args.across, args.out)
    from .e2e.methods import methods_from_args

    methods = methods_from_args(ap, args)
    if args.sync_warmup < 0:
        ap.error(f"--sync-warmup must be >= 0, got {args.sync_warmup}")
    if "g-lion" not in methods and args.target is None:
        methods = ["g-lion"] + methods  # the reference that defines L (with --target, only if asked for)
    cfg = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "block_size": args.block_size,
           "batch_size": args.batch_size, "bucket_mb": args.bucket_mb, "lr": args.lr,
           "weight_decay": args.weight_decay, "betas": list(args.betas), "ties": args.ties,
           "quant_bits": args.quant_bits, "seed": args.seed,
           "steps": args.steps, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
           "warmup_frac": args.warmup_frac, "methods": methods, "timeout": args.timeout, "synthetic": False,
           "sequential": True, "warmup": 0, "per_node": args.per_node, "sync_every": args.sync_every,
           "sync_warmup": args.sync_warmup, "abstain_below": args.abstain_below, "outer_scale": args.outer_scale,
           "reset_momentum": args.reset_momentum, "stream_delay": args.stream_delay, "fragments": args.fragments,
           "fragment_alpha": args.fragment_alpha, "outer_lr": args.outer_lr,
           "nodes": args.workers // args.per_node if args.per_node else 0}
    if args.curves and args.extend:
        ap.error("--extend trains and merges; --curves only re-composes: give one of them")
    stored = None  # the earlier run whose workload (and curves) this one takes
    if args.curves or args.extend:
        with open(args.curves or args.extend) as f:
            stored = json.load(f)
        cfg = {"per_node": 0, "nodes": 0, "sync_every": 10, "outer_lr": 0.7, **stored["config"], "timeout": args.timeout}
    if args.curves:
        args.workers = stored["workers"]
    if args.extend:
        if stored["workers"] != args.workers:
            ap.error(f"--extend {args.extend} was run on {stored['workers']} ranks, not --workers {args.workers}")
        methods = cfg["methods"] = [m for m in methods if m not in stored["curves"]]
        print(f"dlion bench ttq: workload of {args.extend} (its flags override these); "
              f"training {', '.join(methods) or 'nothing new'}")
    if args.warmup_step_times and not (args.step_times and cfg.get("sync_warmup", 0)):
        ap.error("--warmup-step-times times the --sync-warmup steps of curves composed with --step-times: "
                 "give both, with curves trained with --sync-warmup K > 0")
    phase = "rounds+warmup" if args.warmup_step_times else "rounds"
    step_ms, step_stat = _step_times(args.step_times, cfg, args.workers, phase) if args.step_times else ({}, None)
    warm_ms = _step_times(args.warmup_step_times, cfg, args.workers, "warmup")[0] if args.warmup_step_times else {}
    measured_ms, measured_warm_ms = step_ms, warm_ms
    if args.compute_speedup is not None:
        if not args.step_times:
            ap.error("--compute-speedup scales the step times of --step-times: give them")
        if args.check_link:
            ap.error("--check-link trains on this host's links: it cannot check emulated step times "
                     "(drop --compute-speedup)")
        try:
            step_ms = emulated_step_times(args.step_times, step_ms, args.compute_speedup)
            if warm_ms:
                warm_ms = emulated_step_times(args.warmup_step_times, warm_ms, args.compute_speedup)
        except ValueError as e:
            ap.error(str(e))
    if args.links:
        try:
            step_ms = only_links(step_ms, args.links.split(","))
            warm_ms = only_links(warm_ms, args.links.split(",")) if warm_ms else warm_ms
        except ValueError as e:
            ap.error(str(e))
    missing = [f"{m} at {k}" for m in warm_ms for k in step_ms.get(m, {}) if k not in warm_ms[m]]
    if missing:
        ap.error(f"--warmup-step-times {args.warmup_step_times} has no step time of {', '.join(missing)}")
    os.makedirs(args.out, exist_ok=True)
    bar = None
    if not args.no_progress and not args.curves and methods:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(methods) * cfg["steps"], desc="ttq curves", unit="step")
        except ImportError:
            bar = None
    t0 = time.time()
    if stored is not None and not (args.extend and methods):  # nothing to train
        curves = {m: [tuple(p) for p in c] for m, c in stored["curves"].items()}
        extra = stored.get("runs", {})
    else:
        from .launch import run_loopback

        import torch._dynamo  # noqa: F401  (forked ranks inherit it)
        per_rank = run_loopback(train_rank, args.workers, cfg, timeout_s=args.timeout,
                                on_tick=None if bar is None else lambda: bar.update(1))
        curves = {d["method"]: [tuple(p) for p in d["curve"]] for d in per_rank[0]}
        extra = {d["method"]: {"train_s": d["train_s"], "loopback_median_step_ms": d["median_step_ms"],
                               "params": d["params"], "optimizer_state_bytes": d["optimizer_state_bytes"],
                               "bits_sent_per_param_per_step": 8 * d["bytes_sent_per_step"] / d["params"]}
                 for d in per_rank[0]}
        if stored is not None:  # --extend: the earlier curves first, then the new ones
            curves = {**{m: [tuple(p) for p in c] for m, c in stored["curves"].items()}, **curves}
            extra = {**stored.get("runs", {}), **extra}
            cfg["methods"] = list(curves)
    if bar is not None:
        bar.close()
    from .e2e.methods import is_method

    borrowed = {}
    for item in args.borrow_curve:
        method, _, source = item.partition("=")
        if source not in curves:
            ap.error(f"--borrow-curve {item}: no curve of {source!r} (curves: {', '.join(curves)})")
        if method in curves or not is_method(method):
            ap.error(f"--borrow-curve {item}: {method!r} " + ("has its own curve" if method in curves
                                                              else "is not a method"))
        curves[method] = curves[source]
        borrowed[method] = source
    links = sorted({k for m in step_ms.values() for k in m}, key=rate_key)
    warmup = (cfg["sync_warmup"], warm_ms) if warm_ms else None
    comp = compose(curves, step_ms, target=args.target, warmup=warmup)
    comp["target_is_reference"] = args.target is None
    doc = {"benchmark": "dlion bench ttq", "config": cfg, "workers": args.workers, "curves": curves,
           "runs": extra, "step_times_ms": step_ms, "step_times_from": os.path.basename(args.step_times or ""),
           "step_time_statistic": step_stat, "borrowed_curves": borrowed,
           "compute_speedup": args.compute_speedup, "measured_step_times_ms": measured_ms,
           **({"warmup_step_times_ms": warm_ms, "warmup_step_times_from": os.path.basename(args.warmup_step_times),
               "measured_warmup_step_times_ms": measured_warm_ms} if warm_ms else {}),
           "composed": comp, "elapsed_s": time.time() - t0}
    if args.check_link:
        doc["check"] = _check(args, cfg, step_ms)
    text = table(comp, links)
    if step_stat:
        text = f"times: steps × the {step_stat} step time of {os.path.basename(args.step_times)}\n" + text
    if warm_ms:
        text = (f"{', '.join(warm_ms)}: the first {cfg['sync_warmup']} steps (--sync-warmup) × the step time of "
                f"--warmup-step-times {args.warmup_step_times}, the rest × that of --step-times\n") + text
    if args.compute_speedup is not None:
        text = (f"emulated host {args.compute_speedup:g}× faster at compute: each step time measured at a link "
                f"{args.compute_speedup:g}× slower, divided by {args.compute_speedup:g}\n") + text
    if borrowed:
        text += "\n" + "\n".join(f"{m}: the curve of {src} (borrowed), with {m}'s step times"
                                  for m, src in borrowed.items())
    if state_text(extra):
        text += "\n\n" + state_text(extra)
    if "check" in doc:
        text += "\n\n" + _check_text(doc["check"])
    print(text)
    with open(os.path.join(args.out, "ttq_results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "ttq_table.txt"), "w") as f:
        f.write(text + "\n")
    p = extra.get("g-lion", {}).get("params") or _params_from(args.step_times)
    if links:
        plot(curves, step_ms, comp, links, os.path.join(args.out, "ttq_loss_vs_time.png"),
             f"dlion bench ttq: {args.workers} ranks, CharGPT {p / 1e6 if p else 0:.2f} M params, "
             f"{cfg['steps']} steps; time = steps × step time measured on the shaped links"
             + (f"\n(emulated: compute {args.compute_speedup:g}× faster, see docs)" if args.compute_speedup else ""),
             warmup=warmup)
    else:
        plot_steps(curves, comp, os.path.join(args.out, "ttq_loss_vs_step.png"),
                   f"dlion bench ttq: {args.workers} ranks, CharGPT {p / 1e6 if p else 0:.2f} M params, "
                   f"{cfg['steps']} steps (no step times given)")
    print(f"wrote {os.path.join(args.out, 'ttq_results.json')}, ttq_table.txt, "
          + ("ttq_loss_vs_time.png" if links else "ttq_loss_vs_step.png"))
    return 0


def _params_from(path: Optional[str]) -> int:
    if not path:
        return 0
    with open(path) as f:
        return int(json.load(f)["results"][0]["params"])


def _check(args, cfg: dict, step_ms: dict) -> dict:
    """Train a few methods end to end on the shaped links; compare with the composed time."""
    from .e2e.methods import parse_methods
    from .launch import run_cluster

    methods = parse_methods(args.check_methods)
    ccfg = dict(cfg, methods=methods, steps=args.check_steps, eval_every=10**9, eval_batches=1)
    cmd = [sys.executable, "-m", "dlion.lab.bench.ttq", "--worker", json.dumps(ccfg)]
    out = {"link": args.check_link, "steps": args.check_steps, "methods": {}}
    runs = run_cluster(cmd, args.workers, [args.check_link], prefix=f"dlq{os.getpid() % 100000}",
                       timeout=args.timeout)
    skip = CHECK_SKIP  # like the e2e warm-up: PowerSGD's first steps are uncompressed fp32
    out["skipped_first_steps"] = skip
    for link, per_rank, results in runs:
        for d in per_rank[0]:
            m = d["method"]
            timed = d["step_s"][skip:]
            composed = len(timed) * step_ms.get(m, {}).get(link, float("nan")) / 1e3
            out["methods"][m] = {"measured_s": sum(timed), "composed_s": composed,
                                 "ratio": sum(timed) / composed if composed else None}
    return out


def _check_text(check: dict) -> str:
    from .e2e.methods import label

    lines = [f"end-to-end check at {check['link']}: {check['steps']} training steps on the shaped links "
             f"(the first {check['skipped_first_steps']} not timed, as in e2e's warm-up)"]
    for m, r in check["methods"].items():
        lines.append(f"  {label(m):<36} measured {r['measured_s']:.1f} s, composed (steps × e2e step time) "
                     f"{r['composed_s']:.1f} s, measured/composed = {r['ratio']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
