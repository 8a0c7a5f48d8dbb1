"""HTTP/1.1 between meshed proxies as streams of one HTTP/2 connection (Linkerd's
`l5d-orig-proto`; here `meshlet-orig-proto`).

When the destination says an endpoint's proxy takes HTTP/2 (its protocol hint), the client
proxy's HTTP/1 engine sends each HTTP/1.1 request for it as a stream on a pooled, multiplexed
mTLS HTTP/2 connection to that proxy, marked `meshlet-orig-proto: HTTP/1.1` (`Upgrade`): no
connection per request in flight, no TLS handshake per connection. The server proxy reads the
mark only on a mesh session (it is stripped from anyone else's request, as every header only
proxies speak) and sends the request to the app as HTTP/1.1 on a pooled keep-alive connection
(`Downgrade`); the app's response goes back the same way. Requests HTTP/2 cannot carry as they
are stay HTTP/1.1 end to end: HTTP/1.0, and protocol upgrades (WebSocket); CONNECT is refused
before either.

What the app sees, against the same request sent as HTTP/1.1 all the way: the same request line
(origin-form target), `Host` right after it, the other fields in their order with the values the
client sent, but every name in lower case (HTTP/2 has no case); the body framed as the client
framed it (its Content-Length, or chunked with its trailers). The client sees the app's status,
fields (names in lower case) and body; a body the app delimited by closing its connection
reaches the client chunked. A field name HTTP/1.1 cannot carry (HTTP/2 allows a few more
characters) or a value with a control character is answered 400 by the server proxy, before
anything goes to the app.

Both halves are adapters, and neither side's engine knows the other protocol: to the HTTP/1
engine an `Upgrade` is the upstream connection of one exchange (h1client.UpstreamConn) and to
the HTTP/2 connection it is a stream (h2client.H2Sink); to a `ProxyStream` a `Downgrade` is the
upstream connection its stream is on, and to the HTTP/1.1 connection the sink of its response
(h1client.ResponseSink).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

import httptools
from hpack import NeverIndexedHeaderTuple

from meshlet.proxy.http.attempts import Failed
from meshlet.proxy.http.contract import ORIG_PROTO_HEADER, Endpoint, HttpLimits, Wait
from meshlet.proxy.http.h1client import H1Upstream, ResponseSink
from meshlet.proxy.http.h1head import (
    Body,
    Rejection,
    RequestHead,
    h1_request_head,
    h2_response_fields,
    last_chunk,
)
from meshlet.proxy.http.h1pool import H1Pool, PoolKey
from meshlet.proxy.http.h2codec import ErrorCode, StreamClosed, error_name, header_list_size
from meshlet.proxy.http.h2conn import MAX_RTT
from meshlet.proxy.http.h2headers import (
    SENSITIVE_HEADERS,
    Header,
    Malformed,
    Request,
    Response,
    Trailers,
    read_response,
    read_trailers,
)
from meshlet.proxy.http.h2stream import Pipe
from meshlet.proxy.io.counters import TcpConn

if TYPE_CHECKING:
    from meshlet.proxy.http.h2client import H2Client
    from meshlet.proxy.http.h2server import H2Server
    from meshlet.proxy.http.h2stream import ProxyStream

log = logging.getLogger(__name__)

ORIG_PROTO: Final = (ORIG_PROTO_HEADER, b"HTTP/1.1")
# Fields of the head the engine writes that HTTP/2 carries otherwise: `Host` is the
# `:authority`, the framing is the stream's own.
_NOT_FIELDS: Final = frozenset({b"host", b"transfer-encoding"})
# RFC 9110 §5.6.2: an HTTP/1.1 field name is a token; HTTP/2 names may hold a few more bytes.
_TCHAR: Final = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# A field value's control characters (HTAB is allowed): HTTP/2 refuses only NUL, CR and LF.
_CONTROL: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_UNBOUNDED: Final = 1 << 30  # the window of an HTTP/1.1 connection: its transport pauses it


# -- the client side: an HTTP/1.1 exchange as an HTTP/2 stream -------------------------------


class Upgrade:
    """One HTTP/1.1 request sent as a stream of a peer proxy's HTTP/2 connection. The engine
    writes the request as it would to an HTTP/1.1 upstream; a parser reads it back, its framing
    undone, into the stream's HEADERS, DATA and trailers. Made with the request's head, which
    becomes the stream's HEADERS; the engine then writes the head again first (`begin`), which
    is skipped."""

    __slots__ = (
        "_authority",
        "_body",
        "_client",
        "_fields",
        "_full",
        "_got",
        "_headers",
        "_high",
        "_parser",
        "_path",
        "_paused",
        "_sink",
        "_skip_head",
        "_unacked",
        "closed",
        "ended",
        "refusal",
        "reused",
        "tcp",
        "transport",
        "up_id",
    )

    def __init__(self, head: RequestHead, limits: HttpLimits) -> None:
        self.closed = False
        self.up_id = 0
        self.reused = False  # set when the peer says it never processed the request
        self.transport: asyncio.Transport | None = None  # none of its own
        self.tcp = TcpConn.uncounted()  # the shared connection counts itself
        self.ended = False  # the whole response was given to the engine
        self.refusal: tuple[int, str] | None = None  # the connection would not send it
        self._client: H2Client | None = None
        self._sink: ResponseSink | None = None
        self._high = limits.max_body_buffer
        self._authority = head.authority
        self._path = b""
        self._fields: list[Header] = []
        self._headers: list[Header] = []
        self._body = Pipe()
        self._skip_head = False
        self._full = False  # the engine was told to stop writing the body
        self._got = False  # a response head came
        self._paused = False  # the engine's client is not reading: credit is held back
        self._unacked = 0
        self._parser = httptools.HttpRequestParser(self)
        self._parser.feed_data(head.head)

    # -- httptools callbacks: the request as the engine writes it ------------------------

    def on_url(self, url: bytes) -> None:
        self._path += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        fields, self._fields = self._fields, []  # what follows are the body's trailers
        headers: list[Header] = [(b":method", self._parser.get_method()), (b":scheme", b"http")]
        if self._authority is not None:
            headers.append((b":authority", self._authority.encode("latin-1")))
        headers.append((b":path", self._path))
        for field in fields:
            name = field[0]
            if name in SENSITIVE_HEADERS:  # kept out of the shared connection's HPACK table
                headers.append(NeverIndexedHeaderTuple(*field))
            elif name not in _NOT_FIELDS:
                headers.append(field)
        headers.append(ORIG_PROTO)
        self._headers = headers

    def on_body(self, body: bytes) -> None:
        self._body.push(body)

    def on_message_complete(self) -> None:
        body = self._body
        if self._fields:
            body.trailers = self._fields
        body.ended = True

    # -- h2client.H2Sink: the stream ------------------------------------------------------

    def head(self) -> tuple[Sequence[Header], bool, int]:
        body = self._body
        ended = body.ended and not body.chunks and body.trailers is None
        return self._headers, ended, header_list_size(self._headers)

    def attach(self, client: H2Client, up_id: int, headers_ended: bool) -> None:
        self._client = client
        self.up_id = up_id
        if headers_ended:
            self._body.done = True
        elif self._body.holding:
            self.pump_request()

    def refused(self, status: int, reason: str) -> None:
        self.refusal = (status, reason)
        self.closed = True

    def pump_request(self) -> None:
        client = self._client
        if client is None:
            return
        body = self._body
        was_done = body.done
        try:
            sent = body.give(client, self.up_id)
        except StreamClosed:
            return  # the stream is closed; its reset is on its way
        if sent:
            client.guard.data_sent(1 + sent // 16384)
        if sent or body.done != was_done:
            client.flush_soon()
        if body.holding:
            client.waiting[self.up_id] = self
        else:
            client.waiting.pop(self.up_id, None)
        if self._full and body.size <= self._high // 4:
            self._full = False
            if self._sink is not None:
                self._sink.upstream_resume_writing()

    def on_informational(self, response: Response) -> None:
        sink = self._sink
        if sink is not None:
            sink.response_informational(response.status, list(response.headers[1:]))
            sink.flush()

    def on_response(self, response: Response, end: bool) -> None:
        sink = self._sink
        if sink is None:
            return
        self._got = True
        body = sink.response_head(response.status, list(response.headers[1:]))
        if body is None:  # answered or sent again instead: this stream was let go
            sink.flush()
            return
        if end or body is Body.NONE:
            self._end(sink, [])
        sink.flush()

    def on_response_data(self, data: bytes, flow_len: int, end: bool) -> None:
        client = self._client
        if client is not None:
            if self._paused:
                self._unacked += flow_len
            elif client.h2.acknowledge(self.up_id, flow_len):
                client.flush_soon()
        sink = self._sink
        if sink is None or self.ended:
            return
        if data:
            sink.response_body(data)
        if end:
            self._end(sink, [])
        sink.flush()

    def on_response_trailers(self, trailers: Trailers) -> None:
        sink = self._sink
        if sink is not None and not self.ended:
            self._end(sink, list(trailers.headers))
            sink.flush()

    def on_up_reset(self, code: int, reason: str = "") -> None:
        why = reason or f"the peer proxy reset the stream ({error_name(code)})"
        self._failed(why, code == ErrorCode.REFUSED_STREAM)

    def up_gone(self, reason: str, unprocessed: bool) -> None:
        self._failed(reason, unprocessed)

    def _end(self, sink: ResponseSink, trailers: list[Header]) -> None:
        self.ended = True
        sink.response_end(trailers, True)  # the engine then closes this (`close`)

    def _failed(self, reason: str, unprocessed: bool) -> None:
        self._let_go(cancel=False)
        sink, self._sink = self._sink, None
        if sink is None or self.ended:
            return
        # Never processed (refused, or beyond a GOAWAY): the engine sends it again, as it
        # does a request whose pooled connection turned out stale.
        self.reused = unprocessed and not self._got
        sink.upstream_lost(ConnectionResetError(reason), self._got)
        sink.flush()

    # -- h1client.UpstreamConn: the exchange's upstream -----------------------------------

    def begin(self, sink: ResponseSink, head_only: bool) -> None:
        self._sink = sink
        self._skip_head = True

    def write(self, data: bytes) -> None:
        self.writelines((data,))

    def writelines(self, data: Sequence[bytes]) -> None:
        if self._skip_head:  # the head, already sent as HEADERS
            self._skip_head = False
            data = data[1:]
        if self.closed or not data:
            return
        parser = self._parser
        for piece in data:
            parser.feed_data(piece)
        self.pump_request()
        sink = self._sink
        if not self._full and self._body.size > self._high and sink is not None:
            self._full = True
            sink.upstream_pause_writing()

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        client = self._client
        if self._unacked and client is not None:
            unacked, self._unacked = self._unacked, 0
            if client.h2.acknowledge(self.up_id, unacked):
                client.flush_soon()

    def detach(self) -> None:
        self._sink = None

    def close(self) -> None:
        """The exchange is over: the stream is cancelled unless it ended both ways."""
        self._sink = None
        self._let_go(cancel=not (self.ended and self._body.done))

    def abort(self) -> None:
        self._sink = None
        self._let_go(cancel=True)

    def _let_go(self, cancel: bool) -> None:
        self.closed = True
        client, self._client = self._client, None
        if client is None:
            return
        if cancel:
            client.reset(self.up_id, ErrorCode.CANCEL)
        client.forget(self)  # (a reset is flushed by `reset`)
        if self._unacked:
            unacked, self._unacked = self._unacked, 0
            if client.h2.acknowledge(self.up_id, unacked):
                client.flush_soon()


# -- the server side: an HTTP/2 stream as an HTTP/1.1 exchange -------------------------------


def refusal(request: Request) -> Malformed | None:
    """Why a request marked `meshlet-orig-proto` cannot go to the app as HTTP/1.1 (None: it
    can): a field name that is not an HTTP/1.1 token, or a value with a control character."""
    for name, value in request.headers:
        if name[:1] == b":":
            continue
        if name.translate(None, _TCHAR):
            return Malformed(f"header name {name[:64]!r} is not valid in HTTP/1.1", answer=True)
        if _CONTROL.search(value) is not None:
            return Malformed(f"control character in header {name[:64]!r}", answer=True)
    return None


def downgrade(
    server: H2Server, pool: H1Pool, stream: ProxyStream, endpoint: Endpoint, fresh: bool
) -> Wait | None:
    """Sends `stream`'s request to `endpoint` as HTTP/1.1: at once on a pooled connection
    (None), else a Wait for a new one (whose result is None, sent, or why it failed)."""
    key = (endpoint.connect or server.conn.connect, endpoint.addr)
    upstream = None if fresh else pool.take(key)
    if upstream is not None:
        Downgrade(stream, pool, key, upstream).start()
        return None
    return Wait(_dial, (server, pool, stream, endpoint, key))


async def _dial(args: tuple[H2Server, H1Pool, ProxyStream, Endpoint, PoolKey]) -> Failed | None:
    server, pool, stream, endpoint, key = args
    upstream = await pool.dial(key, server.conn.limits, server.upstream_counts(endpoint))
    if isinstance(upstream, Failed):
        return upstream
    if stream.closed:
        pool.give(key, upstream)
        return None
    Downgrade(stream, pool, key, upstream).start()
    return None


class Downgrade:
    """The HTTP/1.1 connection one `ProxyStream`'s request goes on, presented to the stream as
    its upstream HTTP/2 connection: `h2` writes the request's body (chunked when it has no
    content-length), acknowledging response bytes lets the connection read on, a reset aborts
    it (the app sees the cancel). Its sink is the connection's response sink; the connection
    goes back to the pool when the exchange ended whole both ways."""

    __slots__ = (
        "_chunked",
        "_held",
        "_high",
        "_key",
        "_paused",
        "_pool",
        "_reusable",
        "_stream",
        "_upstream",
        "gone",
        "loop",
        "request_done",
        "response_done",
        "rtt",
        "waiting",
        "writable",
    )

    peer_max_frame: Final = _UNBOUNDED

    def __init__(self, stream: ProxyStream, pool: H1Pool, key: PoolKey, upstream: H1Upstream):
        self._stream = stream
        self._pool = pool
        self._key = key
        self._upstream = upstream
        self._chunked = False
        self._held = 0  # response bytes given to the stream and not yet acknowledged
        self._high = stream.server.conn.limits.max_body_buffer
        self._paused = False
        self._reusable = False
        self.loop = upstream.loop
        self.rtt = MAX_RTT
        self.writable = True
        self.waiting: dict[int, ProxyStream] = {}
        self.gone = False  # the stream let go of it
        self.request_done = False
        self.response_done = False

    @property
    def h2(self) -> Downgrade:
        return self

    @property
    def guard(self) -> Downgrade:
        return self

    def start(self) -> None:
        stream = self._stream
        request = stream.request
        _, end, _ = stream.head()
        self._chunked = not end and request.length < 0
        self.request_done = end
        added = len(stream.server.conn.add_headers)
        head = h1_request_head(request.method, request.path, request.authority,
                               request.headers, request.length, self._chunked, added)  # fmt: skip
        upstream = self._upstream
        upstream.begin(self, request.method == "HEAD")
        upstream.write(head)
        stream.attach(self, 1, end)

    # -- what the stream calls on its upstream connection ---------------------------------

    def window(self, stream_id: int) -> int:
        return _UNBOUNDED

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        upstream = self._upstream
        if not self._chunked:
            upstream.write(data)
        elif data:
            upstream.writelines((b"%x\r\n" % len(data), data, b"\r\n0\r\n\r\n" if end else b"\r\n"))
        elif end:
            upstream.write(b"0\r\n\r\n")
        self.request_done = end

    def send_headers(self, stream_id: int, headers: Iterable[Header], end: bool) -> None:
        """The request's trailers: HTTP/1.1 carries them only after a chunked body."""
        if self._chunked:
            self._upstream.write(last_chunk(list(headers)))
        self.request_done = True

    def end_stream(self, stream_id: int) -> None:
        if self._chunked:
            self._upstream.write(b"0\r\n\r\n")
        self.request_done = True

    def acknowledge(self, stream_id: int, n: int) -> None:
        self._held -= n
        if self._paused and self._held <= self._high // 4:
            self._paused = False
            self._upstream.resume_reading()

    def data_sent(self, frames: int) -> None:
        """The abuse guard's count: an HTTP/1.1 connection has none."""

    def flush_soon(self) -> None:
        """Writes go out as they are made."""

    def reset(self, stream_id: int, code: int) -> None:
        """The stream is cancelled: so is the exchange, by closing its connection."""
        if not self.gone:
            self.gone = True
            self._upstream.abort()

    def forget(self, stream: object) -> None:
        if self.gone:
            return
        self.gone = True
        upstream = self._upstream
        if self.response_done and self.request_done and self._reusable:
            upstream.detach()
            self._pool.give(self._key, upstream)
        else:
            upstream.abort()

    # -- h1client.ResponseSink: the app's response ----------------------------------------

    def response_informational(self, status: int, fields: list[Header]) -> None:
        converted = h2_response_fields(status, fields, False)
        if not isinstance(converted, Rejection) and status != 101:
            self._stream.on_informational(Response(converted[0], status, None))

    def response_head(self, status: int, fields: list[Header]) -> Body | None:
        stream = self._stream
        if status == 101:
            stream.malformed_response("the app switched protocols, unasked")
            return None
        converted = h2_response_fields(status, fields, stream.request.method == "HEAD")
        if isinstance(converted, Rejection):
            stream.malformed_response(converted.reason)
            return None
        headers, body = converted
        response = read_response(headers)
        if isinstance(response, Malformed):
            stream.malformed_response(response.reason)
            return None
        stream.on_response(response, False)  # its end comes with `response_end`
        return None if self.gone else body

    def response_body(self, data: bytes) -> None:
        self._held += len(data)
        if not self._paused and self._held > self._high:
            self._paused = True
            self._upstream.pause_reading()
        self._stream.on_response_data(data, len(data), False)

    def response_end(self, trailers: list[Header], reusable: bool) -> None:
        self.response_done = True
        self._reusable = reusable
        stream = self._stream
        if not trailers:
            stream.on_response_data(b"", 0, True)
            return
        read = read_trailers([(name.lower(), value) for name, value in trailers])
        if isinstance(read, Malformed):
            stream.malformed_response(read.reason)
        else:
            stream.on_response_trailers(read)

    def response_upgraded(self, rest: bytes) -> None:
        self._stream.malformed_response("the app switched protocols, unasked")

    def upstream_lost(self, exc: BaseException | None, got_bytes: bool) -> None:
        if self.gone:
            return
        why = f"the app's connection failed: {exc}" if exc else "the app closed the connection"
        # A pooled connection closed before a byte of the answer: stale, never processed.
        self._stream.up_gone(why, self._upstream.reused and not got_bytes)

    def upstream_pause_writing(self) -> None:
        self.writable = False

    def upstream_resume_writing(self) -> None:
        self.writable = True
        for stream in list(self.waiting.values()):
            stream.pump_request()

    def flush(self) -> None:
        """The stream's writes to its client are flushed by that connection."""
