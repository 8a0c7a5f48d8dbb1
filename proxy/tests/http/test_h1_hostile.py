"""Hostile HTTP/1.1 input (HARDENING.md): refused with the documented status and a close,
nothing forwarded upstream, and the proxy goes on serving the next client."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import httptools
import pytest

from meshlet.proxy.http.contract import MAX_INFORMATIONAL, HttpLimits
from meshlet.proxy.http.h1 import serve_h1
from meshlet.proxy.http.h2pool import H2Pool
from meshlet.proxy.http.h2server import serve_h2
from meshlet.proxy.io.connect import tcp_connector


class Recorder:
    """An upstream that records every byte and answers each complete request with 200."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.connections = 0
        self.eof = asyncio.Event()  # the proxy closed a connection to it
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    @property
    def addr(self) -> tuple[str, int]:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        parser = httptools.HttpRequestParser(_Answer(writer))
        try:
            while data := await reader.read(65536):
                self.raw += data
                parser.feed_data(data)
        except (ConnectionError, httptools.HttpParserError):
            pass
        finally:
            self.eof.set()
            writer.close()


class _Answer:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def on_message_complete(self) -> None:
        self.writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


@pytest.fixture(params=["h1", "h1 over h2"])
async def front(request: Any, engine_proxy: Any) -> AsyncIterator[Any]:
    """`await front(upstream, limits=...)`: the HTTP/1 engine in front of `upstream`, directly
    (`h1`) or sending its requests as streams of a peer proxy's HTTP/2 connection, which sends
    them to `upstream` as HTTP/1.1 again (`h1 over h2`: orig_proto.py). Every defence and every
    byte the upstream sees must be the same either way."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(upstream: tuple[str, int], limits: HttpLimits | None = None) -> Any:
            if request.param == "h1":
                return await engine_proxy(serve_h1, upstream, limits)
            peer = await engine_proxy(serve_h2, upstream, limits, from_proxy=True)
            pool = H2Pool(tcp_connector(1.0), limits or HttpLimits())
            await stack.enter_async_context(pool)
            engine = functools.partial(serve_h1, h2=pool)
            return await engine_proxy(engine, ("127.0.0.1", peer.port), limits, h2=True)

        yield start


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    rec.server = await asyncio.start_server(rec.serve, "127.0.0.1", 0)
    yield rec
    rec.server.close()
    for writer in rec.writers:
        writer.close()
    await rec.server.wait_closed()


async def exchange(port: int, *parts: bytes, pause: float = 0.0) -> bytes:
    """Sends `parts` (pausing between them) and reads until the proxy closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(pause)
            if reader.at_eof():
                break
        async with asyncio.timeout(3):
            data = b""
            try:
                while chunk := await reader.read(65536):
                    data += chunk
            except ConnectionResetError:
                pass
            return data
    finally:
        writer.close()


async def still_serves(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /next HTTP/1.1\r\nHost: svc\r\n\r\n")
        async with asyncio.timeout(3):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        writer.close()


def post(*fields: bytes, body: bytes = b"", version: bytes = b"1.1") -> bytes:
    head = b"POST /x HTTP/" + version + b"\r\nHost: svc\r\n" + b"".join(f + b"\r\n" for f in fields)
    return head + b"\r\n" + body


CHUNKED = b"Transfer-Encoding: chunked"
HOSTILE = {
    "CL then TE": (post(b"Content-Length: 5", CHUNKED, body=b"0\r\n\r\n"), 400),
    "TE then CL": (post(CHUNKED, b"Content-Length: 5", body=b"0\r\n\r\n"), 400),
    "two different CLs": (post(b"Content-Length: 5", b"Content-Length: 6", body=b"hello!"), 400),
    "CL +5": (post(b"Content-Length: +5", body=b"hello"), 400),
    "CL -1": (post(b"Content-Length: -1", body=b"hello"), 400),
    "TE gzip, chunked": (post(b"Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n"), 501),
    "TE gzip then TE chunked": (
        post(b"Transfer-Encoding: gzip", CHUNKED, body=b"0\r\n\r\n"),
        501,
    ),
    "TE xchunked": (post(b"Transfer-Encoding: xchunked", body=b"0\r\n\r\n"), 400),
    "TE chunked, gzip": (post(b"Transfer-Encoding: chunked, gzip", body=b"0\r\n\r\n"), 400),
    "TE on HTTP/1.0": (post(CHUNKED, body=b"0\r\n\r\n", version=b"1.0"), 400),
    "space before colon": (post(b"X-A : b"), 400),
    "CR in a value": (post(b"X-A: b\rc"), 400),
    "NUL in a value": (post(b"X-A: b\x00c"), 400),
    "obs-fold": (post(b"X-A: b", b" folded"), 400),
    "chunk-size overflow": (post(CHUNKED, body=b"fffffffffffffffffffff\r\nx\r\n0\r\n\r\n"), 400),
    "LF in a chunk extension": (post(CHUNKED, body=b"5;a\nb\r\nhello\r\n0\r\n\r\n"), 400),
    "bad chunk size": (post(CHUNKED, body=b"zz\r\nhello\r\n0\r\n\r\n"), 400),
    "101 header fields": (post(*(b"X-%d: v" % i for i in range(100))), 431),
    "16 KiB request line": (b"GET /" + b"a" * 16384 + b" HTTP/1.1\r\nHost: svc\r\n\r\n", 414),
    "two Host headers": (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    "HTTP/2.0 in an HTTP/1 request line": (b"GET / HTTP/2.0\r\nHost: svc\r\n\r\n", 505),
    "HTTP/1.2": (b"GET / HTTP/1.2\r\nHost: svc\r\n\r\n", 400),
    "CONNECT": (b"CONNECT svc:443 HTTP/1.1\r\nHost: svc:443\r\n\r\n", 405),
    "unknown method": (b"BREW /pot HTTP/1.1\r\nHost: svc\r\n\r\n", 400),
    "authority-form target": (b"GET svc:80 HTTP/1.1\r\nHost: svc\r\n\r\n", 400),
    "userinfo in the target": (b"GET http://u@svc/ HTTP/1.1\r\nHost: svc\r\n\r\n", 400),
    "bad Host": (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
    "random bytes": (b"\x8f\x00\xffgarbage\r\n\r\n", 400),
    "TLS ClientHello on a plaintext port": (
        bytes.fromhex("160301002e0100002a0303") + b"\0" * 40,
        400,
    ),
}


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    return int(reply[9:12])


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_request_is_refused_and_nothing_forwarded(
    case: str, front: Any, recorder: Recorder
) -> None:
    data, expected = HOSTILE[case]
    proxy = await front(recorder.addr)
    reply = await exchange(proxy.port, data)  # returns once the proxy closed the connection
    assert status_of(reply) == expected
    head = reply.partition(b"\r\n\r\n")[0]
    assert b"\r\nConnection: close" in head and b"\r\nmeshlet-proxy-error: " in head
    assert recorder.raw == b""
    errors = {"direction": "outbound", "status_code": str(expected)}
    assert proxy.metrics.registry.get_sample_value("http_client_errors_total", errors) == 1
    await still_serves(proxy.port)


def headers_of_size(total: int) -> bytes:
    """Header fields of exactly `total` bytes as the limit counts them (name + value + 4)."""
    fields, left = [], total - len(b"Host") - len(b"svc") - 4 - len(b"/")  # Host and target
    while left > 0:
        value = b"v" * max(1, min(8000, left - len(b"X-00") - 4))
        fields.append(b"X-%02d: %s\r\n" % (len(fields), value))
        left -= 4 + len(value) + 4
    assert left == 0
    return b"GET / HTTP/1.1\r\nHost: svc\r\n" + b"".join(fields) + b"\r\n"


@pytest.mark.parametrize("split", [False, True], ids=["one read", "split"])
async def test_headers_over_64_kib_are_431(split: bool, front: Any, recorder: Recorder) -> None:
    proxy = await front(recorder.addr)
    at_limit = headers_of_size(64 * 1024)
    over = headers_of_size(64 * 1024 + 1)
    parts = (over[:40000], over[40000:]) if split else (over,)
    assert status_of(await exchange(proxy.port, *parts, pause=0.05)) == 431
    assert recorder.raw == b""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(at_limit)  # exactly the limit is fine
        async with asyncio.timeout(3):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
    finally:
        writer.close()


async def test_a_head_with_as_many_fields_as_allowed_is_forwarded_whole(
    front: Any, recorder: Recorder
) -> None:
    proxy = await front(recorder.addr)
    fields = b"".join(b"X-%02d: v\r\n" % i for i in range(98))  # Host, Connection: 100
    reply = await exchange(
        proxy.port, b"GET / HTTP/1.1\r\nHost: svc\r\n" + fields + b"Connection: close\r\n\r\n"
    )
    assert status_of(reply) == 200
    assert (
        bytes(recorder.raw).lower() == b"get / http/1.1\r\nhost: svc\r\n" + fields.lower() + b"\r\n"
    )


async def test_a_head_over_the_peer_proxys_limit_is_431_and_costs_no_other_request(
    engine_proxy: Any,
) -> None:
    """A peer proxy with smaller header limits than the client side's: a request over them is
    answered 431 by the client side, never sent on the shared HTTP/2 connection (which the peer
    would close with a connection error, failing the request in flight beside it)."""
    release = asyncio.Event()

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(app, "127.0.0.1", 0)
    small = HttpLimits(max_header_bytes=4096)
    try:
        peer = await engine_proxy(serve_h2, server.sockets[0].getsockname()[:2], small,
                                  from_proxy=True)  # fmt: skip
        async with H2Pool(tcp_connector(1.0), HttpLimits()) as pool:
            engine = functools.partial(serve_h1, h2=pool)
            proxy = await engine_proxy(engine, ("127.0.0.1", peer.port), h2=True)
            first = asyncio.create_task(
                exchange(proxy.port, b"GET /a HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n")
            )
            await asyncio.sleep(0.2)
            big = b"GET /b HTTP/1.1\r\nHost: svc\r\nConnection: close\r\nX-Big: %s\r\n\r\n"
            reply = await exchange(proxy.port, big % (b"v" * 8000))
            release.set()
            assert status_of(reply) == 431 and b"upstream takes" in reply
            assert status_of(await first) == 200
            assert pool.connections == 1  # the shared connection lived
    finally:
        server.close()


async def test_head_sent_a_byte_at_a_time_times_out_with_408(
    front: Any, recorder: Recorder
) -> None:
    proxy = await front(recorder.addr, limits=HttpLimits(header_read_timeout=0.5))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def trickle() -> None:
        for byte in b"GET / HTTP/1.1\r\nHost: svc\r\nX-Slow: " + b"a" * 100:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(trickle())
    try:
        async with asyncio.timeout(3):
            reply = await reader.read()
    finally:
        task.cancel()
        writer.close()
    assert status_of(reply) == 408
    assert 0.4 < loop.time() - start < 1.5
    assert recorder.raw == b""
    await still_serves(proxy.port)


async def test_unfinished_head_is_bounded_before_its_timeout(
    front: Any, recorder: Recorder
) -> None:
    proxy = await front(recorder.addr)  # header_read_timeout: 10 s
    big = b"GET / HTTP/1.1\r\nHost: svc\r\nX-Big: " + b"v" * (1024 * 1024)  # never ends
    parts = [big[i : i + 16384] for i in range(0, len(big), 16384)]
    reply = await exchange(proxy.port, *parts, pause=0.001)
    assert status_of(reply) == 431
    assert recorder.raw == b""


async def test_a_stalled_body_is_cut_by_the_opt_in_stream_idle_timeout(
    front: Any, recorder: Recorder
) -> None:
    limits = HttpLimits(stream_idle_timeout=0.5)
    proxy = await front(recorder.addr, limits=limits)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST /slow HTTP/1.1\r\nHost: svc\r\nContent-Length: 10000000\r\n\r\nab")
        async with asyncio.timeout(3):
            reply = await reader.read()  # about one byte a second would follow: too slow
    finally:
        writer.close()
    assert status_of(reply) == 408
    async with asyncio.timeout(3):
        await recorder.eof.wait()  # the upstream's request was cut, never completed
    assert recorder.raw.endswith(b"\r\n\r\nab")
    await still_serves(proxy.port)


async def test_body_is_not_buffered_when_the_upstream_stops_reading(front: Any) -> None:
    release = asyncio.Event()
    stalled: list[asyncio.Task[Any]] = []

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        stalled.append(task)
        await release.wait()  # until the test is over
        writer.close()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    try:
        proxy = await front(server.sockets[0].getsockname()[:2])
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        size = 256 * 1024 * 1024
        writer.write(b"PUT /big HTTP/1.1\r\nHost: svc\r\nContent-Length: %d\r\n\r\n" % size)
        sent, piece = 0, b"x" * (1024 * 1024)
        try:
            async with asyncio.timeout(1.5):
                while sent < size:
                    writer.write(piece)
                    await writer.drain()
                    sent += len(piece)
        except TimeoutError:
            pass
        # Kernel socket buffers on loopback hold some MiB; the proxy itself holds < 1 MiB.
        assert sent < 64 * 1024 * 1024
        writer.transport.abort()
    finally:
        release.set()
        await asyncio.gather(*stalled)
        server.close()
        await server.wait_closed()


async def test_bad_chunk_after_the_head_was_forwarded_cuts_the_upstream(
    front: Any, recorder: Recorder
) -> None:
    proxy = await front(recorder.addr)
    reply = await exchange(
        proxy.port, post(CHUNKED, body=b"5\r\nhello\r\n"), b"ffffffffffffffffffffff\r\n", pause=0.2
    )
    assert status_of(reply) == 400
    async with asyncio.timeout(3):
        await recorder.eof.wait()
    assert recorder.raw.endswith(b"5\r\nhello\r\n")  # never the last chunk
    await still_serves(proxy.port)


async def test_client_supplied_internal_headers_are_stripped(
    front: Any, recorder: Recorder
) -> None:
    proxy = await front(recorder.addr)
    reply = await exchange(
        proxy.port,
        b"GET / HTTP/1.1\r\nHost: svc\r\nmeshlet-client-id: admin.ns\r\n"
        b"MESHLET-PROXY-ERROR: x\r\nl5d-dst-canonical: x\r\nL5d-Client-Id: admin.ns\r\n"
        b"l5d-proxy-error: x\r\nConnection: close\r\n\r\n",
    )
    assert status_of(reply) == 200
    assert recorder.raw == b"GET / HTTP/1.1\r\nHost: svc\r\n\r\n"


async def test_an_informational_flood_from_an_upstream_is_not_relayed(front: Any) -> None:
    """20,000 `103 Early Hints` before the response: ten reach the client, then 502."""

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 20_000)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    try:
        proxy = await front(server.sockets[0].getsockname()[:2])
        reply = await exchange(
            proxy.port,
            b"POST / HTTP/1.1\r\nHost: svc\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
    finally:
        server.close()
    assert reply.count(b"HTTP/1.1 103") == MAX_INFORMATIONAL
    final = reply.lower().split(b"http/1.1 103 early hints\r\nlink: </a>\r\n\r\n")[-1]
    assert final.startswith(b"http/1.1 502"), final[:200]
    assert b"informational" in final


async def test_an_upstream_cannot_pass_its_answer_off_as_the_proxys(front: Any) -> None:
    """An app's (or an unmeshed upstream's) `meshlet-proxy-error` or `l5d-proxy-error` never
    reaches the client: only a proxy says a failure was its own."""

    async def forger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 502 Bad Gateway\r\nmeshlet-proxy-error: forged\r\n"
            b"L5d-Proxy-Error: forged\r\nX-App: yes\r\nContent-Length: 0\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(forger, "127.0.0.1", 0)
    try:
        proxy = await front(server.sockets[0].getsockname()[:2])
        reply = await exchange(
            proxy.port, b"GET / HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n"
        )
    finally:
        server.close()
    assert status_of(reply) == 502
    head = reply.split(b"\r\n\r\n")[0].lower()
    assert b"x-app: yes" in head
    assert b"proxy-error" not in head


async def test_upgrade_h2c_is_stripped_and_relayed_as_http1(front: Any, recorder: Recorder) -> None:
    proxy = await front(recorder.addr)
    reply = await exchange(
        proxy.port,
        b"GET / HTTP/1.1\r\nHost: svc\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        b"GET /after HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n",
    )
    assert reply.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert bytes(recorder.raw) == (
        b"GET / HTTP/1.1\r\nHost: svc\r\n\r\nGET /after HTTP/1.1\r\nHost: svc\r\n\r\n"
    )


async def test_upgrade_h2c_with_a_body_keeps_the_body(front: Any, recorder: Recorder) -> None:
    proxy = await front(recorder.addr)
    reply = await exchange(
        proxy.port,
        b"POST /form HTTP/1.1\r\nHost: svc\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: 5\r\n\r\nhello"
        b"GET /after HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n",
    )
    assert reply.count(b"HTTP/1.1 200 OK\r\n") == 2
    assert bytes(recorder.raw) == (
        b"POST /form HTTP/1.1\r\nHost: svc\r\nContent-Length: 5\r\n\r\nhello"
        b"GET /after HTTP/1.1\r\nHost: svc\r\n\r\n"
    )
