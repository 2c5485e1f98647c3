"""Retry budget and completion rate, driven by a fake clock."""

from __future__ import annotations

from router.budget import RetryBudget
from router.health import CompletionRate


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spend_all(budget: RetryBudget, most: int = 1000) -> int:
    """Spend until refused; how many were granted (bounded: a budget that never refuses fails)."""
    for spent in range(most):
        if not budget.try_spend():
            return spent
    raise AssertionError(f"the budget granted {most} retries without refusing one")


def test_retries_are_bounded_by_a_share_of_requests() -> None:
    clock = FakeClock()
    budget = RetryBudget(0.2, clock, reserve_per_s=0.0, cap=50.0)
    # The initial reserve is spent first...
    assert spend_all(budget) > 0
    # ...then 100 requests buy 20 retries, not more.
    for _ in range(100):
        budget.deposit()
    assert spend_all(budget) == 20


def test_reserve_refills_with_time_up_to_the_cap() -> None:
    clock = FakeClock()
    budget = RetryBudget(0.0, clock, reserve_per_s=2.0, cap=5.0)
    assert spend_all(budget) > 0
    assert not budget.try_spend()
    clock.now += 1.0
    assert budget.try_spend() and budget.try_spend()
    assert not budget.try_spend()
    clock.now += 3600
    spent = sum(budget.try_spend() for _ in range(100))
    assert spent == 5


def test_completion_rate_and_retry_after() -> None:
    clock = FakeClock()
    rate = CompletionRate(clock, window_s=10.0)
    assert rate.retry_after_s(5) == 5  # unknown rate: a fixed guess
    for i in range(20):
        clock.now = 1000.0 + i * 0.5
        rate.record()
    assert rate.per_second() == 2.0
    assert rate.retry_after_s(1) == 1
    assert rate.retry_after_s(9) == 5  # 9 ahead at 2/s
    assert rate.retry_after_s(10_000) == 60  # capped
    clock.now += 30  # the window empties
    assert rate.per_second() == 0.0
