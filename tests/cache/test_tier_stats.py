"""RateEstimate: a tier's load speed from recent loads; one stall ages out in seconds, even when no
load follows it, and barely moves an estimate fed by steady traffic."""

from __future__ import annotations

import pytest

from cache.tiers.stats import RateEstimate

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def estimate(clock: Clock) -> RateEstimate:
    return RateEstimate(bytes_per_s=500e6, latency_s=2e-3, clock=clock)


def test_the_prior_until_a_sample_arrives() -> None:
    clock = Clock()
    rate = estimate(clock)
    assert (rate.bytes_per_s, rate.latency_s, rate.samples, rate.age_s()) == (500e6, 2e-3, 0, None)
    rate.observe(0, 1.0)  # nothing loaded: not a sample
    rate.observe(MB, 0.0)
    assert rate.samples == 0 and rate.latency_s == 2e-3


def test_samples_move_the_estimate_and_are_counted() -> None:
    clock = Clock()
    rate = estimate(clock)
    for _ in range(20):
        rate.observe(10 * MB, 0.1, ops=10)  # ~100 MB/s, 10 ms per op
        clock.now += 0.05
    assert rate.samples == 20 and rate.age_s() == pytest.approx(0.05)
    assert 100e6 < rate.bytes_per_s < 120e6  # the prior counts as one faint sample
    assert rate.latency_s == pytest.approx(0.01, rel=0.1)


def test_a_stall_ages_out_in_seconds_without_further_loads() -> None:
    clock = Clock()
    rate = estimate(clock)
    rate.observe(4 * MB, 0.004, ops=4)  # a normal load: 1 ms per op, 1 GB/s
    normal = rate.predict_s(4 * MB, 4)
    clock.now += 1.0
    rate.observe(4 * MB, 10.0, ops=4)  # a ten-second stall
    assert rate.predict_s(4 * MB, 4) > 20 * normal  # at once: recompute
    clock.now += 10.0  # no load meanwhile (the estimate chose recompute)
    assert rate.predict_s(4 * MB, 4) < 3 * normal
    assert rate.samples == 2


def test_one_stall_among_steady_loads_barely_moves_the_estimate() -> None:
    clock = Clock()
    rate = estimate(clock)
    for _ in range(50):
        rate.observe(4 * MB, 0.004, ops=4)
        clock.now += 0.1
    steady = rate.latency_s
    rate.observe(4 * MB, 10.0, ops=4)
    for _ in range(20):  # two seconds of normal loads after it
        clock.now += 0.1
        rate.observe(4 * MB, 0.004, ops=4)
    assert rate.latency_s < 1.5 * steady


def test_setting_a_value_pins_it_until_the_next_sample() -> None:
    clock = Clock()
    rate = estimate(clock)
    rate.observe(MB, 1.0)
    rate.bytes_per_s, rate.latency_s = 1e12, 0.0  # what tests and benchmarks do to force loads
    assert (rate.bytes_per_s, rate.latency_s) == (1e12, 0.0)
    rate.observe(MB, 0.001)
    assert 0.0 < rate.latency_s < 0.001
