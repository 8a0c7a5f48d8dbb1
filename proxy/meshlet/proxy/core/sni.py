"""The server name (SNI) of a TLS ClientHello, read from the first bytes of a connection (pure).

`parse_sni(data)` never raises and never reads past its bounds: it answers `Incomplete(needed)`
while the ClientHello is still arriving (`needed`: the total byte count to peek next), `Sni(name)`
once it is complete (`name` None when the hello carries no server name), and `NOT_TLS` for bytes
that are not a well-formed ClientHello. The hello may span several TLS records (RFC 8446 §5.1);
a hello over MAX_HELLO_BYTES, or one needing more than MAX_PEEK_BYTES of records, is refused
as NOT_TLS, so a caller never peeks more than MAX_PEEK_BYTES.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

MAX_HELLO_BYTES: Final = 16 * 1024  # the ClientHello message body; real ones are under 2 KiB
_RECORD_HEADER: Final = 5
_MAX_RECORD: Final = 2**14  # RFC 8446 §5.1: a plaintext fragment is at most 2^14 bytes
_HANDSHAKE_HEADER: Final = 4
# Records and their headers: room for a maximal hello cut into a few records, no more.
MAX_PEEK_BYTES: Final = 2 * (_RECORD_HEADER + _MAX_RECORD)

_CONTENT_HANDSHAKE: Final = 0x16
_CLIENT_HELLO: Final = 0x01
_EXT_SERVER_NAME: Final = 0x0000
_HOST_NAME: Final = 0x00
_MAX_NAME: Final = 253  # a DNS name, dots included (RFC 1035 §3.1)
_NAME_BYTES: Final = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")


@dataclass(frozen=True, slots=True)
class Incomplete:
    """More bytes are needed: at least `needed` in total (from the start of the connection)."""

    needed: int


@dataclass(frozen=True, slots=True)
class Sni:
    """A complete ClientHello; `name` is its host name (lower case), None when it sends none."""

    name: str | None


class NotTls(enum.Enum):
    """The bytes are not a well-formed TLS ClientHello (or one larger than MAX_HELLO_BYTES)."""

    NOT_TLS = "not-tls"


NOT_TLS: Final = NotTls.NOT_TLS

Result = Incomplete | Sni | NotTls


class _Malformed(Exception):
    """Raised inside the parser only; `parse_sni` answers NOT_TLS."""


def parse_sni(data: bytes | bytearray | memoryview) -> Result:
    """Reads the SNI from the ClientHello at the start of `data`; see the module docstring."""
    hello = _hello(memoryview(data))
    if not isinstance(hello, memoryview):
        return hello
    try:
        return Sni(_server_name(hello))
    except _Malformed:
        return NOT_TLS


def _hello(data: memoryview) -> memoryview | Incomplete | NotTls:
    """The ClientHello body, reassembled from its handshake records, or what stops that."""
    body = bytearray()
    wanted = _HANDSHAKE_HEADER  # handshake bytes needed: the header, then the whole message
    offset = 0
    while len(body) < wanted:
        if len(data) < offset + _RECORD_HEADER:
            if len(data) > offset and data[offset] != _CONTENT_HANDSHAKE:
                return NOT_TLS
            if len(data) > offset + 1 and data[offset + 1] != 3:
                return NOT_TLS
            return _incomplete(offset + _RECORD_HEADER)
        kind, major = data[offset], data[offset + 1]
        length = int.from_bytes(data[offset + 3 : offset + 5], "big")
        if kind != _CONTENT_HANDSHAKE or major != 3 or not 0 < length <= _MAX_RECORD:
            return NOT_TLS
        end = offset + _RECORD_HEADER + length
        if len(data) < end:
            if len(body) < _HANDSHAKE_HEADER:
                # Check the handshake header as soon as it is there, before waiting for more.
                seen = body + data[offset + _RECORD_HEADER :]
                bad = _bad_handshake_header(seen)
                if bad is not None:
                    return bad
            return _incomplete(end)
        body += data[offset + _RECORD_HEADER : end]
        offset = end
        if wanted == _HANDSHAKE_HEADER and len(body) >= _HANDSHAKE_HEADER:
            bad = _bad_handshake_header(body)
            if bad is not None:
                return bad
            wanted = _HANDSHAKE_HEADER + int.from_bytes(body[1:4], "big")
    return memoryview(body)[_HANDSHAKE_HEADER:wanted]


def _incomplete(needed: int) -> Incomplete | NotTls:
    return Incomplete(needed) if needed <= MAX_PEEK_BYTES else NOT_TLS


def _bad_handshake_header(seen: bytes | bytearray) -> NotTls | None:
    if seen and seen[0] != _CLIENT_HELLO:
        return NOT_TLS
    if len(seen) >= _HANDSHAKE_HEADER:
        length = int.from_bytes(seen[1:4], "big")
        if not 0 < length <= MAX_HELLO_BYTES:
            return NOT_TLS
    return None


class _Reader:
    """Bounds-checked reads over a buffer; every overrun raises _Malformed."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    @property
    def left(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise _Malformed
        start = self._pos
        self._pos += n
        return self._data[start : self._pos]

    def take_all(self) -> memoryview:
        return self.take(self.left)

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, length_size: int) -> _Reader:
        """A length-prefixed vector, as a reader of its own."""
        return _Reader(self.take(self.uint(length_size)))


def _server_name(hello: memoryview) -> str | None:
    """RFC 8446 §4.1.2 ClientHello, then RFC 6066 §3 server_name."""
    reader = _Reader(hello)
    reader.take(2 + 32)  # legacy_version, random
    if len(reader.vector(1).take_all()) > 32:  # legacy_session_id
        raise _Malformed
    suites = reader.vector(2)
    if suites.left == 0 or suites.left % 2:
        raise _Malformed
    if reader.vector(1).left == 0:  # legacy_compression_methods
        raise _Malformed
    if reader.left == 0:
        return None  # no extensions at all (before TLS 1.2): no name
    extensions = reader.vector(2)
    if reader.left:
        raise _Malformed  # bytes after the extensions
    name: str | None = None
    seen: set[int] = set()
    while extensions.left:
        kind = extensions.uint(2)
        data = extensions.vector(2)
        if kind in seen:
            raise _Malformed  # RFC 8446 §4.2: no extension type twice
        seen.add(kind)
        if kind == _EXT_SERVER_NAME:
            name = _host_name(data)
    return name


def _host_name(extension: _Reader) -> str | None:
    names = extension.vector(2)
    if extension.left:
        raise _Malformed
    found: str | None = None
    while names.left:
        kind = names.uint(1)
        value = names.vector(2).take_all()
        if kind != _HOST_NAME:
            continue  # other name types are not defined; skipped
        if found is not None:
            raise _Malformed  # RFC 6066: at most one name of a type
        found = _valid_name(value)
    return found


def _valid_name(value: memoryview) -> str:
    raw = bytes(value)
    if not 0 < len(raw) <= _MAX_NAME or not _NAME_BYTES.issuperset(raw):
        raise _Malformed
    if raw.endswith(b".") or raw.startswith(b".") or b".." in raw:
        raise _Malformed
    return raw.decode("ascii").lower()
