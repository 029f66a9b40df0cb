"""HierarchicalDistributedLion on a 2-D Gloo mesh (nodes × local ranks) against a literal reference.

The reference below is written from the algorithm's definition (docs/usage.md): the node's
gradient is the mean of its ranks' gradients (a missing one counts as 0), each node runs Lion
with its own momentum and votes with the sign of its update, the nodes' votes are aggregated
by the rule of "Communication Efficient Distributed Training with Distributed Lion" (Liu et al.
2024, arXiv 2404.00438), and every rank applies the literal Lion update. It shares no code with
the optimizer except the tie-coin hash and the quantiser's rounding, which are part of the
contract.
"""

import io
import math

import pytest
import torch

import dlion
from dlion.aggregation import coin_key, tie_coins
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, SHAPES, STEPS, WD, configs_worker, grads_for, init_params


def make_mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("node", "local"))


def hier_worker(rank, world, shape, configs):
    mesh = make_mesh(shape)
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = dlion.HierarchicalDistributedLion(
            params, lr=LR, betas=BETAS, weight_decay=WD, mesh=mesh, vote=cfg["vote"], ties=cfg.get("ties", "zero"),
            comm=cfg.get("comm", "1bit"), momentum_sync=cfg.get("momentum_sync", "none"),
            aggregate=cfg.get("aggregate", "sign"), quant_norm=cfg.get("quant_norm", "l1"),
            quant_bits=cfg.get("quant_bits", 8), bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0), seed=5)
        history = []
        for t in range(STEPS):
            for p, g in zip(params, grads_for(rank, t, cfg.get("dense", False))):
                p.grad = g
            opt.step()
            history.append([p.detach().clone() for p in params])
        out.append(dict(history=history, layout=opt.bucket_layout(), stats=opt.comm_stats.state_dict(),
                        momentum_numel=opt.momentum_numel, num_params=opt.num_params))
    return out


def _pieces(k, layout, L):
    """(slice j, start, end) of parameter k's flat coordinates, cut at the slice boundaries."""
    bucket, off, padded = layout[k]
    S = padded // L
    n = math.prod(SHAPES[k][0])
    out, x = [], off
    while x < off + n:
        j = x // S
        end = min(off + n, (j + 1) * S)
        out.append((j, x - off, end - off, x - j * S))
        x = end
    return bucket, out


def hier_reference(nodes, L, cfg, layout):
    """The hierarchical algorithm, literally: node-mean gradients, one momentum per node, a vote of the nodes."""
    dense = cfg.get("dense", False)
    x = [p.clone() for p in init_params(0)]
    m = [[torch.zeros(s, dtype=d) for s, d in SHAPES] for _ in range(nodes)]
    for t in range(STEPS):
        grads = [grads_for(r, t, dense) for r in range(nodes * L)]
        for k, (shape, dtype) in enumerate(SHAPES):
            deltas, any_grad = [], False
            for a in range(nodes):
                gs = [grads[a * L + j][k] for j in range(L)]
                if all(g is None for g in gs):
                    deltas.append(torch.zeros(shape, dtype=dtype))  # the node abstains
                    continue
                any_grad = True
                g = sum(gi if gi is not None else torch.zeros(shape, dtype=dtype) for gi in gs) / L
                c = BETAS[0] * m[a][k] + (1 - BETAS[0]) * g
                if cfg.get("aggregate") == "quantized":
                    s = (2 ** (cfg.get("quant_bits", 8) - 1) - 1) // nodes
                    q = torch.zeros(c.numel())
                    _, pieces = _pieces(k, layout, L)
                    for _, lo, hi, _ in pieces:  # the per-tensor scale is taken per piece of a slice
                        piece = c.reshape(-1)[lo:hi]
                        a_ = piece.abs().float()
                        scale = {"l1": a_.mean(), "linf": a_.max()}[cfg.get("quant_norm", "l1")]
                        scale = scale if scale > 0 else torch.tensor(1.0)
                        q[lo:hi] = torch.clamp(torch.round(piece.float() / scale * (s / 2)), -s, s)
                    deltas.append(q.view(shape))
                else:
                    deltas.append(torch.sign(c))
                m[a][k] = BETAS[1] * m[a][k] + (1 - BETAS[1]) * g
            if not any_grad:
                continue
            s = sum(deltas)
            nz = sum(d.abs() for d in deltas)
            if cfg["vote"] == "avg":
                update = s / nodes
            else:
                update = torch.sign(s).to(dtype)
                if cfg.get("ties") == "random":
                    bucket, pieces = _pieces(k, layout, L)
                    coins = torch.cat([tie_coins(coin_key(5, t, bucket * L + j), start, hi - lo)
                                       for j, lo, hi, start in pieces]).view(shape).to(dtype)
                    update = torch.where((s == 0) & (nz > 0), coins, update)
            x[k] = x[k] * (1 - LR * WD)
            x[k] = x[k] - LR * update
        sync = cfg.get("momentum_sync", "none")
        if sync != "none" and (t + 1) % sync == 0:
            for k in range(len(SHAPES)):
                mean = sum(m[a][k].float() for a in range(nodes)) / nodes
                for a in range(nodes):
                    m[a][k] = mean.to(m[a][k].dtype)
    return x


CONFIGS = [
    dict(vote="mavo"),
    dict(vote="avg"),
    dict(vote="mavo", ties="random"),
    dict(vote="mavo", comm="allgather"),
    dict(vote="avg", comm="allgather", bucket_cap_mb=40 * 4 / 2**20),  # tiny buckets: one per parameter or so
    dict(vote="mavo", dense=True),
    dict(vote="mavo", ties="random", dense=True),
    dict(vote="mavo", comm="pbit"),
    dict(vote="avg", comm="pbit", dense=True),
    dict(vote="mavo", comm="auto", momentum_sync=2),
    dict(vote="mavo", aggregate="quantized", quant_bits=4, bucket_cap_mb=300 * 4 / 2**20),
]


def test_two_nodes_of_two_ranks_match_the_literal_reference_and_agree_bitwise_after_every_step():
    results = spawn(hier_worker, 4, (2, 2), CONFIGS, timeout_s=300)
    for c, cfg in enumerate(CONFIGS):
        ranks = [r[c] for r in results]
        for t in range(STEPS):
            for rank in range(1, 4):
                for k, (a, b) in enumerate(zip(ranks[rank]["history"][t], ranks[0]["history"][t])):
                    assert torch.equal(a, b), f"{cfg}: rank {rank} parameter {k} differs from rank 0 after step {t}"
        expected = hier_reference(2, 2, cfg, ranks[0]["layout"])
        for k, (got, want) in enumerate(zip(ranks[0]["history"][-1], expected)):
            assert torch.equal(got, want), f"{cfg}: parameter {k} differs from the literal reference"
        if not cfg.get("dense"):  # the parameter no rank has a gradient for is untouched
            assert torch.equal(ranks[0]["history"][-1][2], init_params(0)[2])
        # one momentum per node, sharded: the node's two ranks hold complementary halves
        n = ranks[0]["num_params"]
        assert ranks[0]["momentum_numel"] + ranks[1]["momentum_numel"] == n
        assert ranks[2]["momentum_numel"] + ranks[3]["momentum_numel"] == n


def flat_worker(rank, world, configs):
    mesh = make_mesh((world, 1))
    flat = configs_worker(rank, world, configs)
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = dlion.HierarchicalDistributedLion(
            params, lr=LR, betas=BETAS, weight_decay=WD, mesh=mesh, vote=cfg["vote"], ties=cfg.get("ties", "zero"),
            comm=cfg.get("comm", "1bit"), momentum_sync=cfg.get("momentum_sync", "none"),
            aggregate=cfg.get("aggregate", "sign"), quant_bits=cfg.get("quant_bits", 8),
            bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0), seed=5)
        for t in range(STEPS):
            for p, g in zip(params, grads_for(rank, t, cfg.get("dense", False))):
                p.grad = g
            opt.step()
        out.append(dict(params=[p.detach().clone() for p in params], stats=opt.comm_stats.state_dict()))
    return flat, out


@pytest.mark.parametrize("world", [3])
def test_one_rank_per_node_is_exactly_flat_distributed_lion(world):
    cfgs = CONFIGS[:4] + CONFIGS[7:]
    for flat, hier in spawn(flat_worker, world, cfgs, timeout_s=300):
        for cfg, f, h in zip(cfgs, flat, hier):
            for k, (a, b) in enumerate(zip(f["params"], h["params"])):
                assert torch.equal(a, b), f"{cfg}: parameter {k} differs from DistributedLion"
            # the same bytes between nodes as the flat optimizer between ranks (minus its one-time DDP check)
            flat_bytes = f["stats"]["bytes_sent"] - f["stats"]["by_kind"].get("check", [0])[0]
            assert h["stats"]["bytes_sent"] == flat_bytes, cfg
