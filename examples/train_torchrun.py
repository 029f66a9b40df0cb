"""Data-parallel training with Distributed Lion under torchrun: a minimal, readable example.

    torchrun --standalone --nproc_per_node 4 examples/train_torchrun.py
    torchrun --standalone --nproc_per_node 2 examples/train_torchrun.py --epochs 2   # quick
    python examples/train_torchrun.py                                                  # one process
    torchrun --standalone --nproc_per_node 4 examples/train_torchrun.py --sync-every 8  # talk every 8 steps

Every rank trains the same small CNN on its own shard of scikit-learn's 8x8
digits. There is no DistributedDataParallel: each rank runs backward on its own
batch and DistributedLion exchanges only the signs of the ranks' Lion updates
(about 1 bit per parameter each way) and applies the majority vote, so the
parameters stay bitwise identical on every rank. Gloo on CPU, NCCL on GPU.
With --sync-every H, LocalDistributedLion instead: H local Lion steps per rank, then one vote
of the ranks' progress (the mean of their signs); between syncs each rank holds its own copy,
so evaluation runs on the agreed parameters, inside opt.anchored().
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dlion
from dlion.integrations import CommMeter
from dlion.lab.data import load_digits_split, shard
from dlion.lab.models import DigitsCNN

# -----------------------------------------------------------------------------
# config
ap = argparse.ArgumentParser(description="Train DigitsCNN with DistributedLion under torchrun.")
ap.add_argument("--epochs", type=int, default=10)
ap.add_argument("--batch-size", type=int, default=32, help="per rank")
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--weight-decay", type=float, default=0.1)
ap.add_argument("--vote", choices=("mavo", "avg"), default=None,
                help="the vote (default: mavo every step; avg with --sync-every, LocalDistributedLion's default)")
ap.add_argument("--sync-every", type=int, default=0, metavar="H",
                help="talk every H steps (LocalDistributedLion); 0 (default): every step (DistributedLion)")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--tensorboard", default=None, metavar="DIR",
                help="rank 0 logs loss and the communication figures per epoch to TensorBoard in DIR")
args = ap.parse_args()

# -----------------------------------------------------------------------------
# distributed set-up: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if torch.cuda.is_available():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    backend = "nccl"
else:
    device = torch.device("cpu")
    backend = "gloo"
if ddp:
    dist.init_process_group(backend)
rank = dist.get_rank() if ddp else 0
world = dist.get_world_size() if ddp else 1
master = rank == 0

# -----------------------------------------------------------------------------
# data: every rank loads the same split and trains on its own shard each epoch
x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits_split(seed=args.seed))

# -----------------------------------------------------------------------------
# model and optimizer: DistributedLion broadcasts rank 0's parameters at construction
torch.manual_seed(args.seed)
model = DigitsCNN().to(device)
if args.sync_every:
    opt = dlion.LocalDistributedLion(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                     sync_every=args.sync_every, vote=args.vote or "avg")
else:
    opt = dlion.DistributedLion(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                vote=args.vote or "mavo")
if master:
    print(f"{world} rank(s), backend {backend if ddp else 'none'}, device {device.type}, "
          f"{opt.num_params:,} parameters, vote={opt.rule.vote}"
          + (f", a sync every {args.sync_every} steps" if args.sync_every else ""))

# per-epoch communication figures (bytes, bits per parameter, time blocked on collectives,
# unanimous / tied votes) from opt.comm_stats, written to TensorBoard by rank 0
meter = CommMeter(opt)
writer = None
if master and args.tensorboard:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    writer = SummaryWriter(args.tensorboard)

# -----------------------------------------------------------------------------
# training loop
steps_per_epoch = x_train.shape[0] // world // args.batch_size
t0 = time.time()
for epoch in range(args.epochs):
    idx = shard(x_train.shape[0], rank, world, seed=args.seed, epoch=epoch).to(device)
    for i in range(steps_per_epoch):
        b = idx[i * args.batch_size:(i + 1) * args.batch_size]
        loss = F.cross_entropy(model(x_train[b]), y_train[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # local Lion sign -> vote across ranks -> same update everywhere
    figures = meter.read()
    if master:
        print(f"epoch {epoch + 1}/{args.epochs}  loss (rank 0's last batch) {loss.item():.4f}")
        if writer is not None:
            writer.add_scalar("train/loss", loss.item(), epoch + 1)
            for name, value in figures.items():
                writer.add_scalar(name, value, epoch + 1)

# -----------------------------------------------------------------------------
# evaluation on rank 0 (all ranks hold the same parameters; with local steps, the same anchor)
bits = opt.comm_stats.bits_per_param_per_step(opt.num_params)  # training traffic only
opt.check_replicas()  # raises dlion.DesyncError if any rank differs
agreed = opt.anchored() if args.sync_every else contextlib.nullcontext()
with agreed:
    if master:
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
if master:
    print(f"test accuracy {100 * acc:.1f} %  |  {time.time() - t0:.1f} s  |  rank 0 sent + received "
          f"{bits:.2f} bits per parameter per step (an fp32 gradient all-reduce: {128 * (world - 1) / world:.0f})")
if writer is not None:
    writer.close()
if ddp:
    dist.barrier()  # leave together (rank 0 evaluated after the last collective)
    dist.destroy_process_group()
