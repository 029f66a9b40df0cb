"""The bit-sliced majority vote (dlion.bitvote, OneBit's path without abstentions) against the
vote written out: unpack every sender's bits, count, compare with N/2, ties by the shared coin
(or the previous code)."""

import os

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from dlion.aggregation import VoteRule, tie_coins_at
from dlion.algorithms import Contribution, OneBit
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
