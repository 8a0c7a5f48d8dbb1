"""The HTTP/1.1 server side as a state machine (sans-IO): what the proxy does with each event of
one client connection: bytes from the client, a timer, the upstream's response, a routing or
connection result. It touches no transport: every effect (writing to the client, closing,
pausing, starting an exchange upstream, arming the timer) goes through `Io`, which the asyncio
shell (`h1.py`) implements, and which a test can implement too.

State, one enum per dimension:
  Conn     the connection: OPEN, CLOSE_AFTER (no more requests), LINGER (answered and
           half-closed: what arrives is dropped), TUNNEL (upgraded), CLOSED
  Parse    the request parser: IDLE (between requests), HEAD, BODY, STOPPED
  Req      one request's body: BODY, COMPLETE, DISCARD (answered locally: read and dropped)
  Resp     its response: WAITING (routing, connecting, or waiting for the head), STREAMING
           (the head went to the client), DONE
  Pause    why reading from the client is paused (a set: the upstream's buffer is full, body
           bytes wait for an upstream, a pipelined request waits for the response in flight)

Requests are handled one at a time; pipelined ones (at most MAX_PIPELINED) wait their turn with
reading paused. Hostile input is answered locally (h1head.py, the parser) and nothing of it is
forwarded. Each request's route, attempts and outcome are its `attempts.Attempts`' (the same
as HTTP/2's): what follows a failure upstream, retries within the route's budget, the route's
timeout. A retry resends the request (its body kept, up to REPLAY_LIMIT) to the endpoint picked
next, and never happens once a response byte went to the client. A route's timeout answers 504
and closes the upstream connection (the upstream sees the cancel).
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable
from typing import Any, Final, Protocol

import httptools

from meshlet.proxy.core.failover import IDEMPOTENT, Failure
from meshlet.proxy.http.attempts import PASS, Answer, Attempts, Step
from meshlet.proxy.http.contract import (
    REPLAY_LIMIT,
    HttpLimits,
    Recording,
    Router,
    RouteTarget,
)
from meshlet.proxy.http.h1client import UpstreamConn
from meshlet.proxy.http.h1head import (
    MAX_TARGET_BYTES,
    Body,
    Header,
    Rejection,
    RequestHead,
    ResponseHead,
    last_chunk,
    local_response,
    modify_head,
    parse_request,
    parse_response,
)
from meshlet.proxy.http.h1pool import PoolKey

log = logging.getLogger(__name__)

MAX_PIPELINED: Final = 16  # complete requests parsed ahead of the one in flight
LINGER_SECONDS: Final = 2.0  # after refusing a request, its bytes are read and dropped this long


class Conn(enum.Enum):
    OPEN = "open"
    CLOSE_AFTER = "close-after"
    LINGER = "linger"
    TUNNEL = "tunnel"
    CLOSED = "closed"


class Parse(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    STOPPED = "stopped"


class Req(enum.Enum):
    BODY = "body"
    COMPLETE = "complete"
    DISCARD = "discard"


class Resp(enum.Enum):
    WAITING = "waiting"
    STREAMING = "streaming"
    DONE = "done"


class Pause:
    """Bits of a set (plain ints: `enum.Flag`'s operators are Python code, on every request)."""

    NONE: Final = 0
    UPSTREAM_FULL: Final = 1  # the upstream's write buffer is full
    BACKLOG: Final = 2  # body bytes wait for an upstream
    INBOX: Final = 4  # bytes of a next request wait for the current response


class Reject(Exception):
    """Raised in a parser callback: the request is answered `status` and the connection closed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Io(Protocol):
    """The effects of the machine (the shell: h1.py)."""

    # The loop's clock (a builtin's bound method: no Python frame per call).
    now: Callable[[], float]

    def write(self, chunks: list[bytes]) -> None:
        """To the client."""

    def close(self, linger: float) -> None:
        """Closes after what is written; with `linger` > 0, half-closes first and reads (and
        drops) the client's bytes that long, so that the answer is not lost to a reset."""

    def abort_client(self) -> None:
        """Resets the client connection (a response cut short must not look complete)."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def arm(self, when: float) -> None:
        """`tick` is to be called at loop time `when` (replaces an earlier arming; `inf`: not
        at all)."""

    def start(self, exchange: Exchange, step: Step | None) -> None:
        """Carry out `step` of the exchange's Attempts (None: its first, `Attempts.start`):
        route, pick and connect it, then call `routed`, `attach` or `answer`."""

    def give_back(self, exchange: Exchange, upstream: UpstreamConn, reusable: bool) -> None:
        """The exchange is done with its upstream connection: to the pool, or closed."""

    def tunnel(self, exchange: Exchange, upstream: UpstreamConn, rest: bytes) -> None:
        """The exchange upgraded (101): relay both connections as they are from now on."""


class Exchange:
    """One request and its response."""

    __slots__ = (
        "att",
        "backlog",
        "backlog_size",
        "head",
        "key",
        "reparse_body",
        "replay",
        "replay_size",
        "req",
        "resp",
        "response",
        "upstream",
    )

    def __init__(self, head: RequestHead, att: Attempts) -> None:
        self.head = head
        self.att = att
        self.req = Req.BODY if head.body is not Body.NONE else Req.COMPLETE
        self.resp = Resp.WAITING
        self.reparse_body = False  # llhttp skipped this body (h2c upgrade): parsed again
        self.backlog: list[bytes] = []  # request bytes (framed) waiting for an upstream
        self.backlog_size = 0
        # Request bytes sent upstream, kept for a retry (None: not kept, or too many).
        self.replay: list[bytes] | None = None
        self.replay_size = 0
        self.key: PoolKey | None = None
        self.upstream: UpstreamConn | None = None
        self.response: ResponseHead | None = None  # the head relayed to the client

    @property
    def replayable(self) -> bool:
        """The whole request sent so far is held: it can be sent again."""
        return self.replay is not None and self.req is not Req.DISCARD

    def buffered(self) -> int:
        """Bytes the proxy holds for this exchange: body waiting for an upstream, and the
        upstream connection's unsent output."""
        upstream = self.upstream
        transport = upstream.transport if upstream is not None else None
        return self.backlog_size + (transport.get_write_buffer_size() if transport else 0)


class H1Machine:
    """The client side of one connection (see the module docstring). Parser callbacks and
    upstream callbacks arrive synchronously; routing and connecting happen in the shell, which
    reports back through `routed`, `attach`, `route_failed` and `connect_failed`."""

    def __init__(
        self,
        io: Io,
        limits: HttpLimits,
        recorder: Recording,
        router: Router,
        add_headers: tuple[Header, ...] = (),
        accepted_at: float | None = None,
    ) -> None:
        self.io = io
        self._limits = limits
        self._recorder = recorder
        self._router = router
        self._add_headers = add_headers
        self._parser: Any = httptools.HttpRequestParser(self)
        self.conn = Conn.OPEN
        self.parse = Parse.IDLE
        self._pause: int = Pause.NONE
        self._write_paused = False
        self._eof = False  # the client half-closed
        self._lost = False  # the client connection is gone
        self._draining = False  # shutdown: finish the exchange in flight, then close
        self._feeding = False
        # The head being parsed.
        self._url = b""
        self._fields: list[Header] = []
        self._head_size = 0  # as counted: target, then name + value + 4 per field
        self._head_raw = 0  # bytes read while the head stays unfinished
        # Exchanges: the one whose body is being parsed, the one in flight, those queued.
        self._parsing: Exchange | None = None
        self._last: Exchange | None = None  # the last exchange whose head was parsed
        self.current: Exchange | None = None
        self._queue: collections.deque[Exchange] = collections.deque()
        self._inbox: list[bytes] = []  # bytes read while the request in flight is complete
        self._pending_reject: tuple[int, str] | None = None
        self._synthetic: Exchange | None = None
        self._tunnel: Exchange | None = None  # upgraded: bytes relayed raw from now on
        self._out: list[bytes] = []  # to the client, written at the end of each event
        now = io.now()
        self._last_io = now
        start = now if accepted_at is None else min(now, accepted_at)
        self._head_deadline: float | None = start + limits.header_read_timeout
        self._timer_at = 0.0
        self._arm(min(self._head_deadline, now + limits.idle_timeout))

    # -- client events --------------------------------------------------------------------

    def data(self, data: bytes) -> None:
        self._last_io = self.io.now()
        if self._tunnel is not None:
            self._raw(data)
            return
        if self.parse is Parse.STOPPED:
            return
        cur = self.current
        if cur is not None and cur.req is Req.COMPLETE:  # the next request waits its turn
            self._inbox.append(data)
            self._pause_reading(Pause.INBOX)
            return
        self._feed(data)
        self.flush()

    def eof(self) -> bool:
        """The client half-closed; whether to keep the connection (to answer it). A request
        whose body was still arriving can never be complete: it ends as a reset ends it."""
        self._eof = True
        ex = self._parsing
        if self.parse is Parse.BODY and ex is not None and ex.req is Req.BODY:
            self._body_cut(ex)
            self.flush()
        return self.current is not None and self.parse is not Parse.HEAD and not self._closed()

    def _body_cut(self, ex: Exchange) -> None:
        """The client's EOF came before `ex`'s body ended: the upstream request is aborted (its
        connection closed: the app sees the cancel, never a request waiting for ever for the
        rest); the client gets a 400 if no response began, its response cut if one is under
        way (never passed off as complete), the connection closed if the response was whole."""
        self._drop_upstream(ex)
        if ex.resp is Resp.WAITING:
            self._answer(ex, 400, "the client closed its side before the request body ended")
            return
        _release(ex)
        if ex.resp is Resp.STREAMING:
            self._abort()
        else:
            self._close()

    def lost(self) -> None:
        self._lost = True
        self.conn = Conn.CLOSED
        cur = self.current
        if cur is not None:
            _release(cur)
            if cur.upstream is not None:
                cur.upstream.abort()  # mid-exchange: that upstream connection cannot be reused
                cur.upstream = None

    def write_paused(self) -> None:
        self._write_paused = True
        cur = self.current
        if cur is not None and cur.upstream is not None:
            cur.upstream.pause_reading()

    def write_resumed(self) -> None:
        self._write_paused = False
        cur = self.current
        if cur is not None and cur.upstream is not None:
            cur.upstream.resume_reading()

    def shutdown(self) -> None:
        """Graceful: the exchange in flight finishes (its response says `Connection: close`),
        then the connection closes; an idle one closes now."""
        self._draining = True
        idle = self.current is None and self.parse is not Parse.HEAD and self._tunnel is None
        if idle and not self._lost:
            self._close()

    def shed(self, why: str) -> None:
        """Under pressure the proxy drops this connection (core/pressure.py): a request waiting
        for its response is answered 503 and the connection closed; a response in progress is
        cut (never passed off as complete); a head being read gets 503; an idle connection
        just closes."""
        if self._closed():
            return
        reason = f"shed under load: {why}"
        cur = self.current
        if cur is not None and cur.resp is Resp.STREAMING:
            self._drop_upstream(cur)
            _release(cur)
            self._abort()
            return
        self._draining = True  # no request after this one
        if cur is not None:
            self._drop_upstream(cur)  # the upstream sees its connection closed: the cancel
            self._answer(cur, 503, reason)
            self._close(linger=True)
        elif self.parse is Parse.HEAD:
            self._refuse(503, reason)
        else:
            self._close()
        self.flush()

    def abandoned(self, ex: Exchange) -> bool:
        return self._lost or ex is not self.current or ex.resp is not Resp.WAITING

    def _closed(self) -> bool:
        return self.conn in (Conn.LINGER, Conn.TUNNEL, Conn.CLOSED)

    # -- parsing ---------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._feeding = True
        in_head = self.parse is Parse.HEAD
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgraded(data[exc.args[0] :])
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, Reject):
                self._refuse(cause.status, cause.reason)
            else:
                log.error("HTTP/1 engine failed on a request", exc_info=cause)
                self._refuse(500, "the proxy failed to handle the request")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed request: {exc}")
        finally:
            self._feeding = False
        if in_head and self.parse is Parse.HEAD:
            # llhttp holds a field until it ends: bound a head that keeps coming unfinished.
            self._head_raw += len(data)
            if self._head_raw > self._limits.max_header_bytes + MAX_TARGET_BYTES:
                limit = self._limits.max_header_bytes
                self._refuse(431, f"request head over {limit} bytes and not finished")
        if self._inbox and self.current is None:
            self._drain_inbox()

    def on_message_begin(self) -> None:
        self.parse = Parse.HEAD
        self._url = b""
        self._fields = []
        self._head_size = self._head_raw = 0
        # The clock runs from the accept for the first head (set at start), else from the
        # head's first byte, or from when the response in flight is done.
        if self.current is None and self._head_deadline is None:
            self._set_head_deadline()

    def on_url(self, url: bytes) -> None:
        self._url = self._url + url if self._url else url
        if len(self._url) > MAX_TARGET_BYTES:
            raise Reject(414, f"request target over {MAX_TARGET_BYTES} bytes")
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        fields = self._fields
        fields.append((name, value))
        self._head_size += len(name) + len(value) + 4
        limits = self._limits
        if self._head_size > limits.max_header_bytes:
            raise Reject(431, f"request header fields over {limits.max_header_bytes} bytes")
        if len(fields) > limits.max_headers:
            raise Reject(431, f"more than {limits.max_headers} request header fields")

    def on_headers_complete(self) -> None:
        self.parse = Parse.BODY
        self._head_deadline = None
        fields, self._fields = self._fields, []
        if self._synthetic is not None:  # the framing-only head fed after an h2c upgrade
            self._parsing, self._synthetic = self._synthetic, None
            return
        parser = self._parser
        head = parse_request(
            parser.get_method(),
            self._url,
            parser.get_http_version(),
            fields,
            self._add_headers,
            self._limits.escaped_slashes,
        )
        if isinstance(head, Rejection):
            raise Reject(head.status, head.reason)
        if self.current is not None and len(self._queue) >= MAX_PIPELINED:
            raise Reject(503, f"more than {MAX_PIPELINED} pipelined requests; wait for responses")
        ex = Exchange(head, Attempts(self._router, self._recorder, head, self.io.now()))
        if head.body is not Body.NONE and not head.upgrade and parser.should_upgrade():
            ex.reparse_body = True
        self._parsing = self._last = ex
        if self.current is None:
            self.current = ex
            if self._limits.stream_idle_timeout is not None:
                self._arm_sooner()
            self.io.start(ex, None)
        else:
            self._queue.append(ex)

    def on_body(self, body: bytes) -> None:
        ex = self._parsing
        if ex is None or ex.req is Req.DISCARD:
            return
        if ex.head.body is Body.CHUNKED:
            self._to_upstream(ex, (b"%x\r\n" % len(body), body, b"\r\n"), len(body))
        else:
            self._to_upstream(ex, (body,), len(body))

    def on_message_complete(self) -> None:
        ex = self._parsing
        if ex is None or ex.reparse_body:
            return
        self._parsing = None
        self.parse = Parse.IDLE
        trailers, self._fields = self._fields, []
        if ex.req is Req.DISCARD:
            ex.req = Req.COMPLETE
            if ex.resp is Resp.DONE:
                self._finish(ex)
            return
        if ex.head.body is Body.CHUNKED:
            self._to_upstream(ex, (last_chunk(trailers),), 0)
        ex.req = Req.COMPLETE
        if ex.resp is Resp.DONE:
            self._finish(ex)

    def _to_upstream(self, ex: Exchange, pieces: tuple[bytes, ...], size: int) -> None:
        upstream = ex.upstream
        if upstream is None:
            ex.backlog += pieces
            ex.backlog_size += size
            if ex.backlog_size > self._limits.max_body_buffer:
                self._pause_reading(Pause.BACKLOG)
            return
        upstream.writelines(pieces)
        if ex.replay is not None:
            ex.replay += pieces
            ex.replay_size += size
            if ex.replay_size > REPLAY_LIMIT:
                ex.replay = None  # too much to keep for a retry

    def _upgraded(self, rest: bytes) -> None:
        ex = self._last
        assert ex is not None
        if ex.head.upgrade:  # from now on the client's bytes are relayed as they are
            self.parse = Parse.STOPPED
            self._tunnel = ex
            if rest:
                self._raw(rest)
            return
        # `Upgrade: h2c` (or an upgrade on HTTP/1.0) was dropped: llhttp skipped the body and
        # stopped; a fresh parser reads the body from a framing-only head, then what follows.
        self._parser = httptools.HttpRequestParser(self)
        if ex.reparse_body:
            ex.reparse_body = False
            self._synthetic = ex
            if ex.head.body is Body.CHUNKED:
                framing = b"Transfer-Encoding: chunked"
            else:
                framing = b"Content-Length: %d" % ex.head.length
            self._parser.feed_data(b"PUT / HTTP/1.1\r\n" + framing + b"\r\n\r\n")
        if rest:
            self._feed(rest)

    def _raw(self, data: bytes) -> None:
        ex = self._tunnel
        assert ex is not None
        if ex.upstream is not None:
            ex.upstream.write(data)
            return
        ex.backlog.append(data)
        ex.backlog_size += len(data)
        if ex.backlog_size > self._limits.max_body_buffer:
            self._pause_reading(Pause.BACKLOG)

    def _refuse(self, status: int, reason: str) -> None:
        """The client sent something the proxy refuses: answer once, then close."""
        ex = None if self.parse is Parse.HEAD else self._parsing  # a bad head, or a bad body
        self.parse = Parse.STOPPED
        self._inbox.clear()
        self._parsing = None
        self._recorder.error(str(status))
        log.debug("refusing a request with %d: %s", status, reason)
        cur = self.current
        if ex is not None and ex is cur:
            if ex.upstream is not None:
                ex.upstream.abort()  # the upstream never sees the request complete
                ex.upstream = None
            if ex.resp is Resp.STREAMING:
                self._abort()  # a response in progress must not look complete
            elif ex.resp is Resp.DONE:
                self._close(linger=True)
            else:
                _release(ex)
                ex.resp = Resp.DONE
                self.current = None
                self._answer_close(status, reason)
            return
        if ex is not None and self._queue and self._queue[-1] is ex:
            self._queue.pop()
        if cur is None:
            self._answer_close(status, reason)
        else:
            self._pending_reject = (status, reason)  # after the responses already due

    # -- routing and connecting (reported by the shell) ------------------------------------

    def routed(self, ex: Exchange, route: RouteTarget) -> None:
        """The exchange's route is known: its filters change the head, its timeout is armed;
        the body is kept for a replay when the route retries, or the method is idempotent."""
        if route.request_headers is not None:
            ex.head = ex.head._replace(head=modify_head(ex.head.head, route.request_headers))
        policy = route.policy
        timed = policy.timeout is not None or policy.attempt_timeout is not None
        if (timed or policy.idle_timeout is not None) and ex is self.current:
            self._arm_sooner()
        if policy.retryable or ex.head.method in IDEMPOTENT:
            ex.replay = []

    def answer(self, ex: Exchange, status: int, reason: str) -> None:
        """The proxy answers the exchange itself (it cannot be routed, or its connections
        failed)."""
        if self.abandoned(ex):
            return
        self._answer(ex, status, reason)
        self.flush()

    def attach(self, ex: Exchange, upstream: UpstreamConn, key: PoolKey | None) -> None:
        """`upstream` takes the request: its head and the body read so far go out."""
        ex.upstream, ex.key = upstream, key
        if ex.att.try_deadline is not None and ex is self.current:
            self._arm_sooner()  # this attempt's own timeout
        upstream.begin(self, ex.head.head_only)
        if self._write_paused:
            upstream.pause_reading()
        if upstream.reused and ex.replay is None and ex.backlog_size <= REPLAY_LIMIT:
            ex.replay = []  # a pooled connection may turn out stale: keep what is sent
        if ex.replay is not None:
            ex.replay += ex.backlog
            ex.replay_size += ex.backlog_size
            if ex.replay_size > REPLAY_LIMIT:
                ex.replay = None
        backlog = ex.backlog
        ex.backlog, ex.backlog_size = [], 0
        upstream.writelines([ex.head.head, *backlog])
        self._resume_reading(Pause.BACKLOG)

    # -- the upstream's response (its UpstreamConn calls these: h1client.ResponseSink) -----

    def response_informational(self, status: int, fields: list[Header]) -> None:
        ex = self.current
        if ex is not None and not ex.head.http10:
            head = parse_response(status, fields, ex.head, False, _from_peer_proxy(ex))
            if isinstance(head, ResponseHead):
                self._out.append(head.head)

    def response_head(self, status: int, fields: list[Header]) -> Body | None:
        ex = self.current
        assert ex is not None
        head = parse_response(status, fields, ex.head, self._draining, _from_peer_proxy(ex))
        if isinstance(head, Rejection):
            self._drop_upstream(ex)
            self._answer(ex, head.status, head.reason)
            return None
        att = ex.att
        now = self.io.now()
        replayable = ex.replay is not None and ex.req is not Req.DISCARD
        step = att.response(status, None, replayable, now, fields)
        if step is not PASS:
            self._retry(ex, step)
            return None
        route = att.route
        if route is not None and route.response_headers is not None:
            head = head._replace(head=modify_head(head.head, route.response_headers))
        ex.response = head
        ex.resp = Resp.STREAMING
        ex.replay = None  # answered: never sent again
        if head.close:
            self.conn = Conn.CLOSE_AFTER if self.conn is Conn.OPEN else self.conn
        self._out.append(head.head)
        self._count_response(ex, status)
        return head.body_in

    def response_body(self, data: bytes) -> None:
        ex = self.current
        head = ex.response if ex is not None else None
        if head is not None and head.body_out is Body.CHUNKED:
            self._out += (b"%x\r\n" % len(data), data, b"\r\n")
        else:
            self._out.append(data)
        if ex is not None:
            ex.att.resp_bytes += len(data)

    def response_end(self, trailers: list[Header], reusable: bool) -> None:
        ex = self.current
        assert ex is not None
        head, ex.response = ex.response, None
        if head is not None and head.body_out is Body.CHUNKED:
            self._out.append(last_chunk(trailers))
        upstream, ex.upstream = ex.upstream, None
        _release(ex, complete=True)
        self._resume_reading(Pause.UPSTREAM_FULL)
        if upstream is not None:
            keep = reusable and ex.req is Req.COMPLETE and not ex.head.upgrade
            self.io.give_back(ex, upstream, keep)
        ex.resp = Resp.DONE
        if ex.req is Req.COMPLETE:
            self._finish(ex)
        else:  # answered before the request ended: the rest of it cannot be read safely
            self._close(linger=True)

    def response_upgraded(self, rest: bytes) -> None:
        ex = self.current
        if ex is None or ex.upstream is None or self._closed():
            return
        upstream, ex.upstream = ex.upstream, None
        ex.resp = Resp.DONE
        self.flush()  # the 101 head
        self.conn = Conn.TUNNEL
        self.parse = Parse.STOPPED
        self._tunnel = None
        self.current = None
        self.io.tunnel(ex, upstream, rest)

    def upstream_lost(self, exc: BaseException | None, got_bytes: bool) -> None:
        ex = self.current
        if ex is None or ex.upstream is None:
            return
        upstream, ex.upstream = ex.upstream, None
        self._resume_reading(Pause.UPSTREAM_FULL)
        if ex.resp is Resp.STREAMING:  # mid-response: the client must see it cut, not complete
            ex.att.cut()
            _release(ex)
            log.debug("upstream %s failed mid-response: %s", ex.att.endpoint, exc)
            ex.response = None
            self._abort()
            return
        failure = Failure.STALE if upstream.reused and not got_bytes else Failure.RESET
        step = ex.att.failed(failure, ex.replayable, False, self.io.now())
        if not isinstance(step, Answer):
            self._retry(ex, step)
            return
        if exc is None:
            why = "the upstream closed the connection before responding"
        else:
            why = f"the upstream connection failed before responding: {exc}"
        self._answer(ex, step.status, why)

    def upstream_pause_writing(self) -> None:
        self._pause_reading(Pause.UPSTREAM_FULL)

    def upstream_resume_writing(self) -> None:
        self._resume_reading(Pause.UPSTREAM_FULL)

    def flush(self) -> None:
        out = self._out
        if out:
            self._out = []
            if not self._closed() and not self._lost:
                self._last_io = self.io.now()
                self.io.write(out)

    # -- retries and timeouts ------------------------------------------------------------

    def _retry(self, ex: Exchange, step: Step) -> None:
        """Sends the request again as its Attempts say: to another endpoint, or (AGAIN) to the
        same one on a new connection."""
        self._drop_upstream(ex)
        replay = ex.replay or []
        ex.backlog, ex.backlog_size = [*replay, *ex.backlog], ex.replay_size + ex.backlog_size
        ex.replay, ex.replay_size = [], 0
        self.io.start(ex, step)

    def _drop_upstream(self, ex: Exchange) -> None:
        if ex.upstream is not None:
            ex.upstream.abort()
            ex.upstream = None

    def _timed_out(self, ex: Exchange) -> None:
        """The request's timeout, or its attempt's, passed before the response head: the
        upstream sees its connection closed (the cancel); 504, or the attempt's retry."""
        self._drop_upstream(ex)
        step = ex.att.expired(self.io.now(), ex.replayable)
        if isinstance(step, Answer):
            self._answer(ex, step.status, step.reason)
        else:
            self._retry(ex, step)

    # -- ends of exchanges ---------------------------------------------------------------

    def _answer(self, ex: Exchange, status: int, reason: str) -> None:
        """Answers `ex` locally (route errors, upstream failures, timeouts)."""
        head = ex.head
        drainable = ex.req is Req.COMPLETE or (
            head.body is Body.LENGTH
            and not head.expect_continue
            and head.length <= self._limits.max_body_buffer
        )
        close = self._draining or self._eof or not head.keep_alive or head.upgrade or not drainable
        self._out.append(local_response(status, reason, close=close, http10=head.http10))
        ex.att.answered(self.io.now())
        self._count_response(ex, status)
        self._recorder.error(str(status))
        _release(ex, complete=True)
        ex.resp = Resp.DONE
        ex.backlog, ex.backlog_size = [], 0
        ex.replay = None
        self._resume_reading(Pause.BACKLOG)
        if close and self.conn is Conn.OPEN:
            self.conn = Conn.CLOSE_AFTER
        if ex.req is Req.COMPLETE:
            self._finish(ex)
        elif close:
            self._close(linger=True)
        else:
            ex.req = Req.DISCARD
            self.flush()

    def _answer_close(self, status: int, reason: str) -> None:
        self._out.append(local_response(status, reason, close=True))
        self._close(linger=True)

    def _finish(self, ex: Exchange) -> None:
        """Both the request and its response are complete: on to the next request."""
        self.current = None
        self.flush()
        if self.conn is not Conn.OPEN or self._draining or self._eof:
            self._close()
            return
        if self._queue:
            nxt = self._queue.popleft()
            self.current = nxt
            nxt.att.arrived = self.io.now()  # its turn: taken now, as HTTP/2's on arrival
            self._arm_sooner()
            self.io.start(nxt, None)
            if nxt.req is Req.COMPLETE:
                return
        elif self._pending_reject is not None:
            self._answer_close(*self._pending_reject)
            return
        else:
            if self.parse is Parse.HEAD:
                self._set_head_deadline()
            self._arm_sooner()  # the connection's idle timer
        if self._inbox and not self._feeding:
            self._drain_inbox()  # the next head, or the body of the request just started
        else:
            self._resume_reading(Pause.INBOX)

    def _drain_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        self._feed(inbox[0] if len(inbox) == 1 else b"".join(inbox))
        if not self._inbox:
            self._resume_reading(Pause.INBOX)

    def _close(self, linger: bool = False) -> None:
        """Closes after what is buffered is sent (see `Io.close` for `linger`)."""
        if self._closed():
            return
        self.flush()
        self.parse = Parse.STOPPED
        self._tunnel = None
        if not linger or self._lost:
            self.conn = Conn.CLOSED
            self.io.close(0.0)
            return
        self.conn = Conn.LINGER
        self.io.close(min(LINGER_SECONDS, self._limits.idle_timeout))

    def _abort(self) -> None:
        self._out = []
        self.conn = Conn.CLOSED
        if not self._lost:
            self.io.abort_client()

    def abort(self) -> None:
        """Closes whatever is still open (the serving task ends, maybe cancelled)."""
        cur = self.current
        if cur is not None:
            self._drop_upstream(cur)
            _release(cur)
        self.conn = Conn.CLOSED

    # -- flow control ----------------------------------------------------------------------

    def _pause_reading(self, reason: int) -> None:
        if not self._pause and not self._closed():
            self.io.pause_reading()
        self._pause |= reason

    def _resume_reading(self, reason: int) -> None:
        if self._pause & reason:
            self._pause &= ~reason
            if not self._pause and not self._closed():
                self.io.resume_reading()

    # -- timers: one, re-armed only when it fires or something is due sooner ---------------

    def _set_head_deadline(self) -> None:
        deadline = self.io.now() + self._limits.header_read_timeout
        self._head_deadline = deadline
        if deadline < self._timer_at:
            self._arm(deadline)

    def _arm(self, when: float) -> None:
        self._timer_at = when
        self.io.arm(when)

    def tick(self) -> None:
        """The timer fired: whatever is due is done, then it is armed again."""
        self._timer_at = float("inf")
        if self._closed():
            return
        now = self.io.now()
        limits = self._limits
        cur = self.current
        if cur is None:
            deadline = self._head_deadline
            if deadline is not None and now >= deadline:
                self._refuse(408, f"request head not received within {limits.header_read_timeout}s")
                self.flush()
                return
            if now >= self._last_io + limits.idle_timeout:
                self._idle_out()
                self.flush()
                return
        else:
            deadline = cur.att.due
            if deadline is not None and cur.resp is Resp.WAITING and now >= deadline:
                self._timed_out(cur)
                self.flush()
                if self._closed():
                    return
            idle = _stream_idle(cur, limits)
            if cur is self.current and idle is not None and now >= self._last_io + idle:
                self._stream_idle_out(cur, idle)
                self.flush()
                return
        self._arm(self._wake_at())

    def _wake_at(self) -> float:
        """When the timer must next fire, for the state as it is (inf: never)."""
        limits = self._limits
        cur = self.current
        if cur is None:
            at = self._last_io + limits.idle_timeout
            deadline = self._head_deadline
            return at if deadline is None else min(at, deadline)
        at = float("inf")
        deadline = cur.att.due
        if deadline is not None and cur.resp is Resp.WAITING:
            at = deadline
        idle = _stream_idle(cur, limits)
        if idle is not None:
            at = min(at, self._last_io + idle)
        return at

    def _arm_sooner(self) -> None:
        when = self._wake_at()
        if when < self._timer_at:
            self._arm(when)

    def _idle_out(self) -> None:
        """No request in flight and no byte for the idle timeout."""
        if self.parse is not Parse.HEAD:
            self._close()  # an idle keep-alive connection
        else:
            self._refuse(408, f"request not received: no bytes for {self._limits.idle_timeout}s")

    def _stream_idle_out(self, ex: Exchange, idle: float) -> None:
        """A request in flight moved no byte either way for its (configured) idle timeout."""
        why = f"no bytes either way for {idle:g}s (the idle timeout)"
        if ex.resp is Resp.STREAMING:
            log.debug("aborting a response: %s", why)
            self._drop_upstream(ex)
            _release(ex)
            self._abort()
        elif ex.req is not Req.COMPLETE:
            self._refuse(408, f"request body stalled: {why}")
        else:
            self._drop_upstream(ex)  # the upstream sees its connection closed: the cancel
            self._answer(ex, 504, f"no response: {why}")

    # -- metrics ---------------------------------------------------------------------------

    def _count_response(self, ex: Exchange, status: int) -> None:
        ex.att.record(status)


def _stream_idle(ex: Exchange, limits: HttpLimits) -> float | None:
    """How long `ex` may stay quiet: its route's idle timeout, else the workload's."""
    route = ex.att.route
    if route is not None and route.policy.idle_timeout is not None:
        return route.policy.idle_timeout
    return limits.stream_idle_timeout


def _from_peer_proxy(ex: Exchange) -> bool:
    """Whether `ex`'s upstream is a meshed peer's proxy (reached over mTLS)."""
    endpoint = ex.att.endpoint
    return endpoint is not None and endpoint.connect is not None


def _release(ex: Exchange, complete: bool = False) -> None:
    """Tells the balancer the request is over, and its outcome (a no-op without a lease, or
    when repeated); and its taps, whether the client got the whole response (`complete`)."""
    ex.att.finish(complete)
    ex.att.release()
