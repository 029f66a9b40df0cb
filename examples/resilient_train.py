"""Fault-tolerant data-parallel training with DistributedLion under torchrun.

Checkpoints every ``--checkpoint-every`` steps (all ranks' momenta, atomically,
see :mod:`dlion.checkpoint`) and, on start, resumes from the checkpoint in
``--dir`` if there is one. Combined with torchrun's restarts, a job survives a
worker that dies: torchrun stops the other workers, starts all of them again,
and they continue from the last checkpoint — bitwise as if nothing happened
(every batch is a function of (seed, rank, step), and the optimizer state of
every rank is restored)::

    torchrun --standalone --nproc_per_node 2 --max-restarts 2 examples/resilient_train.py \\
        --dir runs/demo --steps 60 --checkpoint-every 10 --crash-at-step 25

``--crash-at-step N`` makes rank 1 ``os._exit(1)`` at step N, once: it leaves a
marker file in ``--dir`` so the restarted job does not crash again. The steps
since the last checkpoint are recomputed after the restart (here 20..24).

Task: a small MLP on scikit-learn's 8x8 digits, each rank drawing its own batches.
Writes ``final.pt`` (a dlion checkpoint) in ``--dir`` at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import dlion
from dlion import checkpoint
from dlion.lab.data import load_digits_split


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="directory for checkpoints (created if missing)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--crash-at-step", type=int, default=-1, help="rank 1 exits abruptly at this step, once")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--vote", choices=("mavo", "avg"), default="mavo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    return ap.parse_args(argv)


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def init_process_group(backend: str, timeout: timedelta) -> int:
    """``init_process_group`` from torchrun's environment, with keys prefixed by the restart count.

    After a restart, torchrun (2.13, ``--standalone``/c10d rendezvous) hands the new
    workers the same store as the previous round, which still holds the dead
    round's addresses; Gloo then tries to connect to the old ports and fails
    ("connectFullMesh failed ... Connection refused"). A per-restart key prefix
    avoids that. Returns the restart count."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"dlion/restart{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return restart


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    restart = init_process_group(args.backend, timedelta(seconds=args.timeout))
    try:
        train(args, restart)
        # Leave together: rank 0 evaluates after the last collective, and a peer that has
        # already exited can make Gloo's teardown abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def train(args, restart: int = 0) -> None:
    """The training loop, in an initialised process group."""
    rank = dist.get_rank()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "checkpoint.pt")
    marker = os.path.join(args.dir, "crashed.marker")

    xtr, ytr, xte, yte = load_digits_split(seed=args.seed)
    xtr, xte = xtr.flatten(1), xte.flatten(1)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = dlion.DistributedLion(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay, vote=args.vote,
                                check_every=args.checkpoint_every)

    start = 0
    if os.path.exists(path):
        info = checkpoint.load(path, model, opt)
        start = int(info.step)
        log(rank, f"resumed from step {start} (restart {restart}): {info.message}")

    for step in range(start, args.steps):
        if step == args.crash_at_step and rank == 1 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"rank 1 crashed at step {step}\n")
                f.flush()
                os.fsync(f.fileno())
            log(rank, f"crashing on purpose at step {step}")
            os._exit(1)
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
        idx = torch.randint(0, len(xtr), (args.batch_size,), generator=g)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(path, model, opt, step=step + 1)
            if rank == 0:
                log(rank, f"step {step + 1}: loss {loss.item():.4f}, checkpoint written")

    checkpoint.save(os.path.join(args.dir, "final.pt"), model, opt, step=args.steps)
    if rank == 0:
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        log(rank, f"done: {args.steps} steps, test accuracy {acc:.3f}, skipped steps {opt.skipped_steps}")


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization: everything is written and the group destroyed, yet
    # torch's C++ teardown at exit has now and then aborted a finished worker under load (SIGABRT,
    # "terminate called without an active exception"), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
