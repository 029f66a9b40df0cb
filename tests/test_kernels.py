"""The fused CPU kernels against the eager operations they replace, value for value, on
random inputs that include zeros of both signs, infinities, NaN and subnormals."""

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlion import kernels

SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 1e-310, 3e38, -3e38, 1.0, -1.0]


def same(a, b):
    """Equal values, NaN where NaN, and the same sign of every zero."""
    return (torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(0.5, 2.0, -2.0), b.nan_to_num(0.5, 2.0, -2.0))
            and torch.equal(torch.signbit(a[a == 0]), torch.signbit(b[b == 0])))


values = st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=True)), min_size=0, max_size=300)
betas = st.floats(0.0, 0.999)


@settings(max_examples=60, deadline=None)
@given(m=values, g=values, beta=betas, dtype=st.sampled_from([torch.float32, torch.float64]),
       negate=st.booleans())
def test_kernels_equal_the_eager_rule(m, g, beta, dtype, negate):
    n = min(len(m), len(g))
    m, g = torch.tensor(m[:n], dtype=dtype), torch.tensor(g[:n], dtype=dtype)
    scale = -(1.0 - beta) if negate else 1.0 - beta
    # c = β·m + scale·g, each product rounded, as DistributedLion's contribute computes it
    c = torch.mul(m, beta).add_(torch.mul(g, scale))
    values = torch.full((n + (-n) % 8,), 7, dtype=torch.int8)
    finite, packed, zeros = kernels.sign_and_pack([m], [g], [0], beta, scale, values, n)
    out = values[:n]
    assert finite == bool(torch.isfinite(c).all())
    if finite:
        assert torch.equal(out, torch.sign(c).to(torch.int8))
        assert zeros == int((torch.sign(c) == 0).sum())
    else:  # no meaning, but nothing a codec cannot take
        assert bool(((out >= -1) & (out <= 1)).all())
    m2 = m.clone()
    kernels.momentum_update_(m2, g, beta, scale)
    assert same(m2, torch.mul(m, beta).add_(torch.mul(g, scale)))


@settings(max_examples=40, deadline=None)
@given(p=values, m=values, g=values, lr=st.floats(1e-6, 0.5), wd=st.sampled_from([0.0, 0.1, 1.0]),
       b1=betas, b2=betas, maximize=st.booleans())
def test_the_fused_lion_rule_equals_the_four_lines(p, m, g, lr, wd, b1, b2, maximize):
    n = min(len(p), len(m), len(g))
    p, m, g = (torch.tensor(x[:n]) for x in (p, m, g))
    p2, m2 = p.clone(), m.clone()
    kernels.lion_update_(p2, m2, g, lr, wd, b1, b2, scale=-1.0 if maximize else 1.0)
    gg = -g if maximize else g
    want_p = p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * gg)  # (a Python float times a tensor
    want_m = b2 * m + (1 - b2) * gg                                         # rounds like torch.mul)
    assert same(p2, want_p) and same(m2, want_m)
    # the update from int8 codes and from packed bits, on the same special values
    codes = torch.sign(b1 * m + (1 - b1) * gg).to(torch.int8)
    codes[codes == 0] = 1
    bits = torch.from_numpy(np.packbits((codes > 0).numpy(), bitorder="little")) if n else torch.zeros(1, dtype=torch.uint8)
    want = p * (1 - lr * wd) - lr * codes.to(p.dtype)
    p3, p4 = p.clone(), p.clone()
    kernels.apply_codes_(p3, codes, lr, wd)
    kernels.apply_signs_(p4, [0], bits, lr, wd)
    assert same(p3, want) and same(p4, want)


def test_supported_only_for_cpu_fp32_fp64_of_one_dtype():
    f = torch.zeros(3)
    assert kernels.supported(f, f) and kernels.supported(f.double(), f.double())
    assert not kernels.supported(f.bfloat16(), f.bfloat16())
    assert not kernels.supported(f, f.double())
    assert not kernels.supported(torch.zeros(3, device="meta"))


def test_a_failed_build_names_the_option_and_the_way_out(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DLION_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="fused=False") as info:
        kernels.momentum_update_(torch.zeros(3), torch.ones(3), 0.9, 0.1)
    assert isinstance(info.value.__cause__, OSError)
    assert not kernels.available()
    # the codec helpers still work, through numpy: the same bits
    v = torch.tensor([1, -1, 0, 1, 1, 0, -1, 1], dtype=torch.int8)
    assert kernels.pack_positive(v).tolist() == [0b10011001]
    assert kernels.unpack_signs(torch.tensor([0b10011001], dtype=torch.uint8), 7).tolist() == [1, -1, -1, 1, 1,
                                                                                                -1, -1]
    assert kernels.count_zeros(v) == 2


def test_the_library_is_built_once_into_the_cache_and_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_library", None)
    monkeypatch.setenv("DLION_CACHE_DIR", str(tmp_path))
    assert not kernels.available()  # (never built by asking)
    kernels.load()
    assert kernels.available()
    built = list(tmp_path.glob("kernels-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_library", None)
    kernels.load()
    assert kernels.available() and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_many_segments_in_one_call_equal_one_call_each():
    """A bucket's tensors go to the library as one array of pointers: the same values as the
    eager ops tensor by tensor, sizes 0 and 1 and a size above the library's chunk included."""
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 300, 70_001, 5]
    for dtype in (torch.float32, torch.float64):
        ps = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        ms = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        gs = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        ms[3][5] = 0.0
        gs[3][5] = 0.0  # c = 0: sign 0
        codes = [torch.randint(-1, 2, (n,), generator=g, dtype=torch.int8) for n in sizes]
        want = [p * (1 - 0.01 * 0.1) - 0.01 * c.to(dtype) for p, c in zip(ps, codes)]
        kernels.apply_codes_(ps, codes, 0.01, 0.1)
        assert all(same(p, w) for p, w in zip(ps, want))
        # the same update from packed 1-bit codes, segments starting at any bit
        starts = [3 + sum(sizes[:i]) + 5 * i for i in range(len(sizes))]
        n_bits = starts[-1] + sizes[-1] + 8
        bits = torch.randint(0, 256, ((n_bits + 7) // 8,), generator=g, dtype=torch.uint8)
        signs = [torch.tensor([1 if (int(bits[i // 8]) >> (i % 8)) & 1 else -1 for i in range(st, st + n)],
                              dtype=torch.int8) for st, n in zip(starts, sizes)]  # (decoded by hand)
        want = [p * (1 - 0.01 * 0.1) - 0.01 * c.to(dtype) for p, c in zip(ps, signs)]
        kernels.apply_signs_(ps, starts, bits, 0.01, 0.1)
        assert all(same(p, w) for p, w in zip(ps, want))
        with pytest.raises(ValueError, match="past the packed bits"):
            kernels.apply_signs_(ps[-1:], [8 * bits.numel() - 2], bits, 0.01, 0.1)
        want_m = [torch.mul(m, 0.99).add_(torch.mul(gg, 0.01)) for m, gg in zip(ms, gs)]
        kernels.momentum_update_(ms, gs, 0.99, 0.01)
        assert all(same(m, w) for m, w in zip(ms, want_m))
        p2, m2 = [p.clone() for p in ps], [m.clone() for m in ms]
        kernels.lion_update_(p2, m2, gs, 0.01, 0.1, 0.9, 0.99)
        for p, m, gg, pp, mm in zip(ps, ms, gs, p2, m2):
            assert same(pp, p * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.9 * m + (1 - 0.9) * gg))
            assert same(mm, 0.99 * m + (1 - 0.99) * gg)


def test_kernels_refuse_mismatched_segments_and_strided_tensors():
    with pytest.raises(ValueError, match="sizes"):
        kernels.momentum_update_([torch.zeros(3)], [torch.zeros(4)], 0.9, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.momentum_update_(torch.zeros(3, 2).t(), torch.zeros(2, 3), 0.9, 0.1)
    with pytest.raises(ValueError, match="fp32 or fp64"):
        kernels.momentum_update_(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), 0.9, 0.1)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.pack_positive(torch.zeros(7, dtype=torch.int8))


codes = st.lists(st.sampled_from([-1, 0, 1]), min_size=0, max_size=200)


@settings(max_examples=60, deadline=None)
@given(v=codes, extra=st.integers(0, 7))
def test_codec_loops_native_and_numpy_agree_with_the_definition(v, extra):
    v = v[:len(v) - len(v) % 8]
    t = torch.tensor(v, dtype=torch.int8)
    want_bits = [sum(1 << k for k in range(8) if v[8 * j + k] > 0) for j in range(len(v) // 8)]
    n = max(0, len(v) - extra)
    kernels.load()  # (the helpers use the library only once something has loaded it)
    for native in ("1", "0"):
        os.environ["DLION_NATIVE"] = native
        try:
            packed = kernels.pack_positive(t)
            assert packed.tolist() == want_bits
            assert kernels.unpack_signs(packed, n).tolist() == [1 if x > 0 else -1 for x in v[:n]]
            assert kernels.count_zeros(t) == v.count(0)
        finally:
            del os.environ["DLION_NATIVE"]


def test_sign_and_pack_writes_signs_zeros_between_and_the_payload():
    """The fused contribution of a bucket with a gap (a parameter without gradient), a segment across
    the library's block boundary, padding and stale values: the signs as the eager ops give them, 0
    elsewhere, the packed bits of values > 0 and the zero count, counted here by hand."""
    g = torch.Generator().manual_seed(3)
    sizes, offsets = [5, 70_000, 3, 40_000], [0, 9, 70_012, 70_020]
    padded, numel = 110_040, 110_020
    for dtype in (torch.float32, torch.float64):
        ms = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        gs = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
        ms[1][100] = gs[1][100] = 0.0  # c = 0: an abstention inside a segment
        values = torch.full((padded,), 7, dtype=torch.int8)  # stale: must all be rewritten
        finite, packed, zeros = kernels.sign_and_pack(ms, gs, offsets, 0.9, 0.1, values, numel)
        want = torch.zeros(padded, dtype=torch.int8)
        for m, gg, o in zip(ms, gs, offsets):
            want[o:o + m.numel()] = torch.sign(torch.mul(m, 0.9).add_(torch.mul(gg, 0.1))).to(torch.int8)
        assert finite and torch.equal(values, want)
        bits = [1 if int(v) > 0 else 0 for v in want]
        assert packed.tolist() == [sum(bits[8 * j + k] << k for k in range(8)) for j in range(padded // 8)]
        assert zeros == sum(1 for v in want[:numel].tolist() if v == 0)
        gs[3][39_999] = float("nan")
        finite, _, _ = kernels.sign_and_pack(ms, gs, offsets, 0.9, 0.1, values, numel)
        assert not finite and bool(((values >= -1) & (values <= 1)).all())
    with pytest.raises(ValueError, match="in order"):
        kernels.sign_and_pack(ms[:2][::-1], gs[:2][::-1], offsets[:2][::-1], 0.9, 0.1, values, numel)
    with pytest.raises(ValueError, match="in order"):
        kernels.sign_and_pack(ms[-1:], gs[-1:], [padded - 10], 0.9, 0.1, values, numel)


def _build_and_use(cache: str) -> bool:
    os.environ["DLION_CACHE_DIR"] = cache
    kernels._library = None
    p, m, g = torch.ones(100), torch.zeros(100), torch.ones(100)
    kernels.lion_update_(p, m, g, 0.1, 0.0, 0.9, 0.99)
    return bool(torch.all(p == 0.9)) and kernels.available()


def test_ranks_building_the_library_at_once_all_load_a_whole_one(tmp_path):
    """Several processes (the ranks of a first run) build into one empty cache at the same time:
    each writes its own temporary file and renames it into place, so every one loads a complete
    library, and one file is left."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(4) as pool:
        assert pool.map(_build_and_use, [str(tmp_path)] * 4) == [True] * 4
    assert len(list(tmp_path.glob("kernels-*.so"))) == 1 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_under_a_saved_graph_is_caught_by_autograd_like_any_in_place_op(fused):
    """The native kernels write parameters through raw pointers; they bump the version counter as a
    torch op does, so backward through a graph that saved the old values fails the same way."""
    import dlion

    p = torch.randn(8, requires_grad=True)
    loss = (p * p).sum()  # saves p
    p.grad = torch.ones(8)
    dlion.Lion([p], lr=0.1, fused=fused).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
