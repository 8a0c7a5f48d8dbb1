"""The one backoff: exponential, capped, equal jitter."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.backoff import Backoff, ceiling, jittered


def test_ceiling_doubles_from_base_up_to_the_cap() -> None:
    assert [ceiling(n, 0.5, 10.0) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]


@given(st.integers(1, 10_000), st.integers(0, 2**32))
def test_waits_stay_within_half_the_ceiling_and_the_ceiling(failures: int, seed: int) -> None:
    top = ceiling(failures, 0.1, 5.0)
    assert top / 2 <= jittered(failures, 0.1, 5.0, random.Random(seed)) <= top <= 5.0


def test_a_success_starts_again_from_base() -> None:
    backoff = Backoff(0.1, 5.0, random.Random(1))
    waits = [backoff.next() for _ in range(8)]
    assert waits[0] <= 0.1 and waits[-1] >= 2.5
    backoff.reset()
    assert backoff.next() <= 0.1


def test_proxies_that_fail_together_do_not_retry_in_lockstep() -> None:
    assert len({jittered(3, 0.5, 10, random.Random(seed)) for seed in range(20)}) == 20


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="0 < base <= cap"):
        Backoff(2.0, 1.0, random.Random())
