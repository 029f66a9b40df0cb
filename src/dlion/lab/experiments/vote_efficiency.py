"""How many workers a majority vote of signs is worth.

Per coordinate, write worker i's pre-sign value as c_i = μ + σ·ε_i with independent
standard-normal ε_i. G-Lion steps by sign(Σ c_i) (along one parameter trajectory the mean of
the workers' c is exactly G-Lion's c: Lion's momentum is linear in the gradients); MaVo steps by
sign(S), S = Σ sign(c_i). With p = P(c_i > 0) ≈ ½ + φ(0)·μ/σ, their expected steps along
sign(μ) are, to first order in a weak signal μ/σ:

    G-Lion, N' workers:  E[Δ] = 2Φ(√N'·μ/σ) − 1     ≈ 2φ(0)·√N'·μ/σ
    MaVo, N workers:     E[Δ] = P(S > 0) − P(S < 0)  ≈ 2φ(0)·κ_N·μ/σ,
                         κ_N = N·C(N−1, ⌊N/2⌋) / 2^(N−1)

(the derivative of the vote's mean in p at p = ½ is 2κ_N). So MaVo at N workers moves like
G-Lion at N' = κ_N² workers: 2.25 at N = 3 and 4, 3.52 at N = 5 and 6, 4.79 at N = 7 and 8,
tending to 2N/π (the sign test's efficiency against the mean under Gaussian noise). An even
N adds nothing over N − 1 in this regime: its extra vote can only turn a win into a tie.

:func:`equivalence` turns that into a prediction a sweep can check: G-Lion's final metric
measured at several N, interpolated linearly in log N at N' = κ_N², against MaVo's at N.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["kappa", "equivalent_workers", "interpolate", "equivalence", "equivalence_lines"]


def kappa(n: int) -> float:
    """κ_N = N·C(N−1, ⌊N/2⌋)/2^(N−1): MaVo's first-order drift in units of one worker's."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"N must be a positive int, got {n!r}")
    return n * math.comb(n - 1, n // 2) / 2 ** (n - 1)


def equivalent_workers(n: int) -> float:
    """N' = κ_N²: the number of G-Lion workers whose sign-of-mean step drifts like MaVo's at N."""
    return kappa(n) ** 2


def interpolate(points: dict, n: float) -> Optional[float]:
    """The value at n of the piecewise-linear interpolation in log N of ``points`` ({N: value});
    None outside the measured range."""
    ns = sorted(points)
    if not ns or not ns[0] <= n <= ns[-1]:
        return None
    return float(np.interp(math.log(n), [math.log(k) for k in ns], [points[k] for k in ns]))


def equivalence(rows: list[dict], vote: str = "dlion_mavo", reference: str = "glion") -> list[dict]:
    """For each N at which ``vote`` ran: N' = κ_N², the reference's final metric interpolated at
    N' (None where N' lies outside the reference's measured N), and the vote's measured metric.
    ``rows`` are :func:`dlion.lab.experiments.plots.summarize` rows (means over seeds)."""
    ref = {r["workers"]: r["mean"] for r in rows if r["method"] == reference and math.isfinite(r["mean"])}
    out = []
    for r in sorted((r for r in rows if r["method"] == vote), key=lambda r: r["workers"]):
        n = r["workers"]
        ne = equivalent_workers(n)
        out.append({"workers": n, "kappa": kappa(n), "equivalent_workers": ne,
                    "predicted": interpolate(ref, ne), "measured": r["mean"], "seeds": r["seeds"],
                    "reference_at_N": ref.get(n)})
    return out


def equivalence_lines(eq: list[dict]) -> list[str]:
    """The equivalence as a Markdown table."""
    if not eq:
        return []
    lines = ["| N | N' = κ_N² | G-Lion at N (measured) | G-Lion at N' (interpolated) = MaVo predicted | "
             "MaVo at N (measured) |", "|---|---|---|---|---|"]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    for e in eq:
        lines.append(f"| {e['workers']} | {e['equivalent_workers']:.2f} | {fmt(e['reference_at_N'])} | "
                     f"{fmt(e['predicted'])} | {e['measured']:.3f} ({e['seeds']}) |")
    return lines
