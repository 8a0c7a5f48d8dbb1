"""What to do when an attempt to send a request (or open a connection) fails (pure): the one
failover policy of HTTP/1, HTTP/2 and opaque TCP.

    decision = decide(Failure.RESET, attempt)
    if decision.budgeted and not budget.withdraw(now):
        decision = decision.otherwise  # the budget says no: what to do instead

- Nothing reaches the client twice, and nothing is retried once a response byte went back to
  the client: the exchange is aborted instead (a cut connection or stream, never a truncated
  body presented as whole).
- A connection that failed before anything was sent (refused, timed out, TLS refused) is tried
  on another endpoint, up to MAX_CONNECTS, without spending the retry budget: the request was
  never sent. Then 502 (504 when the last failure was a timeout, 503 when the endpoint
  refused new streams: an HTTP/2 upstream allowing none). Opaque TCP is reset.
- A reused (pooled) connection that the upstream had closed before any response byte is tried
  once more on a fresh one (STALE), without the budget.
- A request that was sent, and then failed before any response byte (RESET), or was answered
  with a failure status (STATUS), is retried on another endpoint when its route is retryable (an
  idempotent method is retried once even on other routes, after a reset), the request can be
  replayed (held whole: its body is small enough), the attempts are not used up, and the retry
  budget agrees. Else: 502 for a reset, the response itself for a status.
- A route's timeout (TIMEOUT) answers 504: the deadline covers the retries too.
- An attempt's own timeout (ATTEMPT_TIMEOUT: an outbound policy's response timeout, or its
  retry timeout) passing before its response head cancels that attempt; it is retried as a
  reset is on a retryable route (the caller says whether the route retries timeouts), else
  answered 504.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

MAX_CONNECTS: Final = 3  # endpoints tried for one request whose connections fail
MAX_ATTEMPTS: Final = 3  # sends of one request on a retryable route (the first included)
MAX_IDEMPOTENT_ATTEMPTS: Final = 2  # sends of an idempotent request on any route
IDEMPOTENT: Final = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class Failure(enum.Enum):
    CONNECT = "connect"  # the connection failed; nothing was sent
    CONNECT_TIMEOUT = "connect_timeout"  # likewise, by the connect timeout
    # The endpoint takes no new stream now (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of 0 for
    # longer than the connect timeout); nothing was sent.
    REFUSED = "refused"
    STALE = "stale"  # a reused connection was found closed before any response byte
    RESET = "reset"  # sent (maybe in part); the upstream failed before any response byte
    STATUS = "status"  # a failure response head arrived (not yet given to the client)
    TIMEOUT = "timeout"  # the route's timeout passed before the response head
    ATTEMPT_TIMEOUT = "attempt_timeout"  # the attempt's own timeout passed before its head


class Action(enum.Enum):
    RETRY = "retry"  # send it again (another endpoint, when one exists)
    RETRY_SAME = "retry_same"  # send it again to the same endpoint, on a fresh connection
    ANSWER = "answer"  # answer the client locally with `status`
    PASS = "pass"  # give the client the upstream's response as it is
    ABORT = "abort"  # cut the client's connection or stream


@dataclass(frozen=True, slots=True)
class Attempt:
    """What is known of the request when an attempt fails."""

    sends: int  # times the request was (at least partly) sent, this failure's included
    connects_failed: int  # connections that failed before anything was sent, this one included
    stale_retried: bool  # a stale pooled connection was already retried
    replayable: bool  # the whole request is held and can be sent again
    retryable_route: bool
    method: str
    responded: bool  # a response byte went back to the client
    retry_limit: int | None = None  # retries the route allows (None: up to MAX_ATTEMPTS sends)


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    status: int = 0  # with ANSWER
    reason: str = ""  # for `meshlet-proxy-error` and logs
    budgeted: bool = False  # a retry the budget must allow, else `otherwise`
    # With RETRY: what to do instead when the budget says no, or when there is nowhere else to
    # send it (a connection to a fixed endpoint failed).
    otherwise: Decision | None = None


_ABORT: Final = Decision(Action.ABORT, reason="the response had started")
_NOTHING_SENT: Final = frozenset({Failure.CONNECT, Failure.CONNECT_TIMEOUT, Failure.REFUSED})
_GAVE_UP_STATUS: Final = {Failure.CONNECT: 502, Failure.CONNECT_TIMEOUT: 504, Failure.REFUSED: 503}


def _route_sends(attempt: Attempt) -> int:
    """Sends a retryable route allows one request: its retries plus the first."""
    return MAX_ATTEMPTS if attempt.retry_limit is None else attempt.retry_limit + 1


def decide(failure: Failure, attempt: Attempt) -> Decision:
    if attempt.responded:
        return _ABORT
    if failure is Failure.TIMEOUT:
        return Decision(Action.ANSWER, 504, "the route's timeout passed")
    if failure in _NOTHING_SENT:
        status = _GAVE_UP_STATUS[failure]
        gave_up = Decision(Action.ANSWER, status, f"{attempt.connects_failed} connections failed")
        if attempt.connects_failed < MAX_CONNECTS:
            return Decision(Action.RETRY, reason="connection failed; nothing was sent",
                            otherwise=gave_up)  # fmt: skip
        return gave_up
    if failure is Failure.STALE:
        if not attempt.stale_retried and attempt.replayable:
            return Decision(Action.RETRY_SAME, reason="a pooled connection had been closed")
        failure = Failure.RESET
    if failure is Failure.ATTEMPT_TIMEOUT:
        gave_up = Decision(Action.ANSWER, 504, "the attempt's timeout passed")
        limit = _route_sends(attempt) if attempt.retryable_route else 1
    elif failure is Failure.RESET:
        gave_up = Decision(Action.ANSWER, 502, "the upstream failed before responding")
        limit = _route_sends(attempt) if attempt.retryable_route else (
            MAX_IDEMPOTENT_ATTEMPTS if attempt.method in IDEMPOTENT else 1
        )  # fmt: skip
    else:  # STATUS
        gave_up = Decision(Action.PASS, reason="a failure response")
        limit = _route_sends(attempt) if attempt.retryable_route else 1
    if attempt.replayable and attempt.sends < limit:
        return Decision(Action.RETRY, reason=f"retry after {failure.value}", budgeted=True,
                        otherwise=gave_up)  # fmt: skip
    return gave_up
