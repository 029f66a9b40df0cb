"""The vote-efficiency law used to read the MaVo gap (docs/results.md)."""

import math

import pytest
import torch

from dlion.lab.experiments.vote_efficiency import equivalence, equivalent_workers, interpolate, kappa


def test_kappa_literal_values():
    assert [kappa(n) for n in (1, 2, 3, 4, 5, 6, 7, 8)] == [1.0, 1.0, 1.5, 1.5, 1.875, 1.875, 2.1875, 2.1875]
    assert equivalent_workers(4) == 2.25
    with pytest.raises(ValueError):
        kappa(0)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_kappa_is_half_the_slope_of_the_vote_mean(n):
    """E[Δ](p) = Σ_k C(N,k) p^k (1−p)^(N−k) sign(2k − N) for N signs each +1 with probability p;
    its slope at p = ½, by a central difference, is 2κ_N."""
    def mean_vote(p):
        return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) * ((2 * k > n) - (2 * k < n)) for k in range(n + 1))
    h = 1e-6
    slope = (mean_vote(0.5 + h) - mean_vote(0.5 - h)) / (2 * h)
    assert slope == pytest.approx(2 * kappa(n), rel=1e-6)


def test_a_vote_of_gaussian_signs_drifts_like_the_sign_of_the_mean_of_kappa_squared_workers():
    """Monte Carlo, weak signal: E[sign Σ sign(μ + ε_i)] over N = 5 workers equals
    2Φ(κ_5·μ) − 1 (G-Lion at κ_5² = 3.52 workers), not 2Φ(√5·μ) − 1 (G-Lion at 5)."""
    g = torch.Generator().manual_seed(0)
    mu, n, samples = 0.05, 5, 2_000_000
    c = mu + torch.randn(samples, n, generator=g, dtype=torch.float64)
    vote = torch.sign(torch.sign(c).sum(1)).mean().item()
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    assert vote == pytest.approx(2 * phi(kappa(n) * mu) - 1, abs=0.003)   # ≈ 0.0746; one s.e. ≈ 0.0007
    assert abs(vote - (2 * phi(math.sqrt(n) * mu) - 1)) > 0.01           # the mean of 5 would give ≈ 0.0890


def test_interpolation_is_linear_in_log_n():
    pts = {2: 2.0, 4: 1.8, 8: 1.7}
    assert interpolate(pts, 2 * math.sqrt(2)) == pytest.approx(1.9, abs=1e-12)
    assert interpolate(pts, 4) == 1.8 and interpolate(pts, 8) == 1.7
    assert interpolate(pts, 1.5) is None and interpolate(pts, 9) is None


def test_equivalence_rows():
    rows = [{"method": "glion", "workers": 2, "mean": 2.0, "seeds": 1},
            {"method": "glion", "workers": 4, "mean": 1.8, "seeds": 3},
            {"method": "dlion_mavo", "workers": 4, "mean": 1.85, "seeds": 3},
            {"method": "dlion_mavo", "workers": 8, "mean": 1.75, "seeds": 1}]
    eq = equivalence(rows)
    assert [e["workers"] for e in eq] == [4, 8]
    t = math.log(2.25 / 2) / math.log(2)
    assert eq[0]["predicted"] == pytest.approx(2.0 - 0.2 * t, abs=1e-12)
    assert eq[0]["reference_at_N"] == 1.8 and eq[0]["measured"] == 1.85
    assert eq[1]["equivalent_workers"] == 2.1875 ** 2 and eq[1]["predicted"] is None  # 4.79 > 4: outside
