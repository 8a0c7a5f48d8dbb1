"""One connection to the tap server, once its TLS handshake is done: HTTP/2 on the proxy's own
engine (`http/h2codec.py`, `http/h2conn.py`) with the data plane's abuse guard (`h2guard`), and
on it the Observe calls of the tap controller, or the refusal of every call of anyone else.

Who is calling is decided in `connection_made`, from the verified client certificate, before
a byte of HTTP/2 is read (`admit`). A client whose identity is not the tap controller's is not
served: its first call is answered PERMISSION_DENIED from its head alone (a trailers-only
response, its stream reset so that the client stops sending), then GOAWAY, and the connection
stops reading and closes `refused_linger` seconds later (`request_timeout` after the handshake
at the latest, call or not). Its request message is never read, however large it says it is:
its bytes stay in the kernel's socket buffers.

The tap controller's calls are bounded as the data plane's streams are: `max_streams` calls at
once (REFUSED_STREAM past them), a head within `max_header_bytes`, one request message of at
most `max_message` bytes (RESOURCE_EXHAUSTED as soon as its 5-byte prefix says more, nothing
of it kept), which must arrive whole within `request_timeout` (DEADLINE_EXCEEDED); malformed
heads reset their stream. Rapid resets (calls reset before their request was whole, or refused),
control-frame and empty-frame floods, a peer that does not read, or one that breaks HTTP/2 close
the connection, with GOAWAY ENHANCE_YOUR_CALM for abuse. A connection with no call and no byte
for `idle_timeout` seconds is closed with GOAWAY.

A call's events go out as its client's flow-control windows and the transport allow; events
wait in the tap's own bounded buffer (tap/taps.py), never here: a call holds at most one
event's frame of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from meshlet.api.hostport import format_hostport
from meshlet.proxy.http.h2codec import ErrorCode, Header, ProtocolError, StreamClosed
from meshlet.proxy.http.h2conn import Peer
from meshlet.proxy.http.h2guard import Guard, GuardLimits
from meshlet.proxy.http.h2headers import Malformed
from meshlet.proxy.tap.grpcwire import (
    RESPONSE_HEAD,
    MessageReader,
    Refusal,
    Status,
    message_frame,
    read_call,
    refusal_head,
    trailers,
)
from meshlet.proxy.tls.contexts import cert_identity

if TYPE_CHECKING:
    from meshlet.proxy.tap.taps import Tap

log = logging.getLogger(__name__)

OBSERVE_PATH: Final = b"/io.linkerd.proxy.tap.Tap/Observe"
STREAM_WINDOW: Final = 65_535  # what a call may send before its bytes are read
CONN_WINDOW: Final = 4 * STREAM_WINDOW


@dataclass(frozen=True, slots=True)
class TapLimits:
    """Every bound of the tap server (docs/tap.md lists them)."""

    max_connections: int = 64  # open at once, handshakes included; more are closed at accept
    handshake_timeout: float = 10.0  # seconds for the TLS handshake
    max_message: int = 64 * 1024  # bytes of one ObserveRequest
    max_streams: int = 16  # calls at once on one connection
    max_header_bytes: int = 16 * 1024  # a call's head, decoded
    max_headers: int = 64  # fields in a call's head
    request_timeout: float = 10.0  # seconds from a call's head to its whole request message
    idle_timeout: float = 60.0  # seconds a connection with no call may stay quiet
    refused_linger: float = 1.0  # seconds a refused client has to read its answer
    guard: GuardLimits = field(default_factory=GuardLimits)


class Calls(Protocol):
    """The Observe service behind the connections (server.py)."""

    def open(self, message: bytes) -> Tap | Refusal:
        """A call's request message: the tap it opens, or why not."""

    def close(self, tap: Tap) -> None:
        """A call is over: its tap is removed."""


class Refusals(Protocol):
    """Where refused connections are counted, by reason (metrics.TapCounts)."""

    def refused(self, reason: str) -> None: ...


def admit(client: str | None, allowed: str) -> Refusal | None:
    """Whether a client proving `client` may tap this proxy (None: it may)."""
    if client is None:
        return Refusal(Status.UNAUTHENTICATED, "tap needs a client certificate naming a DNS SAN")
    if client != allowed:
        return Refusal(Status.PERMISSION_DENIED, f"{client} may not tap this proxy")
    return None


class Call:
    """One Observe call: its request message being read, then its tap's events going out."""

    __slots__ = ("ended", "frame", "reader", "scheduled", "sid", "tap", "timer")

    def __init__(self, sid: int, reader: MessageReader, timer: asyncio.TimerHandle) -> None:
        self.sid = sid
        self.reader = reader
        self.timer: asyncio.TimerHandle | None = timer  # the request message's deadline
        self.tap: Tap | None = None  # once the request is read and the tap open
        self.frame = b""  # the unsent rest of one event's DATA
        self.ended = False  # the client's side of the stream ended
        self.scheduled = False  # a pump is due on the loop


class TapConnection(Peer[Call]):
    """One client's connection: serves its calls, or refuses them (module docstring)."""

    def __init__(self, calls: Calls, allowed: str, limits: TapLimits, counts: Refusals) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(Guard(limits.guard, loop.time()), False, STREAM_WINDOW, CONN_WINDOW,
                         limits.max_header_bytes, limits.max_streams)  # fmt: skip
        self.calls = calls
        self.allowed = allowed
        self.limits = limits
        self.counts = counts
        self.client: str | None = None
        self.refusal: Refusal | None = None  # set for a client that is not allowed
        self.streams: dict[int, Call] = {}
        self.done: asyncio.Future[None] = loop.create_future()
        self._last_sid = 0  # the highest stream id taken: a GOAWAY's last stream id
        self._draining = False
        self._idle_seen = -1
        self._timer: asyncio.TimerHandle | None = None  # the idle check, or the linger

    # -- connection --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client = cert_identity(transport.get_extra_info("peercert"))
        self.refusal = admit(self.client, self.allowed)
        super().connection_made(transport)
        if self.refusal is not None:  # its call is answered, or it is closed in any case
            self.counts.refused("identity")
            log.info("tap: refused %s: %s", self._peer(), self.refusal.message)
            self._timer = self.loop.call_later(self.limits.request_timeout, self._close_now)
            return
        self._timer = self.loop.call_later(self.limits.idle_timeout, self._idle_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        for call in list(self.streams.values()):
            self._forget(call)
        if not self.done.done():
            self.done.set_result(None)

    def abort(self) -> None:
        """Closes at once (the server stops)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def _close_now(self) -> None:
        if self.closed:
            return
        self.flush()
        for call in list(self.streams.values()):
            self._forget(call)
        self.closed = True  # nothing more is read or written
        self.close_transport()

    # -- input --

    def on_head(self, sid: int, headers: Sequence[Header], end: bool) -> None:
        if self.refusal is not None:
            self._refuse_client(sid, end)
            return
        if self._draining or len(self.streams) >= self.limits.max_streams:
            self.reset(sid, ErrorCode.REFUSED_STREAM)
            self._calm(self.guard.stream_reset(self._now()))
            return
        self.guard.stream_opened()
        self._last_sid = sid
        checked = read_call(headers, OBSERVE_PATH, self.limits.max_headers)
        if isinstance(checked, Malformed):
            log.debug("tap: malformed call on stream %d: %s", sid, checked.reason)
            self.reset(sid, ErrorCode.PROTOCOL_ERROR)
            self._calm(self.guard.stream_reset(self._now()))
            return
        if checked is None and end:
            checked = Refusal(Status.INVALID_ARGUMENT, "no request message")
        if checked is not None:
            self._finish(sid, refusal_head(checked), ended=end)
            self._calm(self.guard.stream_reset(self._now()))
            return
        timer = self.loop.call_later(self.limits.request_timeout, self._too_slow, sid)
        self.streams[sid] = Call(sid, MessageReader(self.limits.max_message), timer)

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        if not data and not end:
            self._calm(self.guard.data_frame(empty=True) or self.guard.control_frame(self._now()))
        else:
            self.guard.data_frame(empty=False)
        self.h2.acknowledge(sid, flow_len)  # what is kept is bounded by the message's limit
        call = self.streams.get(sid)
        if call is None:
            return
        refused = call.reader.feed(data)
        if refused is not None:
            self._end_call(call, refused, ended=end)
        elif end:
            self._request_ended(call)

    def on_trailers(self, sid: int, headers: Sequence[Header]) -> None:
        call = self.streams.get(sid)
        if call is not None:
            self._request_ended(call)

    def on_informational(self, sid: int, headers: Sequence[Header]) -> None:
        pass  # a client-side event: the codec of a server never makes it

    def on_reset(self, sid: int, code: int) -> None:
        """The client reset a call (or the codec did, for a stream error)."""
        call = self.streams.get(sid)
        if call is not None:
            self._forget(call)
        if call is None or call.tap is None:  # before its request was served: as rapid resets do
            self._calm(self.guard.stream_reset(self._now()))

    def on_window(self, sid: int) -> None:
        self._calm(self.guard.control_frame(self._now()))
        if sid:
            call = self.streams.get(sid)
            if call is not None and call.tap is not None:
                self._pump(call)
        else:
            self.pump_waiting()

    def on_settings(self) -> None:
        self._calm(self.guard.control_frame(self._now()))
        self.pump_waiting()

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None:
        self._draining = True
        if code or not self.streams:
            self._close_now()

    def _broken(self, exc: ProtocolError) -> None:
        log.info("tap: client %s broke HTTP/2: %s", self._peer(), exc)
        self.counts.refused("protocol")
        self._close_now()

    def _calm(self, reason: str | None, hard: bool = False) -> None:
        """Abuse: GOAWAY ENHANCE_YOUR_CALM, and the connection (its calls with it) closes."""
        if reason is None or self.closed:
            return
        log.warning("tap: client %s: %s; closing the connection", self._peer(), reason)
        self.counts.refused("abuse")
        self.h2.goaway(self._last_sid, ErrorCode.ENHANCE_YOUR_CALM, reason.encode()[:256])
        self._close_now()

    # -- calls --

    def _refuse_client(self, sid: int, end: bool) -> None:
        """A client that may not tap: its call is answered from its head, then the connection
        says GOAWAY, stops reading, and closes once the answer had time to arrive."""
        assert self.refusal is not None
        self._last_sid = sid
        self._finish(sid, refusal_head(self.refusal), ended=end)
        self.h2.goaway(sid, ErrorCode.NO_ERROR)
        self.flush()
        self.closed = True  # the codec reads no further frame
        transport = self.transport
        if transport is not None:
            transport.pause_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.limits.refused_linger, self.close_transport)

    def _finish(self, sid: int, block: list[Header], *, ended: bool) -> None:
        """Ends a call's stream with `block` (its trailers, or a whole trailers-only answer);
        a client still sending is told to stop (RST_STREAM NO_ERROR)."""
        try:
            self.h2.send_headers(sid, block, True)
        except StreamClosed:
            return
        if not ended:
            self.h2.reset_stream(sid, ErrorCode.NO_ERROR)
        self.flush_soon()

    def _end_call(self, call: Call, refusal: Refusal, *, ended: bool) -> None:
        head_sent = call.tap is not None
        block = trailers(refusal.status, refusal.message) if head_sent else refusal_head(refusal)
        self._finish(call.sid, block, ended=ended or call.ended)
        self._forget(call)
        if not head_sent:
            self._calm(self.guard.stream_reset(self._now()))

    def _too_slow(self, sid: int) -> None:
        call = self.streams.get(sid)
        if call is not None and call.tap is None:
            call.timer = None
            why = f"the request message did not arrive within {self.limits.request_timeout:g}s"
            self._end_call(call, Refusal(Status.DEADLINE_EXCEEDED, why), ended=call.ended)

    def _request_ended(self, call: Call) -> None:
        call.ended = True
        if call.tap is not None:
            return
        message = call.reader.end()
        if isinstance(message, Refusal):
            self._end_call(call, message, ended=True)
            return
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        opened = self.calls.open(message)
        if isinstance(opened, Refusal):
            self._end_call(call, opened, ended=True)
            return
        call.tap = opened
        opened.wake = lambda: self._wake(call)
        self.h2.send_headers(call.sid, RESPONSE_HEAD, False)
        self.flush_soon()
        self._pump(call)

    def _forget(self, call: Call) -> None:
        self.streams.pop(call.sid, None)
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        tap, call.tap = call.tap, None
        if tap is not None:
            tap.wake = None
            self.calls.close(tap)
        if self._draining and not self.streams:
            self.flush()
            self.close_transport()

    # -- output --

    def _wake(self, call: Call) -> None:
        """A tap queued events (on a request's path): they are sent soon, once per loop turn."""
        if not call.scheduled:
            call.scheduled = True
            self.loop.call_soon(self._pump_soon, call)

    def _pump_soon(self, call: Call) -> None:
        call.scheduled = False
        if call.tap is not None:
            self._pump(call)

    def pump_waiting(self) -> None:
        for call in list(self.streams.values()):
            if call.tap is not None:
                self._pump(call)

    def _pump(self, call: Call) -> None:
        """Sends what the call's client's windows and the transport allow; ends the call once
        its tap is done and every event went."""
        tap = call.tap
        if tap is None or self.closed:
            return
        h2 = self.h2
        sid = call.sid
        sent = 0
        while self.writable:
            if not call.frame:
                if tap.events:
                    call.frame = message_frame(tap.events.popleft().SerializeToString())
                elif tap.done:
                    self._finish(sid, trailers(Status.OK), ended=call.ended)
                    self._forget(call)
                    break
                else:
                    break
            n = min(h2.window(sid), h2.peer_max_frame, len(call.frame))
            if n <= 0:
                break
            try:
                h2.send_data(sid, call.frame[:n], False)
            except StreamClosed:
                return
            call.frame = call.frame[n:]
            sent += 1
        if sent:
            self.guard.data_sent(sent)
        self.flush_soon()

    # -- timers --

    def _now(self) -> float:
        return self.loop.time()

    def _idle_tick(self) -> None:
        if self.closed:
            return
        if not self.streams and self.activity == self._idle_seen:
            log.debug("tap: connection idle for %gs: closing", self.limits.idle_timeout)
            self.write_goaway(self._last_sid, ErrorCode.NO_ERROR)
            self._close_now()
            return
        self._idle_seen = self.activity
        self._timer = self.loop.call_later(self.limits.idle_timeout, self._idle_tick)

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        where = format_hostport(peer[0], peer[1]) if peer else "?"
        return f"{where} ({self.client})" if self.client else where
