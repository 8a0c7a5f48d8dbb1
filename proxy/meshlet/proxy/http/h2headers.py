"""HTTP/2 header blocks as the proxy relays them: validation (done here, not by h2) and rewriting.

h2 validates header blocks with a chain of generators and per-byte Python loops; the proxy turns
that off (`validate_inbound_headers=False`) and runs the same RFC 9113 §8.2-8.3 checks in one
pass that also does the work it needs anyway: stripping headers only the proxy may set, adding
its own, finding the authority and whether the request is gRPC. Pure functions over header lists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from hpack import NeverIndexedHeaderTuple

from meshlet.api.target import EscapedSlashes, Refused, normalize_host, normalize_target
from meshlet.proxy.core.header_modifier import HeaderModifier
from meshlet.proxy.http.contract import (
    INTERNAL_HEADERS,
    ORIG_PROTO_HEADER,
    PROXY_ERROR_HEADER,
    PROXY_RESPONSE_HEADERS,
    Redirection,
    error_reason,
    location_value,
)
from meshlet.proxy.http.h2codec import header_list_size

Header = tuple[bytes, bytes]

# RFC 9113 §8.2.2: hop-by-hop headers have no meaning in HTTP/2; a message carrying one is
# malformed.
CONNECTION_HEADERS: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
# Credentials are kept out of the HPACK dynamic table of the (shared) upstream connection.
SENSITIVE_HEADERS: Final = frozenset({b"authorization", b"proxy-authorization"})
GRPC_UNAVAILABLE: Final = "14"
GRPC_DEADLINE_EXCEEDED: Final = "4"
# The gRPC status of the proxy's own answers, by the HTTP status it would give (as Linkerd's
# synthetic responses): 403 PERMISSION_DENIED, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 504
# DEADLINE_EXCEEDED; any other UNAVAILABLE.
GRPC_STATUS_OF: Final = {403: "7", 404: "5", 429: "8", 504: GRPC_DEADLINE_EXCEEDED}

# RFC 9113 §8.2.1: a name is 0x21-0x7e without uppercase and, past a pseudo-header's leading
# colon, without ':'. Deleting the allowed bytes leaves something only when the name is bad.
_NAME_BYTES: Final = bytes(c for c in range(0x21, 0x7F) if not 0x41 <= c <= 0x5A and c != 0x3A)
# A value has no NUL, CR or LF and no leading or trailing space or tab.
_BAD_VALUE: Final = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
_REQUEST_PSEUDO: Final = frozenset({b":method", b":scheme", b":path", b":authority"})
# RFC 9110 §9.1: a method is a token.
_METHOD: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9113 §8.3.1: a :path is a request target: no space or control byte (which an HTTP/1 app
# behind a translating hop would split on) and no DEL. `_PATH_WORK` finds those and whatever
# meshlet.api.target's normalization may change (MAY_CHANGE): one search tells a :path valid
# and normal.
_BAD_PATH: Final = re.compile(rb"[\x00-\x20\x7f]")
_PATH_WORK: Final = re.compile(rb"[\x00-\x20\x7f#%]|/\.|//")
_STATUS: Final = re.compile(rb"[1-9][0-9][0-9]\Z")


class Request(NamedTuple):
    """A valid request head, rewritten to be sent upstream."""

    headers: list[Header]
    authority: str | None  # `:authority`, else `host`
    grpc: bool  # content-type application/grpc*
    method: str = "GET"
    path: str = "/"
    length: int = -1  # its content-length (-1: none): the body's DATA must add up to it
    # An HTTP/1.1 request a peer proxy sent as this stream (`meshlet-orig-proto`): it goes to
    # the app as HTTP/1.1 (http/orig_proto.py).
    orig_proto: bool = False
    # Its header list's size as SETTINGS_MAX_HEADER_LIST_SIZE counts it (at most: the fields it
    # came with, and those added).
    size: int = 0


class Response(NamedTuple):
    """A valid response head (final or 1xx) as received."""

    headers: Sequence[Header]
    status: int
    grpc_status: str | None  # set on a trailers-only gRPC response
    length: int = -1  # its content-length (-1: none)


class Trailers(NamedTuple):
    headers: Sequence[Header]
    grpc_status: str | None


@dataclass(frozen=True, slots=True)
class Malformed:
    """A header block that must not be relayed: the stream is reset, or, with `answer` (a
    well-formed request the proxy declines: too big, a target it refuses), answered `status`."""

    reason: str
    status: int = 400
    answer: bool = False


# Fields that passed `_field_error` lately: a connection's peers repeat the same few (HPACK
# hands them out from its tables), so each is checked once. Bounded, forgotten all at once.
_VALID: Final[dict[tuple[bytes, bytes], None]] = {}
_VALID_ENTRIES: Final = 4096
_VALID_LENGTH: Final = 256  # name and value: longer fields are checked every time


def _field_error(name: bytes, value: bytes) -> str | None:
    field = (name, value)
    if field in _VALID:
        return None
    error = _check_field(name, value)
    if error is None and len(name) + len(value) <= _VALID_LENGTH:
        if len(_VALID) >= _VALID_ENTRIES:
            _VALID.clear()
        _VALID[field] = None
    return error


def _check_field(name: bytes, value: bytes) -> str | None:
    if not name or name.translate(None, _NAME_BYTES):
        return f"invalid header name {name[:64]!r}"
    if _BAD_VALUE.search(value) is not None:
        return f"invalid value for header {name[:64]!r}"
    if name in CONNECTION_HEADERS:
        return f"connection-specific header {name.decode()!r}"
    if name == b"te" and value.lower() != b"trailers":
        return "te other than trailers"
    return None


def _value_error(header: Header) -> bool:
    """Whether a pseudo-header's value is bad (remembered as `_field_error` does). A `:path` or
    `:authority` is remembered only once `read_request` found it in its normal form."""
    if header in _VALID:
        return False
    name, value = header
    if name == b":path":
        return False  # `_normal_path` checks it, with its normal form
    if _BAD_VALUE.search(value) is not None:
        return True
    if name == b":method":
        if _METHOD.fullmatch(value) is None:
            return True
        _remember(header)
    elif name == b":scheme":
        _remember(header)
    return False


def _remember(header: Header) -> None:
    if len(header[0]) + len(header[1]) <= _VALID_LENGTH:
        if len(_VALID) >= _VALID_ENTRIES:
            _VALID.clear()
        _VALID[header] = None


def _normal_path(path: bytes, slashes: EscapedSlashes) -> bytes | Malformed:
    """A `:path` in the one form the proxy routes on and forwards (meshlet.api.target)."""
    if path == b"*" or (b":path", path) in _VALID:
        return path
    if _PATH_WORK.search(path) is None:
        _remember((b":path", path))
        return path
    if _BAD_PATH.search(path) is not None:
        return Malformed("a :path with a space or control byte")
    normal = normalize_target(path, slashes)
    if isinstance(normal, Refused):
        return Malformed(normal.reason, 400, answer=True)
    if normal is path:
        _remember((b":path", path))
    return normal


def _normal_authority(authority: bytes) -> bytes | Malformed:
    """An `:authority` (or `host`) in its normal form (meshlet.api.target)."""
    if (b":authority", authority) in _VALID:
        return authority
    host = normalize_host(authority)
    if host is None:
        return Malformed("an :authority that is not a host name or address", 400, answer=True)
    if host is authority:
        _remember((b":authority", authority))
    return host


# What `read_request` does with a field, by name; absent: checked and kept.
_PSEUDO, _INTERNAL, _HOST, _CONTENT_TYPE, _SENSITIVE, _LENGTH, _ORIG_PROTO = range(7)
_REQUEST_FIELDS: Final = {
    **dict.fromkeys(_REQUEST_PSEUDO, _PSEUDO),
    **dict.fromkeys(INTERNAL_HEADERS, _INTERNAL),
    ORIG_PROTO_HEADER: _ORIG_PROTO,
    **dict.fromkeys(SENSITIVE_HEADERS, _SENSITIVE),
    b"host": _HOST,
    b"content-type": _CONTENT_TYPE,
    b"content-length": _LENGTH,
}
_MAX_LENGTH_DIGITS: Final = 18  # a content-length fits an int64


def _content_length(value: bytes, seen: int) -> int | None:
    """A content-length's value; None when it is not a length, or differs from one `seen`
    before (-1: none): RFC 9110 §8.6."""
    if not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
        return None
    length = int(value)
    return None if seen not in (-1, length) else length


def read_request(
    block: Sequence[Header],
    add: Sequence[Header],
    max_headers: int,
    slashes: EscapedSlashes = EscapedSlashes.KEEP,
    from_proxy: bool = False,
    size: int = 0,
) -> Request | Malformed:
    """Checks a request head and rewrites it for the upstream: `:path`, `:authority` and `host`
    normalized (meshlet.api.target), internal headers stripped, `add` appended, credentials marked
    never-indexed. `meshlet-orig-proto: HTTP/1.1` is read only `from_proxy` (a meshed peer's
    proxy): stripped from anyone else's request, as every internal header is. `size`: the
    block's header list size, when the decoder counted it (else it is counted here)."""
    if len(block) > max_headers:
        return Malformed(f"more than {max_headers} headers", 431, answer=True)
    out: list[Header] = []
    pseudo: dict[bytes, bytes] = {}
    host: bytes | None = None
    grpc = False
    regular = False
    fresh = False  # a pseudo-header not known valid and normal: the target needs a look
    length = -1
    orig_proto = False
    for header in block:
        name, value = header
        kind = _REQUEST_FIELDS.get(name)
        if kind == _PSEUDO:
            if regular:
                return Malformed(f"pseudo-header {name.decode()} after headers")
            if name in pseudo:
                return Malformed(f"duplicate {name.decode()}")
            if header not in _VALID:
                if _value_error(header):
                    return Malformed(f"invalid value for {name.decode()}")
                fresh = True
            pseudo[name] = value
            out.append(header)
            continue
        if name[:1] == b":":
            if regular:
                return Malformed(f"pseudo-header {name.decode(errors='replace')} after headers")
            return Malformed(f"pseudo-header {name[:64]!r} not allowed in a request")
        regular = True
        if header not in _VALID:
            error = _field_error(name, value)
            if error is not None:
                return Malformed(error)
        if kind is None:
            out.append(header)
        elif kind == _HOST:
            if host is not None:
                return Malformed("more than one host header")
            host = value
            out.append(header)
        elif kind == _CONTENT_TYPE:
            grpc = value.startswith(b"application/grpc")
            out.append(header)
        elif kind == _SENSITIVE:
            out.append(NeverIndexedHeaderTuple(name, value))
        elif kind == _LENGTH:
            declared = _content_length(value, length)
            if declared is None:
                return Malformed("an invalid content-length")
            length = declared
            out.append(header)
        elif kind == _ORIG_PROTO:
            orig_proto = from_proxy and value == b"HTTP/1.1"
        # _INTERNAL: dropped
    method = pseudo.get(b":method")
    if method is None:
        return Malformed("no :method")
    authority = pseudo.get(b":authority")
    if method == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or authority is None:
            return Malformed("CONNECT needs :authority and no :scheme or :path")
    elif b":scheme" not in pseudo or not pseudo.get(b":path"):
        return Malformed("no :scheme or :path")
    elif pseudo[b":path"][:1] != b"/" and (pseudo[b":path"] != b"*" or method != b"OPTIONS"):
        return Malformed("a :path not starting with / (only OPTIONS may ask for *)")
    if authority is not None and host is not None and authority != host:
        return Malformed("host differs from :authority")
    named = authority if authority is not None else host
    path = pseudo.get(b":path") or b""
    if fresh or authority is None:  # else the path and authority were seen valid and normal
        if named is not None:
            normal = _normal_authority(named)
            if isinstance(normal, Malformed):
                return normal
            if normal is not named:
                out = [(h[0], normal) if h[0] in (b":authority", b"host") else h for h in out]
                named = normal
        if path:
            normal_path = _normal_path(path, slashes)
            if isinstance(normal_path, Malformed):
                return normal_path
            if normal_path is not path:
                out = [(b":path", normal_path) if h[0] == b":path" else h for h in out]
                path = normal_path
    size = size or header_list_size(block)
    if add:
        out.extend(add)
        size += header_list_size(add)
    return Request(out, named.decode("latin-1") if named is not None else None, grpc,
                   method.decode("latin-1"), path.decode("latin-1"), length,
                   orig_proto, size)  # fmt: skip


def modify_request(request: Request, modifier: HeaderModifier) -> Request:
    """The request with its headers changed by a route's filters (names are lower case on both
    sides; pseudo-headers and the proxy's own are names no modifier may use, so they stay);
    credentials it writes are marked never-indexed, as `read_request` marks the client's."""
    drop = modifier.drop
    headers = [h for h in request.headers if h[0] not in drop]
    headers += (NeverIndexedHeaderTuple(*h) if h[0] in SENSITIVE_HEADERS else h
                for h in modifier.append)  # fmt: skip
    return request._replace(headers=headers, size=header_list_size(headers))


def read_response(block: Sequence[Header], from_peer_proxy: bool = False) -> Response | Malformed:
    """Checks a response head from an upstream: `:status` first and alone, valid fields. The
    proxy's error headers are removed unless the upstream is a meshed peer's proxy."""
    if not block or block[0][0] != b":status" or _STATUS.match(block[0][1]) is None:
        return Malformed("response without a valid :status first", 502)
    grpc_status = None
    strip = False
    length = -1
    for name, value in block[1:]:
        if name[:1] == b":":
            return Malformed(f"pseudo-header {name[:64]!r} in a response", 502)
        error = _field_error(name, value)
        if error is not None:
            return Malformed(error, 502)
        if name == b"grpc-status":
            grpc_status = value.decode("latin-1")
        elif name == b"content-length":
            if length == -1 and value.isdigit() and len(value) <= _MAX_LENGTH_DIGITS:
                length = int(value)  # the common case, without a call
                continue
            declared = _content_length(value, length)
            if declared is None:
                return Malformed("an invalid content-length", 502)
            length = declared
        elif name in PROXY_RESPONSE_HEADERS and not from_peer_proxy:
            strip = True
    if strip:
        block = [h for h in block if h[0] not in PROXY_RESPONSE_HEADERS]
    return Response(block, int(block[0][1]), grpc_status, length)


def read_trailers(block: Sequence[Header]) -> Trailers | Malformed:
    """Checks trailers (either direction): no pseudo-headers, valid fields; headers only the
    proxy may set are removed."""
    grpc_status = None
    strip = False
    for name, value in block:
        if name[:1] == b":":
            return Malformed(f"pseudo-header {name[:64]!r} in trailers", 502)
        error = _field_error(name, value)
        if error is not None:
            return Malformed(error, 502)
        if name == b"grpc-status":
            grpc_status = value.decode("latin-1")
        elif name in INTERNAL_HEADERS:
            strip = True
    if strip:
        block = [h for h in block if h[0] not in INTERNAL_HEADERS]
    return Trailers(block, grpc_status)


def grpc_message(text: str) -> bytes:
    """Percent-encodes as gRPC's `grpc-message` requires (printable ASCII except '%' kept)."""
    return b"".join(
        bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c
        for c in text.encode("utf-8")
    )


def grpc_status_of(status: int) -> str:
    return GRPC_STATUS_OF.get(status, GRPC_UNAVAILABLE)


def local_response(
    status: int, reason: str, grpc: bool, grpc_status: str | None = None
) -> list[Header]:
    """The head of a response the proxy answers itself (ends the stream). gRPC clients get a
    trailers-only response (HTTP 200, `grpc-status`: 14 UNAVAILABLE, or 4 DEADLINE_EXCEEDED for
    a timeout) that they understand."""
    if isinstance(reason, Redirection) and not grpc:
        return [(b":status", str(status).encode()), (b"location", location_value(reason)),
                (b"content-length", b"0")]  # fmt: skip
    proxy_error = (PROXY_ERROR_HEADER, error_reason(reason).strip() or b"error")
    if grpc:
        return [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", (grpc_status or grpc_status_of(status)).encode()),
            (b"grpc-message", grpc_message(reason.strip())[:512]),
            proxy_error,
        ]
    return [(b":status", str(status).encode()), proxy_error, (b"content-length", b"0")]
