"""One HTTP/2 connection of the proxy, either side: the codec (`h2codec`), batched output, write
back-pressure, the abuse guard and the streams waiting for flow-control credit.

The codec calls the `Peer`'s `on_*` methods frame by frame; output is collected in the codec and
written once per read (`flush`) or once per loop iteration (`flush_soon`) for peers that another
connection's events wrote to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final, Generic, TypeVar, cast

from meshlet.proxy.http.h2codec import (
    MAX_WINDOW,
    Codec,
    ErrorCode,
    Header,
    ProtocolError,
    error_name,
)
from meshlet.proxy.http.h2guard import Guard
from meshlet.proxy.io.counters import TcpConn

log = logging.getLogger(__name__)

HIGH_WATER: Final = 256 * 1024  # transport write buffer: stop giving body bytes above this
LOW_WATER: Final = 64 * 1024
CLOSE_GRACE: Final = 2.0  # seconds a closing connection may take to write what it queued
# The round trip to an upstream, as the proxy estimates it (h2client.py): from the connection's
# start to the upstream's first SETTINGS, then lowered by every response that came back sooner
# (each bounds it); within these (loop time has a millisecond's resolution).
MIN_RTT: Final = 0.001
MAX_RTT: Final = 0.02

__all__ = ["MAX_WINDOW", "ErrorCode", "Peer", "error_name"]

S = TypeVar("S")  # what a stream of this connection is to it (h2server's, h2client's)


class Peer(asyncio.Protocol, Generic[S]):
    """Transport, codec, input and write scheduling of one connection; `ProxyStream`s use it as
    the source or the sink of a body. Subclasses are the codec's handler (`h2codec.Handler`:
    the `on_*` methods), and say what a broken connection (`_broken`) and abuse (`_calm`)
    mean; `S` is what their streams are to them."""

    def __init__(
        self,
        guard: Guard,
        client_side: bool,
        stream_window: int,
        conn_window: int,
        max_header_bytes: int,
        max_streams: int | None = None,
    ) -> None:
        self.h2 = Codec(self, client_side, stream_window, conn_window, max_header_bytes,
                        max_streams)  # fmt: skip
        self.guard = guard
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.writable = True  # the transport's buffer is below its high-water mark
        self.closed = False
        # Streams holding body bytes (or their end) back for lack of flow-control credit or of
        # writability on this connection, by this connection's stream id.
        self.waiting: dict[int, S] = {}
        self.activity = 0  # reads so far; the idle timer compares it across ticks
        self._flush_scheduled = False
        self.tcp = TcpConn.uncounted()  # the connection's counts, set by the owner

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        self.h2.start()
        self.flush()

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        self.pump_waiting()
        self.flush()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # closed by the proxy: nothing more is read
        self.activity += 1
        self.tcp.read += len(data)
        try:
            self.h2.receive(data)
        except ProtocolError as exc:
            self.flush()  # the codec's GOAWAY
            self._broken(exc)
            return
        if self.closed:
            return
        self.flush()
        if self.transport is not None:  # a peer not reading: draining would be pointless
            self._calm(self.guard.write_buffer(self.transport.get_write_buffer_size()), True)

    # the codec's handler: what both sides do alike

    def on_control(self) -> None:
        self._calm(self.guard.control_frame(self.loop.time()))

    def on_head(self, sid: int, headers: Sequence[Header], end: bool) -> None:
        raise NotImplementedError

    def on_informational(self, sid: int, headers: Sequence[Header]) -> None:
        raise NotImplementedError

    def on_trailers(self, sid: int, headers: Sequence[Header]) -> None:
        raise NotImplementedError

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        raise NotImplementedError

    def on_reset(self, sid: int, code: int) -> None:
        raise NotImplementedError

    def on_window(self, sid: int) -> None:
        raise NotImplementedError

    def on_settings(self) -> None:
        raise NotImplementedError

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None:
        raise NotImplementedError

    def _broken(self, exc: ProtocolError) -> None:
        """The peer broke the protocol (the codec's GOAWAY is already written)."""
        raise NotImplementedError

    def _calm(self, reason: str | None, hard: bool = False) -> None:
        """Closes the connection for abuse when `reason` is not None (`hard`: at once, without
        letting streams in flight finish)."""
        raise NotImplementedError

    # output

    def flush(self) -> None:
        data = self.h2.take()
        transport = self.transport
        if data and not self.closed and transport is not None and not transport.is_closing():
            self.tcp.written += len(data)
            transport.write(data)

    def flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM, unless the stream is already closed."""
        if self.h2.reset_stream(stream_id, code):
            self.flush_soon()

    def pump_waiting(self) -> None:
        for stream in list(self.waiting.values()):
            self.pump(stream)

    def pump(self, stream: S) -> None:
        """Gives `stream` a chance to send what it holds back on this connection."""
        raise NotImplementedError

    def write_goaway(self, last_stream_id: int, code: int, debug: bytes = b"") -> None:
        if self.transport is not None and not self.closed:
            self.h2.goaway(last_stream_id, code, debug)
            self.flush()

    def close_transport(self) -> None:
        """Closes after the queued bytes are written: at once when the peer is not reading,
        within CLOSE_GRACE seconds in any case."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > HIGH_WATER:
            transport.abort()
            return
        transport.close()
        if transport.get_write_buffer_size():
            self.loop.call_later(CLOSE_GRACE, transport.abort)
