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
from dlion.vote import coin_key, tie_coins
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, SHAPES, STEPS, WD, configs_worker, grads_for, init_params


def make_mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("node", "local"))


def hier_from_cfg(params, mesh, cfg):
    """The hierarchical optimizer with a test config's options (the keys conftest.configs_worker reads)."""
    return dlion.HierarchicalDistributedLion(
        params, lr=LR, betas=BETAS, weight_decay=WD, mesh=mesh, vote=cfg["vote"], ties=cfg.get("ties", "zero"),
        comm=cfg.get("comm", "1bit"), momentum_sync=cfg.get("momentum_sync", "none"),
        aggregate=cfg.get("aggregate", "sign"), quant_norm=cfg.get("quant_norm", "l1"),
        quant_bits=cfg.get("quant_bits", 8), bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0), seed=5,
        momentum_dtype=cfg.get("momentum_dtype"), fused=cfg.get("fused", False))


def hier_worker(rank, world, shape, configs):
    mesh = make_mesh(shape)
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = hier_from_cfg(params, mesh, cfg)
        history = []
        for t in range(STEPS):
            for p, g in zip(params, grads_for(rank, t, cfg.get("dense", False))):
                p.grad = g
            opt.step()
            history.append([p.detach().clone() for p in params])
        out.append(dict(history=history, layout=opt.bucket_layout(), stats=opt.comm_stats.state_dict(),
                        momentum_numel=opt.momentum_numel, num_params=opt.num_params,
                        algorithms=opt.algorithm_names))
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
    mdt = cfg.get("momentum_dtype")  # storage only: widened to the parameter's dtype for the math
    m = [[torch.zeros(s, dtype=mdt or d) for s, d in SHAPES] for _ in range(nodes)]
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
                c = BETAS[0] * m[a][k].to(dtype) + (1 - BETAS[0]) * g
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
                m[a][k] = (BETAS[1] * m[a][k].to(dtype) + (1 - BETAS[1]) * g).to(mdt or dtype)
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
    dict(vote="mavo", momentum_dtype=torch.bfloat16, momentum_sync=3),
    # the native loops on each rank's slice (fp32 and fp64 buckets; abstentions; the packed 1-bit payload)
    dict(vote="mavo", ties="random", fused=True),
    dict(vote="avg", dense=True, fused=True),
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
        # the collective among the nodes, per bucket
        want = "quantized" if cfg.get("aggregate") == "quantized" else cfg.get("comm", "1bit")
        for res in ranks:
            assert res["algorithms"] and all(a == want if want != "auto" else a in ("1bit", "allgather", "pbit")
                                             for a in res["algorithms"])
        # one momentum per node, sharded: the node's two ranks hold complementary halves
        n = ranks[0]["num_params"]
        assert ranks[0]["momentum_numel"] + ranks[1]["momentum_numel"] == n
        assert ranks[2]["momentum_numel"] + ranks[3]["momentum_numel"] == n


def test_one_node_is_lion_on_the_mean_gradient_with_sharded_momentum():
    """A single node of 2 ranks: one voter, so Δ = sign(c) of the node (Lion on the mean gradient)."""
    cfgs = [dict(vote="mavo"), dict(vote="avg", comm="allgather", dense=True)]
    results = spawn(hier_worker, 2, (1, 2), cfgs, timeout_s=120)
    for c, cfg in enumerate(cfgs):
        expected = hier_reference(1, 2, cfg, results[0][c]["layout"])
        for rank in range(2):
            for k, (got, want) in enumerate(zip(results[rank][c]["history"][-1], expected)):
                assert torch.equal(got, want), f"{cfg}: rank {rank} parameter {k}"
        assert results[0][c]["stats"]["bytes_sent"] == 0  # nothing crosses between nodes: there is one


def flat_worker(rank, world, configs):
    mesh = make_mesh((world, 1))
    flat = configs_worker(rank, world, configs)
    out = []
    for cfg in configs:
        params = [p.requires_grad_() for p in init_params(rank)]
        opt = hier_from_cfg(params, mesh, cfg)
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
            for key in ("voted", "unanimous", "tied"):  # and the same vote tallies
                assert h["stats"][key] == f["stats"][key], (cfg, key)


# -- bytes between nodes and momentum memory -----------------------------------------------------

class GroupTap:
    """Counts, independently of the library, the bytes handed to torch.distributed's collectives,
    split by whether the group spans nodes (ranks r // L differ) or stays inside one."""

    def __init__(self, local_world):
        import torch.distributed as dist
        self.dist, self.L, self.orig = dist, local_world, {}
        self.bytes = {"inter": 0.0, "intra": 0.0}
        self.calls = {"inter": [], "intra": []}
        for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce",
                     "reduce_scatter_tensor", "reduce_scatter_single"):
            if hasattr(dist, name):
                self.orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.orig[name]))

    def _wrap(self, name, fn):
        def wrapper(*a, **k):
            group = k.get("group")
            n = self.dist.get_world_size(group)
            ranks = self.dist.get_process_group_ranks(group) if group is not None else list(range(n))
            where = "inter" if len({r // self.L for r in ranks}) > 1 else "intra"
            t = a[1] if name != "all_reduce" else a[0]  # the input tensor
            b = t.numel() * t.element_size()
            factor = {"all_reduce": 2 * (n - 1) / n, "all_to_all_single": (n - 1) / n,
                      "reduce_scatter_tensor": (n - 1) / n, "reduce_scatter_single": (n - 1) / n}.get(name, n - 1)
            self.bytes[where] += b * factor
            self.calls[where].append((name, b))
            return fn(*a, **k)
        return wrapper

    def close(self):
        for name, fn in self.orig.items():
            setattr(self.dist, name, fn)


BIG = 400_000


def bytes_worker(rank, world, configs):
    mesh = make_mesh((2, 2))
    out = []
    for cfg in configs:
        torch.manual_seed(0)
        params = [torch.randn(BIG, requires_grad=True), torch.randn(40, requires_grad=True)]
        opt = dlion.HierarchicalDistributedLion(params, lr=1e-3, mesh=mesh, **cfg)
        flat_params = [p.detach().clone().requires_grad_() for p in params]
        flat = dlion.DistributedLion(flat_params, lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        tap = GroupTap(2)
        try:
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
        finally:
            tap.close()
        sd = opt.state_dict()
        out.append(dict(tap=(tap.bytes, tap.calls), stats=opt.comm_stats.state_dict(),
                        local=opt.local_stats.state_dict(), num_params=opt.num_params,
                        hier_momentum_bytes=sum(m.numel() * m.element_size()
                                                for m in sd["dlion"]["hierarchical"]["momentum"]),
                        flat_momentum_bytes=sum(flat.state[p]["exp_avg"].numel() * flat.state[p]["exp_avg"].element_size()
                                                for p in flat_params),
                        momentum_numel=opt.momentum_numel))
    return out


def test_bytes_between_nodes_stay_near_the_bound_spread_over_local_ranks_and_momentum_is_sharded():
    """Per step, the bytes a rank sends to other nodes are within 1.1x of (1 + b)(n-1)/n bits per
    parameter divided by the L local ranks (each carries its slice); comm_stats counts exactly what
    reaches torch.distributed on the inter-node groups; momentum memory per rank is 1/L of flat's."""
    cfgs = [dict(vote="mavo", comm="1bit"), dict(vote="mavo", ties="random", comm="1bit"),
            dict(vote="avg", comm="1bit"), dict(vote="mavo", comm="auto")]
    bits = [1.6, 1.0, 2.0, 1.6]  # b for two voters: base-3 ties, random ties, ⌈log2 3⌉, (auto: all-gather, 1 bit)
    results = spawn(bytes_worker, 4, cfgs, timeout_s=300)
    n_nodes, L, steps = 2, 2, 3
    for c, (cfg, b) in enumerate(zip(cfgs, bits)):
        per_node = 0.0
        for rank, res in enumerate(r[c] for r in results):
            (tapped, calls), st, n = res["tap"], res["stats"], res["num_params"]
            assert n == BIG + 40
            assert st["bytes_sent"] == pytest.approx(tapped["inter"], abs=len(calls["inter"])), cfg
            assert res["local"]["bytes_sent"] == pytest.approx(tapped["intra"], abs=len(calls["intra"])), cfg
            bound = (1 + b) * (n_nodes - 1) / n_nodes * n / 8 / L  # this rank's share, bytes per step
            sent = tapped["inter"] / steps
            assert 0.9 * bound <= sent <= 1.1 * bound or (cfg["comm"] == "auto" and sent <= 1.1 * bound), \
                (cfg, rank, sent, bound)
            per_node += sent if rank < L else 0.0
            # nothing but the vote crosses nodes: the fp32 gradients stay inside
            assert {name for name, _ in calls["inter"]} <= {"all_to_all_single", "all_gather_single",
                                                            "all_gather_into_tensor", "all_reduce"}
            assert all(nb < 4 * n / L / 8 for _, nb in calls["inter"]), cfg  # no fp32-sized payload
            # momentum: this rank holds its slice of the node's momentum, 1/L of the flat optimizer's
            assert res["hier_momentum_bytes"] == 4 * res["momentum_numel"]
            assert res["flat_momentum_bytes"] == 4 * n
            # (slices differ by the bucket's padding: fewer than 40·n_nodes·L coordinates)
            assert abs(res["hier_momentum_bytes"] - res["flat_momentum_bytes"] / L) <= 4 * 40 * n_nodes * L, cfg
        assert per_node <= 1.1 * (1 + b) * (n_nodes - 1) / n_nodes * (BIG + 40) / 8


# -- checkpoints ------------------------------------------------------------------------------

def _hier(params, mesh, **kw):
    return dlion.HierarchicalDistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, mesh=mesh, comm="1bit",
                                             seed=5, **kw)


def _train(opt, params, rank, steps):
    for t in steps:
        for p, g in zip(params, grads_for(rank, t, False)):
            p.grad = g
        opt.step()


def checkpoint_worker(rank, world):
    import torch.distributed as dist
    mesh = make_mesh((2, 2))
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = _hier(params, mesh, ties="random")
    _train(opt, params, rank, range(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # this rank's state: its slices of its node's momentum
    saved_params = [p.detach().clone() for p in params]
    _train(opt, params, rank, range(3, STEPS))
    straight = [p.detach().clone() for p in params]
    straight_m = [m.clone() for m in opt.state_dict()["dlion"]["hierarchical"]["momentum"]]

    resumed = [p.clone().requires_grad_() for p in saved_params]
    opt2 = _hier(resumed, mesh, ties="random")
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    _train(opt2, resumed, rank, range(3, STEPS))
    out = dict(straight=straight, resumed=[p.detach().clone() for p in resumed],
               straight_m=straight_m, resumed_m=opt2.state_dict()["dlion"]["hierarchical"]["momentum"],
               steps=(opt.comm_stats.steps, opt2.comm_stats.steps),
               step_state=[opt2.state[p]["step"].item() for p in resumed])

    errors = {}
    hier_sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    flat_params = [p.clone().requires_grad_() for p in saved_params]
    flat = dlion.DistributedLion(flat_params, lr=LR, comm="1bit")
    _train(flat, flat_params, rank, range(1))
    try:
        flat.load_state_dict(hier_sd)
    except ValueError as e:
        errors["hier->flat"] = str(e)
    try:
        _hier([p.clone().requires_grad_() for p in saved_params], mesh).load_state_dict(flat.state_dict())
    except ValueError as e:
        errors["flat->hier"] = str(e)
    # another rank's shard (the other local rank of the node): refused, not silently mixed in
    others = [None] * world
    dist.all_gather_object(others, buf.getvalue())
    neighbour = torch.load(io.BytesIO(others[rank ^ 1]), weights_only=True)
    try:
        _hier([p.clone().requires_grad_() for p in saved_params], mesh).load_state_dict(neighbour)
    except ValueError as e:
        errors["neighbour"] = str(e)
    out["errors"] = errors
    return out


def test_checkpoint_resumes_bitwise_on_the_mesh_and_flat_hierarchical_mixes_are_refused():
    for rank, res in enumerate(spawn(checkpoint_worker, 4, timeout_s=300)):
        for k, (a, b) in enumerate(zip(res["straight"], res["resumed"])):
            assert torch.equal(a, b), f"rank {rank} parameter {k}: resumed run differs from the uninterrupted one"
        for a, b in zip(res["straight_m"], res["resumed_m"]):
            assert torch.equal(a, b)
        assert res["steps"] == (STEPS, STEPS)
        assert res["step_state"][0] == STEPS and res["step_state"][2] == 0  # parameter 2 never had a gradient
        err = res["errors"]
        assert "saved by dlion.HierarchicalDistributedLion" in err["hier->flat"]
        assert "saved by a flat optimizer" in err["flat->hier"]
        assert "Momentum shards cannot be re-cut" in err["neighbour"] and f"local {rank % 2}" in err["neighbour"]


# -- errors are rank-consistent ------------------------------------------------------------------

def errors_worker(rank, world):
    mesh = make_mesh((2, 2))
    out = {}
    # an LR changed on one rank only (rank 3: node 1, local 1)
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = _hier(params, mesh)
    _train(opt, params, rank, range(1))
    if rank == 3:
        opt.param_groups[0]["lr"] = LR / 2
    before = [p.detach().clone() for p in params]
    try:
        _train(opt, params, rank, range(1, 2))
    except ValueError as e:
        out["lr"] = (str(e), all(torch.equal(a, b) for a, b in zip(before, params)))
    # inf on one rank: every rank skips the step
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = _hier(params, mesh)
    _train(opt, params, rank, range(1))
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads_for(rank, 1, True)):
        p.grad = g
    if rank == 1:
        params[6].grad[3, 3] = float("inf")
    opt.step()
    out["inf"] = (opt.skipped_steps, all(torch.equal(a, b) for a, b in zip(before, params)))
    # a sparse gradient on rank 2: its ValueError there, RuntimeError elsewhere, nothing changed
    for p, g in zip(params, grads_for(rank, 2, True)):
        p.grad = g
    if rank == 2:
        params[1].grad = params[1].grad.to_sparse()
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        out["sparse"] = (type(e).__name__, str(e), all(torch.equal(a, b) for a, b in zip(before, params)))
    # check_every: replicas compared across the whole mesh; a replica changed behind its back is named
    params = [p.requires_grad_() for p in init_params(rank)]
    opt = _hier(params, mesh, check_every=1)
    _train(opt, params, rank, range(2))
    if rank == 2:
        with torch.no_grad():
            params[5][7] += 1.0
    try:
        opt.check_replicas()
    except dlion.DesyncError as e:
        out["desync"] = str(e)
    return out


def test_bad_inputs_on_one_rank_stop_or_skip_every_rank_and_change_nothing():
    for rank, res in enumerate(spawn(errors_worker, 4, timeout_s=120)):
        msg, unchanged = res["lr"]
        assert "ranks disagree on lr, betas, weight_decay or maximize at step 1" in msg and unchanged
        assert res["inf"] == (1, True)
        kind, msg, unchanged = res["sparse"]
        assert unchanged
        if rank == 2:
            assert kind == "ValueError" and "has a sparse gradient" in msg
        else:
            assert kind == "RuntimeError" and "another rank rejected its gradients" in msg
        assert "parameter 5 (shape (50,)) differs between rank 0 and rank 2 after step 2" in res["desync"]


def checkpoint_files_worker(rank, world, path, sharded):
    from torch import nn

    from dlion import checkpoint
    mesh = make_mesh((2, 2))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        return model, _hier(model.parameters(), mesh, ties="random")

    def train(model, opt, steps):
        g = torch.Generator().manual_seed(100 + rank)
        for t in range(steps[-1] + 1):
            x = torch.randn(8, 6, generator=g)
            if t in steps:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()

    model, opt = build()
    train(model, opt, range(3))
    checkpoint.save(path, model, opt, sharded=sharded)
    train(model, opt, range(3, 6))
    straight = [p.detach().clone() for p in model.parameters()]
    model2, opt2 = build()
    checkpoint.load(path, model2, opt2)
    train(model2, opt2, range(3, 6))
    return straight, [p.detach().clone() for p in model2.parameters()], opt2.step_count


@pytest.mark.parametrize("sharded", [False, True])
def test_dlion_checkpoint_files_resume_the_hierarchical_optimizer_bitwise(tmp_path, sharded):
    path = str(tmp_path / ("ckpt" if sharded else "ckpt.pt"))
    results = spawn(checkpoint_files_worker, 4, path, sharded, timeout_s=300)
    for straight, resumed, steps in results:
        assert steps == 6
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def resize_worker(rank, world, path):
    from torch import nn

    from dlion import checkpoint
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = _hier(model.parameters(), make_mesh((1, 2)))
    try:
        checkpoint.load(path, model, opt)
    except checkpoint.CheckpointError as e:  # (any other exception fails the worker, and the test)
        return type(e).__name__, str(e)
    return None


def test_a_hierarchical_checkpoint_on_another_mesh_is_refused(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    spawn(checkpoint_files_worker, 4, path, False, timeout_s=300)  # saved by 2 × 2 ranks
    for rank, err in enumerate(spawn(resize_worker, 2, path, timeout_s=120)):  # loaded by 1 × 2
        assert err is not None, "a 2 x 2 hierarchical checkpoint was loaded on a 1 x 2 mesh"
        # rank r of the 1 × 2 mesh reads the state rank r saved: (node 0, local r) of the 2 × 2 mesh
        assert err == ("CheckpointError", f"checkpoint {path!r}: HierarchicalDistributedLion: this state was saved on "
                       f"a 2 × 2 mesh by rank (node 0, local {rank}); this rank is (node 0, local {rank}) of a 1 × 2 "
                       "mesh with another layout. Momentum shards cannot be re-cut: resume on the same mesh, each "
                       "rank loading its own state."), err


def mesh_change_worker(rank, world, path):
    import dlion.checkpoint as ckpt
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = _hier(model.parameters(), make_mesh((2, 2)))
    model(torch.randn(3, 6) + rank).sum().backward()
    opt.step()
    ckpt.save(path, model, opt)
    saved = [p.detach().clone() for p in model.parameters()]
    # the same 4 ranks as 4 nodes of 1: another mesh, so the momentum shards do not fit
    fresh = torch.nn.Linear(6, 4)
    before = [p.detach().clone() for p in fresh.parameters()]
    opt2 = _hier(fresh.parameters(), make_mesh((4, 1)))
    try:
        ckpt.load(path, fresh, opt2)
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    # on the mesh it was saved on, it loads
    again = torch.nn.Linear(6, 4)
    ckpt.load(path, again, _hier(again.parameters(), make_mesh((2, 2))))
    loaded = all(torch.equal(a, b) for a, b in zip(saved, again.parameters()))
    return error, unchanged, loaded


def test_checkpoint_load_on_another_mesh_refuses_before_changing_the_model(tmp_path):
    for rank, (error, unchanged, loaded) in enumerate(spawn(mesh_change_worker, 4, str(tmp_path / "c.pt"),
                                                            timeout_s=300)):
        assert error is not None and "Momentum shards cannot be re-cut" in error, (rank, error)
        assert unchanged, f"rank {rank}: the model was changed by a load that failed"
        assert loaded


def test_previous_vote_ties_are_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="ties='previous' is implemented in DistributedLion"):
        dlion.HierarchicalDistributedLion([torch.zeros(3, requires_grad=True)], ties="previous")
