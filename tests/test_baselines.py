"""Baselines of the convergence sweeps: their mechanics on small tensors, their bit
counts against counts written out here, and that each one learns in a short run."""

import math

import pytest
import torch

from dlion.lab.experiments.baselines import (DGC, DGCSGD, GradDrop, MeanFP32, PowerSGD, TernGrad, dgc_density,
                                             dgc_lr_factor, topk_mask)


def test_mean_fp32_is_the_mean_and_costs_a_ring_all_reduce():
    g = [torch.randn(4, 3, 5), torch.randn(4, 7)]
    agg = MeanFP32([torch.Size([3, 5]), torch.Size([7])], 4)
    out = agg(g)
    assert torch.allclose(out[0], g[0].mean(0)) and torch.allclose(out[1], g[1].mean(0))
    # ring all-reduce of 22 fp32 values at N = 4: reduce-scatter + all-gather, 2·3 chunks of 22/4 values
    assert agg.bits.per_param_per_step() == 2 * 3 * (22 / 4) * 32 / 22 == 48.0


# -- TernGrad ---------------------------------------------------------------------------

def test_terngrad_is_unbiased():
    torch.manual_seed(0)
    g = torch.randn(50)
    draws = 4000  # many "workers" with the same gradient = many independent draws
    agg = TernGrad([g.shape], draws, clip=None, seed=1)
    mean = agg([g.expand(draws, 50).clone()])[0]
    s = g.abs().max()
    # each entry: mean of `draws` values in {−s, 0, s} with mean g → sd ≤ s/√draws
    assert (mean - g).abs().max() < 5 * s / math.sqrt(draws)
    # and it is a real average of coins, not g itself: every single draw is a scaled trit
    t, _ = agg.ternarize(g.expand(3, 50).clone())
    assert set(t.unique().tolist()) <= {-1.0, 0.0, 1.0}


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


@pytest.mark.parametrize("N", [2, 4, 8])
def test_terngrad_bits(N):
    shapes = [torch.Size([10, 10]), torch.Size([10])]  # d = 110, T = 2
    agg = TernGrad(shapes, N, seed=0)
    for _ in range(3):
        agg([torch.randn(N, 10, 10), torch.randn(N, 10)])
    d, T = 110, 2
    scales = 2 * (N - 1) / N * 32 * T                     # MAX all-reduce of the two scales
    trits = 8 / 5 * d                                      # 5 trits per byte
    field = {2: 3, 4: 4, 8: 5}[N]                          # sums in [−N, N]: 5, 9, 17 values
    onebit = (N - 1) / N * trits + (N - 1) / N * field * d  # all-to-all of trits + all-gather of sums
    gather = (N - 1) * trits                               # or everyone's trits to everyone
    assert agg.bits.per_param_per_step() == pytest.approx((scales + min(onebit, gather)) / d)
    assert (N == 2) == (gather < onebit)


# -- GradDrop ---------------------------------------------------------------------------

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
    for step in range(5):
        g = torch.randn(N, n)
        if step == 0:  # the first step sends exactly the 10 largest |g| of each worker
            out = agg([g])[0]
            expect = sum(g[i] * topk_mask(g[i:i + 1], 10)[0] for i in range(N)) / N
            assert torch.equal(out, expect)
        else:
            out = agg([g])[0]
        total_g += g
        total_sent += out
    # conservation: what was sent plus what is still held equals all the gradients
    assert torch.allclose(total_sent * N + agg.residuals[0].sum(0), total_g.sum(0), atol=1e-4)
    assert int((agg.residuals[0] != 0).sum()) > 0.9 * N * n  # the residual really is carried
    # all-gather of 10 (value, index) pairs per rank: each rank sends them to N − 1 = 2 others
    assert agg.bits.per_param_per_step() == pytest.approx(2 * 10 * 64 / n)


def test_graddrop_residual_lets_small_coordinates_through_eventually():
    # one coordinate with a small, constant gradient: without the residual it is never sent
    N = 2
    agg = GradDrop([torch.Size([100])], N, density=0.01)
    g = torch.zeros(N, 100)
    g[:, 0] = 1.0       # the big one
    g[:, 1] = 0.3       # small but persistent
    sent1 = []
    for _ in range(5):
        sent1.append(float(agg([g.clone()])[0][1]))
    assert sent1[0] == 0.0 and max(sent1) > 0.0


def test_graddrop_threshold_is_global_over_tensors():
    N = 2
    shapes = [torch.Size([4, 25]), torch.Size([100])]
    agg = GradDrop(shapes, N, density=0.01)  # k = 2 of 200 per worker
    big = torch.randn(N, 4, 25) * 100
    small = torch.randn(N, 100)
    out = agg([big, small])
    assert int((out[0] != 0).sum()) >= 2 and int((out[1] != 0).sum()) == 0  # the small tensor sends nothing
    per_tensor = GradDrop(shapes, N, density=0.01, scope="tensor")
    out = per_tensor([big, small])
    assert int((out[1] != 0).sum()) >= 1


# -- DGC --------------------------------------------------------------------------------

def test_dgc_masks_and_accumulates_exactly():
    torch.manual_seed(0)
    N, m = 2, 0.9
    shape = torch.Size([20, 100])  # n = 2000, k = 2 at 0.1 %
    n, k = 2000, 2
    agg = DGC([shape], N, density=0.001, momentum=m, warmup_steps=0)
    g1 = torch.randn(N, *shape)
    out = agg([g1])[0]
    f1 = g1.reshape(N, n)
    sent_mask = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        sent_mask[i, f1[i].abs().topk(k).indices] = True
    assert torch.equal(out.reshape(-1), (f1 * sent_mask).sum(0) / N)
    # local accumulation keeps the unsent velocity; momentum factor masking clears u where sent
    assert torch.equal(agg.v[0], f1 * ~sent_mask)
    assert torch.equal(agg.u[0], f1 * ~sent_mask)
    g2 = torch.randn(N, *shape)
    out2 = agg([g2])[0].reshape(-1)
    u2 = m * (f1 * ~sent_mask) + g2.reshape(N, n)
    v2 = f1 * ~sent_mask + u2
    mask2 = torch.zeros(N, n, dtype=torch.bool)
    for i in range(N):
        mask2[i, v2[i].abs().topk(k).indices] = True
    assert torch.allclose(out2, (v2 * mask2).sum(0) / N)
    assert torch.allclose(agg.v[0], v2 * ~mask2)
    assert torch.allclose(agg.u[0], u2 * ~mask2)
    # all-gather of k (value, index) pairs per rank to N − 1 = 1 other rank
    assert agg.bits.per_param_per_step() == pytest.approx(1 * k * 64 / n)


def test_dgc_without_momentum_masking_keeps_the_momentum():
    torch.manual_seed(0)
    agg = DGC([torch.Size([10, 10])], 2, density=0.01, momentum=0.9, momentum_masking=False)
    g = torch.randn(2, 10, 10)
    agg([g])
    assert torch.equal(agg.u[0], g.reshape(2, 100))  # u is not cleared where sent
    assert int((agg.v[0] == 0).sum()) == 2           # v is


def test_dgc_sends_one_dimensional_tensors_dense_with_momentum():
    torch.manual_seed(0)
    N, m = 3, 0.9
    shapes = [torch.Size([30, 40]), torch.Size([40])]
    agg = DGC(shapes, N, density=0.001, momentum=m)
    assert agg.compressed == [True, False]
    M = torch.zeros(40)
    for _ in range(3):
        g = [torch.randn(N, 30, 40), torch.randn(N, 40)]
        out = agg(g)
        M = m * M + g[1].mean(0)
        assert torch.allclose(out[1], M)               # dense, with momentum on the mean
        assert int((out[0] != 0).sum()) <= N * 2       # the matrix stays sparse (k = 2 per worker)
    # counted: sparse part all-gather of 2 pairs to N − 1 ranks, bias a fp32 ring all-reduce
    sparse = (N - 1) * 2 * 64
    dense = 2 * (N - 1) / N * 40 * 32
    assert agg.bits.per_param_per_step() == pytest.approx((sparse + dense) / 1240)
    # the old behaviour (biases compressed too) is still available and differs: the bias is
    # sparsified like the matrix (top-k, k = ⌈0.001·40⌉ = 1 per worker), not averaged with momentum
    old = DGC(shapes, N, density=0.001, momentum=m, dense_1d=False)
    assert old.compressed == [True, True]
    torch.manual_seed(1)
    M = torch.zeros(40)
    for _ in range(3):
        g = [torch.randn(N, 30, 40), torch.randn(N, 40)]
        out = old(g)
        M = m * M + g[1].mean(0)
        assert 1 <= int((out[1] != 0).sum()) <= N  # k = 1 per worker
        assert not torch.allclose(out[1], M)
    # counted: one all-gather of 2 + 1 pairs per worker to N − 1 ranks, nothing dense
    assert old.bits.per_param_per_step() == pytest.approx((N - 1) * (2 + 1) * 64 / 1240)


def test_dgc_at_density_one_is_momentum_sgd_exactly():
    torch.manual_seed(0)
    N, lr, m = 4, 0.05, 0.9
    w0 = [torch.randn(6, 5), torch.randn(5)]
    a = [w.clone() for w in w0]
    b = [w.clone().requires_grad_(True) for w in w0]
    agg = DGC([w.shape for w in w0], N, density=1.0, momentum=m)
    opt_a = DGCSGD(a, lr=lr, momentum=m)
    opt_b = torch.optim.SGD(b, lr=lr, momentum=m)
    for _ in range(10):
        g = [torch.randn(N, *w.shape) for w in w0]
        for p, o in zip(a, agg(g)):
            p.grad = o
        opt_a.step()
        for p, gi in zip(b, g):
            p.grad = gi.mean(0)
        opt_b.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y.detach(), rtol=1e-6, atol=1e-6)


def test_dgc_local_clipping_scales_each_worker_to_its_share():
    N = 4
    agg = DGC([torch.Size([100])], N, density=1.0, momentum=0.0, clip_norm=1.0)
    g = torch.zeros(N, 100)
    g[0] = 10.0          # norm 100 → clipped to 1/√4 = 0.5
    g[1, 0] = 0.1        # norm 0.1 → untouched
    out = agg([g])[0]
    expect = (g[0] * 0.5 / (100 + 1e-6) + g[1]) / N
    assert torch.allclose(out, expect)
    assert torch.allclose(DGC([torch.Size([100])], N, density=1.0, momentum=0.0)([g])[0], g.mean(0))


def test_dgc_warmup_schedules_follow_the_reference():
    c = 0.001 ** (1 / 5)
    assert [dgc_density(s, 0.001, 100) for s in (0, 25, 50, 99)] == pytest.approx([c, c ** 2, c ** 3, c ** 4])
    assert [round(dgc_density(s, 0.001, 100), 4) for s in (0, 25, 50, 75)] == [0.2512, 0.0631, 0.0158, 0.004]
    assert dgc_density(100, 0.001, 100) == 0.001
    assert dgc_density(0, 0.001, 0) == 0.001
    assert dgc_density(0, 0.05, 100) == pytest.approx(0.05 ** 0.2)
    # the lr: lr/N → lr linearly (Goyal et al.'s gradual warm-up, as the reference script does it)
    assert dgc_lr_factor(0, 100, 4) == 0.25
    assert dgc_lr_factor(50, 100, 4) == pytest.approx((0.5 * 3 + 1) / 4)
    assert dgc_lr_factor(100, 100, 4) == 1.0


def test_dgc_sgd_decays_weights_with_momentum():
    p = torch.ones(3, requires_grad=True)
    opt = DGCSGD([p], lr=0.1, momentum=0.5, weight_decay=0.2)
    p.grad = torch.zeros(3)
    opt.step()   # B = 0.2·1 → p = 1 − 0.1·0.2 = 0.98
    assert torch.allclose(p.detach(), torch.full((3,), 0.98))
    opt.step()   # B = 0.5·0.2 + 0.2·0.98 = 0.296 → p = 0.98 − 0.0296
    assert torch.allclose(p.detach(), torch.full((3,), 0.98 - 0.0296))


# -- PowerSGD ---------------------------------------------------------------------------

def test_powersgd_full_rank_is_the_exact_mean():
    torch.manual_seed(0)
    N = 3
    shapes = [torch.Size([6, 4]), torch.Size([5, 2, 3]), torch.Size([7])]
    agg = PowerSGD(shapes, N, rank=6, min_compression_rate=0)
    # with no minimum compression rate even the vector is "compressed" (as a 7 × 1 matrix), as in the hook
    assert [c for *_, c in agg.plan] == [True, True, True]
    for _ in range(3):
        g = [torch.randn(N, *s) for s in shapes]
        for o, gi in zip(agg(g), g):
            torch.testing.assert_close(o, gi.mean(0), rtol=1e-4, atol=1e-5)
    # each worker keeps x_i − mean (as the hook does), nothing of the mean is left over
    assert agg.error.mean(0).abs().max() < 1e-4 and agg.error.abs().max() > 0.1


def test_powersgd_low_rank_is_rank_r_and_carries_the_error_exactly():
    torch.manual_seed(0)
    N, r = 4, 1
    shapes = [torch.Size([8, 6]), torch.Size([6])]
    gs = [[torch.randn(N, *s) for s in shapes] for _ in range(6)]
    agg = PowerSGD(shapes, N, rank=r)
    total_out = [torch.zeros(s) for s in shapes]
    for g in gs:
        out = agg(g)
        assert torch.linalg.matrix_rank(out[0]) == r
        # the vector is averaged in fp32; its error terms (x_i − mean) cancel in the mean
        torch.testing.assert_close(out[1], g[1].mean(0), rtol=1e-5, atol=1e-5)
        for t, o in zip(total_out, out):
            t += o
    # error feedback telescopes: Σ_t x̂_t + mean_i e_i = Σ_t mean_i g_i, exactly up to rounding
    total_g = [sum(g[k] for g in gs).mean(0) for k in range(2)]
    err = agg.error.split([48, 6], 1)
    for t_o, e, t_g, s in zip(total_out, err, total_g, shapes):
        torch.testing.assert_close(t_o + e.mean(0).reshape(s), t_g, rtol=1e-4, atol=1e-4)
    assert agg.error[:, :48].abs().max() > 0.1  # a real residual, not a trivial zero
    # without error feedback nothing is carried and the sums drift apart
    no_ef = PowerSGD(shapes, N, rank=r, use_error_feedback=False)
    total = sum(no_ef(g)[0] for g in gs)
    assert no_ef.error is None and (total - total_g[0]).abs().max() > 0.1


def test_powersgd_warm_start_is_power_iteration():
    # the same matrix every step, no error feedback: with warm start P, Q converge to the
    # best rank-1 approximation (one power-iteration step per step); cold, every step is
    # one step from a random Q
    torch.manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(12, 12))
    V, _ = torch.linalg.qr(torch.randn(9, 9))
    S = torch.tensor([5.0, 2.0, 1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01])
    M = U[:, :9] @ torch.diag(S) @ V.T
    best = S[0] * torch.outer(U[:, 0], V[:, 0])
    g = [M.expand(2, 12, 9).clone()]
    warm = PowerSGD([M.shape], 2, rank=1, use_error_feedback=False)
    cold = PowerSGD([M.shape], 2, rank=1, use_error_feedback=False, warm_start=False)
    for _ in range(20):
        a, b = warm(g)[0], cold(g)[0]
    assert (a - best).abs().max() < 1e-4
    assert (b - best).abs().max() > 1e-2
    assert cold.q_memory is None and warm.q_memory[0].shape == (1, 9, 1)


def test_powersgd_bits():
    N = 4
    shapes = [torch.Size([25, 1, 5]), torch.Size([25]), torch.Size([10, 125])]
    d = 125 + 25 + 1250
    for r, expect_pq in [(1, (25 + 5) * 1 + (10 + 125) * 1), (2, (25 + 5) * 2 + (10 + 125) * 2),
                         (4, (10 + 125) * 4)]:
        agg = PowerSGD(shapes, N, rank=r)
        agg([torch.randn(N, *s) for s in shapes])
        # the (25, 5) matrix is not worth compressing at rank 4: (25 + 5)·4·2 ≥ 125
        dense = 25 + (125 if r == 4 else 0)
        expect = 2 * (N - 1) / N * 32 * (expect_pq + dense) / d
        assert agg.bits.per_param_per_step() == pytest.approx(expect)
    warm = PowerSGD(shapes, N, rank=1, start_iter=1)
    warm([torch.randn(N, *s) for s in shapes])
    assert warm.bits.per_param_per_step() == pytest.approx(48.0)  # plain fp32 all-reduce before start_iter


# -- misc -------------------------------------------------------------------------------

def test_shapes_are_checked():
    with pytest.raises(ValueError):
        MeanFP32([torch.Size([3])], 4)([torch.randn(3, 3)])


# -- PowerSGD against PyTorch's powerSGD_hook on real Gloo ranks ---------------------------

PSGD_SHAPES = [torch.Size([40, 16]), torch.Size([5]), torch.Size([8, 6, 4]), torch.Size([40, 16]), torch.Size([30, 20])]
PSGD_STEPS = 6


def _psgd_grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=g) for s in PSGD_SHAPES]


class _Bucket:
    """The part of ``dist.GradBucket`` that powerSGD_hook uses: one bucket holding every tensor."""

    def __init__(self, flat):
        self.flat = flat

    def buffer(self):
        return self.flat

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        sizes = [s.numel() for s in PSGD_SHAPES]
        return [v.view(s) for v, s in zip(self.flat.split(sizes), PSGD_SHAPES)]


def _psgd_hook_worker(rank, world, r):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    state = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=r, start_powerSGD_iter=2,
                          random_seed=7)
    outs, errors = [], []
    for step in range(PSGD_STEPS):
        flat = torch.cat([g.reshape(-1) for g in _psgd_grads(rank, step)])
        out = powerSGD_hook(state, _Bucket(flat)).wait()
        outs.append(out.clone())
        errors.append(state.error_dict[0].clone() if 0 in state.error_dict else None)
    return outs, errors


@pytest.mark.parametrize("r", [1, 2, 4])
def test_powersgd_matches_the_pytorch_hook_on_two_gloo_ranks(r):
    from dlion.lab.spawn import spawn

    world = 2
    results = spawn(_psgd_hook_worker, world, r, timeout_s=60)
    sim = PowerSGD(PSGD_SHAPES, world, rank=r, start_iter=2, random_seed=7)
    assert sum(c for *_, c in sim.plan) >= 3  # several compressed matrices, two of one shape
    for step in range(PSGD_STEPS):
        grads = [torch.stack(gs) for gs in zip(*(_psgd_grads(i, step) for i in range(world)))]
        out = torch.cat([o.reshape(-1) for o in sim(grads)])
        for rank, (outs, errors) in enumerate(results):
            torch.testing.assert_close(outs[step], out, rtol=1e-5, atol=1e-6)
            if step >= 2:
                torch.testing.assert_close(errors[step], sim.error[rank], rtol=1e-5, atol=1e-6)
            else:
                assert errors[step] is None  # plain all-reduce before start_powerSGD_iter
