"""DistributedLion on real Gloo process groups against a single-process simulation of N workers.

Each worker gets gradients that are a fixed function of (rank, step) (``grads_for`` in
conftest.py, shared with the Lion Cub and simulation tests), including the awkward cases:
a row whose gradient is always 0 (a padding embedding), a parameter no rank ever has a
gradient for, and one only even ranks have.
The reference below is written directly from the update rule of "Communication Efficient
Distributed Training with Distributed Lion" (Liu et al. 2024, arXiv 2404.00438) — it
shares no code with the optimizer except the tie-coin hash, which is part of the contract.
"""

import math

import pytest
import torch

import dlion
from dlion.vote import coin_key, tie_coins
from dlion.lab.spawn import spawn
from conftest import BETAS, LR, SHAPES, STEPS, WD, configs_worker, grads_for, init_params


def simulate(world, cfg, layout, momenta=False):
    """N workers in one process, straight from the paper's equations (with ``momentum_dtype``:
    m stored in that dtype, widened to the parameter's dtype for the math, rounded once)."""
    x = [p.clone() for p in init_params(0)]
    store = cfg.get("momentum_dtype")
    m = [[torch.zeros(s, dtype=store or d) for s, d in SHAPES] for _ in range(world)]
    last = [torch.zeros(s, dtype=d) for s, d in SHAPES]  # the last applied update (ties="previous")
    for t in range(STEPS):
        grads = [grads_for(i, t, cfg.get("dense", False)) for i in range(world)]
        for k in range(len(SHAPES)):
            deltas = []
            for i in range(world):
                g = grads[i][k]
                if g is None:
                    deltas.append(torch.zeros_like(x[k]))  # abstain
                    continue
                if cfg.get("maximize"):
                    g = -g
                mk = m[i][k].to(x[k].dtype)
                c = BETAS[0] * mk + (1 - BETAS[0]) * g
                deltas.append(torch.sign(c))
                m[i][k] = (BETAS[1] * mk + (1 - BETAS[1]) * g).to(m[i][k].dtype)
            if all(grads[i][k] is None for i in range(world)):
                last[k] = torch.zeros_like(x[k])
                continue  # no gradient anywhere: not touched at all
            s = sum(deltas)
            nz = sum(d.abs() for d in deltas)
            if cfg["vote"] == "avg":
                update = s / world
            else:
                update = torch.sign(s)
                if cfg.get("ties") in ("random", "previous") and world > 1:
                    bucket, offset, _ = layout[k]
                    coins = tie_coins(coin_key(5, t, bucket), offset, s.numel()).view(s.shape).to(s.dtype)
                    if cfg["ties"] == "previous":  # the last applied update where it moved, else the coin
                        coins = torch.where(last[k] != 0, last[k], coins)
                    update = torch.where((s == 0) & (nz > 0), coins, update)
            last[k] = update
            x[k] = x[k] * (1 - LR * WD)
            x[k] = x[k] - LR * update
    return (x, m) if momenta else x


CONFIGS = [
    dict(vote="mavo"),
    dict(vote="avg"),
    dict(vote="mavo", ties="random"),
    dict(vote="mavo", comm="allgather"),
    dict(vote="avg", comm="allgather", bucket_cap_mb=40 * 4 / 2**20),  # tiny buckets: one per parameter or so
    dict(vote="mavo", dense=True),
    dict(vote="avg", dense=True),
    dict(vote="mavo", ties="random", dense=True),
    dict(vote="mavo", comm="pbit"),
    dict(vote="avg", comm="pbit", dense=True),
    dict(vote="avg", comm="auto"),
    dict(vote="mavo", momentum_dtype=torch.bfloat16),
    dict(vote="avg", dense=True, momentum_dtype=torch.bfloat16),
    dict(vote="mavo", maximize=True),  # (the fp32 bucket reads its gradients in place, the fp64 one copies them)
    dict(vote="mavo", ties="random", fused=True),  # native local math (fp32 and fp64 buckets; abstentions)
    dict(vote="mavo", ties="previous"),
    dict(vote="mavo", ties="previous", dense=True, comm="pbit"),
    dict(vote="mavo", ties="previous", comm="allgather", bucket_cap_mb=40 * 4 / 2**20),
    dict(vote="avg", dense=True, maximize=True, fused=True),
    dict(vote="mavo", fused=True, momentum_dtype=torch.bfloat16),  # (falls back: bf16-stored momentum)
    # no abstention: the 1-bit codes are applied from their packed bits; gradients read in place (fp32)
    dict(vote="mavo", ties="random", dense=True, fused=True),
    dict(vote="mavo", dense=True, maximize=True, fused=True),
    # a small first bucket, then one bucket of the rest (DDP's first bucket)
    dict(vote="mavo", ties="random", fused=True, bucket_cap_mb=[40 * 4 / 2**20, 25.0]),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_matches_simulated_workers_and_ranks_agree_bitwise(world):
    results = spawn(configs_worker, world, CONFIGS)
    for c, cfg in enumerate(CONFIGS):
        ranks = [r[c] for r in results]
        expected = simulate(world, cfg, ranks[0]["layout"])
        n_buckets = 0 if world == 1 else 1 + max(w[0] for w in ranks[0]["layout"] if w is not None)
        for res in ranks:  # the algorithm asked for, in every bucket (comm="auto" in this test's set-up: one of them)
            want = cfg.get("comm", "1bit")
            assert len(res["algorithms"]) == n_buckets and all(
                a == want if want != "auto" else a in ("1bit", "allgather", "pbit") for a in res["algorithms"])
        for rank, res in enumerate(ranks):
            for k, (got, want) in enumerate(zip(res["params"], expected)):
                assert torch.equal(got, want), f"{cfg} rank {rank} parameter {k} differs from the simulation"
        # Explicit: the parameter nobody had a gradient for is rank 0's initial value, untouched,
        # and the padding row only decayed.
        row = init_params(0)[0][0]
        for _ in range(STEPS):
            row = row * (1 - LR * WD)
        for res in ranks:
            if not cfg.get("dense"):
                assert torch.equal(res["params"][2], init_params(0)[2])
                assert torch.equal(res["params"][0][0], row)
            # the per-parameter step counters: every step that moved the parameter, none for the one never updated
            updated = [g is not None for g in grads_for(0, 0, cfg.get("dense", False))]
            assert res["steps"] == [STEPS if moved else 0.0 for moved in updated], (cfg, res["steps"])
        if cfg.get("ties") == "previous" and world % 2 == 0:  # the rule is exercised: it is not the coin's
            coin = next(c for c, other in enumerate(CONFIGS) if other == dict(vote="mavo", ties="random"))
            if cfg == dict(vote="mavo", ties="previous"):
                assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["params"], results[0][coin]["params"]))
        if cfg.get("momentum_dtype") is not None:  # the stored momenta themselves, in their dtype
            _, ref_m = simulate(world, cfg, ranks[0]["layout"], momenta=True)
            for rank, res in enumerate(ranks):
                for k, (got, want) in enumerate(zip(res["momenta"], ref_m[rank])):
                    if got is not None:
                        assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"{cfg} rank {rank} m{k}"


def expected_bits(vote, ties, world):
    """b, the width of the result on the way back, with no abstentions."""
    if vote == "avg":
        return math.ceil(math.log2(world + 1))
    return 1.0 if (world % 2 or ties == "random") else 1.6


class WireTap:
    """Counts, independently of the library, the bytes handed to torch.distributed's
    collectives, converted with the bandwidth-optimal per-rank factors written here."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.sent, self.calls, self.orig = dist, 0.0, [], {}
        for name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_reduce"):
            if hasattr(dist, name):
                self.orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.orig[name]))

    def _wrap(self, name, fn):
        def wrapper(*a, **k):
            n = self.dist.get_world_size(k.get("group"))
            t = a[1] if name != "all_reduce" else a[0]  # the input tensor
            b = t.numel() * t.element_size()
            self.sent += {"all_to_all_single": b * (n - 1) / n, "all_reduce": 2 * b * (n - 1) / n}.get(name, b * (n - 1))
            self.calls.append((name, b))
            return fn(*a, **k)
        return wrapper

    def close(self):
        for name, fn in self.orig.items():
            setattr(self.dist, name, fn)


def tapped_worker(rank, world, configs):
    out = []
    for cfg in configs:
        tap = WireTap()
        try:
            res = configs_worker(rank, world, [cfg])[0]
        finally:
            tap.close()
        res["tap"] = (tap.sent, tap.calls)
        out.append(res)
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_bytes_on_the_wire_are_counted_exactly_and_stay_near_the_bound(world):
    """comm_stats equals an independent count of what reaches torch.distributed, and that
    count is within 1.05x of the information bound (1 + b)(N-1)/N bits per coordinate
    plus a fixed header per bucket (at most 64 bytes a block)."""
    cfgs = [dict(vote="mavo", dense=True), dict(vote="avg", dense=True), dict(vote="mavo", ties="random", dense=True),
            dict(vote="mavo"), dict(vote="mavo", ties="random")]
    results = spawn(tapped_worker, world, cfgs)
    n = sum(math.prod(s) for s, _ in SHAPES)
    for cfg, res in zip(cfgs, results[0]):
        st = res["stats"]
        sent, calls = res["tap"]
        buckets = len({entry[0] for entry in res["layout"]})
        assert st["steps"] == STEPS and st["bytes_sent"] == st["bytes_received"]
        assert st["bytes_sent"] == pytest.approx(sent, abs=len(calls)), cfg  # rounding: at most 1 byte per call
        kinds = [c[0] for c in calls]  # one all-to-all and one all-gather per bucket and step ...
        a2a = kinds.count("all_to_all_single")
        ag = kinds.count("all_gather_single") + kinds.count("all_gather_into_tensor")
        assert a2a + ag == len(kinds)
        ag -= 1  # after the first step: one all-gather of gradient checksums (the DDP-wrapped-model warning)
        if cfg.get("dense"):
            assert a2a == ag == buckets * STEPS, (cfg, kinds)
        else:  # ... plus at most one re-send in base 3 per bucket and direction: the format switch is sticky
            assert buckets * STEPS <= a2a <= buckets * (STEPS + 1) and buckets * STEPS <= ag <= buckets * (STEPS + 1)
        b = expected_bits(cfg["vote"], cfg.get("ties", "zero"), world)
        bound = (1 + b) * (world - 1) / world * n / 8
        header = buckets * 2 * 64 * world  # one header per block each way
        assert sent / STEPS <= 1.05 * bound + header, (cfg, sent / STEPS, bound)


def frozen_worker(rank, world, grads_less):
    torch.manual_seed(0)
    backbone = torch.nn.Linear(1000, 1000)        # 1 M frozen values
    head = torch.nn.Linear(1000, 10)              # ~10 k trainable values
    extra = torch.nn.Linear(10, 10)               # trainable, but with no gradient on some / all ranks
    backbone.requires_grad_(False)
    params = list(backbone.parameters()) + list(head.parameters()) + list(extra.parameters())
    frozen_before = [p.detach().clone() for p in backbone.parameters()]
    tap = WireTap()
    try:
        opt = dlion.DistributedLion(params, lr=0.01, weight_decay=0.1, momentum_sync=1, comm="1bit")
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(8, 1000, generator=g)
            opt.zero_grad()
            y = head(backbone(x))
            if grads_less == "some" and rank % 2 == 0:
                y = y + extra(y).sum() * 0 + extra(torch.zeros(1, 10)).sum()
            y.pow(2).mean().backward()
            opt.step()
    finally:
        tap.close()
    return dict(params=[p.detach().clone() for p in params], frozen_before=frozen_before, tap=tap.sent,
                stats=opt.comm_stats.state_dict(), num_params=opt.num_params,
                has_state=[p in opt.state for p in params])


@pytest.mark.parametrize("grads_less", ["all", "some"])
def test_frozen_parameters_never_travel(grads_less):
    world = 3
    results = spawn(frozen_worker, world, grads_less)
    trainable = 1000 * 10 + 10 + 10 * 10 + 10
    for r, res in enumerate(results):
        assert res["num_params"] == trainable
        for a, b in zip(res["params"][:2], res["frozen_before"]):
            assert torch.equal(a, b)  # frozen: unchanged (and rank 0's, by the initial broadcast)
        for a, b in zip(res["params"], results[0]["params"]):
            assert torch.equal(a, b)  # every rank bitwise equal
        assert res["has_state"][:2] == [False, False]  # no momentum for frozen parameters
    st = results[0]["stats"]
    # 1-bit vote of the trainable part + momentum sync of the trainable part only, per step:
    vote = 2 * trainable / 8 * (world - 1) / world
    sync = 2 * 4 * trainable * (world - 1) / world
    per_step = results[0]["tap"] / 3
    assert per_step == pytest.approx(st["bytes_sent"] / 3, rel=1e-3)
    assert per_step < 1.1 * (vote + sync) + 2 * 64 * world * 2, per_step  # nothing of the 1 M frozen values
    if grads_less == "all":  # `extra` never has a gradient: untouched, no decay
        assert torch.equal(results[0]["params"][4], frozen_worker_init()[4])


def all_frozen_worker(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    model.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    opt = dlion.DistributedLion(model.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(2):
        opt.step()
    return dict(same=[torch.equal(a, b) for a, b in zip(model.parameters(), before)], steps=opt.step_count,
                num_params=opt.num_params)


def test_a_model_with_nothing_trainable_steps_and_changes_nothing():
    for res in spawn(all_frozen_worker, 2):
        assert res == dict(same=[True, True], steps=2, num_params=0)


def frozen_worker_init():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10), torch.nn.Linear(10, 10)]
    return [p.detach().clone() for m in mods for p in m.parameters()]


def test_without_process_group_it_is_plain_lion():
    a = [p.requires_grad_() for p in init_params(0)]
    b = [p.detach().clone().requires_grad_() for p in a]
    oa = dlion.DistributedLion(a, lr=LR, weight_decay=WD)
    ob = dlion.Lion(b, lr=LR, weight_decay=WD)
    for t in range(STEPS):
        for pa, pb, g in zip(a, b, grads_for(0, t, False)):
            pa.grad = pb.grad = g
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
    assert oa.comm_stats.bytes_sent == 0 and oa.comm_stats.steps == STEPS


# -- bad input ---------------------------------------------------------------

def mismatch_worker(rank, world, kind):
    shapes = [(4, 3), (5,)]
    if kind == "shape" and rank == 1:
        shapes = [(3, 4), (5,)]
    if kind == "count" and rank == 1:
        shapes = [(4, 3)]
    params = [torch.ones(s, dtype=torch.float64 if (kind == "dtype" and rank == 1 and i == 1) else torch.float32)
              * (rank + 1) for i, s in enumerate(shapes)]
    try:
        dlion.DistributedLion(params, lr=0.1)
    except ValueError as e:
        return str(e), [p.clone() for p in params]
    return None, None


@pytest.mark.parametrize("kind, message", [
    ("shape", "ranks disagree on the model at parameter 0: rank 1 has shape (3, 4) dtype float32, rank 0 has shape (4, 3)"),
    ("count", "rank 1 has 1 parameters, rank 0 has 2"),
    ("dtype", "at parameter 1: rank 1 has shape (5,) dtype float64, rank 0 has shape (5,) dtype float32"),
])
def test_ranks_disagreeing_on_the_model_get_a_clear_error_and_nothing_changes(kind, message):
    results = spawn(mismatch_worker, 2, kind)
    for rank, (err, params) in enumerate(results):
        assert err is not None and message in err
        assert all(torch.all(p == rank + 1) for p in params)  # not overwritten by rank 0's broadcast


@pytest.mark.parametrize("kwargs, message", [
    (dict(vote="median"), "Unknown vote 'median'"),
    (dict(ties="up"), "Unknown ties 'up'"),
    (dict(comm="carrier-pigeon"), "Unknown comm 'carrier-pigeon'"),
    (dict(lr=0), "Invalid learning rate"),
    (dict(betas=(0.9, 1.0)), "Invalid beta2"),
    (dict(weight_decay=-1), "Invalid weight_decay"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb must be > 0"),
    (dict(bucket_cap_mb=[]), "bucket_cap_mb must be > 0"),
    (dict(bucket_cap_mb=[1.0, -2.0]), "bucket_cap_mb must be > 0"),
    (dict(bucket_cap_mb=[1.0, True]), "bucket_cap_mb must be > 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dlion.DistributedLion([torch.zeros(3, requires_grad=True)], **kwargs)


def test_a_list_of_bucket_caps_sizes_the_first_buckets_and_repeats_its_last():
    from dlion.buckets import layout_buckets
    ps = [torch.zeros(n, requires_grad=True) for n in (100, 100, 100, 50, 30, 20)]
    group: dict = {}
    mb = 4 / 2**20  # one fp32 coordinate
    sizes = [[p.numel() for p in b.params] for b in layout_buckets(ps, [group] * 6, 2, [60 * mb, 200 * mb])]
    assert sizes == [[20, 30], [50, 100], [100, 100]]  # reversed order; a bucket closes before passing its cap
    sizes = [[p.numel() for p in b.params] for b in layout_buckets(ps, [group] * 6, 2, 200 * mb)]
    assert sizes == [[20, 30, 50, 100], [100, 100]]
    sizes = [[p.numel() for p in b.params] for b in layout_buckets(ps, [group] * 6, 2, [10 * mb, 60 * mb, 1000 * mb])]
    assert sizes == [[20], [30], [50, 100, 100, 100]]  # a parameter larger than the cap gets a bucket of its own


def test_bad_parameters_rejected():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="appears more than once"):
        dlion.DistributedLion([p, p])
    with pytest.raises(ValueError, match="Lion needs floating-point"):
        dlion.DistributedLion([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(ValueError, match="is sparse"):
        dlion.DistributedLion([torch.zeros(3, 3).to_sparse()])


def sparse_grad_worker(rank, world):
    a = torch.ones(4, requires_grad=True)
    b = torch.ones(4, requires_grad=True)
    opt = dlion.DistributedLion([a, b], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = torch.ones(4).to_sparse() if rank == 0 else torch.ones(4)
    try:
        opt.step()
    except (ValueError, RuntimeError) as e:
        return str(e), a.detach().clone(), opt.state[a].get("exp_avg")
    return None, a.detach().clone(), None


def test_sparse_gradient_on_one_rank_stops_every_rank_and_changes_nothing():
    (err0, a0, m0), (err1, a1, m1) = spawn(sparse_grad_worker, 2)
    assert "Parameter 1 (shape (4,)) has a sparse gradient" in err0
    assert "another rank rejected its gradients" in err1  # no hang on the healthy rank
    assert torch.equal(a0, torch.ones(4)) and torch.equal(a1, torch.ones(4))
    for m in (m0, m1):  # momenta untouched (allocated at construction, still zero)
        assert m is None or torch.equal(m, torch.zeros(4))


# -- misuse that used to desynchronise silently ----------------------------------------

def option_mismatch_worker(rank, world, option):
    kwargs = {"vote": "avg", "ties": "random", "comm": "pbit", "bucket_cap_mb": 1.0, "delay": 1}[option]
    p = torch.ones(4, requires_grad=True)
    try:
        dlion.DistributedLion([p], lr=0.1, **({option: kwargs} if rank == 1 else {}))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("option", ["vote", "ties", "comm", "bucket_cap_mb", "delay"])
def test_options_that_differ_between_ranks_raise_at_construction_on_every_rank(option):
    for err in spawn(option_mismatch_worker, 2, option, timeout_s=30):
        assert err is not None and "ranks disagree on the optimizer's options" in err and option in err


def lr_mismatch_worker(rank, world):
    p = torch.ones(6, requires_grad=True)
    opt = dlion.DistributedLion([p], lr=0.1, comm="1bit")
    p.grad = torch.ones(6)
    opt.step()
    if rank == 0:
        opt.param_groups[0]["lr"] = 0.05  # e.g. an LR scheduler stepped on one rank only
    before = p.detach().clone()
    p.grad = torch.ones(6)
    try:
        opt.step()
    except ValueError as e:
        return str(e), torch.equal(p.detach(), before)
    return None, False


def test_hyperparameters_changed_on_one_rank_raise_within_one_step_on_every_rank():
    for err, unchanged in spawn(lr_mismatch_worker, 3, timeout_s=30):
        assert err is not None and "ranks disagree on lr, betas, weight_decay or maximize at step 1" in err
        assert unchanged


def discard_worker(rank, world, skip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = dlion.DistributedLion(model.parameters(), lr=0.05, overlap=True, comm="1bit", bucket_cap_mb=64 * 4 / 2**20)
    g = torch.Generator().manual_seed(rank)
    import warnings
    for t in range(3):
        x = torch.randn(5, 8, generator=g)
        if skip and t == 1:  # a backward that no step follows (a skipped batch), then zero_grad
            model(torch.randn(5, 8) * 100).pow(2).sum().backward()  # (global RNG: g stays in step)
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                opt.zero_grad()
        else:
            opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_zero_grad_discards_a_backward_without_step_like_torch_optim():
    """A discarded backward leaves no trace: same parameters as if it never happened."""
    plain = spawn(discard_worker, 2, False, timeout_s=30)
    skipped = spawn(discard_worker, 2, True, timeout_s=30)
    for a, b in zip(plain, skipped):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def late_failure_worker(rank, world, failure, overlap, comm):
    torch.manual_seed(0)
    a, b, c = (torch.randn(1000, requires_grad=True) for _ in range(3))
    # one parameter per bucket; buckets follow reversed parameter order, so `a` is the last bucket
    opt = dlion.DistributedLion([{"params": [a]}, {"params": [b, c]}], lr=0.01, weight_decay=0.1, comm=comm,
                                overlap=overlap, bucket_cap_mb=1000 * 4 / 2**20)
    g = torch.Generator().manual_seed(rank)
    for t in range(2):
        for p in (a, b, c):
            p.grad = torch.randn(1000, generator=g)
        if t == 1 and failure == "nan" and rank == world - 1:
            a.grad[7] = float("nan")
        if t == 1 and failure == "lr" and rank == 0:
            opt.param_groups[0]["lr"] = 0.02  # a's group only: the last bucket's digest differs
        before = [p.detach().clone() for p in (a, b, c)]
        momenta = [opt.state[p]["exp_avg"].clone() for p in (a, b, c)] if t else None
        try:
            opt.step()
            error = None
        except ValueError as e:
            error = str(e)
    unchanged = all(torch.equal(x, y) for x, y in zip((a, b, c), before))
    kept = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip((a, b, c), momenta))
    return dict(buckets=len(opt.buckets), error=error, unchanged=unchanged, momenta_kept=kept,
                skipped=opt.skipped_steps)


@pytest.mark.parametrize("comm", ["1bit", "pbit"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("failure", ["nan", "lr"])
def test_a_failure_in_the_last_bucket_leaves_the_earlier_finished_buckets_unapplied(failure, overlap, comm):
    """Buckets are applied as their codes come back, but only once every bucket's first
    collective has shown that no rank failed: a NaN or a changed lr in the last bucket
    leaves every parameter and momentum unchanged on every rank."""
    for res in spawn(late_failure_worker, 3, failure, overlap, comm, timeout_s=60):
        assert res["buckets"] == 3
        assert res["unchanged"] and res["momenta_kept"], res
        if failure == "nan":
            assert res["error"] is None and res["skipped"] == 1
        else:
            assert "ranks disagree on lr" in res["error"] and res["skipped"] == 0


def step_count_worker(rank, world, reset):
    from dlion.collectives import CommStats

    params = [p.requires_grad_() for p in init_params(rank)]
    opt = dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, ties="random", seed=5,
                                momentum_sync=2)
    for t in range(STEPS):
        if reset and t == 3:
            opt.comm_stats = CommStats()  # statistics only: the algorithm must not notice
        for p, g in zip(params, grads_for(rank, t, False)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt.step_count, opt.state_dict()["dlion"]["step_count"]


def test_the_step_counter_is_the_optimizers_not_the_traffic_statistics():
    # tie coins and the momentum-sync schedule are keyed by opt.step_count, which a reset of
    # comm_stats leaves alone; it is saved in state_dict()
    plain = spawn(step_count_worker, 2, False)
    reset = spawn(step_count_worker, 2, True)
    for (pa, na, sa), (pb, nb, sb) in zip(plain, reset):
        assert na == nb == sa == sb == STEPS
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def tally_worker(rank, world, comm):
    # 1000 coordinates, first step (m = 0, so δ = sign(g)): 0–399 every rank +1 (unanimous),
    # 400–799 rank 0 +1 and rank 1 −1 (tied), 800–999 only rank 0 votes (neither)
    p = torch.zeros(1000, requires_grad=True)
    opt = dlion.DistributedLion([p], lr=0.1, comm=comm)
    g = torch.zeros(1000)
    g[:400] = 1.0
    g[400:800] = 1.0 if rank == 0 else -1.0
    if rank == 0:
        g[800:] = 1.0
    p.grad = g
    opt.step()
    st = opt.comm_stats
    return st.voted, st.unanimous, st.tied, st.wait_s


@pytest.mark.parametrize("comm", ["1bit", "allgather", "pbit"])
def test_vote_tally_counts_unanimous_and_tied_coordinates(comm):
    got = spawn(tally_worker, 2, comm)
    if comm == "1bit":  # each rank decides its own chunk: together they cover the bucket once
        totals = [sum(r[i] for r in got) for i in range(3)]
    else:               # every rank decides the whole bucket
        assert got[0][:3] == got[1][:3]
        totals = list(got[0][:3])
    assert totals == [1000, 400, 400]
    assert all(r[3] >= 0.0 for r in got)


def extra_backward_worker(rank, world, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = dlion.DistributedLion(model.parameters(), lr=0.05, overlap=overlap, comm="1bit",
                                bucket_cap_mb=64 * 4 / 2**20)  # several buckets
    g = torch.Generator().manual_seed(rank)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the extra backward is legitimate: no warning
        for t in range(3):
            opt.zero_grad()
            model(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
            if t >= 1:  # steps 1 and 2: two backwards, then step (no no_sync)
                model(torch.randn(5, 8, generator=g)).pow(3).sum().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], \
        [opt.state[p]["exp_avg"].clone() for p in model.parameters()]


def test_step_after_an_extra_backward_uses_the_accumulated_gradients_with_overlap():
    """overlap=True, backward, backward, step: what overlap=False (and torch.optim) gives, bitwise,
    on every rank — not the Δ of the first backward only."""
    plain = spawn(extra_backward_worker, 2, False, timeout_s=30)
    overlapped = spawn(extra_backward_worker, 2, True, timeout_s=30)
    for (pa, ma), (pb, mb) in zip(plain, overlapped):
        for x, y in zip(pa + ma, pb + mb):
            assert torch.equal(x, y)
    for x, y in zip(plain[0][0], plain[1][0]):
        assert torch.equal(x, y)


# -- parameters with no gradient on any rank ------------------------------------------------

SKIP_STEPS = 8


def skip_schedule(k, t, world):
    """Sizes [3000, 50, 7]: the 3000 used by all at step 0, by rank 1 alone at step 4 (when every
    rank has left it out: a re-send) and by all at step 7; the 50 always; the 7 at step 7 only."""
    if k == 0:
        return {0: range(world), 4: [1], 7: range(world)}.get(t, [])
    if k == 1:
        return range(world)
    return range(world) if t == 7 else []


def partial_schedule(k, t, world):
    """Sizes [3000, 30000, 7]: the 3000 on even ranks, the 30000 on all, the 7 on the last rank."""
    return [range(0, world, 2), range(world), [world - 1]][k]


SCHEDULES = {"skip": ([3000, 50, 7], skip_schedule), "partial": ([3000, 30000, 7], partial_schedule),
             "dead": ([3000, 30000, 7], partial_schedule)}


def skip_grad(rank, t, k, sizes, name="skip"):
    """``name="dead"``: as "partial", but ranks 0-2 have two coordinates of the 30000 whose
    gradient is always 0 (c = 0: they abstain inside a parameter they have a gradient for)."""
    g = torch.Generator().manual_seed(100 * rank + 10 * t + k)
    out = torch.randn(sizes[k], generator=g)
    if name == "dead" and k == 1 and rank < 3:
        out[10 + 7 * rank:12 + 7 * rank] = 0.0
    return out


def skip_reference(world, cfg, layout):
    """The paper's update written out: a coordinate votes where the rank has a gradient; a
    parameter no rank has a gradient for is not touched; ties by the coins at the layout's offsets."""
    sizes, schedule = SCHEDULES[cfg.get("schedule", "skip")]
    g0 = torch.Generator().manual_seed(7)
    x = [torch.randn(n, generator=g0) for n in sizes]
    m = [[torch.zeros(n) for n in sizes] for _ in range(world)]
    last = [torch.zeros(n) for n in sizes]  # the last applied update (ties="previous")
    for t in range(SKIP_STEPS):
        for k in range(len(sizes)):
            voters = list(schedule(k, t, world))
            if not voters:
                last[k] = torch.zeros(sizes[k])
                continue
            s = torch.zeros(sizes[k])
            nz = torch.zeros(sizes[k])
            for i in voters:
                g = skip_grad(i, t, k, sizes, cfg.get("schedule", "skip"))
                d = torch.sign(BETAS[0] * m[i][k] + (1 - BETAS[0]) * g)
                m[i][k] = BETAS[1] * m[i][k] + (1 - BETAS[1]) * g
                s, nz = s + d, nz + d.abs()
            if cfg["vote"] == "avg":
                update = s / world
            else:
                update = torch.sign(s)
                if cfg.get("ties") in ("random", "previous"):
                    bucket, offset, _ = layout[k]
                    coins = tie_coins(coin_key(0, t, bucket), offset, s.numel()).to(s.dtype)
                    if cfg["ties"] == "previous":
                        coins = torch.where(last[k] != 0, last[k], coins)
                    update = torch.where((s == 0) & (nz > 0), coins, update)
            last[k] = update
            x[k] = x[k] * (1 - LR * WD) - LR * update
    return x


def skip_worker(rank, world, configs):
    out = []
    for cfg in configs:
        sizes, schedule = SCHEDULES[cfg.get("schedule", "skip")]
        g0 = torch.Generator().manual_seed(7)
        params = [torch.randn(n, generator=g0).requires_grad_() for n in sizes]
        tap = WireTap()
        try:
            def build():
                return dlion.DistributedLion(params, lr=LR, betas=BETAS, weight_decay=WD, vote=cfg["vote"],
                                             ties=cfg.get("ties", "zero"), comm=cfg.get("comm", "1bit"),
                                             overlap=cfg.get("overlap", False), fused=cfg.get("fused", False),
                                             bucket_cap_mb=cfg.get("bucket_cap_mb", 25.0))
            opt = build()
            per_step, calls = [], []
            for t in range(SKIP_STEPS):
                if t == cfg.get("resume_at"):  # a fresh optimizer from the state_dict: the left-out set too
                    state = opt.state_dict()
                    opt = build()
                    opt.load_state_dict(state)
                for k, p in enumerate(params):
                    p.grad = (skip_grad(rank, t, k, sizes, cfg.get("schedule", "skip")) if rank in schedule(k, t, world)
                              else None)
                before, n_calls = tap.sent, len(tap.calls)
                opt.step()
                per_step.append(tap.sent - before)
                calls.append(len(tap.calls) - n_calls)
        finally:
            tap.close()
        out.append(dict(params=[p.detach().clone() for p in params], layout=opt.bucket_layout(),
                        per_step=per_step, calls=calls, stats=opt.comm_stats.state_dict()))
    return out


def run_against_reference(world, configs):
    """Run ``skip_worker`` on ``world`` Gloo ranks; assert every rank's parameters equal the
    paper's update written out, bitwise; return rank 0's records."""
    results = spawn(skip_worker, world, configs)
    for c, cfg in enumerate(configs):
        want = skip_reference(world, cfg, results[0][c]["layout"])
        for rank in range(world):
            for k, (got, ref) in enumerate(zip(results[rank][c]["params"], want)):
                assert torch.equal(got, ref), f"{cfg} world {world} rank {rank} parameter {k}"
    return results[0]


SKIP_CONFIGS = [dict(vote="mavo", resume_at=3), dict(vote="mavo", ties="random"), dict(vote="avg"),
                dict(vote="mavo", comm="allgather"), dict(vote="mavo", ties="random", comm="pbit")]


@pytest.mark.parametrize("world", [3, 4])
def test_a_parameter_without_gradient_anywhere_costs_only_its_header_bit(world):
    """Bitwise the paper's update (tie coins included) while a large parameter goes unused,
    comes back on one rank only (every rank had left it out: the bucket is re-sent in full)
    and is used again; and while it is left out, the bytes are those of the used parameters."""
    results = run_against_reference(world, SKIP_CONFIGS)
    for cfg, res in zip(SKIP_CONFIGS, results):
        per_step, calls = res["per_step"], res["calls"]
        assert sum(per_step) == pytest.approx(res["stats"]["bytes_sent"], abs=sum(calls))
        if cfg.get("comm", "1bit") != "1bit":
            continue
        # 1-bit path: 1 bit up, at most 1.6 (a vote) or ceil(log2(2N + 1)) (a sum) back per coordinate
        # sent, (N-1)/N of them leave, + headers
        back = 1.6 if cfg["vote"] == "mavo" else math.ceil(math.log2(2 * world + 1))

        def bound(coords):
            return (1 + back) * (world - 1) / world * coords / 8 + 2 * 64 * world
        # steps 2, 3, 5 and 6: nobody had the 3000- and 7-value parameters in the step before: only the 50 travel
        for t in (2, 3, 6):
            assert per_step[t] < bound(50), (t, per_step)
        # steps 1 and 5: only the 7 values are left out (the 3000 had a gradient in the step before)
        for t in (1, 5):
            assert (world - 1) / world * 3050 / 8 < per_step[t] < bound(3050), (t, per_step)
        # steps 4 and 7: a rank has a gradient for a parameter every rank left out: one exchange of the
        # 50, then one of everything; step 0 cannot know yet: everything (and, at even N, once, the
        # codes again in base 3 when the ties' zero runs do not fit: the sticky format switch)
        for t in (4, 7):
            assert (world - 1) / world * 3057 / 8 < per_step[t] < bound(3057 + 50), (t, per_step)
        assert per_step[0] > (world - 1) / world * 3057 / 8, per_step
        assert calls[4] >= 2 * calls[3] and calls[7] >= 2 * calls[6], calls


PARTIAL_CONFIGS = [dict(vote="mavo", schedule="partial"), dict(vote="mavo", ties="random", schedule="partial"),
                   dict(vote="avg", schedule="partial")]


@pytest.mark.parametrize("world", [3, 4, 5])
def test_abstentions_on_whole_parameters_keep_the_1bit_path(world):
    """Parameters that only some ranks have gradients for: bitwise the paper's update, and each
    coordinate's codes come back in the bits its number of voters v needs (every rank knows v
    from the has-gradient bitmaps): MaVo 1 bit where v is odd, base 3 where a tie can give 0,
    Avg ceil(log2(N+1)); not base 3 for the whole bucket."""
    results = run_against_reference(world, PARTIAL_CONFIGS)
    sizes, schedule = SCHEDULES["partial"]
    for cfg, res in zip(PARTIAL_CONFIGS, results):
        bits = 0.0  # the bound, coordinate by coordinate: 1 bit up, b(v) back, (N-1)/N of it leaves
        for k, n in enumerate(sizes):
            v = len(schedule(k, 0, world))
            if cfg["vote"] == "avg":
                back = math.ceil(math.log2(world + 1))
            elif cfg.get("ties") in ("random", "previous") or v % 2 == 1:
                back = 1.0
            else:
                back = 1.6  # a base-3 digit, 5 to a byte
            bits += n * (1 + back)
        bound = bits * (world - 1) / world / 8
        header = 2 * 64 * world
        for t in range(1, SKIP_STEPS):
            assert res["per_step"][t] <= 1.05 * bound + header, (cfg, t, res["per_step"], bound)


# One parameter per bucket and overlap=True: the exchange thread walks the buckets' later collectives
# (re-sends of left-out parameters, Avg's extra gather) in slot order (dlion.pipeline).
PIPELINE_CONFIGS = [dict(vote="mavo", overlap=True, bucket_cap_mb=40 * 4 / 2**20),
                    dict(vote="mavo", ties="random", overlap=True, bucket_cap_mb=40 * 4 / 2**20),
                    dict(vote="avg", schedule="dead", overlap=True, bucket_cap_mb=40 * 4 / 2**20),
                    dict(vote="mavo", schedule="partial", overlap=True, bucket_cap_mb=40 * 4 / 2**20),
                    # fused local math from the gradient hooks, abstentions, and a resume from the state_dict
                    dict(vote="mavo", ties="random", schedule="partial", overlap=True, fused=True, resume_at=3,
                         bucket_cap_mb=40 * 4 / 2**20),
                    # ties="previous": the last vote lives in the state_dict, and the voters read it mid-backward
                    dict(vote="mavo", ties="previous", schedule="partial", overlap=True, resume_at=3,
                         bucket_cap_mb=40 * 4 / 2**20),
                    dict(vote="mavo", ties="previous", resume_at=5, bucket_cap_mb=40 * 4 / 2**20),
                    # a small first bucket, the rest in larger ones (the list form of bucket_cap_mb)
                    dict(vote="mavo", ties="random", schedule="partial", overlap=True, fused=True,
                         bucket_cap_mb=[10 * 4 / 2**20, 3000 * 4 / 2**20])]


@pytest.mark.parametrize("world", [3, 4])
def test_buckets_with_chains_of_different_lengths_stay_exact_with_the_exchange_thread(world):
    """Three buckets whose collective chains differ in length from step to step (a re-send in
    full, an extra gather, none): bitwise the paper's update on every rank, with overlap=True."""
    results = run_against_reference(world, PIPELINE_CONFIGS)
    for cfg, res in zip(PIPELINE_CONFIGS, results):
        assert len(res["layout"]) == 3 and len({b for b, _, _ in res["layout"]}) == 3, res["layout"]
    # skip schedule: steps 4 and 7 re-send the left-out bucket in full (two more collectives)
    assert results[0]["calls"][4] > results[0]["calls"][3], results[0]["calls"]


DEAD_CONFIGS = [dict(vote="mavo", schedule="dead"), dict(vote="mavo", ties="random", schedule="dead"),
                dict(vote="avg", schedule="dead")]


@pytest.mark.parametrize("world", [3, 4])
def test_a_few_zeros_of_c_ride_as_exceptions_or_fall_back(world):
    """Ranks 0-2 each have two coordinates with c = 0 inside a parameter they have a gradient
    for, so fewer than v ranks vote there: bitwise the paper's update all the same. For Avg every
    such coordinate breaks the parity of (s + v)/2: six exceptions in one chunk do not fit the
    room for four, and the codes are gathered once more in a plain format (one more collective
    per step); MaVo's zeros at odd v fit, and no collective is added."""
    results = run_against_reference(world, DEAD_CONFIGS)
    calls = {cfg["vote"] + cfg.get("ties", ""): res["calls"] for cfg, res in zip(DEAD_CONFIGS, results)}
    assert calls["mavo"][1:] == calls["mavorandom"][1:] == [2] * (SKIP_STEPS - 1), calls
    assert calls["avg"][1:] == [3] * (SKIP_STEPS - 1), calls


def test_the_optimizer_keeps_no_reference_to_the_gradients_after_a_step():
    """Gradients read in place by the vote must be released with the step: after zero_grad()
    nothing of the optimizer holds them (a weak reference dies)."""
    results = spawn(_released_worker, 2)
    for alive in results:
        assert alive == [False, False]


def _released_worker(rank, world):
    import gc
    import weakref

    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = dlion.DistributedLion([p], lr=0.01)
    out = []
    for step in range(2):
        p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(rank * 10 + step))
        ref = weakref.ref(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        out.append(ref() is not None)
    return out
