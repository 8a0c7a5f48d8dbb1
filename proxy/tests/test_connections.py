"""What both stacks share once a connection's fate is known: counting it, refusing it, and
relaying opaque TCP to the endpoint picked, trying others when one cannot be reached. Real
loopback connections: an echo server upstream, ports nobody listens on, a client socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshlet.proxy.connections import Connections
from meshlet.proxy.core.failover import MAX_CONNECTS
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.contract import Addr, Endpoint, HttpLimits, RouteError
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Accepted
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.lease import RecordingLease


def count(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def connections() -> Connections:
    return Connections(ProxyMetrics(), HttpLimits(), tcp_connector(1.0), asyncio.Event())


def unused_port() -> Addr:
    """An address nobody listens on: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        host, port = sock.getsockname()[:2]
    return host, port


@pytest.fixture
async def echo() -> AsyncIterator[Addr]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer), contextlib.suppress(ConnectionError):
            while data := await reader.read(1024):
                writer.write(data)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[:2]
    server.close()
    await server.wait_closed()


class Script:
    """Picks each endpoint of `addrs` in turn, each with its own lease."""

    def __init__(self, *addrs: Addr) -> None:
        self.addrs = list(addrs)
        self.leases: list[RecordingLease] = []
        self.afters: list[Addr | None] = []
        self.picked: list[Endpoint] = []  # where each pick was told the last attempt went

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError:
        self.afters.append(after.addr if after is not None else None)
        if not self.addrs:
            return RouteError(503, "no endpoints left")
        lease = RecordingLease()
        self.leases.append(lease)
        addr = self.addrs.pop(0)
        self.picked.append(Endpoint(addr, f"{addr[0]}:{addr[1]}", lease=lease))
        return self.picked[-1]


async def relayed(conns: Connections, picker: Any, sent: bytes) -> bytes:
    """Relays a fresh client connection through `picker`; what the client got back before the
    connection ended (a reset reads as b"")."""
    loop = asyncio.get_running_loop()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        listening.setblocking(False)
        client = socket.create_connection(listening.getsockname()[:2])
        sock, addr = await loop.sock_accept(listening)
    sock.setblocking(False)
    accepted = Accepted(sock, addr[:2], sock.getsockname()[:2], None, loop.time())
    labels = conns.metrics.conn("outbound", "10.96.0.10:3306")
    client.setblocking(False)
    with client:
        await loop.sock_sendall(client, sent)
        client.shutdown(socket.SHUT_WR)
        async with conns.counted(labels) as tcp:
            relay = asyncio.create_task(conns.relay(accepted, picker, labels, tcp))
            received = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await loop.sock_recv(client, 1024):
                    received += chunk
        await relay
    return received


async def test_opaque_bytes_are_relayed_both_ways(echo: Addr) -> None:
    conns = connections()
    assert await relayed(conns, FixedPicker(Endpoint(echo, "echo")), b"ping") == b"ping"


async def test_a_balanced_endpoint_hears_of_its_connection_and_its_end(echo: Addr) -> None:
    script = Script(echo)
    assert await relayed(connections(), script, b"ping") == b"ping"
    assert script.leases[0].events == ["responded", "release"]  # the connect time: the sample


async def test_unreachable_endpoints_are_skipped_until_one_answers(echo: Addr) -> None:
    script = Script(unused_port(), unused_port(), echo)
    assert await relayed(connections(), script, b"ping") == b"ping"
    assert [lease.events[0] for lease in script.leases] == ["failed", "failed", "responded"]
    tried = [e.addr for e in script.picked]
    assert script.afters == [None, *tried[:2]]  # each pick knows where the last one failed


async def test_after_max_connects_failures_the_client_is_reset(echo: Addr) -> None:
    script = Script(*(unused_port() for _ in range(MAX_CONNECTS)), echo)
    assert await relayed(connections(), script, b"ping") == b""
    assert len(script.leases) == MAX_CONNECTS  # the endpoint after them is never tried


async def test_a_fixed_endpoint_that_cannot_be_reached_is_not_retried() -> None:
    conns = connections()
    assert await relayed(conns, FixedPicker(Endpoint(unused_port(), "gone")), b"ping") == b""


async def test_a_route_error_resets_the_client() -> None:
    assert await relayed(connections(), Script(), b"ping") == b""


async def test_a_counted_connection_is_open_while_served_then_closed(echo: Addr) -> None:
    conns = connections()
    labels = conns.metrics.conn("inbound", "10.0.0.7:8080")
    async with conns.counted(labels) as tcp:
        assert count(conns.metrics, "tcp_open_connections", peer="src", direction="inbound") == 1
        tcp.read += 10
    assert count(conns.metrics, "tcp_open_connections", peer="src", direction="inbound") == 0
    assert count(conns.metrics, "tcp_close_total", peer="src", direction="inbound") == 1
    assert count(conns.metrics, "tcp_read_bytes_total", peer="src", direction="inbound") == 10


@pytest.mark.parametrize(("port", "label"), [(5432, "5432"), (None, "unknown")])
def test_detection_timeouts_are_counted_by_port(port: int | None, label: str) -> None:
    conns = connections()
    conns.detect_timed_out("outbound", 10.0, port)
    assert count(conns.metrics, "protocol_detect_timeout_total", direction="outbound",
                 port=label) == 1  # fmt: skip


def test_a_late_http_check_refuses_http_and_counts_it() -> None:
    conns = connections()
    check, refused = conns.late_http_check("10.0.0.9:51000", 5432, 10.0)
    assert check(b"POST /x HTTP/1.1\r\n", False) is True
    assert check(b"GE", False) is None  # not known yet: more bytes are awaited
    assert check(b"\x00\x00\x00\x08\x04\xd2\x16\x2f", True) is False  # a Postgres SSLRequest
    refused()
    assert count(conns.metrics, "fail_fast_total", direction="inbound", reason="late_http") == 1
