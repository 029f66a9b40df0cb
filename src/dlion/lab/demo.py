"""``dlion demo``: G-Lion vs D-Lion (MaVo, Avg) on N local workers.

Starts N worker processes on this machine, joined in a Gloo process group over
loopback (:func:`dlion.lab.spawn.spawn`), and trains the same small CNN on
scikit-learn's 8x8 digits three times, one optimizer after the other:

1. **G-Lion**: the model wrapped in ``DistributedDataParallel`` (fp32 gradient
   all-reduce), then :class:`dlion.Lion` on the averaged gradient;
2. **D-Lion MaVo**: the plain model and :class:`dlion.DistributedLion` with
   ``vote="mavo"`` (every rank sends the signs of its own Lion update, all ranks
   apply the majority vote);
3. **D-Lion Avg**: the same with ``vote="avg"`` (all ranks apply the mean sign).

Same initial weights, same per-epoch data shards, same number of steps. At the
end it checks that the parameters are bitwise identical on all ranks, evaluates
test accuracy on rank 0 and prints one table with the traffic per rank and step.

Traffic is counted per step, per rank, as the bytes a bandwidth-optimal
implementation of each collective moves over that rank's links (like
``DistributedLion.comm_stats``). For G-Lion a DDP communication hook wraps
DDP's default all-reduce and counts every gradient bucket of B bytes as a ring
all-reduce: 2·(N−1)/N·B sent and as much received.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["main", "run", "METHODS"]

# name -> (optimizer kind, vote, default lr, default weight decay)
METHODS = {
    "G-Lion (DDP)": ("glion", None, 3e-3, 0.1),
    "D-Lion MaVo": ("dlion", "mavo", 3e-3, 0.1),
    "D-Lion Avg": ("dlion", "avg", 3e-3, 0.1),
}


# -- counting DDP's traffic ------------------------------------------------------

class _DDPTraffic:
    """State of the counting comm hook: bytes a ring all-reduce moves per rank."""

    def __init__(self, world: int):
        self.world = world
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0


def _counting_allreduce_hook(state: _DDPTraffic, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    moved = 2 * (state.world - 1) * buf.numel() * buf.element_size() // state.world
    state.bytes_sent += moved
    state.bytes_received += moved
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)  # None: the default (world) group


# -- one worker ----------------------------------------------------------------------

def _checksum(params) -> torch.Tensor:
    """Two int64 sums of the raw bits of all parameters (plain and position-weighted)."""
    bits = torch.cat([p.detach().reshape(-1).view(torch.int32) for p in params]).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
    return torch.stack([bits.sum(), (bits * pos).sum()])


def _train_one(rank, world, method, data, cfg):
    from dlion.distributed import DistributedLion
    from dlion.lion import Lion

    from .data import shard
    from .models import DigitsCNN

    kind, vote, lr, wd = METHODS[method]
    lr = cfg["lr"] if cfg["lr"] is not None else lr
    wd = cfg["weight_decay"] if cfg["weight_decay"] is not None else wd
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(cfg["seed"])
    model = DigitsCNN(width=cfg["width"])
    named = list(model.named_parameters())
    params = [p for _, p in named]
    num_params = sum(p.numel() for p in params)
    if kind == "glion":
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model)
        traffic = _DDPTraffic(world)
        net.register_comm_hook(traffic, _counting_allreduce_hook)
        opt = Lion(params, lr=lr, weight_decay=wd)
    else:
        net = model
        opt = DistributedLion(named, lr=lr, weight_decay=wd, vote=vote, comm=cfg["comm"])

    batch = cfg["batch_size"]
    per_rank = x_train.shape[0] // world
    steps_per_epoch = per_rank // batch
    total = steps_per_epoch * cfg["epochs"]
    bar = None
    if rank == 0 and cfg["progress"]:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"{method:<13}", unit="step", leave=True, dynamic_ncols=True,
                   file=sys.stderr)
    dist.barrier()
    start = time.perf_counter()
    smooth = None
    for epoch in range(cfg["epochs"]):
        idx = shard(x_train.shape[0], rank, world, seed=cfg["seed"], epoch=epoch)
        for s in range(steps_per_epoch):
            b = idx[s * batch:(s + 1) * batch]
            loss = F.cross_entropy(net(x_train[b]), y_train[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if bar is not None:
                smooth = loss.item() if smooth is None else 0.9 * smooth + 0.1 * loss.item()
                bar.set_postfix(loss=f"{smooth:.3f}", refresh=False)
                bar.update(1)
    dist.barrier()
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()

    if kind == "glion":
        sent, received, steps = traffic.bytes_sent, traffic.bytes_received, total
    else:
        st = opt.comm_stats
        sent, received, steps = st.bytes_sent, st.bytes_received, st.steps

    # Replicas must be bitwise identical: gather every rank's checksum (not counted as training traffic).
    mine = _checksum(params)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    identical = all(torch.equal(everyone[0], c) for c in everyone)

    accuracy = None
    if rank == 0:
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return dict(method=method, lr=lr, weight_decay=wd, accuracy=accuracy, bytes_sent=sent,
                bytes_received=received, steps=steps, num_params=num_params, wall=wall, identical=identical,
                final_loss=smooth, by_kind=dict(opt.comm_stats.by_kind) if kind == "dlion" else None)


def _worker(rank, world, methods, data, cfg):
    return [_train_one(rank, world, m, data, cfg) for m in methods]


# -- the table ---------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_table(rows: list[dict], world: int) -> str:
    """The results as a plain-text table (one row per method)."""
    head = ["method", "test acc", "bytes per rank per step", "bits/param/step", "wall time"]
    sub = ["", "", "sent + received", "sent + received", ""]
    body = []
    for r in rows:
        steps = max(r["steps"], 1)
        sent, recv = r["bytes_sent"] / steps, r["bytes_received"] / steps
        bits_sent, bits_recv = 8.0 * sent / r["num_params"], 8.0 * recv / r["num_params"]
        body.append([r["method"], f"{100 * r['accuracy']:.1f} %", f"{_fmt_bytes(sent)} + {_fmt_bytes(recv)}",
                     f"{bits_sent:.2f} + {bits_recv:.2f}", f"{r['wall']:.1f} s"])
    widths = [max(len(x[i]) for x in [head, sub, *body]) for i in range(len(head))]
    left = {0}

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), line(sub), rule, *(line(b) for b in body)])


def _per_step_total(r: dict) -> float:
    return (r["bytes_sent"] + r["bytes_received"]) / max(r["steps"], 1)


_NOTE = """
How bytes are counted: per rank and optimizer step, what a bandwidth-optimal
collective moves over that rank's links (training steps only, not the initial
broadcast or the final check).
  G-Lion: fp32 ring all-reduce of the gradients, 2(N-1)/N x 32 bits per
    parameter sent and as many received ({ring} + {ring} for N={n}).
  D-Lion (comm=1bit): all-to-all of the local signs, then all-gather of the
    aggregated codes: (up + down) x (N-1)/N bits per parameter each way.
    up = 1 bit; coordinates whose update is exactly zero (e.g. dead ReLU
    units) abstain and travel as zero runs in a small header, or, when they
    are too scattered for that (as in this CNN), the bucket goes as base-3
    digits (1.6 bits); down = 1 bit (+ zero runs of the result) for MaVo,
    base-3 when those runs do not fit (ties at even N); for Avg
    ceil(log2(N+1)) bits, or ceil(log2(2N+1)) with abstentions.
    Plus a header of a few dozen bytes per bucket, block and step.
Wall times: N processes share this machine's cores; compare them only within
one run."""


# -- entry points ----------------------------------------------------------------------------

def run(workers: int = 4, epochs: int = 12, seed: int = 0, lr=None, weight_decay=None, batch_size: int = 32,
        width: int = 32, comm: str = "1bit", progress: bool = True, methods=None, data=None) -> list[dict]:
    """Train every method on ``workers`` local processes; one result per method (rank 0's
    accuracy and wall time, the busiest rank's bytes, whether all ranks ended identical)."""
    from .data import load_digits_split
    from .spawn import spawn

    methods = list(methods or METHODS)
    if data is None:
        data = load_digits_split(seed=seed)
    cfg = dict(epochs=epochs, seed=seed, lr=lr, weight_decay=weight_decay, batch_size=batch_size, width=width,
               comm=comm, progress=progress)
    per_rank = spawn(_worker, workers, methods, data, cfg, timeout_s=600.0)
    rows = per_rank[0]
    for i, row in enumerate(rows):
        # Every rank counts its own traffic; report the busiest.
        others = [pr[i] for pr in per_rank]
        row["bytes_sent"] = max(o["bytes_sent"] for o in others)
        row["bytes_received"] = max(o["bytes_received"] for o in others)
        row["identical"] = all(o["identical"] for o in others)
    return rows


#: modules the demo needs beyond dlion's own dependencies, with the packages that provide them;
#: all are in the ``tools`` extra of pyproject.toml
_TOOLS = (("sklearn", "scikit-learn", "the digits data set"), ("tqdm", "tqdm", "the progress bars"))


def missing_tools(progress: bool) -> list[tuple[str, str]]:
    """(package, what it is for) of every module the demo needs and cannot import; tqdm only
    with progress bars."""
    out = []
    for module, package, why in _TOOLS:
        if module == "tqdm" and not progress:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            out.append((package, why))
    return out


def missing_tools_message(missing: list[tuple[str, str]]) -> str:
    names = " and ".join(f"{p} (for {why})" for p, why in missing)
    return (f"dlion demo needs {names}, not installed here. Install dlion's 'tools' extra:\n"
            f'    pip install "dlion[tools]"        (from a clone: pip install -e ".[tools]")\n'
            f"or install them directly: pip install {' '.join(p for p, _ in missing)}")


def results_doc(rows: list[dict], cfg: dict) -> dict:
    """What the demo prints, as a JSON-ready record: per method the accuracy, the bytes and
    bits per parameter one rank sends and receives per step (the busiest rank's counts), the
    wall time, and whether every rank ended with the same parameters."""
    import platform

    from dlion import __version__

    methods = []
    for r in rows:
        steps = max(r["steps"], 1)
        sent, recv = r["bytes_sent"] / steps, r["bytes_received"] / steps
        methods.append({
            "method": r["method"], "lr": r["lr"], "weight_decay": r["weight_decay"],
            "test_accuracy": r["accuracy"], "steps": r["steps"], "num_params": r["num_params"],
            "bytes_sent_per_step": sent, "bytes_received_per_step": recv,
            "bits_per_param_sent_per_step": 8.0 * sent / r["num_params"],
            "bits_per_param_received_per_step": 8.0 * recv / r["num_params"],
            "bytes_by_collective": r.get("by_kind"), "wall_s": r["wall"], "replicas_identical": r["identical"],
        })
    by = {r["method"]: r for r in rows}
    g, m = by.get("G-Lion (DDP)"), by.get("D-Lion MaVo")
    ratio = _per_step_total(g) / _per_step_total(m) if g and m and _per_step_total(m) > 0 else None
    return {"benchmark": "dlion demo", "config": cfg, "methods": methods,
            "glion_bytes_over_dlion_mavo_bytes": ratio,
            "counting": "per rank and optimizer step, what a bandwidth-optimal collective moves over that "
                        "rank's links (G-Lion: a ring all-reduce of the fp32 gradients; D-Lion: its comm_stats)",
            "dlion_version": __version__, "torch": torch.__version__, "python": platform.python_version()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlion demo",
        description="Train a small CNN on scikit-learn's digits on N local worker processes (Gloo over "
                    "loopback) with G-Lion (DDP + Lion), D-Lion MaVo and D-Lion Avg, and compare test "
                    "accuracy, traffic per step and wall time.")
    p.add_argument("--workers", type=int, default=4, help="number of worker processes (default 4)")
    p.add_argument("--epochs", type=int, default=12, help="epochs per method (default 12)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the initial weights and the shards")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for all methods (default: per method, 3e-3)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="decoupled weight decay for all methods (default: per method, 0.1)")
    p.add_argument("--batch-size", type=int, default=32, help="local batch per worker (default 32)")
    p.add_argument("--width", type=int, default=32, help="DigitsCNN width (default 32: ~58k parameters)")
    p.add_argument("--comm", default="1bit", choices=["1bit", "allgather", "pbit", "auto"],
                   help="D-Lion's collective (default 1bit: all-to-all + all-gather, ~(1+1)(N-1)/N bits per "
                        "parameter; 'auto' picks by bucket size and a per-call latency estimate)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write the figures it prints to DIR/demo_results.json (and the table to "
                        "DIR/demo_table.txt)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars; print only the table")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 2:
        print("dlion demo: --workers must be at least 2 (one worker has nothing to communicate)", file=sys.stderr)
        return 2
    if args.epochs < 1 or args.batch_size < 1 or args.width < 1:
        print("dlion demo: --epochs, --batch-size and --width must be positive", file=sys.stderr)
        return 2
    progress = not (args.quiet or args.no_progress)
    missing = missing_tools(progress)
    if missing:
        print(missing_tools_message(missing), file=sys.stderr)
        return 2
    from .data import load_digits_split

    data = load_digits_split(seed=args.seed)
    n_train, n_test = data[0].shape[0], data[2].shape[0]
    steps_per_epoch = (n_train // args.workers) // args.batch_size
    if steps_per_epoch < 1:
        print(f"dlion demo: --batch-size {args.batch_size} is larger than a worker's shard "
              f"({n_train // args.workers} images)", file=sys.stderr)
        return 2
    say = (lambda *a: None) if args.quiet else print
    n = args.workers
    say(f"dlion demo: {n} worker processes on this machine (Gloo over loopback), scikit-learn digits "
        f"({n_train} train / {n_test} test), DigitsCNN, local batch {args.batch_size} "
        f"(global {n * args.batch_size}), {args.epochs} epochs = {steps_per_epoch * args.epochs} steps per method")
    sys.stdout.flush()
    rows = run(workers=n, epochs=args.epochs, seed=args.seed, lr=args.lr, weight_decay=args.weight_decay,
               batch_size=args.batch_size, width=args.width, comm=args.comm, progress=progress, data=data)
    lrs = ", ".join(f"{r['method']} {r['lr']:g}" for r in rows)
    say(f"\n{rows[0]['num_params']:,} parameters; lr: {lrs}; weight decay {rows[0]['weight_decay']:g}\n")
    text = format_table(rows, n)
    print(text)
    if args.out:
        cfg = dict(workers=n, epochs=args.epochs, seed=args.seed, batch_size=args.batch_size, width=args.width,
                   comm=args.comm, lr=args.lr, weight_decay=args.weight_decay)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "demo_results.json"), "w") as f:
            json.dump(results_doc(rows, cfg), f, indent=1)
        with open(os.path.join(args.out, "demo_table.txt"), "w") as f:
            f.write(text + "\n")
    by = {r["method"]: r for r in rows}
    g, m = by.get("G-Lion (DDP)"), by.get("D-Lion MaVo")
    print()
    if g and m and _per_step_total(m) > 0:
        ratio = _per_step_total(g) / _per_step_total(m)
        print(f"G-Lion moves {ratio:.1f}x the bytes of D-Lion MaVo per step (D-Lion MaVo: 1/{ratio:.0f} of G-Lion).")
    identical = all(r["identical"] for r in rows)
    print(f"parameters identical on all {n} ranks: {'yes' if identical else 'NO'}")
    if args.comm == "1bit":
        say(_NOTE.format(n=n, ring=f"{64 * (n - 1) / n:g}"))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
