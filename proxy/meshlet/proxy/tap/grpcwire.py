"""gRPC over HTTP/2 as the tap server speaks it, sans I/O: one call's head checked, its one
request message read within a size limit, and the frames and header blocks of the answer.

The tap server serves one method, a unary request and a stream of responses; this is all of
gRPC it needs (the gRPC over HTTP/2 protocol: a message is a compressed flag, a 4-byte
big-endian length, then the bytes; the status goes in trailers, or alone in a trailers-only
response when the call is refused before it starts).

`MessageReader` reads the length from the first five bytes and refuses a message over its
limit right there, before a byte of it is kept: a client declaring a gigabyte is answered
RESOURCE_EXHAUSTED on its first DATA frame. What it keeps is never more than the limit.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from meshlet.proxy.http.h2headers import Malformed, grpc_message, read_request

Header = tuple[bytes, bytes]

_PREFIX: Final = struct.Struct(">BL")  # the compressed flag, the message's length
PREFIX_SIZE: Final = _PREFIX.size


class Status(IntEnum):
    """gRPC status codes (the ones the tap server answers with, and OK)."""

    OK = 0
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    UNAUTHENTICATED = 16


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call answered without being served: a gRPC status (in a trailers-only response), or,
    for what is not a gRPC call at all, an HTTP status (`http`)."""

    status: Status
    message: str
    http: int = 200


def read_call(
    headers: Sequence[Header], path: bytes, max_headers: int
) -> Malformed | Refusal | None:
    """Whether a request head is a gRPC call of `path` (None: it is). Malformed: the head
    breaks HTTP/2 (its stream is reset); a Refusal: another method, path or encoding."""
    request = read_request(headers, (), max_headers)
    if isinstance(request, Malformed):
        return request
    if request.method != "POST":
        return Refusal(Status.UNIMPLEMENTED, "gRPC calls are POST requests", http=405)
    if not request.grpc:
        return Refusal(Status.UNIMPLEMENTED, "not a gRPC call (content-type)", http=415)
    if request.path.encode("latin-1") != path:
        return Refusal(Status.UNIMPLEMENTED, f"no method {request.path[:128]} here")
    for name, value in headers:
        if name == b"grpc-encoding" and value != b"identity":
            return Refusal(Status.UNIMPLEMENTED, "compressed messages are not accepted")
    return None


class MessageReader:
    """Reads the one request message of a unary call, of at most `limit` bytes."""

    __slots__ = ("_buf", "_length", "limit", "message")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.message: bytes | None = None  # set once it is whole
        self._buf = bytearray()
        self._length = -1  # -1: the prefix is not read yet

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> Refusal | None:
        """Takes bytes of the request's body; a Refusal ends the call (nothing more is read)."""
        if not data:
            return None
        if self.message is not None:
            return Refusal(Status.INVALID_ARGUMENT, "more than one message on a unary call")
        buf = self._buf
        if self._length < 0:
            need = PREFIX_SIZE - len(buf)
            buf += data[:need]
            data = data[need:]
            if len(buf) < PREFIX_SIZE:
                return None
            flag, length = _PREFIX.unpack(buf)
            if flag:
                return Refusal(Status.UNIMPLEMENTED, "compressed messages are not accepted")
            if length > self.limit:
                return Refusal(
                    Status.RESOURCE_EXHAUSTED,
                    f"a request message of {length} bytes is over the {self.limit}-byte limit",
                )
            self._length = length
            buf.clear()
        need = self._length - len(buf)
        if len(data) > need:
            return Refusal(Status.INVALID_ARGUMENT, "more than one message on a unary call")
        buf += data
        if len(buf) == self._length:
            self.message = bytes(buf)
            buf.clear()
        return None

    def end(self) -> bytes | Refusal:
        """The request's body ended: its message, or why there is none."""
        if self.message is not None:
            return self.message
        if self._length < 0 and not self._buf:
            return Refusal(Status.INVALID_ARGUMENT, "no request message")
        return Refusal(Status.INVALID_ARGUMENT, "the request message is cut short")


def message_frame(payload: bytes) -> bytes:
    """One response message as it goes in DATA frames."""
    return _PREFIX.pack(0, len(payload)) + payload


RESPONSE_HEAD: Final[tuple[Header, ...]] = (
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
)


def trailers(status: Status, message: str = "") -> list[Header]:
    """The trailers that end a call."""
    fields = [(b"grpc-status", b"%d" % status)]
    if message:
        fields.append((b"grpc-message", grpc_message(message)[:512]))
    return fields


def refusal_head(refusal: Refusal) -> list[Header]:
    """The whole answer to a refused call: a trailers-only gRPC response, or an HTTP status."""
    if refusal.http != 200:
        return [(b":status", b"%d" % refusal.http), (b"content-length", b"0")]
    return [*RESPONSE_HEAD, *trailers(refusal.status, refusal.message)]
