"""Per-tenant admission limits on a fake clock: bursts, exact retry times, refill, concurrency
slots released exactly once, tenants independent, limits changed by a reload."""

from __future__ import annotations

import pytest

from tenants.limits import RateLimiter, Refusal, Slot, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refusal_with_the_exact_wait_then_refill() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TenantLimits(requests_per_s=2.0, burst=3)
    assert all(isinstance(limiter.acquire("a", limits), Slot) for _ in range(3))
    refused = limiter.acquire("a", limits)
    assert isinstance(refused, Refusal) and refused.limit == "requests_per_s"
    assert refused.retry_after_s == pytest.approx(0.5)
    assert "2 requests per second" in refused.message and "Retry after 1 s" in refused.message
    clock.now += 0.5
    assert isinstance(limiter.acquire("a", limits), Slot)
    assert isinstance(limiter.acquire("a", limits), Refusal)
    clock.now += 10  # refills up to the burst, never beyond
    assert sum(isinstance(limiter.acquire("a", limits), Slot) for _ in range(5)) == 3


def test_tokens_per_minute_counts_prompt_and_output_budget() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TenantLimits(tokens_per_min=600)  # 10 tokens per second
    assert isinstance(limiter.acquire("a", limits, tokens=500), Slot)
    refused = limiter.acquire("a", limits, tokens=200)
    assert isinstance(refused, Refusal) and refused.limit == "tokens_per_min"
    assert refused.retry_after_s == pytest.approx(10.0)  # 100 missing at 10/s
    clock.now += 10
    assert isinstance(limiter.acquire("a", limits, tokens=200), Slot)


def test_concurrency_slots_are_released_once() -> None:
    limiter = RateLimiter(Clock())
    limits = TenantLimits(max_concurrent=2)
    first, second = limiter.acquire("a", limits), limiter.acquire("a", limits)
    assert isinstance(first, Slot) and isinstance(second, Slot)
    refused = limiter.acquire("a", limits)
    assert isinstance(refused, Refusal) and refused.limit == "max_concurrent" and refused.retry_after_s > 0
    first.release()
    first.release()  # harmless: still one free slot, not two
    assert limiter.running("a") == 1
    third = limiter.acquire("a", limits)
    assert isinstance(third, Slot)
    assert isinstance(limiter.acquire("a", limits), Refusal)
    second.release()
    third.release()
    assert limiter.running("a") == 0


def test_tenants_are_independent_and_unlimited_by_default() -> None:
    limiter = RateLimiter(Clock())
    strict = TenantLimits(requests_per_s=1.0)
    assert isinstance(limiter.acquire("a", strict), Slot)
    assert isinstance(limiter.acquire("a", strict), Refusal)
    assert isinstance(limiter.acquire("b", strict), Slot)
    assert all(isinstance(limiter.acquire("c", TenantLimits()), Slot) for _ in range(1000))


def test_new_limits_apply_to_the_next_request_and_state_survives() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    assert isinstance(limiter.acquire("a", TenantLimits(requests_per_s=1.0, burst=2)), Slot)
    # a reload lowers the burst: the level is capped, the bucket is not refilled
    assert isinstance(limiter.acquire("a", TenantLimits(requests_per_s=1.0, burst=1)), Slot)
    assert isinstance(limiter.acquire("a", TenantLimits(requests_per_s=1.0, burst=1)), Refusal)
    # limits removed by a reload: admitted at once
    assert isinstance(limiter.acquire("a", TenantLimits()), Slot)


def test_a_reload_keeps_what_was_refilled_at_the_old_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    fast, slow = TenantLimits(requests_per_s=1.0, burst=2), TenantLimits(requests_per_s=0.1, burst=2)
    assert all(isinstance(limiter.acquire("a", fast), Slot) for _ in range(2))
    clock.now += 0.5  # half a request refilled at 1/s
    refused = limiter.acquire("a", slow)
    assert isinstance(refused, Refusal) and refused.retry_after_s == pytest.approx(5.0)  # the other half at 0.1/s


def test_a_request_bigger_than_the_token_budget_waits_for_a_full_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TenantLimits(tokens_per_min=60)  # 1 token per second
    assert isinstance(limiter.acquire("a", limits, tokens=100), Slot)  # a full bucket: admitted, emptied
    refused = limiter.acquire("a", limits, tokens=100)
    assert isinstance(refused, Refusal) and refused.retry_after_s == pytest.approx(60.0)
    assert "60 tokens per minute" in refused.message
    clock.now += 60
    assert isinstance(limiter.acquire("a", limits, tokens=100), Slot)


def test_a_refused_request_takes_nothing() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TenantLimits(requests_per_s=1.0, burst=1, tokens_per_min=60, max_concurrent=1)
    first = limiter.acquire("a", limits, tokens=60)
    assert isinstance(first, Slot)
    busy = limiter.acquire("a", limits, tokens=1)
    assert isinstance(busy, Refusal) and busy.limit == "max_concurrent" and busy.retry_after_s >= 1
    first.release()
    early = limiter.acquire("a", limits, tokens=1)
    assert isinstance(early, Refusal) and early.limit == "requests_per_s"
    assert early.retry_after_s == pytest.approx(1.0)
    clock.now += 1  # one request and one token refilled
    costly = limiter.acquire("a", limits, tokens=30)
    assert isinstance(costly, Refusal) and costly.limit == "tokens_per_min"
    assert costly.retry_after_s == pytest.approx(29.0)
    assert isinstance(limiter.acquire("a", limits, tokens=1), Slot)  # the refusals took no request, no token
    assert limiter.running("a") == 1


def test_the_wait_is_never_zero() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = TenantLimits(requests_per_s=1000.0, burst=1)
    assert isinstance(limiter.acquire("a", limits), Slot)
    clock.now += 0.000999
    refused = limiter.acquire("a", limits)
    assert isinstance(refused, Refusal) and 0 < refused.retry_after_s < 0.001
    assert "Retry after 1 s" in refused.message


@pytest.mark.parametrize("kwargs", [{"requests_per_s": 0}, {"requests_per_s": -1.0}, {"max_concurrent": 0},
                                    {"tokens_per_min": True}, {"burst": 3}, {"requests_per_s": float("inf")},
                                    {"requests_per_s": float("nan")}, {"max_concurrent": "2"}])
def test_invalid_limits_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        TenantLimits(**kwargs)
