"""Host synchronisations per step, audited on the CPU: adding one to the step's path fails here.

On a GPU a step should not stop to read values on the host. CI has no GPU, so the steps run
under :class:`sync_audit.EmulatedDevice`: the parameters and gradients are tagged as CUDA tensors
(``device == cuda:0``), the library takes the branches CUDA tensors take (the torch-op vote, no
numpy, no native kernels), and every operation that would make the host wait for the device is
counted by source line. Each step's count per (file, function) must stay within the budget
below; a new ``.item()``, ``bool(tensor)``, ``.cpu()``, unpinned copy to the device, ``nonzero``
… anywhere on the path fails the test with the line that made it.

A dense 1-bit step makes two: one read of every bucket's finiteness flag and zero count (what the
host-built headers need) before the first collectives, and one read of every bucket's received
headers after them (:func:`dlion.buckets.read_flags`, :func:`dlion.wire.read_heads`); the vote
tallies stay on the device until ``comm_stats`` is read. That holds for the simulator (N = 4, two
buckets: every worker's and bucket's together) and per rank of ``DistributedLion(overlap=False)``.
With ``overlap=True`` backward's hooks make none (the header's status is completed on the device),
and the exchange thread reads each bucket's received headers as they come; the DDP communication
hook makes none either before it returns, and reads the headers in its completion callback.

Before these were batched, the GPU's ``torch.cuda.set_sync_debug_mode`` (tests/test_cuda.py,
docs/results/gpu-check*/cuda_sync_counts.json) agreed with this audit line for line: 18 for the
dense 1-bit step below (one read per bucket and worker in ``contribute`` and in ``_split``, one per
bucket for the tallies). The counts asserted here (2) are the emulation's; they have not been
measured on a GPU yet.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading

import pytest
import torch

import dlion
from dlion.simulate import SimulatedDistributedLion
from sync_audit import EmulatedDevice, to_device

SHAPES = [(32, 32), (128,), (8, 16), (64,), (4,), (5, 3), (7,)]  # tests/test_cuda.py's SHAPES_ODD
CAP_MB = 600 * 4 / 2**20  # ~600 fp32 coordinates a bucket: two buckets, as on the GPU
LR, N = 0.01, 4

# -- the budgets: the host syncs still on the path, per step -----------------------------------
# (file, function) -> (syncs per unit, the unit, why it is still there). A unit is evaluated by
# _allowed: "bucket·worker" = buckets × workers (the simulator runs every worker's contribution).
DENSE_1BIT = {
    "dlion/buckets.py read_flags": (1, "step",
        "one read of every bucket's (and simulated worker's) finiteness flag and zero count together: "
        "the 1-bit header's status (NONFINITE) and whether zero runs are listed are built on the host"),
    "dlion/wire.py read_heads": (1, "round",
        "every bucket's received headers come to the host in one copy per round of collectives: every "
        "rank decides the wire format, the failure flags and the has-gradient bitmap there"),
    # no add_tallies: the vote tallies stay on the device until comm_stats is read (CommStats.tallies)
}
LION: dict = {}  # dlion.Lion: none (0 on the GPU too)
LOCAL_INNER = {
    "dlion/local.py _inner_step": (1, "step",
        "the local step is skipped on inf/NaN gradients: one read of their finiteness"),
}
LOCAL_ROUND = {  # one sync round of LocalDistributedLion, N = 2, per rank
    "dlion/local.py _inner_step": (1, "step", LOCAL_INNER["dlion/local.py _inner_step"][2]),
    "dlion/buckets.py read_flags": (1, "round",
        "every bucket's residual finiteness and zero count, for the headers' status, in one read"),
    "dlion/wire.py read_heads": (1, "round", DENSE_1BIT["dlion/wire.py read_heads"][2]),
    # the progress A − x has zeros (coordinates whose local steps cancelled): the abstaining 1-bit path.
    # Its zero runs are found and listed on the device (wire.device_runs, wire._device_headers: 13 per
    # bucket before, when they were found and listed on the host: _has_zeros 2, zero_runs 6,
    # _zeros_within_parameters 1, _headers 1, _runs_fit 3)
    "dlion/wire.py _runs_fit": (1, "bucket",
        "codes gathered in base 3: whether their zero runs fit the header again decides the next step's "
        "format on every rank (one read of the most runs in a chunk, counted on the device)"),
}


def _allowed(budget: dict, units: dict) -> dict:
    return {site: per * units[unit] for site, (per, unit, _why) in budget.items()}


def check_budget(em: EmulatedDevice, budget: dict, units: dict) -> None:
    allowed = _allowed(budget, units)
    over = {site: (n, allowed.get(site, 0)) for site, n in em.by_function().items() if n > allowed.get(site, 0)}
    assert not em.errors, em.errors
    assert not over, ("host synchronisations over budget, site: (counted, allowed) "
                      f"{over}; every sync counted: {dict(em.syncs)}")


# -- the steps ---------------------------------------------------------------------------

def dense_1bit_step() -> tuple[EmulatedDevice, SimulatedDistributedLion, SimulatedDistributedLion]:
    """One dense 1-bit SimulatedDistributedLion step (N = 4, two buckets) after a warm-up step,
    on emulated CUDA tensors: the audit, the optimizer, and the same steps on the CPU."""
    g = torch.Generator().manual_seed(7)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads0 = [[[torch.randn(s, generator=g) for s in SHAPES] for _ in range(N)] for _ in range(2)]
    em = EmulatedDevice()
    with em:
        params, grads = to_device(params0), to_device(grads0)
        sim = SimulatedDistributedLion(params, N, lr=LR, comm="1bit", bucket_cap_mb=CAP_MB)
        sim.step(grads[0])
        em.counting = True
        sim.step(grads[1])
        em.counting = False
    # the same steps on the CPU give the same parameters (the emulation computes on the CPU)
    ref = SimulatedDistributedLion(params0, N, lr=LR, comm="1bit", bucket_cap_mb=CAP_MB)
    ref.step(grads0[0])
    ref.step(grads0[1])
    assert all(torch.equal(a, b) for a, b in zip(params, params0))
    return em, sim, ref


def test_dense_1bit_simulated_step_within_budget():
    em, sim, ref = dense_1bit_step()
    assert len(sim.buckets) == 2 and sim.step_count == 2
    # one round of collectives reads headers: the all-to-all of signs (the codes come back as 1 bit)
    check_budget(em, DENSE_1BIT, {"step": 1, "round": 1})
    assert em.count() == 2, em.by_site()  # (18 before the reads were batched, as measured on a GPU)


ABSTAINING_1BIT = {  # one simulated step with abstentions (tests/test_cuda.py's make_grads), N = 4, two buckets
    "dlion/buckets.py read_flags": (1, "step", DENSE_1BIT["dlion/buckets.py read_flags"][2]),
    "dlion/wire.py read_heads": (1, "round", DENSE_1BIT["dlion/wire.py read_heads"][2]),
    "dlion/wire.py _runs_fit": (1, "bucket·worker", LOCAL_ROUND["dlion/wire.py _runs_fit"][2]),
    # no _has_zeros, zero_runs, _headers, _zeros_within_parameters, count_votes, _few, run_indices: the
    # senders' zero runs are found and listed on the device (wire.device_runs), the received ones are on the
    # host already (the headers), and go to the device from pinned memory (113 syncs before; 132 on a GPU)
}


@pytest.mark.parametrize("comm, rounds, syncs", [("1bit", 2, 7), ("allgather", 1, 2)])
def test_abstaining_simulated_step_within_budget(comm, rounds, syncs):
    """SimulatedDistributedLion (N = 4, two buckets) through steps with every kind of abstention
    (:func:`test_cuda.make_grads`: a worker without a parameter's gradient, a parameter no worker has, c = 0
    on a whole parameter and on a slice): the zero runs in the headers, both ways, are found and listed on
    the device, so the step reads what a dense one reads (and, 1-bit, whether base-3 codes fit again);
    the parameters and the bytes sent are bitwise those of the same steps on the CPU."""
    from test_cuda import init_params, make_grads
    steps = make_grads(N, 3, SHAPES, "randn")
    params0 = init_params(SHAPES)
    em = EmulatedDevice()
    with em:
        params, grads = to_device([p.clone() for p in params0]), to_device(steps)
        sim = SimulatedDistributedLion(params, N, lr=LR, comm=comm, bucket_cap_mb=CAP_MB)
        sim.step(grads[0])
        em.counting = True
        sim.step(grads[1])
        em.counting = False
        sim.step(grads[2])
    ref = SimulatedDistributedLion(params0, N, lr=LR, comm=comm, bucket_cap_mb=CAP_MB)
    for step in steps:
        ref.step(step)
    assert len(sim.buckets) == 2
    check_budget(em, ABSTAINING_1BIT, {"step": 1, "round": rounds, "bucket·worker": 2 * N})
    assert em.count() == syncs, em.by_site()
    assert all(torch.equal(a, b) for a, b in zip(params, params0))
    assert sim.comm_stats.bytes_sent == ref.comm_stats.bytes_sent


# -- abstentions only on whole parameters: the codes come back by voters (wire._ByVoters) ----------------
BV_SHAPES = [(48, 64), (1024,), (16, 32), (512,), (4,), (5, 3), (7,)]
BV_CAP_MB = 2100 * 4 / 2**20  # two buckets: parameter 0 alone, parameters 1 … 6 together
BY_VOTERS = {  # one simulated step whose abstentions are whole parameters without gradient, N = 4, two buckets
    "dlion/buckets.py read_flags": (1, "step", DENSE_1BIT["dlion/buckets.py read_flags"][2]),
    "dlion/wire.py read_heads": (1, "round",
        "every bucket's received headers in one copy per round: the signs' (the wire format, the failure "
        "flags, the has-gradient bitmaps whose voter counts choose the codes' format) and the codes' (each "
        "chunk's exception count: whether every rank gathers the codes again in a plain format)"),
    # no _misfits, _parts, encode, decode: the per-coordinate formats go to the device once as index
    # tensors from pinned memory, the exceptions are found with nonzero_static in the list's fixed room and
    # their header is written on the device, the received ones go there in one copy from pinned memory
    # (before: 100 syncs in this step with MaVo, 112 with Avg, over 2 buckets × 4 workers; see the commit)
}


def by_voters_schedule(world: int = 4, steps: int = 3) -> tuple[list, list]:
    """(initial parameters, grads[t][rank]) for BV_SHAPES whose only abstentions are whole parameters and a
    few c = 0: parameter 0 (a bucket alone) has no gradient on rank 2 (3 voters everywhere: one format);
    parameter 1 a gradient on rank 0 only, parameter 5 none on rank 0, parameters 2, 3, 4, 6 none on rank 3
    (1 or 3 voters: counts mixed within the bucket). Exact zeros every step (the momentum stays 0 there,
    c = 0): rank 1 at two coordinates of parameter 3 (exceptions that fit their list) and ranks 0, 1, 3 at
    two each of parameter 0's first chunk (six: with ``vote="avg"`` more than the list's room, so the codes
    are gathered again)."""
    g = torch.Generator().manual_seed(21)
    params = [torch.randn(s, generator=g) for s in BV_SHAPES]
    out = []
    for _ in range(steps):
        step = []
        for rank in range(world):
            grads = [torch.randn(s, generator=g) for s in BV_SHAPES]
            if rank == 2:
                grads[0] = None
            else:
                grads[0].view(-1)[[3 * rank + 1, 3 * rank + 2]] = 0.0
            if rank != 0:
                grads[1] = None
            else:
                grads[5] = None
            if rank == 3:
                for k in (2, 3, 4, 6):
                    grads[k] = None
            if rank == 1:
                grads[3][[100, 101]] = 0.0
            step.append(grads)
        out.append(step)
    return params, out


def _spy_by_voters(monkeypatch) -> list:
    """Records what every _ByVoters.decode received: (one voter count or None, each chunk's exception count)."""
    from dlion import wire
    seen, decode = [], wire._ByVoters.decode

    def spy(self, gathered):
        heads = (gathered if isinstance(gathered, wire.Received) else
                 wire.read_heads([(gathered, (len(self.n1), self.head // 4))])[0]).headers
        seen.append((self.uniform, heads[:, 0].tolist()))
        return decode(self, gathered)

    monkeypatch.setattr(wire._ByVoters, "decode", spy)
    return seen


@pytest.mark.parametrize("options", [dict(vote="mavo"), dict(vote="avg")], ids=["mavo", "avg"])
def test_by_voters_simulated_step_within_budget(options, monkeypatch):
    """SimulatedDistributedLion (N = 4, two buckets) through steps where the only abstentions are whole
    parameters some ranks have no gradient for, and a few c = 0 (:func:`by_voters_schedule`): the codes come
    back by voters (:class:`dlion.wire._ByVoters`, one format for the bucket of parameter 0, mixed in the
    other), with exceptions listed and, ``avg``, a chunk with more than fit (gathered again). The step reads
    what a dense one reads, plus the codes' headers in the round that gathers them; the parameters, the
    tallies and the bytes sent are bitwise those of the same steps on the CPU."""
    seen = _spy_by_voters(monkeypatch)
    params0, steps = by_voters_schedule()
    kw = dict(lr=LR, comm="1bit", bucket_cap_mb=BV_CAP_MB, **options)
    em = EmulatedDevice()
    with em:
        params, grads = to_device([p.clone() for p in params0]), to_device(steps)
        sim = SimulatedDistributedLion(params, N, **kw)
        sim.step(grads[0])
        em.counting = True
        sim.step(grads[1])
        em.counting = False
        sim.step(grads[2])
    dev_seen = list(seen)
    ref = SimulatedDistributedLion(params0, N, **kw)
    for step in steps:
        ref.step(step)
    assert len(sim.buckets) == 2
    check_budget(em, BY_VOTERS, {"step": 1, "round": 2})
    assert em.count() == 3, em.by_site()
    assert all(torch.equal(a, b) for a, b in zip(params, params0))
    assert sim.comm_stats.state_dict() == ref.comm_stats.state_dict()
    # the device path met what the test is about, and saw the CPU's headers
    assert seen[len(dev_seen):] == dev_seen and len(dev_seen) == 3 * 2 * N
    assert {u for u, _ in dev_seen} == {3, None}
    assert any(c > 0 for _, counts in dev_seen for c in counts)            # exceptions listed
    if options["vote"] == "avg":
        assert any(c < 0 for _, counts in dev_seen for c in counts)        # and a chunk with more than fit


def test_vote_tallies_are_read_when_the_statistics_are():
    """The step reads no tally; reading ``comm_stats`` does, once, and gives the CPU run's figures."""
    em, sim, ref = dense_1bit_step()
    assert "dlion/collectives.py add_tallies" not in em.by_function()
    pending = list(sim.comm_stats._pending)
    assert pending == [torch.device("cuda", 0)]  # summed on the device, not read yet
    em.syncs.clear()
    with em:
        em.counting = True
        got = sim.comm_stats.state_dict()
        again = (sim.comm_stats.voted, sim.comm_stats.unanimous, sim.comm_stats.tied)
        em.counting = False
    assert em.by_function() == {"dlion/collectives.py tallies": 1}  # one read, for all three, once
    assert got == ref.comm_stats.state_dict() and got["voted"] > 0 and got["unanimous"] > 0
    assert again == (got["voted"], got["unanimous"], got["tied"])


def test_lion_step_has_no_host_sync():
    g = torch.Generator().manual_seed(7)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    grads0 = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(2)]
    for foreach in (None, False):
        em = EmulatedDevice()
        with em:
            params = [p.requires_grad_() for p in to_device(params0)]
            grads = to_device(grads0)
            opt = dlion.Lion(params, lr=LR, weight_decay=0.1, foreach=foreach)
            for step in range(2):
                for p, gr in zip(params, grads[step]):
                    p.grad = gr
                em.counting = step == 1
                opt.step()
            em.counting = False
            assert params[0].is_cuda and opt.state[params[0]]["exp_avg"].is_cuda
        check_budget(em, LION, {})
        assert em.count() == 0


def _threaded_ranks(world: int, fn) -> list:
    """``fn(rank)`` on ``world`` threads joined in one process group (torch's threaded test backend)."""
    mtpg = pytest.importorskip("torch.testing._internal.distributed.multi_threaded_pg")
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    results, errors = [None] * world, []

    def run(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results


def test_local_distributed_lion_round_within_budget():
    """One round of LocalDistributedLion (H = 2: a local step, then a local step and the sync) on two
    ranks, threads of this process; each thread audits its own rank (modes are per thread)."""
    H, world = 2, 2
    g = torch.Generator().manual_seed(7)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]

    def rank_fn(rank):
        gg = torch.Generator().manual_seed(100 + rank)
        grads0 = [[torch.randn(s, generator=gg) for s in SHAPES] for _ in range(2 * H)]
        em = EmulatedDevice()
        with em:
            params = [p.requires_grad_() for p in to_device([p.clone() for p in params0])]
            grads = to_device(grads0)
            opt = dlion.LocalDistributedLion(params, lr=LR, sync_every=H, comm="1bit", bucket_cap_mb=CAP_MB)
            counts = []
            for step in range(2 * H):  # the first round warms up; the second is audited
                for p, gr in zip(params, grads[step]):
                    p.grad = gr
                em.syncs.clear()
                em.counting = step >= H
                opt.step()
                em.counting = False
                counts.append(em.by_function())
                if step >= H:
                    unit = {"step": 1, "bucket": len(opt.buckets) if step == 2 * H - 1 else 0,
                            "round": int(step == 2 * H - 1)}
                    check_budget(em, LOCAL_ROUND, unit)
        return counts, len(opt.buckets)

    for counts, buckets in _threaded_ranks(world, rank_fn):
        assert buckets == 2
        assert counts[H] == {"dlion/local.py _inner_step": 1}  # a local step: one read
        assert sum(counts[2 * H - 1].values()) > 1             # the sync round was audited


def _audited_steps(rank: int, steps: int, emulate: bool, budget: dict, units: dict, make_opt, prepare=None):
    """One rank's ``steps`` dense steps of the optimizer ``make_opt(params, prepare())`` (two buckets,
    SHAPES, seeded gradients per rank), on emulated CUDA tensors (``emulate``) or on the CPU; the syncs of
    every step after the first are checked against ``budget``. Returns (counts, parameters, optimizer)."""
    prepared = prepare() if prepare is not None else None  # (outside the emulation: e.g. a device mesh)
    g = torch.Generator().manual_seed(7)
    params0 = [torch.randn(s, generator=g) for s in SHAPES]
    gg = torch.Generator().manual_seed(100 + rank)
    grads0 = [[torch.randn(s, generator=gg) for s in SHAPES] for _ in range(steps)]
    em = EmulatedDevice()
    counts = []
    with em if emulate else contextlib.nullcontext():
        move = to_device if emulate else (lambda x: x)
        params = [p.requires_grad_() for p in move([p.clone() for p in params0])]
        grads = move(grads0)
        opt = make_opt(params, prepared)
        assert len(opt.buckets) == 2 and params[0].is_cuda == emulate
        for step in range(steps):
            for p, gr in zip(params, grads[step]):
                p.grad = gr
            em.syncs.clear()
            em.counting = step >= 1  # (the first step also checks for identical gradients)
            opt.step()
            em.counting = False
            if step >= 1:
                check_budget(em, budget, units)
                counts.append(em.count())
    return counts, [p.detach().clone() for p in params], opt


DISTRIBUTED_STEP = {  # one dense 1-bit step of DistributedLion(overlap=False), per rank
    "dlion/buckets.py read_flags": (1, "step", DENSE_1BIT["dlion/buckets.py read_flags"][2]),
    "dlion/wire.py read_heads": (1, "step", DENSE_1BIT["dlion/wire.py read_heads"][2]),
}


def test_distributed_lion_dense_step_per_rank_within_budget():
    """DistributedLion(comm="1bit") on two ranks (threads of this process, two buckets): per rank and
    step, one read of every bucket's flags and one of every bucket's received headers (five before:
    two per bucket and one for the tallies); the parameters and the tallies are bitwise those of
    the same ranks on CPU tensors."""
    world, steps = 2, 3

    def run(rank, emulate: bool):
        counts, params, opt = _audited_steps(
            rank, steps, emulate, DISTRIBUTED_STEP, {"step": 1},
            lambda params, _: dlion.DistributedLion(params, lr=LR, comm="1bit", bucket_cap_mb=CAP_MB))
        return counts, params, opt.comm_stats.state_dict()

    dev = _threaded_ranks(world, lambda rank: run(rank, True))
    cpu = _threaded_ranks(world, lambda rank: run(rank, False))
    for (counts, params, stats), (_, want, want_stats) in zip(dev, cpu):
        assert counts == [2] * (steps - 1)
        assert all(torch.equal(a, b) for a, b in zip(params, want))
        assert {k: v for k, v in stats.items() if k != "wait_s"} == \
            {k: v for k, v in want_stats.items() if k != "wait_s"}
    assert all(torch.equal(a, b) for a, b in zip(dev[0][1], dev[1][1]))  # the replicas agree


HIERARCHICAL_STEP = {  # one dense 1-bit step of HierarchicalDistributedLion, per rank
    "dlion/hierarchical.py _read_together": (1, "node round",
        "inside the node, every bucket's reduced headers (which ranks had gradients, a bad gradient, the "
        "digest bits) after the reduce-scatters, and every slice's vote flags after the all-gathers: one "
        "copy each (with one rank per node the header and the flags are the rank's own: none)"),
    "dlion/buckets.py read_flags": (1, "step",
        "every slice's finiteness flag and zero count together: the vote's header is built on the host"),
    "dlion/wire.py read_heads": (1, "round", DENSE_1BIT["dlion/wire.py read_heads"][2]),
    # no _fill_send: the reduce-scatter's header goes to the device from pinned memory, asynchronously
}


def _hierarchical_run(shape: tuple, steps: int, emulate: bool, budget: dict):
    """HierarchicalDistributedLion(comm="1bit") on a ``shape`` = (nodes, ranks per node) mesh of threads,
    two buckets; per rank, the syncs of every step after the first (checked against ``budget``), the
    parameters and both statistics."""
    from torch.distributed.device_mesh import init_device_mesh
    units = {"step": 1, "round": 1, "node round": 2 if shape[1] > 1 else 0}

    def run(rank):
        counts, params, opt = _audited_steps(
            rank, steps, emulate, budget, units,
            lambda params, mesh: dlion.HierarchicalDistributedLion(params, lr=LR, mesh=mesh, comm="1bit",
                                                                   bucket_cap_mb=CAP_MB),
            prepare=lambda: init_device_mesh("cpu", shape, mesh_dim_names=("node", "local")))
        stats = [{k: v for k, v in s.state_dict().items() if k != "wait_s"} for s in (opt.comm_stats, opt.local_stats)]
        return counts, params, stats

    return _threaded_ranks(shape[0] * shape[1], run)


@pytest.mark.parametrize("shape, syncs", [((2, 2), 4), ((2, 1), 2)])
def test_hierarchical_dense_step_per_rank_within_budget(shape, syncs):
    """HierarchicalDistributedLion(comm="1bit") on a 2 × 2 mesh (four threads) and on two nodes of one rank,
    two buckets: per rank and step, one read of every bucket's reduced headers, one of every slice's
    finiteness flag and zero count, one of every vote's received headers and one of every slice's vote
    flags (12 before: six per bucket); with one rank per node only the two of the flat optimizer. The
    parameters and both statistics are bitwise those of the same ranks on CPU tensors."""
    steps = 3
    dev = _hierarchical_run(shape, steps, True, HIERARCHICAL_STEP)
    cpu = _hierarchical_run(shape, steps, False, HIERARCHICAL_STEP)
    for (counts, params, stats), (_, want, want_stats) in zip(dev, cpu):
        assert counts == [syncs] * (steps - 1)
        assert all(torch.equal(a, b) for a, b in zip(params, want))
        assert stats == want_stats
    assert all(torch.equal(a, b) for r in dev[1:] for a, b in zip(dev[0][1], r[1]))  # the replicas agree


DDP_HOOK_STEP = {  # one step of DDP with dlion_hook (comm="1bit"), per rank; none where the hook contributes
    # (no _eager_contribution: the finiteness flag and zero count stay on the device, the header is
    # completed there, dlion.wire._device_headers; 1 per bucket before)
    "dlion/wire.py _split": (1, "bucket",
        "the received headers, in the collective's completion callback (decide), once it has completed: every "
        "rank reads the wire format and the failure flags there (with the threaded group the callback runs "
        "before the hook returns; on Gloo or NCCL, on the group's thread)"),
}


class _DDPHookAudit(EmulatedDevice):
    """EmulatedDevice that also counts, apart, the synchronisations made in dlion_hook's completion
    callback (``decide``, found on the stack), so that what the hook does before it returns its future
    (contribute, issue the first collective) is counted on its own (``syncs`` minus ``callback``)."""

    def __init__(self):
        super().__init__()
        self.callback: collections.Counter = collections.Counter()

    def _sync(self, what: str, times: int = 1) -> None:
        super()._sync(what, times)
        if not self.counting:
            return
        f = sys._getframe(1)
        while f is not None:
            if f.f_code.co_name == "decide" and f.f_code.co_filename.replace("\\", "/").endswith(
                    "dlion/integrations/ddp.py"):
                self.callback[f"{self.site()} ({what})"] += times
                return
            f = f.f_back

    def contribute_site(self) -> dict:
        """by_function() of the syncs made outside the callback."""
        out: collections.Counter = collections.Counter()
        for key, n in (self.syncs - self.callback).items():
            where, func = key.split(" (")[0].split(" ")[:2]
            out[f"{where.rsplit(':', 1)[0]} {func}"] += n
        return dict(out)


def _ddp_hook_run(rank: int, emulate: bool, schedule: list, options: dict, audit_from: int = 1):
    """One rank's steps of DistributedDataParallel with dlion_hook(**options) on a model whose gradients
    are exactly ``schedule[t][rank]`` (loss = Σ (p·g).sum(), several buckets); with ``emulate`` on emulated
    CUDA tensors. Backward runs the hook without the thread's torch-function modes: the hook enters the
    mode itself, and the tensors DDP makes in C++ (the bucket, the gradients it writes) are tagged by hand.
    Returns per step (from ``audit_from``) the buckets, the syncs by function and those outside the
    callback; after every step the parameters and then the Δ the hook wrote into their gradients;
    skipped steps and buckets; the comm statistics (the hook records no vote tallies)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from dlion.integrations.ddp import ApplyDelta, DLionHookState, dlion_hook

    class Dot(torch.nn.Module):
        def __init__(self, init):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in init])

        def forward(self, grads):
            return sum((p * g).sum() for p, g in zip(self.ps, grads))

    em = _DDPHookAudit()
    mode = em if emulate else contextlib.nullcontext()
    move = to_device if emulate else (lambda x: x)
    counts, history, buckets = [], [], set()
    with mode:
        model = Dot(move(schedule[0]["params"]))
        if emulate:
            for p in model.parameters():
                em.tags[p] = True
        # (DDP closes a bucket once it reaches the cap, in reverse order: (32, 32) alone, the rest together)
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = DLionHookState(ddp.module, bucket_cap_mb=0.001, **options)

        def hook(st, bucket):
            buckets.add(bucket.index())
            if emulate:
                em.tags[bucket.buffer()] = True
            with mode:
                return dlion_hook(st, bucket)

        ddp.register_comm_hook(state, hook)
        opt = ApplyDelta(ddp.parameters(), lr=LR, weight_decay=0.1)
        for t, step in enumerate(schedule[1:]):
            grads = move(step[rank])
            em.syncs.clear()
            em.callback.clear()
            buckets.clear()
            em.counting = t >= audit_from  # (DDP rebuilds its buckets after the first iteration)
            ddp(grads).backward()
            if emulate:
                for p in model.parameters():
                    em.tags[p.grad] = True
            deltas = [p.grad.clone() for p in model.parameters()]  # (the hook's Δ, as DDP wrote it)
            opt.step()
            opt.zero_grad()
            em.counting = False
            assert not em.errors, em.errors
            history.append([p.detach().clone() for p in model.parameters()] + deltas)
            if t >= audit_from:
                counts.append((len(buckets), em.by_function(), em.contribute_site()))
        stats = state.comm_stats.state_dict()
    return counts, history, (state.skipped_steps, state.skipped_buckets), stats


def test_ddp_hook_step_per_rank_within_budget():
    """DistributedDataParallel with dlion_hook (comm="1bit") on two ranks (threads, two buckets), dense
    steps: where the hook contributes and issues its first collective, no host synchronisation (one read
    per bucket before: the finiteness flag and zero count); in its completion callback one read per
    bucket of the received headers. Parameters are bitwise those of the same ranks on CPU tensors."""
    world, steps = 2, 3
    schedule = _dense_schedule(steps, world)

    def run(rank, emulate):
        counts, history, _, _ = _ddp_hook_run(rank, emulate, schedule, {})
        for k, by, _ in counts:
            check_budget_counts(by, DDP_HOOK_STEP, {"bucket": k})
        return counts, history

    dev = _threaded_ranks(world, lambda rank: run(rank, True))
    cpu = _threaded_ranks(world, lambda rank: run(rank, False))
    for (counts, history), (_, want) in zip(dev, cpu):
        assert len(counts) == steps - 1
        for k, by, contribute in counts:
            assert k == 2 and by == {"dlion/wire.py _split": k}, by
            assert contribute == {}, contribute
        assert all(torch.equal(a, b) for got, ref in zip(history, want) for a, b in zip(got, ref))
    assert all(torch.equal(a, b) for a, b in zip(dev[0][1][-1], dev[1][1][-1]))


def check_budget_counts(by_function: dict, budget: dict, units: dict) -> None:
    """:func:`check_budget` of counts already taken (by function)."""
    allowed = _allowed(budget, units)
    over = {site: (n, allowed.get(site, 0)) for site, n in by_function.items() if n > allowed.get(site, 0)}
    assert not over, f"host synchronisations over budget, site: (counted, allowed) {over}"


@pytest.mark.parametrize("options", [
    dict(vote="mavo"), dict(vote="mavo", ties="random"), dict(vote="avg"), dict(vote="mavo", comm="allgather"),
    dict(vote="avg", comm="pbit")],
    ids=["mavo", "mavo-random", "avg", "allgather", "pbit-avg"])
def test_ddp_hook_with_abstentions_matches_the_cpu(options):
    """dlion_hook on emulated CUDA tensors through steps with exact zeros in c (rank 0, steps 0 … 2), ties
    (two ranks) and a NaN (rank 1, step 6): no host synchronisation where the hook contributes and issues
    its first collective in any step, and after every step the parameters are bitwise those of the same
    ranks on CPU tensors, as is each step's Δ, with the same skipped step and bucket, and the same bytes
    sent: rank 0's own zeros are listed as runs in its 1-bit header on the device (dlion.wire.device_runs),
    as the host lists them on the CPU (before, the hook's header flagged an overflow and the bucket went
    again in base 3: more bytes, the same votes)."""
    world = 2
    schedule = [step if t == 0 else [[g if g is not None else torch.zeros(s) for g, s in zip(r, SHAPES)]
                                     for r in step]
                for t, step in enumerate(_abstaining_schedule(world))]  # (DDP: no gradient is a zero one)

    def run(rank, emulate):
        return _ddp_hook_run(rank, emulate, schedule, options, audit_from=0)

    dev = _threaded_ranks(world, lambda rank: run(rank, True))
    cpu = _threaded_ranks(world, lambda rank: run(rank, False))
    for (counts, history, skipped, stats), (_, want, want_skipped, want_stats) in zip(dev, cpu):
        assert [contribute for _, _, contribute in counts] == [{}] * 8
        assert skipped == want_skipped == (1, 1)  # the NaN's bucket, in step 6
        for got, ref in zip(history, want):
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
        if options.get("ties", "zero") == "zero":  # two ranks: a tie wherever their signs differ, Δ = 0 there
            assert all(bool((d == 0).any()) for d in history[7][len(SHAPES):])
        assert stats["bytes_sent"] == want_stats["bytes_sent"]
    assert all(torch.equal(a, b) for a, b in zip(dev[0][1][-1], dev[1][1][-1]))  # the replicas agree
    assert not all(torch.equal(a, b) for a, b in zip(dev[0][1][0], dev[0][1][-1]))  # (they moved)


# -- overlap=True: the gradient hooks ------------------------------------------------------------
OVERLAP_STEP = {  # one dense 1-bit step of DistributedLion(overlap=True), per rank; none inside backward's hooks
    "dlion/wire.py _split": (1, "bucket",
        "on the exchange thread, not in a hook: each bucket's received headers as its first collective "
        "completes (the buckets arrive one at a time from the hooks, so they are not read together)"),
}


class _HookAudit(EmulatedDevice):
    """EmulatedDevice that also counts, apart, the synchronisations made inside backward's hooks
    (``hooks``), which run on the caller's thread while the exchange thread syncs on its own."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()
        self.hooks: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _sync(self, what: str, times: int = 1) -> None:
        if not self.counting:
            return
        key = f"{self.site()} ({what})"
        with self._lock:  # (the exchange thread counts too)
            self.syncs[key] += times
            if getattr(self.local, "in_hook", False):
                self.hooks[key] += times


def _audit_overlap(opt, em: _HookAudit, params: list) -> None:
    """Run ``opt``'s gradient hooks and exchange thread under ``em``. Backward runs hooks without the
    caller's torch-function modes and makes the gradients in C++ (untagged): the hook wrapper tags
    them and enters the mode, marking what it counts as inside a hook; the exchange thread enters it
    too. (In the worker process only: the class patch and the set_device stub die with it.)"""
    from dlion.pipeline import Pipeline
    inner = opt._on_grad

    def on_grad(k, j):
        for p in params:
            if p.grad is not None:
                em.tags[p.grad] = True
        em.local.in_hook = True
        try:
            with em:
                inner(k, j)
        finally:
            em.local.in_hook = False

    opt._on_grad = on_grad  # (the registered hooks look the method up when they fire)
    drive = Pipeline._drive_guarded

    def guarded(pipeline):
        with em:
            drive(pipeline)

    Pipeline._drive_guarded = guarded
    torch.cuda.set_device = lambda device: None  # (the emulated cuda:0 has no CUDA context to select)


def _backward(params: list, grads: list) -> None:
    """p.grad = g exactly (None where g is None), through backward: loss = Σ (p·g).sum()."""
    loss = sum((p * g).sum() for p, g in zip(params, grads) if g is not None)
    loss.backward()


def _overlap_worker(rank: int, world: int, schedule: list, options: dict, emulate: bool, overlap: bool):
    """One rank's steps of DistributedLion(comm="1bit", **options) on the SHAPES model (two buckets), the
    gradients of step t being ``schedule[t][rank]`` (None: no gradient), set through backward; with
    ``emulate`` on emulated CUDA tensors under :func:`_audit_overlap`. Returns the parameters after
    every step, the syncs per step (all, and inside the hooks) and the skipped steps."""
    em = _HookAudit()
    move = to_device if emulate else (lambda x: x)
    history, counts = [], []
    with em if emulate else contextlib.nullcontext():
        params = [p.requires_grad_() for p in move([p.clone() for p in schedule[0]["params"]])]
        opt = dlion.DistributedLion(params, lr=LR, bucket_cap_mb=CAP_MB, overlap=overlap, **{"comm": "1bit", **options})
        assert len(opt.buckets) == 2 and params[0].is_cuda == emulate
        if emulate:
            _audit_overlap(opt, em, params)
        for t, step in enumerate(schedule[1:]):
            grads = move(step[rank])
            em.syncs.clear()
            em.hooks.clear()
            em.counting = t >= 1  # (the first step also checks for identical gradients)
            _backward(params, grads)
            for p in params:
                if p.grad is not None and emulate:
                    em.tags[p.grad] = True
            opt.step()
            em.counting = False
            opt.zero_grad()
            history.append([p.detach().clone() for p in params])
            counts.append((em.by_function(), dict(em.hooks)))
        stats = opt.comm_stats.state_dict()
    return history, counts, opt.skipped_steps, stats


def _dense_schedule(steps: int, world: int) -> list:
    g = torch.Generator().manual_seed(7)
    schedule = [{"params": [torch.randn(s, generator=g) for s in SHAPES]}]
    for _ in range(steps):
        schedule.append([[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)])
    return schedule


def _overlap_runs(schedule: list, options: dict) -> tuple[list, list]:
    """The schedule on two ranks: overlap=True on emulated CUDA tensors, and overlap=False on the CPU."""
    from dlion.lab.spawn import spawn
    dev = spawn(_overlap_worker, 2, schedule, options, True, True, timeout_s=300)
    cpu = spawn(_overlap_worker, 2, schedule, options, False, False, timeout_s=300)
    return dev, cpu


def test_overlap_hooks_make_no_host_sync():
    """DistributedLion(overlap=True, comm="1bit") on two ranks (Gloo processes, two buckets, emulated CUDA
    tensors): inside backward's hooks, where each bucket's contribution is made and its first collective
    issued, no host synchronisation at all (two before, per step: one read of each bucket's finiteness flag
    and zero count); per step one read of each bucket's received headers, on the exchange thread. The
    parameters are bitwise those of overlap=False on CPU tensors."""
    steps = 3
    dev, cpu = _overlap_runs(_dense_schedule(steps, 2), {})
    for (history, counts, _, _), (want, _, _, _) in zip(dev, cpu):
        for by_function, hooks in counts[1:]:
            assert hooks == {}, hooks
            assert by_function == _allowed(OVERLAP_STEP, {"bucket": 2}) == {"dlion/wire.py _split": 2}, by_function
        assert all(torch.equal(a, b) for got, ref in zip(history, want) for a, b in zip(got, ref))


def _abstaining_schedule(world: int = 2) -> list:
    """Eight steps of gradients for the SHAPES model on two ranks, with every kind of abstention a hook
    can meet (parameter indices: 0 is bucket 1 alone; 1 … 6 are bucket 0):

    0. rank 0: parameter 6 has two exact zeros (c = 0 there: the momentum is still 0), parameter 3 all
       zeros (so its momentum stays 0: c = 0 in steps 0 … 2, many zeros, "scattered");
    1. rank 1: no gradient for parameter 5 (its bucket leaves from step(), not a hook);
    2. rank 1: no gradient for parameter 0 (a whole bucket abstains);
    3. dense again (rank 0's parameter 3 gets a gradient: c ≠ 0);
    4. no rank has a gradient for parameter 4 (it is left out of the next step's payload);
    5. only rank 0 has one for parameter 4 (the compacted first collective, then the whole bucket again);
    6. rank 1: a NaN (every rank skips the step);
    7. dense.

    With two ranks every coordinate whose signs differ is a tie."""
    g = torch.Generator().manual_seed(11)
    schedule = [{"params": [torch.randn(s, generator=g) for s in SHAPES]}]
    for t in range(8):
        step = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(world)]
        if t == 0:
            step[0][6][2] = step[0][6][3] = 0.0
        if t <= 2:
            step[0][3] = torch.zeros(SHAPES[3])
        if t == 1:
            step[1][5] = None
        if t == 2:
            step[1][0] = None
        if t == 4:
            step[0][4] = step[1][4] = None
        if t == 5:
            step[1][4] = None
        if t == 6:
            step[1][2][5] = float("nan")
        schedule.append(step)
    return schedule


@pytest.mark.parametrize("options", [
    dict(vote="mavo"), dict(vote="mavo", ties="random"), dict(vote="avg"), dict(vote="mavo", comm="allgather"),
    dict(vote="avg", comm="pbit"), dict(aggregate="quantized", comm="auto")],
    ids=["mavo", "mavo-random", "avg", "allgather", "pbit-avg", "quantized"])
def test_overlap_hooks_with_abstentions_match_the_cpu(options):
    """overlap=True on emulated CUDA tensors through steps with exact zeros in c, missing gradients, a
    parameter left out of the payload, a NaN and ties (:func:`_abstaining_schedule`): no host
    synchronisation inside the hooks in any step, and after every step the parameters are bitwise those of
    overlap=False on CPU tensors, with the same skipped step, vote tallies and bytes sent: where a sender's
    c has zeros of its own, its hook header lists their runs, found on the device (dlion.wire.device_runs),
    as the host lists them on the CPU (``1bit``, ``allgather``; before, it flagged an overflow and the bucket
    went again in base 3: more bytes, the same votes); ``pbit`` and ``quantized`` set their header fields on
    the device."""
    dev, cpu = _overlap_runs(_abstaining_schedule(), options)
    for (history, counts, skipped, stats), (want, _, want_skipped, want_stats) in zip(dev, cpu):
        assert [hooks for _, hooks in counts[1:]] == [{}] * 7
        assert skipped == want_skipped == 1
        for got, ref in zip(history, want):
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
        tallies = ("voted", "unanimous", "tied")
        assert [stats[k] for k in tallies] == [want_stats[k] for k in tallies]
        assert stats["tied"] > 0 or options.get("aggregate") == "quantized"  # (which has no tallies)
        assert stats["bytes_sent"] == want_stats["bytes_sent"]  # (rank 0's own zeros listed, not re-sent)
    assert all(torch.equal(a, b) for a, b in zip(dev[0][0][-1], dev[1][0][-1]))  # the replicas agree
    assert not all(torch.equal(a, b) for a, b in zip(dev[0][0][0], dev[0][0][-1]))  # (they moved)
