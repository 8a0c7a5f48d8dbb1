"""How one connection's requests to a service are routed by the service's outbound policy
(Linkerd's client policy, linkerd2-proxy `outbound/src/http/logical/policy`), once the policy
controller has answered and no ServiceProfile with routes or dst_overrides claims the service.

A request takes the best route and rule (`core.route_index`: the table the policy keeps for
its gRPC routes for a gRPC request when it has some, else for the routes of the connection's
HTTP version; the precedence is `core.route_select`'s); none matches: 404, as Linkerd's
outbound proxy answers. The rule's filters apply in order, then the drawn backend's: a
RequestHeaderModifier changes the request the engines forward
(`RouteTarget.request_headers`), a ResponseHeaderModifier the response they relay back
(`response_headers`), a RequestRedirect is answered here (3xx with `Location`), a
failure injector answers its share of requests, a Forbidden or Invalid filter and a `Fail`
backend answer with their status and `meshlet-proxy-error` saying why. The backend is drawn by
weight per request (`route_select.pick`); a balanced backend's endpoints come from discovery by
its path, balanced as dst_overrides' services are (`Destinations.pick_backend`). The rule's
request timeout (else the backend's) is the route's timeout, its idle timeout how long a
request may stay quiet. Requests are counted in Linkerd 2.16's outbound route families
(http/route_series.py: the parent Service, the route and the backend as the policy names them): a
route target carries its backend's series, looked up when the target is built; a rule's own
answer (a redirect, an injected failure, a route that cannot send) is counted on its route here.

The rule's retry resends a failed attempt (`core.failover`, with the Service's retry budget):
a retried HTTP status, a retried gRPC code (in the head, or in trailers that come with the
response's first body bytes: `ProxyStream` holds the response that long), a reset, or an
attempt's own timeout (`route_policy`), after the retry's backoff, and only while the
service's retry budget (`budget`: the one its ServiceProfile's retries share, by default 20 %
of its requests plus 10 a second) allows: a limit of 2 on a Service whose every replica fails
does not triple its load.

What a rule leads to is built once per policy version and kept for the connection (a
RouteTarget per backend): routing a request is a match, a draw and a dict read.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from meshlet.api.pathregex import RegexBudgetExceeded
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.core.accrual import FailureAccrual, InvalidAccrual
from meshlet.proxy.core.authz import HttpMatch, PathKind, prefix_length
from meshlet.proxy.core.client_policy import (
    Balance,
    ClientPolicy,
    Fail,
    FailureInjector,
    Filter,
    Forbidden,
    Forward,
    Invalid,
    PolicyRef,
    Protocol,
    Redirect,
    RequestHeaders,
    ResponseHeaders,
    Route,
    RouteBackend,
    Rule,
)
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.core.route_select import Selected, pick
from meshlet.proxy.core.routes import RoutePolicy
from meshlet.proxy.http import route_series
from meshlet.proxy.http.contract import (
    Endpoint,
    GrpcFailure,
    Redirection,
    RequestTarget,
    RouteError,
    RouteTarget,
    Wait,
)
from meshlet.proxy.http.route_series import UNKNOWN, parent_labels

if TYPE_CHECKING:
    from meshlet.proxy.core.endpoints import DiscoveredEndpoint
    from meshlet.proxy.core.retry_budget import RetryBudget
    from meshlet.proxy.discovery.outbound_policy import Followed
    from meshlet.proxy.http.route_series import BackendSeries, RouteSeries
    from meshlet.proxy.metrics import ProxyMetrics
    from meshlet.proxy.outbound.destinations import Destinations

NO_ROUTE: Final = RouteError(404, "no route found for request")  # linkerd2-proxy's words
NO_BACKEND: Final = RouteError(500, "the route has no backends")
FORBIDDEN: Final = RouteError(403, "the route forbids the request")
INVALID: Final = "the route is invalid: "
GRPC_DEADLINE_EXCEEDED: Final = 4

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackendPicker:
    """Each attempt balanced over the endpoints of the backend discovery names `path`."""

    mesh: Destinations
    path: str
    session: SessionProtocol

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError | Wait:
        return self.mesh.pick_backend(self.path, self.session, after)


@dataclass(frozen=True, slots=True)
class ForwardPicker:
    """The one endpoint of a forward backend."""

    mesh: Destinations
    endpoint: DiscoveredEndpoint
    session: SessionProtocol

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError:
        return self.mesh.reach(self.endpoint, self.session)


class PolicyRouter:
    """Routes the requests of one connection to one service by its outbound policy."""

    def __init__(
        self,
        mesh: Destinations,
        metrics: ProxyMetrics,
        session: SessionProtocol,
        dst: str,
        rng: random.Random | None = None,
        budget: RetryBudget | None = None,
    ) -> None:
        self._mesh = mesh
        self._metrics = metrics
        self._session = session
        self._dst = dst
        self._budget = budget
        self._rng = rng or random.Random()
        self._followed: Followed | None = None
        self._version = -1
        # by (route, rule, backend) index: what requests sent there are routed to
        self._targets: dict[tuple[int, int, int], tuple[RouteTarget | RouteError, BackendSeries]]
        self._targets = {}
        self._route_series: dict[int, RouteSeries] = {}  # by route index: its route metrics

    def route(self, followed: Followed, request: RequestTarget) -> RouteTarget | RouteError | None:
        """The request's route by the policy; None when the policy has no HTTP routes (an
        opaque or TLS port, as the controller sees it): the caller routes as without it."""
        policy = followed.policy
        assert policy is not None
        if followed is not self._followed or followed.version != self._version:
            self._followed, self._version = followed, followed.version
            self._targets, self._route_series = {}, {}
        routes, grpc = self._routes(policy, request)
        if not routes:
            return None
        if len(routes) == 1 and _matches_all(routes[0]):
            selected: Selected | None = Selected(0, 0, routes[0].rules[0])  # a default route
        else:
            try:
                selected = policy.table(routes, grpc).select_parts(
                    request.authority, request.method, request.path,
                    getattr(request, "headers", ()),
                )  # fmt: skip
            except RegexBudgetExceeded as exc:
                self._metrics.route_regex_budget_exceeded_total.labels("outbound").inc()
                return RouteError(exc.status, str(exc))
        if selected is None:
            return NO_ROUTE
        rule = selected.target
        answered = self._answered(rule.filters, rule, request, grpc)
        if answered is None:
            backend = pick(rule.distribution, self._rng)
            if backend is None:
                answered = NO_BACKEND
            elif backend.filters:
                answered = self._answered(backend.filters, rule, request, grpc)
        if answered is not None:
            self._route_metrics(policy.meta, routes, selected.route, grpc).finished(
                *_answer_labels(answered), 0.0
            )
            return answered
        assert backend is not None
        at = rule.distribution.backends.index(backend)
        key = (selected.route, selected.rule, at)
        held = self._targets.get(key)
        if held is None:
            route = self._route_metrics(policy.meta, routes, selected.route, grpc)
            series = route_series.backend(route, backend.backend.meta)
            target = self._target(rule, backend, policy.meta)
            if isinstance(target, RouteTarget):
                target = target._replace(series=series)
            held = self._targets[key] = (target, series)
        target, series = held
        series.requests.value += 1
        if isinstance(target, RouteError):  # a Fail backend: answered here
            series.route.finished(0, None, UNKNOWN, 0.0)
        return target

    def _route_metrics(
        self, parent: PolicyRef, routes: tuple[Route, ...], at: int, grpc: bool
    ) -> RouteSeries:
        """The route metrics of `routes[at]`, looked up once per policy version."""
        series = self._route_series.get(at)
        if series is None:
            m = self._metrics
            families = m.outbound_grpc_route if grpc else m.outbound_http_route
            series = self._route_series[at] = route_series.route(families, parent, routes[at].meta)
        return series

    def _routes(
        self, policy: ClientPolicy, request: RequestTarget
    ) -> tuple[tuple[Route, ...], bool]:
        """The routes a request may take: gRPC routes for a gRPC request (or any request to a
        gRPC port); else those of the connection's HTTP version, or of the other one when the
        port declares only it (an `http` or `h2c` appProtocol)."""
        if policy.grpc and (policy.protocol is Protocol.GRPC or getattr(request, "grpc", False)):
            return policy.grpc, True
        h2 = self._session is SessionProtocol.HTTP2
        return ((policy.http2 or policy.http1) if h2 else (policy.http1 or policy.http2)), False

    def _answered(
        self, filters: tuple[Filter, ...], rule: Rule, request: RequestTarget, grpc: bool
    ) -> RouteError | None:
        """The local answer a filter gives the request, if one does (a gRPC route's failure
        injector names a gRPC code: answered as HTTP 500 carrying it)."""
        for f in filters:
            if isinstance(f, Redirect):
                return RouteError(f.status, Redirection(location(f, rule, request)))
            if isinstance(f, FailureInjector):
                if self._rng.randrange(f.denominator) < f.numerator:
                    why = f.message or "failure injected by the route"
                    if grpc:
                        return RouteError(500, GrpcFailure(why, f.status))
                    return RouteError(f.status, why)
            elif isinstance(f, Forbidden):
                return FORBIDDEN
            elif isinstance(f, Invalid):
                return RouteError(500, f"{INVALID}{f.message}")
        return None

    def _target(
        self, rule: Rule, backend: RouteBackend, parent: PolicyRef
    ) -> RouteTarget | RouteError:
        dispatch = backend.backend.dispatch
        if isinstance(dispatch, Fail):
            return RouteError(500, f"backend {backend.backend.meta}: {dispatch.message}")
        filters = rule.filters + backend.filters
        timeout = rule.timeouts.request or backend.request_timeout
        endpoints: BackendPicker | ForwardPicker
        if isinstance(dispatch, Balance):
            self._mesh.set_failure_accrual(dispatch.path, _accrual(dispatch))
            self._mesh.route_parent(dispatch.path, parent_labels(parent))
            endpoints = BackendPicker(self._mesh, dispatch.path, self._session)
        else:
            assert isinstance(dispatch, Forward)
            endpoints = ForwardPicker(self._mesh, dispatch.endpoint, self._session)
        policy = route_policy(rule, timeout)
        return RouteTarget(
            self._dst, policy, self._budget, endpoints,
            _modifier(filters, RequestHeaders), _modifier(filters, ResponseHeaders),
        )  # fmt: skip


def _answer_labels(answer: RouteError) -> tuple[int, str | None, str]:
    """A rule's local answer as Linkerd's route metrics label it: a redirect's or an injected
    failure's status (or gRPC code); a route that cannot send the request, an error."""
    reason = answer.reason
    if isinstance(reason, GrpcFailure):
        return answer.status, reason.code, ""
    if answer is NO_BACKEND or answer is FORBIDDEN or reason.startswith(INVALID):
        return 0, None, UNKNOWN
    return answer.status, None, ""


def route_policy(rule: Rule, timeout: float | None) -> RoutePolicy:
    """What the engines apply of a rule: its request timeout (`timeout`: the rule's, else the
    backend's) over every attempt; per attempt the rule's response timeout or its retry's
    per-try timeout, whichever is shorter (the one its 504 names); its retries. An attempt that
    times out is retried when the retry has a timeout of its own, or retries the status the
    proxy answers for one (504, gRPC DEADLINE_EXCEEDED)."""
    retry = rule.retry
    per_try = retry.timeout if retry is not None else None
    response = rule.timeouts.response
    attempt = min(response, per_try) if response and per_try else response or per_try
    name = "per-try" if per_try and (not response or per_try < response) else "response"
    if retry is None or retry.limit <= 0:
        return RoutePolicy(timeout=timeout, idle_timeout=rule.timeouts.idle,
                           attempt_timeout=attempt, attempt_timeout_name=name)  # fmt: skip
    retries_timeouts = per_try is not None or any(a <= 504 <= b for a, b in retry.statuses) or (
        GRPC_DEADLINE_EXCEEDED in retry.grpc_codes
    )  # fmt: skip
    b = retry.backoff
    return RoutePolicy(
        timeout=timeout, idle_timeout=rule.timeouts.idle, retryable=True,
        retry_statuses=retry.statuses, retry_grpc_codes=retry.grpc_codes, retry_limit=retry.limit,
        attempt_timeout=attempt, retry_timeouts=retries_timeouts, attempt_timeout_name=name,
        retry_backoff=(b.min, b.max, b.jitter) if b is not None else None,
    )  # fmt: skip


def _matches_all(route: Route) -> bool:
    """The route takes every request with its one rule (the policy's default route)."""
    if route.hosts or len(route.rules) != 1:
        return False
    matches = route.rules[0].matches
    return not matches or any(m.matches_all for m in matches)


def _modifier(
    filters: tuple[Filter, ...], kind: type[RequestHeaders] | type[ResponseHeaders]
) -> HeaderModifier | None:
    """The filters of `kind` as one modification, in order; None when there is none."""
    out: HeaderModifier | None = None
    for f in filters:
        if isinstance(f, kind):
            out = f.modifier if out is None else out.then(f.modifier)
    return out


def location(redirect: Redirect, rule: Rule, request: RequestTarget) -> str:
    """Where a RequestRedirect sends the request: each part it leaves unset is the request's
    own (a prefix replaces the path prefix the rule matched)."""
    scheme = redirect.scheme or "http"
    authority = request.authority or ""
    host, port = _host_port(authority)
    host = redirect.host or host
    if redirect.port is not None:
        port = str(redirect.port)
    elif redirect.scheme is not None:
        port = ""
    path, sep, query = request.path.partition("?")
    if redirect.full_path is not None:
        path = redirect.full_path
    elif redirect.prefix is not None:
        matched = _matched_prefix(rule, path)
        rest = path[len(matched) :] if matched else path
        path = redirect.prefix.rstrip("/") + ("/" + rest.lstrip("/") if rest else "") or "/"
    where = f"{host}:{port}" if port else host
    return f"{scheme}://{where}{path}{sep}{query}"


def _host_port(authority: str) -> tuple[str, str]:
    if authority.startswith("["):
        end = authority.find("]")
        return authority[: end + 1], authority[end + 2 :]
    host, _, port = authority.partition(":")
    return host, port


def _matched_prefix(rule: Rule, path: str) -> str:
    for m in rule.matches:
        p = m.path if isinstance(m, HttpMatch) else None
        if p is not None and p.kind is PathKind.PREFIX and prefix_length(p.value, path) is not None:
            return p.value.rstrip("/")
    return ""


def _accrual(balance: Balance) -> FailureAccrual | None:
    """The balancer's failure accrual from the backend's (None: off). Values the breaker cannot
    take leave it off for that backend, said in the log."""
    spec = balance.accrual
    if spec is None:
        return None
    try:
        return FailureAccrual(spec.max_failures, spec.backoff.min, spec.backoff.max,
                              spec.backoff.jitter)  # fmt: skip
    except InvalidAccrual as exc:
        log.warning("backend %s: failure accrual left off: %s", balance.path, exc)
        return None
