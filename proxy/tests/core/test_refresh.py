"""Certificate refresh timing: renew at 70 % of what is left, within [10 s, 24 h]; retry ≤ 10 s."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core import refresh

HOUR = 3600.0
NOW = 1_700_000_000.0
times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize(
    ("lifetime", "delay"),
    [
        (24 * HOUR + 20, 0.7 * (24 * HOUR + 20)),  # a fresh 24 h leaf: renewed after ~16.8 h
        (100.0, 70.0),
        (10 / 0.7, 10.0),  # exactly where the floor starts
        (5.0, 10.0),  # short-lived: never sooner than 10 s
        (0.0, 10.0),
        (-50.0, 10.0),  # already expired (clock skew): still 10 s, not a tight loop
        (48 * HOUR, 24 * HOUR),  # long-lived: at least once a day
    ],
)
def test_renewal_at_70_percent_of_the_remaining_lifetime(lifetime: float, delay: float) -> None:
    assert refresh.renew_in(NOW + lifetime, NOW) == pytest.approx(delay)


def test_a_24h_certificate_is_renewed_again_at_70_percent_of_what_is_left() -> None:
    valid_until = NOW + 24 * HOUR
    first = refresh.renew_in(valid_until, NOW)
    second = refresh.renew_in(valid_until, NOW + first)
    assert first == pytest.approx(0.7 * 24 * HOUR)
    assert second == pytest.approx(0.7 * 0.3 * 24 * HOUR)


@given(valid_until=times, now=times)
def test_renewal_delay_is_always_between_10s_and_24h(valid_until: float, now: float) -> None:
    assert refresh.MIN_REFRESH <= refresh.renew_in(valid_until, now) <= refresh.MAX_REFRESH


@given(now=times, remaining=st.floats(min_value=10 / 0.7, max_value=24 * HOUR / 0.7))
def test_renewal_delay_is_70_percent_inside_the_bounds(now: float, remaining: float) -> None:
    assert refresh.renew_in(now + remaining, now) == pytest.approx(0.7 * remaining, abs=1e-5)


@given(now=times, a=st.floats(-1e6, 1e6), b=st.floats(-1e6, 1e6))
def test_more_remaining_lifetime_never_renews_sooner(now: float, a: float, b: float) -> None:
    short, long = sorted((a, b))
    assert refresh.renew_in(now + short, now) <= refresh.renew_in(now + long, now)


def test_retry_ceiling_doubles_from_half_a_second_up_to_10s() -> None:
    ceilings = [refresh.retry_ceiling(n) for n in range(1, 9)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


@given(failures=st.integers(min_value=1, max_value=10**6), seed=st.integers())
def test_retry_delay_is_jittered_and_never_above_10s(failures: int, seed: int) -> None:
    delay = refresh.retry_in(failures, random.Random(seed))
    ceiling = refresh.retry_ceiling(failures)
    assert ceiling / 2 <= delay <= ceiling <= refresh.MAX_RETRY


def test_retry_delays_differ_between_proxies() -> None:
    """Jitter: proxies that lost identity together do not retry in lockstep."""
    delays = {refresh.retry_in(3, random.Random(seed)) for seed in range(20)}
    assert len(delays) == 20
    assert all(1.0 < d <= 2.0 for d in delays)
