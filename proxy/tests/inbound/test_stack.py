"""The inbound stack's decisions for plain connections, as a table: an accepted connection (its
target port, its first bytes) → refused (and why), or served as HTTP/1, HTTP/2 or opaque TCP
towards the pod's port, with the labels it is counted under. Real loopback connections;
serving is recorded (conftest `connections`). Mesh sessions (mTLS to the inbound port) are
covered end to end in mesh/test_component.py."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.api.ports import parse_ports
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.http.contract import Endpoint, RouteTarget, Target
from meshlet.proxy.inbound.stack import InboundStack

POD_IP = "10.0.0.7"
INBOUND_PORT = 4143
ADMIN_PORT = 4191
GET = b"GET / HTTP/1.1\r\nHost: web:8080\r\n\r\n"
HELLO = b"\x16\x03\x01\x00\xa5\x01\x00"  # the start of a TLS ClientHello
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DETECT_TIMEOUT = 0.1
LISTENER = (POD_IP, INBOUND_PORT)  # where iptables sends what arrives for the pod


def stack(connections: Any, opaque: str = "3306", require_identity: str = "9443") -> InboundStack:
    own = SelfTargets([("0.0.0.0", INBOUND_PORT), ("0.0.0.0", ADMIN_PORT)])
    return InboundStack(connections, None, port=INBOUND_PORT, self_targets=own,
                        detect_timeout=DETECT_TIMEOUT, opaque_ports=parse_ports(opaque),
                        require_identity=parse_ports(require_identity))  # fmt: skip


@pytest.mark.parametrize(
    ("port", "first", "how"),
    [
        (8080, GET, "http/1"),
        (8080, PREFACE, "h2"),
        (8080, HELLO, "opaque"),  # TLS from the client: not HTTP
        (3306, GET, "opaque"),  # an opaque port is never detected, whatever arrives
        (5432, b"", "opaque"),  # silent until the detection timeout: server speaks first
    ],
)
async def test_a_plain_connection_is_served_by_what_its_first_bytes_are(
    connections: Any, accept: Any, port: int, first: bytes, how: str
) -> None:
    accepted, _ = await accept(first, local=LISTENER, original_dst=(POD_IP, port))
    await stack(connections, opaque="3306").handle(accepted)
    [served] = connections.served
    assert served.how == how
    assert served.labels.direction == "inbound"
    assert served.labels.target_addr == f"{POD_IP}:{port}"
    assert served.labels.tls == "no_identity" and served.labels.client_id == ""
    assert served.add_headers == ()  # no identity to vouch for


async def test_http_is_forwarded_to_the_pods_port_whatever_the_request_names(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(GET, local=LISTENER, original_dst=(POD_IP, 8080))
    await stack(connections).handle(accepted)
    [served] = connections.served
    route = served.routing.route(Target("elsewhere.example:80", "GET", "/"))
    assert isinstance(route, RouteTarget)
    endpoint = route.endpoints.pick()
    assert isinstance(endpoint, Endpoint) and endpoint.addr == (POD_IP, 8080)


async def test_opaque_tcp_is_relayed_to_the_pods_port(connections: Any, accept: Any) -> None:
    accepted, _ = await accept(b"\x00binary", local=LISTENER, original_dst=(POD_IP, 3306))
    await stack(connections).handle(accepted)
    [served] = connections.served
    assert served.routing.pick() == Endpoint((POD_IP, 3306), f"{POD_IP}:3306")
    assert served.guard is None


async def test_a_silent_client_is_relayed_with_a_guard_and_the_timeout_counted(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(b"", local=LISTENER, original_dst=(POD_IP, 5432))
    await stack(connections).handle(accepted)
    [served] = connections.served
    assert served.how == "opaque"
    assert served.guard is not None  # HTTP arriving later is refused, not relayed
    check, refused = served.guard
    assert check(b"GET / HTTP/1.1\r\n", False) is True
    assert check(b"\x00\x00\x00\x08", True) is False
    refused()
    assert connections.counter("fail_fast_total", direction="inbound", reason="late_http") == 1
    assert connections.counter("protocol_detect_timeout_total", direction="inbound",
                               port="5432") == 1  # fmt: skip


async def test_bytes_that_are_not_http_are_relayed_without_a_guard(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(HELLO, local=LISTENER, original_dst=(POD_IP, 8443))
    await stack(connections).handle(accepted)
    [served] = connections.served
    assert served.guard is None
    assert connections.counter("protocol_detect_timeout_total", direction="inbound",
                               port="8443") == 0  # fmt: skip


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ((POD_IP, 9443), "identity_required"),  # plaintext to a port that demands mTLS
        ((POD_IP, ADMIN_PORT), "loop"),
        (("127.0.0.1", ADMIN_PORT), "loop"),
        ((POD_IP, INBOUND_PORT), "no_identity"),  # mTLS before this proxy has a certificate
    ],
)
async def test_refused_connections_are_closed_and_counted_by_reason(
    connections: Any, accept: Any, target: tuple[str, int], reason: str
) -> None:
    accepted, _ = await accept(GET, local=LISTENER, original_dst=target)
    await stack(connections).handle(accepted)
    assert connections.served == []
    assert accepted.sock.fileno() == -1  # closed
    assert connections.counter("fail_fast_total", direction="inbound", reason=reason) == 1


async def test_a_client_that_leaves_before_sending_anything_is_not_served(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(b"", local=LISTENER, original_dst=(POD_IP, 8080), close=True)
    await stack(connections).handle(accepted)
    assert connections.served == []
    assert accepted.sock.fileno() == -1


async def test_the_connection_is_counted_open_while_served_and_closed_after(
    connections: Any, accept: Any
) -> None:
    accepted, _ = await accept(GET, local=LISTENER, original_dst=(POD_IP, 8080))
    await stack(connections).handle(accepted)
    labels = {"peer": "src", "direction": "inbound", "target_addr": f"{POD_IP}:8080"}
    assert connections.counter("tcp_open_total", **labels) == 1
    assert connections.counter("tcp_open_connections", **labels) == 0
    assert connections.counter("tcp_close_total", **labels) == 1
