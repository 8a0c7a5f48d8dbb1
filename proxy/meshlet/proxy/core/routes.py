"""ServiceProfile routes (pure): which route a request takes, and how its response is classified.

A request takes the first route whose condition matches its method and path (Linkerd's rule);
none: the default route (no timeout, no retries, default classification). A path regex matches
the whole path (anchored). Regexes are compiled with RE2, a linear-time engine: the path is the
client's, and a backtracking engine lets one request spend seconds of CPU on a pattern such as
`(a+)+$`. RE2's syntax is Rust `regex`'s (no look-around, no back-references), the engine of
linkerd2-proxy; a route whose regex RE2 refuses never matches (`compiled` says why).

Linear is not free: a request pays its regexes from a `Meter` (meshlet.api.pathregex). A request
whose path is too long for the profile's regexes takes the default route: a profile's routes
only name, time and retry requests, they grant no access, so the request is served as one no
route matches rather than refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, TypeAlias, TypeVar

from meshlet.api.pathregex import Budget, Meter, Regex, RegexBudgetExceeded, compile_path_regex
from meshlet.proxy.core.classify import FAILURE, SUCCESS, classify

MAX_CACHED_PATTERNS: Final = 1024

# The route model (what `discovery.profile` decodes a profile's routes into).

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class AllOf(Generic[M]):
    matches: tuple[M, ...]


@dataclass(frozen=True, slots=True)
class AnyOf(Generic[M]):
    matches: tuple[M, ...]


@dataclass(frozen=True, slots=True)
class Not(Generic[M]):
    match: M


@dataclass(frozen=True, slots=True)
class PathRegex:
    regex: str  # matches the whole request path
    # compiled by the profile's decoder (under its budget); else compiled at its first use
    compiled: Regex | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Method:
    method: str  # case-sensitive, e.g. "GET"


@dataclass(frozen=True, slots=True)
class StatusRange:
    min: int
    max: int  # inclusive


RequestMatch: TypeAlias = (
    "AllOf[RequestMatch] | AnyOf[RequestMatch] | Not[RequestMatch] | PathRegex | Method"
)
ResponseMatch: TypeAlias = (
    "AllOf[ResponseMatch] | AnyOf[ResponseMatch] | Not[ResponseMatch] | StatusRange"
)


@dataclass(frozen=True, slots=True)
class ResponseClass:
    condition: ResponseMatch
    is_failure: bool


@dataclass(frozen=True, slots=True)
class Route:
    condition: RequestMatch
    response_classes: tuple[ResponseClass, ...]
    labels: tuple[tuple[str, str], ...]
    retryable: bool
    timeout: float | None  # seconds; None: no timeout


class BadRoute(ValueError):
    """A route's condition cannot be compiled."""


@functools.lru_cache(maxsize=MAX_CACHED_PATTERNS)
def _compiled(regex: str) -> Regex:
    try:
        return compile_path_regex(regex)
    except ValueError as exc:
        raise BadRoute(f"path regex {regex[:80]!r}: {exc}") from None


def compiled(condition: RequestMatch, budget: Budget) -> RequestMatch:
    """`condition` with each of its path regexes compiled under `budget` (a profile's);
    BadRoute when one does not compile or the budget refuses it."""
    if isinstance(condition, PathRegex):
        try:
            return PathRegex(condition.regex, budget.compile(condition.regex))
        except ValueError as exc:
            raise BadRoute(f"path regex {condition.regex[:80]!r}: {exc}") from None
    if isinstance(condition, AllOf):
        return AllOf(tuple(compiled(m, budget) for m in condition.matches))
    if isinstance(condition, AnyOf):
        return AnyOf(tuple(compiled(m, budget) for m in condition.matches))
    if isinstance(condition, Not):
        return Not(compiled(condition.match, budget))
    return condition


def matches(condition: RequestMatch, method: str, path: str, meter: Meter) -> bool:
    """Whether the request matches; its regexes paid from `meter` (RegexBudgetExceeded)."""
    if isinstance(condition, Method):
        return condition.method == method
    if isinstance(condition, PathRegex):
        regex = condition.compiled
        if regex is None:
            try:
                regex = _compiled(condition.regex)
            except BadRoute:
                return False
        return regex.matches(path, meter)
    if isinstance(condition, AllOf):
        return all(matches(m, method, path, meter) for m in condition.matches)
    if isinstance(condition, AnyOf):
        return any(matches(m, method, path, meter) for m in condition.matches)
    return not matches(condition.match, method, path, meter)


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """What a request's route asks of the proxy: the route's metric name (`rt_route`; empty
    for the default route), its timeout, whether it may be retried, its classes, and how long
    its requests may stay quiet (None: the workload's setting, by default no limit). An
    outbound policy's retry also names the HTTP statuses (inclusive ranges) and gRPC codes
    retried (both None: every failure, as a ServiceProfile's) and how many retries one request
    gets (None: the ServiceProfile rule, up to MAX_ATTEMPTS sends); and, per attempt, how long
    it may wait for its response head (`attempt_timeout`: the policy's response timeout or its
    retry's per-try timeout, the shorter, named by `attempt_timeout_name` in the 504 it answers;
    whether one that passes is retried: `retry_timeouts`) and how long a retry waits first
    (`retry_backoff`: min, max, jitter ratio; None: at once)."""

    name: str = ""
    timeout: float | None = None
    retryable: bool = False
    classes: tuple[ResponseClass, ...] = ()
    idle_timeout: float | None = None
    retry_statuses: tuple[tuple[int, int], ...] | None = None
    retry_grpc_codes: frozenset[int] | None = None
    retry_limit: int | None = None
    attempt_timeout: float | None = None
    retry_timeouts: bool = False
    attempt_timeout_name: str = "response"  # or "per-try"
    retry_backoff: tuple[float, float, float] | None = None


DEFAULT_ROUTE: Final = RoutePolicy()


def policy(route: Route) -> RoutePolicy:
    name = dict(route.labels).get("route", "")
    return RoutePolicy(name, route.timeout, route.retryable, route.response_classes)


def route_for(routes: Sequence[Route], method: str, path: str) -> Route | None:
    """The first route matching the request; None: the default route (also for a request
    whose path is too long for the routes' regexes: see the module's docstring)."""
    path = path.split("?", 1)[0] or "/"
    meter = Meter()
    try:
        for route in routes:
            if matches(route.condition, method, path, meter):
                return route
    except RegexBudgetExceeded:
        return None
    return None


def _status_matches(condition: ResponseMatch, status: int) -> bool:
    if isinstance(condition, StatusRange):
        return condition.min <= status <= condition.max
    if isinstance(condition, AllOf):
        return all(_status_matches(m, status) for m in condition.matches)
    if isinstance(condition, AnyOf):
        return any(_status_matches(m, status) for m in condition.matches)
    return not _status_matches(condition.match, status)


def classify_response(route: RoutePolicy, status: int, grpc_status: str | None) -> str:
    """`success` or `failure`: the first of the route's response classes matching `status`
    decides; none: the default (5xx or a gRPC error is a failure)."""
    for response_class in route.classes:
        if _status_matches(response_class.condition, status):
            return FAILURE if response_class.is_failure else SUCCESS
    return classify(status, grpc_status)
