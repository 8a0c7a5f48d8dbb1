"""The HTTP/1.1 engine relaying real clients to real upstream servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import http.client
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshlet.proxy.http.contract import HttpLimits
from meshlet.proxy.http.h1 import serve_h1
from meshlet_testing.polling import eventually
from meshlet_testing.sockets import hanging_port

# -- an upstream origin server that records what reaches it --------------------------------


@dataclass
class Seen:
    """A request as the upstream received it."""

    method: bytes
    target: bytes
    fields: list[tuple[bytes, bytes]]
    body: bytes = b""

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.fields if n.lower() == name]


Responder = Callable[[Seen, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]


async def plain(seen: Seen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b"%s %s %d" % (seen.method, seen.target, len(seen.body))
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
    if seen.method != b"HEAD":
        writer.write(body)


class _Parse:
    """httptools callbacks of one upstream connection."""

    def __init__(self, upstream: Upstream, writer: asyncio.StreamWriter) -> None:
        self.upstream, self.writer = upstream, writer
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[Seen] = []
        self.fields: list[tuple[bytes, bytes]] = []
        self.target = b""
        self.body: list[bytes] = []

    def on_message_begin(self) -> None:
        self.fields, self.target, self.body = [], b"", []

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        if any(v.lower() == b"100-continue" for n, v in self.fields if n.lower() == b"expect"):
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.upstream.body_bytes += len(body)
        self.upstream.body_started.set()

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        self.done.append(Seen(method, self.target, self.fields, b"".join(self.body)))


@dataclass
class Upstream:
    """A real HTTP/1.1 origin: counts connections, records requests and every byte received."""

    respond: Responder = plain
    connections: int = 0
    closed: int = 0
    raw: bytearray = field(default_factory=bytearray)
    requests: list[Seen] = field(default_factory=list)
    body_bytes: int = 0
    body_started: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    @property
    def addr(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        parse = _Parse(self, writer)
        try:
            while data := await reader.read(65536):
                self.raw += data
                with contextlib.suppress(httptools.HttpParserUpgrade):
                    parse.parser.feed_data(data)
                while parse.done:
                    seen = parse.done.pop(0)
                    self.requests.append(seen)
                    if await self.respond(seen, reader, writer):
                        return  # the responder took the connection over, or closed it
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            self.closed += 1
            writer.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    up.server = await asyncio.start_server(up.serve, "127.0.0.1", 0)
    yield up
    up.server.close()
    for writer in up.writers:
        writer.close()
    await up.server.wait_closed()


# -- clients -------------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    fields: list[tuple[bytes, bytes]]
    body: bytes
    raw_status: int = 0

    def header(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.fields if n.lower() == name]
        return values[0] if values else None


class _ResponseParse:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[Response] = []
        self.fields: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.head_only = False
        self.head_seen = False

    def on_message_begin(self) -> None:
        self.fields, self.body, self.head_seen = [], [], False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_seen = True
        status = self.parser.get_status_code()
        if self.head_only and status >= 200:
            self.done.append(Response(status, self.fields, b""))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.head_only:
            status = self.parser.get_status_code()
            self.done.append(Response(status, self.fields, b"".join(self.body)))


class Client:
    """A raw client connection: exact bytes out, responses parsed back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parse = _ResponseParse()

    @classmethod
    async def open(cls, port: int) -> Client:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, head_only: bool = False, within: float = 3.0) -> Response:
        if head_only:
            self.parse = _ResponseParse()
            self.parse.head_only = True
        async with asyncio.timeout(within):
            while not self.parse.done:
                data = await self.reader.read(65536)
                if not data:
                    raise EOFError("connection closed before a complete response")
                self.parse.parser.feed_data(data)
        return self.parse.done.pop(0)

    async def closed(self, within: float = 3.0) -> bool:
        """True when the proxy closes the connection (EOF) with nothing more sent."""
        async with asyncio.timeout(within):
            try:
                return await self.reader.read(65536) == b""
            except ConnectionResetError:
                return True

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[int], Awaitable[Client]]]:
    opened: list[Client] = []

    async def open_client(port: int) -> Client:
        client = await Client.open(port)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


def get(path: str = "/", host: str = "svc", extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (path.encode(), host.encode(), extra)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.wait_for(asyncio.to_thread(fn), 5)


# -- keep-alive, framing, streaming --------------------------------------------------------


async def test_keep_alive_requests_share_one_upstream_connection(
    engine_proxy: Any, upstream: Upstream
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)

    def five_requests() -> list[tuple[int, bytes]]:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        try:
            results = []
            for i in range(5):
                conn.request("POST", f"/n/{i}", body=b"x" * i, headers={"Host": "svc"})
                reply = conn.getresponse()
                results.append((reply.status, reply.read()))
            return results
        finally:
            conn.close()

    results = await in_thread(five_requests)
    assert results == [(200, b"POST /n/%d %d" % (i, i)) for i in range(5)]
    assert upstream.connections == 1
    assert [r.target for r in upstream.requests] == [b"/n/%d" % i for i in range(5)]


@pytest.mark.parametrize("waits", [False, True], ids=["routed-at-once", "routing-waits"])
async def test_requests_are_relayed_whether_routing_waits_or_not(
    engine_proxy: Any, upstream: Upstream, clients: Any, waits: bool
) -> None:
    """Routing that answers at once is used inside the parser's callbacks (no task turn);
    routing that must wait goes through the task. Both relay the same, errors included."""
    proxy = await engine_proxy(serve_h1, None, waits=waits)
    client = await clients(proxy.port)
    host = f"{upstream.addr[0]}:{upstream.addr[1]}"
    chunked = b"POST /2 HTTP/1.1\r\nHost: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (
        host.encode()
    )
    await client.send(get("/1", host) + chunked + b"3\r\nabc\r\n0\r\n\r\n" + get("/3", host))
    replies = [await client.response() for _ in range(3)]
    assert [r.body for r in replies] == [b"GET /1 0", b"POST /2 3", b"GET /3 0"]
    await client.send(b"GET /nowhere HTTP/1.1\r\n\r\n")  # no Host: a route error
    reply = await client.response()
    assert (reply.status, reply.header(b"meshlet-proxy-error")) == (400, b"no authority")
    await client.send(get("/5", host))
    assert (await client.response()).body == b"GET /5 0"
    assert proxy.routes == [host, host, host, None, host]  # each request routed once
    assert proxy.awaited == (5 if waits else 0)
    assert upstream.connections == 1


async def test_hop_by_hop_and_internal_headers_are_not_forwarded(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(
        serve_h1, upstream.addr, add_headers=((b"meshlet-client-id", b"web.default"),)
    )
    client = await clients(proxy.port)
    await client.send(
        b"GET /h HTTP/1.1\r\nHost: svc\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTE: trailers, deflate\r\n"
        b"Trailer: X-T\r\nmeshlet-client-id: forged\r\nmeshlet-proxy-error: forged\r\n"
        b"l5d-dst-canonical: forged\r\nX-Kept: yes\r\n\r\n"
    )
    assert (await client.response()).status == 200
    (seen,) = upstream.requests
    names = {n.lower() for n, _ in seen.fields}
    assert names == {b"host", b"x-kept", b"te", b"meshlet-client-id"}
    assert seen.header(b"te") == [b"trailers"]
    assert seen.header(b"meshlet-client-id") == [b"web.default"]


async def test_chunked_request_body_is_streamed_not_buffered(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    piece = bytes(range(256)) * 256  # 64 KiB
    await client.send(b"POST /up HTTP/1.1\r\nHost: svc\r\nTransfer-Encoding: chunked\r\n\r\n")
    await client.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    # The upstream sees the body while the client has sent 64 KiB of its 4 MiB.
    async with asyncio.timeout(3):
        await upstream.body_started.wait()
    for _ in range(63):
        await client.send(b"%x\r\n%s\r\n" % (len(piece), piece))
    await client.send(b"0\r\n\r\n")
    reply = await client.response()
    assert reply.body == b"POST /up %d" % (64 * len(piece))
    assert upstream.requests[0].body == piece * 64
    assert upstream.requests[0].header(b"transfer-encoding") == [b"chunked"]


async def test_chunked_response_is_streamed_to_the_client(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    piece = b"z" * 65536
    first_seen = asyncio.Event()

    async def stream(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await w.drain()
        async with asyncio.timeout(3):
            await first_seen.wait()  # only after the client got the first piece
        for _ in range(63):
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
        w.write(b"0\r\nX-Checksum: done\r\n\r\n")

    upstream.respond = stream
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(get("/down"))
    got = b""
    async with asyncio.timeout(3):
        while len(got) < 65536:
            got += await client.reader.read(65536)
    first_seen.set()
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    client.parse.parser.feed_data(got)
    reply = await client.response()
    assert reply.header(b"transfer-encoding") == b"chunked"
    assert reply.body == piece * 64
    assert reply.header(b"x-checksum") == b"done"  # the trailer is relayed


async def test_content_length_bodies_both_ways(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def echo(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n" % len(seen.body))
        w.write(seen.body)

    upstream.respond = echo
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    body = b"0123456789abcdef" * 131072  # 2 MiB
    await client.send(b"PUT /echo HTTP/1.1\r\nHost: svc\r\nContent-Length: %d\r\n\r\n" % len(body))
    await client.send(body)
    reply = await client.response()
    assert (reply.status, reply.header(b"content-length")) == (201, b"%d" % len(body))
    assert reply.body == body


async def test_expect_100_continue_is_relayed_before_the_body(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(
        b"POST /e HTTP/1.1\r\nHost: svc\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    )
    async with asyncio.timeout(3):
        interim = await client.reader.readuntil(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    await client.send(b"hello")
    reply = await client.response()
    assert (reply.status, reply.body) == (200, b"POST /e 5")
    assert upstream.requests[0].header(b"expect") == [b"100-continue"]


async def test_curl_gets_a_chunked_watch_that_is_quiet_for_longer_than_the_idle_timeout(
    engine_proxy: Any, upstream: Upstream
) -> None:
    """A watch, a long poll, `logs -f`: the head and a first event, then nothing for five
    times the connection idle timeout (shortened here: nothing else times a request), then
    the last event. curl, a client nobody here wrote, gets it whole."""

    async def watch(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
        await w.drain()
        await asyncio.sleep(1.0)
        w.write(b"5\r\nlast\n\r\n0\r\n\r\n")
        await w.drain()
        return False

    upstream.respond = watch
    proxy = await engine_proxy(serve_h1, upstream.addr, limits=HttpLimits(idle_timeout=0.2))
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", f"http://127.0.0.1:{proxy.port}/watch",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await curl.communicate()
    assert curl.returncode == 0, err
    assert out == b"first\nlast\n"


async def test_websocket_upgrade_relays_opaque_bytes_after_101(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def websocket(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        assert seen.header(b"upgrade") == [b"websocket"]
        w.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: abc\r\n\r\nserver-first"
        )
        while data := await r.read(1024):  # echo, upper-cased
            w.write(data.upper())
            await w.drain()
        return True

    upstream.respond = websocket
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(
        b"GET /ws HTTP/1.1\r\nHost: svc\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Key: k\r\n\r\n"
    )
    async with asyncio.timeout(3):
        head = await client.reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ")
        assert b"Upgrade: websocket" in head and b"Sec-WebSocket-Accept: abc" in head
        assert await client.reader.readexactly(12) == b"server-first"
        frame = b"\x81\x05hello GET / HTTP/1.1\r\n\r\n"  # not parsed as HTTP
        await client.send(frame)
        assert await client.reader.readexactly(len(frame)) == frame.upper()
    client.writer.write_eof()
    assert await client.closed()


async def test_connection_close_is_honoured(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(get("/bye", extra=b"Connection: close\r\n"))
    reply = await client.response()
    assert reply.status == 200
    assert reply.header(b"connection") == b"close"
    assert await client.closed()
    assert upstream.requests[0].header(b"connection") == []


async def test_pipelined_requests_are_answered_in_order(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(
        get("/1") + b"POST /2 HTTP/1.1\r\nHost: svc\r\nContent-Length: 3\r\n\r\nabc" + get("/3")
    )
    replies = [await client.response() for _ in range(3)]
    assert [r.body for r in replies] == [b"GET /1 0", b"POST /2 3", b"GET /3 0"]
    assert upstream.connections == 1


async def test_pipelined_body_arriving_later_is_relayed_after_the_first_response(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def slow_first(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if seen.target == b"/slow":
            await asyncio.sleep(0.1)
        await plain(seen, r, w)

    upstream.respond = slow_first
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(
        get("/slow") + b"POST /2 HTTP/1.1\r\nHost: svc\r\nContent-Length: 10\r\n\r\n01234"
    )
    await asyncio.sleep(0.02)
    await client.send(b"56789")
    assert (await client.response()).body == b"GET /slow 0"
    assert (await client.response()).body == b"POST /2 10"
    assert upstream.requests[1].body == b"0123456789"


async def test_bad_request_pipelined_after_a_good_one(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(get("/ok") + b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n")
    assert (await client.response()).body == b"GET /ok 0"
    reply = await client.response()
    assert (reply.status, reply.header(b"connection")) == (400, b"close")
    assert await client.closed()
    assert [r.target for r in upstream.requests] == [b"/ok"]


async def test_http10_client_gets_a_close_delimited_body(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def chunked(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")

    upstream.respond = chunked
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(b"GET /old HTTP/1.0\r\nHost: svc\r\n\r\n")
    async with asyncio.timeout(3):
        raw = await client.reader.read()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding" not in head and b"Connection: close" in head
    assert body == b"abc"


async def test_head_response_has_no_body_and_keeps_the_connection(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(b"HEAD /x HTTP/1.1\r\nHost: svc\r\n\r\n")
    reply = await client.response(head_only=True)
    assert (reply.status, reply.header(b"content-length")) == (200, b"9")
    client.parse = _ResponseParse()
    await client.send(get("/y"))
    assert (await client.response()).body == b"GET /y 0"
    assert upstream.connections == 1


# -- routing and upstream failures ---------------------------------------------------------


async def test_absolute_form_target_routes_by_its_authority(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, None)
    client = await clients(proxy.port)
    host, port = upstream.addr
    await client.send(
        b"GET http://%s:%d/p?q=1 HTTP/1.1\r\nHost: other\r\n\r\n" % (host.encode(), port)
    )
    assert (await client.response()).body == b"GET /p?q=1 0"
    assert proxy.routes == [f"{host}:{port}"]
    assert upstream.requests[0].header(b"host") == [b"%s:%d" % (host.encode(), port)]


async def test_route_error_is_answered_locally_and_keeps_the_connection(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, None)
    client = await clients(proxy.port)
    await client.send(b"GET /nowhere HTTP/1.1\r\n\r\n")  # no Host: no authority
    reply = await client.response()
    assert reply.status == 400
    assert reply.header(b"meshlet-proxy-error") == b"no authority"
    assert reply.header(b"connection") is None
    host, port = upstream.addr
    await client.send(get("/then", host=f"{host}:{port}"))
    assert (await client.response()).body == b"GET /then 0"
    assert proxy.routes == [None, f"{host}:{port}"]


async def test_route_error_drains_a_small_body_and_keeps_the_connection(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, None)
    client = await clients(proxy.port)
    await client.send(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n01234")
    reply = await client.response()
    assert (reply.status, reply.header(b"connection")) == (400, None)
    host, port = upstream.addr
    await client.send(b"56789" + get("/after", host=f"{host}:{port}"))
    assert (await client.response()).body == b"GET /after 0"
    assert [r.target for r in upstream.requests] == [b"/after"]


async def test_route_error_with_an_unsent_body_closes_the_connection(
    engine_proxy: Any, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, None)
    client = await clients(proxy.port)
    await client.send(b"PUT / HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    reply = await client.response()
    assert (reply.status, reply.header(b"connection")) == (400, b"close")
    assert await client.closed()  # the body never sent cannot be told from a next request


async def test_refused_upstream_is_502_with_the_reason(engine_proxy: Any, clients: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    proxy = await engine_proxy(serve_h1, ("127.0.0.1", closed_port))
    client = await clients(proxy.port)
    await client.send(get("/"))
    reply = await client.response()
    assert reply.status == 502
    error = reply.header(b"meshlet-proxy-error")
    assert error is not None and b"connecting to 127.0.0.1:%d failed" % closed_port in error
    await client.send(get("/"))  # the client connection is still served
    assert (await client.response()).status == 502


async def test_connect_timeout_is_504(engine_proxy: Any, clients: Any) -> None:
    with hanging_port() as port:
        limits = HttpLimits(connect_timeout=0.2)
        proxy = await engine_proxy(serve_h1, ("127.0.0.1", port), limits=limits)
        client = await clients(proxy.port)
        await client.send(get("/"))
        reply = await client.response()
    assert reply.status == 504
    assert reply.header(b"meshlet-proxy-error") == (
        b"connecting to 127.0.0.1:%d timed out after 0.2s" % port
    )


async def test_upstream_closing_an_idle_connection_costs_no_error(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def then_close(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        await plain(seen, r, w)
        await w.drain()
        return True  # closes its keep-alive connection right after the response

    upstream.respond = then_close
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    for i in range(3):
        await client.send(get(f"/{i}"))
        assert (await client.response()).status == 200
        await asyncio.sleep(0.05)
    assert upstream.connections == 3


async def test_stale_pooled_connection_is_retried_on_a_fresh_one(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    # The upstream answers once per connection, then drops the connection when the next
    # request arrives on it (the keep-alive race): the proxy must retry, the client see 200.
    served: set[int] = set()

    async def once(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if id(w) in served:
            w.transport.abort()
            return True
        served.add(id(w))
        await plain(seen, r, w)
        return False

    upstream.respond = once
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    await client.send(get("/first"))
    assert (await client.response()).status == 200
    await client.send(b"POST /second HTTP/1.1\r\nHost: svc\r\nContent-Length: 4\r\n\r\nbody")
    reply = await client.response()
    assert (reply.status, reply.body) == (200, b"POST /second 4")
    assert upstream.connections == 2
    assert [r.target for r in upstream.requests] == [b"/first", b"/second", b"/second"]
    assert upstream.requests[2].body == b"body"
    registry = proxy.metrics.registry
    assert (
        registry.get_sample_value(
            "http_client_errors_total", {"direction": "outbound", "status_code": "502"}
        )
        is None
    )


async def test_upstream_dying_mid_response_aborts_the_client(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def cut(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        if seen.target == b"/length":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"a" * 10)
        else:
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n")
        await w.drain()
        w.transport.abort()
        return True

    upstream.respond = cut
    proxy = await engine_proxy(serve_h1, upstream.addr)

    def fetch(path: str) -> BaseException | None:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        try:
            conn.request("GET", path, headers={"Host": "svc"})
            reply = conn.getresponse()
            reply.read()
        except (http.client.IncompleteRead, ConnectionError) as exc:
            return exc
        finally:
            conn.close()
        return None

    assert isinstance(
        await in_thread(lambda: fetch("/length")), (http.client.IncompleteRead, ConnectionError)
    )
    assert isinstance(
        await in_thread(lambda: fetch("/chunked")), (http.client.IncompleteRead, ConnectionError)
    )


async def test_tls_is_terminated_on_accept(
    engine_proxy: Any, upstream: Upstream, tmp_path: Path
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "web.test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("web.test")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_context = ssl.create_default_context(cadata=pem.decode())
    proxy = await engine_proxy(serve_h1, upstream.addr, ssl=server)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", proxy.port, ssl=client_context, server_hostname="web.test"
    )
    client = Client(reader, writer)
    try:
        for path in ("/a", "/b"):
            await client.send(get(path))
            assert (await client.response()).body == b"GET %s 0" % path.encode()
    finally:
        client.close()
    assert upstream.connections == 1


# -- timeouts, shutdown, pool -------------------------------------------------------------


async def test_idle_keep_alive_connection_is_closed(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr, limits=HttpLimits(idle_timeout=0.3))
    client = await clients(proxy.port)
    await client.send(get("/"))
    assert (await client.response()).status == 200
    start = asyncio.get_running_loop().time()
    assert await client.closed(within=2)
    assert 0.2 < asyncio.get_running_loop().time() - start < 1.5


async def test_pool_closes_upstream_connections_idle_too_long(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    proxy = await engine_proxy(serve_h1, upstream.addr, limits=HttpLimits(pool_idle_timeout=0.2))
    client = await clients(proxy.port)
    await client.send(get("/"))
    assert (await client.response()).status == 200
    assert upstream.closed == 0
    await eventually(lambda: upstream.closed == 1)  # the proxy closed its idle connection
    await client.send(get("/"))
    assert (await client.response()).status == 200
    assert upstream.connections == 2


async def test_shutdown_finishes_the_request_in_flight_then_closes(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    release, arrived = asyncio.Event(), asyncio.Event()
    release.set()

    async def gated(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        arrived.set()
        await release.wait()
        await plain(seen, r, w)

    upstream.respond = gated
    proxy = await engine_proxy(serve_h1, upstream.addr)
    idle, busy = await clients(proxy.port), await clients(proxy.port)
    await idle.send(get("/idle"))
    assert (await idle.response()).status == 200
    release.clear()
    arrived.clear()
    await busy.send(get("/busy"))
    async with asyncio.timeout(3):
        await arrived.wait()
    proxy.closing.set()
    assert await idle.closed(within=1)  # an idle keep-alive connection closes at once
    release.set()
    reply = await busy.response()  # the request in flight is answered, then the connection closes
    assert reply.status == 200 and reply.header(b"connection") == b"close"
    assert await busy.closed(within=1)


async def test_metrics_count_requests_responses_and_local_errors(
    engine_proxy: Any, upstream: Upstream, clients: Any
) -> None:
    async def status(seen: Seen, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        code = int(seen.target[1:])
        w.write(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % code)

    upstream.respond = status
    proxy = await engine_proxy(serve_h1, upstream.addr)
    client = await clients(proxy.port)
    for path in ("/200", "/404", "/503", "/200"):
        await client.send(get(path))
        await client.response()
    await client.send(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    assert (await client.response()).status == 400

    registry = proxy.metrics.registry
    host, port = upstream.addr
    labels = {
        "direction": "outbound",
        "target_addr": f"127.0.0.1:{proxy.port}",
        "tls": "no_identity",
        "no_tls_reason": "not_provided_by_remote",
        "authority": f"{host}:{port}",
    }  # labels without a value (client_id, server_id, dst_*, grpc_status) are left out
    assert registry.get_sample_value("request_total", labels) == 4

    def responses(code: str, classification: str) -> float | None:
        values = {
            **labels,
            "status_code": code,
            "classification": classification,
        }
        return registry.get_sample_value("response_total", values)

    assert responses("200", "success") == 2
    assert responses("404", "success") == 1
    assert responses("503", "failure") == 1
    latency = {**labels, "status_code": "200", "classification": "success"}
    assert registry.get_sample_value("response_latency_ms_count", latency) == 2
    errors = {"direction": "outbound", "status_code": "400"}
    assert registry.get_sample_value("http_client_errors_total", errors) == 1
