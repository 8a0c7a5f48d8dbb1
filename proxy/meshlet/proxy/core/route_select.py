"""Which outbound route and rule a request takes, and which backend of the rule's distribution
it goes to (pure: the random source is passed in).

Precedence is the Gateway API's (HTTPRoute, GRPCRoute), the specification the routes are written
to: first the best host match (an exact host over any wildcard, a longer wildcard over a
shorter); then, over every rule of those routes, the best rule match. For HTTP that is an exact
path over a path prefix or regex, then the longer path match, then a method match, then more
header matches, then more query parameter matches; for gRPC a longer service, then a longer
method, then more header matches. What still ties goes to the route sent first (the policy
controller sends routes oldest first, then by name, as the Gateway API asks) and, within it, to
the rule written first. A rule without matches matches every request, as the prefix `/`.

Matching a single host, path, header or query parameter is the inbound router's
(`core.authz`: `HostMatch`, `HttpMatch`, `GrpcMatch`), so both directions read a match alike.
Its `find_rule` is not reused: it orders rules as linkerd2-proxy does in both directions (path
match length first, so an exact path ties with a prefix of the same length, and the method
last), where the Gateway API puts an exact path first and the method before headers; and its
routes carry authorizations rather than backends.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

from meshlet.proxy.core.authz import GrpcMatch, HttpMatch, PathKind, Request
from meshlet.proxy.core.client_policy import (
    Backend,
    Dispatch,
    Distribution,
    Route,
    RouteBackend,
    Rule,
)

_MATCH_ALL_HTTP = (False, 1, False, 0, 0)
_MATCH_ALL_GRPC = (0, 0, 0)


class Selected(NamedTuple):
    route: int  # the index of the route in the policy's list
    rule: int  # the index of the rule in the route
    target: Rule


def http_key(match: HttpMatch, req: Request) -> tuple[bool, int, bool, int, int] | None:
    """How well `match` fits `req` (higher is better), None when it does not."""
    summary = match.summary(req)
    if summary is None:
        return None
    exact = match.path is not None and match.path.kind is PathKind.EXACT
    return (exact, summary[0], match.method is not None, len(match.headers), len(match.query))


def grpc_key(match: GrpcMatch, req: Request) -> tuple[int, int, int] | None:
    summary = match.summary(req)
    return None if summary is None else summary[:3]


def select_http(routes: Sequence[Route], req: Request) -> Selected | None:
    """The route and rule an HTTP request takes; None: no route matches (Linkerd answers 404)."""
    return _select(routes, req, lambda m: http_key(m, req) if isinstance(m, HttpMatch) else None,
                   _MATCH_ALL_HTTP)  # fmt: skip


def select_grpc(routes: Sequence[Route], req: Request) -> Selected | None:
    """The route and rule a gRPC request (path `/service/method`) takes; None: no match."""
    return _select(routes, req, lambda m: grpc_key(m, req) if isinstance(m, GrpcMatch) else None,
                   _MATCH_ALL_GRPC)  # fmt: skip


def _select(
    routes: Sequence[Route],
    req: Request,
    key: Callable[[HttpMatch | GrpcMatch], tuple[object, ...] | None],
    match_all: tuple[object, ...],
) -> Selected | None:
    best: tuple[tuple[int, int] | tuple[()], tuple[object, ...]] | None = None
    found = None
    for index, route in enumerate(routes):
        host: tuple[int, int] | tuple[()] = ()
        if route.hosts:
            hosts = [hs for h in route.hosts if (hs := h.summary(req.host)) is not None]
            if not hosts:
                continue
            host = max(hosts)
        for at, rule in enumerate(route.rules):
            if not rule.matches:
                rule_key: tuple[object, ...] | None = match_all
            else:
                keys = [k for m in rule.matches if (k := key(m)) is not None]
                rule_key = max(keys) if keys else None
            if rule_key is None:
                continue
            candidate = (host, rule_key)
            if best is None or candidate > best:
                best, found = candidate, Selected(index, at, rule)
    return found


def pick(
    distribution: Distribution,
    rng: random.Random,
    ready: Callable[[Backend], bool] = lambda _: True,
) -> RouteBackend | None:
    """The backend a request goes to: for FIRST_AVAILABLE the first `ready` one (else the
    first), for RANDOM_AVAILABLE a draw weighted by the backends' weights (a weight of 0 is
    never drawn); None for EMPTY."""
    backends = distribution.backends
    if distribution.kind is Dispatch.EMPTY or not backends:
        return None
    if distribution.kind is Dispatch.FIRST_AVAILABLE:
        return next((b for b in backends if ready(b.backend)), backends[0])
    draw = rng.randrange(distribution.cumulative[-1])
    return backends[bisect.bisect_right(distribution.cumulative, draw)]
