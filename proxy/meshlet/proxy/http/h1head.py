"""HTTP/1.1 message heads (pure): which heads the proxy accepts, and the heads it forwards.

llhttp (through httptools) already rejects malformed syntax; this module enforces the rest of
HARDENING.md's list on the parsed fields: framing it cannot relay safely (Transfer-Encoding on
HTTP/1.0, codings other than a lone `chunked`), several Host headers, odd request targets, versions
other than 1.0/1.1, CONNECT. It drops hop-by-hop and internal headers and re-serializes heads with
the framing the proxy chooses. No sockets and no clock here.

Statuses: 400 for malformed framing or targets, 501 for a transfer coding other than `chunked`,
505 for an HTTP version other than 1.0/1.1, 405 for CONNECT; the engine adds 414 (target over
MAX_TARGET_BYTES), 431 (headers over the limits) and 408 (head not received in time).
"""

from __future__ import annotations

import enum
import http
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from meshlet.api.target import EscapedSlashes, Refused, normalize_host, normalize_target
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.http.contract import (
    INTERNAL_HEADERS,
    PROXY_ERROR_HEADER,
    PROXY_RESPONSE_HEADERS,
    Redirection,
    error_reason,
    location_value,
)

Header = tuple[bytes, bytes]

MAX_TARGET_BYTES: Final = 8 * 1024

_REASONS: Final = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_STATUS_LINES: Final = {
    code: b"HTTP/1.1 %d %s" % (code, phrase) for code, phrase in _REASONS.items()
}
_FIELD_LINE: Final = b": ".join  # of a (name, value) pair: `name: value`
_ABSOLUTE: Final = re.compile(rb"[hH][tT][tT][pP]://([^/?#]*)(.*)", re.DOTALL)
# Hosts lately found normal (a connection's requests repeat one): each is checked once.
# Bounded, forgotten all at once.
_NORMAL_HOSTS: Final[dict[bytes, None]] = {}
_NORMAL_HOSTS_KEPT: Final = 1024


class Body(enum.Enum):
    """How a body is delimited on the wire."""

    NONE = "none"  # no body follows the head
    LENGTH = "length"  # Content-Length bytes, relayed as they are
    CHUNKED = "chunked"  # chunked: re-framed piece by piece
    EOF = "eof"  # until the connection closes (responses only)


# What the proxy does with a field it reads, by lower-cased name; absent: forwarded as is.
_DROP, _HOST, _LENGTH, _CODING, _CONNECTION, _UPGRADE, _TE, _EXPECT = range(8)
_HOP_BY_HOP: Final = {
    b"connection": _CONNECTION,
    b"keep-alive": _DROP,
    b"proxy-connection": _DROP,
    b"te": _TE,
    b"trailer": _DROP,
    b"transfer-encoding": _CODING,
    b"upgrade": _UPGRADE,
    b"http2-settings": _DROP,  # goes with `Upgrade: h2c`, which is never passed on
}
_REQUEST_FIELDS: Final = {
    **_HOP_BY_HOP,
    **dict.fromkeys(INTERNAL_HEADERS, _DROP),
    b"host": _HOST,
    b"content-length": _LENGTH,
    b"expect": _EXPECT,
}
# A response from a peer proxy keeps its `meshlet-proxy-error`; any other's is dropped.
_PEER_RESPONSE_FIELDS: Final = {**_HOP_BY_HOP, b"content-length": _LENGTH}
_RESPONSE_FIELDS: Final = {**_PEER_RESPONSE_FIELDS, **dict.fromkeys(PROXY_RESPONSE_HEADERS, _DROP)}
# Trailer fields that would change framing or routing are never relayed.
_NOT_TRAILERS: Final = frozenset(
    {*_HOP_BY_HOP, b"content-length", b"host", b"content-type", *INTERNAL_HEADERS}
)
# Connection options that name no header; other options name headers dropped as hop-by-hop.
_CONNECTION_OPTIONS: Final = frozenset({b"close", b"keep-alive", b"upgrade"})
_FRAMING: Final = frozenset({b"host", b"content-length", b"transfer-encoding"})
_H2_FRAMING: Final = frozenset({b"host", b"content-length"})  # written by the proxy itself


@dataclass(frozen=True, slots=True)
class Rejection:
    """A head the proxy refuses: answered locally with `status`, the connection closed."""

    status: int
    reason: str


class RequestHead(NamedTuple):
    """An accepted request: where it goes and the head forwarded upstream.

    Heads are NamedTuples, not frozen dataclasses: as immutable, and built four times faster on
    the per-request path (measured: 0.5 µs against 2-3 µs)."""

    head: bytes  # origin-form target, HTTP/1.1, hop-by-hop and internal fields dropped
    authority: str | None  # from the absolute-form target, else Host
    body: Body  # NONE, LENGTH or CHUNKED
    length: int  # with Body.LENGTH
    keep_alive: bool  # the client keeps the connection after the response
    http10: bool
    head_only: bool  # HEAD: the response carries no body
    expect_continue: bool
    upgrade: bool  # a protocol upgrade (never h2c): bytes are relayed after a 101
    method: str = "GET"
    path: str = "/"  # origin-form, with the query
    headers: Sequence[Header] = ()  # the fields as received (route matching reads them)


class ResponseHead(NamedTuple):
    """A response head as the client receives it."""

    head: bytes
    body_in: Body  # how the upstream delimits the body
    body_out: Body  # how the client receives it: NONE, LENGTH (as received), CHUNKED or EOF
    close: bool  # the client connection closes after this response


def _tokens(value: bytes) -> list[bytes]:
    if b"," not in value:  # mostly one token (`Connection: keep-alive`)
        return [value.strip().lower()]
    return [t.strip().lower() for t in value.split(b",")]


def _without_options(fields: list[Header], options: list[bytes]) -> list[Header]:
    if _CONNECTION_OPTIONS.issuperset(options):
        return fields
    named = {t for t in options if t not in _CONNECTION_OPTIONS and t not in _FRAMING}
    if not named:
        return fields
    return [(n, v) for n, v in fields if n.lower() not in named]


def _codings_body(codings: list[bytes]) -> Body | Rejection:
    if codings.count(b"chunked") != 1 or codings[-1] != b"chunked":
        return Rejection(400, "Transfer-Encoding must end with a single chunked coding")
    if len(codings) > 1:
        return Rejection(501, "transfer codings other than chunked are not supported")
    return Body.CHUNKED


def parse_request(
    method: bytes,
    target: bytes,
    version: str,
    fields: Sequence[Header],
    add_headers: Sequence[Header] = (),
    slashes: EscapedSlashes = EscapedSlashes.KEEP,
) -> RequestHead | Rejection:
    """Checks a request head llhttp parsed and builds the head forwarded upstream, its target
    and Host in the one form the proxy routes on and the app receives (meshlet.api.target)."""
    if version == "1.1":
        http10 = False
    elif version == "1.0":
        http10 = True
    else:
        return Rejection(505, f"HTTP/{version} is not supported; use HTTP/1.1")
    if method == b"CONNECT":
        return Rejection(405, "CONNECT is not supported by the proxy")
    kept: list[Header] = []
    hosts: list[bytes] = []
    length: bytes | None = None
    codings: list[bytes] | None = None
    connection: list[bytes] = []
    upgrade: bytes | None = None
    trailers = expect_continue = False
    for name, value in fields:
        kind = _REQUEST_FIELDS.get(name.lower())
        if kind is None:
            kept.append((name, value))
        elif kind == _HOST:
            hosts.append(value.strip())
        elif kind == _LENGTH:
            value = value.strip()
            if not value.isdigit() or len(value) > 18 or (length is not None and length != value):
                return Rejection(400, "invalid or conflicting Content-Length")
            length = value
        elif kind == _CODING:
            codings = (codings or []) + _tokens(value)
        elif kind == _CONNECTION:
            connection += _tokens(value)
        elif kind == _UPGRADE:
            upgrade = value if upgrade is None else upgrade + b"," + value
        elif kind == _TE:
            trailers = trailers or any(t.split(b";")[0] == b"trailers" for t in _tokens(value))
        elif kind == _EXPECT:
            expect_continue = value.strip().lower() == b"100-continue"
            kept.append((name, value))
    if connection:
        kept = _without_options(kept, connection)

    body, size = Body.NONE, 0
    if codings is not None:
        if http10:
            return Rejection(400, "Transfer-Encoding is not allowed in an HTTP/1.0 request")
        if length is not None:
            return Rejection(400, "both Content-Length and Transfer-Encoding")
        framing = _codings_body(codings)
        if isinstance(framing, Rejection):
            return framing
        body = framing
    elif length is not None:
        body, size = Body.LENGTH, int(length)

    if len(hosts) > 1:
        return Rejection(400, "more than one Host header")
    host = hosts[0] if hosts else None
    if target[:1] == b"/":
        path = target
    elif (absolute := _ABSOLUTE.fullmatch(target)) is not None:
        host, path = absolute.group(1), absolute.group(2)
        if not host:
            return Rejection(400, "absolute-form target without a host")
        if path[:1] != b"/":
            path = b"/" + path
    elif target == b"*" and method == b"OPTIONS":
        path = target
    else:
        return Rejection(400, "request target must be origin-form (/path) or http:// absolute-form")
    # Most targets are normal already, which four scans of the text tell (MAY_CHANGE of
    # meshlet.api.target; on str: `in` on bytes raises and clears a TypeError each time).
    text = path.decode("latin-1")
    if "%" in text or "/." in text or "//" in text or "#" in text:
        normal = normalize_target(path, slashes)
        if isinstance(normal, Refused):
            return Rejection(400, normal.reason)
        path = normal
        text = path.decode("latin-1")
    if host and host not in _NORMAL_HOSTS:
        normal_host = normalize_host(host)
        if normal_host is None:
            return Rejection(400, "invalid Host: not a host name or address with a port")
        if normal_host is host:
            if len(_NORMAL_HOSTS) >= _NORMAL_HOSTS_KEPT:
                _NORMAL_HOSTS.clear()
            _NORMAL_HOSTS[host] = None
        host = normal_host

    upgrading = False
    if upgrade is not None and b"upgrade" in connection and not http10:
        protocols = [p for p in (t.strip() for t in upgrade.split(b",")) if p]
        protocols = [p for p in protocols if p.lower() != b"h2c"]  # h2c: stays HTTP/1.1
        if protocols:
            upgrading, upgrade = True, b", ".join(protocols)

    lines = [method + b" " + path + b" HTTP/1.1"]
    if host:
        lines.append(b"Host: " + host)
    lines += map(_FIELD_LINE, kept)
    if body is Body.CHUNKED:
        lines.append(b"Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(b"Content-Length: " + length)
    if trailers:
        lines.append(b"TE: trailers")
    if upgrading and upgrade is not None:
        lines += (b"Connection: upgrade", b"Upgrade: " + upgrade)
    lines += map(_FIELD_LINE, add_headers)
    lines.append(b"\r\n")
    return RequestHead(
        b"\r\n".join(lines),
        host.decode("ascii") if host else None,
        body,
        size,
        (b"keep-alive" in connection) if http10 else (b"close" not in connection),
        http10,
        method == b"HEAD",
        expect_continue,
        upgrading,
        method.decode("latin-1"),
        text,
        fields,
    )


def modify_head(head: bytes, modifier: HeaderModifier) -> bytes:
    """A head serialized here (a request's or a response's), its fields changed by a route's
    filters. The fields the proxy writes itself (framing, Host, `meshlet-client-id`) are ones
    no modifier may name (meshlet.api.headers), so they stay as they are."""
    start, _, rest = head[:-4].partition(b"\r\n")
    fields = [_split_field(line) for line in rest.split(b"\r\n")] if rest else []
    return b"\r\n".join([start, *map(_FIELD_LINE, modifier.apply(fields)), b"\r\n"])


def _split_field(line: bytes) -> Header:
    name, _, value = line.partition(b": ")
    return name, value


def parse_response(
    status: int,
    fields: Sequence[Header],
    request: RequestHead,
    close: bool,
    from_peer_proxy: bool = False,
) -> ResponseHead | Rejection:
    """The head the client receives for an upstream response to `request`; `close` when the
    client connection is to close after it anyway (shutdown, or the request asked so);
    `from_peer_proxy` when the upstream is a meshed peer's proxy, whose error headers are kept."""
    table = _PEER_RESPONSE_FIELDS if from_peer_proxy else _RESPONSE_FIELDS
    kept: list[Header] = []
    length: bytes | None = None
    codings: list[bytes] | None = None
    connection: list[bytes] = []
    upgrade: bytes | None = None
    for name, value in fields:
        kind = table.get(name.lower())
        if kind is None:
            kept.append((name, value))
        elif kind == _LENGTH:
            value = value.strip()
            if not value.isdigit() or (length is not None and length != value):
                return Rejection(502, "upstream sent an invalid Content-Length")
            length = value
            kept.append((name, value))
        elif kind == _CODING:
            codings = (codings or []) + _tokens(value)
        elif kind == _CONNECTION:
            connection += _tokens(value)
        elif kind == _UPGRADE:
            upgrade = value
    if connection:
        kept = _without_options(kept, connection)

    lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown" % status]
    lines += map(_FIELD_LINE, kept)
    if status < 200:
        if status == 101:
            if not request.upgrade or upgrade is None:
                return Rejection(502, "upstream switched protocols without an upgrade request")
            lines += (b"Connection: upgrade", b"Upgrade: " + upgrade, b"\r\n")
            return ResponseHead(b"\r\n".join(lines), Body.EOF, Body.EOF, True)
        lines.append(b"\r\n")
        return ResponseHead(b"\r\n".join(lines), Body.NONE, Body.NONE, False)

    close = close or not request.keep_alive or request.upgrade
    if codings is not None:
        if codings != [b"chunked"]:
            return Rejection(502, "upstream used a transfer coding other than chunked")
        body_in = Body.CHUNKED
    elif length is not None:
        body_in = Body.LENGTH
    else:
        body_in = Body.EOF
    if request.head_only or status in (204, 304):
        body_in = body_out = Body.NONE
    elif body_in is Body.LENGTH:
        body_out = Body.LENGTH
    elif request.http10:
        body_out, close = Body.EOF, True
    else:
        body_out = Body.CHUNKED
        lines.append(b"Transfer-Encoding: chunked")
    if close:
        lines.append(b"Connection: close")
    elif request.http10:
        lines.append(b"Connection: keep-alive")
    lines.append(b"\r\n")
    return ResponseHead(b"\r\n".join(lines), body_in, body_out, close)


def h2_response_fields(
    status: int, fields: Sequence[Header], head_only: bool
) -> tuple[list[Header], Body] | Rejection:
    """An upstream's HTTP/1.1 response head as HTTP/2 fields (`:status` first, names in lower
    case, hop-by-hop fields, the ones `Connection` names and the proxy's own error headers
    dropped), and how the upstream delimits its body."""
    kept: list[Header] = [(b":status", b"%d" % status)]
    length: bytes | None = None
    codings: list[bytes] | None = None
    connection: list[bytes] = []
    for name, value in fields:
        name = name.lower()
        kind = _RESPONSE_FIELDS.get(name)
        if kind is None:
            kept.append((name, value.strip(b" \t")))
        elif kind == _LENGTH:
            value = value.strip()
            if not value.isdigit() or (length is not None and length != value):
                return Rejection(502, "upstream sent an invalid Content-Length")
            if length is None:
                kept.append((name, value))
            length = value
        elif kind == _CODING:
            codings = (codings or []) + _tokens(value)
        elif kind == _CONNECTION:
            connection += _tokens(value)
    if connection:
        kept = _without_options(kept, connection)
    if head_only or status in (204, 304) or status < 200:
        return kept, Body.NONE
    if codings is not None:
        if codings != [b"chunked"] or length is not None:
            return Rejection(502, "upstream framed its body other than by chunked alone")
        return kept, Body.CHUNKED
    return kept, (Body.LENGTH if length is not None else Body.EOF)


def h1_request_head(
    method: str,
    path: str,
    authority: str | None,
    headers: Sequence[Header],
    length: int,
    chunked: bool,
    added: int = 0,
) -> bytes:
    """An HTTP/2 request's head (checked by h2headers.read_request) as the HTTP/1.1 head the
    proxy forwards for the same request sent as HTTP/1.1 (`parse_request`): request line,
    `Host`, the fields in their order, the framing (`length`, or `chunked`), `TE`, then the
    last `added` fields (the proxy's own)."""
    lines = [f"{method} {path} HTTP/1.1".encode("latin-1")]
    if authority:
        lines.append(b"Host: " + authority.encode("latin-1"))
    end = len(headers) - added
    trailers = False
    for header in headers[:end]:
        name = header[0]
        if name == b"te":
            trailers = True
        elif name[:1] != b":" and name not in _H2_FRAMING:
            lines.append(_FIELD_LINE(header))
    if chunked:
        lines.append(b"Transfer-Encoding: chunked")
    elif length >= 0:
        lines.append(b"Content-Length: %d" % length)
    if trailers:
        lines.append(b"TE: trailers")
    lines += map(_FIELD_LINE, headers[end:])
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


def last_chunk(trailers: Sequence[Header]) -> bytes:
    """The end of a chunked body, with the trailer fields that may be relayed."""
    kept = [n + b": " + v + b"\r\n" for n, v in trailers if n.lower() not in _NOT_TRAILERS]
    return b"0\r\n" + b"".join(kept) + b"\r\n"


def local_response(status: int, reason: str, *, close: bool, http10: bool = False) -> bytes:
    """A response the proxy answers itself, carrying `meshlet-proxy-error: <reason>` (or, for
    a route's redirect, its `Location`)."""
    if isinstance(reason, Redirection):
        lines = [
            b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Redirect")),
            b"Location: " + location_value(reason),
            b"Content-Length: 0",
        ]
        if close:
            lines.append(b"Connection: close")
        elif http10:
            lines.append(b"Connection: keep-alive")
        return b"\r\n".join(lines) + b"\r\n\r\n"
    text = error_reason(reason)
    body = text + b"\n"
    lines = [
        b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error")),
        b"Content-Type: text/plain",
        b"Content-Length: %d" % len(body),
        PROXY_ERROR_HEADER + b": " + text,
    ]
    if close:
        lines.append(b"Connection: close")
    elif http10:
        lines.append(b"Connection: keep-alive")
    lines.append(b"\r\n")
    return b"\r\n".join(lines) + body
