"""Hierarchical Distributed Lion on several nodes under torchrun: a minimal, readable example.

Two nodes of two ranks (run the first line on node 0 and the second on node 1, HOST = node 0's address):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --node-rank 0 \\
        examples/train_hierarchical.py
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --node-rank 1 \\
        examples/train_hierarchical.py

Inside a node the ranks average their gradients in full precision (reduce-scatter) and hold
one shared Lion momentum, sharded; between nodes only the 1-bit vote of the nodes travels.
The (nodes, ranks per node) mesh comes from torchrun's LOCAL_WORLD_SIZE. Gloo on CPU, NCCL on GPU.
``--out DIR`` writes one JSON per rank (used by the tests).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dlion
from dlion.lab.data import load_digits_split, shard
from dlion.lab.models import DigitsCNN

ap = argparse.ArgumentParser(description="Train DigitsCNN with HierarchicalDistributedLion under torchrun.")
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: whole epochs)")
ap.add_argument("--batch-size", type=int, default=32, help="per rank")
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--weight-decay", type=float, default=0.1)
ap.add_argument("--vote", choices=("mavo", "avg"), default="mavo")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--out", default="", help="directory for one JSON result per rank")
args = ap.parse_args()

# torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (ranks of a node are consecutive)
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    backend = "nccl"
else:
    device = torch.device("cpu")
    backend = "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()

x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits_split(seed=args.seed))
torch.manual_seed(args.seed)
model = DigitsCNN().to(device)
# mesh=None: ("node", "local") = (WORLD_SIZE / LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE); or pass
# mesh=init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("node", "local"))
opt = dlion.HierarchicalDistributedLion(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                        vote=args.vote)
if rank == 0:
    print(f"{opt.num_nodes} node(s) x {opt.local_world_size} rank(s), backend {backend}, "
          f"{opt.num_params:,} parameters, vote={args.vote}", flush=True)

steps, t0, loss = 0, time.time(), torch.zeros(())
steps_per_epoch = x_train.shape[0] // world // args.batch_size
for epoch in range(args.epochs):
    idx = shard(x_train.shape[0], rank, world, seed=args.seed, epoch=epoch).to(device)
    for i in range(steps_per_epoch):
        b = idx[i * args.batch_size:(i + 1) * args.batch_size]
        loss = F.cross_entropy(model(x_train[b]), y_train[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()  # node-mean gradient -> node's Lion sign -> vote of the nodes -> same update everywhere
        steps += 1
        if steps == args.steps:
            break
    if steps == args.steps:
        break

opt.check_replicas()  # raises dlion.DesyncError if any rank differs
with torch.no_grad():
    acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    checksum = [float(p.double().sum()) for p in model.parameters()]
between = 8 * opt.comm_stats.bytes_sent / max(1, opt.comm_stats.steps) / opt.num_params
if rank == 0:
    print(f"{steps} steps, test accuracy {100 * acc:.1f} %, {time.time() - t0:.1f} s; rank 0 sent "
          f"{between:.3f} bits per parameter per step to other nodes", flush=True)
if args.out:
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world=world, node=opt.node, local_rank=opt.local_rank,
                       env_local_rank=int(os.environ["LOCAL_RANK"]), group_rank=int(os.environ["GROUP_RANK"]),
                       steps=steps, accuracy=acc, loss=float(loss), checksum=checksum,
                       inter_bits_per_param_step=between,
                       local_bytes=opt.local_stats.bytes_sent, momentum_numel=opt.momentum_numel,
                       num_params=opt.num_params), f)
dist.barrier()  # leave together: a peer that has exited can make Gloo's teardown abort
dist.destroy_process_group()
