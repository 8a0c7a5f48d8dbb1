"""A redirected connection to a service, routed by the service's outbound policy: scripted
discovery (outbound/conftest.py), and a real grpcio OutboundPolicies server answering with the
policies the controller's own translation makes of a Service and an HTTPRoute. The policy is
asked for when the connection's router is made; until it arrives requests take the
ServiceProfile path; a ServiceProfile with routes keeps the service to itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from meshlet.api import outbound_pb2, outbound_pb2_grpc, wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import SessionProtocol
from meshlet.controlplane.k8s.events import Kind, Upsert
from meshlet.controlplane.k8s.objects import service
from meshlet.controlplane.policy.outbound_index import OutboundIndex
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.core.routes import AllOf, Method, PathRegex, Route
from meshlet.proxy.discovery.outbound_policy import WatchOutbound
from meshlet.proxy.http.contract import Endpoint, RouteTarget, Target, Wait, settle
from meshlet.proxy.outbound import connection_router
from meshlet.proxy.outbound.connection_router import OutboundRouter
from meshlet.proxy.outbound.policies import OutboundPolicies

from .conftest import NS, Discovery, fqn

WORKLOAD = f'{{"ns":"{NS}","pod":"vote-bot-1"}}'


def route(parent: str, prefix: str, to: str) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": f"{parent}-route", "namespace": NS},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": parent, "port": 80}],
            "rules": [
                {"matches": [{"path": {"type": "PathPrefix", "value": prefix}}],
                 "backendRefs": [{"name": to, "port": 80}]},
                {"backendRefs": [{"name": parent, "port": 80}]},
            ],
        },
    }  # fmt: skip


class Controller(outbound_pb2_grpc.OutboundPoliciesServicer):
    """Answers each Watch with the policy of the Service its authority names, then waits."""

    def __init__(self, index: OutboundIndex) -> None:
        self.index = index
        self.asked: list[str] = []
        self.silent = False  # never answer for Service api

    async def Watch(  # type: ignore[override]
        self, request: outbound_pb2.TrafficSpec, context: Any
    ) -> AsyncIterator[outbound_pb2.OutboundPolicy]:
        self.asked.append(request.authority)
        name = request.authority.split(".", 1)[0]
        if name == "api" and self.silent:
            await asyncio.Event().wait()  # a controller that never answers
        found = self.index.get(NS, name, 80)
        assert found is not None
        yield found
        await asyncio.Event().wait()


@pytest.fixture
async def policies() -> AsyncIterator[tuple[OutboundPolicies, Controller]]:
    index = OutboundIndex()
    timeouts = {wellknown.TIMEOUT_REQUEST_ANNOTATION: "2s", wellknown.TIMEOUT_IDLE_ANNOTATION: "5s"}
    for name, ip in (("web", "10.96.0.10"), ("web-v2", "10.96.0.11"), ("api", "10.96.0.12")):
        notes = timeouts if name == "web" else None
        index.apply(Upsert(Kind.SERVICE, service(name, NS, cluster_ip=ip, annotations=notes)))
    opaque = service("db", NS, cluster_ip="10.96.0.13")
    opaque["spec"]["ports"][0]["appProtocol"] = "meshlet.io/opaque"
    index.apply(Upsert(Kind.SERVICE, opaque))
    index.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, route("web", "/v2", "web-v2")))
    index.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, route("api", "/v2", "web-v2")))
    controller = Controller(index)
    server = grpc.aio.server()
    outbound_pb2_grpc.add_OutboundPoliciesServicer_to_server(controller, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    followed = OutboundPolicies(
        WatchOutbound(HostPort("127.0.0.1", port), None, None, WORKLOAD), lambda: 0.0
    )
    try:
        yield followed, controller
    finally:
        await followed.aclose()
        await server.stop(grace=0)


async def eventually(condition: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polls state no event announces
            await asyncio.sleep(0.01)


async def routed(router: OutboundRouter, path: str) -> RouteTarget:
    route = await settle(router.route(Target("10.96.0.10:80", "GET", path)))
    assert isinstance(route, RouteTarget), route
    return route


async def endpoint(router: OutboundRouter, path: str) -> Endpoint:
    route = await routed(router, path)
    picked = await settle(route.endpoints.pick())
    assert isinstance(picked, Endpoint), picked
    return picked


async def test_a_redirected_connection_follows_its_service_s_policy(
    discovery: Discovery, policies: tuple[OutboundPolicies, Controller]
) -> None:
    followed, controller = policies
    client = discovery.client
    client.service("web", 80, Discovery.endpoint("10.0.0.1"), cluster_ip="10.96.0.10")
    client.service("web-v2", 80, Discovery.endpoint("10.0.0.2"))
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.96.0.10", 80))
    assert not isinstance(destination, tuple)
    router = OutboundRouter(
        mesh, discovery.metrics, SessionProtocol.HTTP1, destination=destination,
        target=HostPort("10.96.0.10", 80), self_targets=SelfTargets([]), local_ip="10.0.0.7",
        policies=followed,
    )  # fmt: skip
    target = HostPort(fqn("web"), 80)
    assert target in followed  # asked for when the connection's router is made
    # Not answered yet: the first request waits for the policy, then takes its route.
    first = followed.follow(target)
    assert first is not None and first.policy is None
    assert isinstance(router.route(Target("10.96.0.10:80", "GET", "/v2/a")), Wait)
    assert (await endpoint(router, "/v2/a")).addr == HostPort("10.0.0.2", 8080)
    assert first.policy is not None
    assert (await endpoint(router, "/other")).addr == HostPort("10.0.0.1", 8080)
    policy = (await routed(router, "/other")).policy  # the Service's timeout annotations
    assert (policy.timeout, policy.idle_timeout, policy.retryable) == (2.0, 5.0, False)
    assert controller.asked == [f"{fqn('web')}:80"]  # one stream, shared


async def test_a_service_profile_with_routes_keeps_the_policy_out(
    discovery: Discovery, policies: tuple[OutboundPolicies, Controller]
) -> None:
    followed, _ = policies
    client = discovery.client
    items = Route(AllOf((Method("GET"), PathRegex("/.*"))), (), (("route", "all"),),
                  retryable=False, timeout=None)  # fmt: skip
    client.service("api", 80, Discovery.endpoint("10.0.0.3"), cluster_ip="10.96.0.12",
                   routes=(items,))  # fmt: skip
    client.service("web-v2", 80, Discovery.endpoint("10.0.0.2"))
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.96.0.12", 80))
    assert not isinstance(destination, tuple)
    router = OutboundRouter(
        mesh, discovery.metrics, SessionProtocol.HTTP1, destination=destination,
        target=HostPort("10.96.0.12", 80), self_targets=SelfTargets([]), local_ip="10.0.0.7",
        policies=followed,
    )  # fmt: skip
    target = HostPort(fqn("api"), 80)
    await eventually(lambda: (f := followed.follow(target)) is not None and f.policy is not None)
    for _ in range(10):
        assert (await endpoint(router, "/v2/a")).addr == HostPort("10.0.0.3", 8080)


async def test_a_service_without_routes_takes_its_default_route(
    discovery: Discovery, policies: tuple[OutboundPolicies, Controller]
) -> None:
    followed, _ = policies
    discovery.client.service("web-v2", 80, Discovery.endpoint("10.0.0.2"), cluster_ip="10.96.0.11")
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.96.0.11", 80))
    assert not isinstance(destination, tuple)
    router = OutboundRouter(
        mesh, discovery.metrics, SessionProtocol.HTTP1, destination=destination,
        target=HostPort("10.96.0.11", 80), self_targets=SelfTargets([]), local_ip="10.0.0.7",
        policies=followed,
    )  # fmt: skip
    target = HostPort(fqn("web-v2"), 80)
    await eventually(lambda: (f := followed.follow(target)) is not None and f.policy is not None)
    for path in ("/", "/a/b?c=d", "/v2"):
        assert (await endpoint(router, path)).addr == HostPort("10.0.0.2", 8080)
    counted = discovery.metrics.registry.get_sample_value(
        "outbound_http_route_backend_requests_total",
        {
            "parent_group": "core",
            "parent_kind": "Service",
            "parent_namespace": NS,
            "parent_name": "web-v2",
            "parent_port": "80",
            "route_kind": "default",
            "route_name": "http",
            "backend_group": "core",
            "backend_kind": "Service",
            "backend_namespace": NS,
            "backend_name": "web-v2",
            "backend_port": "80",
        },
    )  # the labels left empty are not written
    assert counted == 3


async def test_http_to_a_port_the_policy_calls_opaque_is_routed_as_without_it(
    discovery: Discovery, policies: tuple[OutboundPolicies, Controller]
) -> None:
    followed, _ = policies
    discovery.client.service("db", 80, Discovery.endpoint("10.0.0.4"), cluster_ip="10.96.0.13")
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.96.0.13", 80))
    assert not isinstance(destination, tuple)
    router = OutboundRouter(
        mesh, discovery.metrics, SessionProtocol.HTTP1, destination=destination,
        target=HostPort("10.96.0.13", 80), self_targets=SelfTargets([]), local_ip="10.0.0.7",
        policies=followed,
    )  # fmt: skip
    target = HostPort(fqn("db"), 80)
    await eventually(lambda: (f := followed.follow(target)) is not None and f.policy is not None)
    found = followed.follow(target)
    assert found is not None and found.policy is not None
    assert not found.policy.http1 and not found.policy.http2  # opaque: no HTTP routes
    assert (await endpoint(router, "/")).addr == HostPort("10.0.0.4", 8080)  # not a 404


async def test_a_silent_controller_holds_up_one_wait_not_every_request(
    discovery: Discovery,
    policies: tuple[OutboundPolicies, Controller],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The controller never answers for api: the first request waits POLICY_WAIT and is routed
    without the policy (to api itself, not by its /v2 route); later requests are not held."""
    followed, controller = policies
    controller.silent = True
    monkeypatch.setattr(connection_router, "POLICY_WAIT", 0.2)
    client = discovery.client
    client.service("api", 80, Discovery.endpoint("10.0.0.3"), cluster_ip="10.96.0.12")
    client.service("web-v2", 80, Discovery.endpoint("10.0.0.2"))
    mesh = discovery.mesh()
    destination = await mesh.destination(HostPort("10.96.0.12", 80))
    assert not isinstance(destination, tuple)
    router = OutboundRouter(
        mesh, discovery.metrics, SessionProtocol.HTTP1, destination=destination,
        target=HostPort("10.96.0.12", 80), self_targets=SelfTargets([]), local_ip="10.0.0.7",
        policies=followed,
    )  # fmt: skip
    target = Target("10.96.0.12:80", "GET", "/v2/a")
    first = router.route(target)
    assert isinstance(first, Wait)
    routed = await settle(first)
    assert isinstance(routed, RouteTarget)
    assert (await settle(routed.endpoints.pick())).addr == HostPort("10.0.0.3", 8080)
    assert isinstance(router.route(target), RouteTarget)  # no second wait
