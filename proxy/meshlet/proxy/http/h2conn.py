"""One HTTP/2 connection of the proxy, either side: h2 set up for relaying, batched output, write
back-pressure, the abuse guard and the streams waiting for flow-control credit.

h2 is used with its header validation and normalization off (`h2headers` checks what the proxy
relays, in one pass) and with the changes a proxy needs (`Connection`). Output is collected in h2
and written once per read (`flush`) or once per loop iteration (`flush_soon`) for peers that
another connection's events wrote to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, cast

import hpack
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    AlternativeServiceAvailable,
    ConnectionTerminated,
    Event,
    PingAckReceived,
    PingReceived,
    PriorityUpdated,
    UnknownFrameReceived,
)
from h2.exceptions import ProtocolError, StreamClosedError, StreamIDTooLowError
from h2.settings import SettingCodes, Settings
from hyperframe.frame import Frame, GoAwayFrame, RstStreamFrame

from meshlet.proxy.http.h2guard import Guard
from meshlet.proxy.http.h2hpack import Decoder, Encoder
from meshlet.proxy.metrics import TcpConn

if TYPE_CHECKING:
    from meshlet.proxy.http.h2stream import ProxyStream

log = logging.getLogger(__name__)

HIGH_WATER: Final = 256 * 1024  # transport write buffer: stop giving body bytes above this
LOW_WATER: Final = 64 * 1024
MAX_WINDOW: Final = 2**31 - 1
CLOSE_GRACE: Final = 2.0  # seconds a closing connection may take to write what it queued


def config(client_side: bool) -> H2Configuration:
    return H2Configuration(
        client_side=client_side,
        header_encoding=None,
        validate_inbound_headers=False,  # h2headers validates, in one pass
        normalize_inbound_headers=False,
        validate_outbound_headers=False,  # we send what we validated
        normalize_outbound_headers=False,
    )


class Connection(H2Connection):
    """h2's connection, changed where a proxy needs it:

    - no per-frame work for a trace log nobody reads;
    - a GOAWAY with NO_ERROR leaves the connection open, so streams up to its last stream id
      finish (h2 would close its state machine and fail every later frame with PROTOCOL_ERROR);
    - a stream past the advertised concurrency limit is left to the engine to refuse with
      REFUSED_STREAM, the connection living on (h2 raises TooManyStreamsError and sends GOAWAY).
    """

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Frame], list[Event]]:
        if frame.error_code != ErrorCodes.NO_ERROR:
            return super()._receive_goaway_frame(frame)
        event = ConnectionTerminated()
        event.error_code = ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def _receive_frame(self, frame: Frame) -> list[Event]:
        """h2's, less the `repr(frame)` it computes for its trace log on every frame received
        even when nothing logs (~5% of the relay's CPU)."""
        events: list[Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as exc:
            if not self._stream_is_closed_by_reset(exc.stream_id):
                raise
            reset = RstStreamFrame(exc.stream_id)  # a frame on a stream we reset: stream error
            reset.error_code = exc.error_code
            self._prepare_for_sending([reset])
            events = exc._events
        except StreamIDTooLowError as exc:
            if self._stream_is_closed_by_reset(exc.stream_id):
                reset = RstStreamFrame(exc.stream_id)
                reset.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([reset])
                events = []
            elif self._stream_is_closed_by_end(exc.stream_id):
                raise StreamClosedError(exc.stream_id) from exc
            else:
                raise
        else:
            self._prepare_for_sending(frames)
        return events

    @property
    def open_inbound_streams(self) -> int:
        _ = super().open_inbound_streams  # forgets closed streams, as h2 does on each new stream
        return 0


def goaway_frame(last_stream_id: int, code: ErrorCodes, debug: bytes = b"") -> bytes:
    """A GOAWAY written around h2 (which would stop the connection for in-flight streams too)."""
    return GoAwayFrame(
        0, last_stream_id=last_stream_id, error_code=code, additional_data=debug
    ).serialize()


def new_connection(
    client_side: bool, stream_window: int, max_header_bytes: int, max_streams: int | None = None
) -> Connection:
    """An h2 connection with the proxy's settings (sent when the connection is made)."""
    h2 = Connection(config(client_side))
    settings = {
        SettingCodes.ENABLE_PUSH: 0,
        SettingCodes.INITIAL_WINDOW_SIZE: stream_window,
        SettingCodes.MAX_HEADER_LIST_SIZE: max_header_bytes,
    }
    if max_streams is not None:
        settings[SettingCodes.MAX_CONCURRENT_STREAMS] = max_streams
    h2.local_settings = Settings(client=client_side, initial_values=settings)
    # h2hpack's classes have the interface h2 uses from hpack's (duck-typed, hence the casts).
    h2.encoder = cast(hpack.Encoder, Encoder())
    h2.decoder = cast(hpack.Decoder, Decoder(max_header_list_size=max_header_bytes))
    return h2


# Frames with no stream to act on: each is checked against the peer's control-frame budget.
CONTROL_EVENTS: Final = (
    PingReceived,
    PingAckReceived,
    PriorityUpdated,
    UnknownFrameReceived,
    AlternativeServiceAvailable,
)


class Peer(asyncio.Protocol):
    """Transport, h2 state, input loop and write scheduling of one connection; `ProxyStream`s
    use it as the source or the sink of a body. Subclasses name their event handlers
    (`handlers`), and say what a broken connection (`_broken`) and abuse (`_calm`) mean."""

    # Handlers take their own event type: Any at this one edge.
    handlers: ClassVar[Mapping[type[Event], Callable[[Any, Any], None]]] = {}

    def __init__(self, h2: Connection, guard: Guard, conn_window: int) -> None:
        self.h2 = h2
        self.guard = guard
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.writable = True  # the transport's buffer is below its high-water mark
        self.closed = False
        # Streams holding body bytes (or their end) back for lack of flow-control credit or of
        # writability on this connection, by this connection's stream id.
        self.waiting: dict[int, ProxyStream] = {}
        self.activity = 0  # reads so far; the idle timer compares it across ticks
        self._conn_window = conn_window
        self._flush_scheduled = False
        self.tcp = TcpConn.uncounted()  # the connection's counts, set by the owner

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        h2 = self.h2
        h2.initiate_connection()
        # The connection window starts at 65,535 whatever the SETTINGS say (RFC 9113 §6.9.2).
        increment = min(self._conn_window, MAX_WINDOW) - h2.inbound_flow_control_window
        if increment > 0:
            h2.increment_flow_control_window(increment)
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
            events = self.h2.receive_data(data)
        except ProtocolError as exc:
            self.flush()  # h2's GOAWAY
            self._broken(exc)
            return
        handlers = self.handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(self, event)
            elif isinstance(event, CONTROL_EVENTS):
                self._calm(self.guard.control_frame(self.loop.time()))
            if self.closed:
                return
        self.flush()
        if self.transport is not None:
            self._calm(self.guard.write_buffer(self.transport.get_write_buffer_size()))

    def _broken(self, exc: ProtocolError) -> None:
        """The peer broke the protocol (h2's GOAWAY is already written)."""
        raise NotImplementedError

    def _calm(self, reason: str | None) -> None:
        """Closes the connection for abuse when `reason` is not None."""
        raise NotImplementedError

    # output

    def flush(self) -> None:
        data = self.h2.data_to_send()
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

    def reset(self, stream_id: int, code: ErrorCodes | int) -> None:
        """RST_STREAM, unless h2 already considers the stream closed."""
        try:
            self.h2.reset_stream(stream_id, code)
        except ProtocolError:
            return
        self.flush_soon()

    def pump_waiting(self) -> None:
        for stream in list(self.waiting.values()):
            self.pump(stream)

    def pump(self, stream: ProxyStream) -> None:
        """Gives `stream` a chance to send what it holds back on this connection."""
        raise NotImplementedError

    def write_goaway(self, last_stream_id: int, code: ErrorCodes, debug: bytes = b"") -> None:
        self.flush()
        if self.transport is not None and not self.closed:
            frame = goaway_frame(last_stream_id, code, debug)
            self.tcp.written += len(frame)
            self.transport.write(frame)

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


def error_name(code: ErrorCodes | int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"0x{int(code):x}"
