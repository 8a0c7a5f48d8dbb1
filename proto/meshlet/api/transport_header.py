"""The transport header between proxies: encoder and an incremental, bounded decoder."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import DecodeError

from meshlet.api import transport_pb2

PREFACE: Final = b"transport.l5d.io/v1\r\n\r\n"
_LENGTH_SIZE: Final = 4
# A header holds a port, a DNS name and a tag: anything larger is hostile.
MAX_HEADER_SIZE: Final = 1024


class SessionProtocol(enum.Enum):
    OPAQUE = "opaque"
    HTTP1 = "http1"
    HTTP2 = "http2"


@dataclass(frozen=True, slots=True)
class Header:
    port: int
    name: str = ""
    protocol: SessionProtocol = SessionProtocol.OPAQUE


@dataclass(frozen=True, slots=True)
class Incomplete:
    """More bytes are needed; at least `needed` in total."""

    needed: int


@dataclass(frozen=True, slots=True)
class Decoded:
    header: Header
    consumed: int


class TransportHeaderError(ValueError):
    """The bytes are not a valid transport header."""


def encode(header: Header) -> bytes:
    msg = transport_pb2.Header(port=header.port, name=header.name)
    if header.protocol is SessionProtocol.HTTP1:
        msg.session_protocol.http1.SetInParent()
    elif header.protocol is SessionProtocol.HTTP2:
        msg.session_protocol.http2.SetInParent()
    body = msg.SerializeToString()
    return PREFACE + len(body).to_bytes(_LENGTH_SIZE, "big") + body


def decode(buf: bytes | bytearray | memoryview) -> Incomplete | Decoded:
    """Decodes a header at the start of `buf`; raises TransportHeaderError on invalid bytes."""
    view = memoryview(buf)
    seen = min(len(view), len(PREFACE))
    if view[:seen] != PREFACE[:seen]:
        raise TransportHeaderError("connection does not start with the transport header preface")
    start = len(PREFACE) + _LENGTH_SIZE
    if len(view) < start:
        return Incomplete(start)
    length = int.from_bytes(view[len(PREFACE) : start], "big")
    if length > MAX_HEADER_SIZE:
        raise TransportHeaderError(f"transport header of {length} bytes exceeds {MAX_HEADER_SIZE}")
    end = start + length
    if len(view) < end:
        return Incomplete(end)
    msg = transport_pb2.Header()
    try:
        msg.ParseFromString(bytes(view[start:end]))
    except DecodeError as exc:
        raise TransportHeaderError(f"transport header is not a valid message: {exc}") from exc
    if not 0 < msg.port < 65536:
        raise TransportHeaderError(f"transport header names port {msg.port}, not in 1..65535")
    kind = msg.session_protocol.WhichOneof("kind") if msg.HasField("session_protocol") else None
    protocol = {
        None: SessionProtocol.OPAQUE,
        "http1": SessionProtocol.HTTP1,
        "http2": SessionProtocol.HTTP2,
    }[kind]
    return Decoded(Header(msg.port, msg.name, protocol), end)
