"""Every collective algorithm gives the same codes, equal to the literal vote, for N = 2…8."""

import math

import pytest
import torch

from dlion.aggregation import VoteRule, coin_key, tie_coins
from dlion.codec import ALIGN
from dlion.collectives import ALGORITHMS, CommStats, choose_algorithm, estimated_bytes, field_width, zero_runs
from dlion.lab.spawn import spawn

RULES = [("mavo", "zero"), ("mavo", "random"), ("avg", "zero")]


def local_delta(rank, world, zeros, n):
    g = torch.Generator().manual_seed(100 * world + rank + (7 if zeros else 0))
    d = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8) * 2 - 1
    if zeros:
        d[torch.rand(n, generator=g) < 0.3] = 0
        d[:40] = 0  # a stretch where every rank abstains
    return d


def run_table(world, n):
    """Every rank's zero runs, padded with empty runs, as the ranks would agree on them."""
    runs = [zero_runs(local_delta(r, world, True, n), n) for r in range(world)]
    table = torch.zeros(world, max(r.shape[0] for r in runs), 2, dtype=torch.int32)
    for r, t in enumerate(runs):
        table[r, :t.shape[0]] = t
    return table


def codes_worker(rank, world, n):
    out = {}
    for vote, ties in RULES:
        rule = VoteRule(vote, world, ties=ties, seed=1)
        for zeros in (False, True, "runs"):
            delta = local_delta(rank, world, zeros is not False, n)
            if zeros == "runs":
                zeros = run_table(world, n)
            for name, algorithm in ALGORITHMS.items():
                stats = CommStats()
                codes = algorithm(delta, zeros, rule, stats=stats, key=coin_key(1, 0, 0))
                label = "runs" if isinstance(zeros, torch.Tensor) else zeros
                out[(vote, ties, label, name)] = (codes.to(torch.int32), stats.bytes_sent, stats.bytes_received)
    return out


def literal(world, vote, ties, zeros, n):
    deltas = [local_delta(r, world, zeros, n).to(torch.int32) for r in range(world)]
    s = sum(deltas)
    nz = sum(d.abs() for d in deltas)
    if vote == "avg":
        return s
    code = torch.sign(s)
    if ties == "random":
        code = torch.where((s == 0) & (nz > 0), tie_coins(coin_key(1, 0, 0), 0, n).to(torch.int32), code)
    return code


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_all_algorithms_agree_with_the_literal_vote(world):
    n = ALIGN * world * 3
    results = spawn(codes_worker, world, n)
    for (vote, ties, zeros, name), (codes, sent, received) in results[0].items():
        want = literal(world, vote, ties, zeros is not False, n)
        assert torch.equal(codes, want), (world, vote, ties, zeros, name)
        for r in range(1, world):
            assert torch.equal(results[r][(vote, ties, zeros, name)][0], codes)
        assert sent == received
        if not zeros:  # bytes moved = the documented formula for this algorithm
            assert sent == pytest.approx(estimated_bytes(name, n, world, VoteRule(vote, world, ties=ties)), abs=1)


def test_field_width_never_overflows():
    assert [field_width(m) for m in (1, 3, 4, 15, 16, 255, 256, 65535)] == [2, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError):
        field_width(2**16)


def test_auto_rule():
    """Two ranks: the naive all-gather moves 1 bit each way, fewer than 1bit's 1.3; three or
    more: the reduce-scatter pattern wins on bytes; tiny buckets: one collective beats two."""
    mavo = lambda n: VoteRule("mavo", n)  # noqa: E731
    assert choose_algorithm(10**7, 2, mavo(2)) == "allgather"
    for world in (3, 4, 8, 16, 32):
        assert choose_algorithm(10**7, world, mavo(world)) == "1bit"
    assert choose_algorithm(4000, 8, mavo(8)) in ("allgather", "pbit")
    for world in (3, 4, 8):
        b = estimated_bytes("1bit", 8 * 10**6, world, mavo(world))
        assert b / 10**6 == pytest.approx((1 + mavo(world).result_bits()) * (world - 1) / world, rel=1e-9)
    assert estimated_bytes("allgather", 8 * 10**6, 5, mavo(5)) == 4 * 10**6
    assert math.isclose(estimated_bytes("pbit", 8 * 10**6, 5, mavo(5)), 2 * 4 * 4 / 5 * 10**6)


def test_zero_runs_and_masks():
    from dlion.collectives import abstention_format, runs_mask
    d = torch.tensor([1, 0, 0, -1, 0, 1, 1, 0], dtype=torch.int8)
    runs = zero_runs(d, 8)
    assert runs.tolist() == [[1, 3], [4, 5], [7, 8]]
    assert runs_mask(runs, 0, 8).tolist() == [False, True, True, False, True, False, False, True]
    assert runs_mask(runs, 2, 6).tolist() == [True, False, True, False]
    assert zero_runs(torch.ones(8, dtype=torch.int8), 8).shape == (0, 2)
    assert abstention_format([0, 0], 4000, 2) == "none"
    assert abstention_format([3, 1], 40000, 2) == "runs"          # 24 B of runs < 1000 B of ternary overhead
    assert abstention_format([3000, 1], 40000, 2) == "ternary"
