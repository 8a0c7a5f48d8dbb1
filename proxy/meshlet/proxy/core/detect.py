"""Protocol detection from the first bytes of a connection (pure).

HTTP/1 is decided from a short prefix that no other protocol the proxy must relay starts with:
a known method and a space (`GET `), or any other method token, a space and the start of a
request target (`/`, `*`, `http://`); only another token followed by another word waits for its
line, which is HTTP when it ends with a version (`FOO bar HTTP/1.1`). What follows (an
over-long target, a bad version, smuggling, odd spaces) is the HTTP/1 engine's to refuse (414,
505, 400). Deciding this way matters for security: bytes an HTTP server would parse as a
request must never be relayed as opaque TCP, where the proxy's HTTP defences and its
`meshlet-client-id` header do not apply.

"Space" and "empty line" are read as the most lenient HTTP/1 server in common use reads them:
Python's `http.server` (under wsgiref and the development servers of werkzeug and Django)
splits the request line with `str.split()`, so a TAB, VT, FF, the C0 separators FS, GS, RS, US,
NEL or NBSP (latin-1) separate its words and any of them, or CR and LF, may lead it; llhttp
skips empty lines before a request line. `GET\t/admin\tHTTP/1.1` and ` GET / HTTP/1.1` are
therefore HTTP (the engine answers them 400), never opaque.

Bytes that are still a prefix of an HTTP request when no more will be awaited (the detection
timeout, or PEEK_BYTES seen) are HTTP/1 too (`final=True`): the engine then answers 408 or 400.
Only a connection on which the client sent nothing, or a partial TLS record, settles as OPAQUE.
"""

from __future__ import annotations

import enum
import re
from typing import Final, Literal, overload

H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PEEK_BYTES: Final = 512
# Methods llhttp parses in HTTP mode (RFC 9110, WebDAV, CalDAV, UPnP, PURGE, QUERY).
KNOWN_METHODS: Final = frozenset(
    b"DELETE GET HEAD POST PUT CONNECT OPTIONS TRACE PATCH COPY LOCK MKCOL MOVE PROPFIND "
    b"PROPPATCH SEARCH UNLOCK BIND REBIND UNBIND ACL REPORT MKACTIVITY CHECKOUT MERGE M-SEARCH "
    b"NOTIFY SUBSCRIBE UNSUBSCRIBE PURGE MKCALENDAR LINK UNLINK SOURCE QUERY".split()
)
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SCHEMES: Final = (b"http://", b"https://")
# What separates the words of a request line (http.server's `str.split()` over latin-1), and
# what may come before one (those and empty lines).
_SPACE: Final = b" \t\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0"
_BLANK: Final = _SPACE + b"\r\n"
_WORD: Final = re.compile(rb"[^ \t\x0b\x0c\r\n\x1c-\x1f\x85\xa0]+")


class Protocol(enum.Enum):
    HTTP1 = "http/1"
    HTTP2 = "h2"
    TLS = "tls"
    OPAQUE = "opaque"


class NeedMore(enum.Enum):
    """The bytes so far are a prefix of more than one protocol."""

    NEED_MORE = "need-more"


NEED_MORE: Final = NeedMore.NEED_MORE


@overload
def detect(data: bytes, *, final: Literal[True]) -> Protocol: ...
@overload
def detect(data: bytes, *, final: bool = False) -> Protocol | NeedMore: ...


def detect(data: bytes, *, final: bool = False) -> Protocol | NeedMore:
    """The protocol the connection speaks, or NEED_MORE while `data` is still ambiguous.

    With `final` (no more bytes will be awaited) the answer is never NEED_MORE: a prefix of an
    HTTP request is HTTP1, nothing at all or a partial TLS record header is OPAQUE.
    """
    if not data:
        return Protocol.OPAQUE if final else NEED_MORE
    if data[0] == 0x16:  # TLS handshake record
        if len(data) < 6:
            return Protocol.OPAQUE if final else NEED_MORE
        if data[1] == 3 and data[5] == 1:  # version 3.x, ClientHello
            return Protocol.TLS
        return Protocol.OPAQUE
    if H2_PREFACE.startswith(data[: len(H2_PREFACE)]):
        if len(data) >= len(H2_PREFACE):
            return Protocol.HTTP2
        return Protocol.HTTP1 if final else NEED_MORE  # `PRI * HTTP/2.0…` cut short
    # Empty lines and spaces before a request line are skipped by HTTP/1 servers (RFC 9112
    # 2.2; llhttp skips any number of empty lines, http.server any whitespace), so they must
    # not hide the request behind them from detection.
    verdict = _http1(data.lstrip(_BLANK))
    if verdict is NEED_MORE and (final or len(data) >= PEEK_BYTES):
        return Protocol.HTTP1
    return verdict


def _http1(data: bytes) -> Protocol | NeedMore:
    """HTTP1, OPAQUE, or NEED_MORE while `data` is a prefix of an HTTP/1 request's start."""
    if not data:
        return NEED_MORE  # only empty lines so far
    token = _TOKEN.match(data)
    if token is None:
        return Protocol.OPAQUE
    end = token.end()
    if end == len(data):
        return NEED_MORE  # a method, still arriving
    if data[end] not in _SPACE:  # a token ended by anything but a space: `PING\r\n`, `*1\r\n`
        return Protocol.OPAQUE
    if token[0] in KNOWN_METHODS:
        return Protocol.HTTP1
    rest = data[end:].lstrip(_SPACE)
    if not rest:
        return NEED_MORE
    if rest[0] in b"/*":  # origin-form or asterisk-form target: an unknown method
        return Protocol.HTTP1
    lowered = rest[: len(_SCHEMES[1])].lower()
    if any(lowered.startswith(scheme) for scheme in _SCHEMES):  # absolute-form
        return Protocol.HTTP1
    # Another word (`EHLO mail.example.com`, memcached's `get key`): a request line only if
    # its last word is a version, as http.server reads `FOO bar HTTP/1.1`.
    line_end = rest.find(b"\n")
    if line_end < 0:
        return NEED_MORE
    words = _WORD.findall(rest, 0, line_end)
    return Protocol.HTTP1 if words[-1].startswith(b"HTTP/") else Protocol.OPAQUE


def may_be_http(data: bytes, *, final: bool = False) -> bool | None:
    """Whether `data`, the first bytes a client sends, may be an HTTP request (None: not known
    yet). A relay that skipped detection uses it to refuse HTTP that arrives late."""
    verdict = detect(data, final=final)
    if verdict is NEED_MORE:
        return None
    return verdict in (Protocol.HTTP1, Protocol.HTTP2)
