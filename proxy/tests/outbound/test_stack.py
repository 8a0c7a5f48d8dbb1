"""The outbound stack's decisions, as a table: an accepted connection (its original destination,
its first bytes, what discovery says of it) → refused (and why), or served as HTTP/1, HTTP/2 or
opaque TCP, with the labels it is counted under and what routes it. Real loopback connections;
serving is recorded (proxy/tests/conftest.py), discovery is scripted (outbound/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.api.hostport import HostPort
from meshlet.api.ports import parse_ports
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.discovery.resolver import Destination
from meshlet.proxy.http.contract import Addr, Endpoint, RouteTarget, Target, settle
from meshlet.proxy.outbound.destinations import Destinations
from meshlet.proxy.outbound.stack import OutboundStack

GET = b"GET / HTTP/1.1\r\nHost: web:80\r\n\r\n"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HELLO = b"\x16\x03\x01\x00\xa5\x01\x00"  # the start of a TLS ClientHello
POD_IP = "10.0.0.7"
LISTENER = (POD_IP, 4140)
WEB = "web.emojivoto.svc.cluster.local:80"
CLUSTER_IP: Addr = HostPort("10.96.0.10", 80)
DETECT_TIMEOUT = 0.1


def stack(connections: Any, mesh: Destinations | None = None) -> OutboundStack:
    own = SelfTargets([("0.0.0.0", 4140), ("0.0.0.0", 4143)])
    return OutboundStack(connections, mesh, self_targets=own, detect_timeout=DETECT_TIMEOUT,
                         opaque_ports=parse_ports("3306"))  # fmt: skip


async def route_of(router: Any, authority: str) -> RouteTarget:
    route = await settle(router.route(Target(authority, "GET", "/")))
    assert isinstance(route, RouteTarget)
    return route


async def endpoint_of(picker: Any) -> Endpoint:
    endpoint = await settle(picker.pick())
    assert isinstance(endpoint, Endpoint)
    return endpoint


@pytest.mark.parametrize(
    ("original_dst", "first", "how", "target_addr"),
    [
        (("192.0.2.1", 80), GET, "http/1", "192.0.2.1:80"),
        (("192.0.2.1", 80), PREFACE, "h2", "192.0.2.1:80"),
        (("192.0.2.1", 443), HELLO, "opaque", "192.0.2.1:443"),
        (("192.0.2.1", 3306), GET, "opaque", "192.0.2.1:3306"),  # an opaque port: not detected
        (("192.0.2.1", 5432), b"", "opaque", "192.0.2.1:5432"),  # silent: server speaks first
        (None, GET, "http/1", "authority"),  # not redirected: routed request by request
    ],
)
async def test_a_connection_is_served_by_what_its_first_bytes_are(
    connections: Any,
    accept: Any,
    original_dst: Addr | None,
    first: bytes,
    how: str,
    target_addr: str,
) -> None:
    accepted, _ = await accept(first, local=LISTENER, original_dst=original_dst)
    await stack(connections).handle(accepted)
    [served] = connections.served
    assert served.how == how
    assert (served.labels.direction, served.labels.target_addr) == ("outbound", target_addr)


async def test_without_discovery_http_goes_to_the_original_destination(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(GET, local=LISTENER, original_dst=("192.0.2.1", 80))
    await stack(connections).handle(accepted)
    [served] = connections.served
    route = await route_of(served.routing, "web:80")
    assert (await endpoint_of(route.endpoints)).addr == ("192.0.2.1", 80)


async def test_opaque_tcp_without_discovery_is_relayed_to_the_original_destination(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(b"\x00mysql", local=LISTENER, original_dst=("192.0.2.1", 3306))
    await stack(connections).handle(accepted)
    [served] = connections.served
    assert await endpoint_of(served.routing) == Endpoint(("192.0.2.1", 3306), "192.0.2.1:3306")
    assert served.guard is None  # the destination's own proxy guards what reaches its app


async def test_a_silent_client_counts_a_detection_timeout_by_port(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(b"", local=LISTENER, original_dst=("192.0.2.1", 5432))
    await stack(connections).handle(accepted)
    assert connections.counter("protocol_detect_timeout_total", direction="outbound",
                               port="5432") == 1  # fmt: skip


@pytest.mark.parametrize(
    ("original_dst", "first", "reason"),
    [
        (("127.0.0.1", 4140), GET, "loop"),  # the proxy's own port
        ((POD_IP, 4143), GET, "loop"),
        (None, HELLO, "no_original_dst"),  # opaque bytes with nowhere to relay them
        (None, b"", "no_original_dst"),
    ],
)
async def test_refused_connections_are_closed_and_counted_by_reason(
    connections: Any, accept: Any, original_dst: Addr | None, first: bytes, reason: str
) -> None:
    accepted, _ = await accept(first, local=LISTENER, original_dst=original_dst)
    await stack(connections).handle(accepted)
    assert connections.served == []
    assert accepted.sock.fileno() == -1
    assert connections.counter("fail_fast_total", direction="outbound", reason=reason) == 1


async def test_a_client_that_leaves_before_sending_anything_is_not_served(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(b"", local=LISTENER, original_dst=("192.0.2.1", 80), close=True)
    await stack(connections).handle(accepted)
    assert connections.served == []


# -- with discovery --------------------------------------------------------------------------


async def test_http_to_a_discovered_service_is_routed_by_its_profile(
    connections: Any, accept: Any, discovery: Any
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10")
    accepted, _ = await accept(GET, local=LISTENER, original_dst=CLUSTER_IP)
    await stack(connections, discovery.mesh()).handle(accepted)
    [served] = connections.served
    route = await route_of(served.routing, "10.96.0.10")
    assert route.dst == WEB and route.budget is not None
    assert (await endpoint_of(route.endpoints)).addr == ("10.1.0.1", 8080)
    assert served.labels.target_addr == "10.96.0.10:80"


async def test_a_profile_marked_opaque_skips_detection_and_balances_the_connection(
    connections: Any, accept: Any, discovery: Any
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10",
                             opaque=True)  # fmt: skip
    accepted, _ = await accept(GET, local=LISTENER, original_dst=CLUSTER_IP)
    await stack(connections, discovery.mesh()).handle(accepted)
    [served] = connections.served
    assert served.how == "opaque"  # HTTP bytes, but the profile says opaque
    endpoint = await endpoint_of(served.routing)
    assert endpoint.addr == ("10.1.0.1", 8080) and endpoint.lease is not None


async def test_opaque_tcp_to_an_address_discovery_does_not_know_goes_there_as_is(
    connections: Any, accept: Any, discovery: Any
) -> None:
    accepted, _ = await accept(b"\x00mysql", local=LISTENER, original_dst=("192.0.2.1", 3306))
    await stack(connections, discovery.mesh()).handle(accepted)
    [served] = connections.served
    assert await endpoint_of(served.routing) == Endpoint(("192.0.2.1", 3306), "192.0.2.1:3306")


async def test_the_destination_is_held_while_the_connection_is_served(
    connections: Any, accept: Any, discovery: Any
) -> None:
    discovery.client.service("web", 80, discovery.endpoint("10.1.0.1"), cluster_ip="10.96.0.10")
    mesh: Destinations = discovery.mesh()
    users: list[int] = []
    serve_http = connections.http

    async def http(*args: Any, **kwargs: Any) -> None:
        destination = await mesh.destination(CLUSTER_IP)
        assert isinstance(destination, Destination)
        users.append(destination.users)
        await serve_http(*args, **kwargs)

    connections.http = http
    accepted, _ = await accept(GET, local=LISTENER, original_dst=CLUSTER_IP)
    await stack(connections, mesh).handle(accepted)
    destination = await mesh.destination(CLUSTER_IP)
    assert isinstance(destination, Destination)
    assert users == [1] and destination.users == 0


async def test_a_full_discovery_refuses_the_connection_rather_than_send_it_unmeshed(
    connections: Any, accept: Any, discovery: Any
) -> None:
    accepted, _ = await accept(GET, local=LISTENER, original_dst=CLUSTER_IP)
    await stack(connections, discovery.mesh(max_destinations=0)).handle(accepted)
    assert connections.served == []
    assert accepted.sock.fileno() == -1
    assert connections.counter("fail_fast_total", direction="outbound",
                               reason="discovery_full") == 1  # fmt: skip
