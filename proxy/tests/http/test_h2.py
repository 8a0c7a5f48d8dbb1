"""The HTTP/2 engine end to end: a raw h2 client, the engine behind a real listener, and a small
h2 upstream, all on 127.0.0.1 sockets."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import shutil
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h2.exceptions
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    PingAckReceived,
    RequestReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.settings import SettingCodes, Settings
from hpack import Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from meshlet.proxy.core.pressure import PressureLimits
from meshlet.proxy.http.contract import MAX_INFORMATIONAL, Connect, HttpLimits
from meshlet.proxy.http.h2client import H2Client
from meshlet.proxy.http.h2conn import HIGH_WATER
from meshlet.proxy.http.h2guard import GuardLimits
from meshlet.proxy.http.h2pool import H2Pool
from meshlet.proxy.http.h2server import serve_h2
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.shedder import PERIOD as SHED_PERIOD
from meshlet.proxy.io.shedder import LoadShedder
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.sockets import hanging_port
from meshlet_testing.sockets import read_until_closed as read_socket_until_closed

Headers = Sequence[tuple[bytes, bytes]]
TIMEOUT = 5.0


async def eventually(condition: Callable[[], bool], within: float = TIMEOUT) -> None:
    """Polls a condition on objects that signal nothing (the upstream's records)."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def request_headers(
    port: int, path: bytes = b"/", method: bytes = b"GET"
) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", method),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", f"127.0.0.1:{port}".encode()),
    ]


# -- a raw client --


class Connection(H2Connection):
    """h2's connection that, after a GOAWAY, keeps reading the streams the GOAWAY let finish
    (h2 would fail every later frame with PROTOCOL_ERROR)."""

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Any], list[Any]]:
        event = ConnectionTerminated()
        event.error_code = ErrorCodes(frame.error_code)
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


@dataclass
class Received:
    """What one stream received."""

    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    informational: list[list[tuple[bytes, bytes]]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] | None = None
    ended: bool = False
    reset: int | None = None

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    def header(self, name: bytes) -> bytes | None:
        for key, value in [*self.headers, *(self.trailers or [])]:
            if key == name:
                return value
        return None

    @property
    def status(self) -> int:
        value = self.header(b":status")
        return int(value) if value else 0


class Client:
    """A prior-knowledge HTTP/2 client driven by the test over a real socket. Reads in the
    background and records per stream; `read=False` stops reading (a client that does not
    read), `ack=False` keeps the bytes received unacknowledged (windows stay closed)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, h2: H2Connection
    ) -> None:
        self.reader, self.writer, self.h2 = reader, writer, h2
        self.streams: dict[int, Received] = {}
        self.goaway: ConnectionTerminated | None = None
        self.eof = False
        self.ack = True
        self.pongs = 0
        self._changed = asyncio.Event()
        self._reading = asyncio.Event()
        self._reading.set()
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls,
        port: int,
        settings: dict[SettingCodes | int, int] | None = None,
        tls: ssl.SSLContext | None = None,
        **config: Any,
    ) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        h2 = Connection(H2Configuration(client_side=True, header_encoding=None, **config))
        h2.initiate_connection()
        if settings:
            h2.update_settings(settings)
        client = cls(reader, writer, h2)
        client.flush()
        return client

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def write(self, raw: bytes) -> None:
        self.writer.write(raw)

    async def round_trip(self) -> None:
        """A PING and its ACK: the proxy has read every frame sent before it."""
        pongs = self.pongs
        self.h2.ping(b"meshlet!")
        self.flush()
        await self.until(lambda: self.pongs > pongs)

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def request(
        self, headers: Headers, body: bytes = b"", end: bool = True, stream_id: int | None = None
    ) -> int:
        sid = stream_id or self.h2.get_next_available_stream_id()
        self.h2.send_headers(sid, headers, end_stream=end and not body)
        self.streams[sid] = Received()
        if body:
            self.h2.send_data(sid, body, end_stream=end)
        self.flush()
        return sid

    def ack_all(self, sid: int) -> None:
        received = self.streams[sid]
        self.h2.acknowledge_received_data(len(received.body), sid)
        self.flush()

    async def _read(self) -> None:
        while True:
            await self._reading.wait()
            try:
                data = await self.reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:
                self.eof = True
                self._changed.set()
                return
            for event in self.h2.receive_data(data):
                self._on(event)
            self.flush()
            self._changed.set()

    def _on(self, event: Any) -> None:
        received = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, ResponseReceived) and received is not None:
            received.headers = list(event.headers)
        elif isinstance(event, DataReceived) and received is not None:
            received.body += event.data
            if self.ack:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, TrailersReceived) and received is not None:
            received.trailers = list(event.headers)
        elif isinstance(event, StreamEnded) and received is not None:
            received.ended = True
        elif isinstance(event, StreamReset) and received is not None:
            received.reset = event.error_code
        elif isinstance(event, ConnectionTerminated):
            self.goaway = event
        elif isinstance(event, PingAckReceived):
            self.pongs += 1
        elif type(event).__name__ == "InformationalResponseReceived" and received is not None:
            received.informational.append(list(event.headers))

    async def until(self, condition: Callable[[], bool], within: float = TIMEOUT) -> None:
        async with asyncio.timeout(within):
            while not condition():
                self._changed.clear()
                await self._changed.wait()

    async def response(self, sid: int) -> Received:
        await self.until(lambda: self.streams[sid].done or self.eof)
        return self.streams[sid]

    async def get(self, port: int, path: bytes = b"/", body: bytes = b"") -> Received:
        method = b"POST" if body else b"GET"
        return await self.response(self.request(request_headers(port, path, method), body))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


# -- a small upstream --


class UpstreamRequest:
    """A request as the upstream sees it, with what its handler can answer."""

    def __init__(self, conn: UpstreamConn, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.conn, self.sid, self.headers = conn, sid, headers
        self.body = bytearray()
        self.ended = asyncio.Event()
        self.reset: int | None = None
        self.sent = 0
        self.trailers_received: list[tuple[bytes, bytes]] | None = None

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def read_body(self) -> bytes:
        await asyncio.wait_for(self.ended.wait(), TIMEOUT)
        return bytes(self.body)

    def respond(self, status: int = 200, headers: Headers = (), end: bool = False) -> None:
        self.conn.h2.send_headers(
            self.sid, [(b":status", str(status).encode()), *headers], end_stream=end
        )
        self.conn.flush()

    async def send(self, data: bytes, end: bool = False) -> None:
        """Sends under flow control, waiting for window as a real server does."""
        h2 = self.conn.h2
        view = memoryview(data)
        while view:
            window = h2.local_flow_control_window(self.sid)
            if window <= 0:
                await self.conn.window_opened()
                continue
            size = min(window, h2.max_outbound_frame_size, len(view))
            chunk, view = view[:size], view[size:]
            h2.send_data(self.sid, bytes(chunk), end_stream=end and not view)
            self.sent += size
            self.conn.flush()
        if end and not data:
            h2.end_stream(self.sid)
            self.conn.flush()

    def trailers(self, headers: Headers) -> None:
        self.conn.h2.send_headers(self.sid, headers, end_stream=True)
        self.conn.flush()

    def reset_stream(self, code: ErrorCodes) -> None:
        self.conn.h2.reset_stream(self.sid, code)
        self.conn.flush()


Handler = Callable[[UpstreamRequest], Awaitable[None]]


class UpstreamConn(asyncio.Protocol):
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.requests: dict[int, UpstreamRequest] = {}
        self.transport: asyncio.Transport | None = None
        self._window = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.upstream.conns.append(self)
        if self.upstream.settings:  # in effect at once and sent in the preface
            self.h2.local_settings = Settings(client=False, initial_values=self.upstream.settings)
        loop = asyncio.get_running_loop()
        loop.call_later(self.upstream.preface_delay, self._preface)

    def _preface(self) -> None:
        self.h2.initiate_connection()
        self.flush()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def window_opened(self) -> None:
        self._window.clear()
        await asyncio.wait_for(self._window.wait(), TIMEOUT)

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, RequestReceived):
                request = UpstreamRequest(self, event.stream_id, list(event.headers))
                self.requests[event.stream_id] = request
                self.upstream.requests.append(request)
                if event.stream_ended:
                    request.ended.set()
                self.upstream.spawn(request)
            elif isinstance(event, DataReceived):
                request = self.requests[event.stream_id]
                request.body += event.data
                if self.upstream.ack:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, TrailersReceived):
                self.requests[event.stream_id].trailers_received = list(event.headers)
                self.requests[event.stream_id].ended.set()
            elif isinstance(event, StreamEnded):
                self.requests[event.stream_id].ended.set()
            elif isinstance(event, StreamReset):
                request = self.requests[event.stream_id]
                request.reset = event.error_code
                request.ended.set()
            elif isinstance(event, WindowUpdated):
                self._window.set()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.upstream.lost += 1


class Upstream:
    """An HTTP/2 server on 127.0.0.1 whose requests are answered by `handler`."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.conns: list[UpstreamConn] = []
        self.requests: list[UpstreamRequest] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.settings: dict[SettingCodes | int, int] = {}
        self.ack = True
        self.lost = 0
        self.preface_delay = 0.0  # seconds before the server's SETTINGS
        self.server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: UpstreamConn(self), "127.0.0.1", 0)
        return "127.0.0.1", self.server.sockets[0].getsockname()[1]

    def spawn(self, request: UpstreamRequest) -> None:
        task = asyncio.create_task(self.handler(request))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.abort()
        if self.server is not None:
            self.server.close()


async def echo(request: UpstreamRequest) -> None:
    """Answers with the request body, the path in a header, and trailers."""
    body = await request.read_body()
    request.respond(200, [(b"x-path", request.header(b":path") or b"")])
    await request.send(body)
    request.trailers([(b"x-body-sha256", hashlib.sha256(body).hexdigest().encode())])


@pytest.fixture
async def upstream() -> AsyncIterator[
    Callable[[Handler], Awaitable[tuple[Upstream, tuple[str, int]]]]
]:
    started: list[Upstream] = []

    async def start(handler: Handler) -> tuple[Upstream, tuple[str, int]]:
        server = Upstream(handler)
        started.append(server)
        return server, await server.start()

    yield start
    for server in started:
        await server.stop()


async def tcp_connect(
    addr: tuple[str, int], factory: Callable[[], asyncio.Protocol]
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(factory, addr[0], addr[1])
    return transport, protocol  # type: ignore[return-value]


@dataclass
class H2Proxy:
    """The engine behind a listener, with the upstream pool the application would share."""

    engine: Any  # conftest's EngineProxy
    pool: H2Pool

    @property
    def port(self) -> int:
        return int(self.engine.port)

    @property
    def metrics(self) -> Any:
        return self.engine.metrics

    def sample(self, name: str, **labels: str) -> float:
        total = 0.0
        for metric in self.metrics.registry.collect():
            for sample in metric.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total


@pytest.fixture
async def h2proxy(engine_proxy: Any) -> AsyncIterator[Callable[..., Awaitable[H2Proxy]]]:
    """`await h2proxy(upstream_addr, limits=..., guard=..., **conn)`: serve_h2 with a pool."""
    pools: list[H2Pool] = []

    async def start(
        addr: tuple[str, int] | None,
        limits: HttpLimits | None = None,
        guard: GuardLimits | None = None,
        connect: Connect = tcp_connect,
        **conn: Any,
    ) -> H2Proxy:
        limits = limits or HttpLimits()
        pool = H2Pool(connect, limits, guard)
        pools.append(pool)
        engine = partial(serve_h2, pool=pool, guard=guard)
        return H2Proxy(await engine_proxy(engine, addr, limits, **conn), pool)

    yield start
    for pool in pools:
        await pool.aclose()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Awaitable[Client]]]:
    opened: list[Client] = []

    async def connect(port: int, **kwargs: Any) -> Client:
        client = await Client.connect(port, **kwargs)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        await client.close()


# -- relaying --


async def test_a_request_and_its_response_are_relayed(h2proxy, upstream, clients) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got = await client.get(proxy.port, b"/hello", b"ping")
    assert got.status == 200
    assert bytes(got.body) == b"ping"
    assert got.header(b"x-path") == b"/hello"
    assert got.header(b"x-body-sha256") == hashlib.sha256(b"ping").hexdigest().encode()
    assert up.requests[0].header(b":authority") == f"127.0.0.1:{proxy.port}".encode()
    assert proxy.engine.routes == [f"127.0.0.1:{proxy.port}"]


@pytest.mark.parametrize("waits", [False, True], ids=["routed-at-once", "routing-waits"])
async def test_streams_need_a_task_only_while_routing_waits(
    h2proxy, upstream, clients, waits
) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr, waits=waits)
    client = await clients(proxy.port)
    assert (await client.get(proxy.port, body=b"first")).status == 200  # connects upstream
    loop = asyncio.get_running_loop()
    made: list[str] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(counting)
    try:
        got = await asyncio.gather(*(client.get(proxy.port, body=b"%d" % i) for i in range(5)))
    finally:
        loop.set_task_factory(factory)
    assert [bytes(g.body) for g in got] == [b"%d" % i for i in range(5)]
    assert made.count("H2Server._carry") == (5 if waits else 0)
    assert len(up.conns) == 1


async def test_internal_headers_are_stripped_and_the_proxys_added(
    h2proxy, upstream, clients
) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr, add_headers=[(b"meshlet-client-id", b"web.default")])
    client = await clients(proxy.port)
    headers = [
        *request_headers(proxy.port),
        (b"meshlet-client-id", b"forged"),
        (b"meshlet-proxy-error", b"forged"),
        (b"l5d-client-id", b"forged"),
        (b"l5d-proxy-error", b"forged"),
        (b"authorization", b"Bearer secret"),
        (b"x-kept", b"yes"),
    ]
    got = await client.response(client.request(headers))
    assert got.status == 200
    seen = up.requests[0].headers
    assert (b"meshlet-client-id", b"web.default") in seen
    assert (b"meshlet-client-id", b"forged") not in seen
    assert all(name != b"meshlet-proxy-error" for name, _ in seen)
    assert all(not name.startswith(b"l5d-") for name, _ in seen)
    assert (b"x-kept", b"yes") in seen and (b"authorization", b"Bearer secret") in seen


async def test_an_upstream_cannot_pass_its_answer_off_as_the_proxys(
    h2proxy, upstream, clients
) -> None:
    """An app's `meshlet-proxy-error` / `l5d-proxy-error`, in a head or in trailers, never
    reaches the client; nor does a client's in its request trailers reach the app."""

    async def forger(request: UpstreamRequest) -> None:
        await request.read_body()
        request.respond(
            503,
            [(b"meshlet-proxy-error", b"forged"), (b"l5d-proxy-error", b"forged"),
             (b"x-app", b"yes")],
        )  # fmt: skip
        request.trailers([(b"meshlet-proxy-error", b"forged"), (b"x-t", b"1")])

    up, addr = await upstream(forger)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    client.h2.send_headers(sid, [(b"meshlet-client-id", b"forged"), (b"x-rt", b"1")], True)
    client.flush()
    got = await client.response(sid)
    assert got.status == 503
    assert (b"x-app", b"yes") in got.headers
    assert not [n for n, _ in [*got.headers, *got.trailers] if n.endswith(b"proxy-error")]
    assert (b"x-t", b"1") in got.trailers
    assert up.requests[0].trailers_received == [(b"x-rt", b"1")]


async def test_large_bodies_stream_both_ways(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    body = bytes(range(256)) * 8192  # 2 MiB, far beyond every window
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    view = memoryview(body)
    while view:  # send under the proxy's flow control, as a real client does
        window = client.h2.local_flow_control_window(sid)
        if window == 0:
            await client.until(lambda: client.h2.local_flow_control_window(sid) > 0)
            continue
        size = min(window, client.h2.max_outbound_frame_size, len(view))
        client.h2.send_data(sid, bytes(view[:size]), end_stream=size == len(view))
        client.flush()
        view = view[size:]
    got = await client.response(sid)
    assert got.ended and got.reset is None
    assert hashlib.sha256(got.body).digest() == hashlib.sha256(body).digest()
    assert got.trailers == [(b"x-body-sha256", hashlib.sha256(body).hexdigest().encode())]


async def test_a_client_that_does_not_read_holds_back_the_upstream(
    h2proxy, upstream, clients
) -> None:
    """Response direction: the proxy credits the upstream only for bytes the client took, so
    what it buffers stays within the window it granted (max_body_buffer) plus a constant."""
    body = bytes(range(256)) * 16384  # 4 MiB
    done = asyncio.Event()

    async def big(request: UpstreamRequest) -> None:
        request.respond(200)
        await request.send(body, end=True)
        done.set()

    up, addr = await upstream(big)
    limits = HttpLimits(max_body_buffer=64 * 1024)
    proxy = await h2proxy(addr, limits=limits)
    client = await clients(proxy.port, settings={SettingCodes.INITIAL_WINDOW_SIZE: 1024})
    client.ack = False  # the client's windows stay shut
    sid = client.request(request_headers(proxy.port))
    await client.until(lambda: len(client.streams[sid].body) == 1024)
    await asyncio.sleep(0.3)  # let the upstream push all it can
    sent = up.requests[0].sent
    assert sent <= limits.max_body_buffer + 1024, sent  # our window + what the client took
    assert not done.is_set()
    client.ack = True  # now read: everything arrives, intact
    client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    client.h2.increment_flow_control_window(1 << 24)
    client.ack_all(sid)
    got = await client.response(sid)
    assert got.ended and bytes(got.body) == body


async def test_an_upstream_that_does_not_read_holds_back_the_client(
    h2proxy, upstream, clients
) -> None:
    """Request direction: the client gets window only as the upstream takes the bytes."""
    release = asyncio.Event()

    async def slow(request: UpstreamRequest) -> None:
        await release.wait()
        body = await request.read_body()
        request.respond(200, end=False)
        await request.send(hashlib.sha256(body).hexdigest().encode(), end=True)

    up, addr = await upstream(slow)
    up.ack = False  # the upstream's windows (64 KiB by default) stay shut
    limits = HttpLimits(max_body_buffer=64 * 1024)
    proxy = await h2proxy(addr, limits=limits)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    sent = 0
    while True:  # send until the proxy's window closes
        window = min(client.h2.local_flow_control_window(sid), 16384)
        if window == 0:
            try:
                await client.until(lambda: client.h2.local_flow_control_window(sid) > 0, within=0.3)
            except TimeoutError:
                break
            continue
        client.h2.send_data(sid, b"x" * window)
        client.flush()
        sent += window
    assert sent <= limits.max_body_buffer + 65535, sent  # our window + the upstream's
    assert sent >= 65535  # the upstream's window was filled
    up.ack = True
    upstream_request = up.requests[0]
    upstream_conn = upstream_request.conn
    upstream_conn.h2.acknowledge_received_data(len(upstream_request.body), upstream_request.sid)
    upstream_conn.flush()
    release.set()
    client.h2.send_data(sid, b"", end_stream=True)
    client.flush()
    got = await client.response(sid)
    assert bytes(got.body) == hashlib.sha256(b"x" * sent).hexdigest().encode()


async def test_concurrent_streams_share_one_upstream_connection(h2proxy, upstream, clients) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    first, second = await clients(proxy.port), await clients(proxy.port)
    calls = [
        c.get(proxy.port, f"/{i}".encode(), b"n%d" % i) for i in range(20) for c in (first, second)
    ]
    results = await asyncio.gather(*calls)
    assert [bytes(r.body) for r in results] == [b"n%d" % i for i in range(20) for _ in (1, 2)]
    assert len(up.conns) == 1
    assert proxy.pool.connections == 1


async def test_a_client_reset_resets_the_upstream_stream(h2proxy, upstream, clients) -> None:
    async def hold(request: UpstreamRequest) -> None:
        request.respond(200)
        await request.ended.wait()  # the client's end of the request, or its reset
        if request.reset is None:
            await request.send(b"", end=True)

    up, addr = await upstream(hold)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port), end=False)
    await client.until(lambda: client.streams[sid].status == 200)
    client.h2.reset_stream(sid, ErrorCodes.CANCEL)
    client.flush()
    request = up.requests[0]
    await asyncio.wait_for(request.ended.wait(), TIMEOUT)
    assert request.reset == ErrorCodes.CANCEL
    assert (await client.get(proxy.port)).status == 200  # the connection lives


async def test_an_upstream_reset_mid_response_resets_the_client_stream_with_its_code(
    h2proxy, upstream, clients
) -> None:
    async def half(request: UpstreamRequest) -> None:
        request.respond(200)
        await request.send(b"partial")
        await asyncio.sleep(0.05)
        request.reset_stream(ErrorCodes.ENHANCE_YOUR_CALM)

    _, addr = await upstream(half)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got = await client.get(proxy.port)
    assert got.status == 200 and bytes(got.body) == b"partial"
    assert got.reset == ErrorCodes.ENHANCE_YOUR_CALM and not got.ended


async def test_an_upstream_reset_before_the_response_is_a_502(h2proxy, upstream, clients) -> None:
    async def refuse(request: UpstreamRequest) -> None:
        request.reset_stream(ErrorCodes.INTERNAL_ERROR)

    _, addr = await upstream(refuse)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got = await client.get(proxy.port)
    assert got.status == 502
    assert b"INTERNAL_ERROR" in (got.header(b"meshlet-proxy-error") or b"")


async def test_an_upstream_dying_mid_response_resets_the_client_stream(
    h2proxy, upstream, clients
) -> None:
    async def die(request: UpstreamRequest) -> None:
        request.respond(200, [(b"content-length", b"100")])
        await request.send(b"only part of it")
        await asyncio.sleep(0.05)
        assert request.conn.transport is not None
        request.conn.transport.abort()

    _, addr = await upstream(die)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got = await client.get(proxy.port)
    assert bytes(got.body) == b"only part of it"
    assert got.reset is not None and not got.ended  # never passed off as complete


async def one_then_two(
    proxy: H2Proxy, client: Client, upstream_has_one: Awaitable[Any]
) -> tuple[Received, Received]:
    """GET /one, then, once the upstream has it, GET /two; both responses."""
    one = client.request(request_headers(proxy.port, b"/one"))
    await asyncio.wait_for(upstream_has_one, TIMEOUT)
    two = client.request(request_headers(proxy.port, b"/two"))
    return await client.response(one), await client.response(two)


async def test_upstream_goaway_retries_unprocessed_streams_and_finishes_the_rest(
    h2proxy, upstream, clients
) -> None:
    first_seen = asyncio.Event()

    async def handler(request: UpstreamRequest) -> None:
        conn = request.conn
        if len(up.conns) == 1 and request.sid == 1:
            first_seen.set()
            await asyncio.sleep(0.2)  # stream 3 arrives meanwhile, then GOAWAY names 1
            request.respond(200, [(b"x-conn", b"1")])
            await request.send(b"first", end=True)
            return
        if len(up.conns) == 1:
            # A graceful GOAWAY naming stream 1 (written around h2, which would stop stream 1).
            goaway = GoAwayFrame(0, last_stream_id=1, error_code=ErrorCodes.NO_ERROR)
            assert conn.transport is not None
            conn.transport.write(goaway.serialize())
            return  # stream 3 is never answered here
        request.respond(200, [(b"x-conn", b"2")])
        await request.send(b"retried", end=True)

    up, addr = await upstream(handler)
    proxy = await h2proxy(addr)
    got_one, got_two = await one_then_two(proxy, await clients(proxy.port), first_seen.wait())
    assert (got_one.status, bytes(got_one.body), got_one.header(b"x-conn")) == (200, b"first", b"1")
    assert (got_two.status, bytes(got_two.body), got_two.header(b"x-conn")) == (
        200,
        b"retried",
        b"2",
    )
    assert len(up.conns) == 2


async def test_an_unreachable_upstream_is_a_502(h2proxy, clients) -> None:
    proxy = await h2proxy(("127.0.0.1", 1))
    client = await clients(proxy.port)
    got = await client.get(proxy.port)
    assert got.status == 502
    assert (got.header(b"meshlet-proxy-error") or b"").startswith(b"connect to 127.0.0.1:1 failed")
    assert proxy.sample("http_client_errors_total", status_code="502") == 1


async def test_an_upstream_that_does_not_answer_the_connect_is_a_504(h2proxy, clients) -> None:
    with hanging_port() as port:
        proxy = await h2proxy(("127.0.0.1", port), connect=tcp_connector(0.2))
        client = await clients(proxy.port)
        got = await client.get(proxy.port)
    assert got.status == 504  # as HTTP/1 answers a connect timeout
    assert b"timed out" in (got.header(b"meshlet-proxy-error") or b"").lower()
    assert proxy.sample("http_client_errors_total", status_code="504") == 1


async def test_grpc_requests_get_unavailable_in_a_trailers_only_response(h2proxy, clients) -> None:
    proxy = await h2proxy(("127.0.0.1", 1))
    client = await clients(proxy.port)
    headers = [*request_headers(proxy.port, b"/pkg.Svc/Call", b"POST"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
    got = await client.response(client.request(headers, body=b"\0\0\0\0\0"))
    assert got.status == 200 and got.ended and got.trailers is None and not got.body
    assert got.header(b"grpc-status") == b"14"
    assert (got.header(b"grpc-message") or b"").startswith(b"connect to 127.0.0.1:1 failed")
    assert (
        proxy.sample(
            "response_total", status_code="200", grpc_status="14", classification="failure"
        )
        == 1
    )


async def test_a_request_without_a_route_is_answered_by_the_proxy(h2proxy, clients) -> None:
    proxy = await h2proxy(None)  # routed by authority; none given
    client = await clients(proxy.port, validate_outbound_headers=False)
    headers = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/")]
    got = await client.response(client.request(headers))
    assert got.status == 400
    assert got.header(b"meshlet-proxy-error") == b"no authority"


async def test_request_and_response_metrics(h2proxy, upstream, clients) -> None:
    async def teapot(request: UpstreamRequest) -> None:
        status = 503 if request.header(b":path") == b"/fail" else 200
        request.respond(status, end=True)

    _, addr = await upstream(teapot)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    assert (await client.get(proxy.port, b"/ok")).status == 200
    assert (await client.get(proxy.port, b"/fail")).status == 503
    authority = f"{addr[0]}:{addr[1]}"
    assert proxy.sample("request_total", authority=authority) == 2
    ok = {"authority": authority, "status_code": "200"}
    assert proxy.sample("response_total", classification="success", **ok) == 1
    failed = {"authority": authority, "status_code": "503", "classification": "failure"}
    assert proxy.sample("response_total", **failed) == 1
    assert proxy.sample("response_latency_ms_count", **failed) == 1


async def test_streams_beyond_the_limit_are_refused_and_the_connection_lives(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        await release.wait()
        request.respond(200, end=True)

    up, addr = await upstream(held)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    await client.until(lambda: client.h2.remote_settings.max_concurrent_streams == 100)
    # Ignore the advertised limit, as a hostile client does.
    client.h2.remote_settings[SettingCodes.MAX_CONCURRENT_STREAMS] = 1000
    client.h2.remote_settings.acknowledge()
    sids = [client.request(request_headers(proxy.port)) for _ in range(105)]
    await client.until(lambda: sum(client.streams[s].reset is not None for s in sids) == 5)
    assert all(client.streams[s].reset == ErrorCodes.REFUSED_STREAM for s in sids[100:])
    await eventually(lambda: len(up.requests) == 100)
    release.set()
    results = [await client.response(s) for s in sids[:100]]
    assert all(r.status == 200 for r in results)
    assert (await client.get(proxy.port)).status == 200  # the connection lives


@pytest.mark.parametrize(
    ("name", "headers"),
    [
        ("uppercase name", [(b"X-Upper", b"1")]),
        ("pseudo-header after a header", [(b"x-a", b"1"), (b":foo", b"1")]),
        ("connection header", [(b"connection", b"keep-alive")]),
        ("CR in a value", [(b"x-a", b"1\r\nx-b: 2")]),
        ("te other than trailers", [(b"te", b"gzip")]),
    ],
)
async def test_a_malformed_request_resets_its_stream_and_the_connection_lives(
    h2proxy, upstream, clients, name, headers
) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    client = await clients(
        proxy.port, validate_outbound_headers=False, normalize_outbound_headers=False
    )
    sid = client.request([*request_headers(proxy.port), *headers], end=False)
    got = await client.response(sid)
    assert got.reset == ErrorCodes.PROTOCOL_ERROR, name
    client.write(DataFrame(sid, b"late body").serialize())  # on the reset stream: ignored
    assert (await client.get(proxy.port)).status == 200
    assert not any(r.header(b":path") != b"/" or r.body for r in up.requests)  # nothing relayed
    assert len(up.requests) == 1
    assert proxy.sample("http_client_errors_total", status_code="400") == 1


async def test_shutdown_sends_goaway_finishes_in_flight_streams_then_closes(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        await release.wait()
        request.respond(200)
        await request.send(b"finished", end=True)

    up, addr = await upstream(held)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port))
    await eventually(lambda: len(up.requests) == 1)
    proxy.engine.closing.set()
    await client.until(lambda: client.goaway is not None)
    assert client.goaway.error_code == ErrorCodes.NO_ERROR
    assert client.goaway.last_stream_id == sid
    release.set()
    got = await client.response(sid)
    assert got.ended and bytes(got.body) == b"finished"
    await client.until(lambda: client.eof)


# -- hostile clients --


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()


async def raw_connection(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A socket speaking HTTP/2 by hand, optionally with a tiny receive buffer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def send_all(sock: socket.socket, data: bytes) -> bool:
    """Sends; False when the proxy closed the connection first."""
    try:
        async with asyncio.timeout(TIMEOUT):
            await asyncio.get_running_loop().sock_sendall(sock, data)
    except (ConnectionError, TimeoutError):
        return False
    return True


async def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the proxy sends until it closes (a reset counts as closed)."""
    return await read_socket_until_closed(sock, TIMEOUT)


def goaway_code(received: bytes) -> int | None:
    """The error code of the last GOAWAY in a byte stream from the proxy."""
    h2 = Connection(H2Configuration(client_side=True, header_encoding=None))
    h2.initiate_connection()
    code = None
    with contextlib.suppress(Exception):
        for event in h2.receive_data(received):
            if isinstance(event, ConnectionTerminated):
                code = event.error_code
    return code


def raw_goaway_code(received: bytes) -> int | None:
    """The error code of the last GOAWAY, read off the frames alone (h2 would stop reading at
    a frame for a stream it never opened, such as a RST_STREAM for a refused raw one)."""
    code, pos = None, 0
    while pos + 9 <= len(received):
        length = int.from_bytes(received[pos : pos + 3], "big")
        if received[pos + 3] == 0x7 and pos + 9 + length <= len(received):
            code = int.from_bytes(received[pos + 13 : pos + 17], "big")
        pos += 9 + length
    return code


def encode_request(port: int, stream_id: int, end: bool = True) -> bytes:
    block = Encoder().encode(request_headers(port))
    frame = HeadersFrame(stream_id, block, flags=["END_HEADERS", *(["END_STREAM"] if end else [])])
    return frame.serialize()


async def assert_proxy_serves(proxy: H2Proxy, clients: Any) -> None:
    client = await clients(proxy.port)
    assert (await client.get(proxy.port)).status == 200


async def test_rapid_reset_is_answered_with_enhance_your_calm(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    frames = bytearray(PREFACE)
    encoder = Encoder()
    for i in range(1000):  # HEADERS then RST_STREAM, over and over (CVE-2023-44487)
        sid = 2 * i + 1
        block = encoder.encode(request_headers(proxy.port))
        frames += HeadersFrame(sid, block, flags=["END_HEADERS", "END_STREAM"]).serialize()
        frames += RstStreamFrame(sid, error_code=ErrorCodes.CANCEL).serialize()
    await send_all(sock, bytes(frames))
    assert goaway_code(await read_until_closed(sock)) == ErrorCodes.ENHANCE_YOUR_CALM
    assert proxy.sample("http_client_errors_total", status_code="enhance_your_calm") == 1
    await assert_proxy_serves(proxy, clients)


async def test_a_thousand_cancellations_of_received_requests_are_not_rapid_reset(
    h2proxy, upstream, clients
) -> None:
    """An `h2` client that cancels 1,000 requests (every one it sends) once the upstream has
    them, crediting flow control back as it goes: a client giving up on long polls, not an
    attack. Its connection lives and its next request is answered."""
    release = asyncio.Event()
    up, addr = await upstream(partial(held_unless, b"/poll", release))
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    for wave in range(1, 21):
        sids = [client.request(request_headers(proxy.port, b"/poll")) for _ in range(50)]
        held = 50 * wave
        await eventually(lambda: len(up.requests) == held)  # noqa: B023 - awaited at once
        await asyncio.sleep(0.005)
        for sid in sids:
            client.h2.reset_stream(sid, ErrorCodes.CANCEL)
        client.flush()
    await eventually(lambda: all(r.reset == ErrorCodes.CANCEL for r in up.requests))
    assert loop.time() - started < 10.0
    assert client.goaway is None and not client.eof
    assert (await client.get(proxy.port, b"/after")).status == 200
    assert proxy.sample("http_client_errors_total") == 0
    release.set()


async def test_a_rapid_reset_lets_the_streams_in_flight_finish(h2proxy, upstream, clients) -> None:
    """When the guard trips, GOAWAY ENHANCE_YOUR_CALM names the last stream taken: the
    client's requests already in flight below it are answered, new ones are not taken."""
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        await release.wait()
        if request.reset is None:
            request.respond(200, end=True)

    up, addr = await upstream(held)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    held = [client.request(request_headers(proxy.port, b"/held")) for _ in range(3)]
    await eventually(lambda: len(up.requests) == 3)
    held_upstream = list(up.requests)
    for _ in range(200):  # HEADERS then RST_STREAM at once, over and over
        sid = client.request(request_headers(proxy.port, b"/x"))
        client.h2.reset_stream(sid, ErrorCodes.CANCEL)
    client.flush()
    await client.until(lambda: client.goaway is not None)
    assert client.goaway is not None
    assert client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert client.goaway.last_stream_id >= max(held)
    release.set()
    for sid in held:
        assert (await client.response(sid)).status == 200
    assert all(r.reset is None for r in held_upstream)
    assert proxy.sample("http_client_errors_total", status_code="enhance_your_calm") == 1
    await client.until(lambda: client.eof)  # then the connection closes
    await assert_proxy_serves(proxy, clients)


async def test_an_upstreams_enhance_your_calm_fails_no_unrelated_request(
    h2proxy, upstream, clients
) -> None:
    """The client side of the mesh: the upstream's guard tripped (GOAWAY ENHANCE_YOUR_CALM,
    last stream 1). Stream 1 is answered on that connection; stream 3, which the upstream
    never took, is sent again on a new connection; nothing fails."""
    release = asyncio.Event()

    async def handler(request: UpstreamRequest) -> None:
        conn = request.conn
        if conn is up.conns[0] and request.sid == 3:
            assert conn.transport is not None  # the GOAWAY, behind h2's back: it still answers
            conn.transport.write(
                GoAwayFrame(
                    0, last_stream_id=1, error_code=ErrorCodes.ENHANCE_YOUR_CALM
                ).serialize()
            )
            release.set()
            return
        await release.wait()
        request.respond(200, [(b"x-conn", b"%d" % (up.conns.index(conn) + 1))], end=True)

    up, addr = await upstream(handler)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got_first, got_second = await one_then_two(
        proxy, client, eventually(lambda: len(up.requests) == 1)
    )
    assert (got_first.status, got_first.header(b"x-conn")) == (200, b"1")
    assert (got_second.status, got_second.header(b"x-conn")) == (200, b"2")
    assert client.goaway is None


async def test_occasional_resets_are_not_rapid_reset(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    for i in range(300):  # a client cancelling one request in ten
        sid = client.request(request_headers(proxy.port), end=i % 10 != 0)
        if i % 10 == 0:
            client.h2.reset_stream(sid, ErrorCodes.CANCEL)
            client.flush()
        else:
            assert (await client.response(sid)).status == 200
    assert client.goaway is None and not client.eof


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(PingFrame(0, opaque_data=b"12345678").serialize(), id="PING"),
        pytest.param(SettingsFrame(0).serialize(), id="SETTINGS"),
        pytest.param(PriorityFrame(1, depends_on=0, stream_weight=16).serialize(), id="PRIORITY"),
        pytest.param(WindowUpdateFrame(0, window_increment=1).serialize(), id="WINDOW_UPDATE"),
    ],
)
async def test_control_frame_floods_are_answered_with_enhance_your_calm(
    h2proxy, upstream, clients, frame
) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))  # this client reads
    await send_all(sock, PREFACE + frame * 5000)
    assert goaway_code(await reader) == ErrorCodes.ENHANCE_YOUR_CALM
    await assert_proxy_serves(proxy, clients)


async def test_empty_data_frames_are_answered_with_enhance_your_calm(
    h2proxy, upstream, clients
) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))
    empty = DataFrame(1, b"").serialize()
    await send_all(sock, PREFACE + encode_request(proxy.port, 1, end=False) + empty * 100)
    assert goaway_code(await reader) == ErrorCodes.ENHANCE_YOUR_CALM
    await assert_proxy_serves(proxy, clients)


async def test_a_ping_flood_from_a_client_that_does_not_read_is_closed(
    h2proxy, upstream, clients
) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port, rcvbuf=4096)
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    await send_all(sock, PREFACE + ping * 20000)  # never reading the ACKs
    await read_until_closed(sock)
    assert proxy.sample("http_client_errors_total", status_code="enhance_your_calm") == 1
    await assert_proxy_serves(proxy, clients)


async def test_output_piling_up_for_a_client_that_does_not_read_is_bounded(
    h2proxy, upstream, clients
) -> None:
    """With the frame budget out of the way, the write-buffer bound alone closes it."""
    _, addr = await upstream(echo)
    guard = GuardLimits(control_base=10**9, max_write_buffer=64 * 1024)
    proxy = await h2proxy(addr, guard=guard)
    # Accepted sockets inherit a fixed send buffer: the kernel cannot absorb the ACKs.
    proxy.engine.listener.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    sock = await raw_connection(proxy.port, rcvbuf=4096)
    ping = PingFrame(0, opaque_data=b"12345678").serialize()
    await send_all(sock, PREFACE + ping * 20000)  # 340 KB of ACKs, never read
    await eventually(
        lambda: proxy.sample("http_client_errors_total", status_code="enhance_your_calm") == 1
    )
    await read_until_closed(sock)
    await assert_proxy_serves(proxy, clients)


async def test_a_continuation_flood_is_closed(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))
    block = Encoder().encode(request_headers(proxy.port))
    frames = HeadersFrame(1, block).serialize()  # no END_HEADERS: CONTINUATION follows
    frames += ContinuationFrame(1, b"").serialize() * 1000
    await send_all(sock, PREFACE + frames)
    assert goaway_code(await reader) == ErrorCodes.PROTOCOL_ERROR
    await assert_proxy_serves(proxy, clients)


async def test_an_hpack_bomb_is_closed(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))
    # One 4 KB header into the dynamic table, then referenced 1,000 times: a 4 MB header list
    # from a 5 KB block.
    block = Encoder().encode([*request_headers(proxy.port), (b"x-bomb", b"b" * 4000)])
    block += bytes([0x80 | 62]) * 1000
    await send_all(sock, PREFACE + HeadersFrame(1, block, flags=["END_HEADERS"]).serialize())
    assert goaway_code(await reader) == ErrorCodes.ENHANCE_YOUR_CALM
    await assert_proxy_serves(proxy, clients)


async def test_too_many_headers_get_431_and_the_connection_lives(
    h2proxy, upstream, clients
) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr, limits=HttpLimits(max_headers=20))
    client = await clients(proxy.port)
    extra = [(f"x-h{i}".encode(), b"v") for i in range(30)]
    got = await client.response(client.request([*request_headers(proxy.port), *extra]))
    assert got.status == 431 and not up.requests
    assert (await client.get(proxy.port)).status == 200


# -- hostile upstreams --


async def test_a_flooding_upstream_is_a_502_and_only_its_connection_goes(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()

    async def good(request: UpstreamRequest) -> None:
        await release.wait()
        request.respond(200)
        await request.send(b"good", end=True)

    async def flood(request: UpstreamRequest) -> None:
        assert request.conn.transport is not None
        request.conn.transport.write(PingFrame(0, opaque_data=b"12345678").serialize() * 5000)

    good_up, good_addr = await upstream(good)
    _, bad_addr = await upstream(flood)
    proxy = await h2proxy(None)  # routed by authority
    client = await clients(proxy.port)

    def to(addr: tuple[str, int]) -> list[tuple[bytes, bytes]]:
        headers = request_headers(0)
        headers[3] = (b":authority", f"{addr[0]}:{addr[1]}".encode())
        return headers

    in_flight = client.request(to(good_addr))
    await eventually(lambda: len(good_up.requests) == 1)
    bad = await client.response(client.request(to(bad_addr)))
    assert bad.status == 502
    assert b"misbehaved" in (bad.header(b"meshlet-proxy-error") or b"")
    release.set()
    got = await client.response(in_flight)
    assert got.status == 200 and bytes(got.body) == b"good"
    assert proxy.pool.connections == 1  # the good one
    assert len(good_up.conns) == 1 and good_up.lost == 0


async def test_a_malformed_upstream_response_is_a_502_and_the_connection_stays(
    h2proxy, upstream, clients
) -> None:
    async def bad_head(request: UpstreamRequest) -> None:
        if request.header(b":path") == b"/bad":
            conn = request.conn
            conn.h2.config.validate_outbound_headers = False
            conn.h2.config.normalize_outbound_headers = False
            conn.h2.send_headers(request.sid, [(b":status", b"200"), (b"Bad Name", b"1")])
            conn.flush()
            return
        request.respond(200, end=True)

    up, addr = await upstream(bad_head)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    bad = await client.get(proxy.port, b"/bad")
    assert bad.status == 502
    assert (await client.get(proxy.port, b"/good")).status == 200
    assert len(up.conns) == 1 and up.lost == 0


# -- more of the lifecycle --


async def test_without_a_shared_pool_the_connection_gets_its_own(
    engine_proxy, upstream, clients
) -> None:
    up, addr = await upstream(echo)
    proxy = await engine_proxy(serve_h2, addr)  # conn.connect, a pool per connection
    client = await clients(proxy.port)
    assert bytes((await client.get(proxy.port, body=b"own")).body) == b"own"
    await client.close()
    await eventually(lambda: up.lost == 1)  # closed with the downstream connection


async def test_a_full_upstream_connection_gets_another_then_requests_wait(
    h2proxy, upstream, clients
) -> None:
    """An upstream allowing 2 streams per connection, 10 requests held there at once: each
    connection that is full gets another beside it (h2pool.MAX_CONNECTIONS, 4), so 8 are served
    at once and 2 wait (no fifth connection) until a stream ends on any connection."""
    active, peak = 0, 0
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await release.wait()
        active -= 1
        request.respond(200, end=True)

    up, addr = await upstream(held)
    up.settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 2}
    up.preface_delay = 0.05  # requests are waiting before the limit is known
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    calls = asyncio.gather(*(client.get(proxy.port) for _ in range(10)))
    await eventually(lambda: active == 8)
    await asyncio.sleep(0.2)  # the other two wait: no fifth connection, no third stream
    assert active == 8 and len(up.conns) == 4
    release.set()
    results = await calls
    assert [r.status for r in results] == [200] * 10
    assert peak == 8 and len(up.conns) == 4


class Held:
    """An upstream handler that holds each request until the test releases it (while
    `holding`), and the paths it saw, in order."""

    def __init__(self) -> None:
        self.holding = True
        self.releases: list[asyncio.Event] = []
        self.paths: list[bytes] = []

    async def __call__(self, request: UpstreamRequest) -> None:
        self.paths.append(request.header(b":path") or b"")
        if self.holding:
            release = asyncio.Event()
            self.releases.append(release)
            await release.wait()
        request.respond(200, end=True)


async def one_stream_each(
    upstream: Any, h2proxy: Any, clients: Any
) -> tuple[Held, Upstream, H2Proxy, Client]:
    """An upstream allowing 1 stream per connection whose handler holds each request (Held), the
    proxy in front of it, and a client of the proxy (from the tests' fixtures)."""
    hold = Held()
    up, addr = await upstream(hold)
    up.settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    proxy = await h2proxy(addr)
    return hold, up, proxy, await clients(proxy.port)


class Counted:
    """What requests waiting for an upstream stream cost: the times a task waited (H2Client.slot)
    and the tasks the proxy made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waits = 0
        self.tasks: list[str] = []
        slot = H2Client.slot

        async def counted(client: H2Client, first: bool = False) -> None:
            self.waits += 1
            await slot(client, first)

        monkeypatch.setattr(H2Client, "slot", counted)
        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()

        def counting(
            loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any
        ) -> asyncio.Task[Any]:
            self.tasks.append(coro.__qualname__)
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting)
        self.restore = partial(loop.set_task_factory, factory)


@pytest.fixture
async def counted(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Counted]:
    got = Counted(monkeypatch)
    yield got
    got.restore()


@pytest.mark.parametrize(
    "late", [False, True], ids=["before-the-connections", "once-they-are-full"]
)
async def test_requests_waiting_for_a_stream_take_turns_one_wake_each(
    h2proxy, upstream, clients, counted, late
) -> None:
    """An upstream allowing 1 stream per connection (so 4 connections) and 40 requests: 36
    wait. The upstream answers one at a time; each stream that ends gives one waiter its turn,
    in the order the requests came. Requests that came before the connections were up wait in
    tasks, each woken once (when each end woke every waiter, the 36 waited 36 + 35 + ... + 1 =
    666 times); requests that came once they were full wait in line without a task."""
    one_at_a_time, up, proxy, client = await one_stream_each(upstream, h2proxy, clients)
    held = one_at_a_time.releases
    sids = [
        client.request(request_headers(proxy.port, b"/%d" % n)) for n in range(4 if late else 40)
    ]
    if late:
        await eventually(lambda: len(held) == 4)
        tasks = len(counted.tasks)
        sids += [client.request(request_headers(proxy.port, b"/%d" % n)) for n in range(4, 40)]
        await client.round_trip()
        assert len(held) == 4 and len(counted.tasks) == tasks and counted.waits == 0
    else:
        await eventually(lambda: len(held) == 4 and counted.waits == 36)
    for left in range(39, -1, -1):
        held.pop(0).set()
        await eventually(partial(lambda left: len(held) == min(4, left), left))
    assert [(await client.response(sid)).status for sid in sids] == [200] * 40
    assert len(up.conns) == 4
    served = [int(path[1:]) for path in one_at_a_time.paths]
    assert sorted(served[:4]) == [0, 1, 2, 3] and served[4:] == list(range(4, 40))
    if late:
        assert counted.waits == 0
        assert counted.tasks.count("H2Server._carry") == 4  # the 4 that connected
    else:
        assert counted.waits <= 36 + 4, counted.waits  # a turn may go before its waiter runs


@pytest.mark.parametrize(
    "late", [False, True], ids=["before-the-connections", "once-they-are-full"]
)
async def test_a_request_reset_while_it_waits_for_a_stream_gives_up_its_place(
    h2proxy, upstream, clients, late
) -> None:
    """4 requests held on an upstream allowing 1 stream per connection, 4 waiting; the client
    resets the first 3 waiting: the next stream to end goes to the fourth, and none of the three
    reaches the upstream."""
    hold, _up, proxy, client = await one_stream_each(upstream, h2proxy, clients)
    held = hold.releases
    sids = [
        client.request(request_headers(proxy.port, b"/%d" % n)) for n in range(4 if late else 8)
    ]
    await eventually(lambda: len(held) == 4)
    sids += [client.request(request_headers(proxy.port, b"/%d" % n)) for n in range(len(sids), 8)]
    await client.round_trip()  # the other four wait for a stream
    for sid in sids[4:7]:
        client.h2.reset_stream(sid, ErrorCodes.CANCEL)
    client.flush()
    await client.round_trip()  # the resets are read
    held[0].set()
    await eventually(lambda: len(held) == 5)
    for release in held:
        release.set()
    assert (await client.response(sids[7])).status == 200
    assert sorted(hold.paths) == sorted(b"/%d" % n for n in (0, 1, 2, 3, 7))


async def test_requests_that_leave_the_line_free_their_places_before_their_turn(
    h2proxy, upstream, clients
) -> None:
    """4 requests held on an upstream allowing 1 stream per connection; 200 more in line, of
    which the clients reset 190 while no stream ends: the line is swept as they leave (it keeps
    fewer than 50 places, not 200), and the 10 left are answered in turn."""
    hold, _up, proxy, first = await one_stream_each(upstream, h2proxy, clients)
    held = hold.releases
    sent = [first.request(request_headers(proxy.port)) for _ in range(4)]
    await eventually(lambda: len(held) == 4)
    lines = [await clients(proxy.port) for _ in range(4)]
    waiting = [(c, c.request(request_headers(proxy.port))) for c in lines for _ in range(50)]
    await eventually(lambda: proxy.pool.in_line == 200)
    for c, sid in waiting[:190]:
        c.h2.reset_stream(sid, ErrorCodes.CANCEL)
        c.flush()
    for c in lines:
        await c.round_trip()  # the resets are read
    assert proxy.pool.in_line < 50
    for _ in range(14):
        await eventually(lambda: held)
        held.pop(0).set()
    assert [(await first.response(sid)).status for sid in sent] == [200] * 4
    assert [(await c.response(sid)).status for c, sid in waiting[190:]] == [200] * 10
    assert proxy.pool.in_line == 0


async def test_a_closing_pool_dials_no_more_for_its_line(h2proxy, upstream, clients) -> None:
    """4 requests held on an upstream allowing 1 stream per connection, 6 in line: the pool
    closes (the proxy shuts down); its connections go, and neither the line nor the 4 they
    carried (GETs, tried again) make a new one."""
    hold, up, proxy, client = await one_stream_each(upstream, h2proxy, clients)
    for n in range(10):
        client.request(request_headers(proxy.port, b"/%d" % n))
    await eventually(lambda: len(hold.releases) == 4 and proxy.pool.in_line == 6)
    await proxy.pool.aclose()
    await asyncio.sleep(0.2)
    assert len(up.conns) == 4
    assert not [t for t in asyncio.all_tasks() if "H2Pool" in repr(t.get_coro())]


async def test_requests_in_line_when_the_upstreams_connections_die_get_new_ones(
    h2proxy, upstream, clients, counted
) -> None:
    """4 requests held on the 4 connections to an upstream allowing 1 stream each, 6 more in
    line without a task; the upstream's connections are cut: the 6 in line go on new connections
    (the pool dials for its line, at most 4 again) and are answered; the 4 sent, POSTs, are not
    sent again (502)."""
    hold_the_first_four, up, proxy, client = await one_stream_each(upstream, h2proxy, clients)
    held = hold_the_first_four.releases
    post = partial(request_headers, proxy.port, method=b"POST")
    sent = [client.request(post(b"/%d" % n), b"x") for n in range(4)]
    await eventually(lambda: len(held) == 4)
    tasks = counted.tasks.count("H2Server._carry")
    waiting = [client.request(request_headers(proxy.port, b"/%d" % n)) for n in range(4, 10)]
    await eventually(lambda: proxy.pool.in_line == 6)
    assert counted.tasks.count("H2Server._carry") == tasks
    hold_the_first_four.holding = False
    for conn in list(up.conns):
        conn.transport.abort()
    assert [(await client.response(sid)).status for sid in waiting] == [200] * 6
    assert [(await client.response(sid)).status for sid in sent] == [502] * 4
    assert 4 < len(up.conns) <= 8


async def test_a_head_over_the_upstreams_header_list_limit_is_431_and_costs_no_other_stream(
    h2proxy, upstream, clients
) -> None:
    """An upstream that takes header lists of at most 1,000 bytes (SETTINGS_MAX_HEADER_LIST_SIZE)
    and treats a larger one as a connection error, as the proxy itself does: the proxy answers
    such a request 431 without sending it, and the shared connection and the request in flight on
    it are untouched."""
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        await release.wait()
        request.respond(200, end=True)

    up, addr = await upstream(held)
    up.settings = {SettingCodes.MAX_HEADER_LIST_SIZE: 1000}
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    first = client.request(request_headers(proxy.port))
    await eventually(lambda: len(up.conns) == 1)
    big = client.request([*request_headers(proxy.port), (b"x-big", b"v" * 1000)])
    refused = await client.response(big)
    assert refused.status == 431
    assert b"upstream takes" in dict(refused.headers)[b"meshlet-proxy-error"]
    release.set()
    assert (await client.response(first)).status == 200
    assert (await client.get(proxy.port)).status == 200
    assert len(up.conns) == 1  # the one connection, never torn down


async def test_one_connection_serves_requests_within_the_upstream_limit(
    h2proxy, upstream, clients
) -> None:
    """Requests one after the other never fill the connection: one connection serves them."""
    up, addr = await upstream(echo)
    up.settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    for _ in range(5):
        assert (await client.get(proxy.port)).status == 200
    assert len(up.conns) == 1


async def test_informational_responses_are_relayed(h2proxy, upstream, clients) -> None:
    async def continue_first(request: UpstreamRequest) -> None:
        request.respond(100)
        request.respond(200)
        await request.send(await request.read_body(), end=True)

    _, addr = await upstream(continue_first)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    headers = [*request_headers(proxy.port, method=b"POST"), (b"expect", b"100-continue")]
    got = await client.response(client.request(headers, body=b"after 100"))
    assert got.informational == [[(b":status", b"100")]]
    assert got.status == 200 and bytes(got.body) == b"after 100"


async def test_an_upstream_allowing_no_stream_gets_a_timely_503(h2proxy, upstream, clients) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS = 0: requests wait no longer than a connect would,
    then 503; when the upstream raises its limit, requests flow again."""
    up, addr = await upstream(echo)
    up.settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 0}
    proxy = await h2proxy(addr, limits=HttpLimits(connect_timeout=0.3))
    client = await clients(proxy.port)
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await client.response(client.request(request_headers(proxy.port)))
    assert got.status == 503 and loop.time() - started < 2.0
    assert b"MAX_CONCURRENT_STREAMS" in (got.header(b"meshlet-proxy-error") or b"")
    assert not up.requests
    (conn,) = up.conns
    conn.h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: 10})
    conn.flush()
    got = await client.response(client.request(request_headers(proxy.port)))
    assert got.status == 200 and len(up.conns) == 1


async def test_an_informational_flood_is_not_relayed(h2proxy, upstream, clients) -> None:
    """20,000 1xx heads before the response: ten are relayed, then the upstream's stream is
    reset and the client gets 502; the connection and the next request are fine."""

    async def flood(request: UpstreamRequest) -> None:
        await request.read_body()
        for _ in range(20_000):
            if request.reset is not None:
                return
            request.conn.h2.send_headers(request.sid, [(b":status", b"103")])
        request.conn.flush()
        request.respond(200, end=True)

    up, addr = await upstream(flood)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    got = await client.response(client.request(request_headers(proxy.port, b"/flood")))
    assert got.status == 502 and len(got.informational) == MAX_INFORMATIONAL
    assert b"informational" in (got.header(b"meshlet-proxy-error") or b"")
    assert len(up.conns) == 1 and client.goaway is None


async def test_an_idle_connection_is_closed_with_goaway(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr, limits=HttpLimits(idle_timeout=0.1))
    client = await clients(proxy.port)
    assert (await client.get(proxy.port)).status == 200
    await client.until(lambda: client.eof, within=1.0)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.NO_ERROR


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_tls_is_terminated_when_the_connection_carries_a_context(
    h2proxy, upstream, clients, tmp_path
) -> None:
    _, addr = await upstream(echo)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(*self_signed(tmp_path))
    server_tls.set_alpn_protocols(["h2"])
    proxy = await h2proxy(addr, ssl=server_tls)
    client_tls = ssl.create_default_context()
    client_tls.check_hostname = False
    client_tls.verify_mode = ssl.CERT_NONE
    client_tls.set_alpn_protocols(["h2"])
    client = await clients(proxy.port, tls=client_tls)
    got = await client.get(proxy.port, body=b"over tls")
    assert got.status == 200 and bytes(got.body) == b"over tls"
    assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"


# -- other implementations as clients: curl and nghttp2's tools (libnghttp2) --


async def run_tool(*argv: str) -> tuple[int, bytes, bytes]:
    tool = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(tool.communicate(), 30)
    assert tool.returncode is not None
    return tool.returncode, out, err


def needs(tool: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which(tool) is None, reason=f"{tool} is not installed")


@needs("curl")
async def test_curl_gets_the_body_and_sends_one(h2proxy, upstream) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    code, out, err = await run_tool(
        "curl", "-sS", "--http2-prior-knowledge", "--data-binary", "x" * 100_000,
        f"http://127.0.0.1:{proxy.port}/curl",
    )  # fmt: skip
    assert code == 0, err
    assert out == b"x" * 100_000
    assert up.requests[0].header(b":path") == b"/curl"


@needs("nghttp")
async def test_nghttp_relays_trailers_and_large_bodies(h2proxy, upstream, tmp_path) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    upload = tmp_path / "upload"
    upload.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: many windows' worth
    code, out, err = await run_tool(
        "nghttp", "-v", "-d", str(upload), f"http://127.0.0.1:{proxy.port}/nghttp"
    )
    assert code == 0, err
    text = out.decode(errors="replace")
    digest = hashlib.sha256(upload.read_bytes()).hexdigest()
    assert f"x-body-sha256: {digest}" in text  # the trailers, after the whole echoed body
    assert "GOAWAY" in text and "error_code=NO_ERROR" in text


@needs("h2load")
async def test_h2load_finds_every_request_answered(h2proxy, upstream) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    code, out, err = await run_tool(
        "h2load", "-n", "2000", "-c", "4", "-m", "16", f"http://127.0.0.1:{proxy.port}/load"
    )
    assert code == 0, err
    text = out.decode()
    assert "2000 succeeded, 0 failed, 0 errored" in text, text
    assert "status codes: 2000 2xx" in text, text


# -- request bodies at a minimum rate --


async def echo_unless_reset(request: UpstreamRequest) -> None:
    await request.read_body()  # ends with the body, or with the proxy's reset
    if request.reset is None:
        await echo(request)


async def test_a_quiet_stream_is_never_cut_by_default(h2proxy, upstream, clients) -> None:
    """A client stream quiet for many times the connection's idle timeout (a watch, a chat):
    nothing cuts it; the connection's idle timer is for connections without streams."""
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr, limits=HttpLimits(idle_timeout=0.2))
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    client.h2.send_data(sid, b"first ")
    client.flush()
    await asyncio.sleep(1.0)  # five idle timeouts without a byte either way
    assert not client.streams[sid].done and not client.eof
    client.h2.send_data(sid, b"last", end_stream=True)
    client.flush()
    got = await client.response(sid)
    assert got.status == 200 and bytes(got.body) == b"first last"


IDLE = HttpLimits(stream_idle_timeout=0.3)


async def test_opt_in_stream_idle_a_stalled_body_gets_408(h2proxy, upstream, clients) -> None:
    up, addr = await upstream(echo_unless_reset)
    proxy = await h2proxy(addr, limits=IDLE)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    client.h2.send_data(sid, b"x" * 10)
    client.flush()
    got = await client.response(sid)
    assert got.status == 408
    assert got.header(b"meshlet-proxy-error") == (
        b"request body stalled: no bytes either way for 0.3s (the idle timeout)"
    )
    await eventually(lambda: bool(up.requests) and up.requests[0].reset == ErrorCodes.CANCEL)
    assert (await client.get(proxy.port)).status == 200  # the connection serves on


async def test_opt_in_stream_idle_an_unanswered_grpc_call_is_deadline_exceeded(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()
    up, addr = await upstream(partial(held_unless, b"/held", release))
    proxy = await h2proxy(addr, limits=IDLE)
    client = await clients(proxy.port)
    headers = [*request_headers(proxy.port, b"/held", b"POST"),
               (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
    got = await client.response(client.request(headers, body=b"\0\0\0\0\0"))
    assert got.status == 200 and got.header(b"grpc-status") == b"4"
    await eventually(lambda: bool(up.requests) and up.requests[0].reset == ErrorCodes.CANCEL)
    release.set()


async def test_opt_in_stream_idle_leaves_a_steady_stream_alone(h2proxy, upstream, clients) -> None:
    _, addr = await upstream(echo)
    proxy = await h2proxy(addr, limits=IDLE)
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, method=b"POST"), end=False)
    for _ in range(8):  # a byte every 0.1 s, for twice the idle timeout and more
        client.h2.send_data(sid, b"y")
        client.flush()
        await asyncio.sleep(0.1)
    client.h2.end_stream(sid)
    client.flush()
    got = await client.response(sid)
    assert got.status == 200 and bytes(got.body) == b"y" * 8


# -- a hostile client, end to end --


async def held_unless(path: bytes, release: asyncio.Event, request: UpstreamRequest) -> None:
    """Requests for `path` wait for `release` (or the proxy's reset); the rest are echoed."""
    if request.header(b":path") != path:
        await echo(request)
        return
    await asyncio.wait_for(release.wait(), TIMEOUT)
    if request.reset is None:
        request.respond(200, end=True)


async def test_frames_on_a_refused_stream_are_dropped_and_the_connection_lives(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()
    up, addr = await upstream(partial(held_unless, b"/held", release))
    proxy = await h2proxy(addr, limits=HttpLimits(max_concurrent_streams=1))
    client = await clients(proxy.port)
    await client.until(lambda: client.h2.remote_settings.max_concurrent_streams == 1)
    client.h2.remote_settings[SettingCodes.MAX_CONCURRENT_STREAMS] = 100
    client.h2.remote_settings.acknowledge()
    held = client.request(request_headers(proxy.port, b"/held"))
    refused = client.request(request_headers(proxy.port, b"/refused"), end=False)
    assert (await client.response(refused)).reset == ErrorCodes.REFUSED_STREAM
    # The client goes on as if it had not heard: body, trailers, credit, priority, reset.
    trailers = client.h2.encoder.encode([(b"x-trailer", b"1")])
    client.write(
        DataFrame(refused, b"x" * 16000).serialize()
        + DataFrame(refused, b"y" * 100, flags=["PADDED"], pad_length=50).serialize()
        + HeadersFrame(refused, trailers, flags=["END_HEADERS", "END_STREAM"]).serialize()
        + WindowUpdateFrame(refused, window_increment=1000).serialize()
        + PriorityFrame(refused, depends_on=0, stream_weight=16).serialize()
        + RstStreamFrame(refused, error_code=ErrorCodes.CANCEL).serialize()
    )
    release.set()
    assert (await client.response(held)).status == 200
    got = await client.get(proxy.port, b"/after", b"body")
    assert got.status == 200 and bytes(got.body) == b"body"
    assert client.goaway is None and not client.eof
    assert [r.header(b":path") for r in up.requests] == [b"/held", b"/after"]
    await assert_proxy_serves(proxy, clients)


async def test_data_past_a_stream_window_resets_only_that_stream(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()
    up, addr = await upstream(partial(held_unless, b"/held", release))
    up.ack = False  # the upstream takes 64 KiB of the body and no more
    proxy = await h2proxy(addr, limits=HttpLimits(max_body_buffer=16384))
    client = await clients(proxy.port)
    sid = client.request(request_headers(proxy.port, b"/held", b"POST"), end=False)
    # 100 KB at once: past the proxy's 16 KiB window plus what the upstream took.
    client.write(b"".join(DataFrame(sid, b"x" * 10000).serialize() for _ in range(10)))
    assert (await client.response(sid)).reset == ErrorCodes.FLOW_CONTROL_ERROR
    release.set()
    assert (await client.get(proxy.port, b"/after")).status == 200
    # whether it had been sent upstream or not, the stream is gone there too
    assert all(r.reset is not None for r in up.requests if r.header(b":path") == b"/held")
    assert client.goaway is None and not client.eof
    await assert_proxy_serves(proxy, clients)


async def test_data_past_the_connection_window_is_a_flow_control_goaway(
    h2proxy, upstream, clients
) -> None:
    release = asyncio.Event()
    up, addr = await upstream(partial(held_unless, b"/", release))
    up.ack = False
    proxy = await h2proxy(addr, limits=HttpLimits(max_body_buffer=16384))
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))
    frames = bytearray(PREFACE)
    encoder = Encoder()
    for sid in range(1, 21, 2):  # 10 streams, each within its own 16 KiB window: 160 KiB
        block = encoder.encode(request_headers(proxy.port, method=b"POST"))
        frames += HeadersFrame(sid, block, flags=["END_HEADERS"]).serialize()
        frames += DataFrame(sid, b"x" * 16384).serialize()
    # ...past the connection's 64 KiB plus the 64 KiB the upstream took
    await send_all(sock, bytes(frames))
    assert goaway_code(await reader) == ErrorCodes.FLOW_CONTROL_ERROR
    release.set()
    await assert_proxy_serves(proxy, clients)


async def test_an_initial_window_shrunk_to_0_mid_response_stops_it_until_it_grows(
    h2proxy, upstream, clients
) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB

    async def big(request: UpstreamRequest) -> None:
        request.respond(200)
        await request.send(body, end=True)

    _, addr = await upstream(big)
    proxy = await h2proxy(addr, limits=HttpLimits(max_body_buffer=64 * 1024))
    client = await clients(proxy.port)
    client.h2.increment_flow_control_window(1 << 24)  # only the stream's window binds
    sid = client.request(request_headers(proxy.port))
    await client.until(lambda: len(client.streams[sid].body) >= 100_000)
    client.ack = False
    client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})
    client.flush()
    await client.until(lambda: client.h2.local_settings.initial_window_size == 0)
    stopped_at = len(client.streams[sid].body)
    await asyncio.sleep(0.3)
    # h2 fails the connection for any byte past the window; nothing more arrived either.
    assert len(client.streams[sid].body) == stopped_at < len(body)
    assert not client.eof and client.goaway is None
    client.ack = True
    client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    client.flush()
    got = await client.response(sid)
    assert got.ended and bytes(got.body) == body
    assert (await client.get(proxy.port, b"/after")).status == 200


async def test_a_max_frame_size_change_mid_response_is_followed(h2proxy, upstream, clients) -> None:
    body = bytes(range(256)) * 8192  # 2 MiB

    async def big(request: UpstreamRequest) -> None:
        request.respond(200)
        await request.send(body, end=True)

    _, addr = await upstream(big)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    client.h2.increment_flow_control_window(1 << 24)
    sid = client.request(request_headers(proxy.port))
    await client.until(lambda: len(client.streams[sid].body) >= 200_000)
    client.h2.update_settings({SettingCodes.MAX_FRAME_SIZE: 1 << 20})
    client.flush()
    await client.until(lambda: len(client.streams[sid].body) >= 1_000_000)
    client.h2.update_settings({SettingCodes.MAX_FRAME_SIZE: 16384})  # h2 checks every frame
    client.flush()
    got = await client.response(sid)
    assert got.ended and bytes(got.body) == body
    assert (await client.get(proxy.port, b"/after")).status == 200
    client.write(SettingsFrame(0, settings={SettingCodes.MAX_FRAME_SIZE: 16383}).serialize())
    await client.until(lambda: client.eof)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.PROTOCOL_ERROR
    await assert_proxy_serves(proxy, clients)


@pytest.mark.parametrize("wave", [50, 100, 250])
async def test_streams_opened_and_reset_in_waves_are_rapid_reset(
    h2proxy, upstream, clients, wave
) -> None:
    """1,000 streams, opened a wave at a time and reset once the wave is in: a client pacing
    its resets is still found out."""
    _, addr = await upstream(echo_unless_reset)
    proxy = await h2proxy(addr)
    sock = await raw_connection(proxy.port)
    reader = asyncio.create_task(read_until_closed(sock))
    encoder = Encoder()
    await send_all(sock, PREFACE)
    for first in range(0, 1000, wave):
        sids = [2 * i + 1 for i in range(first, first + wave)]
        opened = b"".join(
            HeadersFrame(sid, encoder.encode(request_headers(proxy.port, method=b"POST")),
                         flags=["END_HEADERS"]).serialize()
            for sid in sids
        )  # fmt: skip
        resets = b"".join(RstStreamFrame(s, error_code=ErrorCodes.CANCEL).serialize() for s in sids)
        try:  # the reader closes the socket once the proxy closed the connection
            if reader.done() or not await send_all(sock, opened + resets):
                break
        except OSError:
            break
        await asyncio.sleep(0.02)
    assert raw_goaway_code(await reader) == ErrorCodes.ENHANCE_YOUR_CALM
    assert proxy.sample("http_client_errors_total", status_code="enhance_your_calm") == 1
    await assert_proxy_serves(proxy, clients)


def split_head(client: Client, sid: int, headers: Headers, pieces: int) -> bytes:
    """The request head h2 would send on `sid`, its block cut into HEADERS and `pieces` - 1
    CONTINUATION frames (h2's stream state and HPACK table follow as if it had sent it)."""
    client.flush()
    client.h2.send_headers(sid, headers, end_stream=True)
    client.streams[sid] = Received()
    data = client.h2.data_to_send()
    assert data[3] == 0x1 and len(data) == 9 + int.from_bytes(data[:3], "big")
    block = data[9:]
    size = -(-len(block) // pieces)
    chunks = [block[at : at + size] for at in range(0, len(block), size)]
    chunks += [b""] * (pieces - len(chunks))
    out = HeadersFrame(sid, chunks[0], flags=["END_STREAM"]).serialize()
    for i, chunk in enumerate(chunks[1:], start=2):
        flags = ["END_HEADERS"] if i == pieces else []
        out += ContinuationFrame(sid, chunk, flags=flags).serialize()
    return out


async def test_header_blocks_in_many_continuations_within_the_limit_are_served(
    h2proxy, upstream, clients
) -> None:
    up, addr = await upstream(echo)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    headers = [
        *request_headers(proxy.port, b"/split"),
        *[(b"x-h%d" % i, b"v" * 50) for i in range(40)],
    ]
    for pieces in (2, 17, 33):  # up to HEADERS and 32 CONTINUATIONs
        sid = client.h2.get_next_available_stream_id()
        client.write(split_head(client, sid, headers, pieces))
        got = await client.response(sid)
        assert got.status == 200, pieces
    big = client.request([*request_headers(proxy.port, b"/big"), (b"x-big", b"b" * 40_000)])
    assert (await client.response(big)).status == 200  # h2 cuts it at 16 KiB frames
    assert up.requests[-1].header(b"x-big") == b"b" * 40_000
    sid = client.h2.get_next_available_stream_id()
    client.write(split_head(client, sid, headers, 34))  # one CONTINUATION too many
    await client.until(lambda: client.eof)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.PROTOCOL_ERROR
    await assert_proxy_serves(proxy, clients)


async def test_a_client_that_never_reads_stops_the_upstream_whatever_its_windows(
    h2proxy, upstream, clients
) -> None:
    """Windows wide open, socket never read: the write buffer's high-water mark stops the
    relay, the upstream gets no more credit, and what the proxy holds stays bounded."""
    body = bytes(range(256)) * 65536  # 16 MiB
    finished = asyncio.Event()

    async def big(request: UpstreamRequest) -> None:
        request.respond(200)
        with contextlib.suppress(TimeoutError):
            await request.send(body, end=True)
            finished.set()

    up, addr = await upstream(big)
    limits = HttpLimits(max_body_buffer=64 * 1024)
    proxy = await h2proxy(addr, limits=limits)
    proxy.engine.listener.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    sock = await raw_connection(proxy.port, rcvbuf=4096)
    window = SettingsFrame(0, settings={SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    await send_all(
        sock,
        PREFACE
        + window.serialize()
        + WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535).serialize()
        + encode_request(proxy.port, 1),
    )
    await eventually(lambda: bool(up.requests) and up.requests[0].sent > 0)
    await asyncio.sleep(0.5)
    sent = up.requests[0].sent
    await asyncio.sleep(0.5)
    assert up.requests[0].sent == sent  # stopped, not trickling
    # the transport's high-water mark + the stream's window + kernel buffers (~390 KB here)
    assert sent < HIGH_WATER + limits.max_body_buffer + 512 * 1024, sent
    assert not finished.is_set()
    sock.close()
    await assert_proxy_serves(proxy, clients)


# -- content-length against DATA (RFC 9113 §8.1.1), both ways --


async def test_a_request_whose_body_disagrees_with_its_length_never_poisons_the_upstream(
    h2proxy, upstream, clients
) -> None:
    """The upstream is the `h2` library, which fails the whole connection (GOAWAY) on a body
    that does not add up to its content-length. Victims' POSTs and GETs in flight on that one
    shared connection finish, each received once: the proxy resets only the malformed streams
    and never relays their excess bytes or a short body's end."""
    release = asyncio.Event()

    async def held(request: UpstreamRequest) -> None:
        body = await request.read_body()
        if request.reset is not None:
            return
        await release.wait()
        request.respond(200, [(b"x-path", request.header(b":path") or b"")])
        await request.send(body, end=True)

    up, addr = await upstream(held)
    proxy = await h2proxy(addr)
    victim = await clients(proxy.port)
    victims = []
    for i in range(6):
        method = b"POST" if i % 2 else b"GET"
        body = b"victim %d" % i if i % 2 else b""
        victims.append(victim.request(request_headers(proxy.port, b"/v%d" % i, method), body))
    await eventually(lambda: len(up.requests) == 6)
    attacker = await clients(proxy.port)
    long = [*request_headers(proxy.port, b"/long", b"POST"), (b"content-length", b"5")]
    short = [*request_headers(proxy.port, b"/short", b"POST"), (b"content-length", b"10")]
    none = [*request_headers(proxy.port, b"/none", b"POST"), (b"content-length", b"3")]
    sids = [
        attacker.request(long, body=b"0123456789"),
        attacker.request(short, body=b"01234"),
        attacker.request(none),
    ]
    for sid in sids:
        assert (await attacker.response(sid)).reset == ErrorCodes.PROTOCOL_ERROR
    release.set()
    for i, sid in enumerate(victims):
        got = await victim.response(sid)
        assert got.status == 200 and got.header(b"x-path") == b"/v%d" % i
        assert bytes(got.body) == (b"victim %d" % i if i % 2 else b"")
    assert len(up.conns) == 1 and up.lost == 0  # the one shared connection lived
    assert sorted(r.header(b":path") for r in up.requests if r.reset is None) == [
        b"/v%d" % i for i in range(6)
    ]
    assert all(len(r.body) <= 5 for r in up.requests if r.header(b":path") == b"/long")
    assert attacker.goaway is None and not attacker.eof  # a stream error: the client lives
    assert proxy.sample("http_client_errors_total", status_code="protocol_error") == 3


async def test_a_response_whose_body_disagrees_with_its_length_is_never_relayed_whole(
    h2proxy, upstream, clients
) -> None:
    """An upstream's body shorter or longer than its content-length: the client's stream is
    reset (never a truncated body passed off as complete), the upstream's stream reset, and the
    other streams on that connection unaffected."""

    async def liar(request: UpstreamRequest) -> None:
        await request.read_body()
        path = request.header(b":path")
        if path == b"/short":
            request.respond(200, [(b"content-length", b"10")])
            await request.send(b"01234", end=True)
        elif path == b"/long":
            request.respond(200, [(b"content-length", b"5")])
            await request.send(b"0123456789", end=True)
        elif path == b"/empty":
            request.respond(200, [(b"content-length", b"3")], end=True)
        else:
            request.respond(200, [(b"content-length", b"2")])
            await request.send(b"ok", end=True)

    up, addr = await upstream(liar)
    proxy = await h2proxy(addr)
    client = await clients(proxy.port)
    short = await client.response(client.request(request_headers(proxy.port, b"/short")))
    assert short.reset is not None and not short.ended
    long = await client.response(client.request(request_headers(proxy.port, b"/long")))
    assert long.reset is not None and not long.ended and len(long.body) <= 5
    empty = await client.response(client.request(request_headers(proxy.port, b"/empty")))
    assert empty.status == 502 and empty.ended
    fine = await client.response(client.request(request_headers(proxy.port, b"/fine")))
    assert fine.status == 200 and bytes(fine.body) == b"ok"
    assert len(up.conns) == 1 and client.goaway is None


# -- an upstream's graceful GOAWAY --


class ClosingConn(UpstreamConn):
    """An `h2`-library server whose GOAWAY is `close_connection()` (as hypercorn's is, at its
    keep_alive_max_requests): h2 then fails every later frame but GOAWAY with
    GOAWAY(PROTOCOL_ERROR), and never answers the streams it took. Input can be held back
    (read off the socket, not yet given to h2), and what arrives after its GOAWAY is kept."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(upstream)
        self.held: bytearray | None = None
        self.after_goaway: bytearray | None = None
        self.protocol_error: str | None = None

    def data_received(self, data: bytes) -> None:
        if self.after_goaway is not None:
            self.after_goaway += data
        if self.held is not None:
            self.held += data
            return
        self.process(data)

    def process(self, data: bytes) -> None:
        try:
            super().data_received(data)
        except h2.exceptions.ProtocolError as exc:  # as hypercorn: the GOAWAY out, then close
            self.protocol_error = str(exc)
            self.flush()
            assert self.transport is not None
            self.transport.close()


async def test_streams_an_upstreams_goaway_excluded_get_nothing_more_and_are_retried(
    h2proxy, clients
) -> None:
    """RFC 9113 §6.8: streams above a GOAWAY's last stream id are treated as never created:
    the proxy sends nothing more on them (not even RST_STREAM) and retries them on a new
    connection (§8.7). An `h2` server in its closed state then fails only on the HEADERS that
    crossed its GOAWAY, and no request fails."""
    first_seen = asyncio.Event()
    closing: list[ClosingConn] = []

    async def handler(request: UpstreamRequest) -> None:
        conn = request.conn
        assert isinstance(conn, ClosingConn)
        if conn is up.conns[0]:
            if request.sid != 1:
                return
            conn.held = bytearray()  # what the proxy writes from now on stays on the wire
            first_seen.set()
            await eventually(lambda: bool(conn.held))  # stream 3's HEADERS, in flight
            conn.after_goaway = bytearray(conn.held)
            conn.h2.close_connection()  # GOAWAY, last stream id 1
            conn.flush()
            await asyncio.sleep(0.2)  # the proxy reads the GOAWAY and acts on it
            closing.append(conn)
            held, conn.held = bytes(conn.held), None
            conn.process(held)  # h2, closed, reads HEADERS 3: ProtocolError
            return  # stream 1 is never answered: h2 sends nothing once closed
        request.respond(200, [(b"x-conn", b"%d" % (up.conns.index(conn) + 1))])
        await request.send(b"ok", end=True)

    up = Upstream(handler)
    loop = asyncio.get_running_loop()
    up.server = await loop.create_server(lambda: ClosingConn(up), "127.0.0.1", 0)
    addr = ("127.0.0.1", up.server.sockets[0].getsockname()[1])
    try:
        proxy = await h2proxy(addr)
        got_one, got_two = await one_then_two(proxy, await clients(proxy.port), first_seen.wait())
        (conn,) = closing
        assert conn.protocol_error is not None and "RECV_HEADERS" in conn.protocol_error
        # 3 was never processed (retried at once), 1 idempotent (retried after the close)
        assert (got_one.status, got_one.header(b"x-conn")) == (200, b"2")
        assert (got_two.status, got_two.header(b"x-conn")) == (200, b"2")
        # after its GOAWAY the upstream got only the HEADERS already in flight
        assert frame_kinds(bytes(conn.after_goaway or b"")) == [(0x1, 3)]
    finally:
        await up.stop()


def frame_kinds(raw: bytes) -> list[tuple[int, int]]:
    """(type, stream id) of each frame in `raw`."""
    out, pos = [], 0
    while len(raw) - pos >= 9:
        length = int.from_bytes(raw[pos : pos + 3], "big")
        out.append((raw[pos + 3], int.from_bytes(raw[pos + 5 : pos + 9], "big") & 0x7FFFFFFF))
        pos += 9 + length
    return out


# -- load shedding --


SHED_GRACE = 0.2


async def test_past_the_stream_mark_the_connection_holding_quiet_streams_goes(
    h2proxy, upstream, clients
) -> None:
    """One client holds 8 streams that move nothing while another keeps its 4 streams and the
    connection busy: over the stream mark, the periodic check sheds the quiet holder (GOAWAY
    ENHANCE_YOUR_CALM); the busy client is untouched."""
    release = asyncio.Event()

    async def handler(request: UpstreamRequest) -> None:
        await request.read_body()
        if request.header(b":path") == b"/hold":
            await release.wait()
        if request.reset is None:
            request.respond(200, end=True)

    _, addr = await upstream(handler)
    metrics = ProxyMetrics()
    shedder = LoadShedder(PressureLimits(streams=10, low_water=0.5, grace=SHED_GRACE), metrics)
    proxy = await h2proxy(addr, shedder=shedder)
    quiet, busy = await clients(proxy.port), await clients(proxy.port)
    held = [quiet.request(request_headers(proxy.port, b"/hold")) for _ in range(8)]
    mine = [busy.request(request_headers(proxy.port, b"/hold")) for _ in range(4)]
    loop = asyncio.get_running_loop()
    until = loop.time() + SHED_PERIOD + SHED_GRACE + 0.5
    while loop.time() < until and quiet.goaway is None:
        assert (await busy.get(proxy.port, b"/quick")).status == 200  # progress
    shedder.close()
    release.set()
    assert quiet.goaway is not None
    assert quiet.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    await quiet.until(lambda: all(quiet.streams[s].done for s in held) or quiet.eof)
    for sid in mine:
        assert (await busy.response(sid)).status == 200
    assert busy.goaway is None
    shed = [
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "load_shed_total" and sample.labels["resource"] == "streams"
    ]
    assert shed == [1.0]


# -- gRPC statuses stay the caller's --


async def test_a_stream_the_upstream_refused_is_sent_again_and_the_grpc_call_succeeds(
    h2proxy, upstream
) -> None:
    """REFUSED_STREAM says the upstream never processed the stream: the proxy sends it again
    (grpcio, a client nobody here wrote, sees one successful call); when every attempt is
    refused the client's stream is reset REFUSED_STREAM, which gRPC reports as UNAVAILABLE, a
    status it may retry, never INTERNAL."""
    import grpc

    refuse = {"count": 1}

    async def handler(request: UpstreamRequest) -> None:
        if refuse["count"]:
            refuse["count"] -= 1
            request.reset_stream(ErrorCodes.REFUSED_STREAM)
            return
        await request.read_body()
        request.respond(200, [(b"content-type", b"application/grpc")])
        await request.send(b"\0\0\0\0\x02ok")
        request.trailers([(b"grpc-status", b"0")])

    up, addr = await upstream(handler)
    proxy = await h2proxy(addr)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        call = channel.unary_unary("/meshlet.test.Echo/Unary")
        assert await call(b"hi", timeout=5) == b"ok"
        assert len(up.requests) == 2  # refused, then sent again
        refuse["count"] = 10  # every attempt refused now
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(b"hi", timeout=5, wait_for_ready=False)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
