"""The spike's candidate (a): a lean sans-IO HTTP/2 codec for a proxy, only as much as relaying
needs for the micro-benchmark (bench/h2spike.py): frames parsed with one `struct` call each,
handler methods called directly (no event objects), the project's HPACK codec, connection and
stream flow-control windows, SETTINGS, WINDOW_UPDATE. Typed so that mypyc can compile it as is.
"""

from __future__ import annotations

import struct
from typing import Any, Final

from meshlet.proxy.http.h2hpack import Decoder, Encoder

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEAD: Final = struct.Struct(">HBBBL")
_WINDOW: Final = struct.Struct(">L")
DATA: Final = 0
HEADERS: Final = 1
SETTINGS: Final = 4
WINDOW_UPDATE: Final = 8
CONTINUATION: Final = 9
END_STREAM: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY: Final = 0x20
ACK: Final = 0x1
MAX_FRAME: Final = 16384
LOCAL_WINDOW: Final = 256 * 1024


def frame_head(length: int, kind: int, flags: int, sid: int) -> bytes:
    return _HEAD.pack(length >> 8, length & 0xFF, kind, flags, sid)


class Stream:
    __slots__ = ("recv_unacked", "send_window")

    def __init__(self, send_window: int) -> None:
        self.send_window = send_window
        self.recv_unacked = 0


class Codec:
    def __init__(self, client_side: bool, handler: Any) -> None:
        self.handler = handler
        self.client_side = client_side
        self.out: list[bytes] = []
        self.buf = b""
        self.enc = Encoder()
        self.dec = Decoder()
        self.preface = not client_side
        self.streams: dict[int, Stream] = {}
        self.send_window = 65535
        self.recv_unacked = 0
        self.peer_initial = 65535
        self.header_sid = 0
        self.header_block = b""
        self.header_end = False
        settings = struct.pack(">HL", 0x4, LOCAL_WINDOW) + struct.pack(">HL", 0x2, 0)
        start = frame_head(len(settings), SETTINGS, 0, 0) + settings
        self.out.append(PREFACE + start if client_side else start)

    def take(self) -> bytes:
        out = b"".join(self.out)
        self.out.clear()
        return out

    def receive(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        if self.preface:
            if len(buf) < 24:
                self.buf = buf
                return
            if buf[:24] != PREFACE:
                raise ValueError("bad preface")
            pos = 24
            self.preface = False
        end_buf = len(buf)
        unpack = _HEAD.unpack_from
        while end_buf - pos >= 9:
            hi, lo, kind, flags, sid = unpack(buf, pos)
            length = (hi << 8) | lo
            start = pos + 9
            end = start + length
            if end > end_buf:
                break
            sid &= 0x7FFFFFFF
            if kind == DATA:
                self._data(sid, flags, buf[start:end], length)
            elif kind == HEADERS:
                self._headers(sid, flags, buf[start:end])
            elif kind == CONTINUATION:
                self._continuation(sid, flags, buf[start:end])
            elif kind == SETTINGS:
                self._settings(flags, buf[start:end])
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, _WINDOW.unpack_from(buf, start)[0] & 0x7FFFFFFF)
            pos = end
        self.buf = buf[pos:] if pos < end_buf else b""

    def _data(self, sid: int, flags: int, payload: bytes, length: int) -> None:
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        self.recv_unacked += length
        stream = self.streams.get(sid)
        if stream is not None:
            stream.recv_unacked += length
        end = bool(flags & END_STREAM)
        self.handler.on_data(sid, payload, end)
        if end:
            self.streams.pop(sid, None)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        if flags & PRIORITY:
            payload = payload[5:]
        end = bool(flags & END_STREAM)
        if not flags & END_HEADERS:
            self.header_sid, self.header_block, self.header_end = sid, payload, end
            return
        self._block(sid, payload, end)

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        self.header_block += payload
        if flags & END_HEADERS:
            self._block(sid, self.header_block, self.header_end)
            self.header_block = b""

    def _block(self, sid: int, block: bytes, end: bool) -> None:
        fields = self.dec.decode(block)
        if sid not in self.streams and not self.client_side:
            self.streams[sid] = Stream(self.peer_initial)
        self.handler.on_headers(sid, fields, end)
        if end:
            self.streams.pop(sid, None)

    def _settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            return
        for i in range(0, len(payload), 6):
            code, value = struct.unpack_from(">HL", payload, i)
            if code == 0x4:
                self.peer_initial = value
            elif code == 0x1:
                self.enc.header_table_size = value
        self.out.append(frame_head(0, SETTINGS, ACK, 0))

    def _window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.send_window += increment
            return
        stream = self.streams.get(sid)
        if stream is not None:
            stream.send_window += increment

    # -- sending --

    def send_headers(self, sid: int, fields: list[tuple[bytes, bytes]], end: bool) -> None:
        if sid not in self.streams:
            self.streams[sid] = Stream(self.peer_initial)
        block = self.enc.encode(fields)
        flags = END_HEADERS | (END_STREAM if end else 0)
        if len(block) <= MAX_FRAME:
            self.out.append(frame_head(len(block), HEADERS, flags, sid) + block)
        else:
            first = block[:MAX_FRAME]
            self.out.append(frame_head(len(first), HEADERS, flags & ~END_HEADERS, sid) + first)
            rest = block[MAX_FRAME:]
            while rest:
                piece, rest = rest[:MAX_FRAME], rest[MAX_FRAME:]
                last = END_HEADERS if not rest else 0
                self.out.append(frame_head(len(piece), CONTINUATION, last, sid) + piece)
        if end:
            self._sent_end(sid)

    def send_data(self, sid: int, data: bytes, end: bool) -> None:
        stream = self.streams[sid]
        size = len(data)
        if size > self.send_window or size > stream.send_window:
            raise ValueError("flow control window exceeded")
        self.send_window -= size
        stream.send_window -= size
        self.out.append(frame_head(size, DATA, END_STREAM if end else 0, sid))
        self.out.append(data)
        if end:
            self._sent_end(sid)

    def _sent_end(self, sid: int) -> None:
        pass  # half-closed (local): the prototype keeps no more state

    def consumed(self, sid: int, size: int) -> None:
        """`size` bytes of `sid`'s DATA were passed on: credit back when half a window is due."""
        stream = self.streams.get(sid)
        if stream is not None and stream.recv_unacked >= LOCAL_WINDOW // 2:
            self.out.append(
                frame_head(4, WINDOW_UPDATE, 0, sid) + _WINDOW.pack(stream.recv_unacked)
            )
            stream.recv_unacked = 0
        if self.recv_unacked >= 65535 // 2:
            self.out.append(frame_head(4, WINDOW_UPDATE, 0, 0) + _WINDOW.pack(self.recv_unacked))
            self.recv_unacked = 0
