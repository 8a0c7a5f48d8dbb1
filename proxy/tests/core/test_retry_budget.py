"""The retry budget: a share of the requests, plus a floor per second, over a window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.retry_budget import RetryBudget


def test_the_floor_alone_allows_min_per_second_times_ttl() -> None:
    budget = RetryBudget(0.2, 10, 10.0, now=0.0)
    allowed = sum(budget.withdraw(0.5) for _ in range(200))
    assert allowed == 100  # 10/s for 10 s, with no request at all


def test_requests_earn_their_ratio_of_retries() -> None:
    budget = RetryBudget(0.2, 0, 10.0, now=0.0)
    for _ in range(100):
        budget.deposit(1.0)
    assert sum(budget.withdraw(1.0) for _ in range(50)) == 20


def test_what_was_earned_and_spent_is_forgotten_after_the_ttl() -> None:
    budget = RetryBudget(0.2, 1, 10.0, now=0.0)
    assert sum(budget.withdraw(0.0) for _ in range(50)) == 10  # the floor: 1/s for 10 s
    assert not budget.withdraw(5.0)  # spent; the window still holds the withdrawals
    assert budget.withdraw(11.0)  # they expired: the floor is back


def test_when_everything_fails_retries_stay_within_the_budget() -> None:
    """Every request fails and wants retrying: retries stay near ratio x requests + floor."""
    budget = RetryBudget(0.2, 10, 10.0, now=0.0)
    retries = requests = 0
    for i in range(10_000):  # 1,000 requests a second for 10 s
        now = i / 1000
        budget.deposit(now)
        requests += 1
        retries += budget.withdraw(now)
    assert retries <= 0.2 * requests + 10 * 10 + 1
    assert retries >= 0.2 * requests * 0.9


@given(st.lists(st.tuples(st.floats(0, 1000), st.booleans()), max_size=200))
def test_the_balance_never_goes_below_what_a_refusal_leaves(
    events: list[tuple[float, bool]],
) -> None:
    budget = RetryBudget(0.2, 10, 10.0, now=0.0)
    now = 0.0
    for delta, is_request in events:
        now += delta % 3
        if is_request:
            budget.deposit(now)
        elif not budget.withdraw(now):
            assert budget.balance(now) < 1.0
        assert budget.balance(now) >= -1.0


def test_out_of_range_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        RetryBudget(0.2, 10, 0.5, now=0.0)
