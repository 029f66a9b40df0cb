"""``dlion bench codec``: what D-Lion's per-step work costs next to the Lion step it replaces.

On one bucket of ``--params`` coordinates, with ``--workers`` simulated ranks (median of
``--repeat``), one rank's share of:

* ``lion step``   the local Lion update of :class:`dlion.Lion` (c, sign, decay, step, momentum)
* ``contribute``  gradient into the flat bucket, c, the non-finite check, sign(c) as int8 (with
                  ``--fused`` the gradients are read in place and the 1-bit payload is packed
                  in the same pass, so the exchange does not pack it again)
* ``exchange``    the aggregation algorithm's own work (``--comm``): encode the header and
                  signs, count and vote on the received chunk, encode and decode the codes —
                  everything but the transport (measured inside the algorithm's generator).
                  With ``--fused``, 1-bit MaVo codes are not decoded here: ``apply`` reads them packed
* ``apply``       Δ from the codes, x·(1 − ηλ) − ηΔ, the momentum update

and prints ns per parameter and the ratios exchange / lion step (the codec's cost) and
(contribute + exchange + apply) / lion step (D-Lion's local work per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dlion.vote import VoteRule
from dlion.wire import Contribution, WireState, make_algorithm, padded_length
from dlion.buckets import (RankBuffers, Scratch, apply_codes, apply_signs, contribute, layout_buckets,
                           update_momentum)
from dlion.collectives import simulate_collective
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


def run(n: int, world: int, vote: str, comm: str, repeat: int, device: str, fused: bool = False,
        ties: str = "zero") -> dict:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g).to(device).requires_grad_()
    p.grad = torch.randn(n, generator=g).to(device)
    opt = Lion([p], lr=1e-4, weight_decay=0.1, fused=fused)
    opt.step()  # allocate the momentum
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn):
        return timeit(lambda: (fn(), sync()), repeat)

    group = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, maximize=False)
    b = layout_buckets([p], [group], world, cap_mb=4 * n / 2**20 + 1)[0]
    scratch = Scratch()
    bufs = [RankBuffers(b) for _ in range(world)]
    for r, buf in enumerate(bufs):  # every simulated rank its own momentum and gradient
        buf.momentum.copy_(torch.randn(n, generator=g))
    grads = [torch.randn(n, generator=g).to(device) for _ in range(world)]
    rule = VoteRule(vote, world, ties=ties)
    alg = make_algorithm(comm, rule)
    states = [WireState(up="narrow" if comm == "pbit" else "runs") for _ in range(world)]
    # ties="previous": the last step's codes, the same on every rank (a tenth of them 0: the coin decides there)
    previous = None
    if ties == "previous":
        previous = torch.randint(0, 2, (b.padded,), generator=g, dtype=torch.int8) * 2 - 1
        previous[torch.rand(b.padded, generator=g) < 0.1] = 0
        previous = previous.to(device)
    contribs, borrowed = [], None
    for r in range(world):
        made = contribute(b, bufs[r], [grads[r]], scratch, beta1=0.9, maximize=False, borrow=True, fused=fused)
        borrowed = made.borrowed if r == 0 else borrowed
        # (with --fused, contribute packed the 1-bit payload on the way, as DistributedLion hands it over)
        contribs.append(Contribution(made.values.clone(), b.numel, torch.tensor(made.present), previous=previous,
                                     packed=made.packed, zeros=made.zeros))
    inside = [0.0]

    def exchange():
        """All ranks in lockstep; only the time inside the algorithm counts (the transport is not timed)."""
        gens = [alg.run(states[r], contribs[r], r, 0) for r in range(world)]
        t = time.perf_counter()
        ops = [next(gen) for gen in gens]
        inside[0] += time.perf_counter() - t
        outcome = None
        while outcome is None:
            outs = simulate_collective(ops[0][0], [op[1] for op in ops])
            t = time.perf_counter()
            nxt = []
            for gen, out in zip(gens, outs):
                try:
                    nxt.append(gen.send(out))
                except StopIteration as stop:
                    outcome = stop.value
            inside[0] += time.perf_counter() - t
            ops = nxt
        return outcome

    outcome = exchange()
    inside[0] = 0.0
    runs = repeat + 1
    for _ in range(runs):
        exchange()
    exchange_s = inside[0] / runs / world

    @torch.no_grad()
    def apply():
        if not (fused and outcome.signs is not None and apply_signs(b, outcome.signs, [True], 1e-4, 0.1)):
            apply_codes(b, outcome.codes, [True], bufs[0].work, bufs[0].work_views, 1e-4, 0.1,
                        world if vote == "avg" else 1, fused=fused)
        update_momentum(b, bufs[0], [True], 0.99, scratch, fused=fused, borrowed=borrowed)

    t = {
        "lion step": timed(opt.step),
        "contribute": timed(lambda: contribute(b, bufs[0], [grads[0]], scratch, beta1=0.9, maximize=False,
                                                  borrow=True, fused=fused)),
        "exchange": exchange_s,
        "apply": timed(apply),
    }
    return {"params": n, "workers": world, "vote": vote, "ties": ties, "comm": comm, "device": device, "fused": fused,
            "seconds": t, "ns_per_param": {k: v / n * 1e9 for k, v in t.items()}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dlion bench codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=parse_count, default=parse_count("16M"), help="coordinates (default 16M)")
    ap.add_argument("--workers", type=int, default=4, help="N for the vote (default 4)")
    ap.add_argument("--vote", choices=("mavo", "avg"), default="mavo")
    ap.add_argument("--comm", choices=("1bit", "allgather", "pbit"), default="1bit")
    ap.add_argument("--ties", choices=("zero", "random", "previous"), default="zero",
                    help="MaVo's ties (default zero: with an even N the codes come back in base 3; previous: "
                         "the last step's codes are random, a tenth of them 0)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one rank per core)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fused", action="store_true", help="Lion and D-Lion's local math with fused=True (CPU)")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    torch.set_num_threads(args.threads)
    r = run(padded_length(args.params, args.workers), args.workers, args.vote, args.comm, args.repeat, args.device,
            args.fused, args.ties)
    ns = r["ns_per_param"]
    print(f"dlion bench codec: {r['params']:,} parameters, N={args.workers}, vote={args.vote}, ties={args.ties}, "
          f"comm={args.comm}, "
          f"device={args.device}, {args.threads} thread(s), median of {args.repeat}"
          + (", fused kernels" if args.fused else ""))
    print(f"{'stage':<12} {'ms':>9} {'ns/param':>9}")
    for k, v in r["seconds"].items():
        print(f"{k:<12} {v * 1e3:>9.2f} {ns[k]:>9.3f}")
    lion = ns["lion step"]
    local = ns["contribute"] + ns["exchange"] + ns["apply"]
    print(f"exchange (encode + vote + decode) = {ns['exchange']:.3f} ns/param = {ns['exchange'] / lion:.2f} × the "
          f"local Lion step")
    print(f"contribute + exchange + apply = {local:.3f} ns/param = {local / lion:.2f} × the local Lion step")
    if args.json:
        r.update(threads=args.threads, repeat=args.repeat, exchange_over_lion=ns["exchange"] / lion,
                 local_over_lion=local / lion)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
