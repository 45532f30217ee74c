"""The two-sample KS test of app/ks.py, from a table: exact statistics, the asymptotic p-value
against Kolmogorov's series computed by hand, and which way a timing check passes."""

from __future__ import annotations

import math

import pytest

from app.ks import kolmogorov_q, ks_2samp, ks_statistic, timing_check


@pytest.mark.parametrize(("x", "y", "d"), [
    ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 0.0),
    ([1.0, 2.0], [3.0, 4.0], 1.0),
    ([1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0], 0.5),
    ([1.0, 1.0, 1.0, 2.0], [1.0, 2.0, 2.0, 2.0], 0.5),  # ties count on both sides at once
    ([0.5], [0.1, 0.2, 0.3, 0.9], 0.75),
])
def test_the_statistic_is_the_largest_gap_between_the_two_cdfs(x: list[float], y: list[float], d: float) -> None:
    assert ks_statistic(x, y) == pytest.approx(d) == ks_statistic(y, x)


def test_the_p_value_is_kolmogorovs_series_with_stephens_correction() -> None:
    d, p = ks_2samp([float(i) for i in range(10)], [float(i) + 10 for i in range(10)])
    lam = (math.sqrt(5) + 0.12 + 0.11 / math.sqrt(5)) * 1.0
    assert d == 1.0 and p == pytest.approx(2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam)
                                                   for k in range(1, 50)))
    assert p == pytest.approx(1.87e-5, rel=0.01)
    assert kolmogorov_q(0.1) == 1.0 and kolmogorov_q(1.36) == pytest.approx(0.0495, abs=5e-4)  # the 5 % point
    with pytest.raises(ValueError):
        ks_statistic([], [1.0])


def test_a_timing_check_passes_on_no_signal_or_on_a_signal_as_asked() -> None:
    fast, slow = [0.001 * (1 + i % 5) for i in range(24)], [0.010 * (1 + i % 5) for i in range(24)]
    alike = timing_check(fast, list(reversed(fast)), must_differ=False)
    assert alike.passed and alike.p == 1.0 and alike.samples == 24
    apart = timing_check(fast, slow, must_differ=True, runs=2)
    assert apart.passed and apart.p < 0.01 and apart.median_s == (0.003, 0.03) and apart.runs == 2
    assert not timing_check(fast, slow, must_differ=False).passed
