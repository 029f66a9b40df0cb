"""The CUDA path against the CPU: bitwise the same parameters for the same gradients.

Every test here is skipped without CUDA (CI has none); ``scripts/gpu_check.sh`` runs them on a
GPU machine. Gradients are always generated on the CPU and copied to the GPU, so both runs see
the same bits.

* ``dlion.Lion`` on CUDA (fp32 and bf16 parameters) against the same steps on the CPU;
* ``SimulatedDistributedLion`` on CUDA against the CPU run, for every comm × vote × ties and
  for quantised aggregation, at N = 3 and 4, with abstentions (``None`` gradients, a gradient
  that is exactly 0, zero runs inside a parameter, a parameter no worker has a gradient for in
  one step);
* two real Gloo ranks on one GPU (``DistributedLion`` with CUDA parameters and gradients)
  against a CPU simulation. If Gloo cannot run one of the collectives on CUDA tensors in this
  torch, that test fails with Gloo's own error, which is what we want to know;
* a *measurement*, not a check: how many host synchronisations one step makes
  (``torch.cuda.set_sync_debug_mode("warn")``), printed and written to
  ``$GPU_CHECK_OUT/cuda_sync_counts.json`` when that variable is set.

Two probes are marked ``xfail(strict=False)``: they compare things that need not be bitwise equal
between CPU and CUDA (a reduction order; a division by a CPU scalar, which CUDA computes as a
multiplication by the reciprocal). XPASS/XFAIL in the summary says which way they went.
"""

from __future__ import annotations

import collections
import json
import os
import warnings

import pytest
import torch

import dlion
from dlion.lab.spawn import spawn
from dlion.simulate import SimulatedDistributedLion

CUDA = torch.cuda.is_available()
DEV = "cuda"  # (the device under test; a CPU dry run of this file's logic may set it to "cpu")
pytestmark = pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is False)")

LR, WD = 0.01, 0.1
# power-of-two sizes: per-parameter means (quantised aggregation's l1 scale) are exact on both devices
SHAPES_POW2 = [(32, 32), (128,), (8, 16), (64,), (4,)]
SHAPES_ODD = SHAPES_POW2 + [(5, 3), (7,)]
CAP_MB = 600 * 4 / 2**20  # ~600 fp32 coordinates a bucket: several buckets


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from 0.0 and compares NaN payloads), on the CPU."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def first_difference(got, want) -> str:
    for k, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:
            continue
        if g is None or w is None or not same_bits(g, w):
            if g is None or w is None:
                return f"parameter {k}: one side is None"
            d = (g.detach().cpu().double() - w.detach().cpu().double()).abs()
            return (f"parameter {k} (shape {tuple(w.shape)}): {int((d > 0).sum())} coordinates differ, "
                    f"max |diff| {float(d.max()):.3g}")
    return ""


# -- the gradients ----------------------------------------------------------------------

def make_grads(world: int, steps: int, shapes, mode: str, seed: int = 0):
    """grads[t][i][k] on the CPU. ``mode`` "randn": normal values; "dyadic": multiples of 1/8 in
    [-1, 1] (with betas (0.5, 0.75) every c, m and sum of |c| stays exact in fp32 for a few steps).
    Abstentions: worker 1 never has a gradient for parameter 1; no worker has one for parameter 2
    at step 1 (left out of step 2's payload, which then has it again); worker 0's gradient of
    parameter 0 is exactly 0 (c = 0 there: an abstention inside the bucket); the last worker's
    gradient of parameter 3 is 0 on a slice (zero runs)."""
    g = torch.Generator().manual_seed(1234 + seed)
    out = []
    for t in range(steps):
        step = []
        for i in range(world):
            grads = []
            for k, s in enumerate(shapes):
                if mode == "dyadic":
                    x = torch.randint(-8, 9, s, generator=g).to(torch.float32) / 8
                else:
                    x = torch.randn(s, generator=g)
                grads.append(x)
            if world > 1:
                grads[1] = None if i == 1 else grads[1]
            if t == 1:
                grads[2] = None
            if i == 0:
                grads[0] = torch.zeros(shapes[0])
            if i == world - 1 and grads[3] is not None:
                grads[3].view(-1)[5:20] = 0.0
            step.append(grads)
        out.append(step)
    return out


def init_params(shapes, dtype=torch.float32, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


# -- dlion.Lion -------------------------------------------------------------------------

@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lion_cuda_equals_cpu_bitwise(dtype, foreach):
    shapes = SHAPES_ODD
    runs = {}
    for dev in ("cpu", DEV):
        params = [p.to(dev).requires_grad_() for p in init_params(shapes, dtype)]
        opt = dlion.Lion(params, lr=LR, betas=(0.9, 0.99), weight_decay=WD, foreach=foreach)
        g = torch.Generator().manual_seed(99)
        for t in range(5):
            for k, p in enumerate(params):
                grad = torch.randn(p.shape, generator=g).to(dtype)
                p.grad = None if (t == 2 and k == 1) else grad.to(dev)
            opt.step()
        runs[dev] = ([p.detach().cpu() for p in params], [opt.state[p]["exp_avg"].cpu() for p in params])
    (p_cpu, m_cpu), (p_gpu, m_gpu) = runs["cpu"], runs[DEV]
    assert not first_difference(p_gpu, p_cpu), "parameters: " + first_difference(p_gpu, p_cpu)
    assert not first_difference(m_gpu, m_cpu), "momenta: " + first_difference(m_gpu, m_cpu)


# -- SimulatedDistributedLion -----------------------------------------------------------

SIGN_CASES = [dict(comm=c, vote=v, ties=t) for c in ("1bit", "allgather", "pbit", "auto")
              for v, t in (("mavo", "zero"), ("mavo", "random"), ("avg", "zero"))]
QUANT_CASES = [dict(comm="1bit", vote="mavo", ties="zero", aggregate="quantized", quant_bits=b, mode="dyadic")
               for b in (4, 8)]
_RANDN_QUANT_REASON = ("probe: quantised aggregation's l1 scale is mean|c| per parameter; CPU and CUDA sum in "
                       "different orders (and CUDA multiplies by 1/n), so with normal gradients the scale may "
                       "differ in its last bit")
PROBES = [pytest.param(dict(comm="1bit", vote="mavo", ties="zero", aggregate="quantized", quant_bits=8,
                            mode="randn"), 4, id="probe-quantized-randn-N4",
                       marks=pytest.mark.xfail(strict=False, reason=_RANDN_QUANT_REASON)),
          pytest.param(dict(comm="allgather", vote="avg", ties="zero"), 6, id="probe-avg-N6",
                       marks=pytest.mark.xfail(strict=False, reason=(
                           "probe: avg divides the summed codes by N (buckets.scale_codes); CUDA divides a "
                           "tensor by a CPU scalar as a multiplication by 1/N, which differs from s/N for "
                           "some s at N = 6, 7, 10, …")))]


def case_id(cfg):
    extra = f"-q{cfg['quant_bits']}" if cfg.get("aggregate") == "quantized" else f"-{cfg['ties']}"
    return f"{cfg['comm']}-{cfg['vote']}{extra}"


def run_sim(device, world, cfg, steps):
    mode = cfg.get("mode", "randn")
    shapes = SHAPES_POW2 if cfg.get("aggregate") == "quantized" else SHAPES_ODD
    betas = (0.5, 0.75) if mode == "dyadic" else (0.9, 0.99)
    params = [p.to(device) for p in init_params(shapes)]
    sim = SimulatedDistributedLion(params, world, lr=LR, betas=betas, weight_decay=WD, vote=cfg["vote"],
                                   ties=cfg["ties"], comm=cfg["comm"], aggregate=cfg.get("aggregate", "sign"),
                                   quant_bits=cfg.get("quant_bits", 8), bucket_cap_mb=CAP_MB, seed=3)
    for step in make_grads(world, steps, shapes, mode):
        sim.step([[None if x is None else x.to(device) for x in grads] for grads in step])
    return params, sim


def check_sim_equal(world, cfg, steps=4):
    p_cpu, s_cpu = run_sim("cpu", world, cfg, steps)
    p_gpu, s_gpu = run_sim(DEV, world, cfg, steps)
    assert all(p.device.type == DEV for p in p_gpu)
    diff = first_difference(p_gpu, p_cpu)
    assert not diff, f"{cfg} N={world}: parameters differ between CUDA and CPU: {diff}"
    for i, (mg, mc) in enumerate(zip(s_gpu.momenta, s_cpu.momenta)):
        diff = first_difference(mg, mc)
        assert not diff, f"{cfg} N={world}: worker {i}'s momenta differ: {diff}"
    a, b = s_gpu.comm_stats.state_dict(), s_cpu.comm_stats.state_dict()
    for key in ("bytes_sent", "bytes_received", "collectives", "by_kind", "voted", "unanimous", "tied"):
        assert a[key] == b[key], f"{cfg} N={world}: comm_stats[{key!r}]: CUDA {a[key]}, CPU {b[key]}"


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("cfg", SIGN_CASES + QUANT_CASES, ids=case_id)
def test_simulated_cuda_equals_cpu_bitwise(cfg, world):
    check_sim_equal(world, cfg)


@pytest.mark.parametrize("cfg,world", PROBES)
def test_simulated_cuda_equals_cpu_probe(cfg, world):
    check_sim_equal(world, cfg)


# -- the dense 1-bit vote on device payloads (OneBit._vote_packed_torch) ------------------------

def dense_grads(world: int, steps: int, shapes, seed: int = 0):
    """Every worker has every gradient, no zero, except parameter 2: no worker has it from step 1
    on (left out of the payload from step 2: the vote runs on gathered coordinates)."""
    g = torch.Generator().manual_seed(4321 + seed)
    return [[[None if (k == 2 and t >= 1) else torch.randn(s, generator=g) for k, s in enumerate(shapes)]
             for _ in range(world)] for t in range(steps)]


@pytest.mark.parametrize("ties", ["zero", "random", "previous"])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_dense_1bit_vote_on_cuda_equals_cpu_bitwise(world, ties):
    """Dense SimulatedDistributedLion steps (comm="1bit"): the vote on CUDA payloads runs in torch
    ops on the device (bit-sliced, tie coins there; ties="zero" at even N: base-3 codes), the CPU's
    natively; the same parameters, momenta and tallies."""
    from dlion.wire import OneBit

    devices = []
    original = OneBit._vote_packed_torch

    def spy(self, rows, *a, **kw):
        devices.append(rows.device.type)
        return original(self, rows, *a, **kw)

    runs = {}
    OneBit._vote_packed_torch = spy
    try:
        for dev in ("cpu", DEV):
            params = [p.to(dev) for p in init_params(SHAPES_ODD)]
            sim = SimulatedDistributedLion(params, world, lr=LR, weight_decay=WD, ties=ties, comm="1bit",
                                           bucket_cap_mb=CAP_MB, seed=3)
            for step in dense_grads(world, 4, SHAPES_ODD):
                sim.step([[None if x is None else x.to(dev) for x in grads] for grads in step])
            runs[dev] = params, sim
    finally:
        OneBit._vote_packed_torch = original
    (p_cpu, s_cpu), (p_gpu, s_gpu) = runs["cpu"], runs[DEV]
    if DEV != "cpu":
        assert devices and set(devices) == {DEV}, devices  # the CPU run voted natively, every CUDA bucket here
    diff = first_difference(p_gpu, p_cpu)
    assert not diff, f"ties={ties} N={world}: parameters differ between CUDA and CPU: {diff}"
    a, b = s_gpu.comm_stats.state_dict(), s_cpu.comm_stats.state_dict()
    for key in ("bytes_sent", "bytes_received", "collectives", "by_kind", "voted", "unanimous", "tied"):
        assert a[key] == b[key], f"ties={ties} N={world}: comm_stats[{key!r}]: CUDA {a[key]}, CPU {b[key]}"


def test_torch_vote_on_cuda_payloads_equals_cpu_vote():
    """OneBit's packed vote on CUDA rows (strided, as in the received buffer) against the same rows on
    the CPU (native vote; ties="zero" at even N: decide + vote_tally), over random inputs, N = 2 … 9,
    every ties policy, gathered coordinates, padding, and a few large chunks; the tally stays on the
    device."""
    import numpy as np

    from dlion.vote import VoteRule, coin_bits, coin_bits_torch
    from dlion.wire import Contribution, OneBit, vote_tally

    g = np.random.default_rng(11)
    for case in range(240):
        world = int(g.integers(2, 10))
        blocks = int(g.integers(1, 40)) if case >= 6 else 123_457 + case  # (the last: ~1 M coordinates)
        ties = ("zero", "random", "previous")[case % 3]
        gathered, rank = bool(case % 2), int(g.integers(0, world))
        width, n = 8 * blocks, 8 * blocks * world
        real = int(g.integers(0, width + 1)) if case % 5 else width
        signs = g.integers(0, 2, (world, width), dtype=np.uint8)
        signs[:, real:] = 0
        wide = np.zeros((world, blocks + 4), dtype=np.uint8)
        wide[:, 4:] = np.packbits(signs, axis=1, bitorder="little")
        previous = torch.from_numpy(g.integers(-1, 2, 3 * n, dtype=np.int8))
        positions = torch.from_numpy(g.permutation(3 * n)[:n].astype(np.int64)) if gathered else None
        lo, key = rank * width, int(g.integers(0, 2**32))
        alg = OneBit(VoteRule("mavo", world, ties=ties))
        cpu_rows = torch.from_numpy(wide)[:, 4:]
        dev_rows = torch.from_numpy(wide).to(DEV)[:, 4:]

        def contrib(dev):
            return Contribution(torch.zeros(n, dtype=torch.int8, device=dev), lo + real,
                                torch.ones(1, dtype=torch.bool), previous=previous.to(dev),
                                positions=None if positions is None else positions.to(dev))
        if ties == "zero" and world % 2 == 0:
            codes, tally = alg._vote_packed_torch(dev_rows, width, real, key, lo, contrib(DEV), codes=True)
            s = torch.from_numpy(signs.sum(axis=0).astype(np.int16) * 2 - world)
            want, want_tally = alg.rule.decide(s, None, key=key, start=lo), vote_tally(s, None, world, real)
            assert same_bits(codes, want), (case, world, ties)
        else:
            want, want_tally = alg._vote_packed(cpu_rows, width, real, key, lo, contrib("cpu"))
            got, tally = alg._vote_packed(dev_rows, width, real, key, lo, contrib(DEV))
            assert got.device.type == DEV and same_bits(got, want), (case, world, ties, gathered)
        assert tally.device.type == DEV and tally.tolist() == want_tally.tolist(), (case, world, ties)
    for start, count in ((0, 8_000_000), (2**33 + 40, 1_000_008), (13, 1001)):
        key = int(g.integers(0, 2**32))
        assert np.array_equal(coin_bits_torch(key, start, count, DEV).cpu().numpy(), coin_bits(key, start, count))


# -- measurement: host synchronisations per step -------------------------------------------

_SYNC_RESULTS: dict = {}


def count_syncs(fn) -> dict:
    """Run ``fn()`` under sync debug mode "warn"; the number of synchronising calls and where
    (the Python line that made each), most frequent first."""
    torch.cuda.synchronize()
    where = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = 0
    for w in caught:
        # (not "Synchronization debug mode is a prototype feature", warned once per process)
        if "called a synchronizing" in str(w.message):
            n += 1
            path = w.filename.replace("\\", "/")
            short = path.split("/src/")[-1] if "/src/" in path else os.path.basename(path)
            where[f"{short}:{w.lineno}"] += 1
    return dict(syncs=n, where=dict(where.most_common()))


def _record(name: str, result: dict) -> None:
    _SYNC_RESULTS[name] = result
    print(f"SYNC-COUNT {name}: {result['syncs']} host synchronisations; by line: {result['where']}")
    out = os.environ.get("GPU_CHECK_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cuda_sync_counts.json"), "w") as f:
            json.dump(_SYNC_RESULTS, f, indent=2)


@pytest.mark.parametrize("comm", ["1bit", "allgather", "pbit"])
def test_sync_count_measurement_simulated_step(comm):
    """MEASUREMENT (never fails on the count): host syncs of one SimulatedDistributedLion step,
    N = 4, on CUDA, after one warm-up step, with and without abstentions."""
    world = 4
    shapes = SHAPES_ODD
    for label, mode in (("dense", None), ("abstaining", "abstain")):
        params = [p.cuda() for p in init_params(shapes)]
        sim = SimulatedDistributedLion(params, world, lr=LR, comm=comm, bucket_cap_mb=CAP_MB)
        steps = make_grads(world, 2, shapes, "randn")
        if mode is None:  # every worker has every gradient, no zero
            steps = [[[torch.randn(s) for s in shapes] for _ in range(world)] for _ in range(2)]
        cuda_steps = [[[None if x is None else x.cuda() for x in g] for g in st] for st in steps]
        sim.step(cuda_steps[0])
        before = [p.clone() for p in params]
        result = count_syncs(lambda: sim.step(cuda_steps[1]))
        result["buckets"] = len(sim.buckets)
        _record(f"SimulatedDistributedLion N=4 comm={comm} {label}", result)
        assert sim.step_count == 2
        assert any(not torch.equal(a, b) for a, b in zip(before, params))


def test_sync_count_measurement_lion_step():
    """MEASUREMENT (never fails on the count): host syncs of one dlion.Lion step on CUDA."""
    params = [p.cuda().requires_grad_() for p in init_params(SHAPES_ODD)]
    opt = dlion.Lion(params, lr=LR)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    _record("Lion (foreach)", count_syncs(opt.step))
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


# -- real Gloo ranks on one GPU (last: the slowest, and the likeliest to fail) -----------------

REAL_SHAPES = [(16, 16), (40,), (3, 7), (1,)]
REAL_STEPS = 3


def real_grads(rank: int, step: int):
    g = torch.Generator().manual_seed(500 + 10 * rank + step)
    grads = [torch.randn(s, generator=g) for s in REAL_SHAPES]
    if rank == 1:
        grads[2] = None  # rank 1 abstains on a whole parameter
    grads[0].view(-1)[:9] = 0.0  # zero runs on every rank (c = 0 at step 0, then the momentum moves it)
    return grads


def real_ranks_worker(rank, world, comm, device):
    """One Gloo rank with its parameters and gradients on cuda:0 (both ranks share the GPU)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    params = [p.to(device).requires_grad_() for p in init_params(REAL_SHAPES)]
    opt = dlion.DistributedLion(params, lr=LR, betas=(0.9, 0.99), weight_decay=WD, comm=comm, vote="mavo")
    for t in range(REAL_STEPS):
        for p, g in zip(params, real_grads(rank, t)):
            p.grad = None if g is None else g.to(device)
        opt.step()
    assert all(p.device.type == device for p in params)
    return dict(params=[p.detach().cpu() for p in params], algorithms=opt.algorithm_names,
                stats=opt.comm_stats.state_dict())


@pytest.mark.parametrize("comm", ["1bit", "allgather"])
def test_real_gloo_ranks_with_cuda_tensors_equal_simulation(comm):
    """REAL RANKS: 2 Gloo processes, CUDA parameters and gradients on cuda:0. A failure here may be
    Gloo refusing a collective (all_to_all_single / all_gather_into_tensor) on CUDA tensors:
    the worker's traceback below is the real error."""
    results = spawn(real_ranks_worker, 2, comm, DEV, timeout_s=60, start_method="spawn")  # (no fork after CUDA init)
    r0, r1 = results
    assert r0["algorithms"] == [comm] * len(r0["algorithms"])
    diff = first_difference(r1["params"], r0["params"])
    assert not diff, f"ranks 0 and 1 disagree: {diff}"
    params = init_params(REAL_SHAPES)
    sim = SimulatedDistributedLion(params, 2, lr=LR, betas=(0.9, 0.99), weight_decay=WD, comm=comm, vote="mavo")
    for t in range(REAL_STEPS):
        sim.step([real_grads(r, t) for r in range(2)])
    diff = first_difference(r0["params"], params)
    assert not diff, f"CUDA ranks differ from the CPU simulation: {diff}"
    assert sim.comm_stats.bytes_sent == r0["stats"]["bytes_sent"]


def local_ranks_worker(rank, world, device, streaming, reset=False, delay=None, fragments=1):
    """LocalDistributedLion on one Gloo rank, parameters and gradients on ``device``."""
    if device == "cuda":
        torch.cuda.set_device(0)
    params = [p.to(device).requires_grad_() for p in init_params(REAL_SHAPES)]
    opt = dlion.LocalDistributedLion(params, lr=LR, betas=(0.9, 0.99), weight_decay=WD, comm="1bit",
                                     sync_every=2, streaming=streaming, reset_momentum=reset, stream_delay=delay,
                                     fragments=fragments, bucket_cap_mb=0.001 if fragments > 1 else 25.0)
    for t in range(2 * REAL_STEPS):
        for p, g in zip(params, real_grads(rank, t % REAL_STEPS)):
            p.grad = None if g is None else g.to(device)
        opt.step()
    opt.flush()
    with opt.anchored():
        anchor = [p.detach().cpu().clone() for p in params]  # (.cpu() of a CPU tensor is no copy)
    return dict(params=[p.detach().cpu().clone() for p in params], anchor=anchor)


@pytest.mark.parametrize("streaming, reset, delay, fragments", [
    (False, False, None, 1), (True, False, None, 1), (False, True, None, 1), (True, True, None, 1), (True, True, 1, 1),
    (True, True, None, 2)])
def test_real_gloo_ranks_local_steps_on_cuda_equal_cpu_ranks(streaming, reset, delay, fragments):
    """REAL RANKS: LocalDistributedLion (H = 2, 6 steps; ``reset_momentum`` too; streamed with the round in
    flight applied one step into the next, ``stream_delay=1``, or in two fragments whose rounds end on
    alternate steps) on CUDA equals the same run on CPU ranks bitwise."""
    gpu = spawn(local_ranks_worker, 2, DEV, streaming, reset, delay, fragments, timeout_s=60, start_method="spawn")
    cpu = spawn(local_ranks_worker, 2, "cpu", streaming, reset, delay, fragments, timeout_s=60, start_method="spawn")
    for r in range(2):
        assert not first_difference(gpu[r]["anchor"], gpu[0]["anchor"]), "CUDA ranks disagree on the anchor"
        diff = first_difference(gpu[r]["params"], cpu[r]["params"])
        assert not diff, f"rank {r}: CUDA differs from CPU: {diff}"
