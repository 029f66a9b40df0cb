"""What the first syncs of a local-vote run do: the rounds where a long-round run goes wrong.

    python -m dlion.lab.experiments.local_early --specs dlocal_mavo:50:alpha=0.67:vote=avg,dlocal_mavo:50:alpha=0.83:vote=avg \\
        --config docs/results/charlm-local/configs/avg_variants_lr3e-4.json --seed 0 --steps 200 --out docs/results/local-early

The ``charlm`` runs of ``runner.run_one`` (N = 4, the schedule of a ``--budget``-step run), stopped after
``--steps`` steps. At every sync, before it: the validation loss of rank 0's own copy and of the mean
of the N copies (model averaging, what 32 bits would buy), the round's summed lr S, mean |d_i| / S
(d_i = A − x_i), the share of coordinates where all N ranks' signs agree, and the weight matrix the outer
step moves most relative to its size (‖A_after − A_before‖ / ‖A_before‖); after it: the anchor's validation
loss. Tracing evaluates copies only; the run's own trajectory is untouched (tested).

Writes ``early.json`` (one list of syncs per spec) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

__all__ = ["trace", "main"]


def trace(spec: str, seed: int, steps: int, budget: int, hp: dict, world_size: int = 4, task_name: str = "charlm"):
    """Run ``spec`` for ``steps`` of a ``budget``-step schedule; return (syncs, anchor parameters)."""
    from .runner import canonical, make_method, make_task

    spec = canonical(spec)
    task = make_task(task_name, False)
    model = task.make_model(seed)
    params = list(model.parameters())
    m = make_method(spec, params, world_size, hp, task_name, seed, budget)
    syncs = []
    plain_sync = m.sync

    def evaluate_with(values):
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
            loss = task.evaluate(model)
            for p, v in zip(params, saved):
                p.copy_(v)
        return loss

    def traced_sync():
        S = m.round_lr_sum
        d = [a.detach().unsqueeze(0) - x for a, x in zip(params, m.workers)]
        numel = sum(p.numel() for p in params)
        agree = sum(int((torch.sign(t).sum(0).abs() == world_size).sum()) for t in d)
        rec = {"step": m.step_count, "S": S,
               "rank0_loss": evaluate_with([x[0] for x in m.workers]),
               "mean_loss": evaluate_with([x.mean(0) for x in m.workers]),
               "mean_abs_d_over_S": sum(float(t.abs().sum()) for t in d) / (world_size * numel) / S,
               "all_agree": agree / numel}
        before = [p.detach().clone() for p in params]
        plain_sync()
        names = [n for n, _ in model.named_parameters()]
        rel = [float((p.detach() - b).norm() / b.norm().clamp_min(1e-12)) for p, b in zip(params, before)]
        k = max((i for i, b in enumerate(before) if b.dim() > 1), key=rel.__getitem__)  # weights: biases start at 0
        rec.update(largest_relative_step=rel[k], largest_relative_step_tensor=names[k],
                   anchor_loss=task.evaluate(model))
        syncs.append(rec)

    m.sync = traced_sync
    for step, (x, y, _) in enumerate(task.batches(world_size, seed, budget)):
        if step == steps:
            break
        grads, _ = task.per_worker_grads(model, x, y, m.worker_params)
        m.step(grads, task.lr_factor(step, budget))
    return syncs, [p.detach().clone() for p in params]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlion.lab.experiments.local_early", description=__doc__.split("\n")[0])
    p.add_argument("--specs", required=True, help="comma-separated dlocal_mavo specs")
    p.add_argument("--config", required=True, help="a tuned.json-style config giving each spec's lr and weight decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200, help="steps to trace")
    p.add_argument("--budget", type=int, default=2000, help="the schedule's run length")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from .runner import hparams_for

    torch.set_num_threads(1)
    config = json.load(open(args.config))
    out = {"seed": args.seed, "steps": args.steps, "budget": args.budget, "workers": args.workers, "runs": {}}
    for spec in [s for s in args.specs.split(",") if s]:
        hp = hparams_for(config, "charlm", spec)
        syncs, _ = trace(spec, args.seed, args.steps, args.budget, hp, args.workers)
        out["runs"][spec] = {"lr": hp["lr"], "weight_decay": hp["weight_decay"], "syncs": syncs}
        print(f"{spec} (lr {hp['lr']:g})")
        print(f"  {'step':>5s} {'S':>8s} {'rank 0':>7s} {'mean':>7s} {'anchor':>7s} {'|d|/S':>6s} {'agree':>6s}  largest step")
        for r in syncs:
            print(f"  {r['step']:5d} {r['S']:8.2e} {r['rank0_loss']:7.3f} {r['mean_loss']:7.3f} {r['anchor_loss']:7.3f} "
                  f"{r['mean_abs_d_over_S']:6.3f} {r['all_agree']:6.3f}  {r['largest_relative_step']:.3f} "
                  f"{r['largest_relative_step_tensor']}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "early.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'early.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
