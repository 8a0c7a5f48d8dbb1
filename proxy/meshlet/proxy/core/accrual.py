"""Failure accrual (pure): Linkerd's consecutive-failures circuit breaker, one per endpoint.

An endpoint whose responses fail `max_failures` times in a row is ejected: the balancer leaves
it out. Once its penalty has passed it admits one request, the probe, and nothing else until
the probe's outcome is known: a success returns the endpoint to the balancer, a failure ejects
it again for twice as long (up to `max_penalty`). Outcomes of requests sent before the ejection
are ignored while the endpoint is out, so only a probe's success brings it back. A probe that
ends with no outcome (its client left) gives way to the next probe at once.

    state     event                        next
    READY     success                      READY, failures reset
    READY     failure (the max_failures-th) EJECTED for penalty(0)
    EJECTED   admitted after its penalty   PROBING (this request is the probe)
    PROBING   the probe succeeds           READY, failures and penalty reset
    PROBING   the probe fails              EJECTED for penalty(level + 1)
    PROBING   the probe is abandoned       EJECTED, its penalty already over
    EJECTED/PROBING  any other outcome     unchanged

Penalties are Linkerd's exponential backoff: min(max, min * 2**level), plus a uniform share of
up to `jitter` of it, never past `max_penalty`. What counts as a failure is Linkerd's default
classification: an HTTP status of 5xx, a gRPC status (in headers or trailers) among the codes
Linkerd calls failures, a reset stream or a connection that failed.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from typing import Final

# UNKNOWN, DEADLINE_EXCEEDED, PERMISSION_DENIED, INTERNAL, UNAVAILABLE, DATA_LOSS: Linkerd's
# default gRPC failure codes (proxy/client-policy grpc.rs `Codes::default`).
GRPC_FAILURES: Final = frozenset({"2", "4", "7", "13", "14", "15"})
MAX_JITTER: Final = 100.0  # Linkerd's bound on jitter_ratio
_MAX_LEVEL: Final = 64  # far past any cap: 2**level stays a small float


def succeeded(status: int, grpc_status: str | None) -> bool:
    """Whether a response counts as a success for failure accrual."""
    return status < 500 and (grpc_status is None or grpc_status not in GRPC_FAILURES)


class InvalidAccrual(ValueError):
    """A FailureAccrual value that cannot be used (the message says which field and why)."""


@dataclass(frozen=True, slots=True)
class FailureAccrual:
    """Linkerd's `FailureAccrual.ConsecutiveFailures`: eject after `max_failures` failures in
    a row; probe after a penalty from `min_penalty` doubling to `max_penalty` (seconds), with
    up to `jitter` of it added at random."""

    max_failures: int = 7
    min_penalty: float = 1.0
    max_penalty: float = 60.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise InvalidAccrual(f"max_failures must be at least 1, got {self.max_failures}")
        if not (math.isfinite(self.min_penalty) and self.min_penalty > 0):
            raise InvalidAccrual(f"min_penalty must be above 0s, got {self.min_penalty}")
        if not (math.isfinite(self.max_penalty) and self.max_penalty >= self.min_penalty):
            raise InvalidAccrual(
                f"max_penalty ({self.max_penalty}s) must be at least min_penalty"
                f" ({self.min_penalty}s)"
            )
        if not (math.isfinite(self.jitter) and 0 <= self.jitter <= MAX_JITTER):
            raise InvalidAccrual(f"jitter must be in [0, {MAX_JITTER:g}], got {self.jitter}")

    def penalty(self, level: int, draw: float) -> float:
        """The wait after the `level`-th ejection in a row (0: the first); `draw` in [0, 1)."""
        return backoff(self.min_penalty, self.max_penalty, self.jitter, level, draw)


def backoff(low: float, high: float, jitter: float, level: int, draw: float) -> float:
    """Linkerd's exponential backoff: the `level`-th wait in a row (0: the first) is `low`
    doubled `level` times, stretched by up to `jitter` of itself (`draw` in [0, 1)), never past
    `high`. The breaker's penalties and the retries' waits."""
    base = min(high, low * 2.0 ** min(level, _MAX_LEVEL))
    return base + min(high - base, base * jitter * draw)


class State(enum.Enum):
    READY = "ready"
    EJECTED = "ejected"
    PROBING = "probing"


class Breaker:
    """One endpoint's breaker (see the module docstring); `now` is passed in, the rng too."""

    __slots__ = ("failures", "level", "policy", "state", "until")

    def __init__(self, policy: FailureAccrual) -> None:
        self.policy = policy
        self.state = State.READY
        self.failures = 0  # consecutive, while READY
        self.level = 0  # ejections in a row (the penalty's exponent)
        self.until = 0.0  # while EJECTED: no probe before then

    def admits(self, now: float) -> bool:
        """Whether the balancer may send the endpoint a request now."""
        state = self.state
        return state is State.READY or (state is State.EJECTED and self.until <= now)

    def admit(self, now: float) -> bool:
        """The balancer picked the endpoint (it `admits`): whether this request is the probe."""
        if self.state is State.EJECTED and self.until <= now:
            self.state = State.PROBING
            return True
        return False

    def success(self, probe: bool) -> None:
        state = self.state
        if state is State.READY:
            self.failures = 0
        elif probe and state is State.PROBING:
            self.state, self.failures, self.level = State.READY, 0, 0

    def failure(self, probe: bool, now: float, rng: random.Random) -> bool:
        """A failed outcome; whether it ejected the endpoint."""
        state = self.state
        if state is State.READY:
            self.failures += 1
            if self.failures < self.policy.max_failures:
                return False
            self.level = 0
        elif probe and state is State.PROBING:
            self.level = min(self.level + 1, _MAX_LEVEL)
        else:
            return False
        self.state = State.EJECTED
        self.until = now + self.policy.penalty(self.level, rng.random())
        return True

    def abandoned(self, probe: bool) -> None:
        """The probe ended with no outcome: the next request may probe."""
        if probe and self.state is State.PROBING:
            self.state = State.EJECTED
