"""The inbound router's policy step (`PolicyRouter`): a request from a connection's client is
allowed on its route and routed, or answered 403/404/429 with Linkerd's metrics; a new policy
applies to the next request of the same connection."""

from __future__ import annotations

import ipaddress

import pytest

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
)
from meshlet.proxy.discovery.decode import DecodeError
from meshlet.proxy.discovery.policy_decode import decode_server
from meshlet.proxy.fixed_router import FixedRouter
from meshlet.proxy.http.contract import RouteError, RouteTarget, Target
from meshlet.proxy.inbound.authz import UNAUTHORIZED, InboundPolicy, PolicyRouter, client_of
from meshlet.proxy.metrics import ProxyMetrics

WEB = "web.shop.serviceaccount.identity.meshlet.cluster.local"
INTRUDER = "api.shop.serviceaccount.identity.meshlet.cluster.local"
PORT = 8080


def _everywhere() -> list[inbound_pb2.Network]:
    v4 = net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv4=0), prefix_len=0)
    v6 = net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv6=net_pb2.IPv6()), prefix_len=0)
    return [inbound_pb2.Network(net=v4), inbound_pb2.Network(net=v6)]


def server(*identities: str, rps: int = 0) -> inbound_pb2.Server:
    clients = inbound_pb2.Authn.PermitMeshTLS.PermitClientIdentities(
        identities=[inbound_pb2.Identity(name=i) for i in identities]
    )
    authz = inbound_pb2.Authz(
        networks=_everywhere(),
        authentication=inbound_pb2.Authn(meshTLS=inbound_pb2.Authn.PermitMeshTLS(identities=clients)),
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="policy.meshlet.io", kind="authorizationpolicy", name="web-only")),
        labels={"group": "policy.meshlet.io", "kind": "authorizationpolicy", "name": "web-only"},
    )  # fmt: skip
    limit = None
    if rps:
        limit = inbound_pb2.HttpLocalRateLimit(
            identity=inbound_pb2.HttpLocalRateLimit.Limit(requestsPerSecond=rps)
        )
    http1 = inbound_pb2.ProxyProtocol.Http1(routes=[], local_rate_limit=limit)
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(http1=http1),
        authorizations=[authz],
        labels={"group": "policy.meshlet.io", "kind": "server", "name": "store"},
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router(
    held: dict[int, object], client_id: str | None, metrics: ProxyMetrics, clock: Clock
) -> PolicyRouter:
    shared = InboundPolicy(lambda port: held[port], metrics, clock)  # type: ignore[arg-type,return-value]
    labels = metrics.conn("inbound", f"10.0.0.5:{PORT}", tls="true", client_id=client_id or "")
    inner = FixedRouter(("10.0.0.5", PORT), metrics)
    client = client_of("10.0.0.9", client_id, tls=True)
    assert client.ip == ipaddress.ip_address("10.0.0.9")
    return PolicyRouter(inner, shared, client, PORT, labels)


REQUEST = Target("store:8080", "GET", "/items")


def test_the_named_identity_is_routed_and_another_gets_403_that_reveals_nothing() -> None:
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(server(WEB))}
    assert isinstance(router(held, WEB, metrics, clock).route(REQUEST), RouteTarget)
    refused = router(held, INTRUDER, metrics, clock).route(REQUEST)
    assert refused == RouteError(403, UNAUTHORIZED)
    assert WEB not in refused.reason  # the caller is not told whom to impersonate
    text = metrics.registry.render().decode()
    assert "inbound_http_authz_allow_total{" in text and 'authz_name="web-only"' in text
    assert "inbound_http_authz_deny_total{" in text and f'client_id="{INTRUDER}"' in text


def test_a_new_policy_applies_to_the_next_request_of_the_same_connection() -> None:
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(server(WEB))}
    conn = router(held, INTRUDER, metrics, clock)
    assert conn.route(REQUEST) == RouteError(403, UNAUTHORIZED)
    held[PORT] = decode_server(server(WEB, INTRUDER))
    assert isinstance(conn.route(REQUEST), RouteTarget)
    held[PORT] = decode_server(server(WEB))
    assert conn.route(REQUEST) == RouteError(403, UNAUTHORIZED)


def test_the_per_identity_rate_limit_answers_429_and_refills() -> None:
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(server(WEB, INTRUDER, rps=5))}
    heavy, light = router(held, INTRUDER, metrics, clock), router(held, WEB, metrics, clock)
    answers = [heavy.route(REQUEST) for _ in range(20)]
    limited = [a for a in answers if isinstance(a, RouteError)]
    assert 10 <= len(limited) <= 15 and all(a.status == 429 for a in limited)
    assert isinstance(light.route(REQUEST), RouteTarget)  # its own bucket
    clock.now += 1.0
    assert isinstance(heavy.route(REQUEST), RouteTarget)
    assert "inbound_http_local_ratelimit_total{" in metrics.registry.render().decode()


# -- route filters ----------------------------------------------------------------------------


def _headers(*pairs: tuple[str, bytes]) -> http_types_pb2.Headers:
    return http_types_pb2.Headers(
        headers=[http_types_pb2.Headers.Header(name=n, value=v) for n, v in pairs]
    )


def filtered(
    modifier: http_route_pb2.RequestHeaderModifier, path: str = "/items"
) -> inbound_pb2.Server:
    """`store` with two routes: under `path`, one whose first rule carries `modifier` (its
    second rule, for `/items/plain`, none); the other, for everything else, none."""
    msg = server(WEB)
    meta = meta_pb2.Metadata(
        resource=meta_pb2.Resource(group="policy.meshlet.io", kind="httproute", name="items")
    )
    match = http_route_pb2.HttpRouteMatch
    rule = inbound_pb2.HttpRoute.Rule
    items = inbound_pb2.HttpRoute(
        metadata=meta,
        rules=[
            rule(matches=[match(path=http_route_pb2.PathMatch(prefix=path))],
                 filters=[inbound_pb2.HttpRoute.Filter(request_header_modifier=modifier)]),
            rule(matches=[match(path=http_route_pb2.PathMatch(exact=path + "/plain"))]),
        ],
    )  # fmt: skip
    rest = inbound_pb2.HttpRoute(
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="policy.meshlet.io", kind="httproute", name="rest")),
        rules=[rule(matches=[match(path=http_route_pb2.PathMatch(prefix="/"))])],
    )  # fmt: skip
    msg.protocol.http1.routes.extend([items, rest])
    return msg


TENANT = http_route_pb2.RequestHeaderModifier(
    add=_headers(("x-region", b"eu")), set=_headers(("X-Tenant", b"red")), remove=["x-debug"]
)


def test_the_matched_rules_header_modifier_rides_on_the_route_and_only_there() -> None:
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(filtered(TENANT))}
    conn = router(held, WEB, metrics, clock)
    routed = conn.route(Target("store:8080", "GET", "/items/1"))
    assert isinstance(routed, RouteTarget) and routed.request_headers is not None
    assert routed.request_headers.apply([(b"X-Debug", b"1"), (b"x-tenant", b"blue")]) == [
        (b"x-region", b"eu"), (b"x-tenant", b"red"),
    ]  # fmt: skip
    for other in ("/items/plain", "/elsewhere"):  # another rule, another route: untouched
        plain = conn.route(Target("store:8080", "GET", other))
        assert isinstance(plain, RouteTarget) and plain.request_headers is None, other
    refused = router(held, INTRUDER, metrics, clock).route(Target("store:8080", "GET", "/items"))
    assert refused == RouteError(403, UNAUTHORIZED)  # filters never come before authorization


@pytest.mark.parametrize(
    ("modifier", "why"),
    [
        (http_route_pb2.RequestHeaderModifier(set=_headers(("meshlet-client-id", b"admin"))),
         "reserved for the proxy"),
        (http_route_pb2.RequestHeaderModifier(add=_headers(("L5D-Client-Id", b"admin"))),
         "reserved for the proxy"),
        (http_route_pb2.RequestHeaderModifier(remove=["meshlet-client-id"]),
         "reserved for the proxy"),
        (http_route_pb2.RequestHeaderModifier(set=_headers((":authority", b"evil"))),
         "pseudo-header"),
        (http_route_pb2.RequestHeaderModifier(set=_headers(("Content-Length", b"0"))), "frames"),
        (http_route_pb2.RequestHeaderModifier(remove=["transfer-encoding"]), "frames"),
        (http_route_pb2.RequestHeaderModifier(add=_headers(("x-a", b"1\r\nx-b: 2"))),
         "control character"),
        (http_route_pb2.RequestHeaderModifier(add=_headers(("x a", b"1"))), "not a valid"),
    ],
)  # fmt: skip
def test_a_modifier_the_proxy_refuses_makes_the_whole_policy_invalid(
    modifier: http_route_pb2.RequestHeaderModifier, why: str
) -> None:
    with pytest.raises(DecodeError, match=f"httproute.policy.meshlet.io/items rule 0: .*{why}"):
        decode_server(filtered(modifier))


def test_a_filter_the_proxy_cannot_apply_is_never_skipped() -> None:
    msg = filtered(TENANT)
    rule = msg.protocol.http1.routes[0].rules[1]
    rule.filters.add().redirect.host = "elsewhere"
    with pytest.raises(DecodeError, match="rule 1: a redirect filter, which the proxy cannot"):
        decode_server(msg)
    rule.filters[0].Clear()
    with pytest.raises(DecodeError, match="a filter without a kind"):
        decode_server(msg)


def test_grpc_routes_carry_their_modifier_too() -> None:
    msg = server(WEB)
    grpc = inbound_pb2.GrpcRoute(
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="gateway.networking.k8s.io", kind="grpcroute", name="echo")),
        rules=[inbound_pb2.GrpcRoute.Rule(
            matches=[grpc_route_pb2.GrpcRouteMatch(
                rpc=grpc_route_pb2.GrpcRpcMatch(service="meshlet.test.Echo"))],
            filters=[inbound_pb2.GrpcRoute.Filter(request_header_modifier=TENANT)])],
    )  # fmt: skip
    msg.protocol.ClearField("http1")
    msg.protocol.grpc.routes.append(grpc)
    held: dict[int, object] = {PORT: decode_server(msg)}
    conn = router(held, WEB, ProxyMetrics(), Clock())
    routed = conn.route(Target("echo:8080", "POST", "/meshlet.test.Echo/Unary"))
    assert isinstance(routed, RouteTarget) and routed.request_headers is not None
    assert conn.route(Target("echo:8080", "POST", "/other.Svc/Unary")) == RouteError(
        404, "no route of server server.policy.meshlet.io/store matches the request"
    )


@pytest.mark.parametrize("spelt", ["/x/../items", "//items", "/%69tems", "/./items"])
def test_a_routes_path_is_held_to_the_form_requests_are_routed_on(spelt: str) -> None:
    """A controller's `/x/../items` means `/items`, which is what a request for it is routed
    as (meshlet.api.target): the route protects it, never silently matching nothing."""
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(filtered(TENANT, path=spelt))}
    routed = router(held, WEB, metrics, clock).route(Target("store:8080", "GET", "/items/1"))
    assert isinstance(routed, RouteTarget) and routed.request_headers is not None
    refused = router(held, INTRUDER, metrics, clock).route(Target("store:8080", "GET", "/items"))
    assert refused == RouteError(403, UNAUTHORIZED)


@pytest.mark.parametrize(
    ("path", "why"),
    [("/café", "not ASCII"), ("/items?x=1", "no query"), ("/items#x", "fragment"),
     ("/a%zz", "percent-encoding")],
)  # fmt: skip
def test_a_routes_path_that_no_request_can_have_makes_the_policy_invalid(
    path: str, why: str
) -> None:
    with pytest.raises(DecodeError, match=why):
        decode_server(filtered(TENANT, path=path))


def regex_routes(*patterns: str) -> inbound_pb2.Server:
    """`store` (WEB only) with one route per regex."""
    msg = server(WEB)
    for n, pattern in enumerate(patterns):
        msg.protocol.http1.routes.append(inbound_pb2.HttpRoute(
            metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
                group="policy.meshlet.io", kind="httproute", name=f"r{n}")),
            rules=[inbound_pb2.HttpRoute.Rule(matches=[http_route_pb2.HttpRouteMatch(
                path=http_route_pb2.PathMatch(regex=pattern))])],
        ))  # fmt: skip
    return msg


def test_a_path_the_routes_regexes_cannot_afford_is_refused_with_414_and_counted() -> None:
    metrics, clock = ProxyMetrics(), Clock()
    held: dict[int, object] = {PORT: decode_server(regex_routes("/items/.*"))}
    conn = router(held, WEB, metrics, clock)
    assert isinstance(conn.route(Target("store:8080", "GET", "/items/1")), RouteTarget)
    refused = conn.route(Target("store:8080", "GET", "/items/" + "x" * 20_000))
    assert isinstance(refused, RouteError) and refused.status == 414
    assert "too long to match against the route's regular expressions" in refused.reason
    text = metrics.registry.render().decode()
    assert 'route_regex_budget_exceeded_total{direction="inbound"} 1.0' in text


def test_a_policy_over_the_regex_budget_is_refused_whole() -> None:
    """The proxy keeps the policy it had (discovery.inbound_policy): what it refuses here."""
    from meshlet.api.pathregex import MAX_PROGRAM, MAX_REGEXES

    with pytest.raises(DecodeError, match=f"more than {MAX_REGEXES} distinct regexes"):
        decode_server(regex_routes(*(f"/p{n}/.*" for n in range(MAX_REGEXES + 1))))
    with pytest.raises(DecodeError, match=f"at most {MAX_REGEXES} regexes, of {MAX_PROGRAM}"):
        decode_server(regex_routes(*(f"/p{n}/[a-z]{{300}}" for n in range(40))))
    decode_server(regex_routes(*(["/same/.*"] * 1000)))  # one pattern however often it is used
