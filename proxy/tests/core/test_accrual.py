"""Failure accrual, one endpoint's breaker: transcripts of its transitions, and invariants
over any sequence of picks, outcomes, abandoned probes and time passing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.accrual import (
    GRPC_FAILURES,
    Breaker,
    FailureAccrual,
    InvalidAccrual,
    State,
    succeeded,
)

NO_JITTER = FailureAccrual(max_failures=3, min_penalty=1.0, max_penalty=8.0, jitter=0.0)


def eject(breaker: Breaker, now: float, rng: random.Random) -> None:
    for _ in range(breaker.policy.max_failures):
        breaker.failure(False, now, rng)


@pytest.mark.parametrize(
    ("status", "grpc_status", "success"),
    [
        (200, None, True),
        (404, None, True),  # a client's error is no failure of the endpoint
        (429, None, True),
        (499, None, True),
        (500, None, False),
        (503, None, False),
        (200, "0", True),
        (200, "5", True),  # NOT_FOUND: the caller's error
        (200, "3", True),  # INVALID_ARGUMENT
        (200, "14", False),  # UNAVAILABLE
        (200, "13", False),  # INTERNAL
        (200, "2", False),  # UNKNOWN
        (200, "4", False),  # DEADLINE_EXCEEDED
        (200, "7", False),  # PERMISSION_DENIED
        (200, "15", False),  # DATA_LOSS
    ],
)
def test_what_counts_as_a_failure_is_linkerds_default(
    status: int, grpc_status: str | None, success: bool
) -> None:
    assert succeeded(status, grpc_status) is success


def test_the_max_failures_th_failure_in_a_row_ejects_and_a_success_between_resets_the_count() -> (
    None
):
    rng = random.Random(1)
    breaker = Breaker(NO_JITTER)
    assert not breaker.failure(False, 0.0, rng)
    assert not breaker.failure(False, 0.0, rng)
    breaker.success(False)
    assert not breaker.failure(False, 0.0, rng)
    assert not breaker.failure(False, 0.0, rng)
    assert breaker.state is State.READY and breaker.admits(0.0)
    assert breaker.failure(False, 10.0, rng)
    assert breaker.state is State.EJECTED and breaker.until == 11.0
    assert not breaker.admits(10.999)


def test_one_probe_after_the_penalty_a_failure_doubles_it_a_success_brings_it_back() -> None:
    rng = random.Random(1)
    breaker = Breaker(NO_JITTER)
    eject(breaker, 0.0, rng)
    assert breaker.admits(1.0)
    assert breaker.admit(1.0)  # the probe
    assert not breaker.admits(1.0)  # nothing else while it is out
    breaker.success(False)  # a request sent before the ejection: ignored
    assert breaker.state is State.PROBING
    assert breaker.failure(True, 1.5, rng)
    assert breaker.until == 3.5  # 2s
    assert breaker.admit(3.5) and breaker.failure(True, 3.5, rng)
    assert breaker.until == 7.5  # 4s
    assert breaker.admit(7.5) and breaker.failure(True, 7.5, rng)
    assert breaker.until == 15.5  # 8s: the cap
    assert breaker.admit(15.5) and breaker.failure(True, 15.5, rng)
    assert breaker.until == 23.5  # still 8s
    assert breaker.admit(23.5)
    breaker.success(True)
    assert breaker.state is State.READY and breaker.failures == 0 and breaker.level == 0
    eject(breaker, 30.0, rng)
    assert breaker.until == 31.0  # the penalty starts over


def test_an_abandoned_probe_lets_the_next_request_probe_at_once() -> None:
    rng = random.Random(1)
    breaker = Breaker(NO_JITTER)
    eject(breaker, 0.0, rng)
    assert breaker.admit(2.0)
    breaker.abandoned(True)
    assert breaker.state is State.EJECTED and breaker.admits(2.0)
    assert breaker.admit(2.0)


def test_outcomes_of_requests_sent_before_the_ejection_change_nothing() -> None:
    rng = random.Random(1)
    breaker = Breaker(NO_JITTER)
    eject(breaker, 0.0, rng)
    assert not breaker.failure(False, 0.5, rng)
    breaker.success(False)
    breaker.abandoned(False)
    assert breaker.state is State.EJECTED and breaker.until == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_failures": 0}, "max_failures must be at least 1"),
        ({"min_penalty": 0.0}, "min_penalty must be above 0s"),
        ({"min_penalty": float("nan")}, "min_penalty must be above 0s"),
        ({"max_penalty": 0.5}, "max_penalty (0.5s) must be at least min_penalty (1.0s)"),
        ({"max_penalty": float("inf")}, "max_penalty (infs) must be at least"),
        ({"jitter": -0.1}, "jitter must be in [0, 100]"),
        ({"jitter": 101.0}, "jitter must be in [0, 100]"),
    ],
)
def test_settings_that_cannot_work_are_refused_with_the_field_named(
    changes: dict[str, float], message: str
) -> None:
    with pytest.raises(InvalidAccrual) as caught:
        FailureAccrual(**changes)  # type: ignore[arg-type]
    assert message in str(caught.value)


@given(
    st.floats(0.001, 100.0),
    st.floats(0.0, 1000.0),
    st.floats(0.0, 100.0),
    st.integers(0, 200),
    st.floats(0.0, 1.0, exclude_max=True),
)
def test_a_penalty_is_within_its_bounds(
    low: float, spread: float, jitter: float, level: int, draw: float
) -> None:
    policy = FailureAccrual(1, low, low + spread, jitter)
    penalty = policy.penalty(level, draw)
    assert low <= penalty <= low + spread
    base = min(low + spread, low * 2.0**level)
    assert base <= penalty <= base * (1 + jitter) + 1e-9


# An operation: ("pick", dt) a request is admitted if the breaker allows, after dt seconds;
# ("end", i, kind) the i-th request in flight ends with a success, a failure, or no outcome.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pick"), st.floats(0.0, 5.0)),
        st.tuples(st.just("end"), st.integers(0, 20), st.sampled_from(["ok", "fail", "none"])),
    ),
    max_size=120,
)


@given(OPS, st.integers(1, 5), st.floats(0.0, 2.0), st.integers(0, 2**32))
def test_invariants_over_any_run(
    ops: list[tuple[object, ...]], max_failures: int, jitter: float, seed: int
) -> None:
    policy = FailureAccrual(max_failures, 0.5, 4.0, jitter)
    breaker = Breaker(policy)
    rng = random.Random(seed)
    now = 0.0
    flying: list[bool] = []  # each request in flight: whether it is the probe
    for op in ops:
        was = breaker.state
        if op[0] == "pick":
            now += float(op[1])  # type: ignore[arg-type]
            if breaker.admits(now):
                flying.append(breaker.admit(now))
        elif flying:
            probe = flying.pop(int(op[1]) % len(flying))  # type: ignore[call-overload]
            if op[2] == "ok":
                breaker.success(probe)
            elif op[2] == "fail":
                before = now
                if breaker.failure(probe, now, rng):
                    assert before + policy.min_penalty <= breaker.until
                    assert breaker.until <= before + policy.max_penalty
            else:
                breaker.abandoned(probe)
            if was is not State.READY and breaker.state is State.READY:
                assert probe and op[2] == "ok"  # back only after the probe's success
        probes = sum(flying)
        assert probes <= 1
        assert (probes == 1) == (breaker.state is State.PROBING)
        if breaker.state is State.READY:
            assert breaker.failures < max_failures


def test_defaults_are_linkerds() -> None:
    policy = FailureAccrual()
    assert (policy.max_failures, policy.min_penalty, policy.max_penalty, policy.jitter) == (
        7, 1.0, 60.0, 0.5,
    )  # fmt: skip
    assert {"2", "4", "7", "13", "14", "15"} == GRPC_FAILURES
