"""The outbound route stage as a table: a connection's logical target (discovered, redirected
but unknown, or not redirected) and a request → the route (`dst`, policy, budget) and the
endpoint its attempts are sent to. Discovery is scripted (outbound/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.core.routes import DEFAULT_ROUTE, AllOf, Method, PathRegex, Route
from meshlet.proxy.discovery.profile import Profile, RetryBudgetSpec
from meshlet.proxy.discovery.resolver import Destination
from meshlet.proxy.http.contract import (
    Addr,
    Endpoint,
    RequestTarget,
    RouteError,
    RouteTarget,
    Target,
    Wait,
    settle,
)
from meshlet.proxy.metrics import OVERFLOW, BoundedValues, ProxyMetrics
from meshlet.proxy.outbound.connection_router import DiscoveredPicker, DnsPicker, OutboundRouter
from meshlet.proxy.outbound.destinations import Destinations

HTTP1 = SessionProtocol.HTTP1
WEB = "web.emojivoto.svc.cluster.local:80"
CLUSTER_IP: Addr = HostPort("10.96.0.10", 80)
PROXY = SelfTargets([("0.0.0.0", 4140), ("0.0.0.0", 4143)])
LOCAL_IP = "10.0.0.7"
LOOP = RouteError(403, "the request targets the proxy itself (a routing loop)")
ITEM = Route(
    AllOf((Method("GET"), PathRegex("/items/[^/]+"))), (), (("route", "GET /items/{id}"),),
    retryable=True, timeout=0.5,
)  # fmt: skip


def request(authority: str | None, method: str = "GET", path: str = "/") -> RequestTarget:
    return Target(authority, method, path)


def router(
    mesh: Destinations | None,
    metrics: ProxyMetrics,
    destination: Destination | None = None,
    target: Addr | None = None,
) -> OutboundRouter:
    return OutboundRouter(mesh, metrics, HTTP1, destination=destination, target=target,
                          self_targets=PROXY, local_ip=LOCAL_IP)  # fmt: skip


async def routed(router: OutboundRouter, req: RequestTarget) -> tuple[RouteTarget, Endpoint]:
    route = await settle(router.route(req))
    assert isinstance(route, RouteTarget)
    endpoint = await settle(route.endpoints.pick())
    assert isinstance(endpoint, Endpoint)
    return route, endpoint


async def service(discovery: Any) -> tuple[Destinations, Destination]:
    """`web` with one endpoint and one profile route, as a redirected connection sees it."""
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10",
                             routes=(ITEM,))  # fmt: skip
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    assert isinstance(destination, Destination)
    return mesh, destination


# -- a discovered service --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "rt_route", "seconds", "retryable"),
    [
        ("GET", "/items/7", "GET /items/{id}", 0.5, True),
        ("GET", "/items/7?fields=name", "GET /items/{id}", 0.5, True),  # the query is not matched
        ("POST", "/items/7", "", None, False),  # no route matches: the default route
        ("GET", "/items/7/reviews", "", None, False),  # the regex matches the whole path
    ],
)
async def test_a_request_to_a_service_takes_its_profile_route(
    discovery: Any, method: str, path: str, rt_route: str, seconds: float | None, retryable: bool
) -> None:
    mesh, destination = await service(discovery)
    outbound = router(mesh, discovery.metrics, destination, CLUSTER_IP)
    route, endpoint = await routed(outbound, request("10.96.0.10", method, path))
    assert route.dst == WEB  # the service's name, whatever the request's authority
    policy = route.policy
    assert (policy.name, policy.timeout, policy.retryable) == (rt_route, seconds, retryable)
    assert route.budget is not None and route.budget is mesh.budget_for(destination)
    assert endpoint.addr == ("10.1.0.1", 8080) and endpoint.lease is not None  # balanced


async def test_each_attempt_of_a_service_request_is_picked_anew(discovery: Any) -> None:
    ep = discovery.endpoint
    discovery.client.service("web", 80, ep("10.1.0.1"), ep("10.1.0.2"), cluster_ip="10.96.0.10")
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    route = await settle(
        router(mesh, discovery.metrics, destination, CLUSTER_IP).route(request("x"))
    )
    assert isinstance(route, RouteTarget)
    picks = {getattr(await settle(route.endpoints.pick()), "addr", None) for _ in range(10)}
    assert picks == {("10.1.0.1", 8080), ("10.1.0.2", 8080)}


async def test_a_redirected_address_discovery_does_not_know_goes_where_it_was_sent(
    discovery: Any,
) -> None:
    mesh = discovery.mesh()
    unknown = await mesh.destination(HostPort("192.0.2.1", 8080))
    assert isinstance(unknown, Destination) and unknown.kind == "unknown"
    outbound = router(mesh, discovery.metrics, unknown, ("192.0.2.1", 8080))
    route, endpoint = await routed(outbound, request("api.example:8080"))
    assert route.dst == "192.0.2.1:8080" and route.policy == DEFAULT_ROUTE
    assert route.budget is None
    assert endpoint.addr == ("192.0.2.1", 8080) and endpoint.lease is None


async def test_nothing_known_and_nowhere_to_fall_back_is_502(discovery: Any) -> None:
    mesh = discovery.mesh()
    unknown = await mesh.destination(HostPort("192.0.2.1", 8080))
    picker = DiscoveredPicker(mesh, unknown, HTTP1, None)
    assert await settle(picker.pick()) == RouteError(
        502, "discovery knows nothing of the request's destination"
    )


# -- a redirected connection without discovery ---------------------------------------------


async def test_without_discovery_a_redirected_connection_goes_to_its_address() -> None:
    metrics = ProxyMetrics()
    outbound = router(None, metrics, None, ("192.0.2.1", 8080))
    route, endpoint = await routed(outbound, request("api.example:8080", "POST", "/x"))
    assert (route.dst, route.policy, route.budget) == ("api.example:8080", DEFAULT_ROUTE, None)
    assert endpoint.addr == ("192.0.2.1", 8080)


# -- a connection that was not redirected: each request by its authority --------------------


@pytest.mark.parametrize(
    ("authority", "outcome"),
    [
        ("192.0.2.1:8080", (("192.0.2.1", 8080), "192.0.2.1:8080")),
        ("192.0.2.1", (("192.0.2.1", 80), "192.0.2.1:80")),
        ("localhost:9000", ("localhost", "localhost:9000")),  # outside the cluster: DNS
        (None, RouteError(400, "the request names no authority (Host or absolute URI)")),
        ("web:http", RouteError(400, "the request's authority is malformed")),
        (
            "127.0.0.1:4140",
            RouteError(403, "the request targets the proxy itself (a routing loop)"),
        ),
    ],
)
async def test_an_unredirected_request_goes_where_its_authority_says(
    discovery: Any, authority: str | None, outcome: tuple[Any, str] | RouteError
) -> None:
    outbound = router(discovery.mesh(), discovery.metrics)  # discovery knows none of these
    if isinstance(outcome, RouteError):
        assert await settle(outbound.route(request(authority))) == outcome
        return
    addr, label = outcome
    route, endpoint = await routed(outbound, request(authority))
    assert route.dst == label and endpoint.authority_label == label
    assert route.policy == DEFAULT_ROUTE and route.budget is None
    if addr == "localhost":
        assert endpoint.addr in (("127.0.0.1", 9000), ("::1", 9000))
    else:
        assert endpoint.addr == addr


async def test_an_unredirected_request_to_a_cluster_name_is_routed_by_discovery(
    discovery: Any,
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), routes=(ITEM,))
    outbound = router(discovery.mesh(), discovery.metrics)
    route, endpoint = await routed(outbound, request(WEB, "GET", "/items/3"))
    assert route.dst == WEB and route.policy.name == "GET /items/{id}"
    assert route.budget is not None
    assert endpoint.addr == ("10.1.0.1", 8080)
    assert discovery.client.asked == [WEB]


async def test_discovery_refusing_an_unredirected_request_answers_for_it(discovery: Any) -> None:
    outbound = router(discovery.mesh(max_destinations=0), discovery.metrics)
    refused = await settle(outbound.route(request(WEB)))
    assert isinstance(refused, RouteError) and refused.status == 503


async def test_without_discovery_unredirected_requests_are_routed_by_dns_alone() -> None:
    metrics = ProxyMetrics()
    outbound = router(None, metrics)
    route, endpoint = await routed(outbound, request("192.0.2.9:81"))
    assert (route.dst, endpoint.addr) == ("192.0.2.9:81", ("192.0.2.9", 81))


async def test_dns_picks_are_labelled_within_the_authority_bound() -> None:
    metrics = ProxyMetrics()
    metrics.authority = BoundedValues(limit=1)
    first = DnsPicker("192.0.2.1:80", PROXY, LOCAL_IP, metrics)
    second = DnsPicker("192.0.2.2:80", PROXY, LOCAL_IP, metrics)
    assert await settle(first.pick()) == Endpoint(("192.0.2.1", 80), "192.0.2.1:80")
    assert await settle(second.pick()) == Endpoint(("192.0.2.2", 80), OVERFLOW)
    loop = DnsPicker("127.0.0.1:4143", PROXY, LOCAL_IP, metrics)
    assert await settle(loop.pick()) == LOOP


# -- without waiting: what the engines ask first, for every request ---------------------------


async def test_an_unredirected_request_is_routed_at_once_after_discovery_answered(
    discovery: Any,
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), routes=(ITEM,))
    outbound = router(discovery.mesh(), discovery.metrics)
    items = request(WEB, "GET", "/items/3")
    assert isinstance(outbound.route(items), Wait)  # discovery not asked yet: wait for it
    route = await settle(outbound.route(items))
    assert isinstance(route, RouteTarget)
    assert outbound.route(items) is route  # kept for the connection's next requests
    endpoint = route.endpoints.pick()
    assert isinstance(endpoint, Endpoint) and endpoint.addr == ("10.1.0.1", 8080)
    assert endpoint.lease is not None
    other = outbound.route(request(WEB, "POST", "/items/3"))
    assert isinstance(other, RouteTarget) and other.policy == DEFAULT_ROUTE


async def test_without_discovery_an_ip_literal_is_routed_at_once_and_kept() -> None:
    outbound = router(None, ProxyMetrics())
    first = outbound.route(request("192.0.2.9:81"))
    assert isinstance(first, RouteTarget) and first.dst == "192.0.2.9:81"
    assert first.endpoints.pick() == Endpoint(("192.0.2.9", 81), "192.0.2.9:81")
    assert outbound.route(request("192.0.2.9:81", "POST", "/x")) is first
    other = outbound.route(request("192.0.2.10"))  # another authority: routed anew
    assert isinstance(other, RouteTarget) and other.dst == "192.0.2.10:80"
    assert outbound.route(request("127.0.0.1:4140")) == LOOP
    assert outbound.route(request("web:http")) == RouteError(
        400, "the request's authority is malformed"
    )
    assert outbound.route(request(None)) == RouteError(
        400, "the request names no authority (Host or absolute URI)"
    )
    assert isinstance(outbound.route(request("localhost:9000")), Wait)  # a name: looked up


async def test_routes_follow_a_profile_that_changes_under_a_live_connection(
    discovery: Any,
) -> None:
    mesh, destination = await service(discovery)
    outbound = router(mesh, discovery.metrics, destination, CLUSTER_IP)
    first = outbound.route(request("10.96.0.10", "POST", "/items/1"))
    assert isinstance(first, RouteTarget) and first.policy == DEFAULT_ROUTE
    assert outbound.route(request("10.96.0.10", "POST", "/items/2")) is first
    assert first.budget is not None and first.budget.ratio == 0.2
    # Discovery adopts a new profile of the service: another retry budget, no routes.
    destination._profile = Profile(
        fqn=WEB.rsplit(":", 1)[0], retry_budget=RetryBudgetSpec(0.5, 1, 5)
    )
    after = outbound.route(request("10.96.0.10", "POST", "/items/3"))
    assert isinstance(after, RouteTarget) and after.policy == DEFAULT_ROUTE
    assert after.budget is not None and after.budget.ratio == 0.5


async def test_a_pick_waits_while_the_service_has_not_reported_endpoints(discovery: Any) -> None:
    authority = discovery.client.service("web", 80, cluster_ip="10.96.0.10")
    del discovery.client.endpoints_of[authority]  # the Get stream has not answered
    mesh = discovery.mesh()
    destination = await mesh.destination(CLUSTER_IP)
    assert isinstance(destination, Destination)
    assert isinstance(DiscoveredPicker(mesh, destination, HTTP1, None).pick(), Wait)
