"""The fused CPU kernels against the eager operations they replace, value for value, on
random inputs that include zeros of both signs, infinities, NaN and subnormals."""

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
    out = torch.full((n,), 7, dtype=torch.int8)
    finite = kernels.sign_contribution(m, g, beta, scale, out)
    assert finite == bool(torch.isfinite(c).all())
    if finite:
        assert torch.equal(out, torch.sign(c).to(torch.int8))
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


def test_supported_only_for_cpu_fp32_fp64_of_one_dtype():
    f = torch.zeros(3)
    assert kernels.supported(f, f) and kernels.supported(f.double(), f.double())
    assert not kernels.supported(f.bfloat16(), f.bfloat16())
    assert not kernels.supported(f, f.double())
    assert not kernels.supported(torch.zeros(3, device="meta"))


def test_a_failed_compilation_names_the_option_and_the_way_out(monkeypatch):
    def broken(fn, **kw):
        def raise_(*a):
            raise OSError("no C++ compiler")
        return raise_

    monkeypatch.setattr(torch, "compile", broken)
    kernels._compiled.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="fused=False") as info:
            kernels.momentum_update_(torch.zeros(3), torch.ones(3), 0.9, 0.1)
        assert isinstance(info.value.__cause__, OSError)
    finally:
        kernels._compiled.cache_clear()


def test_past_the_recompile_limit_the_kernels_still_give_the_eager_values():
    """A process that meets many shapes and dtypes (or inherits compiled variants through fork)
    exceeds dynamo's recompile limit; the call must then run the same ops eagerly, not fail."""
    import torch._dynamo

    kernels._compiled.cache_clear()
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            for dtype, n in [(torch.float32, 50), (torch.float64, 50), (torch.float32, 1), (torch.float64, 1)]:
                m, g = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
                m2 = m.clone()
                kernels.momentum_update_(m2, g, 0.99, 0.01)
                assert same(m2, torch.mul(m, 0.99).add_(torch.mul(g, 0.01)))
    finally:
        kernels._compiled.cache_clear()
        torch._dynamo.reset()
