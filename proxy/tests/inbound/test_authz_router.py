"""The inbound router's policy step (`PolicyRouter`): a request from a connection's client is
allowed on its route and routed, or answered 403/404/429 with Linkerd's metrics; a new policy
applies to the next request of the same connection."""

from __future__ import annotations

import ipaddress

from meshlet.api import inbound_pb2, meta_pb2, net_pb2
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
