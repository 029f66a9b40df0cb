"""The collectives one rank issues, exchange by exchange, for ``LocalDistributedLion`` streamed in
fragments: why a short window counts more bits than the steady state.

    python scripts/fragment_bytes.py [--fragments 3] [--sync-every 25] [--steps 100] [--bucket-mb 1.5]

Four Gloo ranks, the e2e benchmark's CharGPT (6 layers, 256 wide), Gaussian gradients (no data), the
e2e run's options (the Avg vote, random ties). Prints, per step that issued an exchange, the number of
collectives and the bytes of their payloads, counted here by wrapping the transport's ``issue`` (not
by the library's counters; a re-sent bucket is logged at the step during which the exchange thread
sent it), and the bits per parameter per step in the first and in the last
``sync_every`` steps; then, on one process, how many coordinates of each round's progress A − x are
exactly 0 after 8, 16 and 25 plain Lion steps (the fragments' first rounds are ⌊f·H/P⌋ steps long).
"""

import argparse
import collections
import warnings

import torch

import dlion
import dlion.collectives as collectives
from dlion.lab.models import CharGPT
from dlion.lab.spawn import spawn


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return CharGPT(vocab_size=65, block_size=64, n_layer=6, n_embd=256, n_head=4)


def worker(rank: int, world: int, args) -> tuple:
    torch.set_num_threads(1)
    net = model()
    opt = dlion.LocalDistributedLion(net.named_parameters(), lr=1e-4, sync_every=args.sync_every,
                                     streaming=args.fragments > 1, fragments=args.fragments,
                                     bucket_cap_mb=args.bucket_mb, ties="random")
    log = []
    issue = collectives.GroupTransport.issue

    def logged(self, kind, send, label=None):
        log.append((opt.step_count, kind, send.numel() * send.element_size()))
        return issue(self, kind, send, label)

    collectives.GroupTransport.issue = logged
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    if args.fragments > 1:
        opt.settle()
    return log, sum(p.numel() for p in net.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fragments", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=25)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--bucket-mb", type=float, default=1.5)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    log, params = spawn(worker, 4, args, timeout_s=900)[0]
    world = 4
    share = {"all_gather": world - 1, "all_to_all": (world - 1) / world, "reduce_scatter": (world - 1) / world,
             "all_reduce": 2 * (world - 1) / world}  # bytes one rank sends per byte of its input
    per_step = collections.OrderedDict()
    for step, kind, nbytes in log:
        calls, total, sent = per_step.get(step, (0, 0, 0.0))
        per_step[step] = (calls + 1, total + nbytes, sent + share[kind] * nbytes)
    print(f"{params} parameters, {args.fragments} fragments, H = {args.sync_every}; per step that issued an "
          "exchange: collectives, their input bytes, the bytes one rank sends")
    for step, (calls, total, sent) in per_step.items():
        print(f"  step {step:4d}: {calls:3d} calls, {total:9d} B in, {sent:11.0f} B sent")
    H = args.sync_every
    for name, lo, hi in (("first", 1, H), ("last", args.steps - H + 1, args.steps)):
        sent = sum(v[2] for s, v in per_step.items() if lo <= s <= hi)
        print(f"bits / parameter / step sent, steps {lo}-{hi} ({name} {H}): {8 * sent / params / H:.4f}")
    net = model()
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = dlion.Lion(net.parameters(), lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for n in range(1, H + 1):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if n in {f * H // args.fragments for f in range(1, args.fragments)} | {H}:
            zeros = {k: int((start[k] == p.detach()).sum()) for k, p in net.named_parameters()}
            top = sorted(((v, k) for k, v in zeros.items() if v), reverse=True)[:3]
            print(f"after {n:3d} Lion steps: {sum(zeros.values()):4d} coordinates exactly back at the start "
                  f"(most in: {', '.join(f'{k} {v}' for v, k in top) or 'none'})")


if __name__ == "__main__":
    main()
