"""When does backward hand over each bucket? One process, one thread, the e2e benchmark's model.

Prints, for ``dlion bench e2e``'s CharGPT (6 layers, 256 wide, batch 4 × 64) and a bucket cap,
the forward time, the backward time and the moment each bucket's last gradient is accumulated
(the earliest its exchange can start), median over --steps steps, and writes them as JSON.
It bounds what overlap can hide: a bucket's bytes cannot leave before that moment.

    python scripts/bucket_ready_times.py --bucket-mb 6 --out docs/results/bucket-ready/bucket_ready.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dlion.buckets import layout_buckets
from dlion.lab.data import load_shakespeare
from dlion.lab.models import CharGPT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[6.0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_ids, _, vocab = load_shakespeare()  # the e2e benchmark's data: its vocabulary and a real batch
    model = CharGPT(len(vocab), block_size=64, n_layer=6, n_head=4, n_embd=256)
    params = list(model.parameters())
    buckets = layout_buckets(params, [{}] * len(params), 4, args.bucket_mb)
    bucket_of = {id(params[i]): b.index for b in buckets for i in b.indices}
    waiting: list[int] = []
    ready: dict[int, float] = {}

    def hook(p: torch.Tensor) -> None:
        k = bucket_of[id(p)]
        waiting[k] -= 1
        if waiting[k] == 0:
            ready[k] = time.perf_counter()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    starts = torch.randint(0, len(train_ids) - 65, (4,))
    x = torch.stack([train_ids[i:i + 64] for i in starts])
    y = torch.stack([train_ids[i + 1:i + 65] for i in starts])
    rows = []
    for _ in range(args.steps + 2):  # the first two warm up
        model.zero_grad(set_to_none=True)
        waiting[:] = [len(b.params) for b in buckets]
        ready.clear()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        rows.append({"forward_ms": 1e3 * (t1 - t0), "backward_ms": 1e3 * (t2 - t1),
                     "ready_ms": [1e3 * (ready[b.index] - t0) for b in buckets]})
    rows = rows[2:]
    med = {"forward_ms": statistics.median(r["forward_ms"] for r in rows),
           "backward_ms": statistics.median(r["backward_ms"] for r in rows),
           "ready_ms": [statistics.median(r["ready_ms"][k] for r in rows) for k in range(len(buckets))]}
    total = med["forward_ms"] + med["backward_ms"]
    print(f"bucket cap {args.bucket_mb} MB: forward {med['forward_ms']:.1f} ms, backward {med['backward_ms']:.1f} ms "
          f"(median of {args.steps} steps, one thread)")
    for b, t in zip(buckets, med["ready_ms"]):
        print(f"  bucket {b.index}: {b.numel * 4 / 2**20:5.2f} MB ready {t:6.1f} ms after the step starts "
              f"({t / total:.0%} of forward + backward)")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"bucket_mb": args.bucket_mb, "steps": args.steps, "bucket_numel": [b.numel for b in buckets],
                       "median": med, "per_step": rows}, f, indent=1)


if __name__ == "__main__":
    main()
