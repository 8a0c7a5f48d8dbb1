"""The policy controller's `Server` messages decoded into the core's `ServerPolicy`, field by
field as linkerd2-proxy reads them (`proxy/server-policy`): the Server's authorizations, plus
loopback, apply to connections and to every route; a port without routes gets one default route;
a route without metadata, a network without an address, a bad regex or a prefix length out of
range makes the whole message invalid (DecodeError: the caller keeps the policy it had), and so
do regexes past the budget a policy's regexes share (meshlet.api.pathregex.Budget: how many
distinct patterns, how large their programs together; what matching them may cost a request is
paid per request, core.authz).
Authorizations without networks permit nothing and are left out, as the contract says. Unknown
fields are ignored (protobuf does that).

A rule's filters compile into one request header modification (`core.header_modifier`). A
filter the proxy cannot apply as written is never skipped (a route served unmodified would
silently be another route than the one configured): a modifier naming a header the proxy
reserves, an invalid name or value, a filter without a kind, and the kinds the proxy does not
implement (failure injection, redirects; the controller refuses them too) make the message
invalid.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf import duration_pb2

from meshlet.api import (
    addr,
    grpc_route_pb2,
    http_route_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
    wellknown,
)
from meshlet.api.pathregex import Budget, Regex
from meshlet.api.target import Refused, normal_path_match
from meshlet.proxy.core.authz import (
    LOCALHOST,
    Authn,
    Authorization,
    GrpcMatch,
    HostKind,
    HostMatch,
    HttpMatch,
    Meta,
    Net,
    Network,
    PathKind,
    PathMatch,
    PortProtocol,
    Route,
    ServerPolicy,
    ValueMatch,
    default_route,
    suffix,
)
from meshlet.proxy.core.header_modifier import NOTHING, HeaderModifier, compile_modifier
from meshlet.proxy.core.ratelimit import RateLimitSpec
from meshlet.proxy.discovery.decode import DecodeError

MAX_ROUTES = 1000
MAX_AUTHORIZATIONS = 1000


def decode_server(msg: inbound_pb2.Server) -> ServerPolicy:
    """The port's policy; DecodeError naming the field that breaks the contract."""
    meta = _labels_meta(msg.labels, "server")
    kind = msg.protocol.WhichOneof("kind") if msg.HasField("protocol") else None
    if kind is None:
        raise DecodeError("Server without a protocol")
    if len(msg.authorizations) > MAX_AUTHORIZATIONS:
        raise DecodeError(f"more than {MAX_AUTHORIZATIONS} authorizations")
    server_authzs = (*_authorizations(msg.authorizations), LOCALHOST)
    proto = msg.protocol
    budget = Budget()
    timeout = None
    rate_limit = None
    routes: tuple[Route, ...] = ()
    grpc = False
    if kind == "detect":
        if proto.detect.HasField("timeout"):
            timeout = duration_seconds(proto.detect.timeout)
        routes = _routes(proto.detect.http_routes, server_authzs, http_match, "HTTP", budget)
        rate_limit = _rate_limit(proto.detect.http_local_rate_limit) if proto.detect.HasField(
            "http_local_rate_limit") else None  # fmt: skip
    elif kind in ("http1", "http2"):
        spec = proto.http1 if kind == "http1" else proto.http2
        routes = _routes(spec.routes, server_authzs, http_match, "HTTP", budget)
        rate_limit = _rate_limit(spec.local_rate_limit) if spec.HasField(
            "local_rate_limit") else None  # fmt: skip
    elif kind == "grpc":
        routes = _routes(proto.grpc.routes, server_authzs, grpc_match, "gRPC", budget)
        grpc = True
    if rate_limit is not None and rate_limit.empty:
        rate_limit = None
    return ServerPolicy(meta, PortProtocol(kind), server_authzs, routes, grpc, rate_limit, timeout)


def duration_seconds(msg: duration_pb2.Duration) -> float:
    seconds = msg.seconds + msg.nanos / 1e9
    if seconds < 0:
        raise DecodeError("a negative duration")
    return seconds


def _labels_meta(labels: Mapping[str, str], default_kind: str) -> Meta:
    """Linkerd's `Meta::try_new_with_default`: `name` required, `group` and `kind` defaulted;
    `kind: default` without a group is a default; `default:NAME` an older default."""
    name = labels.get("name")
    if not name:
        raise DecodeError("labels without a name")
    group = labels.get("group", wellknown.POLICY_API_GROUP)
    kind = labels.get("kind")
    if kind is not None:
        return Meta.default(name) if not group and kind == "default" else Meta(group, kind, name)
    head, sep, rest = name.partition(":")
    if sep:
        return Meta.default(rest) if head == "default" else Meta(group, head, rest)
    return Meta(group, default_kind, name)


def _meta(msg: meta_pb2.Metadata) -> Meta:
    kind = msg.WhichOneof("kind")
    if kind == "default":
        return Meta.default(msg.default)
    if kind == "resource":
        r = msg.resource
        return Meta(r.group, r.kind, r.name)
    raise DecodeError("metadata without a kind")


def _net(msg: net_pb2.IPNetwork) -> Net:
    try:
        ip = addr.ip_from_proto(msg.ip)
        return ipaddress.ip_network(f"{ip}/{msg.prefix_len}", strict=False)
    except ValueError as exc:
        raise DecodeError(f"network: {exc}") from None


def _authorizations(items: Iterable[inbound_pb2.Authz]) -> tuple[Authorization, ...]:
    out = []
    for item in items:
        if not item.networks:
            continue  # the contract: an authorization with no network is ignored
        networks = []
        for network in item.networks:
            if not network.HasField("net"):
                raise DecodeError("authorization network without net")
            networks.append(
                Network(_net(network.net), tuple(_net(e) for e in getattr(network, "except")))
            )
        meta = (_meta(item.metadata) if item.HasField("metadata")
                else _labels_meta(item.labels, "serverauthorization"))  # fmt: skip
        if not item.HasField("authentication"):
            raise DecodeError(f"authorization {meta} without authentication")
        permit = item.authentication.WhichOneof("permit")
        if permit == "unauthenticated":
            out.append(Authorization(tuple(networks), Authn.UNAUTHENTICATED, meta))
        elif permit == "meshTLS":
            clients = item.authentication.meshTLS.WhichOneof("clients")
            if clients == "unauthenticated":
                out.append(Authorization(tuple(networks), Authn.TLS_ANY, meta))
            elif clients == "identities":
                ids = item.authentication.meshTLS.identities
                out.append(Authorization(
                    tuple(networks), Authn.TLS_IDENTITIES, meta,
                    frozenset(i.name for i in ids.identities),
                    tuple(suffix(list(s.parts)) for s in ids.suffixes),
                ))  # fmt: skip
            else:
                raise DecodeError(f"authorization {meta}: meshTLS without clients")
        else:
            raise DecodeError(f"authorization {meta} without a permit")
    return tuple(out)


def _regex(pattern: str, what: str, budget: Budget) -> Regex:
    try:
        return budget.compile(pattern)
    except ValueError as exc:
        raise DecodeError(f"{what} regex {pattern[:80]!r}: {exc}") from None


def host_matches(items: Iterable[http_route_pb2.HostMatch]) -> tuple[HostMatch, ...]:
    out = []
    for item in items:
        kind = item.WhichOneof("match")
        if kind == "exact":
            out.append(HostMatch(HostKind.EXACT, item.exact.lower()))
        elif kind == "suffix":
            labels = list(reversed(item.suffix.reverse_labels))
            out.append(HostMatch(HostKind.SUFFIX, suffix([label.lower() for label in labels])))
        else:
            raise DecodeError("host match without a match")
    return tuple(out)


def _header_matches(
    items: Iterable[http_route_pb2.HeaderMatch], budget: Budget
) -> tuple[ValueMatch, ...]:
    out = []
    for item in items:
        kind = item.WhichOneof("value")
        name = item.name.lower()
        if not name:
            raise DecodeError("header match without a name")
        if kind == "exact":
            out.append(ValueMatch(name, exact=bytes(item.exact)))
        elif kind == "regex":
            out.append(ValueMatch(name, regex=_regex(item.regex, "header", budget)))
        else:
            raise DecodeError(f"header match {name!r} without a value")
    return tuple(out)


def _normal(value: str) -> str:
    """An Exact or PathPrefix value as requests are routed (meshlet.api.target): a controller
    sending `/x/../admin` means `/admin`, which is what a request for it is routed as."""
    normal = normal_path_match(value)
    if isinstance(normal, Refused):
        raise DecodeError(f"path match {value[:80]!r}: {normal.reason}")
    return normal


def http_match(msg: http_route_pb2.HttpRouteMatch, budget: Budget) -> HttpMatch:
    """One match of a rule; its regexes compiled under the policy's `budget`."""
    path = None
    if msg.HasField("path"):
        kind = msg.path.WhichOneof("kind")
        if kind == "exact":
            path = PathMatch(PathKind.EXACT, _normal(msg.path.exact))
        elif kind == "prefix":
            path = PathMatch(PathKind.PREFIX, _normal(msg.path.prefix or "/"))
        elif kind == "regex":
            path = PathMatch(PathKind.REGEX, msg.path.regex, _regex(msg.path.regex, "path", budget))
        else:
            raise DecodeError("path match without a kind")
    query = []
    for item in msg.query_params:
        kind = item.WhichOneof("value")
        if kind == "exact":
            query.append(ValueMatch(item.name, exact=item.exact))
        elif kind == "regex":
            query.append(ValueMatch(item.name, regex=_regex(item.regex, "query parameter", budget)))
        else:
            raise DecodeError(f"query parameter match {item.name!r} without a value")
    method = None
    if msg.HasField("method"):
        method_kind = msg.method.WhichOneof("type")
        if method_kind == "registered":
            method = _METHODS.get(msg.method.registered)
            if method is None:
                raise DecodeError(f"unknown method {msg.method.registered}")
        elif method_kind == "unregistered":
            method = msg.method.unregistered
    return HttpMatch(path, _header_matches(msg.headers, budget), tuple(query), method)


_METHODS = {0: "GET", 1: "POST", 2: "PUT", 3: "DELETE", 4: "PATCH", 5: "OPTIONS", 6: "CONNECT",
            7: "HEAD", 8: "TRACE"}  # fmt: skip


def _route_authzs(
    items: Iterable[inbound_pb2.Authz], server: tuple[Authorization, ...]
) -> tuple[Authorization, ...]:
    return (*_authorizations(items), *server)


def grpc_match(msg: grpc_route_pb2.GrpcRouteMatch, budget: Budget) -> GrpcMatch:
    """One match of a gRPC rule; its header regexes compiled under the policy's `budget`."""
    return GrpcMatch(msg.rpc.service, msg.rpc.method, _header_matches(msg.headers, budget))


def _routes(
    items: Iterable[inbound_pb2.HttpRoute] | Iterable[inbound_pb2.GrpcRoute],
    server: tuple[Authorization, ...],
    match: Callable[[Any, Budget], HttpMatch | GrpcMatch],
    what: str,
    budget: Budget,
) -> tuple[Route, ...]:
    """HTTP or gRPC routes (`match` reads one rule match); the default route when none."""
    routes = []
    for item in items:
        if not item.HasField("metadata"):
            raise DecodeError(f"{what} route without metadata")
        meta = _meta(item.metadata)
        rules = tuple(tuple(match(m, budget) for m in rule.matches) for rule in item.rules)
        modifiers = _modifiers(item.rules, meta)
        routes.append(Route(meta, host_matches(item.hosts), rules,
                            _route_authzs(item.authorizations, server), modifiers))  # fmt: skip
    if len(routes) > MAX_ROUTES:
        raise DecodeError(f"more than {MAX_ROUTES} routes")
    return tuple(routes) or (default_route(server),)


_Rule = inbound_pb2.HttpRoute.Rule | inbound_pb2.GrpcRoute.Rule


def _modifiers(rules: Iterable[_Rule], route: Meta) -> tuple[HeaderModifier | None, ...]:
    """Each rule's header modification (None: none), or () when no rule has one."""
    out: list[HeaderModifier | None] = []
    for at, rule in enumerate(rules):
        modifier = NOTHING
        for spec in rule.filters:
            kind = spec.WhichOneof("kind")
            if kind != "request_header_modifier":
                what = f"a {kind} filter" if kind else "a filter without a kind"
                raise DecodeError(f"route {route} rule {at}: {what}, which the proxy cannot apply")
            modifier = modifier.then(_modifier(spec.request_header_modifier, route, at))
        out.append(None if modifier == NOTHING else modifier)
    return tuple(out) if any(m is not None for m in out) else ()


def _modifier(msg: http_route_pb2.RequestHeaderModifier, route: Meta, at: int) -> HeaderModifier:
    try:
        return compile_modifier(
            [(h.name, h.value) for h in msg.add.headers],
            [(h.name, h.value) for h in msg.set.headers],
            msg.remove,
        )
    except ValueError as exc:
        raise DecodeError(f"route {route} rule {at}: RequestHeaderModifier: {exc}") from None


def _rate_limit(msg: inbound_pb2.HttpLocalRateLimit) -> RateLimitSpec:
    meta = None
    if msg.HasField("metadata"):
        m = _meta(msg.metadata)
        meta = (m.group, m.kind, m.name)
    overrides = []
    for item in msg.overrides:
        rps = item.limit.requestsPerSecond if item.HasField("limit") else 0
        if rps:
            overrides.append((rps, frozenset(i.name for i in item.clients.identities)))
    return RateLimitSpec(
        total=msg.total.requestsPerSecond if msg.HasField("total") else None,
        identity=msg.identity.requestsPerSecond if msg.HasField("identity") else None,
        overrides=tuple(overrides),
        meta=meta,
    )
