"""Inbound authorization as the inbound stack applies it: once per connection for opaque TCP
(`InboundPolicy.connection`), per request for HTTP and gRPC (`PolicyRouter`, the connection's
router, in front of the `FixedRouter` that forwards to the pod). A request's route also brings
its rule's request header modification, which the router hands to the engines on the
`RouteTarget` it returns.

The client is the socket's address and the identity the mesh TLS handshake proved; nothing a
request carries counts. A router reads the port's current policy at each request (a dict read)
and recomputes the client's decisions only when the policy changed, so a change applies to the
next request of every connection. Rate limits are per port and policy, shared by every
connection. Denials are counted with Linkerd's metric names and logged, a few lines a second at
most (a flood of denials must not flood the log).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Final

from meshlet.proxy.core import authz
from meshlet.proxy.core.authz import (
    Allowed,
    Client,
    Decision,
    Denied,
    NoRoute,
    OverBudget,
    Permits,
    ServerPolicy,
)
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.core.ratelimit import RateLimiter
from meshlet.proxy.http.contract import (
    RequestTarget,
    RouteError,
    Router,
    RouteTarget,
    Wait,
    settle,
)
from meshlet.proxy.io.counters import ConnLabels, Counted
from meshlet.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

LOG_LINES_PER_SECOND: Final = 5.0
UNAUTHORIZED: Final = "unauthorized request on route"  # linkerd2-proxy's words
Policies = Callable[[int], ServerPolicy]


class LogBudget:
    """Lets `rate` lines a second through (a burst of as many), and says how many it held back."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = rate
        self._at = clock()
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: drop this line; else the lines dropped since the last one let through."""
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            self.suppressed += 1
            return None
        self._tokens -= 1.0
        dropped, self.suppressed = self.suppressed, 0
        return dropped


class InboundPolicy:
    """The proxy's inbound policies (`policies(port)`), its rate limiters and its denial log."""

    def __init__(
        self, policies: Policies, metrics: ProxyMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policies = policies
        self.metrics = metrics
        self.clock = clock
        self._limiters: dict[int, tuple[ServerPolicy, RateLimiter]] = {}
        self._log = LogBudget(LOG_LINES_PER_SECOND, clock)

    def limiter(self, port: int, policy: ServerPolicy) -> RateLimiter | None:
        """The port's rate limiter under `policy` (a new policy starts new buckets)."""
        spec = policy.rate_limit
        if spec is None:
            return None
        held = self._limiters.get(port)
        if held is None or held[0] is not policy:
            if held is not None and held[1].spec == spec:
                limiter = held[1]  # the same limits in a new policy: the buckets carry on
            else:
                limiter = RateLimiter(spec, self.clock())
            self._limiters[port] = (policy, limiter)
            return limiter
        return held[1]

    def connection(self, client: Client, port: int, labels: ConnLabels) -> bool:
        """Whether an opaque connection from `client` to `port` may be relayed (counted)."""
        policy = self.policies(port)
        decision = client.connection(policy)
        srv = _srv(labels.target_addr, policy)
        tls = _tls(labels)
        if isinstance(decision, Allowed):
            self.metrics.inbound_tcp_authz_allow_total.labels(
                *srv, *decision.authz.meta, *tls).inc()  # fmt: skip
            if decision.authz.meta.is_audit:
                self.audit(client, policy, f"server {policy.meta}")
            return True
        self.metrics.inbound_tcp_authz_deny_total.labels(*srv, *tls).inc()
        self.denied(client, port, decision.reason)
        return False

    def denied(self, client: Client, port: int, reason: str) -> None:
        dropped = self._log.allow()
        if dropped is None:
            return
        more = f" ({dropped} more denials not logged)" if dropped else ""
        log.warning("inbound: %s denied on port %d: %s%s", _who(client), port, reason, more)

    def audit(self, client: Client, policy: ServerPolicy, what: str) -> None:
        dropped = self._log.allow()
        if dropped is None:
            return
        log.info("inbound: %s allowed by the audit policy on %s: it would be denied otherwise",
                 _who(client), what)  # fmt: skip


def _who(client: Client) -> str:
    if client.client_id:
        return f"client {client.client_id} at {client.ip}"
    return f"client {client.ip} ({'mesh TLS, no identity' if client.tls else 'no TLS'})"


def _srv(target_addr: str, policy: ServerPolicy) -> tuple[str, str, str, str]:
    return (target_addr, *policy.meta)


def _tls(labels: ConnLabels) -> tuple[str, str, str]:
    return (labels.tls, labels.no_tls_reason if labels.tls != "true" else "", labels.client_id)


def client_of(ip: str, client_id: str | None, tls: bool) -> Client:
    return Client(ipaddress.ip_address(ip.split("%", 1)[0]), client_id or None, tls)


class PolicyRouter:
    """One connection's router: each request is authorized on its route, rate limited, then
    routed by `inner`."""

    __slots__ = (
        "_allow",
        "_client",
        "_deny",
        "_inner",
        "_labels",
        "_limiter",
        "_modifiers",
        "_permits",
        "_policy",
        "_port",
        "_shared",
        "_trivial",
    )

    def __init__(
        self, inner: Router, shared: InboundPolicy, client: Client, port: int, labels: ConnLabels
    ) -> None:
        self._inner = inner
        self._shared = shared
        self._client = client
        self._port = port
        self._labels = labels
        self._policy: ServerPolicy | None = None
        self._permits: Permits
        self._trivial = False
        self._modifiers: tuple[tuple[HeaderModifier | None, ...], ...] | None = None
        self._limiter: RateLimiter | None = None
        self._allow: list[Counted | None] = []
        self._deny: list[Counted | None] = []

    def _refresh(self, policy: ServerPolicy) -> None:
        self._policy = policy
        self._permits = self._client.permits(policy)
        routes = policy.routes
        filtered = any(r.modifiers for r in routes)
        self._modifiers = tuple(r.modifiers for r in routes) if filtered else None
        self._trivial = self._permits.match_free
        self._limiter = self._shared.limiter(self._port, policy)
        self._allow = [None] * len(routes)
        self._deny = [None] * len(routes)

    def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
        policy = self._shared.policies(self._port)
        if policy is not self._policy:
            self._refresh(policy)
        permits = self._permits
        decision: Decision
        if self._trivial:
            index, rule, decision = 0, 0, permits.routes[0]
        else:
            index, rule, decision = authz.decide(
                permits, request.method, request.path, lambda: _view(request)
            )
        if type(decision) is Allowed:
            counter = self._allow[index]
            if counter is None:
                counter = self._allow[index] = self._counter(index, decision)
            counter.inc()
            if decision.authz.meta.is_audit:
                what = f"route {policy.routes[index].meta} of server {policy.meta}"
                self._shared.audit(self._client, policy, what)
            limiter = self._limiter
            if limiter is not None:
                limited = limiter.check(self._client.client_id, self._shared.clock())
                if limited is not None:
                    self._rate_limited(policy, limited.scope)
                    return RouteError(429, limited.reason())
            modifiers = self._modifiers
            if modifiers is not None and modifiers[index]:
                modifier = modifiers[index][rule]
                if modifier is not None:
                    return _modified(self._inner.route(request), modifier)
            return self._inner.route(request)
        if isinstance(decision, Denied):
            counter = self._deny[index]
            if counter is None:
                deny = self._shared.metrics.inbound_http_authz_deny_total
                counter = self._deny[index] = deny.labels(
                    *_srv(self._labels.target_addr, policy),
                    *policy.routes[index].meta,
                    *_tls(self._labels),
                )
            counter.inc()
            self._shared.denied(self._client, self._port, decision.reason)
            # the caller learns that it was refused, not what would have let it in: the
            # authorizations it lacks are in the proxy's log, for the operator
            return RouteError(403, UNAUTHORIZED)
        if isinstance(decision, OverBudget):  # refused whole: no route, so no authorization
            self._shared.metrics.route_regex_budget_exceeded_total.labels("inbound").inc()
            return RouteError(decision.status, decision.reason)
        assert isinstance(decision, NoRoute)
        self._shared.metrics.inbound_http_route_not_found_total.labels(
            *_srv(self._labels.target_addr, policy), *_tls(self._labels)).inc()  # fmt: skip
        return RouteError(404, decision.reason)

    def _counter(self, index: int, allowed: Allowed) -> Counted:
        policy = self._policy
        assert policy is not None
        return self._shared.metrics.inbound_http_authz_allow_total.labels(
            *_srv(self._labels.target_addr, policy), *policy.routes[index].meta,
            *allowed.authz.meta, *_tls(self._labels),
        )  # fmt: skip

    def _rate_limited(self, policy: ServerPolicy, scope: str) -> None:
        spec = policy.rate_limit
        meta = spec.meta if spec is not None and spec.meta is not None else ("", "", "")
        family = self._shared.metrics.inbound_http_local_ratelimit_total
        srv = _srv(self._labels.target_addr, policy)
        family.labels(*srv, *meta, scope, *_tls(self._labels)).inc()


def _modified(
    routed: RouteTarget | RouteError | Wait, modifier: HeaderModifier
) -> RouteTarget | RouteError | Wait:
    if isinstance(routed, RouteTarget):
        return routed._replace(request_headers=modifier)
    if isinstance(routed, Wait):
        return Wait(_modified_later, (routed, modifier))
    return routed


async def _modified_later(args: tuple[Wait, HeaderModifier]) -> RouteTarget | RouteError:
    routed: RouteTarget | RouteError = await settle(args[0])
    return _modified(routed, args[1])  # type: ignore[return-value]


def _view(request: RequestTarget) -> authz.Request:
    headers = getattr(request, "headers", ())
    return authz.request(request.authority, request.method, request.path, headers)
