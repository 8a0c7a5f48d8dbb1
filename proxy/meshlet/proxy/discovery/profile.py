"""`DestinationProfile` messages decoded into typed, immutable values (pure).

A profile says what an outbound target is (DESIGN §5): `fqn` set → a service whose endpoints
come from `Get`; `endpoint` set → one known pod, no balancing; neither → unknown, forwarded to
the original destination as is. It also carries the traffic split (`dst_overrides`, weights
where 10000 is 100 %), `opaque`, the retry budget and the routes (the first matching route wins;
an unmatched response is a success). Route matching itself belongs to the HTTP layer.

A route or override that breaks the contract is left out and named in `Profile.rejected`; a
malformed `endpoint` rejects the whole message (DecodeError) rather than dropping its TLS
identity. The routes' regexes share one budget (meshlet.api.pathregex.Budget): the routes past
it, and any after the first regex refused, are left out and named the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf import duration_pb2

from meshlet.api import destination_pb2, http_types_pb2
from meshlet.api.pathregex import Budget
from meshlet.proxy.core.endpoints import DiscoveredEndpoint
from meshlet.proxy.core.routes import (
    AllOf,
    AnyOf,
    BadRoute,
    Method,
    Not,
    PathRegex,
    RequestMatch,
    ResponseClass,
    ResponseMatch,
    Route,
    StatusRange,
    compiled,
)
from meshlet.proxy.discovery.decode import DecodeError, decode_endpoint

MAX_DEPTH = 16  # all/any/not levels in one condition, as the control plane allows


@dataclass(frozen=True, slots=True)
class RetryBudgetSpec:
    ratio: float
    min_per_second: int
    ttl: float  # seconds


DEFAULT_RETRY_BUDGET = RetryBudgetSpec(0.2, 10, 10.0)


class DstOverride(NamedTuple):
    authority: str  # a `Get` path: `<svc>.<ns>.svc.<domain>:<port>`
    weight: int  # relative; 10000 is 100 %


@dataclass(frozen=True, slots=True)
class Profile:
    fqn: str | None = None  # the service's name without port
    opaque: bool = False
    endpoint: DiscoveredEndpoint | None = None  # the lookup named a pod
    dst_overrides: tuple[DstOverride, ...] = ()
    retry_budget: RetryBudgetSpec = DEFAULT_RETRY_BUDGET
    routes: tuple[Route, ...] = ()
    rejected: tuple[str, ...] = ()  # routes and overrides left out, and why


UNKNOWN = Profile()


def _seconds(msg: duration_pb2.Duration) -> float:
    return msg.seconds + msg.nanos / 1e9


def _method(msg: http_types_pb2.HttpMethod) -> str:
    kind = msg.WhichOneof("type")
    if kind == "registered":
        return http_types_pb2.HttpMethod.Registered.Name(msg.registered)
    if kind == "unregistered" and msg.unregistered:
        return msg.unregistered
    raise DecodeError("method match without a method")


def _request_match(msg: destination_pb2.RequestMatch, depth: int = 0) -> RequestMatch:
    if depth > MAX_DEPTH:
        raise DecodeError(f"request match nested deeper than {MAX_DEPTH}")
    kind = msg.WhichOneof("match")
    if kind == "all":
        return AllOf(tuple(_request_match(m, depth + 1) for m in msg.all.matches))
    if kind == "any":
        return AnyOf(tuple(_request_match(m, depth + 1) for m in msg.any.matches))
    if kind == "not":
        return Not(_request_match(getattr(msg, "not"), depth + 1))
    if kind == "path":
        return PathRegex(msg.path.regex)
    if kind == "method":
        return Method(_method(msg.method))
    raise DecodeError("request match with no condition")


def _response_match(msg: destination_pb2.ResponseMatch, depth: int = 0) -> ResponseMatch:
    if depth > MAX_DEPTH:
        raise DecodeError(f"response match nested deeper than {MAX_DEPTH}")
    kind = msg.WhichOneof("match")
    if kind == "all":
        return AllOf(tuple(_response_match(m, depth + 1) for m in msg.all.matches))
    if kind == "any":
        return AnyOf(tuple(_response_match(m, depth + 1) for m in msg.any.matches))
    if kind == "not":
        return Not(_response_match(getattr(msg, "not"), depth + 1))
    if kind == "status":
        low = msg.status.min
        high = msg.status.max or low  # a missing bound makes the range one code
        if not 100 <= low <= high <= 599:
            raise DecodeError(f"status range {low}-{high}")
        return StatusRange(low, high)
    raise DecodeError("response match with no condition")


def _route(msg: destination_pb2.Route, budget: Budget) -> Route:
    if not msg.HasField("condition"):
        raise DecodeError("route without condition")
    try:
        condition = compiled(_request_match(msg.condition), budget)
    except BadRoute as exc:
        raise DecodeError(str(exc)) from None
    timeout = _seconds(msg.timeout) if msg.HasField("timeout") else 0.0
    return Route(
        condition=condition,
        response_classes=tuple(
            ResponseClass(_response_match(c.condition), c.is_failure) for c in msg.response_classes
        ),
        labels=tuple(sorted(msg.metrics_labels.items())),
        retryable=msg.is_retryable,
        timeout=timeout if timeout > 0 else None,
    )


def decode_profile(msg: destination_pb2.DestinationProfile) -> Profile:
    """The profile in `msg`; DecodeError when its `endpoint` is unusable."""
    rejected: list[str] = []
    routes = []
    regexes = Budget()  # what the routes' regexes share (meshlet.api.pathregex)
    for i, route in enumerate(msg.routes):
        try:
            routes.append(_route(route, regexes))
        except DecodeError as exc:
            rejected.append(f"routes[{i}]: {exc}")
    overrides = []
    for i, dst in enumerate(msg.dst_overrides):
        if dst.authority:
            overrides.append(DstOverride(dst.authority, dst.weight))
        else:
            rejected.append(f"dst_overrides[{i}]: no authority")
    budget = DEFAULT_RETRY_BUDGET
    if msg.HasField("retry_budget"):
        rb = msg.retry_budget
        ratio = float(f"{rb.retry_ratio:.7g}")  # a float32 on the wire: 0.2, not 0.200000003
        budget = RetryBudgetSpec(ratio, rb.min_retries_per_second, _seconds(rb.ttl))
    endpoint = decode_endpoint(msg.endpoint, {}) if msg.HasField("endpoint") else None
    return Profile(
        fqn=msg.fully_qualified_name or None,
        opaque=msg.opaque_protocol,
        endpoint=endpoint,
        dst_overrides=tuple(overrides),
        retry_budget=budget,
        routes=tuple(routes),
        rejected=tuple(rejected),
    )
