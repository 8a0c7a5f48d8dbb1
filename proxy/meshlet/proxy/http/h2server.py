"""The proxy's HTTP/2 server side: serves one accepted connection (`serve_h2`), relaying each
stream to the endpoint its authority routes to over the pooled upstream connection.

Hostile clients are bounded here: streams past `max_concurrent_streams` are refused
(REFUSED_STREAM, the connection lives), malformed requests reset their stream (PROTOCOL_ERROR),
and rapid resets, control-frame floods, empty-frame floods or a client that stops reading while
its output piles up close the connection with GOAWAY ENHANCE_YOUR_CALM (`h2guard`). The codec caps
CONTINUATION frames and HPACK header lists (GOAWAY). At shutdown (`conn.closing`) the server sends
GOAWAY with the last stream it took, finishes those, then closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from meshlet.api.hostport import format_hostport
from meshlet.proxy.http.attempts import Attempts, Step, advance, advance_now, begin
from meshlet.proxy.http.contract import Endpoint, HttpConn, Wait
from meshlet.proxy.http.h1pool import H1Pool
from meshlet.proxy.http.h2codec import ErrorCode, Header, ProtocolError, error_name
from meshlet.proxy.http.h2conn import Peer
from meshlet.proxy.http.h2guard import Guard, GuardLimits
from meshlet.proxy.http.h2headers import Malformed, local_response, read_request, read_trailers
from meshlet.proxy.http.h2pool import H2Pool
from meshlet.proxy.http.h2stream import ProxyStream
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.tls.transport import tls_accept

if TYPE_CHECKING:
    from meshlet.proxy.io.counters import TcpConn

log = logging.getLogger(__name__)

# The downstream connection window, in stream windows: what one client can have in flight.
CONN_WINDOW_STREAMS: Final = 4
_MIN_IDLE_CHECK: Final = 0.01  # seconds between checks of streams' idle timeouts, at least
CALM_GRACE: Final = 10.0  # seconds streams in flight may take to finish after the guard trips


async def serve_h2(
    conn: HttpConn,
    pool: H2Pool | None = None,
    guard: GuardLimits | None = None,
    h1_pool: H1Pool | None = None,
) -> None:
    """Serves one accepted HTTP/2 connection (`conn.sock`, or `conn.handoff`) until it closes.

    `pool` is the process's shared upstream pool (one connection per endpoint); the application
    makes one and passes it (e.g. `functools.partial(serve_h2, pool=pool)`). Without it the
    connection gets a pool of its own, closed with it. `h1_pool` holds the HTTP/1.1 connections
    to the app of the requests a peer proxy sent as HTTP/1.1 (`conn.from_proxy`); likewise."""
    own_h1 = h1_pool is None
    if h1_pool is None:
        h1_pool = H1Pool(conn.limits.pool_idle_timeout)
    try:
        if pool is None:
            async with H2Pool(conn.connect, conn.limits, guard) as own:
                await _serve(conn, own, guard or GuardLimits(), h1_pool)
        else:
            await _serve(conn, pool, guard or GuardLimits(), h1_pool)
    finally:
        if own_h1:
            h1_pool.close()


async def _serve(conn: HttpConn, pool: H2Pool, guard: GuardLimits, h1_pool: H1Pool) -> None:
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tasks:
        server = H2Server(conn, pool, tasks, guard, h1_pool)
        if conn.handoff is not None:
            conn.handoff.adopt(server)
        else:
            sock = conn.sock
            assert isinstance(sock, socket.socket)
            try:
                if conn.ssl is None:
                    await loop.connect_accepted_socket(lambda: server, sock=sock)
                else:
                    await tls_accept(sock, conn.ssl, lambda: server,
                                     handshake_timeout=conn.limits.header_read_timeout)  # fmt: skip
            except (OSError, TimeoutError) as exc:
                log.debug("HTTP/2 connection not established: %r", exc)
                sock.close()
                return
        closing = tasks.create_task(conn.closing.wait())
        closing.add_done_callback(server.on_closing)
        try:
            await server.done
        finally:
            closing.cancel()
            server.abort()


class H2Server(Peer[ProxyStream]):
    def __init__(
        self,
        conn: HttpConn,
        pool: H2Pool,
        tasks: asyncio.TaskGroup,
        guard: GuardLimits,
        h1_pool: H1Pool,
    ) -> None:
        limits = conn.limits
        loop = asyncio.get_running_loop()
        # A peer proxy sends HTTP/1.1 heads its HTTP/1 engine took, as HTTP/2 (orig_proto.py):
        # in HTTP/2's measure a field counts 28 bytes more, and the pseudo-headers 32 each.
        # Its head has the 4 pseudo-headers and the mark beside the fields it was taken with.
        max_header_bytes = limits.max_header_bytes
        self._max_headers = limits.max_headers
        if conn.from_proxy:
            max_header_bytes += 28 * limits.max_headers + 4 * 32
            self._max_headers += 5
        super().__init__(Guard(guard, loop.time()), False, limits.max_body_buffer,
                         CONN_WINDOW_STREAMS * limits.max_body_buffer, max_header_bytes,
                         limits.max_concurrent_streams)  # fmt: skip
        self.conn = conn
        self.pool = pool
        self.h1_pool = h1_pool
        self.done: asyncio.Future[None] = loop.create_future()
        self.streams: dict[int, ProxyStream] = {}
        self._tasks = tasks
        self._forwarding: set[asyncio.Task[None]] = set()
        self._labels = conn.labels.values()
        self._direction = conn.labels.direction
        self._max_streams = limits.max_concurrent_streams
        self._last_taken = 0  # the highest stream id taken: the GOAWAY's last stream id
        self._draining = False
        self._calmed = False  # the guard tripped: GOAWAY sent, streams in flight finishing
        self._calm_timer: asyncio.TimerHandle | None = None
        self._idle_seen = -1
        self._idle_timer: asyncio.TimerHandle | None = None
        # Armed while a stream has an idle timeout (opt-in): checks streams every quarter of it.
        self._stream_timer: asyncio.TimerHandle | None = None
        self.recorder = Recorder(conn.metrics, conn.labels, conn.observer)
        if conn.tcp is not None:
            self.tcp = conn.tcp

    # -- connection --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.conn.shedder is not None:
            self.conn.shedder.add(self, self._direction)
        limits = self.conn.limits
        self._idle_timer = self.loop.call_later(limits.idle_timeout, self._idle_tick)
        if self.conn.closing.is_set():
            self.shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.tcp.close(exc)
        if self.conn.shedder is not None:
            self.conn.shedder.remove(self)
        for timer in (self._idle_timer, self._stream_timer, self._calm_timer):
            if timer is not None:
                timer.cancel()
        for stream in list(self.streams.values()):
            stream.down_gone()
        for task in self._forwarding:
            task.cancel()
        if not self.done.done():
            self.done.set_result(None)

    def on_closing(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled():
            self.shutdown()

    def shutdown(self) -> None:
        """Graceful: GOAWAY naming the last stream taken; those finish, then the connection
        closes."""
        if self._draining or self.closed:
            return
        self._draining = True
        self.write_goaway(self._last_taken, ErrorCode.NO_ERROR)
        if not self.streams:
            self.close_transport()

    def abort(self) -> None:
        """Closes at once (the grace period is over or the serving task was cancelled)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def pump(self, stream: ProxyStream) -> None:
        stream.pump_response()

    # -- input --

    def _broken(self, exc: ProtocolError) -> None:
        log.info("HTTP/2 client broke the protocol: %s", exc)
        self.count_error(exc.code)
        self.closed = True  # the codec takes no more input
        for stream in list(self.streams.values()):
            stream.down_gone()
        self.close_transport()

    def on_head(self, sid: int, headers: Sequence[Header], end: bool) -> None:
        if self._draining:  # after our GOAWAY: not taken (RFC 9113 §6.8), work that earns nothing
            self.count_error(ErrorCode.REFUSED_STREAM)
            self.reset(sid, ErrorCode.REFUSED_STREAM)
            self._calm(self.guard.control_frame(self._now()))
            return
        if len(self.streams) >= self._max_streams:
            self.count_error(ErrorCode.REFUSED_STREAM)
            self._refuse(sid, ErrorCode.REFUSED_STREAM)
            return
        self.guard.stream_opened()
        self._last_taken = sid
        limits = self.conn.limits
        conn = self.conn
        request = read_request(
            headers,
            conn.add_headers,
            self._max_headers,
            limits.escaped_slashes,
            conn.from_proxy,
            self.h2.decoder.last_size,
        )
        if not isinstance(request, Malformed) and request.orig_proto:
            from meshlet.proxy.http.orig_proto import refusal  # a peer's opt-in: when used

            request = refusal(request) or request
        if isinstance(request, Malformed):
            log.debug("malformed request on stream %d: %s", sid, request.reason)
            self.count_error(request.status)
            if request.answer:  # well-formed, only refused (too big, a target): say so
                answer = local_response(request.status, request.reason, False)
                self.h2.send_headers(sid, answer, True)
                if not end:
                    self.reset(sid, ErrorCode.NO_ERROR)
                self.flush_soon()
            else:
                self._refuse(sid, ErrorCode.PROTOCOL_ERROR)
            return
        if end and request.length > 0:  # RFC 9113 §8.1.1: no body, yet a length
            log.debug("malformed request on stream %d: content-length without a body", sid)
            self.count_error(ErrorCode.PROTOCOL_ERROR)
            self._refuse(sid, ErrorCode.PROTOCOL_ERROR)
            return
        att = Attempts(self.conn.router, self.recorder, request, self.loop.time())
        stream = ProxyStream(self, sid, request, att)
        stream.req.ended = end
        self.streams[sid] = stream
        idle = self.conn.limits.stream_idle_timeout
        if idle is not None:
            self.watch_idle(idle)
        try:
            rest = begin(att, stream)
        except Exception:
            log.exception("forwarding stream %d failed", sid)
            stream.answer(502, "proxy error")
            return
        if rest is not None:
            self._advance(stream, rest)

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        if not data and not end:
            self._calm(self.guard.data_frame(empty=True) or self.guard.control_frame(self._now()))
        else:
            self.guard.data_frame(empty=False)
        stream = self.streams.get(sid)
        if stream is None:  # answered or reset already: credit the bytes and drop them
            self.h2.acknowledge(sid, flow_len)
            return
        stream.on_request_data(data, flow_len, end)

    def on_trailers(self, sid: int, headers: Sequence[Header]) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        trailers = read_trailers(headers)
        if isinstance(trailers, Malformed):
            self.count_error(400)
            self.reset(stream.down_id, ErrorCode.PROTOCOL_ERROR)
            stream.on_down_reset(ErrorCode.PROTOCOL_ERROR)
            self._calm(self.guard.stream_reset(self._now()))
            return
        stream.on_request_trailers(list(trailers.headers))

    def on_reset(self, sid: int, code: int) -> None:
        """The client reset a stream (or the codec did, for a stream error)."""
        stream = self.streams.get(sid)
        now = self._now()
        if stream is None:  # one the codec reset for the client's error, before it was served
            self._calm(self.guard.stream_reset(now))
            return
        early = stream.early(now)
        stream.on_down_reset(code)
        if early:  # before the upstream could answer: what a rapid reset does
            self._calm(self.guard.stream_reset(now))

    def on_window(self, sid: int) -> None:
        self._calm(self.guard.control_frame(self._now()))
        if sid:
            stream = self.waiting.get(sid)
            if stream is not None:
                stream.pump_response()
        else:
            self.pump_waiting()

    def on_settings(self) -> None:
        self._calm(self.guard.control_frame(self._now()))
        self.pump_waiting()  # the initial window may have grown

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None:
        if code:
            log.info("HTTP/2 client closed with %s", error_name(code))
            self.close_transport()
            return
        self._draining = True  # the client opens no more streams; finish what is in flight
        if not self.streams:
            self.close_transport()

    # -- streams --

    def forward(self, stream: ProxyStream, step: Step) -> None:
        """Sends `stream` again as its Attempts say (a retry): at once when nothing needs
        waiting, else in a task this connection owns."""
        try:
            rest = advance_now(stream.att, stream, step)
        except Exception:
            log.exception("forwarding stream %d failed", stream.down_id)
            stream.answer(502, "proxy error")
            return
        if rest is not None:
            self._advance(stream, rest)

    def _advance(self, stream: ProxyStream, step: Step) -> None:
        if self.closed:
            stream.att.release()
            return
        stream.task = task = self._tasks.create_task(self._carry(stream, step))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)

    async def _carry(self, stream: ProxyStream, step: Step) -> None:
        try:
            await advance(stream.att, stream, step, self.loop.time)
        except Exception:
            log.exception("forwarding stream %d failed", stream.down_id)
            stream.answer(502, "proxy error")

    def downgrade(self, stream: ProxyStream, endpoint: Endpoint, fresh: bool) -> Wait | None:
        """Sends a request a peer proxy sent as HTTP/1.1 to `endpoint` as such (ProxyStream.send
        for `request.orig_proto`)."""
        from meshlet.proxy.http.orig_proto import downgrade

        return downgrade(self, self.h1_pool, stream, endpoint, fresh)

    def upstream_counts(self, endpoint: Endpoint) -> TcpConn:
        """The counts of a new upstream connection to `endpoint`."""
        return self.conn.metrics.dst_conn(self._direction, endpoint.addr, endpoint.labels)

    def forget(self, stream: ProxyStream) -> None:
        self.streams.pop(stream.down_id, None)
        self.waiting.pop(stream.down_id, None)
        if self._draining and not self.streams:
            self.flush()
            self.close_transport()

    def malformed(self) -> None:
        """A stream the proxy reset for the client's malformed message: it counts as a reset
        before the upstream could answer."""
        self._calm(self.guard.stream_reset(self._now()))

    def _refuse(self, stream_id: int, code: ErrorCode) -> None:
        self.reset(stream_id, code)
        self._calm(self.guard.stream_reset(self._now()))

    # -- core.pressure.Peer: what the load shedder weighs --

    def progress(self) -> int:
        return self.tcp.read + self.tcp.written

    def holds(self) -> tuple[int, int]:
        transport = self.transport
        buffered = transport.get_write_buffer_size() if transport is not None else 0
        for stream in self.streams.values():
            buffered += stream.req.size + stream.resp.size
        return len(self.streams), buffered

    def shed(self, why: str) -> None:
        """Under pressure the proxy drops this connection: GOAWAY ENHANCE_YOUR_CALM, its streams
        reset and their upstream streams cancelled."""
        if self.closed:
            return
        self.count_error(ErrorCode.ENHANCE_YOUR_CALM)
        self.h2.goaway(self._last_taken, ErrorCode.ENHANCE_YOUR_CALM, b"shed under load")
        self._close_now()

    # -- abuse --

    def _now(self) -> float:
        return self.loop.time()

    def _calm(self, reason: str | None, hard: bool = False) -> None:
        """The guard tripped: GOAWAY ENHANCE_YOUR_CALM naming the last stream taken; streams
        in flight may finish (within CALM_GRACE), new ones are refused. A second trip, or a
        peer that does not read (`hard`), closes the connection at once."""
        if reason is None or self.closed:
            return
        if not self._calmed:
            self.count_error(ErrorCode.ENHANCE_YOUR_CALM)
            self.h2.goaway(self._last_taken, ErrorCode.ENHANCE_YOUR_CALM, reason.encode()[:256])
            self.flush()
        if self._calmed or hard or not self.streams:
            log.warning("HTTP/2 client %s: %s; closing the connection", self._peer(), reason)
            self._close_now()
            return
        log.warning("HTTP/2 client %s: %s; GOAWAY, its %d streams in flight may finish",
                    self._peer(), reason, len(self.streams))  # fmt: skip
        self._calmed = self._draining = True
        self._calm_timer = self.loop.call_later(CALM_GRACE, self._close_now)

    def _close_now(self) -> None:
        if self.closed:
            return
        for stream in list(self.streams.values()):
            stream.down_gone()
        self.flush()
        self.closed = True  # nothing more is read or written
        self.close_transport()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return format_hostport(peer[0], peer[1]) if peer else "?"

    def _idle_tick(self) -> None:
        if self.closed:
            return
        if not self.streams and self.activity == self._idle_seen:
            log.debug("HTTP/2 connection idle for %ss: closing", self.conn.limits.idle_timeout)
            self.shutdown()
            self.close_transport()
            return
        self._idle_seen = self.activity
        self._idle_timer = self.loop.call_later(self.conn.limits.idle_timeout, self._idle_tick)

    def watch_idle(self, idle: float) -> None:
        """A stream may stay quiet only `idle` seconds (a configured stream idle timeout):
        streams are checked every quarter of it from now on."""
        if self._stream_timer is None and not self.closed:
            period = max(idle / 4, _MIN_IDLE_CHECK)
            self._stream_timer = self.loop.call_later(period, self._stream_tick, period)

    def _stream_tick(self, period: float) -> None:
        """Ends the streams that moved no byte either way for their idle timeout."""
        self._stream_timer = None
        if self.closed:
            return
        now = self.loop.time()
        watched = False
        for stream in list(self.streams.values()):
            idle = stream.idle_timeout()
            if idle is None or stream.closed:
                continue
            watched = True
            if stream.quiet_for(now) >= idle:
                stream.idle_out(idle)
        if watched:
            self._stream_timer = self.loop.call_later(period, self._stream_tick, period)

    # -- metrics --

    def count_error(self, status: int | ErrorCode) -> None:
        """Requests or connections refused for their input, by status sent (or HTTP/2 error
        code name for resets and GOAWAYs)."""
        label = error_name(status).lower() if isinstance(status, ErrorCode) else str(status)
        self.recorder.error(label)
