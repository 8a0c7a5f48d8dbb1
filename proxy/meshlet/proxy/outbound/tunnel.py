"""CONNECT on the outbound listener: an app that uses the proxy as its HTTP proxy (grpcio's
`grpc_proxy`, `https_proxy`, curl's `-p`) opens a tunnel with a CONNECT request as the first
bytes of a connection that was not redirected. The head is read here, exactly up to its end
(the bytes after it are the tunnel's), and answered: 200 once the stack knows where the tunnel
goes, else the error's status, with `meshlet-proxy-error`, and the connection closed.

Limits: the head must be complete within `limits.header_read_timeout` of the accept and within
MAX_HEAD bytes (431 otherwise); its target must be authority-form `host:port` (400 otherwise).
CONNECT anywhere else (a later request of a connection, a redirected connection) is answered
405 by the HTTP/1 engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from typing import Final

from meshlet.proxy.authority import split_authority
from meshlet.proxy.http.contract import RouteError
from meshlet.proxy.io.listener import Accepted, peek_until

MAX_HEAD: Final = 16 * 1024  # bytes of a CONNECT request's head, fields and all
_TOKEN: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a field name (RFC 9110)
_VALUE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # no control characters
ESTABLISHED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"
_REASONS: Final = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout",
                   431: "Request Header Fields Too Large", 502: "Bad Gateway",
                   503: "Service Unavailable", 504: "Gateway Timeout"}  # fmt: skip


def is_connect(first_bytes: bytes) -> bool:
    """Whether a connection's first bytes are a CONNECT request (after the empty lines a
    server ignores before a request line, as detection does)."""
    return first_bytes.lstrip(b"\r\n").startswith(b"CONNECT ")


async def read_head(accepted: Accepted, within: float) -> str | RouteError | None:
    """The authority a CONNECT request names (`host:port`), its head consumed from the
    socket; a RouteError to answer; None when the client closed first."""
    sock = accepted.sock
    try:
        async with asyncio.timeout_at(accepted.deadline(within)):
            data = await peek_until(sock, lambda seen: _end(seen) >= 0, MAX_HEAD)
    except TimeoutError:
        return RouteError(408, "the CONNECT request's head did not arrive in time")
    except OSError:
        return None
    end = _end(data)
    if end < 0:
        if len(data) >= MAX_HEAD:
            return RouteError(431, "the CONNECT request's head is too large")
        with contextlib.suppress(OSError):  # read, so that closing sends a FIN, not a reset
            sock.recv(len(data))
        return None  # the client half-closed before its head was complete
    try:
        head = sock.recv(end + 4)  # the head only: what follows is the tunnel's
    except OSError:
        return None
    return _authority(head)


def _end(data: bytes) -> int:
    """Where the head's final empty line starts (-1: not yet); empty lines before the request
    line are skipped."""
    return data.find(b"\r\n\r\n", len(data) - len(data.lstrip(b"\r\n")))


def _authority(head: bytes) -> str | RouteError:
    line, *fields = head.lstrip(b"\r\n").split(b"\r\n")
    for field in fields[:-2]:  # the head ends with two empty lines
        name, colon, value = field.partition(b":")
        if not colon or not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(value):
            return RouteError(400, "malformed CONNECT header field")
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] != b"CONNECT" or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return RouteError(400, "malformed CONNECT request line")
    try:
        authority = parts[1].decode("ascii")
    except UnicodeDecodeError:
        return RouteError(400, "the CONNECT target is not ASCII")
    addr = split_authority(authority, default_port=0)
    if addr is None or addr.port == 0 or not addr.host or "/" in authority:
        return RouteError(400, "the CONNECT target must be host:port")
    return authority


def answer(sock: socket.socket, error: RouteError) -> None:
    """The error as the tunnel's answer; the connection is closed."""
    reason = error.reason.encode("ascii", "replace")
    status = f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}\r\n".encode()
    try:
        sock.send(status + b"meshlet-proxy-error: " + reason +
                  b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")  # fmt: skip
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


def established(sock: socket.socket) -> bool:
    """Tells the client its tunnel is open; False when it is gone."""
    try:
        return sock.send(ESTABLISHED) == len(ESTABLISHED)
    except OSError:
        return False
