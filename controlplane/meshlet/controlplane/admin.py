"""The control plane's admin HTTP server: /metrics, /ready and /live."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD: Final = 8192
READ_TIMEOUT: Final = 5.0


class AdminServer:
    """A deliberately small HTTP/1.1 server: GET only, one request per connection."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        self._registry = registry
        self._ready = ready
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_HEAD)
        sockname = self._server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, content_type, body = self._route(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, content_type, body = "400 Bad Request", "text/plain", b"bad request\n"
        except ConnectionError:
            writer.close()
            return
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        try:
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _route(self, head: bytes) -> tuple[str, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return "400 Bad Request", "text/plain", b"bad request\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if target == b"/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if target == b"/live":
            return "200 OK", "text/plain", b"live\n"
        if target == b"/ready":
            if self._ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"not ready\n"
        return "404 Not Found", "text/plain", b"not found\n"
