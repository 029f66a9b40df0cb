"""torchft's quantised all-reduce with the row-scaled fp8 / fp4 wire (dlion.lab.quantised_allreduce,
dlion.lab.float_wire): real Gloo ranks against the formula written out here, and its bytes counted here."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlion.collectives import CommStats
from dlion.lab import float_wire as fw
from dlion.lab.quantised_allreduce import quantised_mean, row_groups
from dlion.lab.spawn import spawn

SHAPES = [(5, 7), (13,), (), (2, 3, 4), (9, 1)]


def _tensors(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    out = [torch.randn(s, generator=g) * (10.0 ** (i - 2)) for i, s in enumerate(SHAPES)]
    out[0][1] = 0.0  # an all-zero row
    return out


def _worker(rank, world, fmt):
    stats = CommStats()
    return quantised_mean(_tensors(rank), fmt, stats=stats), stats.bytes_sent


@pytest.mark.parametrize("world,fmt", [(3, "fp4"), (4, "fp4"), (4, "fp8"), (5, "fp4")])
def test_every_rank_gets_the_requantised_mean_of_the_quantised_tensors(world, fmt):
    results = spawn(_worker, world, fmt)
    # the formula: Q((Q(x_0) + … + Q(x_{N-1})) / N), Q row by row, added in rank order
    xs = [_tensors(r) for r in range(world)]
    for t, shape in enumerate(SHAPES):
        acc = fw.roundtrip(xs[0][t], fmt)
        for r in range(1, world):
            acc = acc + fw.roundtrip(xs[r][t], fmt)
        want = fw.roundtrip(acc / world, fmt)
        for mean, _ in results:
            assert mean[t].shape == torch.Size(shape)
            assert torch.equal(mean[t], want), (t, shape)
    # bytes, counted here: V values in R rows (a 3-d tensor's rows: its last dimension), fp4 two per byte with each
    # group padded to a byte, 4 per row's scale; each rank sends the others' groups of its rows, then its group to
    # the N − 1 others: summed over the ranks, 2(N − 1) times one copy of every group
    values = sum(torch.Size(s).numel() for s in SHAPES)
    rows = 5 + 1 + 1 + 2 * 3 + 9
    one_copy = (values / 2 if fmt == "fp4" else values) + 4 * rows
    total = sum(sent for _, sent in results)
    assert 2 * (world - 1) * one_copy <= total <= 2 * (world - 1) * (one_copy + (world if fmt == "fp4" else 0))


def test_row_groups_cut_the_rows_in_order_by_their_values():
    # 3 rows of 4, 1 row of 10, 2 rows of 4: 30 values, N = 4, cuts where the count first reaches 7.5, 15, 22.5
    assert row_groups([3, 1, 2], [4, 10, 4], 4) == [[(0, 0, 2)], [(0, 2, 3), (1, 0, 1)], [(2, 0, 1)], [(2, 1, 2)]]
    assert row_groups([1], [8], 3) == [[(0, 0, 1)], [], []]  # one row: the others own nothing


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=40),
       st.sampled_from(fw.FORMATS))
def test_a_roundtrip_keeps_signs_and_the_row_scale_and_fp4_lands_on_a_level(values, fmt):
    x = torch.tensor(values)
    y = fw.roundtrip(x, fmt)
    scale = float(x.abs().max())
    # the absmax comes back: exactly in fp4 (level 1 × scale), within fp32 rounding in fp8 (448 × scale / 448)
    assert float(y.abs().max()) == (scale if fmt == "fp4" else pytest.approx(scale, rel=1e-6))
    assert torch.all((y == 0) | (torch.sign(y) == torch.sign(x)))
    if fmt == "fp4" and scale > 0:
        levels = torch.tensor([0.0] + [2.0 ** k for k in range(-6, 1)])
        m = (x.abs() / scale)
        got = (y.abs() / scale)
        for mi, gi in zip(m.tolist(), got.tolist()):
            nearest = min(levels.tolist(), key=lambda v: (abs(v - mi), -v))  # ties away from zero
            assert gi == pytest.approx(nearest, rel=1e-6), (mi, gi)
    codes, _ = fw.encode(fw.rows_of(x), fmt)
    if fmt == "fp4":
        assert int(codes.max()) < 16
        assert torch.equal(fw.unpack4(fw.pack4(codes), codes.numel()), codes.reshape(-1))


def _sync_worker(rank, world):
    from dlion.lab import diloco as ld

    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    st = ld.make_state(params, sync_every=1, outer_lr=1.0, quantize="fp4")
    st.outer.param_groups[0]["momentum"] = 0.0  # (plain SGD at lr 1: θ ← θ − mean)
    st.outer.param_groups[0]["nesterov"] = False
    xs = _tensors(rank)
    with torch.no_grad():
        params[0].copy_(xs[0][:3, :4])
        params[1].copy_(xs[1][:5])
    ld.sync(st)  # Δ_i = θ − x_i = −x_i
    return [p.detach().clone() for p in params], st.stats.bytes_sent


def test_the_functional_sync_takes_the_quantised_mean():
    world = 3
    results = spawn(_sync_worker, world)
    xs = [_tensors(r) for r in range(world)]
    for t, (rows, cols) in enumerate(((3, 4), (5, None))):
        d = [-(x[t][:rows, :cols] if cols else x[t][:rows]) for x in xs]
        acc = fw.roundtrip(d[0], "fp4")
        for di in d[1:]:
            acc = acc + fw.roundtrip(di, "fp4")
        want = -fw.roundtrip(acc / world, "fp4")  # θ = 0 − mean
        for params, sent in results:
            assert torch.equal(params[t], want)
            assert sent > 0
    with pytest.raises(ValueError, match="quantize"):
        from dlion.lab import diloco as ld
        ld.make_state([torch.zeros(2)], sync_every=1, quantize="fp4", wire_dtype=torch.bfloat16)
