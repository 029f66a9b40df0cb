"""Faults on real Gloo groups: Byzantine sign hooks, replica desync, non-finite gradients,
workers that die or hang, and a torchrun job that is killed and resumes from its checkpoint."""

import importlib.util
import multiprocessing
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dlion
from dlion import checkpoint
from dlion.lab import faults
from dlion import DesyncError
from dlion.lab.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "resilient_train.py"


# ---------------------------------------------------------------------------
# the hooks themselves
# ---------------------------------------------------------------------------


def test_hooks_transform_signs():
    d = torch.tensor([1, -1, 0, 1, 0, -1], dtype=torch.int8)
    assert torch.equal(faults.sign_flip()(0, d), -d)
    assert torch.equal(faults.sign_flip(start=5)(4, d), d) and torch.equal(faults.sign_flip(start=5)(5, d), -d)
    assert torch.equal(faults.stuck_at_zero()(3, d), torch.zeros_like(d))
    assert torch.equal(faults.honest()(3, d), d)
    r = faults.random_signs(seed=1)(0, torch.zeros(10_000, dtype=torch.int8))
    assert r.dtype == torch.int8 and set(r.unique().tolist()) == {-1, 1} and abs(r.float().mean()) < 0.05
    # a function of (seed, step, call within the step): reproducible, different across steps and buckets
    h1, h2 = faults.random_signs(seed=1), faults.random_signs(seed=1)
    a, b = h1(0, d), h1(0, d)
    assert torch.equal(a, h2(0, d)) and torch.equal(b, h2(0, d))
    assert not torch.equal(h1(1, torch.zeros(64, dtype=torch.int8)), faults.random_signs(2)(1, torch.zeros(64, dtype=torch.int8)))
    for out in (faults.sign_flip()(0, d), faults.stuck_at_zero()(0, d), faults.random_signs()(0, d)):
        assert out.dtype == torch.int8 and out.shape == d.shape and out.abs().max() <= 1
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        faults.sign_flip(start=-1)
    with pytest.raises(ValueError, match="Unknown fault 'meltdown'"):
        faults.make("meltdown")
    assert torch.equal(faults.make("sign_flip")(0, d), -d)


# ---------------------------------------------------------------------------
# hooks, desync and non-finite gradients on Gloo (one spawn, several scenarios)
# ---------------------------------------------------------------------------

SHAPES = [(5, 4), (7,), (3,)]


def params_for():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def grads(rank, t):
    g = torch.Generator().manual_seed(100 * rank + t)
    return [torch.randn(s, generator=g) for s in SHAPES]


def scenarios(rank, world):
    out = {}
    # (1) every rank flips: Δ is exactly the honest Δ negated; the hook sees int8 signs and the step number
    moves = {}
    for name in ("honest", "flip"):
        ps = params_for()
        x0 = [p.detach().clone() for p in ps]
        seen = []

        def hook(step, d, name=name, seen=seen):
            seen.append((step, d.dtype, sorted(d.unique().tolist())))
            return -d if name == "flip" else d

        opt = dlion.DistributedLion(ps, lr=0.1, vote="mavo", sign_hook=hook, bucket_cap_mb=1e-4)
        for p, g in zip(ps, grads(rank, 0)):
            p.grad = g
        opt.step()
        moves[name] = [torch.sign(p.detach() - x) for p, x in zip(ps, x0)]
        out[f"seen_{name}"] = seen
    out["flip_mirrors"] = all(torch.equal(a, -b) for a, b in zip(moves["honest"], moves["flip"]))

    # (2) all ranks but 0 stuck at zero: they abstain, the vote is rank 0's own Lion step
    ps = params_for()
    opt = dlion.DistributedLion(ps, lr=0.05, weight_decay=0.1, vote="mavo",
                                sign_hook=faults.stuck_at_zero() if rank else None)
    ref = params_for()
    lion = dlion.Lion(ref, lr=0.05, weight_decay=0.1)
    for t in range(4):
        for p, q, g, g0 in zip(ps, ref, grads(rank, t), grads(0, t)):
            p.grad, q.grad = g, g0
        opt.step()
        lion.step()
    out["abstainers_ignored"] = all(torch.equal(p, q) for p, q in zip(ps, ref))

    # (3) desync: rank 1 nudges a parameter after step 2; the check after step 4 names it
    ps = params_for()
    opt = dlion.DistributedLion(ps, lr=0.01, check_every=2)
    try:
        for t in range(6):
            for p, g in zip(ps, grads(rank, t)):
                p.grad = g
            opt.step()
            if t == 1 and rank == 1:
                with torch.no_grad():
                    ps[1][3] += 1e-6
        out["desync"] = None
    except DesyncError as e:
        out["desync"] = (t, str(e))

    # (4) non-finite gradients on one rank: every rank skips that step ("skip") or raises ("raise")
    for policy in ("skip", "raise"):
        ps = params_for()
        opt = dlion.DistributedLion(ps, lr=0.01, nonfinite=policy)
        history, error = [], None
        try:
            for t in range(4):
                gs = grads(rank, t)
                if t == 2 and rank == world - 1:
                    gs[0][1, 1] = float("nan") if policy == "skip" else float("inf")
                for p, g in zip(ps, gs):
                    p.grad = g
                opt.step()
                history.append([p.detach().clone() for p in ps])
        except FloatingPointError as e:
            error = str(e)
        out[policy] = dict(skipped=opt.skipped_steps, history=history, error=error,
                           momenta=[opt.state[p]["exp_avg"].clone() for p in ps])
    return out


def test_hooks_desync_and_nonfinite_on_gloo():
    world = 3
    res = spawn(scenarios, world)
    for r, out in enumerate(res):
        assert out["flip_mirrors"]
        assert [s[0] for s in out["seen_flip"]] == [0] * len(out["seen_flip"]) and len(out["seen_flip"]) >= 2
        assert all(dt == torch.int8 and set(v) <= {-1, 0, 1} for _, dt, v in out["seen_flip"])
        assert out["abstainers_ignored"]
        t, msg = out["desync"]
        assert t == 3 and "parameter 1 (shape (7,)) differs between rank 0 and rank 1 after step 4" in msg
        skip = out["skip"]
        assert skip["skipped"] == 1 and skip["error"] is None and len(skip["history"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(skip["history"][1], skip["history"][2]))  # step 3 skipped
        assert not all(torch.equal(a, b) for a, b in zip(skip["history"][2], skip["history"][3]))
        assert all(torch.isfinite(m).all() for m in skip["momenta"])
        rz = out["raise"]
        assert "inf/NaN gradients at step 2" in rz["error"] and len(rz["history"]) == 2
    for r in range(1, world):  # replicas identical after a skipped step
        assert all(torch.equal(a, b) for a, b in zip(res[0]["skip"]["history"][3], res[r]["skip"]["history"][3]))


# ---------------------------------------------------------------------------
# Byzantine workers: majority vote still trains with 2 of 5 flipping every sign
# ---------------------------------------------------------------------------


def byzantine(rank, world, data, faulty, vote, steps):
    xtr, ytr, xte, yte = (t.flatten(1) if t.dim() > 1 else t for t in data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = dlion.DistributedLion(model.parameters(), lr=1e-2, vote=vote,
                                sign_hook=faults.sign_flip() if rank < faulty else None, check_every=25)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    with torch.no_grad():
        return (model(xte).argmax(1) == yte).float().mean().item()


def test_majority_vote_tolerates_two_of_five_sign_flippers():
    from dlion.lab.data import load_digits_split

    accs = spawn(byzantine, 5, load_digits_split(), 2, "mavo", 100)
    assert len(set(accs)) == 1  # identical replicas, faulty ranks included
    assert accs[0] > 0.85, accs


# ---------------------------------------------------------------------------
# a worker that dies or hangs: the others stop with an error, they do not hang
# ---------------------------------------------------------------------------


def failing_worker(rank, world, store, timeout_s, mode, fail_at, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    ps = params_for()
    opt = dlion.DistributedLion(ps, lr=0.01)
    started = time.monotonic()
    try:
        for t in range(10_000):
            if rank == 1 and t == fail_at:
                if mode == "exit":
                    os._exit(1)  # no clean-up, sockets close with the process
                time.sleep(3600)  # hung, its sockets stay open
            started = time.monotonic()
            for p, g in zip(ps, grads(rank, t)):
                p.grad = g
            opt.step()
        queue.put((rank, "finished", 0.0))
    except Exception as e:
        queue.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - started))
    os._exit(0)


@pytest.mark.parametrize("mode,timeout_s", [("exit", 10.0), ("hang", 2.0)])
def test_surviving_ranks_stop_with_an_error(tmp_path, mode, timeout_s):
    """Rank 1 of 3 dies (os._exit) or hangs at step 5. Ranks 0 and 2 must raise and end: a dead
    peer is noticed through its closed connection (well under the timeout), a hung one after
    the process-group timeout."""
    world, limit = 3, 30.0
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=failing_worker,
                         args=(r, world, str(tmp_path / "store"), timeout_s, mode, 5, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + limit
        for r in (0, 2):
            procs[r].join(timeout=max(0.1, deadline - time.monotonic()))
        hung = [r for r in (0, 2) if procs[r].is_alive()]
        assert not hung, f"ranks {hung} still running {limit:.0f} s after rank 1 failed ({mode})"
        reports = {}
        while not queue.empty():
            r, msg, elapsed = queue.get()
            reports[r] = (msg, elapsed)
        assert set(reports) == {0, 2}
        for r, (msg, elapsed) in reports.items():
            assert msg != "finished"
            assert elapsed < timeout_s + 8.0, (r, msg, elapsed)
            if mode == "hang":
                assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg
                assert elapsed >= timeout_s * 0.5, (r, msg, elapsed)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


# ---------------------------------------------------------------------------
# torchrun: a killed worker, a restart, a resume from the checkpoint — bitwise
# ---------------------------------------------------------------------------


def torchrun(tmp, *extra, restarts=1):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), str(EXAMPLE), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=150)


def reference_run(rank, world, argv):
    """The example's training loop in processes that never fail (dlion.lab.spawn instead of torchrun)."""
    spec = importlib.util.spec_from_file_location("resilient_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.train(mod.parse_args(argv))


def test_torchrun_restart_resumes_bitwise(tmp_path):
    """torchrun with --max-restarts 1; rank 1 exits abruptly at step 15; torchrun restarts both
    workers; they resume from the step-10 checkpoint; at step 30 the parameters and every rank's
    optimizer state equal those of a run that never failed, bit for bit."""
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    crashed.mkdir(); clean.mkdir()
    common = ["--steps", "30", "--checkpoint-every", "10"]
    a = torchrun(crashed, "--dir", str(crashed), "--crash-at-step", "15", *common)
    log = a.stdout + a.stderr
    # on failure show the log without the survivors' long tracebacks
    short = "\n".join(line for line in log.splitlines() if not line.startswith("[rank0]:   "))
    assert a.returncode == 0, short[-6000:]
    assert (crashed / "crashed.marker").exists()
    assert "crashing on purpose at step 15" in log and "resumed from step 10 (restart 1)" in log, short[-6000:]
    spawn(reference_run, 2, ["--dir", str(clean), *common])
    pa = checkpoint.read(crashed / "final.pt")
    pb = checkpoint.read(clean / "final.pt")
    assert pa["step"] == pb["step"] == 30 and pa["world_size"] == 2
    assert pa["model"].keys() == pb["model"].keys()
    for k in pa["model"]:
        assert torch.equal(pa["model"][k], pb["model"][k]), k
    for sa, sb in zip(pa["optimizer"], pb["optimizer"]):  # every rank's momenta and counters
        wall = ("wait_s",)  # a wall-clock time, never bitwise reproducible
        assert {**sa["dlion"], "comm_stats": {k: v for k, v in sa["dlion"]["comm_stats"].items() if k not in wall}} \
            == {**sb["dlion"], "comm_stats": {k: v for k, v in sb["dlion"]["comm_stats"].items() if k not in wall}}
        for i in sa["state"]:
            assert torch.equal(sa["state"][i]["exp_avg"], sb["state"][i]["exp_avg"])
            assert torch.equal(sa["state"][i]["step"], sb["state"][i]["step"])
