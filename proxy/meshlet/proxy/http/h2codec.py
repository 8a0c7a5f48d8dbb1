"""HTTP/2 (RFC 9113) for a proxy, sans I/O: bytes in, the handler's methods called per frame,
bytes out. One `Codec` per connection, either side.

Built for relaying (docs/h2-engine.md has the measurement that chose it): a frame header is one
`struct` call, frames go straight to the handler's methods (no event object per frame), output
frames are collected in a list and joined once per flush, and header fields are passed through
as the HPACK codec (`h2hpack`) decoded them: what a request or response must look like is
`h2headers`' business, checked once by the engine.

What the codec enforces is the framing layer, as the RFC says: the preface and the SETTINGS that
must follow it, frame sizes, padding, the stream state machine (idle, open, half-closed, closed;
frames on a stream this side reset are dropped, their bytes credited back), header blocks
(CONTINUATION only right after its HEADERS, at most `MAX_CONTINUATIONS` of them, HPACK errors),
flow control (a peer sending past a window, or a WINDOW_UPDATE taking one past 2^31-1), SETTINGS
values, and no server push. A connection error raises `ProtocolError` with the GOAWAY already
queued, and the codec takes no more input; a stream error queues RST_STREAM and tells the
handler through `on_reset`, the connection living on. Everything an abuse guard needs to count
(PING, PRIORITY, SETTINGS, WINDOW_UPDATE, unknown frames) reaches the handler.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from enum import IntEnum
from itertools import chain
from typing import Final, NoReturn, Protocol

from hpack.exceptions import HPACKError, OversizedHeaderListError

from meshlet.proxy.http.h2hpack import Decoder, Encoder

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_WINDOW: Final = 2**31 - 1
DEFAULT_WINDOW: Final = 65535
MIN_FRAME_SIZE: Final = 16384  # also the largest frame this side accepts
MAX_FRAME_SIZE: Final = 2**24 - 1
MAX_CONTINUATIONS: Final = 32  # CONTINUATION frames per header block
RESET_MEMORY: Final = 1024  # streams this side reset whose late frames are still dropped quietly
SKIPPED_MEMORY: Final = 64  # ranges of stream ids the peer skipped (never opened), newest kept

# frame types
DATA: Final = 0x0
HEADERS: Final = 0x1
PRIORITY: Final = 0x2
RST_STREAM: Final = 0x3
SETTINGS: Final = 0x4
PUSH_PROMISE: Final = 0x5
PING: Final = 0x6
GOAWAY: Final = 0x7
WINDOW_UPDATE: Final = 0x8
CONTINUATION: Final = 0x9

# flags
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

# settings
HEADER_TABLE_SIZE: Final = 0x1
ENABLE_PUSH: Final = 0x2
MAX_CONCURRENT_STREAMS: Final = 0x3
INITIAL_WINDOW_SIZE: Final = 0x4
MAX_FRAME_SIZE_SETTING: Final = 0x5
MAX_HEADER_LIST_SIZE: Final = 0x6

_HEAD: Final = struct.Struct(">HBBBL")  # length (24 bits as 16 + 8), type, flags, stream id
_U32: Final = struct.Struct(">L")
_SETTING: Final = struct.Struct(">HL")
_GOAWAY: Final = struct.Struct(">LL")
UNLIMITED: Final = 2**31  # a peer's limits before its SETTINGS say otherwise
_SELF_DEPENDENT: Final = 0x100  # not a wire flag: a HEADERS frame whose stream depends on itself


class ErrorCode(IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{int(code):x}"


class ProtocolError(Exception):
    """The peer broke HTTP/2: a connection error, its GOAWAY queued."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{reason} ({code.name})")
        self.code = code
        self.reason = reason


class StreamClosed(Exception):
    """Sending on a stream this side may no longer send on (closed, reset, or ended)."""


class NoStreamIds(Exception):
    """The connection used up its stream ids: a new connection is needed."""


Header = tuple[bytes, bytes]


class Handler(Protocol):
    """What a connection's owner is told, frame by frame. `closed` stops the input at once."""

    closed: bool

    def on_head(self, sid: int, headers: Sequence[Header], end: bool) -> None:
        """A request (server side) or a final response (client side) head."""

    def on_informational(self, sid: int, headers: Sequence[Header]) -> None:
        """A 1xx response head (client side)."""

    def on_trailers(self, sid: int, headers: Sequence[Header]) -> None:
        """Trailers: the stream's input ends with them."""

    def on_data(self, sid: int, data: bytes, flow_len: int, end: bool) -> None:
        """Body bytes (`flow_len` counts padding too: what flow control charged)."""

    def on_reset(self, sid: int, code: int) -> None:
        """The stream is gone: reset by the peer, or by this side for a stream error."""

    def on_window(self, sid: int) -> None:
        """More send credit on `sid` (0: the connection)."""

    def on_settings(self) -> None:
        """The peer's SETTINGS were applied (and acknowledged)."""

    def on_goaway(self, code: int, last_sid: int, debug: bytes) -> None: ...

    def on_control(self) -> None:
        """A frame with nothing to act on: PING, PRIORITY, an unknown type, a late frame."""


class Stream:
    __slots__ = ("head", "recv_open", "recv_window", "send_open", "send_window", "unacked")

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0  # bytes received, passed on, not yet credited back
        self.recv_open = True  # the peer may send more
        self.send_open = True  # this side may send more
        self.head = False  # a final head was received: what follows is body, then trailers


def header_list_size(headers: Sequence[Header]) -> int:
    """A header list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it (RFC 9113 §6.5.2): its
    names and values, and 32 bytes per field."""
    return sum(map(len, chain.from_iterable(headers))) + 32 * len(headers)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, sid) + payload


def goaway_frame(last_sid: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, _GOAWAY.pack(last_sid, code) + debug)


class Codec:
    """One HTTP/2 connection's protocol state.

    `stream_window` is the window each stream gets from this side, `conn_window` the
    connection's; `max_header_bytes` bounds a decoded header list (SETTINGS_MAX_HEADER_LIST_SIZE),
    `max_streams` is advertised (SETTINGS_MAX_CONCURRENT_STREAMS) but enforced by the owner,
    which refuses streams past it with REFUSED_STREAM rather than failing the connection."""

    def __init__(
        self,
        handler: Handler,
        client_side: bool,
        stream_window: int,
        conn_window: int,
        max_header_bytes: int,
        max_streams: int | None = None,
    ) -> None:
        self.handler = handler
        self.client_side = client_side
        self.streams: dict[int, Stream] = {}
        self.send_window = DEFAULT_WINDOW  # the connection's, granted by the peer
        self.peer_initial = DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_max_frame = MIN_FRAME_SIZE
        self.peer_max_streams = UNLIMITED
        # The largest header list the peer takes (SETTINGS_MAX_HEADER_LIST_SIZE, in RFC 9113's
        # measure: `header_list_size`); unlimited until it says.
        self.peer_max_header_list = UNLIMITED
        self.local_initial = min(stream_window, MAX_WINDOW)
        self.conn_window = min(max(conn_window, DEFAULT_WINDOW), MAX_WINDOW)
        self.recv_window = DEFAULT_WINDOW  # raised by `start`'s WINDOW_UPDATE
        self.conn_unacked = 0
        self.last_peer_sid = 0  # the highest stream id the peer opened (server side)
        self.next_sid = 1  # the next stream id this side opens (client side)
        self.reset_ids: dict[int, None] = {}  # streams this side reset, oldest first
        # Ranges (first, last) of ids the peer skipped when it opened a stream: they were never
        # opened, so a frame opening one later is a stream id going backwards (server side).
        self.skipped: list[tuple[int, int]] = []
        self.dead = False  # a connection error: no more input
        self._out: list[bytes] = []
        self._buf = b""
        self._preface = not client_side  # the client preface is still to be read
        # A client's preface is followed by its SETTINGS (checked); a server's SETTINGS may
        # come after its ACK of ours (as `h2` servers send them when they start late).
        self._settings_seen = client_side
        self._block_sid = 0  # a header block waiting for CONTINUATION
        self._block: list[bytes] = []
        self._block_flags = 0
        self._continuations = 0
        self.encoder = Encoder()
        self.decoder = Decoder(max_header_list_size=max_header_bytes)
        settings = [(ENABLE_PUSH, 0), (INITIAL_WINDOW_SIZE, self.local_initial),
                    (MAX_HEADER_LIST_SIZE, max_header_bytes)]  # fmt: skip
        if max_streams is not None:
            settings.append((MAX_CONCURRENT_STREAMS, max_streams))
        self._settings = b"".join(_SETTING.pack(k, v) for k, v in settings)

    # -- output --

    def start(self) -> None:
        """Queues this side's preface: SETTINGS, then the connection window's raise (the
        connection window starts at 65,535 whatever SETTINGS say, RFC 9113 §6.9.2)."""
        out = self._out
        if self.client_side:
            out.append(PREFACE)
        out.append(frame(SETTINGS, 0, 0, self._settings))
        raise_by = self.conn_window - self.recv_window
        if raise_by > 0:
            out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(raise_by)))
            self.recv_window = self.conn_window

    def take(self) -> bytes:
        """The bytes queued since the last call."""
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    def next_stream_id(self) -> int:
        """The id of the next stream this side opens (client side)."""
        sid = self.next_sid
        if sid > MAX_WINDOW:
            raise NoStreamIds
        return sid

    def send_headers(self, sid: int, headers: Iterable[Header], end: bool) -> None:
        """A header block on `sid`: a new stream's head (client side: `next_stream_id`), a
        response head, or trailers (`end`)."""
        stream = self.streams.get(sid)
        if stream is None:
            if not self.client_side or sid != self.next_sid:
                raise StreamClosed(sid)
            self.next_sid = sid + 2
            stream = self.streams[sid] = Stream(self.peer_initial, self.local_initial)
        elif not stream.send_open:
            raise StreamClosed(sid)
        block = self.encoder.encode(headers)
        flags = END_STREAM if end else 0
        limit = self.peer_max_frame
        out = self._out
        if len(block) <= limit:
            n = len(block)
            out.append(_HEAD.pack(n >> 8, n & 0xFF, HEADERS, flags | END_HEADERS, sid))
            out.append(block)
        else:
            out.append(frame(HEADERS, flags, sid, block[:limit]))
            for at in range(limit, len(block), limit):
                piece = block[at : at + limit]
                last = END_HEADERS if at + limit >= len(block) else 0
                out.append(frame(CONTINUATION, last, sid, piece))
        if end:
            self._sent_end(sid, stream)

    def send_data(self, sid: int, data: bytes, end: bool) -> None:
        """Body bytes within `window(sid)` and `peer_max_frame` (the caller splits)."""
        stream = self.streams.get(sid)
        if stream is None or not stream.send_open:
            raise StreamClosed(sid)
        n = len(data)
        if n > self.send_window or n > stream.send_window or n > self.peer_max_frame:
            raise ValueError(f"{n} bytes exceed the send window or the frame size")
        self.send_window -= n
        stream.send_window -= n
        self._out.append(_HEAD.pack(n >> 8, n & 0xFF, DATA, END_STREAM if end else 0, sid))
        if n:
            self._out.append(data)
        if end:
            self._sent_end(sid, stream)

    def end_stream(self, sid: int) -> None:
        self.send_data(sid, b"", True)

    def _sent_end(self, sid: int, stream: Stream) -> None:
        stream.send_open = False
        if not stream.recv_open:
            del self.streams[sid]

    def window(self, sid: int) -> int:
        """How many body bytes `sid` may send now."""
        stream = self.streams.get(sid)
        if stream is None:
            return 0
        return min(self.send_window, stream.send_window)

    def reset_stream(self, sid: int, code: int) -> bool:
        """RST_STREAM; False (nothing sent) when the stream is already closed."""
        if self.streams.pop(sid, None) is None:
            return False
        self._out.append(frame(RST_STREAM, 0, sid, _U32.pack(code)))
        self._remember_reset(sid)
        return True

    def forget_stream(self, sid: int) -> None:
        """A stream the peer's GOAWAY excluded (above its last stream id): treated as never
        created (RFC 9113 §6.8), so nothing more is sent on it, not even RST_STREAM; frames
        that still arrive for it are dropped quietly."""
        if self.streams.pop(sid, None) is not None:
            self._remember_reset(sid)

    def _remember_reset(self, sid: int) -> None:
        reset_ids = self.reset_ids
        reset_ids[sid] = None
        if len(reset_ids) > RESET_MEMORY:
            del reset_ids[next(iter(reset_ids))]

    def acknowledge(self, sid: int, n: int) -> bool:
        """`n` bytes received on `sid` were passed on: their credit goes back to the peer, in
        WINDOW_UPDATEs once half a window is due. True when one was queued (to be flushed)."""
        if n <= 0:
            return False
        queued = False
        self.conn_unacked += n
        if self.conn_unacked >= self.conn_window // 2:
            self.recv_window += self.conn_unacked
            self._out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.conn_unacked)))
            self.conn_unacked = 0
            queued = True
        stream = self.streams.get(sid)
        if stream is not None and stream.recv_open:
            stream.unacked += n
            if stream.unacked >= self.local_initial // 2:
                stream.recv_window += stream.unacked
                self._out.append(frame(WINDOW_UPDATE, 0, sid, _U32.pack(stream.unacked)))
                stream.unacked = 0
                queued = True
        return queued

    def goaway(self, last_sid: int, code: int, debug: bytes = b"") -> None:
        self._out.append(goaway_frame(last_sid, code, debug))

    # -- input --

    def receive(self, data: bytes) -> None:
        """Parses what arrived and tells the handler. Raises ProtocolError for a connection
        error (the GOAWAY queued); the codec then ignores any further input."""
        if self.dead:
            return
        buf = self._buf + data if self._buf else data
        pos = 0
        if self._preface:
            if len(buf) < 24:
                if not PREFACE.startswith(buf):
                    self._fail(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 client preface")
                self._buf = buf
                return
            if buf[:24] != PREFACE:
                self._fail(ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 client preface")
            self._preface = False
            pos = 24
        size = len(buf)
        unpack = _HEAD.unpack_from
        handler = self.handler
        while size - pos >= 9:
            hi, lo, kind, flags, sid = unpack(buf, pos)
            length = (hi << 8) | lo
            if length > MIN_FRAME_SIZE:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = pos + 9 + length
            if end > size:
                break
            payload = buf[pos + 9 : end]
            pos = end
            sid &= 0x7FFFFFFF
            if not self._settings_seen and (kind != SETTINGS or flags & ACK):
                self._fail(ErrorCode.PROTOCOL_ERROR, "the preface's SETTINGS frame is missing")
            if self._block_sid and kind != CONTINUATION:
                self._fail(ErrorCode.PROTOCOL_ERROR, "a header block interrupted")
            if kind == DATA:
                self._data(sid, flags, payload)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload)
            elif kind == RST_STREAM:
                self._rst_stream(sid, payload)
            elif kind == SETTINGS:
                self._settings_frame(sid, flags, payload)
            elif kind == PING:
                self._ping(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == PRIORITY:
                if sid == 0:
                    self._fail(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._fail(ErrorCode.FRAME_SIZE_ERROR, "a PRIORITY frame not 5 bytes long")
                if _U32.unpack_from(payload)[0] & 0x7FFFFFFF == sid:  # RFC 9113 §5.3.1
                    self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
                else:
                    handler.on_control()
            elif kind == GOAWAY:
                self._goaway(sid, payload)
            elif kind == PUSH_PROMISE:
                self._fail(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE with push disabled")
            else:
                handler.on_control()  # unknown frame types are ignored (RFC 9113 §4.1)
            if handler.closed:
                self._buf = b""
                return
        self._buf = buf[pos:] if pos < size else b""

    def _fail(self, code: ErrorCode, reason: str) -> NoReturn:
        self.dead = True
        self._out.append(goaway_frame(self.last_peer_sid, code, reason.encode()))
        raise ProtocolError(code, reason)

    def _stream_error(self, sid: int, code: ErrorCode) -> None:
        self.streams.pop(sid, None)
        self._out.append(frame(RST_STREAM, 0, sid, _U32.pack(code)))
        self._remember_reset(sid)
        self.handler.on_reset(sid, code)

    def _skip(self, first: int, last: int) -> None:
        skipped = self.skipped
        skipped.append((first, last))
        if len(skipped) > SKIPPED_MEMORY:
            del skipped[0]

    def _skipped(self, sid: int) -> bool:
        """Whether the peer skipped `sid` (never opened it) when it opened a later stream."""
        return any(first <= sid <= last for first, last in self.skipped)

    def _closed(self, sid: int) -> bool:
        """Whether `sid`, not open, was opened before (not idle)."""
        if sid % 2 == 0:
            return False  # even ids are the server's: it never opens one (no push)
        return sid <= (self.next_sid - 2 if self.client_side else self.last_peer_sid)

    def _late(self, sid: int, kind: str) -> None:
        """A frame on a stream that is not open: dropped if this side reset the stream, a
        connection error if it was idle or closed normally."""
        if sid in self.reset_ids:
            self.handler.on_control()
            return
        if self._closed(sid):
            self._fail(ErrorCode.STREAM_CLOSED, f"{kind} on closed stream {sid}")
        self._fail(ErrorCode.PROTOCOL_ERROR, f"{kind} on idle stream {sid}")

    def _unpad(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            self._fail(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self.recv_window -= length
        if self.recv_window < 0:
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "DATA past the connection window")
        data = self._unpad(flags, payload)
        stream = self.streams.get(sid)
        if stream is None or not stream.recv_open or not stream.head:
            self.acknowledge(0, length)  # dropped: its connection credit goes back
            if stream is None:
                self._late(sid, "DATA")
            else:
                self._stream_error(sid, ErrorCode.STREAM_CLOSED if not stream.recv_open else
                                   ErrorCode.PROTOCOL_ERROR)  # fmt: skip
            return
        stream.recv_window -= length
        if stream.recv_window < 0:
            self.acknowledge(0, length)
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        end = bool(flags & END_STREAM)
        if end:
            stream.recv_open = False
            if not stream.send_open:
                del self.streams[sid]
        self.handler.on_data(sid, data, length, end)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            if _U32.unpack_from(payload)[0] & 0x7FFFFFFF == sid:
                flags |= _SELF_DEPENDENT  # a stream error, once the block is decoded
            payload = payload[5:]
        if flags & END_HEADERS:
            self._block_done(sid, flags, payload)
            return
        self._block_sid, self._block_flags = sid, flags
        self._block = [payload]
        self._continuations = 0

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if not self._block_sid or sid != self._block_sid:
            self._fail(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self._continuations += 1
        if self._continuations > MAX_CONTINUATIONS:
            self._fail(ErrorCode.PROTOCOL_ERROR, "too many CONTINUATION frames")
        self._block.append(payload)
        if flags & END_HEADERS:
            block = b"".join(self._block)
            self._block_sid, self._block = 0, []
            self._block_done(sid, self._block_flags, block)

    def _block_done(self, sid: int, flags: int, block: bytes) -> None:
        try:  # always decoded: the HPACK table must follow, even for a dropped block
            fields = self.decoder.decode(block)
        except OversizedHeaderListError:
            self._fail(ErrorCode.ENHANCE_YOUR_CALM, "a header list past the advertised size")
        except (HPACKError, ValueError, IndexError):
            self._fail(ErrorCode.COMPRESSION_ERROR, "an undecodable header block")
        end = bool(flags & END_STREAM)
        stream = self.streams.get(sid)
        handler = self.handler
        if stream is None:
            if self.client_side or sid % 2 == 0 or sid <= self.last_peer_sid:
                if not self.client_side and sid % 2 and self._skipped(sid):
                    self._fail(ErrorCode.PROTOCOL_ERROR, f"stream id {sid} went backwards")
                self._late(sid, "HEADERS")
                return
            if sid > self.last_peer_sid + 2:
                self._skip(self.last_peer_sid + 2, sid - 2)
            self.last_peer_sid = sid
            if flags & _SELF_DEPENDENT:  # RFC 9113 §5.3.1: a stream error
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
                return
            stream = self.streams[sid] = Stream(self.peer_initial, self.local_initial)
            stream.head = True
            stream.recv_open = not end
            handler.on_head(sid, fields, end)
            return
        if not stream.recv_open:
            self._stream_error(sid, ErrorCode.STREAM_CLOSED)
            return
        if stream.head:  # trailers: they end the stream
            if not end:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
                return
            stream.recv_open = False
            if not stream.send_open:
                del self.streams[sid]
            handler.on_trailers(sid, fields)
            return
        # client side: the response head, maybe informational first
        status = _status(fields)
        if status.startswith(b"1") and len(status) == 3 and status != b"101":
            if end:
                self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
                return
            handler.on_informational(sid, fields)
            return
        stream.head = True
        if end:
            stream.recv_open = False
            if not stream.send_open:
                del self.streams[sid]
        handler.on_head(sid, fields, end)

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "a WINDOW_UPDATE not 4 bytes long")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                self._fail(ErrorCode.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            if self.send_window > MAX_WINDOW - increment:
                self._fail(ErrorCode.FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
            self.send_window += increment
            self.handler.on_window(0)
            return
        stream = self.streams.get(sid)
        if stream is None:
            if self._closed(sid) or sid in self.reset_ids:
                self.handler.on_control()  # a late credit for a closed stream
                return
            self._fail(ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
        if increment == 0:
            self._stream_error(sid, ErrorCode.PROTOCOL_ERROR)
            return
        if stream.send_window > MAX_WINDOW - increment:
            self._stream_error(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        stream.send_window += increment
        self.handler.on_window(sid)

    def _rst_stream(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "a RST_STREAM not 4 bytes long")
        if sid == 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if self.streams.pop(sid, None) is None:
            if not self._closed(sid) and sid not in self.reset_ids:
                self._fail(ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            self.handler.on_control()
            return
        self.handler.on_reset(sid, _U32.unpack(payload)[0])

    def _settings_frame(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                self._fail(ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            self.handler.on_control()
            return
        if len(payload) % 6:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        self._settings_seen = True
        initial = highest = -1  # the frame's last and highest SETTINGS_INITIAL_WINDOW_SIZE
        for at in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, at)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._fail(ErrorCode.FLOW_CONTROL_ERROR, "an initial window past 2^31-1")
                initial, highest = value, max(highest, value)
            elif key == MAX_FRAME_SIZE_SETTING:
                if not MIN_FRAME_SIZE <= value <= MAX_FRAME_SIZE:
                    self._fail(ErrorCode.PROTOCOL_ERROR, f"a maximum frame size of {value}")
                self.peer_max_frame = value
            elif key == MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == MAX_HEADER_LIST_SIZE:
                self.peer_max_header_list = value
            elif key == HEADER_TABLE_SIZE:
                self.encoder.header_table_size = value
            elif key == ENABLE_PUSH and (value > 1 or (value == 1 and self.client_side)):
                self._fail(ErrorCode.PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH of {value}")
            # others (unknown ones) are ignored
        if initial >= 0:
            self._initial_window(initial, highest)
        self._out.append(frame(SETTINGS, ACK, 0))
        self.handler.on_settings()

    def _initial_window(self, value: int, highest: int) -> None:
        """A new SETTINGS_INITIAL_WINDOW_SIZE, applied to the open streams once per frame
        (`value`, the frame's last), not once per entry: a frame can hold 2,730 of them. The
        frame is refused as a whole if any of its values, taken in turn, would have taken a
        window past 2^31-1 (`highest` is the one that goes furthest)."""
        streams = self.streams.values()
        rise = highest - self.peer_initial
        if rise > 0 and any(stream.send_window > MAX_WINDOW - rise for stream in streams):
            self._fail(ErrorCode.FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
        delta = value - self.peer_initial
        self.peer_initial = value
        if delta:
            for stream in streams:
                stream.send_window += delta

    def _ping(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "a PING not 8 bytes long")
        if not flags & ACK:
            self._out.append(frame(PING, ACK, 0, payload))
        self.handler.on_control()

    def _goaway(self, sid: int, payload: bytes) -> None:
        if sid != 0:
            self._fail(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            self._fail(ErrorCode.FRAME_SIZE_ERROR, "a GOAWAY shorter than 8 bytes")
        last, code = _GOAWAY.unpack_from(payload)
        self.handler.on_goaway(code, last & 0x7FFFFFFF, payload[8:])


def _status(fields: Sequence[Header]) -> bytes:
    for name, value in fields:
        if name == b":status":
            return bytes(value)
    return b""
