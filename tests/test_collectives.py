"""Every aggregation algorithm gives the same codes, equal to the literal vote, for N = 2…8;
real runs, the automatic choice's estimate and the simulator count the same bytes."""

import math

import pytest
import torch

from dlion.aggregation import VoteRule, coin_key, tie_coins
from dlion.algorithms import (ALGORITHMS, Contribution, WireState, choose_algorithm, make_algorithm, runs_mask,
                              zero_runs)
from dlion.codec import ALIGN
from dlion.collectives import CommStats, GroupTransport, field_width
from dlion.pipeline import Flight
from dlion.simulate import _lockstep
from dlion.lab.spawn import spawn

RULES = [("mavo", "zero"), ("mavo", "random"), ("avg", "zero")]
PATTERNS = ("dense", "scattered", "clustered")


def local_delta(rank, world, pattern, n):
    g = torch.Generator().manual_seed(100 * world + rank + 7 * PATTERNS.index(pattern))
    d = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8) * 2 - 1
    if pattern == "scattered":
        d[torch.rand(n, generator=g) < 0.3] = 0
    if pattern != "dense":
        d[:40] = 0  # a stretch where every rank abstains
        d[100 + rank:110 + rank] = 0  # dead units, partly shared
    return d


def contribution(rank, world, pattern, n):
    return Contribution(local_delta(rank, world, pattern, n), n, torch.ones(3, dtype=torch.bool), 0, 12345)


def state_for(name):
    return WireState(up="narrow" if name == "pbit" else "runs")


def codes_worker(rank, world, n):
    import torch.distributed as dist
    out = {}
    for vote, ties in RULES:
        rule = VoteRule(vote, world, ties=ties, seed=1)
        for pattern in PATTERNS:
            for name in ALGORITHMS:
                stats = CommStats()
                transport = GroupTransport(None, stats)
                alg = make_algorithm(name, rule)
                state = state_for(name)
                codes = []
                for step in range(2):  # a second step runs in whatever format the first settled on
                    flight = Flight(alg.run(state, contribution(rank, world, pattern, n), rank, coin_key(1, 0, 0)),
                                     transport)
                    flight.advance(transport, block=True)
                    codes.append(flight.outcome.codes.to(torch.int32))
                out[(vote, ties, pattern, name)] = (codes, stats.bytes_sent, stats.bytes_received, stats.collectives)
    dist.barrier()
    return out


def literal(world, vote, ties, pattern, n):
    deltas = [local_delta(r, world, pattern, n).to(torch.int32) for r in range(world)]
    s = sum(deltas)
    nz = sum(d.abs() for d in deltas)
    if vote == "avg":
        return s
    code = torch.sign(s)
    if ties == "random":
        code = torch.where((s == 0) & (nz > 0), tie_coins(coin_key(1, 0, 0), 0, n).to(torch.int32), code)
    return code


def simulated_bytes(world, vote, ties, pattern, name, n):
    rule = VoteRule(vote, world, ties=ties, seed=1)
    alg = make_algorithm(name, rule)
    states = [state_for(name) for _ in range(world)]
    stats = CommStats()
    for _ in range(2):
        gens = [alg.run(states[r], contribution(r, world, pattern, n), r, coin_key(1, 0, 0)) for r in range(world)]
        outcome = _lockstep(gens, stats)
    return stats, outcome


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_all_algorithms_agree_with_the_literal_vote_and_count_the_same_bytes(world):
    n = ALIGN * world * 30
    results = spawn(codes_worker, world, n)
    for (vote, ties, pattern, name), (codes, sent, received, calls) in results[0].items():
        want = literal(world, vote, ties, pattern, n)
        for c in codes:
            assert torch.equal(c, want), (world, vote, ties, pattern, name)
        for r in range(1, world):
            assert results[r][(vote, ties, pattern, name)][1] == sent
            for a, b in zip(results[r][(vote, ties, pattern, name)][0], codes):
                assert torch.equal(a, b)
        assert sent == received
        sim, outcome = simulated_bytes(world, vote, ties, pattern, name, n)
        assert torch.equal(outcome.codes.to(torch.int32), want)
        assert (sim.bytes_sent, sim.collectives) == (sent, calls), (world, vote, ties, pattern, name)
        if pattern == "dense":  # real run = estimate used by comm="auto" = simulator, exactly
            alg = make_algorithm(name, VoteRule(vote, world, ties=ties))
            assert sent == pytest.approx(2 * alg.estimated_bytes(n, 3), abs=2 * calls), (world, vote, ties, name)


def test_one_bit_stays_one_bit_with_clustered_abstentions():
    """Clustered abstentions ride as run tables: the way up stays 1 bit (plus the fixed header)."""
    world, n = 3, ALIGN * 3 * 300
    stats, outcome = simulated_bytes(world, "mavo", "zero", "clustered", "1bit", n)
    dense, _ = simulated_bytes(world, "mavo", "zero", "dense", "1bit", n)
    assert stats.by_kind["signs"] == dense.by_kind["signs"]  # same bytes up as without abstentions
    assert stats.collectives == dense.collectives == 4       # no base-3 re-send


def test_field_width_never_overflows():
    assert [field_width(m) for m in (1, 3, 4, 15, 16, 255, 256, 65535)] == [2, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        field_width(2**16)


def test_auto_rule():
    """Two ranks: the naive all-gather moves 1 bit each way, fewer than 1bit's 1.3; three or
    more: the reduce-scatter pattern wins on bytes; tiny buckets: one collective beats two."""
    mavo = lambda n: VoteRule("mavo", n)  # noqa: E731
    assert choose_algorithm(10**7, 10, mavo(2)) == "allgather"
    for world in (3, 4, 8, 16, 32):
        assert choose_algorithm(10**7, 10, mavo(world)) == "1bit"
    assert choose_algorithm(4000, 10, mavo(8)) in ("allgather", "pbit")
    for world in (3, 4, 8):
        b = make_algorithm("1bit", mavo(world)).estimated_bytes(8 * 10**6, 10)
        # the information bound plus the run-table room of the header (about 2 % of the way up)
        assert b / 10**6 == pytest.approx((1 + mavo(world).result_bits()) * (world - 1) / world, rel=0.015)
    assert make_algorithm("allgather", mavo(5)).estimated_bytes(8 * 10**6, 10) == pytest.approx(4 * 10**6, rel=0.025)
    assert math.isclose(make_algorithm("pbit", mavo(5)).estimated_bytes(8 * 10**6, 10), 2 * 4 * 4 / 5 * 10**6,
                        rel_tol=1e-3)


def test_zero_runs_and_masks():
    d = torch.tensor([1, 0, 0, -1, 0, 1, 1, 0], dtype=torch.int8)
    rows, starts, ends = zero_runs(d.clone(), 1, 8)
    assert torch.stack([starts, ends], 1).tolist() == [[1, 3], [4, 5], [7, 8]]
    assert runs_mask(rows, starts, ends, (1, 8)).tolist() == [[False, True, True, False, True, False, False, True]]
    rows, starts, ends = zero_runs(d.clone(), 2, 8)  # two rows of 4: a run never crosses a row
    assert list(zip(rows.tolist(), starts.tolist(), ends.tolist())) == [(0, 1, 3), (1, 0, 1), (1, 3, 4)]
    rows, _, _ = zero_runs(d.clone(), 1, 6)  # padding (from numel on) is not a run
    assert rows.numel() == 2
    assert zero_runs(torch.ones(8, dtype=torch.int8), 1, 8)[0].numel() == 0
