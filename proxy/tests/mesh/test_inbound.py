"""The inbound mesh terminator end to end: a "db" pod on 127.0.0.2 (its inbound listener and its
app), a "web" pod on 127.0.0.3 (its outbound engine), real TLS from the project's CA between
them. What reaches the app, and every refusal, is observed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, RequestReceived, ResponseReceived, StreamEnded

from meshlet.api import transport_header, wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.transport_header import Header, SessionProtocol
from meshlet.proxy.core import sni
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.fixed_router import FixedRouter
from meshlet.proxy.http.contract import CLIENT_ID_HEADER, HttpConn, HttpLimits
from meshlet.proxy.http.h1 import serve_h1
from meshlet.proxy.http.h2server import serve_h2
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.counters import TcpConn
from meshlet.proxy.io.listener import Accepted, Listener, bind
from meshlet.proxy.mesh import (
    MeshInbound,
    PassThrough,
    Refusal,
    Refused,
    Terminated,
    mesh_connect,
    relay,
)
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.tls import contexts

WEB = wellknown.identity_name("web", "emojivoto")
DB = wellknown.identity_name("db", "emojivoto")
DB_IP, WEB_IP = "127.0.0.2", "127.0.0.3"
ADMIN_PORT = 4191
TIMEOUT = 5.0
Outcome = Terminated | PassThrough | Refused


# -- the db pod: its app (opaque, HTTP/1, HTTP/2) and its inbound terminator --


@dataclass
class App:
    """The db pod's servers on 127.0.0.2, recording what reached them."""

    opaque_port: int = 0
    h1_port: int = 0
    h2_port: int = 0
    opaque_received: bytearray = field(default_factory=bytearray)
    h1_heads: list[bytes] = field(default_factory=list)
    h2_headers: list[list[tuple[bytes, bytes]]] = field(default_factory=list)
    connections: int = 0
    transports: list[asyncio.BaseTransport] = field(default_factory=list)  # closed at the end


async def opaque_app(app: App, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Speaks first, echoes in upper case, says bye and closes at "quit" or the client's FIN."""
    app.connections += 1
    app.transports.append(writer.transport)
    writer.write(b"db ready\n")
    while data := await reader.read(65536):
        app.opaque_received += data
        writer.write(data.upper())
        if data.endswith(b"quit"):
            break
    writer.write(b"bye\n")
    await writer.drain()
    writer.close()


async def h1_app(app: App, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request with its head as the body."""
    app.connections += 1
    app.transports.append(writer.transport)
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            app.h1_heads.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(head), head))
    writer.close()


class H2App(asyncio.Protocol):
    """Answers every request with 200 and the number of headers it saw."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.app.connections += 1
        self.app.transports.append(transport)
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, RequestReceived):
                self.app.h2_headers.append(list(event.headers))
                body = b"%d headers" % len(event.headers)
                self.h2.send_headers(event.stream_id, [(b":status", b"200")])
                self.h2.send_data(event.stream_id, body, end_stream=True)
            elif isinstance(event, DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.transport.write(self.h2.data_to_send())


@dataclass
class DbPod:
    """The inbound listener and what it decided for each connection."""

    port: int
    app: App
    outcomes: list[Outcome] = field(default_factory=list)
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)
    passed_bytes: list[bytes] = field(default_factory=list)
    passed: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    hold: bool = False  # keep Terminated connections undispatched, for the test to adopt
    relayed: list[tuple[TcpConn, TcpConn]] = field(default_factory=list)  # (client, app)

    async def next_outcome(self) -> Outcome:
        async with asyncio.timeout(TIMEOUT):
            while not self.outcomes:
                self.decided.clear()
                await self.decided.wait()
        return self.outcomes.pop(0)


StartDb = Callable[..., Awaitable[DbPod]]


@pytest.fixture
async def db_pod(pki: Any) -> AsyncIterator[StartDb]:
    """`await db_pod(detect_timeout=...)`: the db pod's app and inbound terminator on 127.0.0.2."""
    cleanup: list[Callable[[], Awaitable[None]]] = []

    async def start(detect_timeout: float = 2.0, hold: bool = False) -> DbPod:
        server_ctx = contexts.server_context(*pki.leaf(DB), pki.anchors, require_client_cert=True)
        app = App()
        servers: list[asyncio.Server] = []
        listener: Listener | None = None
        task: asyncio.Task[None] | None = None

        async def stop() -> None:
            if listener is not None:
                listener.stop_accepting()
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if listener is not None:
                await listener.drain(grace=1.0)
            for transport in app.transports:
                transport.abort()
            for server in servers:
                server.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(server.wait_closed(), 1.0)

        cleanup.append(stop)  # before anything is started: a failure below leaks nothing
        loop = asyncio.get_running_loop()
        servers.append(await asyncio.start_server(lambda r, w: opaque_app(app, r, w), DB_IP, 0))
        servers.append(await asyncio.start_server(lambda r, w: h1_app(app, r, w), DB_IP, 0))
        servers.append(await loop.create_server(lambda: H2App(app), DB_IP, 0))
        app.opaque_port, app.h1_port, app.h2_port = (s.sockets[0].getsockname()[1] for s in servers)
        sock = bind((DB_IP, 0))
        port = sock.getsockname()[1]
        own = SelfTargets([(DB_IP, port), ("0.0.0.0", ADMIN_PORT)])
        inbound = MeshInbound(server_ctx, DB, own, detect_timeout)
        pod = DbPod(port, app, hold=hold)
        metrics, closing = ProxyMetrics(), asyncio.Event()

        async def handle(accepted: Accepted) -> None:
            outcome = await inbound.accept(accepted)
            pod.outcomes.append(outcome)
            pod.decided.set()
            if isinstance(outcome, Refused):
                pod.refusals[outcome.reason.value] += 1
            elif isinstance(outcome, PassThrough):
                async with asyncio.timeout(TIMEOUT):
                    pod.passed_bytes.append(await loop.sock_recv(accepted.sock, 65536))
                pod.passed.set()
                accepted.sock.close()
            elif not pod.hold:
                await dispatch(outcome, metrics, closing, pod)

        listener = Listener(sock, handle, "inbound")
        task = asyncio.create_task(listener.serve())
        return pod

    yield start
    for stop in cleanup:
        await stop()


async def dispatch(
    terminated: Terminated, metrics: ProxyMetrics, closing: asyncio.Event, pod: DbPod
) -> None:
    """What the app does with a terminated connection, by the header's session protocol."""
    if terminated.header.protocol is SessionProtocol.OPAQUE:
        client, app = TcpConn.uncounted(), TcpConn.uncounted()
        pod.relayed.append((client, app))
        await relay(terminated, tcp_connector(1.0), client, app)
        return
    target = terminated.target

    conn = HttpConn(
        sock=None,
        router=FixedRouter(target, metrics),
        connect=tcp_connector(1.0),
        metrics=metrics,
        labels=metrics.conn("inbound", f"{target[0]}:{target[1]}", tls="true"),
        limits=HttpLimits(),
        closing=closing,
        add_headers=[(CLIENT_ID_HEADER, terminated.client_id.encode())],
        handoff=terminated,
    )
    if terminated.header.protocol is SessionProtocol.HTTP1:
        await serve_h1(conn)
    else:
        await serve_h2(conn)


# -- clients --


class Collect(asyncio.Protocol):
    """A protocol on the client side of a mesh connection: collects bytes, notices the end."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.data = bytearray()
        self.eof = False
        self.changed = asyncio.Event()
        self.lost = asyncio.Event()
        self.lost_exc: Exception | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.changed.set()

    def eof_received(self) -> bool:
        self.eof = True
        self.changed.set()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_exc = exc
        self.lost.set()
        self.changed.set()

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(TIMEOUT):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


def web_context(pki: Any) -> ssl.SSLContext:
    return contexts.client_context(*pki.leaf(WEB), pki.anchors)


async def mesh_to(
    pki: Any, pod: DbPod, port: int, session: SessionProtocol, protocol: asyncio.Protocol
) -> Any:
    connect = mesh_connect(web_context(pki), DB, port, session)
    transport, _ = await connect(HostPort(DB_IP, pod.port), lambda: protocol)
    return transport


async def raw_tls(
    pod: DbPod, context: ssl.SSLContext, server_name: str = DB
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(DB_IP, pod.port, ssl=context, server_hostname=server_name)


async def closed_by_peer(reader: asyncio.StreamReader) -> None:
    """The server closed the connection: EOF, or the TLS alert it sent before closing."""
    with contextlib.suppress(ssl.SSLError, ConnectionError):
        async with asyncio.timeout(TIMEOUT):
            assert await reader.read() == b""


class H2Probe(asyncio.Protocol):
    """A prior-knowledge HTTP/2 client over any transport (plain, or a mesh connection)."""

    def __init__(self) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.transport: Any = None
        self.responses: dict[int, tuple[list[tuple[bytes, bytes]], bytearray]] = {}
        self.ended: set[int] = set()
        self.changed = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, ResponseReceived):
                self.responses[event.stream_id] = (list(event.headers), bytearray())
            elif isinstance(event, DataReceived):
                self.responses[event.stream_id][1].extend(event.data)
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamEnded):
                self.ended.add(event.stream_id)
        self.transport.write(self.h2.data_to_send())
        self.changed.set()

    async def get(self, extra: list[tuple[bytes, bytes]]) -> tuple[dict[bytes, bytes], bytes]:
        stream_id = self.h2.get_next_available_stream_id()
        headers = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"),
                   (b":authority", b"db.emojivoto.svc"), *extra]  # fmt: skip
        self.h2.send_headers(stream_id, headers, end_stream=True)
        self.transport.write(self.h2.data_to_send())
        async with asyncio.timeout(TIMEOUT):
            while stream_id not in self.ended:
                self.changed.clear()
                await self.changed.wait()
        response_headers, body = self.responses[stream_id]
        return dict(response_headers), bytes(body)


def h1_request(extra: bytes = b"") -> bytes:
    return b"GET /x HTTP/1.1\r\nhost: db.emojivoto.svc\r\n" + extra + b"\r\n"


def client_id_seen(head: bytes) -> list[bytes]:
    return [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"meshlet-client-id:")
    ]


# -- the mesh transport end to end --


async def test_opaque_bytes_cross_both_ways_behind_the_header(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod()
    client = Collect()
    transport = await mesh_to(pki, pod, pod.app.opaque_port, SessionProtocol.OPAQUE, client)

    await client.until(lambda: client.data == b"db ready\n")  # the app speaks first
    transport.write(b"hello over mtls")
    await client.until(lambda: client.data.endswith(b"HELLO OVER MTLS"))
    transport.write(b", quit")  # the app closes: its last bytes, then the close, come through
    await client.until(lambda: client.eof)
    transport.close()
    await client.until(lambda: client.lost.is_set())
    assert client.data == b"db ready\nHELLO OVER MTLS, QUIT" + b"bye\n"

    outcome = await pod.next_outcome()
    assert isinstance(outcome, Terminated)
    assert outcome.header == Header(pod.app.opaque_port, "", SessionProtocol.OPAQUE)
    assert outcome.client_id == WEB
    assert outcome.target == (DB_IP, pod.app.opaque_port)  # the pod's own IP
    assert pod.app.opaque_received == b"hello over mtls, quit"
    ((client, app),) = pod.relayed  # bytes read from each side, written to the other
    assert (client.read, app.written) == (21, 21)
    assert (app.read, client.written) == (9 + 21 + 4, 9 + 21 + 4)


async def test_bytes_sent_with_the_header_reach_the_app(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod()
    reader, writer = await raw_tls(pod, web_context(pki))
    payload = b"first bytes, in the header's own write"
    writer.write(transport_header.encode(Header(pod.app.opaque_port)) + payload)

    async with asyncio.timeout(TIMEOUT):
        assert await reader.readexactly(9) == b"db ready\n"
        assert await reader.readexactly(len(payload)) == payload.upper()
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Terminated)
    assert payload.startswith(outcome.initial)  # what was read past the header, replayed
    writer.close()


async def test_http1_through_the_terminator_carries_the_client_identity(
    pki: Any, db_pod: StartDb
) -> None:
    pod = await db_pod()
    client = Collect()
    transport = await mesh_to(pki, pod, pod.app.h1_port, SessionProtocol.HTTP1, client)

    transport.write(h1_request(b"meshlet-client-id: forged.by.the.client\r\n"))
    await client.until(lambda: b"GET /x" in client.data and client.data.endswith(b"\r\n\r\n"))
    assert client.data.startswith(b"HTTP/1.1 200 OK\r\n")
    (head,) = pod.app.h1_heads
    assert client_id_seen(head) == [WEB.encode()]  # the forged one stripped, ours added
    transport.close()


async def test_http1_from_the_outbound_engine_reuses_one_mesh_connection(
    pki: Any, db_pod: StartDb
) -> None:
    """web's outbound engine (127.0.0.3) → mTLS → db's inbound (127.0.0.2) → db's app."""
    pod = await db_pod()
    metrics, closing = ProxyMetrics(), asyncio.Event()
    connect = mesh_connect(web_context(pki), DB, pod.app.h1_port, SessionProtocol.HTTP1)

    router = FixedRouter(HostPort(DB_IP, pod.port), metrics)

    async def outbound(accepted: Accepted) -> None:
        labels = metrics.conn("outbound", "db.emojivoto.svc:80")
        await serve_h1(
            HttpConn(accepted.sock, router, connect, metrics, labels, HttpLimits(), closing)
        )

    listener = Listener(bind((WEB_IP, 0)), outbound, "outbound")
    task = asyncio.create_task(listener.serve())
    try:
        reader, writer = await asyncio.open_connection(*listener.address)
        for _ in range(2):
            writer.write(h1_request(b"meshlet-client-id: forged\r\n"))
            async with asyncio.timeout(TIMEOUT):
                assert await reader.readuntil(b"\r\n\r\n") == (
                    b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(pod.app.h1_heads[-1])
                )
                await reader.readexactly(len(pod.app.h1_heads[-1]))
        writer.close()
    finally:
        listener.stop_accepting()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await listener.drain(grace=1.0)
    assert [client_id_seen(head) for head in pod.app.h1_heads] == [[WEB.encode()]] * 2
    assert len(pod.outcomes) == 1 and isinstance(pod.outcomes[0], Terminated)  # one handshake


async def test_http2_through_the_terminator_carries_the_client_identity(
    pki: Any, db_pod: StartDb
) -> None:
    pod = await db_pod()
    probe = H2Probe()
    transport = await mesh_to(pki, pod, pod.app.h2_port, SessionProtocol.HTTP2, probe)

    for _ in range(2):  # two streams on one mesh connection
        headers, _body = await probe.get([(b"meshlet-client-id", b"forged")])
        assert headers[b":status"] == b"200"
    seen = [[v for k, v in h if k == b"meshlet-client-id"] for h in pod.app.h2_headers]
    assert seen == [[WEB.encode()]] * 2
    assert len(pod.outcomes) == 1
    transport.close()


async def test_http2_from_the_outbound_engine(pki: Any, db_pod: StartDb) -> None:
    """A plain HTTP/2 client → web's outbound engine → mTLS → db's inbound engine → db's app."""
    pod = await db_pod()
    metrics, closing = ProxyMetrics(), asyncio.Event()
    connect = mesh_connect(web_context(pki), DB, pod.app.h2_port, SessionProtocol.HTTP2)

    router = FixedRouter(HostPort(DB_IP, pod.port), metrics)

    async def outbound(accepted: Accepted) -> None:
        labels = metrics.conn("outbound", "db.emojivoto.svc:80")
        await serve_h2(
            HttpConn(accepted.sock, router, connect, metrics, labels, HttpLimits(), closing)
        )

    listener = Listener(bind((WEB_IP, 0)), outbound, "outbound")
    task = asyncio.create_task(listener.serve())
    try:
        probe = H2Probe()
        transport, _ = await asyncio.get_running_loop().create_connection(
            lambda: probe, *listener.address
        )
        headers, _body = await probe.get([(b"x-request", b"1")])
        assert headers[b":status"] == b"200"
        transport.close()
    finally:
        listener.stop_accepting()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await listener.drain(grace=1.0)
    (seen,) = pod.app.h2_headers
    assert (b"meshlet-client-id", WEB.encode()) in seen and (b"x-request", b"1") in seen


# -- refusals: closed, counted, logged --


def tls12_client(pki: Any) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=pki.anchors)
    context.load_cert_chain(*pki.leaf(WEB))
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols([wellknown.TRANSPORT_ALPN])
    return context


@pytest.mark.parametrize(
    ("client", "reason"),
    [
        ("no_certificate", Refusal.NO_CLIENT_CERTIFICATE),
        ("other_ca", Refusal.UNTRUSTED),
        ("expired", Refusal.EXPIRED),
        ("not_yet_valid", Refusal.NOT_YET_VALID),
        ("tls_1_2", Refusal.TLS_VERSION),
        ("no_alpn", Refusal.NO_MESH_ALPN),
    ],
)
async def test_a_client_that_is_not_a_mesh_peer_is_refused(
    pki: Any, db_pod: StartDb, client: str, reason: Refusal, caplog: Any
) -> None:
    pod = await db_pod()
    context = {
        "no_certificate": lambda: contexts.client_context(None, None, pki.anchors),
        "other_ca": lambda: contexts.client_context(
            *pki.leaf(WEB, pki.other_issuer()), pki.anchors
        ),
        "expired": lambda: contexts.client_context(*pki.expired_leaf(WEB), pki.anchors),
        "not_yet_valid": lambda: contexts.client_context(
            *pki.leaf(WEB, issued_at=pki.now + dt.timedelta(hours=1)), pki.anchors
        ),
        "tls_1_2": lambda: tls12_client(pki),
        "no_alpn": lambda: contexts.client_context(*pki.leaf(WEB), pki.anchors, alpn=()),
    }[client]()

    try:
        reader, writer = await raw_tls(pod, context)
    except (ssl.SSLError, ConnectionError):
        pass  # below TLS 1.3 the handshake fails on the client's side too
    else:
        # TLS 1.3: the client's side of the handshake is done before the server checks it.
        writer.write(transport_header.encode(Header(pod.app.opaque_port)) + b"secret")
        await closed_by_peer(reader)
        writer.close()
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused)
    assert outcome.reason is reason
    assert pod.refusals == {reason.value: 1}
    assert pod.app.connections == 0  # nothing reached the app
    assert any(
        "inbound mTLS from 127." in r.getMessage() and reason.value in r.getMessage()
        for r in caplog.records
    )


async def test_garbage_instead_of_a_transport_header_is_refused(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod()
    reader, writer = await raw_tls(pod, web_context(pki))
    writer.write(b"GET / HTTP/1.1\r\nhost: db\r\n\r\n")
    await closed_by_peer(reader)
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused) and outcome.reason is Refusal.BAD_HEADER
    assert "preface" in outcome.detail
    assert pod.app.connections == 0
    writer.close()


async def test_an_oversized_transport_header_is_refused_before_it_is_read(
    pki: Any, db_pod: StartDb
) -> None:
    pod = await db_pod()
    reader, writer = await raw_tls(pod, web_context(pki))
    writer.write(transport_header.PREFACE + (10**6).to_bytes(4, "big"))
    await closed_by_peer(reader)
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused) and outcome.reason is Refusal.BAD_HEADER
    writer.close()


@pytest.mark.parametrize("own", ["inbound", "admin"])
async def test_a_header_naming_a_proxy_port_is_refused(pki: Any, db_pod: StartDb, own: str) -> None:
    pod = await db_pod()
    port = pod.port if own == "inbound" else ADMIN_PORT
    client = Collect()
    await mesh_to(pki, pod, port, SessionProtocol.OPAQUE, client)
    await client.until(lambda: client.lost.is_set())
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused) and outcome.reason is Refusal.LOOP
    assert pod.refusals == {"loop": 1}


async def test_a_client_silent_after_the_handshake_times_out(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod(detect_timeout=0.3)
    reader, writer = await raw_tls(pod, web_context(pki))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await closed_by_peer(reader)
    assert loop.time() - started < 1.0
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused) and outcome.reason is Refusal.HEADER_TIMEOUT
    writer.close()


async def test_a_half_sent_client_hello_times_out_or_is_dropped(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod(detect_timeout=0.3)
    hello = captured_hello(DB)
    for reason in (Refusal.HELLO_TIMEOUT, Refusal.CLOSED):
        _reader, writer = await asyncio.open_connection(DB_IP, pod.port)
        writer.write(hello[:100])
        if reason is Refusal.CLOSED:
            await asyncio.sleep(0.05)
            writer.close()
        outcome = await pod.next_outcome()
        assert isinstance(outcome, Refused) and outcome.reason is reason
        writer.close()
    assert pod.refusals == {"client_hello_timeout": 1, "closed_before_header": 1}


async def test_the_client_closing_before_the_header_is_refused(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod()
    _reader, writer = await raw_tls(pod, web_context(pki))
    writer.write(transport_header.PREFACE[:10])
    await asyncio.sleep(0.05)
    writer.close()
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Refused) and outcome.reason is Refusal.CLOSED


# -- not ours: passed through untouched --


def captured_hello(server_name: str) -> bytes:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def test_tls_for_someone_else_is_passed_through_with_nothing_read(
    pki: Any, db_pod: StartDb
) -> None:
    pod = await db_pod()
    other = "api.example.com"
    hello = captured_hello(other)
    _reader, writer = await asyncio.open_connection(DB_IP, pod.port)
    writer.write(hello)
    outcome = await pod.next_outcome()
    assert outcome == PassThrough(other)
    await asyncio.wait_for(pod.passed.wait(), TIMEOUT)
    assert pod.passed_bytes == [hello]  # the app relays these bytes to the original destination
    assert sni.parse_sni(pod.passed_bytes[0]) == sni.Sni(other)
    assert not pod.refusals
    writer.close()


async def test_bytes_that_are_no_client_hello_are_passed_through(pki: Any, db_pod: StartDb) -> None:
    pod = await db_pod()
    _reader, writer = await asyncio.open_connection(DB_IP, pod.port)
    writer.write(b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00")  # a handshake, but no hello
    assert await pod.next_outcome() == PassThrough(None)
    writer.close()


# -- the hand-over --


async def test_what_happens_before_the_hand_over_reaches_the_adopting_protocol(
    pki: Any, db_pod: StartDb
) -> None:
    """Bytes arriving after the header while nobody has adopted the connection yet reach the
    protocol that adopts it, and so does the client's close."""
    pod = await db_pod(hold=True)
    reader, writer = await raw_tls(pod, web_context(pki))
    writer.write(transport_header.encode(Header(pod.app.opaque_port)))
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Terminated) and outcome.initial == b""
    writer.write(b"late bytes")
    await asyncio.sleep(0.1)  # they arrive while reading is paused

    adopter = Collect()
    outcome.adopt(adopter)
    await adopter.until(lambda: adopter.data == b"late bytes")
    assert adopter.transport is outcome.transport
    adopter.transport.write(b"answer")
    async with asyncio.timeout(TIMEOUT):
        assert await reader.readexactly(6) == b"answer"
    writer.close()  # close_notify: the end of the stream, then the connection's loss
    await adopter.until(lambda: adopter.eof)
    adopter.transport.close()
    await adopter.until(lambda: adopter.lost.is_set())
    with pytest.raises(AssertionError, match="adopted once"):
        outcome.adopt(Collect())


async def test_a_connection_lost_before_the_hand_over_is_reported_to_the_adopter(
    pki: Any, db_pod: StartDb
) -> None:
    pod = await db_pod(hold=True)
    _reader, writer = await raw_tls(pod, web_context(pki))
    writer.write(transport_header.encode(Header(pod.app.opaque_port)))
    outcome = await pod.next_outcome()
    assert isinstance(outcome, Terminated)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()  # a reset
    await asyncio.sleep(0.1)

    adopter = Collect()
    outcome.adopt(adopter)
    await adopter.until(lambda: adopter.lost.is_set())
