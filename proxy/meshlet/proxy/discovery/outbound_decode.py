"""The policy controller's `OutboundPolicy` decoded into a `ClientPolicy` (pure), field by field
as linkerd2-proxy reads it (`proxy/client-policy`).

A policy is taken whole or not at all: every problem found is collected, with where it is
("http1 route 2 (HTTPRoute.gateway.networking.k8s.io/shop/cart) rule 0 backend 1: ..."), and
one `DecodeError` names them all (the first `MAX_PROBLEMS`), so the caller keeps the policy it
had rather than routing by a part of the new one. A rule's matches are read by the inbound
decoder's functions (`policy_decode.http_match`, `grpc_match`, `host_matches`): the messages are
shared, so both sides accept and refuse the same things. Regexes are RE2 (`meshlet.api.pathregex`:
linear-time matching, a bounded program), so no pattern a controller sends can make matching a
request backtrack without end; a pattern RE2 refuses refuses the policy, and so do regexes past
the budget the policy's regexes share (`pathregex.Budget`: a pattern the HTTP/1 and HTTP/2
routes of a detect port both use counts once); what they may cost a request is paid per
request (`pathregex.Meter`).

Bounds, each refusing the policy: at most `MAX_ROUTES` routes per protocol (a detect port's
policy carries a Service's HTTPRoutes twice, for HTTP/1 and HTTP/2), `MAX_BACKENDS` backends
per distribution, weights at most `MAX_WEIGHT` (the Gateway API's maximum) with a positive total,
retry limits within Linkerd's u16. Filters the contract defines are all decoded (the router
applies them); a filter, distribution, accrual or dispatch without a kind is an error, never
skipped: a route served without one of its filters would be another route than configured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Final, TypeVar

from google.protobuf import duration_pb2

from meshlet.api import http_route_pb2, meta_pb2, outbound_pb2
from meshlet.api.pathregex import Budget
from meshlet.proxy.core.client_policy import (
    EMPTY,
    Backend,
    Balance,
    ClientPolicy,
    ConsecutiveFailures,
    Dispatch,
    Distribution,
    ExponentialBackoff,
    Fail,
    FailureInjector,
    Filter,
    Forbidden,
    Forward,
    Invalid,
    OpaqueRoute,
    PeakEwma,
    Penalty,
    PolicyRef,
    Protocol,
    Queue,
    Redirect,
    RequestHeaders,
    ResponseHeaders,
    Retry,
    Route,
    RouteBackend,
    Rule,
    Timeouts,
    with_accrual,
)
from meshlet.proxy.core.header_modifier import HeaderModifier, compile_modifier
from meshlet.proxy.discovery.decode import DecodeError, decode_endpoint
from meshlet.proxy.discovery.policy_decode import (
    duration_seconds,
    grpc_match,
    host_matches,
    http_match,
)

MAX_ROUTES: Final = 10_000
MAX_BACKENDS: Final = 1_000  # per distribution
MAX_WEIGHT: Final = 1_000_000
MAX_RETRIES: Final = 65_535
MAX_PROBLEMS: Final = 20
# Linkerd's defaults for a PenaltyPeakEwma field left unset (seconds)
_PENALTY_DEFAULTS: Final = {"default_rtt": 0.03, "decay": 10.0, "penalty": 5.0,
                            "penalty_decay": 10.0, "max_retry_after": 300.0}  # fmt: skip
_GRPC_CODES: Final = {"cancelled": 1, "deadine_exceeded": 4, "resource_exhausted": 8,
                      "internal": 13, "unavailable": 14}  # fmt: skip
_SCHEMES: Final = {0: "http", 1: "https"}

T = TypeVar("T")
_HttpRule = outbound_pb2.HttpRoute.Rule
_GrpcRule = outbound_pb2.GrpcRoute.Rule


class _Problems:
    """Every problem of one message, each with where it is; and the budget its regexes share."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.regexes = Budget()

    def attempt(self, where: str, read: Callable[[], T]) -> T | None:
        try:
            return read()
        except DecodeError as exc:
            self.found.append(f"{where}: {exc}" if where else str(exc))
            return None

    def raise_any(self) -> None:
        if not self.found:
            return
        shown = "; ".join(self.found[:MAX_PROBLEMS])
        more = len(self.found) - MAX_PROBLEMS
        tail = f"; and {more} more" if more > 0 else ""
        count = len(self.found)
        raise DecodeError(f"{count} problem{'s' if count > 1 else ''}: {shown}{tail}")


def decode_outbound(msg: outbound_pb2.OutboundPolicy) -> ClientPolicy:
    """The target's policy; DecodeError naming every problem when any field breaks the
    contract."""
    problems = _Problems()
    meta = problems.attempt("metadata", lambda: ref(msg.metadata, "policy metadata")
                            if msg.HasField("metadata") else _missing("metadata"))  # fmt: skip
    kind = msg.protocol.WhichOneof("kind") if msg.HasField("protocol") else None
    if kind is None:
        problems.found.append("no protocol")
        problems.raise_any()
    total = _route_count(msg.protocol)
    if total > MAX_ROUTES:
        raise DecodeError(f"{total} routes, more than the {MAX_ROUTES} a protocol may have")
    proto = msg.protocol
    policy: dict[str, Any] = {}
    if kind == "detect":
        d = proto.detect
        policy["detect_timeout"] = problems.attempt("detect timeout", lambda: _duration(d.timeout))
        for name in ("timeout", "http1", "http2", "opaque"):
            if not d.HasField(name):
                problems.found.append(f"detect without {name}")
        policy["http1"] = _http_routes(d.http1, "http1", problems)
        policy["http2"] = _http_routes(d.http2, "http2", problems)
        policy["opaque"] = _opaque_routes(d.opaque.routes, "opaque", problems)
    elif kind in ("http1", "http2"):
        policy[kind] = _http_routes(getattr(proto, kind), kind, problems)
    elif kind == "grpc":
        policy["grpc"] = _grpc_routes(proto.grpc, problems)
    elif kind == "opaque":
        policy["opaque"] = _opaque_routes(proto.opaque.routes, "opaque", problems)
    else:
        for at, route in enumerate(proto.tls.routes):
            if route.snis:
                problems.found.append(f"tls route {at}: SNI matches, which the proxy cannot "
                                      "route by")  # fmt: skip
        policy["opaque"] = _opaque_routes(proto.tls.routes, "tls", problems)
    problems.raise_any()
    return ClientPolicy(meta or PolicyRef.default(""), Protocol(kind), **policy)


def _route_count(proto: outbound_pb2.ProxyProtocol) -> int:
    """The routes of the policy's longest list (one oneof is set: the others are empty)."""
    d = proto.detect
    return max(len(d.http1.routes), len(d.http2.routes), len(d.opaque.routes),
               len(proto.http1.routes), len(proto.http2.routes), len(proto.grpc.routes),
               len(proto.opaque.routes), len(proto.tls.routes))  # fmt: skip


def _missing(what: str) -> Any:
    raise DecodeError(f"no {what}")


def _duration(msg: duration_pb2.Duration) -> float:
    return duration_seconds(msg)


def _duration_or(msg: Any, name: str, default: float) -> float:
    """The duration field `name` of `msg`, `default` when unset."""
    return _duration(getattr(msg, name)) if msg.HasField(name) else default


def _meta(item: Any) -> PolicyRef:
    return ref(item.metadata, "metadata") if item.HasField("metadata") else _missing("metadata")


def ref(msg: meta_pb2.Metadata, what: str) -> PolicyRef:
    """Linkerd's outbound `Meta`: a default by name, or a resource with its group, kind, name
    and namespace all set."""
    kind = msg.WhichOneof("kind")
    if kind == "default":
        return PolicyRef.default(msg.default)
    if kind != "resource":
        raise DecodeError(f"{what} without a kind")
    r = msg.resource
    empty = [f for f in ("group", "kind", "name", "namespace") if not getattr(r, f)]
    if empty:
        raise DecodeError(f"{what} without {', '.join(empty)}")
    port = r.port if 0 < r.port <= 65535 else 0
    return PolicyRef(r.kind, r.name, r.group, r.namespace, r.section, port)


# -- routes ---------------------------------------------------------------------------------


def _http_routes(spec: Any, what: str, problems: _Problems) -> tuple[Route, ...]:
    """An Http1 or Http2 protocol's routes, its failure accrual on their balancers."""
    routes = tuple(
        r for at, item in enumerate(spec.routes)
        if (r := _route(item, f"{what} route {at}", problems, _http_rule)) is not None
    )  # fmt: skip
    return _accrued(routes, spec, what, problems)


def _grpc_routes(spec: outbound_pb2.ProxyProtocol.Grpc, problems: _Problems) -> tuple[Route, ...]:
    routes = tuple(
        r for at, item in enumerate(spec.routes)
        if (r := _route(item, f"grpc route {at}", problems, _grpc_rule)) is not None
    )  # fmt: skip
    return _accrued(routes, spec, "grpc", problems)


def _accrued(routes: tuple[Route, ...], spec: Any, what: str, problems: _Problems
             ) -> tuple[Route, ...]:  # fmt: skip
    if not spec.HasField("failure_accrual"):
        return routes
    found = problems.attempt(f"{what} failure accrual", lambda: accrual(spec.failure_accrual))
    return routes if found is None else with_accrual(routes, found)


def _route(
    item: Any, where: str, problems: _Problems, rule: Callable[[Any, str, _Problems], Rule | None]
) -> Route | None:
    meta = problems.attempt(where, functools.partial(_meta, item))
    if meta is not None:
        where = f"{where} ({meta})"
    hosts = problems.attempt(where, lambda: host_matches(item.hosts))
    rules = [rule(r, f"{where} rule {at}", problems) for at, r in enumerate(item.rules)]
    if meta is None or hosts is None or any(r is None for r in rules):
        return None
    return Route(meta, hosts, tuple(r for r in rules if r is not None))


def _http_rule(msg: _HttpRule, where: str, problems: _Problems) -> Rule | None:
    budget = problems.regexes
    matches = problems.attempt(where, lambda: tuple(http_match(m, budget) for m in msg.matches))
    filters = _filters(msg.filters, where, problems, _http_filter)
    distribution = _distribution(msg, where, problems, _http_filter)
    timeouts = problems.attempt(f"{where} timeouts", lambda: _timeouts(msg))
    retry = problems.attempt(f"{where} retry", lambda: _http_retry(msg.retry)
                             if msg.HasField("retry") else None)  # fmt: skip
    if matches is None or filters is None or distribution is None or timeouts is None:
        return None
    return Rule(matches, filters, distribution, timeouts, retry, msg.allow_l5d_request_headers)


def _grpc_rule(msg: _GrpcRule, where: str, problems: _Problems) -> Rule | None:
    budget = problems.regexes
    matches = problems.attempt(where, lambda: tuple(grpc_match(m, budget) for m in msg.matches))
    filters = _filters(msg.filters, where, problems, _grpc_filter)
    distribution = _distribution(msg, where, problems, _grpc_filter)
    timeouts = problems.attempt(f"{where} timeouts", lambda: _timeouts(msg))
    retry = problems.attempt(f"{where} retry", lambda: _grpc_retry(msg.retry)
                             if msg.HasField("retry") else None)  # fmt: skip
    if matches is None or filters is None or distribution is None or timeouts is None:
        return None
    return Rule(matches, filters, distribution, timeouts, retry, msg.allow_l5d_request_headers)


def _opaque_routes(items: Iterable[Any], what: str, problems: _Problems) -> tuple[OpaqueRoute, ...]:
    out = []
    for at, item in enumerate(items):
        where = f"{what} route {at}"
        meta = problems.attempt(where, functools.partial(_meta, item))
        rules = []
        for n, r in enumerate(item.rules):
            here = f"{where} rule {n}"
            filters = _filters(r.filters, here, problems, _opaque_filter)
            distribution = _distribution(r, here, problems, _opaque_filter)
            if filters is not None and distribution is not None:
                rules.append(Rule((), filters, distribution))
        if meta is not None and len(rules) == len(item.rules):
            out.append(OpaqueRoute(meta, tuple(rules)))
    return tuple(out)


def _timeouts(msg: _HttpRule | _GrpcRule) -> Timeouts:
    t = msg.timeouts
    request = _duration(t.request) if t.HasField("request") else None
    if request is None and msg.HasField("requestTimeout"):
        request = _duration(msg.requestTimeout)
    return Timeouts(
        request=request,
        response=_duration(t.response) if t.HasField("response") else None,
        idle=_duration(t.idle) if t.HasField("idle") else None,
    )


def _limit(value: int) -> int:
    if value > MAX_RETRIES:
        raise DecodeError(f"max_retries {value} is more than {MAX_RETRIES}")
    return value


def _retry_extras(msg: Any) -> dict[str, Any]:
    return {
        "limit": _limit(msg.max_retries),
        "max_request_bytes": msg.max_request_bytes,
        "timeout": _duration(msg.timeout) if msg.HasField("timeout") else None,
        "backoff": backoff(msg.backoff) if msg.HasField("backoff") else None,
    }


def _http_retry(msg: outbound_pb2.HttpRoute.Retry) -> Retry:
    """Linkerd's: conditions are required, each range within 1..599 and in order."""
    if not msg.HasField("conditions"):
        raise DecodeError("no conditions")
    ranges = []
    for r in msg.conditions.status_ranges:
        if not (0 < r.start <= r.end <= 599):
            raise DecodeError(f"status range {r.start}-{r.end} is not within 1-599 in order")
        ranges.append((r.start, r.end))
    return Retry(statuses=tuple(ranges), **_retry_extras(msg))


def _grpc_retry(msg: outbound_pb2.GrpcRoute.Retry) -> Retry:
    if not msg.HasField("conditions"):
        raise DecodeError("no conditions")
    codes = frozenset(code for name, code in _GRPC_CODES.items()
                      if getattr(msg.conditions, name))  # fmt: skip
    return Retry(grpc_codes=codes, **_retry_extras(msg))


def backoff(msg: outbound_pb2.ExponentialBackoff) -> ExponentialBackoff:
    """Linkerd's `try_backoff`: min and max required, min <= max, max above 0, jitter in
    [0, 100]."""
    if not msg.HasField("min_backoff") or not msg.HasField("max_backoff"):
        raise DecodeError("backoff without min_backoff or max_backoff")
    low, high = _duration(msg.min_backoff), _duration(msg.max_backoff)
    jitter = msg.jitter_ratio
    if low > high or high == 0:
        raise DecodeError(f"backoff {low}s-{high}s: the maximum must be above 0 and the minimum")
    if not 0.0 <= jitter <= 100.0:  # also refuses NaN
        raise DecodeError(f"backoff jitter {jitter} is not within 0-100")
    return ExponentialBackoff(low, high, jitter)


def accrual(msg: outbound_pb2.FailureAccrual) -> ConsecutiveFailures:
    kind = msg.WhichOneof("kind")
    if kind != "consecutive_failures":
        what = f"kind {kind}" if kind else "no kind"
        raise DecodeError(f"{what}; the proxy implements consecutive_failures only")
    c = msg.consecutive_failures
    if not c.HasField("backoff"):
        raise DecodeError("consecutive_failures without a backoff")
    return ConsecutiveFailures(c.max_failures, backoff(c.backoff))


# -- filters --------------------------------------------------------------------------------


def _filters(
    items: Iterable[Any], where: str, problems: _Problems, read: Callable[[Any], Filter]
) -> tuple[Filter, ...] | None:
    out = [problems.attempt(f"{where} filter {at}", functools.partial(read, f))
           for at, f in enumerate(items)]  # fmt: skip
    return None if any(f is None for f in out) else tuple(f for f in out if f is not None)


def _modifier(msg: Any) -> HeaderModifier:
    try:
        return compile_modifier(
            [(h.name, h.value) for h in msg.add.headers],
            [(h.name, h.value) for h in msg.set.headers],
            msg.remove,
        )
    except ValueError as exc:
        raise DecodeError(str(exc)) from None


def _injector(msg: Any, status: int, lowest: int, highest: int) -> FailureInjector:
    if not lowest <= status <= highest:
        raise DecodeError(f"failure injector status {status} is not within {lowest}-{highest}")
    numerator, denominator = 1, 1
    if msg.HasField("ratio"):
        numerator, denominator = msg.ratio.numerator, msg.ratio.denominator
        if denominator == 0 or numerator > denominator:
            raise DecodeError(f"failure injector ratio {numerator}/{denominator}")
    return FailureInjector(status, msg.message, numerator, denominator)


def _http_filter(msg: outbound_pb2.HttpRoute.Filter) -> Filter:
    kind = msg.WhichOneof("kind")
    if kind == "request_header_modifier":
        return RequestHeaders(_modifier(msg.request_header_modifier))
    if kind == "response_header_modifier":
        return ResponseHeaders(_modifier(msg.response_header_modifier))
    if kind == "failure_injector":
        return _injector(msg.failure_injector, msg.failure_injector.status, 100, 599)
    if kind == "redirect":
        return _redirect(msg.redirect)
    raise DecodeError("a filter without a kind")


def _grpc_filter(msg: outbound_pb2.GrpcRoute.Filter) -> Filter:
    kind = msg.WhichOneof("kind")
    if kind == "request_header_modifier":
        return RequestHeaders(_modifier(msg.request_header_modifier))
    if kind == "failure_injector":
        return _injector(msg.failure_injector, msg.failure_injector.code, 1, 16)
    raise DecodeError("a filter without a kind")


def _opaque_filter(msg: outbound_pb2.OpaqueRoute.Filter) -> Filter:
    kind = msg.WhichOneof("kind")
    if kind == "invalid":
        return Invalid(msg.invalid.message)
    if kind == "forbidden":
        return Forbidden()
    raise DecodeError("a filter without a kind")


def _redirect(msg: http_route_pb2.RequestRedirect) -> Redirect:
    status = msg.status or 301
    if not 300 <= status <= 399:
        raise DecodeError(f"redirect status {status} is not a redirection (3xx)")
    if msg.port > 65535:
        raise DecodeError(f"redirect port {msg.port}")
    scheme = None
    if msg.HasField("scheme"):
        which = msg.scheme.WhichOneof("type")
        scheme = (_SCHEMES.get(msg.scheme.registered) if which == "registered"
                  else msg.scheme.unregistered or None)  # fmt: skip
        if scheme is None:
            raise DecodeError("redirect scheme without a value")
    path = msg.path.WhichOneof("replace") if msg.HasField("path") else None
    return Redirect(
        status,
        scheme,
        msg.host or None,
        msg.port or None,
        msg.path.full if path == "full" else None,
        msg.path.prefix if path == "prefix" else None,
    )


# -- distributions and backends -------------------------------------------------------------


def _distribution(
    rule: Any, where: str, problems: _Problems, read: Callable[[Any], Filter]
) -> Distribution | None:
    """A rule's backends; a rule without a distribution has none (EMPTY), as Linkerd reads an
    unset one."""
    if not rule.HasField("backends"):
        return EMPTY
    msg = rule.backends
    kind = msg.WhichOneof("kind")
    if kind == "empty":
        return EMPTY
    if kind is None:
        problems.found.append(f"{where}: a distribution without a kind")
        return None
    weighted = kind == "random_available"
    items = getattr(msg, kind).backends
    if not items:
        problems.found.append(f"{where}: a {kind} distribution without backends")
        return None
    if len(items) > MAX_BACKENDS:
        problems.found.append(f"{where}: {len(items)} backends, more than {MAX_BACKENDS}")
        return None
    backends = []
    for at, item in enumerate(items):
        here = f"{where} backend {at}"
        weight = 1
        if weighted:
            weight = item.weight
            if weight > MAX_WEIGHT:
                problems.found.append(f"{here}: weight {weight} is more than {MAX_WEIGHT}")
            if not item.HasField("backend"):
                problems.found.append(f"{here}: a weighted backend without a backend")
                continue
            item = item.backend
        rb = _route_backend(item, weight, here, problems, read)
        if rb is not None:
            backends.append(rb)
    if len(backends) < len(items):
        return None
    if not weighted:
        return Distribution(Dispatch.FIRST_AVAILABLE, tuple(backends))
    if all(b.weight == 0 for b in backends):
        problems.found.append(f"{where}: every backend has weight 0")
        return None
    return Distribution.weighted(tuple(backends))


def _route_backend(
    msg: Any, weight: int, where: str, problems: _Problems, read: Callable[[Any], Filter]
) -> RouteBackend | None:
    backend = problems.attempt(where, lambda: decode_backend(msg.backend)
                               if msg.HasField("backend") else _missing("backend"))  # fmt: skip
    filters = _filters(msg.filters, where, problems, read)
    timeout = None
    if "requestTimeout" in msg.DESCRIPTOR.fields_by_name and msg.HasField("requestTimeout"):
        timeout = problems.attempt(f"{where} request timeout",
                                   lambda: _duration(msg.requestTimeout))  # fmt: skip
    if backend is None or filters is None:
        return None
    return RouteBackend(backend, filters, timeout, weight)


def decode_backend(msg: outbound_pb2.Backend) -> Backend:
    """Linkerd's: metadata and a queue required; a balancer needs its discovery and load; a
    backend without a dispatcher fails its requests."""
    if not msg.HasField("metadata"):
        raise DecodeError("no backend metadata")
    meta = ref(msg.metadata, "backend metadata")
    if not msg.HasField("queue"):
        raise DecodeError(f"backend {meta} without a queue")
    if not msg.queue.HasField("failfast_timeout"):
        raise DecodeError(f"backend {meta} queue without failfast_timeout")
    queue = Queue(msg.queue.capacity, _duration(msg.queue.failfast_timeout))
    kind = msg.WhichOneof("kind")
    dispatch: Balance | Forward | Fail
    if kind == "balancer":
        dispatch = _balance(msg.balancer, meta)
    elif kind == "forward":
        dispatch = Forward(decode_endpoint(msg.forward, {}))
    else:
        dispatch = Fail(f"backend {meta} has no dispatcher")
    return Backend(meta, queue, dispatch)


def _balance(msg: outbound_pb2.Backend.BalanceP2c, meta: PolicyRef) -> Balance:
    if msg.discovery.WhichOneof("kind") != "dst":
        raise DecodeError(f"backend {meta} balancer without discovery")
    path = msg.discovery.dst.path
    if not path:
        raise DecodeError(f"backend {meta} balancer with an empty discovery path")
    load = msg.WhichOneof("load")
    if load == "peak_ewma":
        spec = msg.peak_ewma
        for name in ("default_rtt", "decay"):
            if not spec.HasField(name):
                raise DecodeError(f"backend {meta} peak EWMA without {name}")
        return Balance(path, PeakEwma(_duration(spec.default_rtt), _duration(spec.decay)))
    if load == "penalty_peak_ewma":
        p = msg.penalty_peak_ewma
        v = {name: _duration_or(p, name, default) for name, default in _PENALTY_DEFAULTS.items()}
        penalty = Penalty(v["penalty"], v["penalty_decay"], v["max_retry_after"])
        dropped = not any((penalty.penalty, penalty.decay, penalty.max_retry_after))
        return Balance(path, PeakEwma(v["default_rtt"], v["decay"], None if dropped else penalty))
    raise DecodeError(f"backend {meta} balancer without a load")
