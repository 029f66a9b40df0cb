"""The zero runs of a 1-bit header found on the device (:func:`dlion.wire.device_runs`) give the bytes the
host path gives (:func:`dlion.wire.zero_runs` then :func:`dlion.wire._headers`), with no host sync.

The values run on emulated CUDA tensors (:class:`sync_audit.EmulatedDevice`), so the device branches are
the ones taken; the reference is the CPU path on the same values. Run counts per row are drawn around the
header's capacity (exactly ``capacity`` fits, ``capacity + 1`` overflows), runs end at row boundaries
(a run never crosses a row), and parameters without gradient add zero spans of their own."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlion import wire
from dlion.wire import Contribution
from sync_audit import EmulatedDevice, to_device


@st.composite
def buckets(draw):
    """(values int8 (rows·width,), rows, numel, capacity, sizes or None, has_grad)."""
    rows = draw(st.integers(1, 4))
    width = 8 * draw(st.integers(1, 5))
    capacity = draw(st.integers(1, 6))
    signs = draw(st.lists(st.sampled_from([-1, 1]), min_size=rows * width, max_size=rows * width))
    values = torch.tensor(signs, dtype=torch.int8).view(rows, width)
    for r in range(rows):
        most = (width + 1) // 2
        k = min(most, draw(st.sampled_from([0, 1, capacity // 2, capacity // 2 + 1, capacity, capacity + 1,
                                            capacity + 2, draw(st.integers(0, most))])))
        cuts = sorted(draw(st.lists(st.integers(0, width), min_size=2 * k, max_size=2 * k, unique=True)))
        for a, b in zip(cuts[::2], cuts[1::2]):  # [a, b) zero; the next run starts after a nonzero
            values[r, a:b] = 0
    values = values.view(-1)
    n = values.numel()
    numel = draw(st.sampled_from([n, draw(st.integers(0, n))]))
    values[numel:] = 0  # padding
    sizes, has_grad = None, torch.ones(draw(st.integers(1, 20)), dtype=torch.bool)
    if draw(st.booleans()) and numel:  # parameter sizes known: some without gradient (all zeros)
        cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=6))) | {0, numel})
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        sizes += [0] * draw(st.integers(0, 2))  # (parameters left out of the payload)
        has_grad = torch.tensor(draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes))))
        at = 0
        for size, has in zip(sizes, has_grad.tolist()):
            if not has:
                values[at:at + size] = 0
            at += size
    return values, rows, numel, capacity, sizes, has_grad


def _host_header(c: Contribution, rows: int, capacity: int, slots: bool, scattered: bool) -> torch.Tensor:
    """What the CPU path sends (OneBit.run with ``scattered``, AllGather.run without)."""
    runs = wire.zero_runs(c.values, rows, c.numel)
    scat = scattered and bool(runs[0].numel()) and wire._zeros_within_parameters(c) > capacity // 2
    return wire._headers(c, rows, capacity, runs, slots, scat)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bucket=buckets(), slots=st.booleans(), scattered=st.booleans(), status=st.sampled_from([0, 1, 2, 3]),
       zeros_as=st.sampled_from(["none", "host", "device"]), finite=st.sampled_from([None, True, False]))
def test_device_header_is_the_host_header(bucket, slots, scattered, status, zeros_as, finite):
    values, rows, numel, capacity, sizes, has_grad = bucket
    zeros = numel - int(torch.count_nonzero(values[:numel]))
    ref_status = status | (wire.NONFINITE if finite is False else 0)
    want = _host_header(Contribution(values, numel, has_grad, ref_status, 12345, sizes=sizes), rows, capacity,
                        slots, scattered)
    em = EmulatedDevice()
    with em:
        dev_values = to_device(values)
        z = {"none": None, "host": zeros, "device": to_device(torch.tensor(zeros))}[zeros_as]
        fin = None if finite is None else to_device(torch.tensor(finite))
        if fin is not None:  # (deferred: the status lacks NONFINITE, which comes from the flag on the device)
            z = to_device(torch.tensor(zeros))
        c = Contribution(dev_values, numel, has_grad, status if fin is not None else ref_status, 12345,
                         sizes=sizes, zeros=z, finite=fin)
        em.counting = True
        got = wire._device_headers(c, rows, capacity, slots, scattered)
        em.counting = False
        assert got.is_cuda
    assert not em.errors and em.count() == 0, em.syncs
    assert torch.equal(got, want), (got, want)
    # the run count column: as many as there are, unless some row overflows (then none is listed)
    counts = torch.bincount(wire.zero_runs(values, rows, numel)[0], minlength=rows)
    over = bool(counts.numel()) and int(counts.max()) > capacity
    assert bool(got[0, 0] & wire._OVERFLOW) == over


@settings(max_examples=200, deadline=None)
@given(bucket=buckets())
def test_codes_way_back_on_the_device_is_the_host_block(bucket):
    """The codes' way back: the block :meth:`Algorithm._down_block` sends (count or −1, runs) and what
    ``_runs_fit`` decides are the host path's, with no host sync making the block and one read for the fit."""
    values, rows, numel, capacity, _, _ = bucket
    alg = wire.OneBit.__new__(wire.OneBit)
    n = values.numel()
    lo = (n // rows) * (rows - 1)  # the last row: padding where numel ends inside it
    codes = values[lo:].clone()
    want = alg._down_block(codes, numel, lo, None, capacity)
    fit = wire.Algorithm._runs_fit(values, rows, numel, capacity)
    em = EmulatedDevice()
    with em:
        dev, dev_values = to_device(codes), to_device(values)
        em.counting = True
        got = alg._down_block(dev, numel, lo, None, capacity)
        em.counting = False
        assert got.is_cuda and em.count() == 0, em.syncs
        em.counting = True
        got_fit = wire.Algorithm._runs_fit(dev_values, rows, numel, capacity)
        em.counting = False
        reads = em.count()
    assert torch.equal(got, want)
    assert got_fit == fit and reads == 1
    decoded = alg._down_decode(want.view(1, -1).expand(2, -1).reshape(-1), 2, codes.numel(), None, capacity)
    real = max(0, min(numel - lo, codes.numel()))
    over = int(want[:4].view(torch.int32)[0]) < 0
    assert decoded is None if over else torch.equal(decoded.view(2, -1)[0][:real] == 0, codes[:real] == 0)


def test_device_runs_examples():
    """Runs at row edges, an exact fit and one more than fits."""
    v = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0,   0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.int8)
    counts, table = wire.device_runs(v, 2, 16, 3)
    assert counts.tolist() == [3, 2]  # row 0: [0,1) [2,4) [5,8); row 1: [0,2) [7,8) (no run crosses the row)
    assert table.tolist() == [[[0, 1], [2, 4], [5, 8]], [[0, 2], [7, 8], [0, 0]]]
    counts, table = wire.device_runs(v, 2, 12, 2)  # numel 12: row 1's padding is not a run; row 0 overflows
    assert counts.tolist() == [3, 1]
    assert table.tolist()[1] == [[0, 2], [0, 0]]
    counts, table = wire.device_runs(torch.ones(16, dtype=torch.int8), 1, 16, 4)
    assert counts.tolist() == [0] and not table.any()


def test_header_at_capacity_lists_and_one_more_overflows():
    v = torch.tensor([0, 1, 0, 0, 1, 0, 0, 0,   0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.int8)
    for capacity, over in ((3, False), (2, True)):  # row 0 has 3 runs: exactly the capacity, or one more
        c = Contribution(v, 16, torch.ones(2, dtype=torch.bool), 0, 7)
        want = _host_header(c, 2, capacity, True, True)
        em = EmulatedDevice()
        with em:
            got = wire._device_headers(Contribution(to_device(v), 16, c.has_grad, 0, 7), 2, capacity, True, True)
        assert torch.equal(got, want)
        assert bool(got[0, 0] & wire._OVERFLOW) == over and bool(got[0, 0] & wire._ABSTAINS)
        assert got[:, 2].tolist() == ([0, 0] if over else [3, 2])
