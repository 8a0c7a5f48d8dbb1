"""Linkerd 2.16's outbound route metrics (linkerd2-proxy `outbound/src/http/logical/policy/route/
metrics.rs`, `backend/metrics.rs`, `linkerd-http-retry`), and the series of one route target.

Only requests routed by an outbound policy's HTTPRoute or GRPCRoute are counted here
(ServiceProfile routes keep the `route_*` families). Each family exists twice, as
`outbound_http_route_*` and `outbound_grpc_route_*` (a GRPCRoute's requests; `grpc_status` in
place of `http_status`, a code's name, `UNKNOWN` when none came):

- per route (`parent_*`, `route_*`): `request_duration_seconds`, a histogram with Linkerd's
  coarse buckets (0.05, 0.5, 1, 10 s), and `request_statuses_total` (`http_status`, `error`),
  once per request, for the response the client got; `retry_requests_total` (each retry sent),
  `retry_successes_total` (a retry's response that was not retried again),
  `retry_limit_exceeded_total` (a request still failing when its retries were used up: once
  per request), `retry_overflow_total` (a retry the retry budget refused);
- per route backend (`backend_*` too): `backend_requests_total`, each dispatch to the backend
  (a retry is dispatched again), `backend_response_duration_seconds` (buckets 0.025, 0.05,
  0.1, 0.25, 0.5, 1, 10 s) and `backend_response_statuses_total` for each attempt's response
  or failure, retried ones included.

`error` is Linkerd's name of why a request ended without a response (`FAIL_FAST`,
`REQUEST_TIMEOUT`, `RESPONSE_HEADERS_TIMEOUT`, `RESET`, `UNKNOWN`); it is left out when a
response came whole, and `http_status` is left out when none came. The request duration runs
from the request's arrival to the response head the client got, a backend response's from its
attempt's start (its endpoint picked: after a retry's backoff) to its head: Linkerd's both run
to the response's last byte.

Series are looked up once per route target (the policy router keeps a `BackendSeries` per
(route, rule, backend) and policy version); a request pays dict reads for its status only. The
families are the app's (`metrics.RouteFamilies`), seen here through the `Families` port.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Final, Protocol

from meshlet.proxy.core.failover import MAX_ATTEMPTS, Action, Attempt, Decision, Failure

if TYPE_CHECKING:  # the ports the app's families fit (`metrics.RouteFamilies`): types only
    from meshlet.proxy.core.client_policy import PolicyRef
    from meshlet.proxy.core.routes import RoutePolicy

    class Count(Protocol):
        """One labelled counter, counted in place (`series.CounterChild`)."""

        value: float

    class Buckets(Protocol):
        """One labelled histogram, observed in place (`series.HistogramChild`)."""

        @property
        def counts(self) -> list[int]: ...

        sum: float

    class CountFamily(Protocol):
        def labels(self, *values: str) -> Count: ...

    class BucketFamily(Protocol):
        def labels(self, *values: str) -> Buckets: ...

    class Families(Protocol):
        """Linkerd's route families of one protocol, as the app registers them
        (`metrics.RouteFamilies`): the route's and the backend's, and the histograms' bounds."""

        @property
        def grpc(self) -> bool: ...
        @property
        def request_buckets(self) -> tuple[float, ...]: ...
        @property
        def response_buckets(self) -> tuple[float, ...]: ...
        @property
        def request_duration(self) -> BucketFamily: ...
        @property
        def request_statuses(self) -> CountFamily: ...
        @property
        def retry_requests(self) -> CountFamily: ...
        @property
        def retry_successes(self) -> CountFamily: ...
        @property
        def retry_limit_exceeded(self) -> CountFamily: ...
        @property
        def retry_overflow(self) -> CountFamily: ...
        @property
        def backend_requests(self) -> CountFamily: ...
        @property
        def backend_response_duration(self) -> BucketFamily: ...
        @property
        def backend_response_statuses(self) -> CountFamily: ...

    _ByStatus = dict[tuple[int, str | None, str], Count]
    _ByWhole = dict[int | str | None, Count]
else:
    _ByStatus = _ByWhole = dict


PARENT: Final = ("parent_group", "parent_kind", "parent_namespace", "parent_name", "parent_port",
                 "parent_section_name")  # fmt: skip
# Linkerd's `error` label values (route/metrics/labels.rs)
FAIL_FAST: Final = "FAIL_FAST"
REQUEST_TIMEOUT: Final = "REQUEST_TIMEOUT"
RESPONSE_HEADERS_TIMEOUT: Final = "RESPONSE_HEADERS_TIMEOUT"
RESET: Final = "RESET"
UNKNOWN: Final = "UNKNOWN"
GRPC_CODES: Final = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip

Values = tuple[str, ...]
StatusKey = tuple[int, str | None, str]  # HTTP status (0: none came), gRPC status, error
_ATTEMPT_ERRORS: Final = {Failure.ATTEMPT_TIMEOUT: RESPONSE_HEADERS_TIMEOUT}  # else RESET


def route(families: Families, parent: PolicyRef, route: PolicyRef) -> RouteSeries:
    """The series of a (parent, route), for its rules and backends to share."""
    return RouteSeries(families, (*ref_values(parent, True), *ref_values(route, False)))


def backend(route: RouteSeries, backend: PolicyRef) -> BackendSeries:
    """The series of one of the route's backends (with the route's)."""
    return BackendSeries(route, (*route.values, *ref_values(backend, True)))


def observe(buckets: Buckets, bounds: tuple[float, ...], value: float) -> None:
    buckets.counts[bisect_left(bounds, value)] += 1
    buckets.sum += value


def ref_values(ref: PolicyRef, service: bool) -> Values:
    """A parent's or backend's label values (`service`: with port and section), or a route's."""
    head = (ref.group, ref.kind, ref.namespace, ref.name)
    return (*head, str(ref.port or ""), ref.section) if service else head


def parent_labels(parent: PolicyRef) -> dict[str, str]:
    """A parent Service's `parent_*` labels, those with a value."""
    values = ref_values(parent, True)
    return {name: value for name, value in zip(PARENT, values, strict=True) if value}


def grpc_code_name(code: str | None) -> str:
    """`grpc-status` as Linkerd labels it: the code's name; `UNKNOWN` for none or another."""
    if code is not None and code.isdigit() and int(code) < len(GRPC_CODES):
        return GRPC_CODES[int(code)]
    return "UNKNOWN"


class Statuses(_ByStatus):
    """A statuses family's children under fixed labels, by (status, grpc status, error): a
    dict, so that counting one already seen is a lookup with no call (`s[key].value += 1`)."""

    __slots__ = ("_family", "_grpc", "_values", "whole")

    def __init__(self, family: CountFamily, values: Values, grpc: bool) -> None:
        super().__init__()
        self._family = family
        self._values = values
        self._grpc = grpc
        self.whole = Whole(self, grpc)

    def __missing__(self, key: StatusKey) -> Count:
        status, grpc_status, error = key
        label = grpc_code_name(grpc_status) if self._grpc else str(status or "")
        child = self[key] = self._family.labels(*self._values, label, error)
        return child

    def inc(self, status: int, grpc_status: str | None, error: str) -> None:
        """`status` 0: no response came (then `error` says why)."""
        self[status, grpc_status, error].value += 1


class Whole(_ByWhole):
    """The children of responses that came whole, by HTTP status (gRPC: the `grpc-status`
    value): the common case, looked up with a key that needs no tuple."""

    __slots__ = ("_grpc", "_statuses")

    def __init__(self, statuses: Statuses, grpc: bool) -> None:
        super().__init__()
        self._statuses = statuses
        self._grpc = grpc

    def __missing__(self, key: int | str | None) -> Count:
        if self._grpc:
            child = self._statuses[0, key if isinstance(key, str) else None, ""]
        else:
            child = self._statuses[key if isinstance(key, int) else 0, None, ""]
        self[key] = child
        return child


class RouteSeries:
    """The per-route series of one (parent, route)."""

    __slots__ = ("bounds", "duration", "families", "limit_exceeded", "overflow", "retries",
                 "statuses", "successes", "values")  # fmt: skip

    def __init__(self, families: Families, values: Values) -> None:
        self.values = values
        self.bounds = families.request_buckets
        self.duration = families.request_duration.labels(*values)
        self.statuses = Statuses(families.request_statuses, values, families.grpc)
        self.retries = families.retry_requests.labels(*values)
        self.successes = families.retry_successes.labels(*values)
        self.limit_exceeded = families.retry_limit_exceeded.labels(*values)
        self.overflow = families.retry_overflow.labels(*values)
        self.families = families

    def finished(
        self, status: int, grpc_status: str | None, error: str, seconds: float | None
    ) -> None:
        """The request's end as the client saw it (once per request)."""
        self.statuses.inc(status, grpc_status, error)
        observe(self.duration, self.bounds, seconds if seconds is not None else 0.0)


class BackendSeries:
    """The series of one route backend (a route target), with its route's."""

    __slots__ = ("bounds", "duration", "grpc", "requests", "route", "statuses")

    def __init__(self, route: RouteSeries, values: Values) -> None:
        families = route.families
        self.route = route
        self.grpc = families.grpc
        self.requests = families.backend_requests.labels(*values)
        self.bounds = families.response_buckets
        self.duration = families.backend_response_duration.labels(*values)
        self.statuses = Statuses(families.backend_response_statuses, values, families.grpc)


def retry_answered(series: BackendSeries, policy: RoutePolicy) -> None:
    """A response that is not retried came back to a request sent again (not only over a
    fresh connection): on a route with retries, a retry's success."""
    if policy.retryable:
        series.route.successes.value += 1


def failover(series: BackendSeries, failure: Failure, decision: Decision, attempt: Attempt) -> None:
    """A sent attempt failed (reset, outlived its own timeout, or a status its route retries)
    and the driver decided (`decision`, after the budget): a retried attempt that got no
    response counts as its error; on a route with retries, a retry is a retry request and a
    dispatch to the backend again, and a failure with its retries used up (while it could
    still be resent) exceeds the limit."""
    retry = decision.action is Action.RETRY
    if retry and failure is not Failure.STATUS:  # else the answer the client gets says so
        series.statuses.inc(0, None, _ATTEMPT_ERRORS.get(failure, RESET))
    if not attempt.retryable_route:
        return
    if retry:
        series.route.retries.value += 1
        series.requests.value += 1
        return
    limit = attempt.retry_limit if attempt.retry_limit is not None else MAX_ATTEMPTS - 1
    if attempt.replayable and not attempt.responded and attempt.sends > limit:
        series.route.limit_exceeded.value += 1
