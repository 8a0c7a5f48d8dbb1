"""The proxy's HTTP/1.1 engine: `serve_h1` serves one accepted connection.

Requests are parsed by httptools on an asyncio Protocol (`H1Server`), checked (`h1head`), routed
with `conn.route`, and relayed over a pooled upstream connection (`h1client`, `h1pool`): heads are
re-serialized without hop-by-hop fields, bodies are streamed piece by piece (chunked ones
re-framed) with back-pressure both ways, never buffered whole. Requests are handled one at a time:
a pipelined request waits, with reading paused, until the previous response has been sent.

Hostile input is answered locally with `Connection: close`, and nothing of it is forwarded:
  400  malformed syntax (llhttp), Content-Length with Transfer-Encoding, two or invalid lengths,
       Transfer-Encoding on HTTP/1.0 or not ending in one `chunked`, several Host headers, bad
       request targets, bad chunks (a bad chunk after the head was forwarded aborts that upstream
       connection, so the upstream never sees a complete request)
  414  a request target over 8 KiB
  431  header fields over `limits.max_header_bytes` (name + value + 4 per field, with the target)
       or over `limits.max_headers` fields, or a head still unfinished after that many bytes
       and 8 KiB more; 503 after MAX_PIPELINED requests parsed ahead of a response
  501  codings other than chunked (`Transfer-Encoding: gzip, chunked`)
  505  versions other than HTTP/1.0 and 1.1;  405 CONNECT
  408  a head not complete within `header_read_timeout`, or a request body that stalls for
       `idle_timeout`
After such an answer the connection is half-closed and the client's bytes are read and dropped
for up to LINGER_SECONDS, so that the answer is not lost to a reset. Route errors are answered
with their status and keep the connection when the rest of the body can be drained (up to
`limits.max_body_buffer`, no `Expect: 100-continue`). Metrics: `request_total` once routed (or
refused by the route), `response_total` and `response_latency_ms` (to the response head) per
response, `http_client_errors_total` for every answer the proxy makes itself.
Upstream failures are answered with `meshlet-proxy-error`: 502 when the connection is refused,
reset or closed before a response, or the response is invalid; 504 when connecting times out.
A reused pooled connection that fails before any response byte is retried once on a fresh
connection. A response cut short aborts the client connection (never a truncated body presented
as complete). Idle keep-alive connections close after `idle_timeout` without a byte either way
(not counted while waiting for the upstream's response head).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from typing import Any, Final, cast

import httptools

from meshlet.proxy.core.classify import classify
from meshlet.proxy.core.failover import Action, Attempt, Failure, decide
from meshlet.proxy.http.contract import (
    Endpoint,
    HttpConn,
    RequestTarget,
    RouteError,
    RouteTarget,
)
from meshlet.proxy.http.h1client import H1Upstream
from meshlet.proxy.http.h1head import (
    MAX_TARGET_BYTES,
    Body,
    Header,
    Rejection,
    RequestHead,
    ResponseHead,
    last_chunk,
    local_response,
    parse_request,
    parse_response,
)
from meshlet.proxy.http.h1pool import H1Pool, PoolKey
from meshlet.proxy.io import relay
from meshlet.proxy.metrics import Values

log = logging.getLogger(__name__)

MAX_PIPELINED: Final = 16  # complete requests parsed ahead of the one in flight
LINGER_SECONDS: Final = 2.0  # after refusing a request, its bytes are read and dropped this long
# Why reading from the client is paused, one bit each.
_UPSTREAM_FULL: Final = 1  # the upstream's write buffer is full
_BACKLOG: Final = 2  # body bytes wait for an upstream connection
_INBOX: Final = 4  # bytes of a next request wait for the current response

_perf = time.perf_counter


async def serve_h1(conn: HttpConn, pool: H1Pool | None = None) -> None:
    """Serves HTTP/1.1 on `conn.sock` (or `conn.handoff`) until the connection closes.

    Upstream connections come from `pool` (share one per listener to reuse them across client
    connections); without one, a pool private to this connection is used and closed with it."""
    loop = asyncio.get_running_loop()
    private = pool is None
    if pool is None:
        pool = H1Pool(conn.limits.pool_idle_timeout)
    server = H1Server(conn, pool)
    sock = cast(socket.socket, conn.sock)
    try:
        if conn.handoff is not None:
            conn.handoff.adopt(server)
        elif conn.ssl is None:
            await loop.connect_accepted_socket(lambda: server, sock=sock)
        else:
            await loop.connect_accepted_socket(
                lambda: server, sock=sock, ssl=conn.ssl,
                ssl_handshake_timeout=conn.limits.header_read_timeout,
            )  # fmt: skip
    except (OSError, TimeoutError) as exc:  # e.g. a failed TLS handshake; uvloop closed sock
        log.debug("HTTP/1 connection not established: %s", exc)
        return

    def closing(task: asyncio.Task[Any]) -> None:
        if not task.cancelled():
            server.shutdown()

    watch = loop.create_task(conn.closing.wait())
    watch.add_done_callback(closing)
    try:
        await server.run()
    finally:
        watch.cancel()
        server.abort()
        if private:
            pool.close()


class _Reject(Exception):
    """Raised in a parser callback: the request is answered `status` and the connection closed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Request:
    """One request: its checked head, its body's progress and its exchange with an upstream."""

    __slots__ = (
        "backlog",
        "backlog_size",
        "body_check_at",
        "body_mark",
        "body_received",
        "cancelled",
        "complete",
        "discard",
        "endpoint",
        "head",
        "key",
        "label",
        "reparse_body",
        "replay",
        "replay_size",
        "responded",
        "retried",
        "route",
        "t0",
        "upstream",
        "values",
    )

    def __init__(self, head: RequestHead) -> None:
        self.head = head
        self.complete = False  # the whole request was read from the client
        self.responded = False  # the whole response was written to the client
        self.cancelled = False
        self.discard = False  # answered locally: the rest of the body is read and dropped
        self.reparse_body = False  # llhttp skipped this body (h2c upgrade): parsed again
        self.backlog: list[bytes] = []  # body bytes (framed) waiting for an upstream
        self.backlog_size = 0
        self.replay: list[bytes] | None = None  # body sent on a reused connection, for a retry
        self.replay_size = 0
        self.retried = False
        self.endpoint: Endpoint | None = None
        self.route: RouteTarget | None = None
        self.key: PoolKey | None = None
        self.upstream: H1Upstream | None = None
        self.label = ""
        self.values: Values | None = None  # metric labels when not the connection's
        self.t0 = 0.0
        # The minimum body rate: bytes of body read, at the last check, and the next check.
        self.body_received = 0
        self.body_mark = 0
        self.body_check_at = 0.0


def _release(req: _Request) -> None:
    """Tells the balancer the request is over (a no-op without a lease, or when repeated)."""
    if req.endpoint is not None and req.endpoint.lease is not None:
        req.endpoint.lease.release()


def _ignore(_: int) -> None:
    pass  # tcp_* byte counts are the caller's concern


class H1Server(asyncio.Protocol):
    """The client side of one connection: parses requests, writes responses, owns timers.

    Parser callbacks and upstream callbacks are synchronous; the only awaits (routing, connect)
    run in `run`, the task of `serve_h1`, one request at a time."""

    def __init__(self, conn: HttpConn, pool: H1Pool) -> None:
        self._conn = conn
        self._limits = conn.limits
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._labels = conn.labels.values()
        self._add_headers: tuple[Header, ...] = tuple(conn.add_headers)
        self._transport = cast(asyncio.Transport, None)  # set by connection_made
        self._parser: Any = httptools.HttpRequestParser(self)
        # The head being parsed.
        self._in_head = False
        self._url = b""
        self._fields: list[Header] = []
        self._head_size = 0  # as counted: target, then name + value + 4 per field
        self._head_raw = 0  # bytes read while the head stays unfinished
        # Requests: the one whose body is being parsed, the one in flight, those parsed ahead.
        self._req: _Request | None = None
        self._last: _Request | None = None  # the last request whose head was parsed
        self._cur: _Request | None = None
        self._queue: collections.deque[_Request] = collections.deque()
        self._inbox: list[bytes] = []  # bytes read while the request in flight is complete
        self._pending_reject: tuple[int, str] | None = None
        self._synthetic: _Request | None = None
        self._tunnel_req: _Request | None = None  # an upgrade: bytes relayed raw from now on
        self._resp: ResponseHead | None = None  # the response being relayed
        self._out: list[bytes] = []  # to the client, written at the end of each upstream read
        self._feeding = False
        self._dead = False  # no more parsing (error, or an upgrade)
        self._shut = False  # the transport was closed or handed off: no more writes
        self._lost = False
        self._closing = False  # shutdown: close after the response in flight
        self._close_after = False
        self._eof = False
        self._paused = 0
        self._write_paused = False
        self._events: collections.deque[_Request | asyncio.Future[None] | None]
        self._events = collections.deque()
        self._waiter: asyncio.Future[_Request | asyncio.Future[None] | None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._head_deadline: float | None = None
        self._last_io = 0.0
        self._upstream_transport: asyncio.Transport | None = None  # after an upgrade
        self._request_counters: dict[tuple[Values | None, str], Any] = {}
        self._response_counters: dict[tuple[Values | None, str, int], tuple[Any, Any]] = {}

    # -- the task: routing and connecting, one request at a time ---------------------------

    async def run(self) -> None:
        events = self._events
        while True:
            if events:
                event = events.popleft()
            else:
                self._waiter = self._loop.create_future()
                event = await self._waiter
            if event is None:
                return
            if isinstance(event, asyncio.Future):
                await event  # an upgraded connection, relayed until both sides close
                return
            await self._start(event)

    def _signal(self, event: _Request | asyncio.Future[None] | None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
        else:
            self._events.append(event)

    def _abandoned(self, req: _Request) -> bool:
        return req.cancelled or self._lost

    async def _start(self, req: _Request) -> None:
        if self._abandoned(req):
            return
        conn = self._conn
        attempts = 0
        while True:
            endpoint = req.endpoint
            if endpoint is None:
                endpoint = await self._route(req)
                if endpoint is None:
                    return
            key: PoolKey = (endpoint.connect or conn.connect, endpoint.addr)
            upstream = None if req.retried else self._pool.take(key)
            if upstream is not None:
                break
            limits = self._limits
            host, port = endpoint.addr
            try:
                upstream = await self._pool.open(key, limits)
                break
            except TimeoutError:
                why = f"connecting to {host}:{port} timed out after {limits.connect_timeout}s"
                status = 504
            except Exception as exc:  # refused, unreachable, TLS failure: all end here
                why, status = f"connecting to {host}:{port} failed: {exc}", 502
            attempts += 1
            if endpoint.lease is not None and not self._abandoned(req):
                # Nothing was sent: the balancer skips that endpoint and the request is routed
                # again, maybe to another endpoint.
                endpoint.lease.failed()
                attempt = Attempt(sends=0, connects_failed=attempts, stale_retried=False,
                                  replayable=True, retryable_route=False,
                                  method=req.head.method, responded=False)  # fmt: skip
                failure = Failure.CONNECT_TIMEOUT if status == 504 else Failure.CONNECT
                if decide(failure, attempt).action is Action.RETRY:
                    req.endpoint = None
                    continue
            if not self._abandoned(req):
                self._answer(req, status, why)
            return
        if self._abandoned(req):
            self._pool.give(key, upstream)
            return
        self._attach(req, upstream, key)

    async def _route(self, req: _Request) -> Endpoint | None:
        """Where `req` goes (counted once per request), or None when answered locally."""
        conn = self._conn
        first = req.t0 == 0.0
        if first:
            req.t0 = _perf()
        head = req.head
        authority = head.authority
        target: Endpoint | RouteError
        try:
            route = req.route
            if route is None:
                routed = await conn.router.route(RequestTarget(authority, head.method, head.path))
                if isinstance(routed, RouteError):
                    target = routed
                else:
                    req.route = route = routed
            if route is not None:
                target = await route.endpoints.pick()
        except Exception:
            log.exception("routing a request for %r failed", authority)
            target = RouteError(502, "routing failed in the proxy")
        if self._abandoned(req):
            if not isinstance(target, RouteError) and target.lease is not None:
                target.lease.release()
            return None
        if isinstance(target, RouteError):
            if first:
                req.label = conn.metrics.authority_label(authority) if authority else ""
                self._count_request(req)
            self._answer(req, target.status, target.reason)
            return None
        req.endpoint = target
        if first:
            req.label, req.values = target.authority_label, target.labels
            self._count_request(req)
        return target

    def _attach(self, req: _Request, upstream: H1Upstream, key: PoolKey) -> None:
        req.upstream, req.key = upstream, key
        upstream.begin(self, req.head.head_only)
        if self._write_paused:
            upstream.pause_reading()
        backlog = req.backlog
        if upstream.reused and req.backlog_size <= self._limits.max_body_buffer:
            req.replay, req.replay_size = list(backlog), req.backlog_size
        else:
            req.replay = None
        req.backlog, req.backlog_size = [], 0
        upstream.writelines([req.head.head, *backlog])
        if self._paused:
            self._resume(_BACKLOG)

    # -- asyncio.Protocol: the client connection -------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        high = self._limits.max_body_buffer
        self._transport.set_write_buffer_limits(high, high // 4)
        self._last_io = now = self._loop.time()
        start = now if self._conn.accepted_at is None else min(now, self._conn.accepted_at)
        self._head_deadline = start + self._limits.header_read_timeout
        self._arm(min(self._head_deadline, now + self._limits.idle_timeout))

    def data_received(self, data: bytes) -> None:
        self._last_io = self._loop.time()
        if self._tunnel_req is not None:
            self._raw(data)
            return
        if self._dead:
            return
        cur = self._cur
        if cur is not None and cur.complete:  # the next request waits for this response
            self._inbox.append(data)
            self._pause(_INBOX)
            return
        self._feed(data)

    def eof_received(self) -> bool:
        self._eof = True
        # A client that half-closes after a complete request still gets its response.
        return self._cur is not None and not self._in_head and not self._shut

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = self._shut = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cur = self._cur
        if cur is not None:
            _release(cur)
        if cur is not None and cur.upstream is not None:
            cur.upstream.abort()  # mid-exchange: that upstream connection cannot be reused
            cur.upstream = None
        self._signal(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        cur = self._cur
        if cur is not None and cur.upstream is not None:
            cur.upstream.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        cur = self._cur
        if cur is not None and cur.upstream is not None:
            cur.upstream.resume_reading()

    # -- parsing ----------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._feeding = True
        in_head = self._in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(data[exc.args[0] :])
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._parse_error(cause.status, cause.reason)
            else:
                log.error("HTTP/1 engine failed on a request", exc_info=cause)
                self._parse_error(500, "the proxy failed to handle the request")
        except httptools.HttpParserError as exc:
            self._parse_error(400, f"malformed request: {exc}")
        finally:
            self._feeding = False
        if in_head and self._in_head and not self._dead:
            # llhttp holds a field until it ends: bound a head that keeps coming unfinished.
            self._head_raw += len(data)
            if self._head_raw > self._limits.max_header_bytes + MAX_TARGET_BYTES:
                limit = self._limits.max_header_bytes
                self._parse_error(431, f"request head over {limit} bytes and not finished")
        if self._inbox and self._cur is None:
            self._drain_inbox()

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = b""
        self._fields = []
        self._head_size = self._head_raw = 0
        # The clock runs from the accept for the first head (connection_made set it), else from
        # the head's first byte, or when the response in flight is done.
        if self._cur is None and self._head_deadline is None:
            self._set_head_deadline()

    def on_url(self, url: bytes) -> None:
        self._url = self._url + url if self._url else url
        if len(self._url) > MAX_TARGET_BYTES:
            raise _Reject(414, f"request target over {MAX_TARGET_BYTES} bytes")
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        fields = self._fields
        fields.append((name, value))
        self._head_size += len(name) + len(value) + 4
        limits = self._limits
        if self._head_size > limits.max_header_bytes:
            raise _Reject(431, f"request header fields over {limits.max_header_bytes} bytes")
        if len(fields) > limits.max_headers:
            raise _Reject(431, f"more than {limits.max_headers} request header fields")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_deadline = None
        fields, self._fields = self._fields, []
        if self._synthetic is not None:  # the framing-only head fed after an h2c upgrade
            self._req, self._synthetic = self._synthetic, None
            return
        parser = self._parser
        head = parse_request(
            parser.get_method(), self._url, parser.get_http_version(), fields, self._add_headers
        )
        if isinstance(head, Rejection):
            raise _Reject(head.status, head.reason)
        if self._cur is not None and len(self._queue) >= MAX_PIPELINED:
            raise _Reject(503, f"more than {MAX_PIPELINED} pipelined requests; wait for responses")
        req = _Request(head)
        if head.body is not Body.NONE and not head.upgrade and parser.should_upgrade():
            req.reparse_body = True
        if head.body is not Body.NONE:
            limits = self._limits
            req.body_check_at = self._loop.time() + limits.body_rate_grace
            if self._timer is None or req.body_check_at < self._timer_at:
                self._arm(req.body_check_at)
        self._req = self._last = req
        if self._cur is None:
            self._cur = req
            self._signal(req)
        else:
            self._queue.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._req
        if req is None:
            return
        req.body_received += len(body)
        if req.discard:
            return
        upstream = req.upstream
        if req.head.body is Body.CHUNKED:
            pieces = (b"%x\r\n" % len(body), body, b"\r\n")
            if upstream is None:
                req.backlog += pieces
            else:
                upstream.writelines(pieces)
                if req.replay is not None:
                    req.replay += pieces
        elif upstream is None:
            req.backlog.append(body)
        else:
            upstream.write(body)
            if req.replay is not None:
                req.replay.append(body)
        if upstream is None:
            req.backlog_size += len(body)
            if req.backlog_size > self._limits.max_body_buffer:
                self._pause(_BACKLOG)
        elif req.replay is not None:
            req.replay_size += len(body)
            if req.replay_size > self._limits.max_body_buffer:
                req.replay = None  # too much to keep for a retry

    def on_message_complete(self) -> None:
        req = self._req
        if req is None or req.reparse_body:
            return
        self._req = None
        trailers, self._fields = self._fields, []
        if req.head.body is Body.CHUNKED and not req.discard:
            end = last_chunk(trailers)
            if req.upstream is None:
                req.backlog.append(end)
            else:
                req.upstream.write(end)
                if req.replay is not None:
                    req.replay.append(end)
        req.complete = True
        if req.responded:
            self._finish(req)

    def _upgraded(self, rest: bytes) -> None:
        req = self._last
        assert req is not None
        if req.head.upgrade:  # from now on the client's bytes are relayed as they are
            self._dead = True
            self._tunnel_req = req
            if rest:
                self._raw(rest)
            return
        # `Upgrade: h2c` (or an upgrade on HTTP/1.0) was dropped: llhttp skipped the body and
        # stopped; a fresh parser reads the body from a framing-only head, then what follows.
        self._parser = httptools.HttpRequestParser(self)
        if req.reparse_body:
            req.reparse_body = False
            self._synthetic = req
            if req.head.body is Body.CHUNKED:
                framing = b"Transfer-Encoding: chunked"
            else:
                framing = b"Content-Length: %d" % req.head.length
            self._parser.feed_data(b"PUT / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        if rest:
            self._feed(rest)

    def _raw(self, data: bytes) -> None:
        req = self._tunnel_req
        assert req is not None
        upstream = req.upstream
        if upstream is not None:
            upstream.write(data)
            return
        req.backlog.append(data)
        req.backlog_size += len(data)
        if req.backlog_size > self._limits.max_body_buffer:
            self._pause(_BACKLOG)

    def _parse_error(self, status: int, reason: str) -> None:
        """The client sent something the proxy refuses: answer once, then close."""
        self._dead = True
        self._inbox.clear()
        req = None if self._in_head else self._req  # a body that broke, or a bad head
        self._req = None
        self._count_error(status)
        log.debug("refusing a request with %d: %s", status, reason)
        cur = self._cur
        if req is not None and req is cur:
            req.cancelled = True
            if req.upstream is not None:
                req.upstream.abort()  # the upstream never sees the request complete
                req.upstream = None
            if self._resp is not None:
                self._abort()  # a response in progress must not look complete
            elif req.responded:
                self._close(linger=True)
            else:
                self._cur = None
                self._answer_close(status, reason)
            return
        if req is not None and self._queue and self._queue[-1] is req:
            self._queue.pop()
        if cur is None:
            self._answer_close(status, reason)
        else:
            self._pending_reject = (status, reason)  # after the responses already due

    # -- responses (called by the upstream connection) -------------------------------------

    def response_informational(self, status: int, fields: list[Header]) -> None:
        req = self._cur
        if req is not None and not req.head.http10:
            head = parse_response(status, fields, req.head, False)
            if isinstance(head, ResponseHead):
                self._out.append(head.head)

    def response_head(self, status: int, fields: list[Header]) -> Body | None:
        req = self._cur
        assert req is not None
        head = parse_response(status, fields, req.head, self._closing)
        if isinstance(head, Rejection):
            if req.upstream is not None:
                req.upstream.abort()
                req.upstream = None
            self._answer(req, head.status, head.reason)
            return None
        self._resp = head
        req.replay = None  # answered: never retried
        if req.endpoint is not None and req.endpoint.lease is not None:
            req.endpoint.lease.responded()
        if head.close:
            self._close_after = True
        self._out.append(head.head)
        self._count_response(req, status)
        return head.body_in

    def response_body(self, data: bytes) -> None:
        head = self._resp
        if head is not None and head.body_out is Body.CHUNKED:
            self._out += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            self._out.append(data)

    def response_end(self, trailers: list[Header], reusable: bool) -> None:
        req = self._cur
        assert req is not None
        head, self._resp = self._resp, None
        if head is not None and head.body_out is Body.CHUNKED:
            self._out.append(last_chunk(trailers))
        upstream, req.upstream = req.upstream, None
        _release(req)
        if self._paused:
            self._resume(_UPSTREAM_FULL)
        if upstream is not None:
            if reusable and req.complete and not req.head.upgrade and req.key is not None:
                upstream.detach()
                self._pool.give(req.key, upstream)
            else:
                upstream.close()
        req.responded = True
        if req.complete:
            self._finish(req)
        else:  # answered before the request ended: the rest of it cannot be read safely
            self._close(linger=True)

    def response_upgraded(self, rest: bytes) -> None:
        req = self._cur
        upstream = req.upstream if req is not None else None
        if req is None or upstream is None or upstream.transport is None or self._shut:
            return
        req.upstream = None
        self._resp = None
        self.flush()  # the 101 head
        client_side, upstream_side, done = relay.pair(self._loop, _ignore, _ignore)
        client, server = self._transport, upstream.transport
        client_side.connection_made(client)
        upstream_side.connection_made(server)
        client.set_protocol(client_side)
        server.set_protocol(upstream_side)
        if rest:
            client.write(rest)
        client.resume_reading()
        server.resume_reading()
        self._shut = self._dead = True
        self._tunnel_req = None
        self._upstream_transport = server
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._signal(done)

    def upstream_lost(self, exc: BaseException | None, got_bytes: bool) -> None:
        req = self._cur
        if req is None or req.upstream is None:
            return
        upstream, req.upstream = req.upstream, None
        self._resume(_UPSTREAM_FULL)
        if self._resp is not None:  # mid-response: the client must see it cut, not complete
            _release(req)
            log.debug("upstream %s failed mid-response: %s", req.endpoint, exc)
            self._resp = None
            self._abort()
            return
        if upstream.reused and not got_bytes and req.replay is not None and not req.retried:
            # A pooled connection the upstream had closed: once more on a fresh one.
            req.retried = True
            req.backlog, req.backlog_size = req.replay, req.replay_size
            req.replay = None
            self._signal(req)
            return
        if exc is None:
            why = "the upstream closed the connection before responding"
        else:
            why = f"the upstream connection failed before responding: {exc}"
        self._answer(req, 502, why)

    def upstream_pause_writing(self) -> None:
        self._pause(_UPSTREAM_FULL)

    def upstream_resume_writing(self) -> None:
        self._resume(_UPSTREAM_FULL)

    def flush(self) -> None:
        out = self._out
        if out:
            self._out = []
            if not self._shut:
                self._last_io = self._loop.time()
                self._transport.writelines(out)

    # -- ends of exchanges ------------------------------------------------------------------

    def _answer(self, req: _Request, status: int, reason: str) -> None:
        """Answers `req` locally (route errors, upstream failures)."""
        head = req.head
        drainable = req.complete or (
            head.body is Body.LENGTH
            and not head.expect_continue
            and head.length <= self._limits.max_body_buffer
        )
        close = self._closing or self._eof or not head.keep_alive or head.upgrade or not drainable
        self._out.append(local_response(status, reason, close=close, http10=head.http10))
        self._count_response(req, status)
        self._count_error(status)
        _release(req)
        req.responded = True
        req.backlog, req.backlog_size = [], 0
        self._resume(_BACKLOG)
        if close:
            self._close_after = True
        if req.complete:
            self._finish(req)
        elif close:
            self._close(linger=True)
        else:
            req.discard = True
            self.flush()

    def _answer_close(self, status: int, reason: str) -> None:
        self._out.append(local_response(status, reason, close=True))
        self._close(linger=True)

    def _finish(self, req: _Request) -> None:
        """Both the request and its response are complete: on to the next request."""
        self._cur = None
        self.flush()
        if self._close_after or self._closing or self._eof:
            self._close()
            return
        if self._queue:
            nxt = self._queue.popleft()
            self._cur = nxt
            self._signal(nxt)
            if nxt.complete:
                return
        elif self._pending_reject is not None:
            self._answer_close(*self._pending_reject)
            return
        elif self._in_head:
            self._set_head_deadline()
        if self._inbox and not self._feeding:
            self._drain_inbox()  # the next head, or the body of the request just started
        elif self._paused:
            self._resume(_INBOX)

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        self._feed(inbox[0] if len(inbox) == 1 else b"".join(inbox))
        if not self._inbox:
            self._resume(_INBOX)

    def _close(self, linger: bool = False) -> None:
        """Closes after what is buffered is sent. With `linger`, when the client may still be
        sending: half-close, then read and drop its bytes for a while, so that closing with
        unread bytes (a reset) does not destroy the response before the client reads it."""
        if self._shut:
            return
        self.flush()
        self._shut = True
        transport = self._transport
        if not linger or self._lost or not transport.can_write_eof():
            transport.close()
            return
        self._dead = True  # what arrives now is dropped
        self._tunnel_req = None
        transport.write_eof()
        transport.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(
            min(LINGER_SECONDS, self._limits.idle_timeout), transport.close
        )

    def _abort(self) -> None:
        self._out = []
        self._shut = True
        if not self._lost:
            self._transport.abort()

    def shutdown(self) -> None:
        """`conn.closing` was set: finish the request in flight with `Connection: close`."""
        self._closing = True
        idle = self._cur is None and not self._in_head and self._tunnel_req is None
        if idle and not self._lost:
            self._close()

    def abort(self) -> None:
        """Closes whatever is still open (the serving task ends, maybe cancelled)."""
        cur = self._cur
        if cur is not None and cur.upstream is not None:
            cur.upstream.abort()
            cur.upstream = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for transport in (self._transport, self._upstream_transport):
            if transport is not None and not transport.is_closing():
                transport.abort()

    # -- flow control -----------------------------------------------------------------------

    def _pause(self, reason: int) -> None:
        if not self._paused and not self._shut:
            self._transport.pause_reading()
        self._paused |= reason

    def _resume(self, reason: int) -> None:
        if self._paused & reason:
            self._paused &= ~reason
            if not self._paused and not self._shut:
                self._transport.resume_reading()

    # -- timers: one handle, re-armed only when it fires or a head starts sooner ------------

    def _set_head_deadline(self) -> None:
        deadline = self._loop.time() + self._limits.header_read_timeout
        self._head_deadline = deadline
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._shut:
            return
        now = self._loop.time()
        limits = self._limits
        cur = self._cur
        deadline = self._head_deadline if cur is None else None
        if deadline is not None and now >= deadline:
            why = f"request head not received within {limits.header_read_timeout}s"
            self._parse_error(408, why)
            return
        if cur is not None and cur.complete and self._resp is None and not cur.responded:
            idle_at = now + limits.idle_timeout  # waiting for the upstream's response head
        else:
            idle_at = self._last_io + limits.idle_timeout
            if now >= idle_at:
                self._idle_out()
                return
        wake = idle_at if deadline is None else min(deadline, idle_at)
        body = self._req if not self._in_head else None
        if body is not None and body.body_check_at:
            if now >= body.body_check_at and not self._body_rate_kept(body, now):
                return
            wake = min(wake, body.body_check_at)
        self._arm(wake)

    def _body_rate_kept(self, req: _Request, now: float) -> bool:
        """At a body-rate check: whether the body kept the minimum rate since the last one (a
        body the proxy paused is not counted against the client); 408 when it did not."""
        limits = self._limits
        arrived = req.body_received - req.body_mark
        req.body_mark = req.body_received
        req.body_check_at = now + limits.body_rate_window
        if arrived >= limits.body_min_bytes or self._paused:
            return True
        why = (
            f"request body slower than {limits.body_min_bytes} bytes per "
            f"{limits.body_rate_window:g}s after {limits.body_rate_grace:g}s"
        )
        self._parse_error(408, why)
        return False

    def _idle_out(self) -> None:
        cur = self._cur
        why = f"no bytes for {self._limits.idle_timeout}s"
        if cur is None and not self._in_head:
            self._close()  # an idle keep-alive connection
        elif cur is None or (self._resp is None and not cur.responded):
            self._parse_error(408, f"request not received: {why}")
        else:
            log.debug("aborting a response the client does not read: %s", why)
            if cur.upstream is not None:
                cur.upstream.abort()
                cur.upstream = None
            self._abort()

    # -- metrics ----------------------------------------------------------------------------

    def _count_request(self, req: _Request) -> None:
        key = (req.values, req.label)
        counter = self._request_counters.get(key)
        if counter is None:
            metric = self._conn.metrics.request_total
            values = req.values or self._labels
            counter = self._request_counters[key] = metric.labels(*values, req.label)
        counter.inc()

    def _count_response(self, req: _Request, status: int) -> None:
        key = (req.values, req.label, status)
        counters = self._response_counters.get(key)
        if counters is None:
            metrics = self._conn.metrics
            labels = req.values or self._labels
            values = (*labels, req.label, str(status), "", classify(status, None))
            counters = self._response_counters[key] = (
                metrics.response_total.labels(*values),
                metrics.response_latency_ms.labels(*values),
            )
        counters[0].inc()
        counters[1].observe((_perf() - req.t0) * 1000.0)

    def _count_error(self, status: int) -> None:
        self._conn.metrics.http_errors_total.labels(self._labels[0], str(status)).inc()
