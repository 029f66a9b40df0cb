"""``dlion experiment``: convergence sweeps on real offline data with simulated workers.

Examples::

    # 1. tune lr / weight decay per method at N = 8 on held-out training data
    dlion experiment --task mnist1d --tune --workers 8 --steps 120 --out docs/results/mnist1d
    # 2. the sweep, reading the tuned config; --resume skips finished runs
    dlion experiment --task mnist1d --workers 4,8,16,32 --seeds 0,1,2 --steps 120 \\
        --config docs/results/mnist1d/tuned.json --out docs/results/mnist1d --fig-dir docs/figures --resume
    # 3. redraw figures and tables from the results file, without training (methods, N,
    #    seeds and step budget default to those in the file; --merge: add the runs of
    #    shards of the same sweep run as separate processes, e.g. one per N)
    dlion experiment --task mnist1d --plot-only --config docs/results/mnist1d/tuned.json \\
        --out docs/results/mnist1d --fig-dir docs/figures [--merge DIR ...]

Methods are specs: a base name, or a compressor with its parameter after a colon —
``dgc:0.01`` (density 1 %), ``graddrop:0.001``, ``powersgd_adamw:4`` (rank 4) — so a
compression rate is swept by listing several, e.g.
``--methods dgc:0.001,dgc:0.01,dgc:0.05,powersgd_lion:1,powersgd_lion:2``.

Outputs in ``--out``: ``runs.jsonl`` (one line per finished run, written at
once: the resume log), ``tune_runs.jsonl`` and ``tuned.json`` (tuning),
``summary.csv`` / ``summary.json`` (mean ± std over seeds per method and N)
and the figures ``results_<task>_*.png`` (in ``--fig-dir``, default ``--out``;
``--fig-name`` changes the ``results_<task>`` part).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .runner import LOCAL_METHODS, METHODS, canonical, hparams_for, load_runs, run_real, sweep, tune
from .tasks import TASKS

__all__ = ["main", "build_parser"]

DEFAULT_BUDGET = {"mnist1d": 120, "digits": 120, "shakespeare": 200, "charlm": 2000}


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _floats(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _methods(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(METHODS)
    out = []
    for n in names:
        try:
            out.append(canonical(n))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (or 'all')") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlion experiment", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=TASKS, default="mnist1d")
    p.add_argument("--methods", type=_methods, default=None,
                   help=f"comma-separated specs (BASE or BASE:PARAM), or 'all' (the default for a sweep): "
                        f"{', '.join(METHODS)}; methods that talk every H steps (not in 'all'): "
                        f"{', '.join(f'{m}:H' for m in LOCAL_METHODS)}; --plot-only: default every method in the results file")
    p.add_argument("--workers", type=_ints, default=None,
                   help="N values, e.g. 4,8,16,32 (default 4,8,16,32; --plot-only: those in the file)")
    p.add_argument("--seeds", type=_ints, default=None, help="default 0,1,2 (--plot-only: those in the file)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per run, the same for every N (default: 120 for mnist1d/digits, "
                        "200 for shakespeare, 2000 for charlm; --plot-only: the budget of the runs in the file if they share one)")
    p.add_argument("--out", default="experiment_out", help="results directory")
    p.add_argument("--fig-dir", default=None, help="where the PNG figures go (default: --out)")
    p.add_argument("--fig-name", default=None,
                   help="figure files are FIG_NAME_{curves,final_vs_N,vs_bits}.png (default: results_TASK)")
    p.add_argument("--lrs", type=_floats, default=None,
                   help="--tune: search these learning rates instead of the family's grid (e.g. to extend it "
                        "past an edge where the best value landed); weight decay as in the grid")
    p.add_argument("--config", default=None, help="tuned hyperparameters (JSON written by --tune)")
    p.add_argument("--resume", action="store_true", help="continue a sweep: skip runs already in runs.jsonl")
    p.add_argument("--tune", action="store_true",
                   help="grid-search lr/wd per method at the first --workers value and first seed; write tuned.json")
    p.add_argument("--plot-only", action="store_true", help="only rebuild summary and figures from runs.jsonl")
    p.add_argument("--merge", nargs="+", default=[], metavar="DIR",
                   help="first append the runs of these result directories (shards of one sweep run in "
                        "parallel, e.g. one per N) to --out's runs.jsonl, skipping keys already there")
    p.add_argument("--real-ranks", action="store_true",
                   help="confirm the simulated path: train the first --methods / --workers / --seeds on that "
                        "many real Gloo ranks (DistributedLion), append the record to real_runs.jsonl and "
                        "compare its curve with the simulated run of the same key in runs.jsonl")
    p.add_argument("--stop-after", type=int, default=None,
                   help="--real-ranks: stop after this many steps of the --steps schedule")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (testing)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    task = args.task
    if not args.plot_only:
        args.methods = list(METHODS) if args.methods is None else args.methods
        args.workers = [4, 8, 16, 32] if args.workers is None else args.workers
        args.seeds = [0, 1, 2] if args.seeds is None else args.seeds
    budget = args.steps
    if budget is None and not args.plot_only:
        budget = DEFAULT_BUDGET[task]
    if budget is not None and budget < 1:
        print("dlion experiment: --steps must be >= 1", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    fig_dir = args.fig_dir or args.out

    if args.tune:
        path = os.path.join(args.out, "tune_runs.jsonl")
        config = tune(task, args.methods, args.workers[0], args.seeds[0], budget, path, quiet=args.quiet,
                      lrs=args.lrs)
        out = os.path.join(args.out, "tuned.json")
        with open(out, "w") as f:
            json.dump(config, f, indent=1)
        for m, c in config["methods"].items():
            print(f"{m:15s} lr={c['lr']:g} weight_decay={c['weight_decay']:g} score={c['score']:.4f}")
        print(f"wrote {out}")
        return 0

    runs_path = os.path.join(args.out, "runs.jsonl")
    config = None
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        if config.get("task", task) != task:
            print(f"dlion experiment: config is for task {config.get('task')!r}, not {task!r}", file=sys.stderr)
            return 2
    if args.real_ranks:
        return _confirm_real(args, task, budget, config, runs_path)
    if args.merge:
        have = {r["key"] for r in load_runs(runs_path)}
        added = 0
        with open(runs_path, "a") as f:
            for d in args.merge:
                for r in load_runs(os.path.join(d, "runs.jsonl")):
                    if r["key"] not in have:
                        f.write(json.dumps(r) + "\n")
                        have.add(r["key"])
                        added += 1
        print(f"merged {added} runs into {runs_path}")
    if not args.plot_only:
        if load_runs(runs_path) and not args.resume:
            print(f"dlion experiment: {runs_path} already holds runs; pass --resume to continue that sweep "
                  "(finished runs are skipped) or choose another --out", file=sys.stderr)
            return 2
        sweep(task, args.methods, args.workers, args.seeds, budget, runs_path, config,
              quiet=args.quiet, max_runs=args.max_runs)

    from .plots import report

    runs = [r for r in load_runs(runs_path) if r["task"] == task]
    if budget is None:  # --plot-only without --steps: the file's budget, if there is one
        budgets = sorted({r["budget"] for r in runs})
        if len(budgets) > 1:
            print(f"dlion experiment: {runs_path} holds runs of several budgets {budgets}; choose one with --steps",
                  file=sys.stderr)
            return 2
        budget = budgets[0] if budgets else DEFAULT_BUDGET[task]
    # this sweep's runs only: same budget, and the hyperparameters of the config in force
    runs = [r for r in runs if r["budget"] == budget
            and (args.methods is None or canonical(r["method"]) in args.methods or r["method"] in args.methods)
            and (args.workers is None or r["workers"] in args.workers)
            and (args.seeds is None or r["seed"] in args.seeds)
            and {"lr": r["lr"], "weight_decay": r["weight_decay"]} == hparams_for(config, task, r["method"])]
    if not runs:
        print("dlion experiment: no finished runs to summarise", file=sys.stderr)
        return 1
    for line in report(runs, args.out, fig_dir, args.fig_name):
        print(line)
    return 0


def _confirm_real(args, task: str, budget: int, config, runs_path: str) -> int:
    """--real-ranks: the same run on real ranks, compared point by point with the simulated one."""
    method, n, seed = args.methods[0], args.workers[0], args.seeds[0]
    hp = hparams_for(config, task, method)
    rec = run_real(task, method, n, seed, budget, hp, args.stop_after)
    with open(os.path.join(args.out, "real_runs.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    sim = {r["key"]: r for r in load_runs(runs_path)}.get(rec["key"])
    print(f"{method} N={n} seed={seed}: {rec['steps']} steps on {n} real ranks in {rec['seconds']:.0f} s; "
          f"parameters bitwise equal on every rank: {rec['ranks_bitwise_equal']}")
    if sim is None:
        print(f"no simulated run with key {rec['key']} in {runs_path} to compare with")
        return 0 if rec["ranks_bitwise_equal"] else 1
    simulated = {c[2]: c[1] for c in sim["curve"]}
    diffs = []
    print("step   simulated   real ranks   |difference|")
    for progress, real, step in rec["curve"]:
        if step in simulated:
            diffs.append(abs(real - simulated[step]))
            print(f"{step:>5.0f}   {simulated[step]:.5f}     {real:.5f}      {diffs[-1]:.2e}")
    if diffs:
        print(f"largest difference of the validation loss: {max(diffs):.2e}")
    return 0 if rec["ranks_bitwise_equal"] else 1
