"""The one failover policy: what to do after each kind of failure."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.failover import (
    MAX_ATTEMPTS,
    MAX_CONNECTS,
    Action,
    Attempt,
    Failure,
    decide,
)

NOTHING_SENT = (Failure.CONNECT, Failure.CONNECT_TIMEOUT, Failure.REFUSED)
FIRST = Attempt(sends=1, connects_failed=0, stale_retried=False, replayable=True,
                retryable_route=False, method="POST", responded=False)  # fmt: skip


def attempt(**changes: object) -> Attempt:
    return dataclasses.replace(FIRST, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failure", "changes", "action", "status", "budgeted"),
    [
        (Failure.CONNECT, {"sends": 0, "connects_failed": 1}, Action.RETRY, 0, False),
        (Failure.CONNECT, {"sends": 0, "connects_failed": MAX_CONNECTS}, Action.ANSWER, 502,
         False),
        (Failure.CONNECT_TIMEOUT, {"sends": 0, "connects_failed": MAX_CONNECTS}, Action.ANSWER,
         504, False),
        (Failure.REFUSED, {"sends": 0, "connects_failed": 1}, Action.RETRY, 0, False),
        (Failure.REFUSED, {"sends": 0, "connects_failed": MAX_CONNECTS}, Action.ANSWER, 503,
         False),
        (Failure.STALE, {}, Action.RETRY_SAME, 0, False),
        (Failure.STALE, {"stale_retried": True}, Action.ANSWER, 502, False),
        (Failure.RESET, {}, Action.ANSWER, 502, False),  # POST, default route: not retried
        (Failure.RESET, {"method": "GET"}, Action.RETRY, 0, True),  # idempotent: once
        (Failure.RESET, {"method": "GET", "sends": 2}, Action.ANSWER, 502, False),
        (Failure.RESET, {"retryable_route": True, "sends": 2}, Action.RETRY, 0, True),
        (Failure.RESET, {"retryable_route": True, "sends": MAX_ATTEMPTS}, Action.ANSWER, 502,
         False),
        (Failure.RESET, {"retryable_route": True, "replayable": False}, Action.ANSWER, 502,
         False),  # a body too large to hold cannot be sent again
        (Failure.STATUS, {}, Action.PASS, 0, False),
        (Failure.STATUS, {"method": "GET"}, Action.PASS, 0, False),  # statuses: routes only
        (Failure.STATUS, {"retryable_route": True}, Action.RETRY, 0, True),
        (Failure.TIMEOUT, {"retryable_route": True}, Action.ANSWER, 504, False),
        (Failure.RESET, {"retryable_route": True, "responded": True}, Action.ABORT, 0, False),
    ],
)  # fmt: skip
def test_decisions(
    failure: Failure, changes: dict[str, object], action: Action, status: int, budgeted: bool
) -> None:
    decision = decide(failure, attempt(**changes))
    assert (decision.action, decision.status, decision.budgeted) == (action, status, budgeted)
    if budgeted:
        assert decision.otherwise is not None
        assert decision.otherwise.action in (Action.ANSWER, Action.PASS)
    if failure in NOTHING_SENT and action is Action.RETRY:
        # nowhere else to go (a fixed endpoint): the answer the last failure calls for
        assert (
            decision.otherwise is not None
            and decision.otherwise.status
            == {Failure.CONNECT: 502, Failure.CONNECT_TIMEOUT: 504, Failure.REFUSED: 503}[failure]
        )


@given(
    st.sampled_from(list(Failure)),
    st.builds(Attempt, sends=st.integers(0, 10), connects_failed=st.integers(0, 10),
              stale_retried=st.booleans(), replayable=st.booleans(),
              retryable_route=st.booleans(), method=st.sampled_from(["GET", "POST"]),
              responded=st.booleans()),
)  # fmt: skip
def test_invariants(failure: Failure, attempt: Attempt) -> None:
    decision = decide(failure, attempt)
    if attempt.responded:  # never anything but a cut once the client got a byte
        assert decision.action is Action.ABORT
    if decision.action in (Action.RETRY, Action.RETRY_SAME) and failure not in NOTHING_SENT:
        assert attempt.replayable  # a request is only sent again when it is held whole
    if decision.action is Action.RETRY and attempt.sends >= MAX_ATTEMPTS:
        assert failure in NOTHING_SENT
    if decision.budgeted:
        assert failure in (Failure.RESET, Failure.STATUS, Failure.STALE, Failure.ATTEMPT_TIMEOUT)
    assert decision.action is not Action.ANSWER or decision.status in (502, 503, 504)


@pytest.mark.parametrize("limit", [0, 1, 2, 5])
def test_an_outbound_policy_s_retry_limit_counts_the_retries_of_a_retryable_route(
    limit: int,
) -> None:
    """`retry.meshlet.io/limit: N`: N retries after the first send, for a failure status and a
    reset alike; None keeps the ServiceProfile rule (MAX_ATTEMPTS sends)."""
    for failure, gave_up in ((Failure.STATUS, Action.PASS), (Failure.RESET, Action.ANSWER)):
        for sends in range(1, limit + 2):
            decision = decide(failure, attempt(retryable_route=True, retry_limit=limit,
                                               sends=sends))  # fmt: skip
            want = Action.RETRY if sends <= limit else gave_up
            assert decision.action is want, (failure, sends, decision)
    unlimited = attempt(retryable_route=True, sends=MAX_ATTEMPTS - 1)
    assert decide(Failure.STATUS, unlimited).action is Action.RETRY
