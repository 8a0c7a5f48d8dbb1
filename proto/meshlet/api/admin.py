"""The admin HTTP endpoints every meshlet process serves: /metrics, /ready, /live (what
kubelet probes and Prometheus scrape), and, where enabled, POST /shutdown from loopback only."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import Final

from meshlet.api.hostport import HostPort

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD: Final = 8192
READ_TIMEOUT: Final = 5.0
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class AdminServer:
    """A deliberately small HTTP/1.1 server: one request per connection, bounded head."""

    def __init__(
        self,
        metrics: Callable[[], bytes],
        ready: Callable[[], bool],
        shutdown: Callable[[], None] | None = None,
        log_level: Callable[[str], str] | None = None,
    ) -> None:
        self._metrics = metrics  # renders /metrics in Prometheus' text format
        self._ready = ready
        self._shutdown = shutdown  # None: /shutdown is disabled
        # Sets the level from a request body and returns it, or raises ValueError; None:
        # PUT /proxy-log-level is not served.
        self._log_level = log_level
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> HostPort:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_HEAD)
        return HostPort.from_sockaddr(self._server.sockets[0].getsockname())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                content = await reader.readexactly(_content_length(head))
            status, body = self._route(head, peer[0] if peer else "", content)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, body = "400 Bad Request", b"bad request\n"
        except ConnectionError:
            writer.close()
            return
        content_type = METRICS_CONTENT_TYPE if body.startswith(b"#") else "text/plain"
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}"
            "\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _route(self, head: bytes, peer: str, content: bytes = b"") -> tuple[str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return "400 Bad Request", b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if target == b"/shutdown":
            return self._shutdown_route(method, peer)
        if target == b"/proxy-log-level" and self._log_level is not None:
            return self._log_level_route(method, peer, content)
        if method != b"GET":
            return "405 Method Not Allowed", b"only GET\n"
        if target == b"/metrics":
            return "200 OK", self._metrics()
        if target == b"/live":
            return "200 OK", b"live\n"
        if target == b"/ready":
            return ("200 OK", b"ready\n") if self._ready() else ("503 Service Unavailable",
                                                                 b"not ready\n")  # fmt: skip
        return "404 Not Found", b"not found\n"

    def _log_level_route(self, method: bytes, peer: str, content: bytes) -> tuple[str, bytes]:
        assert self._log_level is not None
        if not _loopback(peer):
            log.warning("refused PUT /proxy-log-level from %r: loopback only", peer)
            return "403 Forbidden", b"the log level is set from loopback only\n"
        if method != b"PUT":
            return "405 Method Not Allowed", b"PUT /proxy-log-level with the level as body\n"
        try:
            level = self._log_level(content.decode("ascii", "replace"))
        except ValueError as exc:
            return "400 Bad Request", f"{exc}\n".encode()
        log.warning("log level set to %s from %s", level, peer)
        return "200 OK", f"log level {level}\n".encode()

    def _shutdown_route(self, method: bytes, peer: str) -> tuple[str, bytes]:
        if self._shutdown is None:
            return "404 Not Found", b"shutdown is not enabled\n"
        if not _loopback(peer):
            log.warning("refused /shutdown from %r: only loopback may shut the proxy down", peer)
            return "403 Forbidden", b"shutdown only from loopback\n"
        if method != b"POST":
            return "405 Method Not Allowed", b"POST /shutdown\n"
        self._shutdown()
        return "202 Accepted", b"shutting down\n"


MAX_BODY: Final = 64  # bytes: the only body accepted is a log level


def _content_length(head: bytes) -> int:
    """The request's Content-Length (0 without one); ValueError past MAX_BODY or malformed."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
            if not 0 <= length <= MAX_BODY:
                raise ValueError("body too large")
            return length
    return 0


def _loopback(peer: str) -> bool:
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False
