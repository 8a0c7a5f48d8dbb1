"""The outbound mesh connector against TLS servers on 127.0.0.2 presenting real certificates
from the project's CA (or from another, or expired, or for someone else): it connects, checks,
writes the transport header and hands over, or refuses and sends nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import transport_header, wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import Decoded, Header, SessionProtocol
from meshlet.proxy.mesh import MeshConnectError, Refusal, mesh_connect
from meshlet.proxy.tls import contexts

WEB = wellknown.identity_name("web", "emojivoto")
DB = wellknown.identity_name("db", "emojivoto")
SERVER_IP = "127.0.0.2"


# -- a TLS server that records what reached it --


@dataclass
class Server:
    port: int
    received: bytearray = field(default_factory=bytearray)
    connections: int = 0
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    peers: list[str] = field(default_factory=list)  # the clients' addresses


@pytest.fixture
async def tls_server() -> AsyncIterator[Callable[[ssl.SSLContext], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(context: ssl.SSLContext) -> Server:
        server: Server

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server.connections += 1
            server.peers.append(writer.get_extra_info("peername")[0])
            try:
                while data := await reader.read(65536):
                    server.received += data
                    writer.write(data.upper())
            except (OSError, ssl.SSLError):
                pass
            finally:
                writer.close()
                server.closed.set()

        listener = await asyncio.start_server(handle, SERVER_IP, 0, ssl=context)
        servers.append(listener)
        server = Server(listener.sockets[0].getsockname()[1])
        return server

    yield start
    for listener in servers:
        listener.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(listener.wait_closed(), 1.0)


class Collect(asyncio.Protocol):
    """The caller's protocol: what the engines or the relay would be."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.data = bytearray()
        self.made_before_data = False
        self.lost = asyncio.Event()
        self.arrived = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.made_before_data = not self.data

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.arrived.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


def server_context(pki: Any, chain_key: tuple[Path, Path], **kw: Any) -> ssl.SSLContext:
    return contexts.server_context(*chain_key, pki.anchors, require_client_cert=True, **kw)


# -- tests --


async def test_connects_writes_the_header_then_hands_over(pki: Any, tls_server: Any) -> None:
    server = await tls_server(server_context(pki, pki.leaf(DB)))
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    connect = mesh_connect(client, DB, 8080, SessionProtocol.HTTP1, "db.emojivoto.svc:8080")

    transport, protocol = await connect(HostPort(SERVER_IP, server.port), Collect)
    assert isinstance(protocol, Collect) and protocol.transport is transport
    assert protocol.made_before_data
    ssl_object = transport.get_extra_info("ssl_object")
    assert ssl_object.version() == "TLSv1.3"
    assert contexts.peer_identity(ssl_object) == DB
    transport.write(b"ping")
    async with asyncio.timeout(5):
        while not protocol.data.endswith(b"PING"):
            await protocol.arrived.wait()
            protocol.arrived.clear()
    decoded = transport_header.decode(bytes(server.received))
    assert isinstance(decoded, Decoded)
    assert decoded.header == Header(8080, "db.emojivoto.svc:8080", SessionProtocol.HTTP1)
    assert server.received[decoded.consumed :] == b"ping"
    assert transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    transport.close()
    await asyncio.wait_for(protocol.lost.wait(), 5)


@pytest.mark.parametrize("source", [None, "127.0.99.7"])
async def test_connections_come_from_the_source_address_asked_for(
    pki: Any, tls_server: Any, source: str | None
) -> None:
    """Pods sharing one host's loopback: without a source address the kernel picks 127.0.0.1
    for every one of them, which the server cannot tell apart (nor from its own localhost)."""
    server = await tls_server(server_context(pki, pki.leaf(DB)))
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    connect = mesh_connect(client, DB, 8080, SessionProtocol.HTTP1, source_ip=source)
    transport, protocol = await connect(HostPort(SERVER_IP, server.port), Collect)
    assert isinstance(protocol, Collect)
    assert transport.get_extra_info("sockname")[0] == (source or "127.0.0.1")
    transport.write(b"ping")  # answered once the server's handler runs
    async with asyncio.timeout(5):
        await protocol.arrived.wait()
    transport.close()
    assert server.peers == [source or "127.0.0.1"]


@pytest.mark.parametrize(
    ("server_cert", "reason"),
    [
        ("other_ca", Refusal.UNTRUSTED),
        ("expired", Refusal.EXPIRED),
        ("wrong_identity", Refusal.WRONG_IDENTITY),
        ("wildcard", Refusal.WRONG_IDENTITY),
        ("no_alpn", Refusal.NO_MESH_ALPN),
    ],
)
async def test_refuses_a_server_that_is_not_who_discovery_named(
    pki: Any, tls_server: Any, server_cert: str, reason: Refusal, caplog: Any
) -> None:
    context = {
        "other_ca": lambda: server_context(pki, pki.leaf(DB, pki.other_issuer())),
        "expired": lambda: server_context(pki, pki.expired_leaf(DB)),
        "wrong_identity": lambda: server_context(pki, pki.leaf(WEB)),
        # OpenSSL's name check accepts a wildcard; the identity check does not.
        "wildcard": lambda: server_context(
            pki, pki.leaf("*.emojivoto.serviceaccount.identity.meshlet.cluster.local")
        ),
        "no_alpn": lambda: server_context(pki, pki.leaf(DB), alpn=()),
    }[server_cert]()
    server = await tls_server(context)
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    connect = mesh_connect(client, DB, 8080, SessionProtocol.OPAQUE)
    made: list[Collect] = []

    with pytest.raises(MeshConnectError) as refused:
        await connect(HostPort(SERVER_IP, server.port), lambda: made.append(Collect()) or made[-1])
    assert refused.value.reason is reason
    assert DB in str(refused.value) and reason.value in str(refused.value)
    assert not made  # the caller's protocol never saw the connection
    if server.connections:  # the handshake completed on the server's side
        await asyncio.wait_for(server.closed.wait(), 5)
    assert server.received == b""  # not even the transport header was sent
    assert any(reason.value in r.getMessage() for r in caplog.records)


async def test_tls_below_1_3_is_refused(pki: Any, tls_server: Any) -> None:
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    assert client.minimum_version is ssl.TLSVersion.TLSv1_3
    legacy = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    legacy.load_cert_chain(*pki.leaf(DB))
    legacy.maximum_version = ssl.TLSVersion.TLSv1_2
    legacy.set_alpn_protocols([wellknown.TRANSPORT_ALPN])
    server = await tls_server(legacy)

    with pytest.raises(MeshConnectError) as refused:
        await mesh_connect(client, DB, 80, SessionProtocol.OPAQUE)(
            HostPort(SERVER_IP, server.port), Collect
        )
    # The server alerts "protocol version", which reaches this side as the connection closing.
    assert refused.value.reason in (Refusal.TLS_VERSION, Refusal.HANDSHAKE_FAILED)
    assert server.received == b""


async def test_a_server_that_never_answers_times_out(pki: Any) -> None:
    silent = socket.socket()
    silent.bind((SERVER_IP, 0))
    silent.listen()
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    connect = mesh_connect(client, DB, 80, SessionProtocol.OPAQUE, timeout=0.2)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError, match=r"TLS handshake with .* timed out after 0\.2s"):
            await connect(HostPort.from_sockaddr(silent.getsockname()), Collect)
        assert loop.time() - started < 1.0
    finally:
        silent.close()


async def test_an_unreachable_peer_is_an_os_error_not_a_refusal(pki: Any) -> None:
    not_listening = socket.socket()  # bound, so the port stays ours, but refusing connections
    not_listening.bind((SERVER_IP, 0))
    client = contexts.client_context(*pki.leaf(WEB), pki.anchors)
    try:
        with pytest.raises(ConnectionRefusedError):
            await mesh_connect(client, DB, 80, SessionProtocol.OPAQUE)(
                HostPort.from_sockaddr(not_listening.getsockname()), Collect
            )
    finally:
        not_listening.close()
