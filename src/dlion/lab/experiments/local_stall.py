"""Why the local vote stalls on some seeds of the time-to-quality runs.

    python -m dlion.lab.experiments.local_stall --seeds 1 4 --steps 200 --probe 1:70,1:80 \\
        --out docs/results/local-stall

The setting of ``dlion bench ttq`` (``charlm``-sized GPT on Shakespeare, 4 ranks, batch 4 per
rank, lr 1e-4 with its warm-up and cosine over a 1000-step run, betas (0.9, 0.99), weight decay
0.1, random ties), the first ``--steps`` steps, validation loss every 10 steps, for:

``vote``        :class:`dlion.LocalDistributedLion`, H = 10, the agreed parameters (the anchor);
``vote-h1-K``   the same with ``sync_warmup=K`` (``--sync-first``): H = 1 for the first K steps, then H = 10: local
                steps only once the early phase is over, as in post-local SGD (Lin et al., "Don't
                Use Large Mini-Batches, Use Local SGD", arXiv 1808.07217);
``vote-ab-T``   the same with ``abstain_below=T`` (``--abstain-below``): a rank abstains where it
                moved less than T times the round's summed lr;
``alone``       rank 0's own Lion on its own batches (the same inner steps, never synced);
``g-lion``      every-step Lion on the mean gradient of the 4 ranks' batches (one process).

``--probe SEED:STEP[,…]`` evaluates, at the sync ending at STEP of the ``vote`` run, what other outer
updates from the same four ranks' progress d_i = A − x_i would have given: the mean of d_i
(model averaging), S·sign(mean d_i), the vote without error feedback, and the vote on
sign(d_i)·[|d_i| ≥ S/2] (a rank abstains where its steps reversed in the round).

Writes ``stall.json`` (every curve and probe, and the bits rank 0 sent per parameter per step) and ``stall.png`` (the curves per seed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Optional

import torch

__all__ = ["main"]

RUN_STEPS, WARMUP, H, LR = 1000, 300, 10, 1e-4
CFG = {"n_layer": 6, "n_embd": 256, "n_head": 4, "block_size": 64, "batch_size": 4, "eval_batches": 8}


def _setup(seed: int):
    from dlion.lab.bench.e2e.methods import _build_model
    from dlion.lab.bench.ttq import _val_batches
    from dlion.lab.data import load_shakespeare

    train_ids, val_ids, vocab = load_shakespeare()
    cfg = {**CFG, "seed": seed}
    return cfg, train_ids, _val_batches(val_ids, cfg), _build_model(cfg, len(vocab))


def _set_lr(opt, step: int) -> float:
    """The ttq schedule's lr at ``step`` of a ``RUN_STEPS`` run, set on every group and returned."""
    from dlion.lab.bench.ttq import lr_factor

    lr = LR * lr_factor(step, RUN_STEPS, WARMUP)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def _probe(opt, model, val, world: int, rank: int, S: float) -> Optional[dict]:
    """Validation loss of the anchor under other outer updates of the round just ended (its sync
    held back), from every rank's progress d_i = A − x_i; rank 0 returns them."""
    import torch.distributed as dist

    from dlion.lab.bench.ttq import evaluate

    params = list(model.parameters())
    with opt.anchored():
        A = [p.detach().clone() for p in params]
    D = []
    for p, a in zip(params, A):
        d = (a - p.detach()).float()
        parts = [torch.empty_like(d) for _ in range(world)]
        dist.all_gather(parts, d)
        D.append(torch.stack(parts))
    if rank:
        return None
    mine = [p.detach().clone() for p in params]

    def loss_at(new):
        with torch.no_grad():
            for p, v in zip(params, new):
                p.copy_(v)
            out = evaluate(model, val)
            for p, v in zip(params, mine):
                p.copy_(v)
        return out

    def vote(signs):
        return torch.sign(signs.sum(0))

    cells = sum(d[0].numel() for d in D)
    return {
        "rank0_local": evaluate(model, val),
        "mean_of_progress": loss_at([a - d.mean(0) for a, d in zip(A, D)]),
        "sign_of_mean": loss_at([a - S * torch.sign(d.mean(0)) for a, d in zip(A, D)]),
        "vote_without_ef": loss_at([a - S * vote(torch.sign(d)) for a, d in zip(A, D)]),
        "vote_abstain_half": loss_at([a - S * vote(torch.sign(d) * (d.abs() >= S / 2)) for a, d in zip(A, D)]),
        "mean_abs_progress_over_S": float(sum(d.abs().sum() for d in D) / (world * cells) / S),
        "share_below_quarter_S": float(sum((d.abs() < S / 4).sum() for d in D) / (world * cells)),
    }


def _ranks(rank: int, world: int, seed: int, steps: int, mode: str, sync_first: int, tau: float = 0.0) -> dict:
    """One mode on ``world`` ranks; ``mode="probe"`` stops at ``steps`` (a round's end) with the
    probe instead of that round's sync; ``sync_first`` K > 0 syncs every step before step K
    (``sync_warmup=K``), ``tau`` > 0 abstains below tau·S (``abstain_below=tau``)."""
    import dlion
    from dlion.lab.bench.ttq import evaluate
    from dlion.lab.data import char_batches

    cfg, train_ids, val, model = _setup(seed)
    opt = dlion.LocalDistributedLion(model.named_parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.1,
                                     vote="mavo", ties="random", comm="1bit", bucket_cap_mb=6, sync_every=H,
                                     sync_warmup=sync_first, abstain_below=tau)
    never = steps + 1
    g = torch.Generator().manual_seed(1000 * seed + rank)
    curve, S = [], 0.0
    for step in range(steps):
        lr = _set_lr(opt, step)
        S = lr if step % H == 0 else S + lr
        opt.sync_every = never if mode == "alone" or (mode == "probe" and step + 1 == steps) else H
        x, y = char_batches(train_ids, cfg["block_size"], cfg["batch_size"], g)
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
        if rank == 0 and (step + 1) % 10 == 0 and mode != "probe":
            with (opt.anchored() if mode != "alone" else contextlib.nullcontext()):
                curve.append((step + 1, evaluate(model, val)))
    found = _probe(opt, model, val, world, rank, S) if mode == "probe" else None
    params = sum(p.numel() for p in model.parameters())
    # what this rank sent, per parameter and step (its own count of the bytes it handed to Gloo)
    return {"curve": curve, "probe": found, "bits_sent": 8 * opt.comm_stats.bytes_sent / (params * steps)}


def _g_lion(seed: int, steps: int, world: int) -> list:
    """Every-step Lion on the mean of the ``world`` ranks' batch gradients, in one process."""
    import dlion
    from dlion.lab.bench.ttq import evaluate
    from dlion.lab.data import char_batches

    cfg, train_ids, val, model = _setup(seed)
    opt = dlion.Lion(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(world)]
    curve = []
    for step in range(steps):
        _set_lr(opt, step)
        opt.zero_grad(set_to_none=True)
        for g in gens:
            x, y = char_batches(train_ids, cfg["block_size"], cfg["batch_size"], g)
            (model(x, y)[1] / world).backward()
        opt.step()
        if (step + 1) % 10 == 0:
            curve.append((step + 1, evaluate(model, val)))
    return curve


def _plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r["seed"] for r in rows if r["curve"]})
    fig, axes = plt.subplots(1, len(seeds), figsize=(5.5 * len(seeds), 4), squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for r in rows:
            if r["seed"] == seed and r["curve"]:
                s, loss = zip(*r["curve"])
                ax.plot(s, loss, label=r["mode"])
        ax.set(title=f"seed {seed}", xlabel="step", ylabel="validation loss", ylim=(2.6, 4.6))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list] = None) -> int:
    from dlion.lab.spawn import spawn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=200, help="steps of the 1000-step schedule (a multiple of 10)")
    ap.add_argument("--sync-first", type=int, default=200, help="K of vote-h1-K (a multiple of 10)")
    ap.add_argument("--probe", default="1:80", help="SEED:STEP[,SEED:STEP...] (STEP a multiple of 10); '' for none")
    ap.add_argument("--abstain-below", type=float, default=0.5, help="T of vote-ab-T")
    ap.add_argument("--modes", default="vote,vote-h1,vote-ab,alone,g-lion",
                    help="which curves (comma separated); rows of others already in --out's stall.json are kept")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for name in ("steps", "sync_first"):
        if getattr(args, name) % H or getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be a multiple of {H}")
    modes = args.modes.split(",")
    known = ("vote", "vote-h1", "vote-ab", "alone", "g-lion")
    if set(modes) - set(known):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(known))}; choose from {', '.join(known)}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "stall.json")
    config = {**CFG, "lr": LR, "run_steps": RUN_STEPS, "warmup_steps": WARMUP, "sync_every": H,
              "workers": args.workers, "steps": args.steps, "sync_first": args.sync_first,
              "abstain_below": args.abstain_below}
    rows = []
    if os.path.exists(path):  # keep the other modes' rows of the same experiment
        with open(path) as f:
            old = json.load(f)
        if {k: v for k, v in old["config"].items() if k != "abstain_below"} != {
                k: v for k, v in config.items() if k != "abstain_below"}:
            ap.error(f"{path} holds another configuration: give another --out")
        rows = old["rows"]
    runs = {"vote": ("vote", 0, 0.0), "vote-h1": ("vote", args.sync_first, 0.0), "vote-ab": ("vote", 0, args.abstain_below),
            "alone": ("alone", 0, 0.0)}
    labels = {"vote-h1": f"vote-h1-{args.sync_first}", "vote-ab": f"vote-ab-{args.abstain_below:g}"}
    for seed in args.seeds:
        for name in modes:
            label = labels.get(name, name)
            bits = None
            if name == "g-lion":
                torch.set_num_threads(1)
                curve = _g_lion(seed, args.steps, args.workers)
            else:
                mode, k, tau = runs[name]
                out = spawn(_ranks, args.workers, seed, args.steps, mode, k, tau, timeout_s=3600)[0]
                curve, bits = out["curve"], out["bits_sent"]
            rows = [r for r in rows if (r["seed"], r["mode"]) != (seed, label)]
            rows.append({"seed": seed, "mode": label, "curve": curve, "bits_sent_per_param_per_step": bits})
            print(f"seed {seed} {label}: " + " ".join(f"{v:.3f}" for _, v in curve)
                  + (f"; {bits:.4f} bits/param/step sent" if bits is not None else ""), flush=True)
    for probe in filter(None, args.probe.split(",")):
        seed, step = (int(v) for v in probe.split(":"))
        found = spawn(_ranks, args.workers, seed, step, "probe", 0, timeout_s=3600)[0]["probe"]
        rows = [r for r in rows if (r["seed"], r["mode"]) != (seed, f"probe-{step}")]
        rows.append({"seed": seed, "mode": f"probe-{step}", "curve": [], "probe": found})
        print(f"probe seed {seed} step {step}: {json.dumps(found)}", flush=True)
    with open(path, "w") as f:
        json.dump({"config": config, "rows": rows}, f, indent=1)
    _plot(rows, os.path.join(args.out, "stall.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
