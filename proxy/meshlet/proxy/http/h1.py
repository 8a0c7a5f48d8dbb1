"""The proxy's HTTP/1.1 engine: `serve_h1` serves one accepted connection.

The protocol's decisions are `h1exchange.H1Machine`'s (parsing with httptools, checking heads
with `h1head`, relaying bodies piece by piece with back-pressure both ways, pipelining, upgrades,
local answers to hostile input, timers, failover and route policy). This module is its shell:
the asyncio Protocol on the client connection, the effects on transports (`Io`), and the task
that routes each exchange (`conn.router`) and connects it (pooled upstream connections:
`h1client`, `h1pool`).

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
  505  versions other than HTTP/1.0 and 1.1
  405  CONNECT (but as the first request of an outbound connection that was not redirected,
       which outbound/tunnel.py answers before this engine sees it)
  408  a head not complete within `header_read_timeout` (from the accept), a request body that
       stalls for `idle_timeout`, or one slower than the minimum body rate
After such an answer the connection is half-closed and the client's bytes are read and dropped
for up to LINGER_SECONDS, so that the answer is not lost to a reset. Route errors are answered
with their status and keep the connection when the rest of the body can be drained. Upstream
failures are answered with `meshlet-proxy-error`: 502 when the connection is refused, reset or
closed before a response, or the response is invalid; 504 when connecting times out or the
route's timeout passes. A response cut short aborts the client connection (never a truncated body
presented as complete). Idle keep-alive connections close after `idle_timeout`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import TYPE_CHECKING, Any, cast

from meshlet.proxy.http.attempts import Answer, Failed, Sending, Step, advance
from meshlet.proxy.http.contract import Connect, Endpoint, HttpConn, RouteTarget, Wait, settle
from meshlet.proxy.http.h1client import H1Upstream, UpstreamConn
from meshlet.proxy.http.h1exchange import Exchange, H1Machine
from meshlet.proxy.http.h1pool import H1Pool, PoolKey
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.io import relay
from meshlet.proxy.io.counters import TcpConn
from meshlet.proxy.io.sockets import write_pieces
from meshlet.proxy.tls.transport import tls_accept

if TYPE_CHECKING:
    from meshlet.proxy.http.h2pool import H2Pool
    from meshlet.proxy.http.orig_proto import Upgrade

log = logging.getLogger(__name__)

# An exchange and the step of its Attempts to carry out (None: the first); an upgraded
# connection's relay; None: the connection is gone.
_Event = tuple[Exchange, Step | None] | asyncio.Future[None] | None


async def serve_h1(conn: HttpConn, pool: H1Pool | None = None, h2: H2Pool | None = None) -> None:
    """Serves HTTP/1.1 on `conn.sock` (or `conn.handoff`) until the connection closes.

    Upstream connections come from `pool` (share one per listener to reuse them across client
    connections); without one, a pool private to this connection is used and closed with it.
    With `h2` (the process's HTTP/2 pool), requests for an endpoint whose proxy takes HTTP/2
    (`Endpoint.h2`) go as streams of its connections (orig_proto.py)."""
    loop = asyncio.get_running_loop()
    private = pool is None
    if pool is None:
        pool = H1Pool(conn.limits.pool_idle_timeout)
    shell = H1Shell(conn, pool, h2)
    sock = cast(socket.socket, conn.sock)
    try:
        if conn.handoff is not None:
            conn.handoff.adopt(shell)
        elif conn.ssl is None:
            await loop.connect_accepted_socket(lambda: shell, sock=sock)
        else:
            await tls_accept(sock, conn.ssl, lambda: shell,
                             handshake_timeout=conn.limits.header_read_timeout)  # fmt: skip
    except (OSError, TimeoutError) as exc:  # e.g. a failed TLS handshake; the socket is closed
        log.debug("HTTP/1 connection not established: %s", exc)
        return

    def closing(task: asyncio.Task[Any]) -> None:
        if not task.cancelled():
            shell.shutdown()

    watch = loop.create_task(conn.closing.wait())
    watch.add_done_callback(closing)
    try:
        await shell.run()
    finally:
        watch.cancel()
        shell.abort()
        if private:
            pool.close()


class H1Shell(asyncio.Protocol):
    """The client connection's Protocol, the machine's `Io`, the routing task, and the
    `attempts.Upstream` of the exchange in flight (one at a time)."""

    def __init__(self, conn: HttpConn, pool: H1Pool, h2: H2Pool | None = None) -> None:
        self._conn = conn
        self._pool = pool
        self._h2 = h2
        self._loop = asyncio.get_running_loop()
        self._transport = cast(asyncio.Transport, None)  # set by connection_made
        self.machine: H1Machine | None = None
        self._events: collections.deque[_Event] = collections.deque()
        self._waiter: asyncio.Future[_Event] | None = None
        self._busy = False  # the task is routing or connecting an exchange
        self._timer: asyncio.TimerHandle | None = None
        self._tunnel: asyncio.Transport | None = None  # the upstream, after an upgrade
        self._ex: Exchange | None = None  # the exchange its Attempts are sending
        self._tcp = conn.tcp or TcpConn.uncounted()
        self.now = self._loop.time  # Io.now

    # -- the task: routing and connecting, one exchange at a time ------------------------

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
            self._busy = True
            try:
                await self._start(*event)
            finally:
                self._busy = False

    def _signal(self, event: _Event) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
        else:
            self._events.append(event)

    async def _start(self, ex: Exchange, step: Step | None) -> None:
        """Carries out `step` of `ex`'s Attempts (its first when None), waiting as needed."""
        machine = self.machine
        assert machine is not None
        if machine.abandoned(ex):
            return
        self._ex = ex
        att = ex.att
        if step is None:
            step = att.start()
            if att.route is not None:
                machine.routed(ex, att.route)
        await advance(att, self, step, self._loop.time)

    # -- attempts.Upstream: the exchange in flight ----------------------------------------

    def gone(self) -> bool:
        ex, machine = self._ex, self.machine
        return ex is None or machine is None or machine.abandoned(ex)

    def routed(self, route: RouteTarget) -> None:
        if self._ex is not None and self.machine is not None:
            self.machine.routed(self._ex, route)

    def send(self, endpoint: Endpoint, fresh: bool) -> Wait | None:
        ex, machine = self._ex, self.machine
        assert ex is not None and machine is not None
        head = ex.head
        if (
            endpoint.h2 is not None
            and self._h2 is not None
            and not head.http10
            and not head.upgrade
        ):
            return self._upgrade(ex, endpoint, endpoint.h2, self._h2)
        key = (endpoint.connect or self._conn.connect, endpoint.addr)
        if not fresh:
            upstream = self._pool.take(key)
            if upstream is not None:
                machine.attach(ex, upstream, key)
                return None
        return Wait(self._connect, (ex, endpoint, key))

    def _upgrade(self, ex: Exchange, endpoint: Endpoint, via: Connect, pool: H2Pool) -> Wait | None:
        """Sends the exchange as a stream of the endpoint proxy's HTTP/2 connection (HTTP/1.0
        and upgrades cannot go so)."""
        from meshlet.proxy.http.orig_proto import Upgrade  # opt-in: imported when used

        stream = Upgrade(ex.head, self._conn.limits)
        opening = pool.open(endpoint._replace(connect=via), stream, self._counts)
        if opening is None and stream.refusal is None:
            assert self.machine is not None
            self.machine.attach(ex, stream, None)
            return None
        return Wait(self._upgraded, (ex, stream, opening))

    async def _upgraded(self, args: tuple[Exchange, Upgrade, Wait | None]) -> Failed | None:
        """The stream opened (then attached to the exchange), or why not; answered here (in
        the task: `send` may run inside a parser callback) when the connection refused it."""
        ex, stream, opening = args
        failed: Failed | None = None if opening is None else await settle(opening)
        machine = self.machine
        if failed is not None:
            stream.closed = True
            return failed
        if machine is None or machine.abandoned(ex):
            stream.abort()
            return None
        if stream.refusal is not None:
            machine.answer(ex, *stream.refusal)
        else:
            machine.attach(ex, stream, None)
        return None

    def _counts(self, endpoint: Endpoint) -> TcpConn:
        """The counts of a new connection to `endpoint`."""
        conn = self._conn
        return conn.metrics.dst_conn(conn.labels.direction, endpoint.addr, endpoint.labels)

    async def _connect(self, args: tuple[Exchange, Endpoint, PoolKey]) -> Failed | None:
        """A new connection to the endpoint, attached to the exchange; or why it failed."""
        ex, endpoint, key = args
        machine = self.machine
        assert machine is not None
        upstream = await self._pool.dial(key, self._conn.limits, self._counts(endpoint))
        if isinstance(upstream, Failed):
            return upstream
        if machine.abandoned(ex):
            self._pool.give(key, upstream)
            return None
        machine.attach(ex, upstream, key)
        return None

    def answer(self, status: int, reason: str) -> None:
        if self._ex is not None and self.machine is not None:
            self.machine.answer(self._ex, status, reason)

    # -- asyncio.Protocol: the client connection ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        conn = self._conn
        if conn.shedder is not None:
            conn.shedder.add(self, conn.labels.direction)
        high = conn.limits.max_body_buffer
        self._transport.set_write_buffer_limits(high, high // 4)
        self.machine = H1Machine(
            self, conn.limits, Recorder(conn.metrics, conn.labels, conn.observer), conn.router,
            tuple(conn.add_headers), conn.accepted_at,
        )  # fmt: skip

    def data_received(self, data: bytes) -> None:
        assert self.machine is not None
        self._tcp.read += len(data)
        self.machine.data(data)

    def eof_received(self) -> bool:
        # A client that half-closes after a complete request still gets its response (over
        # TLS too: the proxy's TLS transport half-closes, tls/transport.py).
        can_half_close = self._transport.can_write_eof()
        return self.machine is not None and self.machine.eof() and can_half_close

    def connection_lost(self, exc: Exception | None) -> None:
        self._tcp.close(exc)
        if self._conn.shedder is not None:
            self._conn.shedder.remove(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.machine is not None:
            self.machine.lost()
        self._signal(None)

    def pause_writing(self) -> None:
        if self.machine is not None:
            self.machine.write_paused()

    def resume_writing(self) -> None:
        if self.machine is not None:
            self.machine.write_resumed()

    def shutdown(self) -> None:
        if self.machine is not None:
            self.machine.shutdown()

    def abort(self) -> None:
        """Closes whatever is still open (the serving task ends, maybe cancelled)."""
        if self.machine is not None:
            self.machine.abort()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for transport in (self._transport, self._tunnel):
            if transport is not None and not transport.is_closing():
                transport.abort()

    # -- core.pressure.Peer: what the load shedder weighs ---------------------------------

    def progress(self) -> int:
        return self._tcp.read + self._tcp.written

    def holds(self) -> tuple[int, int]:
        machine = self.machine
        buffered = self._transport.get_write_buffer_size()
        if machine is None or machine.current is None:
            return 0, buffered
        return 1, buffered + machine.current.buffered()

    def shed(self, why: str) -> None:
        if self.machine is not None:
            self.machine.shed(why)

    # -- Io: the machine's effects ----------------------------------------------------------

    def write(self, chunks: list[bytes]) -> None:
        self._tcp.written += write_pieces(self._transport, chunks)

    def close(self, linger: float) -> None:
        transport = self._transport
        if linger <= 0 or not transport.can_write_eof() or transport.is_closing():
            transport.close()
            return
        transport.write_eof()
        transport.resume_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(linger, transport.close)

    def abort_client(self) -> None:
        self._transport.abort()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if when != float("inf"):
            self._timer = self._loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.machine is not None:
            self.machine.tick()

    def start(self, exchange: Exchange, step: Step | None) -> None:
        """Sends the exchange at once when nothing needs waiting (discovery has answered, the
        pick is immediate, an idle connection is pooled): the common case, with no turn of the
        task. Else the task carries on. It may run inside a parser callback, so it only ever
        ends in `attach`: answers are left to the task."""
        if self._busy or self._events:
            self._signal((exchange, step))
            return
        att = exchange.att
        try:
            if step is None:
                step = att.start()
                if att.route is not None and self.machine is not None:
                    self.machine.routed(exchange, att.route)
            if isinstance(step, Endpoint):
                self._ex = exchange
                sending = self.send(step, False)
                if sending is None:
                    att.sent()
                    return
                step = Sending(sending)
        except Exception:
            log.exception("routing a request for %r failed", exchange.head.authority)
            step = Answer(502, "routing failed in the proxy")
        self._signal((exchange, step))

    def give_back(self, exchange: Exchange, upstream: UpstreamConn, reusable: bool) -> None:
        if reusable and exchange.key is not None and isinstance(upstream, H1Upstream):
            upstream.detach()
            self._pool.give(exchange.key, upstream)
        else:
            upstream.close()

    def tunnel(self, exchange: Exchange, upstream: UpstreamConn, rest: bytes) -> None:
        """Both connections are relayed as they are from now on (after a 101)."""
        server = upstream.transport
        if server is None:
            return
        client_side, upstream_side, done = relay.pair(self._loop, self._tcp, None, upstream.tcp)
        client = self._transport
        client_side.connection_made(client)
        upstream_side.connection_made(server)
        client.set_protocol(client_side)
        server.set_protocol(upstream_side)
        if rest:
            self._tcp.written += len(rest)
            client.write(rest)
        client.resume_reading()
        server.resume_reading()
        self._tunnel = server
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._signal(done)
