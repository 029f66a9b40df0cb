"""The bit-sliced majority vote (dlion.bitvote, OneBit's path without abstentions) against the
vote written out: unpack every sender's bits, count, compare with N/2, ties by the shared coin
(or the previous code)."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dlion.vote import VoteRule, tie_coins_at
from dlion.wire import Contribution, OneBit
from dlion.bitvote import compare_count, count_planes, popcount_prefix


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_count_planes_and_comparisons_equal_counting(nbytes, rows, seed):
    g = np.random.default_rng(seed)
    packed = g.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    packed[:, 0] = 0xFF  # the extremes: every voter 1, …
    if nbytes > 1:
        packed[:, 1] = 0  # … and none
    counts = np.unpackbits(packed, axis=1, bitorder="little").sum(axis=0)
    planes = count_planes(packed)
    got = sum(np.unpackbits(p, bitorder="little").astype(np.int64) << k for k, p in enumerate(planes))
    assert np.array_equal(got, counts)
    for t in range(rows + 2):
        gt, eq = compare_count(planes, t)
        assert np.array_equal(np.unpackbits(gt, bitorder="little"), (counts > t).astype(np.uint8))
        assert np.array_equal(np.unpackbits(eq, bitorder="little"), (counts == t).astype(np.uint8))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.sampled_from([1, 2, 3, 4, 5, 8, 16, 31, 255]), st.integers(0, 2**31 - 1),
       st.integers(0, 400))
def test_native_majority_equals_counting(nbytes, rows, seed, real):
    """dlion.kernels.majority (one native pass, 64 columns at a time, rows with a stride and a
    length that is no multiple of 8) against counting the unpacked bits."""
    from dlion import kernels

    kernels.load()  # (fused=True loads it; the codec helpers then use it)
    g = np.random.default_rng(seed)
    packed = g.integers(0, 256, (rows, nbytes + 2), dtype=np.uint8)[:, 1:-1]  # (strided rows)
    packed[:, 0] = 0xFF
    counts = np.unpackbits(packed, axis=1, bitorder="little").sum(axis=0)
    got = kernels.majority(packed, real)
    assert got is not None  # (CI has a C compiler)
    gt, eq, unanimous, tied = got
    t = rows // 2
    assert np.array_equal(np.unpackbits(gt, bitorder="little"), (counts > t).astype(np.uint8))
    assert np.array_equal(np.unpackbits(eq, bitorder="little"), (counts == t).astype(np.uint8))
    live = counts[:min(real, counts.size)]
    assert unanimous == int(((live == 0) | (live == rows)).sum())
    assert tied == (int((live == t).sum()) if rows % 2 == 0 else 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 60), st.integers(0, 2**31 - 1))
def test_popcount_prefix(n, seed):
    mask = np.random.default_rng(seed).integers(0, 256, 6, dtype=np.uint8)
    assert popcount_prefix(mask, n) == int(np.unpackbits(mask, bitorder="little")[:n].sum())


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 9), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from(["random", "previous"]),
       st.booleans(), st.integers(0, 3), st.sampled_from(["1", "0"]))
def test_packed_vote_equals_the_vote_written_out(world, blocks, seed, ties, gathered, rank, native):
    """Native (dlion.kernels.majority) and numpy (DLION_NATIVE=0) alike."""
    from dlion import kernels

    kernels.load()  # (fused=True loads it; the codec helpers then use it)
    os.environ["DLION_NATIVE"] = native
    try:
        _check_packed_vote(world, blocks, seed, ties, gathered, rank)
    finally:
        del os.environ["DLION_NATIVE"]


def _check_packed_vote(world, blocks, seed, ties, gathered, rank):
    rank %= world
    width = 8 * blocks
    n = width * world
    g = np.random.default_rng(seed)
    real = int(g.integers(0, width + 1))  # the rest of the chunk is padding (all senders −1, bit 0)
    signs = g.integers(0, 2, (world, width), dtype=np.uint8)
    signs[:, real:] = 0
    rows = torch.from_numpy(np.packbits(signs, axis=1, bitorder="little"))
    previous = torch.from_numpy(g.integers(-1, 2, 3 * n, dtype=np.int8))
    positions = torch.from_numpy(g.permutation(3 * n)[:n].astype(np.int64)) if gathered else None
    lo = rank * width
    contrib = Contribution(torch.zeros(n, dtype=torch.int8), lo + real, torch.ones(1, dtype=torch.bool),
                           positions=positions, previous=previous)
    alg = OneBit(VoteRule("mavo", world, ties=ties))
    key = seed & 0xFFFF
    packed, tally = alg._vote_packed(rows, width, real, key, lo, contrib)

    count = signs.sum(axis=0).astype(np.int64)
    want = np.where(2 * count > world, 1, -1).astype(np.int8)
    tied = np.flatnonzero(2 * count == world)
    for j in tied:
        at = lo + j if positions is None else int(positions[lo + j])
        coin = int(tie_coins_at(key, torch.tensor([at]))[0])
        last = int(previous[at])
        want[j] = last if (ties == "previous" and last != 0) else coin
    assert np.array_equal(np.unpackbits(packed.numpy(), bitorder="little"), (want > 0).astype(np.uint8))
    unanimous = int(((count[:real] == 0) | (count[:real] == world)).sum())
    assert tally.tolist() == [real, unanimous, int((2 * count[:real] == world).sum())]


# -- the torch-op vote (device payloads) against the native and numpy vote -------------------------

from dlion import wire  # noqa: E402
from dlion.vote import coin_bits, coin_bits_torch  # noqa: E402
from dlion.wire import vote_tally  # noqa: E402
from dlion.bitvote import (compare_count_torch, count_planes_torch, equals_all_torch, pack_bits_torch,  # noqa: E402
                           popcount_prefix_torch, unpack_bits_torch)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2**31 - 1), st.integers(0, 400))
def test_torch_planes_and_comparisons_equal_numpy(nbytes, rows, seed, n):
    g = np.random.default_rng(seed)
    packed = g.integers(0, 256, (rows, nbytes + 2), dtype=np.uint8)[:, 1:-1]  # strided rows, as payloads
    packed[:, 0] = 0xFF
    if nbytes > 1:
        packed[:, 1] = 0
    before = packed.copy()
    t_rows = torch.from_numpy(packed)
    planes, want = count_planes_torch(t_rows), count_planes(packed)
    assert len(planes) == len(want)
    assert all(np.array_equal(p.numpy(), w) for p, w in zip(planes, want))
    for t in range(rows + 2):
        gt, eq = compare_count_torch(planes, t)
        wgt, weq = compare_count(want, t)
        assert np.array_equal(gt.numpy(), wgt) and np.array_equal(eq.numpy(), weq)
        assert compare_count_torch(planes, t, want_gt=False)[1].numpy().tobytes() == weq.tobytes()
        assert int(popcount_prefix_torch(eq, n)) == popcount_prefix(weq, n)
    assert np.array_equal(equals_all_torch(planes, rows).numpy(), compare_count(want, rows)[1])
    assert np.array_equal(packed, before)  # the rows are never written
    bits = g.integers(0, 2, n, dtype=np.uint8)
    assert np.array_equal(pack_bits_torch(torch.from_numpy(bits)).numpy(), np.packbits(bits, bitorder="little"))
    assert np.array_equal(unpack_bits_torch(t_rows[0], min(n, 8 * nbytes)).numpy(),
                          np.unpackbits(packed[0], count=min(n, 8 * nbytes), bitorder="little"))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 300))
def test_coin_bits_torch_equal_numpy(key, start, n):
    assert np.array_equal(coin_bits_torch(key, start, n).numpy(), coin_bits(key, start, n))


@settings(max_examples=400, deadline=None)
@given(st.integers(2, 9), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from(["zero", "random", "previous"]),
       st.booleans(), st.integers(0, 8), st.sampled_from(["1", "0"]), st.booleans())
def test_torch_vote_equals_native_and_numpy_vote(world, blocks, seed, ties, gathered, rank, native, no_previous):
    """OneBit's vote in torch ops (wire.TORCH_VOTE, what device payloads take) against the
    CPU's (native kernels.majority, or numpy with DLION_NATIVE=0), bitwise: the packed codes and the
    tally; and where the codes go back in base 3 (ties="zero", even N), its int8 codes against
    ``rule.decide`` and ``vote_tally`` of the counted sums (the path the CPU takes there)."""
    rank %= world
    width = 8 * blocks
    n = width * world
    g = np.random.default_rng(seed)
    real = int(g.integers(0, width + 1))  # the rest of the chunk is padding: every sender's bit 0 (value 0)
    signs = g.integers(0, 2, (world, width), dtype=np.uint8)
    signs[:, real:] = 0
    rows = torch.from_numpy(np.packbits(signs, axis=1, bitorder="little"))
    wide = torch.from_numpy(g.integers(0, 256, (world, blocks + 3), dtype=np.uint8))
    wide[:, 1:1 + blocks] = rows  # strided rows, as the payloads sit in the received buffer
    rows = wide[:, 1:1 + blocks]
    previous = None if no_previous else torch.from_numpy(g.integers(-1, 2, 3 * n, dtype=np.int8))
    positions = torch.from_numpy(g.permutation(3 * n)[:n].astype(np.int64)) if gathered else None
    lo = rank * width
    contrib = Contribution(torch.zeros(n, dtype=torch.int8), lo + real, torch.ones(1, dtype=torch.bool),
                           positions=positions, previous=previous)
    alg = OneBit(VoteRule("mavo", world, ties=ties))
    key = int(g.integers(0, 2**32))
    if ties == "zero" and world % 2 == 0:  # no _vote_packed on the CPU here: the codes travel in base 3
        codes, tally = alg._vote_packed_torch(rows, width, real, key, lo, contrib, codes=True)
        s = torch.from_numpy(signs.sum(axis=0).astype(np.int16) * 2 - world)
        assert torch.equal(codes, alg.rule.decide(s, None, key=key, start=lo))
        assert tally.tolist() == vote_tally(s, None, world, real).tolist()
        return
    os.environ["DLION_NATIVE"] = native
    try:
        want, want_tally = alg._vote_packed(rows, width, real, key, lo, contrib)
    finally:
        del os.environ["DLION_NATIVE"]
    got, got_tally = alg._vote_packed_torch(rows, width, real, key, lo, contrib)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    assert got_tally.dtype == torch.int64 and got_tally.tolist() == want_tally.tolist()
    wire.TORCH_VOTE = True  # the switch routes _vote_packed itself
    try:
        again, again_tally = alg._vote_packed(rows, width, real, key, lo, contrib)
    finally:
        wire.TORCH_VOTE = False
    assert torch.equal(again, want) and again_tally.tolist() == want_tally.tolist()


def _simulate(world, ties, grads_kind, torch_vote, calls):
    from dlion.simulate import SimulatedDistributedLion

    gen = torch.Generator().manual_seed(7)
    shapes = [(40, 13), (7,), (300,), (5, 5)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    sim = SimulatedDistributedLion(params, world, lr=0.01, weight_decay=0.1, ties=ties, comm="1bit", seed=3,
                                   bucket_cap_mb=400 * 4 / 2**20)  # several buckets
    original = OneBit._vote_packed_torch

    def counted(self, *a, **kw):
        calls.append(kw.get("codes", False))
        return original(self, *a, **kw)

    wire.TORCH_VOTE = torch_vote
    OneBit._vote_packed_torch = counted
    try:
        for t in range(5):
            grads = []
            for i in range(world):
                g = [torch.randn(s, generator=gen) for s in shapes]
                if grads_kind == "left out" and t >= 1:
                    g[1] = None  # no rank has it: left out of the payload (gathered coordinates) from step 2
                elif grads_kind == "abstaining":
                    g[0][3] = 0.0
                    if i % 2:
                        g[2] = None
                grads.append(g)
            sim.step(grads)
    finally:
        wire.TORCH_VOTE = False
        OneBit._vote_packed_torch = original
    st_ = sim.comm_stats
    return params, (st_.voted, st_.unanimous, st_.tied, st_.bytes_sent, st_.bytes_received)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("ties", ["zero", "random", "previous"])
@pytest.mark.parametrize("grads_kind", ["dense", "left out", "abstaining"])
def test_simulation_with_the_torch_vote_equals_the_cpu_vote(world, ties, grads_kind):
    """Whole SimulatedDistributedLion steps (comm="1bit") with the torch-op vote forced on the CPU:
    the same parameters, bitwise, the same tallies and bytes, and the torch vote did run where no
    rank abstains (the packed vote, or ties="zero" at even N the base-3 codes)."""
    calls_cpu, calls_torch = [], []
    want, want_stats = _simulate(world, ties, grads_kind, False, calls_cpu)
    got, got_stats = _simulate(world, ties, grads_kind, True, calls_torch)
    assert not calls_cpu
    assert bool(calls_torch) == (grads_kind != "abstaining")
    assert all(c == (ties == "zero" and world % 2 == 0) for c in calls_torch)
    for p, q in zip(got, want):
        assert torch.equal(p, q)
    assert got_stats == want_stats
