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

The routes are not scanned per request: `core.route_index.RouteTable` files each match once per
policy version (the policy keeps it, `ClientPolicy.table`), and a request reads only the entries
its host, path or gRPC service can meet.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence

from meshlet.proxy.core.authz import GrpcMatch, HttpMatch, PathKind, Request
from meshlet.proxy.core.client_policy import Backend, Dispatch, Distribution, Route, RouteBackend
from meshlet.proxy.core.route_index import RouteTable, Selected

__all__ = ["RouteTable", "Selected", "grpc_key", "http_key", "pick", "select_grpc", "select_http"]


def http_key(match: HttpMatch, req: Request) -> tuple[bool, int, bool, int, int] | None:
    """How well `match` fits `req` in the order above (higher is better), None when it does not:
    the ranking `RouteTable` reaches without computing it for every match."""
    summary = match.summary(req)
    if summary is None:
        return None
    exact = match.path is not None and match.path.kind is PathKind.EXACT
    return (exact, summary[0], match.method is not None, len(match.headers), len(match.query))


def grpc_key(match: GrpcMatch, req: Request) -> tuple[int, int, int] | None:
    summary = match.summary(req)
    return None if summary is None else summary[:3]


def select_http(routes: Sequence[Route], req: Request) -> Selected | None:
    """The route and rule an HTTP request takes; None: no route matches (Linkerd answers 404).
    Indexes `routes` for this one request: a router keeps the policy's `RouteTable`."""
    return RouteTable(routes, grpc=False).select(req)


def select_grpc(routes: Sequence[Route], req: Request) -> Selected | None:
    """The route and rule a gRPC request (path `/service/method`) takes; None: no match."""
    return RouteTable(routes, grpc=True).select(req)


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
