"""Protocol detection from the first bytes of a connection (pure)."""

from __future__ import annotations

import enum
import re
from typing import Final

H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PEEK_BYTES: Final = 512
# An HTTP/1 request line: a method token, a space, a target, a space, HTTP/1.x.
_TOKEN: Final = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE: Final = re.compile(rb"^" + _TOKEN + rb" [^ \r\n]+ HTTP/1\.[01]\r?\n")
_PARTIAL_LINE: Final = re.compile(rb"^" + _TOKEN + rb"( [^ \r\n]*( ([^\n]*))?)?$")


class Protocol(enum.Enum):
    HTTP1 = "http/1"
    HTTP2 = "h2"
    TLS = "tls"
    OPAQUE = "opaque"


class NeedMore(enum.Enum):
    """The bytes so far are a prefix of more than one protocol."""

    NEED_MORE = "need-more"


NEED_MORE: Final = NeedMore.NEED_MORE


def detect(data: bytes) -> Protocol | NeedMore:
    """The protocol the connection speaks, or NEED_MORE while `data` is still ambiguous.

    At PEEK_BYTES (or at the detection timeout) the caller treats NEED_MORE as OPAQUE.
    """
    if not data:
        return NEED_MORE
    if data[0] == 0x16:  # TLS handshake record
        if len(data) < 6:
            return NEED_MORE
        if data[1] == 3 and data[5] == 1:  # version 3.x, ClientHello
            return Protocol.TLS
        return Protocol.OPAQUE
    if H2_PREFACE.startswith(data[: len(H2_PREFACE)]):
        return Protocol.HTTP2 if len(data) >= len(H2_PREFACE) else NEED_MORE
    line_end = data.find(b"\n")
    if line_end >= 0:
        return Protocol.HTTP1 if _REQUEST_LINE.match(data[: line_end + 1]) else Protocol.OPAQUE
    if len(data) >= PEEK_BYTES:
        return Protocol.OPAQUE
    return NEED_MORE if _could_be_request_line(data) else Protocol.OPAQUE


def _could_be_request_line(data: bytes) -> bool:
    """Whether `data` (no newline yet) can still grow into an HTTP/1 request line."""
    match = _PARTIAL_LINE.match(data)
    if match is None:
        return False
    version = match[3]
    return version is None or any(v.startswith(version) for v in (b"HTTP/1.1\r", b"HTTP/1.0\r"))
