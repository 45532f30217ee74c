"""The two-sample Kolmogorov–Smirnov test, for timing audits (app/audit.py and
tests/app/test_timing_audit.py): does one sample of times to first token come from another
distribution than a second one?

D is the largest gap between the two empirical distribution functions; the p-value is
Kolmogorov's asymptotic distribution at ``λ = (√n_e + 0.12 + 0.11/√n_e)·D`` with
``n_e = n·m/(n+m)`` (Stephens' small-sample correction, as in Numerical Recipes' ``kstwo``)::

    Q(λ) = 2 Σ_{k≥1} (−1)^{k−1} exp(−2k²λ²)

It is conservative for ties and for samples of a few dozen, which is the direction a check that
must not cry wolf wants. No scipy: numpy does the sorting and counting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def ks_statistic(x: Sequence[float], y: Sequence[float]) -> float:
    """The largest distance between the empirical CDFs of ``x`` and ``y`` (0 to 1)."""
    if not len(x) or not len(y):
        raise ValueError("both samples need at least one value")
    xs, ys = np.sort(np.asarray(x, dtype=float)), np.sort(np.asarray(y, dtype=float))
    points = np.concatenate([xs, ys])
    cdf_x = np.searchsorted(xs, points, side="right") / len(xs)
    cdf_y = np.searchsorted(ys, points, side="right") / len(ys)
    return float(np.max(np.abs(cdf_x - cdf_y)))


def kolmogorov_q(lam: float, terms: int = 100) -> float:
    """Q(λ): the probability that Kolmogorov's statistic exceeds ``lam`` (1 for small ``lam``,
    where the series converges too slowly to be summed and the answer is 1 to many digits)."""
    if lam < 0.2:
        return 1.0
    total = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, terms + 1))
    return min(1.0, max(0.0, total))


def ks_2samp(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(D, p) of the two-sample KS test of ``x`` against ``y``; a small p says they differ."""
    d = ks_statistic(x, y)
    n, m = len(x), len(y)
    en = math.sqrt(n * m / (n + m))
    return d, kolmogorov_q((en + 0.12 + 0.11 / en) * d)


@dataclass(slots=True)
class TimingCheck:
    """One KS test of two TTFT samples, and whether it came out as it must: no signal (p above
    ``alpha``) where the two sides must look alike, a signal where they must differ."""

    d: float
    p: float
    samples: int
    median_s: tuple[float, float]  # (first side, second side)
    runs: int  # 1, or 2 when a failed first run was repeated with new samples
    passed: bool


def timing_check(x: Sequence[float], y: Sequence[float], must_differ: bool, alpha: float = 0.01,
                 runs: int = 1) -> TimingCheck:
    """KS-test ``x`` against ``y``: passed when p < ``alpha`` if they ``must_differ``, else p > ``alpha``."""
    d, p = ks_2samp(x, y)
    medians = (round(float(np.median(x)), 6), round(float(np.median(y)), 6))
    return TimingCheck(d=round(d, 4), p=float(f"{p:.4g}"), samples=len(x), median_s=medians, runs=runs,
                       passed=p < alpha if must_differ else p > alpha)
