"""The proxy's HTTP/2 connection to one endpoint (prior knowledge), multiplexing the streams of
every downstream connection that goes there.

An upstream is trusted no more than a client: a connection-level protocol error, a flood or a
peer that stops reading tears down this connection only (its streams get 502, or a reset when
their response had started); a malformed response head on one stream is a 502 for that stream.
A GOAWAY retires the connection from the pool: streams above its last stream id are retried once
elsewhere (or refused), the others finish.

A request reaches this connection as an `H2Sink`: its head, and where its response goes. That is
all the client side knows of what serves the request downstream (`h2stream.ProxyStream` today),
and it imports nothing of the server side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from meshlet.proxy.http.contract import Addr, HttpLimits
from meshlet.proxy.http.h2codec import (
    MAX_WINDOW,
    ErrorCode,
    Header,
    NoStreamIds,
    ProtocolError,
    error_name,
)
from meshlet.proxy.http.h2conn import MAX_RTT, MIN_RTT, Peer
from meshlet.proxy.http.h2guard import Guard, GuardLimits
from meshlet.proxy.http.h2headers import (
    Malformed,
    Response,
    Trailers,
    read_response,
    read_trailers,
)

if TYPE_CHECKING:
    from meshlet.proxy.http.attempts import Failed

log = logging.getLogger(__name__)

# Seconds streams below an error GOAWAY's last stream id may take to finish.
GOAWAY_GRACE: Final = 10.0


class H2Sink(Protocol):
    """One request on an upstream stream, as the connection sees it: the request's head, then
    the events of its response. `closed`: the request is over (a waiter for a stream passes its
    turn); `up_id`: its stream on this connection, once `attach`ed."""

    closed: bool
    up_id: int

    def head(self) -> tuple[Sequence[Header], bool, int]:
        """The request's head, whether it is the whole request (no body, no trailers), and its
        size as SETTINGS_MAX_HEADER_LIST_SIZE counts it (h2codec.header_list_size)."""
        ...

    def attach(self, client: H2Client, up_id: int, headers_ended: bool) -> None: ...

    def refused(self, status: int, reason: str) -> None:
        """The connection will not send the request (its head is over what the upstream said
        it takes): answer it from the proxy with `status`."""
        ...

    def pump_request(self) -> None:
        """Gives the connection what the request holds back (its body, its trailers)."""
        ...

    def on_informational(self, response: Response) -> None: ...

    def on_response(self, response: Response, end: bool) -> None: ...

    def on_response_data(self, data: bytes, flow_len: int, end: bool) -> None: ...

    def on_response_trailers(self, trailers: Trailers) -> None: ...

    def on_up_reset(self, code: int, reason: str = "") -> None:
        """The upstream reset the stream (or sent what the proxy will not relay: `reason`)."""
        ...

    def up_gone(self, reason: str, unprocessed: bool) -> None:
        """The connection failed, or went away without the stream (`unprocessed`)."""
        ...


class Queueable(H2Sink, Protocol):
    """A request that can wait in the pool's line for a stream without a task (H2Pool.open)."""

    def dequeued(self, failed: Failed | None) -> None:
        """Its turn came: it was opened (and attached), or could not be: `failed` says why
        (nothing was sent)."""
        ...


class H2Client(Peer[H2Sink]):
    """One upstream HTTP/2 connection. `retire` is called once when it must take no new streams
    (GOAWAY, failure, idle close). `peer_proxy`: the upstream is a meshed peer's proxy (reached
    over mTLS), whose own error headers are kept. `slots`: the waiters for a stream, shared by
    the pool's connections to one endpoint, so that a stream ending on any of them wakes them."""

    def __init__(
        self,
        addr: Addr,
        limits: HttpLimits,
        guard: GuardLimits,
        retire: Callable[[H2Client], None],
        peer_proxy: bool = False,
        slots: Line | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        # The connection window is the largest allowed: a downstream client that stops reading
        # holds back at most its streams' windows, never the whole shared connection.
        super().__init__(Guard(guard, loop.time()), True, limits.max_body_buffer, MAX_WINDOW,
                         limits.max_header_bytes)  # fmt: skip
        self.addr = addr
        self.peer_proxy = peer_proxy
        self.streams: dict[int, H2Sink] = {}
        self.usable = False  # takes new streams
        # Set at the upstream's first SETTINGS (or failure): streams wait for it, so that the
        # upstream's concurrency limit is known before the first one is opened.
        self.settled: asyncio.Future[None] = loop.create_future()
        self._retire = retire
        self._idle_timeout = limits.idle_timeout
        self._idle_seen = -1
        self._idle_timer: asyncio.TimerHandle | None = None
        self._goaway_timer: asyncio.TimerHandle | None = None
        self._slots = slots if slots is not None else deque()
        self._made_at = 0.0
        # The round trip to the upstream: a client's reset sooner than this after its request
        # was sent came before the upstream could answer (h2guard).
        self.rtt = MAX_RTT

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.usable = True
        self._made_at = self.loop.time()
        self._idle_timer = self.loop.call_later(self._idle_timeout, self._idle_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self.tcp.close(exc)
        self._fail(f"upstream connection lost: {exc}" if exc else "upstream closed the connection")

    # -- streams --

    def open(self, stream: H2Sink) -> bool:
        """Sends the request head of `stream` on a new stream; False when the upstream's
        concurrency limit is reached (wait for `slot`) or the connection is retiring. A head
        over the upstream's SETTINGS_MAX_HEADER_LIST_SIZE is not sent: the stream is refused
        (431), and taken (True)."""
        h2 = self.h2
        if not self.usable:
            return False
        if len(self.streams) >= h2.peer_max_streams:
            return False
        headers, end, size = stream.head()
        limit = h2.peer_max_header_list
        if size > limit:
            # Sent, it would cost every stream of the connection: a peer may answer a list over
            # its limit with a connection error (a meshlet proxy does).
            stream.refused(431, f"request header fields over the {limit} bytes the upstream takes")
            return True
        try:
            up_id = h2.next_stream_id()
        except NoStreamIds:
            self._retire_now()
            return False
        h2.send_headers(up_id, headers, end)
        self.streams[up_id] = stream
        self.guard.stream_opened()
        stream.attach(self, up_id, end)
        self.flush_soon()
        return True

    async def slot(self, first: bool = False) -> None:
        """Waits for a turn at a free stream: a stream closing here or on another connection
        sharing the slots wakes the longest waiter (`first`: a waiter whose turn was taken
        before it ran goes back to the front), a new limit or a retiring connection all of
        them. A waiter cancelled after its turn came passes it on."""
        slot = self.loop.create_future()
        if first:
            self._slots.appendleft(slot)
        else:
            self._slots.append(slot)
        try:
            await slot
        except asyncio.CancelledError:
            if slot.cancelled():
                with contextlib.suppress(ValueError):
                    self._slots.remove(slot)
            else:
                wake_one(self._slots)
            raise

    def _free_slot(self) -> None:
        """A new stream limit, or no more streams here: every waiter tries again."""
        wake_all(self._slots)

    def forget(self, stream: H2Sink) -> None:
        if self.streams.pop(stream.up_id, None) is not None:
            self.waiting.pop(stream.up_id, None)
            wake_one(self._slots)  # one stream free: one turn (waking all cost O(waiters) each)
            if not self.streams and not self.usable:
                self.close_transport()

    def pump(self, stream: H2Sink) -> None:
        stream.pump_request()

    # -- input --

    def _broken(self, exc: ProtocolError) -> None:
        self._fail(f"upstream broke HTTP/2: {exc}")

    def on_head(self, sid: int, headers: Sequence[Header], end: bool) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        response = read_response(headers, self.peer_proxy)
        if isinstance(response, Malformed):
            self.reset(sid, ErrorCode.PROTOCOL_ERROR)
            stream.on_up_reset(
                ErrorCode.PROTOCOL_ERROR, f"bad upstream response: {response.reason}"
            )
            return
        stream.on_response(response, end)

    def on_informational(self, sid: int, headers: Sequence[Header]) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        response = read_response(headers, self.peer_proxy)
        if not isinstance(response, Malformed):
            stream.on_informational(response)

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        if not data and not end:
            self._calm(self.guard.data_frame(empty=True) or self.guard.control_frame(self._now()))
        stream = self.streams.get(sid)
        if stream is None:
            self.h2.acknowledge(sid, flow_len)
            return
        stream.on_response_data(data, flow_len, end)

    def on_trailers(self, sid: int, headers: Sequence[Header]) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        trailers = read_trailers(headers)
        if isinstance(trailers, Malformed):
            self.reset(sid, ErrorCode.PROTOCOL_ERROR)
            stream.on_up_reset(
                ErrorCode.PROTOCOL_ERROR, f"bad upstream trailers: {trailers.reason}"
            )
            return
        stream.on_response_trailers(trailers)

    def on_reset(self, sid: int, code: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            stream.on_up_reset(code)

    def on_window(self, sid: int) -> None:
        self._calm(self.guard.control_frame(self._now()))
        if sid:
            stream = self.waiting.get(sid)
            if stream is not None:
                stream.pump_request()
        else:
            self.pump_waiting()

    def on_settings(self) -> None:
        if not self.settled.done():
            self.rtt = min(max(self.loop.time() - self._made_at, MIN_RTT), MAX_RTT)
            self.settled.set_result(None)
        self._calm(self.guard.control_frame(self._now()))
        self.pump_waiting()  # the initial window may have grown
        self._free_slot()  # ...and the stream limit

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None:
        """RFC 9113 §6.8: no new stream goes on this connection; streams above `last_sid`
        were never processed and go elsewhere; the others finish here (after an error code,
        within GOAWAY_GRACE)."""
        log.info("upstream %s sent GOAWAY %s (last stream %d): %r", self.addr,
                 error_name(code), last_sid, debug[:200])  # fmt: skip
        self._retire_now()
        for up_id, stream in list(self.streams.items()):
            if up_id > last_sid:
                self.h2.forget_stream(up_id)  # never created: no RST_STREAM follows
                stream.up_gone("upstream went away", unprocessed=True)
        if not self.streams:
            self.close_transport()
        elif code != ErrorCode.NO_ERROR and self._goaway_timer is None:
            reason = f"upstream sent GOAWAY {error_name(code)}; its streams did not finish"
            self._goaway_timer = self.loop.call_later(GOAWAY_GRACE, self._fail, reason)

    # -- abuse and failure --

    def _now(self) -> float:
        return self.loop.time()

    def _calm(self, reason: str | None, hard: bool = False) -> None:
        if reason is None or self.closed:
            return
        log.warning("upstream %s: %s; closing it", self.addr, reason)
        self.h2.goaway(0, ErrorCode.ENHANCE_YOUR_CALM)
        self.flush()
        self._fail(f"upstream misbehaved: {reason}")

    def _retire_now(self) -> None:
        if self.usable:
            self.usable = False
            self._retire(self)
        self._free_slot()  # waiters go back to the pool for another connection

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        self._retire_now()
        self.closed = True
        if not self.settled.done():
            self.settled.set_result(None)
        for timer in (self._idle_timer, self._goaway_timer):
            if timer is not None:
                timer.cancel()
        for stream in list(self.streams.values()):
            stream.up_gone(reason, unprocessed=False)
        self.streams.clear()
        self.waiting.clear()
        if self.transport is not None:
            self.close_transport()

    def close(self) -> None:
        """Closes now (the pool is closing); streams in flight fail."""
        if not self.closed:
            self.h2.goaway(0, ErrorCode.NO_ERROR)
            self.flush()
            self._fail("proxy shutting down")

    def _idle_tick(self) -> None:
        if self.closed:
            return
        if not self.streams and self.activity == self._idle_seen:
            self._retire_now()
            self.close()
            return
        self._idle_seen = self.activity
        self._idle_timer = self.loop.call_later(self._idle_timeout, self._idle_tick)


class Turn(Protocol):
    """A request waiting in line for a stream without a task of its own (h2pool.Queued)."""

    def turn(self, front: bool) -> bool:
        """Its turn: True when it took the stream, or went back in line (at the `front`) for
        want of one; False when it passes (its request went away)."""
        ...


# The requests waiting for a stream on an endpoint's connections: a task's future, or a Turn.
Line = deque[asyncio.Future[None] | Turn]


def wake_one(line: Line) -> None:
    """Gives the longest waiter for a stream its turn."""
    while line:
        waiter = line.popleft()
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(None)
                return
        elif waiter.turn(front=True):
            return


def wake_all(line: Line) -> None:
    """Gives every waiter a turn, in order (those finding no stream stay in line)."""
    waiting = list(line)
    line.clear()
    for waiter in waiting:
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(None)
        else:
            waiter.turn(front=False)
