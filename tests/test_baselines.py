"""Baselines of the convergence sweeps: their mechanics and their bit counts."""

import math

import pytest
import torch

from dlion.lab.experiments.baselines import DGC, GradDrop, MeanFP32, TernGrad, dgc_density, topk_mask


def test_mean_fp32_is_the_mean_and_costs_64_bits():
    g = [torch.randn(4, 3, 5), torch.randn(4, 7)]
    agg = MeanFP32([torch.Size([3, 5]), torch.Size([7])], 4)
    out = agg(g)
    assert torch.allclose(out[0], g[0].mean(0)) and torch.allclose(out[1], g[1].mean(0))
    assert agg.bits.per_param_per_step() == (32.0, 32.0)


def test_terngrad_is_unbiased():
    torch.manual_seed(0)
    g = torch.randn(50)
    draws = 4000  # many "workers" with the same gradient = many independent draws
    agg = TernGrad([g.shape], draws, clip=None, seed=1)
    mean = agg([g.expand(draws, 50).clone()])[0]
    s = g.abs().max()
    # each entry: mean of `draws` values in {−s, 0, s} with mean g → sd ≤ s/√draws
    assert (mean - g).abs().max() < 5 * s / math.sqrt(draws)


def test_terngrad_values_are_scaled_trits_and_the_scale_is_shared():
    torch.manual_seed(0)
    agg = TernGrad([torch.Size([6, 6])], 3, clip=None, seed=0)
    g = torch.randn(3, 6, 6)
    g[1] *= 10
    t, s = agg.ternarize(g)
    assert set(t.unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.all(s == g.abs().max())  # scaler sharing: the max over all workers
    # a coordinate is never sent with the wrong sign
    assert torch.all(t * g >= 0)


def test_terngrad_clipping_bounds_the_gradient():
    agg = TernGrad([torch.Size([1000])], 2, clip=2.5, seed=0)
    g = torch.randn(2, 1000)
    g[0, 0] = 1000.0
    _, s = agg.ternarize(g)
    assert float(s.max()) < 1000.0


def test_terngrad_bits():
    shapes = [torch.Size([10, 10]), torch.Size([10])]
    agg = TernGrad(shapes, 8, seed=0)
    for _ in range(3):
        agg([torch.randn(8, 10, 10), torch.randn(8, 10)])
    up, down = agg.bits.per_param_per_step()
    assert up == pytest.approx(math.log2(3) + 32 * 2 / 110)
    assert down == pytest.approx(math.log2(17) + 32 * 2 / 110)


def test_topk_mask_keeps_exactly_k_per_row():
    x = torch.randn(5, 100)
    m = topk_mask(x, 7)
    assert m.sum(1).tolist() == [7] * 5
    kept_min = torch.where(m, x.abs(), torch.inf).min(1).values
    dropped_max = torch.where(~m, x.abs(), -torch.inf).max(1).values
    assert torch.all(kept_min >= dropped_max)


def test_graddrop_keeps_one_percent_and_carries_the_rest():
    torch.manual_seed(0)
    N, n = 3, 1000
    agg = GradDrop([torch.Size([n])], N, density=0.01)
    total_g = torch.zeros(N, n)
    total_sent = torch.zeros(n)
    for _ in range(5):
        g = torch.randn(N, n)
        total_g += g
        out = agg([g])[0]
        total_sent += out
    # conservation: what was sent plus what is still held equals all the gradients
    assert torch.allclose(total_sent * N + agg.residuals[0].sum(0), total_g.sum(0), atol=1e-4)
    # exactly k = 10 coordinates per worker per step → upload 64·10/1000 bits
    up, down = agg.bits.per_param_per_step()
    assert up == pytest.approx(64 * 10 / n)
    assert 64 * 10 / n <= down <= N * 64 * 10 / n


def test_dgc_keeps_exactly_k_and_accumulates_the_rest():
    torch.manual_seed(0)
    N, n, m = 2, 2000, 0.9
    agg = DGC([torch.Size([n])], N, density=0.001, momentum=m, warmup_steps=0)
    g1 = torch.randn(N, n)
    out = agg([g1])[0]
    k = 2
    sent_mask = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        idx = g1[i].abs().topk(k).indices
        sent_mask[i, idx] = True
    assert torch.allclose(out * N, (g1 * sent_mask).sum(0))
    # local accumulation keeps the unsent velocity; momentum factor masking clears u where sent
    assert torch.allclose(agg.v[0], g1 * ~sent_mask)
    assert torch.allclose(agg.u[0], g1 * ~sent_mask)
    g2 = torch.randn(N, n)
    agg([g2])
    u2 = m * (g1 * ~sent_mask) + g2
    v2 = g1 * ~sent_mask + u2
    assert int((agg.v[0] != 0).sum(1).min()) == n - k  # exactly k more were sent
    sent2 = v2 - agg.v[0]
    assert torch.all((sent2 != 0).sum(1) == k)
    up, _ = agg.bits.per_param_per_step()
    assert up == pytest.approx(64 * k / n)


def test_dgc_with_full_density_is_plain_averaged_sgd():
    agg = DGC([torch.Size([10])], 3, density=1.0, warmup_steps=0)
    for _ in range(3):
        g = torch.randn(3, 10)
        assert torch.allclose(agg([g])[0], g.mean(0))


def test_dgc_warmup_schedule():
    assert dgc_density(0, 0.001, 100) == 0.25
    assert dgc_density(25, 0.001, 100) == 0.0625
    assert dgc_density(50, 0.001, 100) == 0.25 ** 3
    assert dgc_density(99, 0.001, 100) == 0.25 ** 4
    assert dgc_density(100, 0.001, 100) == 0.001
    assert dgc_density(0, 0.001, 0) == 0.001


def test_shapes_are_checked():
    with pytest.raises(ValueError):
        MeanFP32([torch.Size([3])], 4)([torch.randn(3, 3)])
