"""``dlion bench codec``: what the bit codec costs next to the Lion step it serves.

On one flat tensor of ``--params`` coordinates, times (median of ``--repeat``):

* ``lion step``  the local Lion update of :class:`dlion.Lion` (c, sign, decay, step, momentum)
* ``sign→int8``  writing sign(c) into the int8 send buffer (DistributedLion's extra local work)
* ``pack``       encoding δ into bits (1 bit per coordinate)
* ``vote``       one rank's share of the 1bit algorithm: count N received chunks of n/N
                 coordinates, decide, encode the result
* ``unpack``     decoding all n result codes and turning them into Δ

and prints ns per parameter and the ratio (pack + vote + unpack) / lion step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dlion.aggregation import VoteRule
from dlion.codec import ALIGN, SignCodec
from dlion.collectives import reduce_counts
from dlion.lion import Lion


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 16M, 500K, 1000000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"parameter count must be > 0, got {text!r}")
    return value


def timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(n: int, world: int, vote: str, repeat: int, device: str) -> dict:
    quantum = ALIGN * world
    n = -(-n // quantum) * quantum
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g).to(device).requires_grad_()
    p.grad = torch.randn(n, generator=g).to(device)
    opt = Lion([p], lr=1e-4, weight_decay=0.1)
    opt.step()  # allocate the momentum
    c = torch.randn(n, generator=g).to(device)
    buffer = torch.empty(n, dtype=torch.int8, device=device)
    delta = torch.sign(c).to(torch.int8)
    delta[delta == 0] = 1
    rule = VoteRule(vote, world)
    up, down = SignCodec(), rule.result_codec(False)
    received = torch.cat([up.encode(torch.roll(delta, r)[: n // world]) for r in range(world)])
    codes = rule.decide(*reduce_counts(received, up, world, n // world))
    result = down.encode(torch.cat([codes] * world))

    def vote_fn():
        s, nz = reduce_counts(received, up, world, n // world)
        down.encode(rule.decide(s, nz))

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn):
        return timeit(lambda: (fn(), sync()), repeat)

    t = {
        "lion step": timed(opt.step),
        "sign→int8": timed(lambda: torch.sub((c > 0).view(torch.int8), (c < 0).view(torch.int8), out=buffer)),
        "pack": timed(lambda: up.encode(delta)),
        "vote": timed(vote_fn),
        "unpack": timed(lambda: rule.delta(down.decode(result, n), torch.float32)),
    }
    return {"params": n, "workers": world, "vote": vote, "device": device,
            "seconds": t, "ns_per_param": {k: v / n * 1e9 for k, v in t.items()}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=parse_count, default=parse_count("16M"), help="coordinates (default 16M)")
    ap.add_argument("--workers", type=int, default=4, help="N for the vote (default 4)")
    ap.add_argument("--vote", choices=("mavo", "avg"), default="mavo")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one rank per core)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    torch.set_num_threads(args.threads)
    r = run(args.params, args.workers, args.vote, args.repeat, args.device)
    ns = r["ns_per_param"]
    print(f"dlion bench codec: {r['params']:,} parameters, N={args.workers}, vote={args.vote}, "
          f"device={args.device}, {args.threads} thread(s), median of {args.repeat}")
    print(f"{'stage':<12} {'ms':>9} {'ns/param':>9}")
    for k, v in r["seconds"].items():
        print(f"{k:<12} {v * 1e3:>9.2f} {ns[k]:>9.3f}")
    codec = ns["pack"] + ns["vote"] + ns["unpack"]
    print(f"pack + vote + unpack = {codec:.3f} ns/param = {codec / ns['lion step']:.2f} × the local Lion step")
    return 0
