"""Owns Linkerd's outbound annotations, read from a Service (every route of it) or a route (its own
rules): retries (`retry.meshlet.io/*`), timeouts (`timeout.meshlet.io/*`) and failure accrual
(`balancer.meshlet.io/failure-accrual*`), with Linkerd's meanings and defaults
(`policy-controller/k8s/index/src/outbound`). Each reader raises ValueError naming the annotation
and what is wrong with its value."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

from meshlet.api import wellknown

W = wellknown
ACCRUAL_MAX_FAILURES: Final = 7
ACCRUAL_MIN_PENALTY: Final = 1.0
ACCRUAL_MAX_PENALTY: Final = 60.0
ACCRUAL_JITTER: Final = 0.5
GRPC_RETRY_CONDITIONS: Final = (
    "cancelled",
    "deadline-exceeded",
    "internal",
    "resource-exhausted",
    "unavailable",
)

T = TypeVar("T")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)?")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds of Linkerd's annotation durations: a whole number and ms, s, m, h or d (`0`
    alone allowed); ValueError saying what is wrong."""
    value = text.strip()
    if value.startswith("-"):
        raise ValueError(f"{value!r} is negative; a duration is at least 0")
    if "." in value:
        raise ValueError(f"{value!r} has a fraction; use a smaller unit such as 1500ms")
    found = _DURATION.fullmatch(value)
    if found is None:
        raise ValueError(f"{value!r} is not a duration such as 500ms, 10s, 5m, 1h or 1d")
    number, unit = int(found.group(1)), found.group(2)
    if unit is None and number != 0:
        raise ValueError(f"{value!r} has no unit; did you mean {number}s or {number}ms?")
    return number * _UNITS[unit or "s"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    request: float | None = None
    response: float | None = None
    idle: float | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """The retry annotations of a Service or route; HTTP and gRPC routes each read theirs."""

    limit: int | None  # None: 1
    timeout: float | None
    http: tuple[tuple[int, int], ...] | None  # status ranges
    grpc: tuple[str, ...] | None  # GRPC_RETRY_CONDITIONS

    def of(self, protocol: str) -> Retry | None:
        """Itself when it says anything to `protocol` (http or grpc), as Linkerd's separate
        `parse_http_retry` and `parse_grpc_retry` would; else None."""
        conditions = self.http if protocol == "http" else self.grpc
        if self.limit is None and self.timeout is None and conditions is None:
            return None
        return self


@dataclass(frozen=True, slots=True)
class Accrual:
    max_failures: int
    min_penalty: float
    max_penalty: float
    jitter: float


def timeouts_of(notes: Mapping[str, str]) -> Timeouts:
    def get(key: str) -> float | None:
        return parse_duration(notes[key]) if key in notes else None

    return Timeouts(
        request=get(W.TIMEOUT_REQUEST_ANNOTATION),
        response=get(W.TIMEOUT_RESPONSE_ANNOTATION),
        idle=get(W.TIMEOUT_IDLE_ANNOTATION),
    )


def _status(text: str) -> int | None:
    return int(text) if text.isdigit() and 100 <= int(text) < 600 else None


def _http_condition(item: str) -> tuple[int, int]:
    if item.lower() == "5xx":
        return 500, 599
    if item.lower() == "gateway-error":
        return 502, 504
    code = _status(item)
    if code is not None:
        return code, code
    start, sep, end = item.partition("-")
    low, high = _status(start), _status(end)
    if sep and low is not None and high is not None and low <= high:
        return low, high
    raise ValueError(
        f"{item!r} is not a retry condition: use 5xx, gateway-error, a status (503) or a"
        " range (500-504) of statuses 100..599"
    )


def _grpc_condition(item: str) -> str:
    if item.lower() in GRPC_RETRY_CONDITIONS:
        return item.lower()
    raise ValueError(f"{item!r} is not one of {', '.join(GRPC_RETRY_CONDITIONS)}")


def _conditions(
    notes: Mapping[str, str], key: str, read: Callable[[str], T]
) -> tuple[T, ...] | None:
    if key not in notes:
        return None
    try:
        return tuple(read(item.strip()) for item in notes[key].split(","))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def retry_of(notes: Mapping[str, str]) -> Retry | None:
    """Linkerd's `parse_http_retry` and `parse_grpc_retry` read together: None when no retry
    annotation is set; a limit of 0 or a timeout of 0 counts as unset; the limit defaults to 1."""
    limit = None
    if W.RETRY_LIMIT_ANNOTATION in notes:
        text = notes[W.RETRY_LIMIT_ANNOTATION].strip()
        if not text.isdigit() or int(text) > 65535:
            raise ValueError(f"{W.RETRY_LIMIT_ANNOTATION}: {text!r} is not a number in 0..65535")
        limit = int(text) or None
    timeout = None
    if W.RETRY_TIMEOUT_ANNOTATION in notes:
        try:
            timeout = parse_duration(notes[W.RETRY_TIMEOUT_ANNOTATION]) or None
        except ValueError as exc:
            raise ValueError(f"{W.RETRY_TIMEOUT_ANNOTATION}: {exc}") from None
    http = _conditions(notes, W.RETRY_HTTP_ANNOTATION, _http_condition)
    grpc = _conditions(notes, W.RETRY_GRPC_ANNOTATION, _grpc_condition)
    if limit is None and timeout is None and http is None and grpc is None:
        return None
    return Retry(limit, timeout, http, grpc)


def accrual_of(notes: Mapping[str, str]) -> Accrual | None:
    """Linkerd's `parse_accrual_config` for the `consecutive` mode."""
    mode = notes.get(W.FAILURE_ACCRUAL_ANNOTATION)
    if mode is None:
        return None
    if mode != "consecutive":
        raise ValueError(f"{W.FAILURE_ACCRUAL_ANNOTATION}: {mode!r} is not a mode; use consecutive")

    def value(key: str, read: Callable[[str], float], default: float) -> float:
        if key not in notes:
            return default
        try:
            return read(notes[key])
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None

    def count(text: str) -> float:
        if not text.strip().isdigit() or int(text) >= 2**32:
            raise ValueError(f"{text!r} is not a whole number in 0..4294967295")
        return int(text)

    def ratio(text: str) -> float:
        try:
            number = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not 0.0 <= number <= 100.0:
            raise ValueError(f"{text!r} is not within 0..100")
        return number

    max_failures = int(
        value(W.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION, count, ACCRUAL_MAX_FAILURES)
    )
    low = value(W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION, parse_duration, ACCRUAL_MIN_PENALTY)
    high = value(W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION, parse_duration, ACCRUAL_MAX_PENALTY)
    jitter = value(W.FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION, ratio, ACCRUAL_JITTER)
    if high <= 0:
        raise ValueError(f"{W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION}: must be more than 0")
    if low > high:
        raise ValueError(
            f"{W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION}: {low:g}s exceeds the max penalty"
            f" ({high:g}s)"
        )
    return Accrual(max_failures, low, high, jitter)


def checked_timeouts(notes: Mapping[str, str]) -> Timeouts:
    for key in (W.TIMEOUT_REQUEST_ANNOTATION, W.TIMEOUT_RESPONSE_ANNOTATION,
                W.TIMEOUT_IDLE_ANNOTATION):  # fmt: skip
        if key in notes:
            try:
                parse_duration(notes[key])
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
    return timeouts_of(notes)


def annotation_problems(notes: Mapping[str, str]) -> list[str]:
    """Every bad outbound annotation value, each as `annotation: what is wrong`."""
    out = []
    for read in (accrual_of, checked_timeouts, retry_of):
        try:
            read(notes)
        except ValueError as exc:
            out.append(str(exc))
    return out
