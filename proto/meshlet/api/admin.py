"""The admin HTTP endpoints every meshlet process serves: /metrics, /ready, /live (what
kubelet probes and Prometheus scrape), and, where enabled, POST /shutdown from loopback only
and a process's own JSON documents (the destination's Prometheus service discovery).

Any pod can reach a proxy's admin port, so what one client can cost the process is bounded:
- a request's head (at most MAX_REQUEST_HEAD bytes) and its body (MAX_BODY) must arrive
  within READ_TIMEOUT seconds, else 400 and close (a slow partial head holds nothing longer);
- at most MAX_CONNECTIONS connections are open at once: one more closes the oldest still
  reading its request, else the oldest of all (legitimate clients, kubelet's probes and
  Prometheus, are done in milliseconds and are never the oldest);
- a response is written MAX_CHUNK bytes at a time, each only once the client took the last,
  and must be written whole within WRITE_TIMEOUT seconds, else the connection is aborted: a
  client that asks for /metrics and never reads holds one chunk, not a copy of the metrics;
- /metrics renders, on the event loop, at most one at a time and the next only RENDER_SPACING
  times the last one's duration after it ended: requests that arrive meanwhile wait for that
  render and share it, so a flood of scrapes takes at most 1 / (1 + RENDER_SPACING) of the
  loop, and every answer is a render that began after its request arrived. A render given in
  pieces (the proxy's registry: `series.Registry.render_chunks`) lets other work run between
  them, so a large registry does not hold the loop for the whole render either.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Final

from meshlet.api.hostport import HostPort

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD: Final = 8192
READ_TIMEOUT: Final = 5.0  # seconds for a request's head and body
WRITE_TIMEOUT: Final = 10.0  # seconds for a response to be taken by its client
MAX_CONNECTIONS: Final = 64  # open at once
MAX_CHUNK: Final = 64 * 1024  # bytes of a response written before waiting for the client
RENDER_SPACING: Final = 4.0  # a /metrics render's duration, times this, before the next
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class AdminServer:
    """A deliberately small HTTP/1.1 server: one request per connection, bounded (see the
    module docstring)."""

    def __init__(
        self,
        metrics: Callable[[], bytes | Iterable[bytes]],
        ready: Callable[[], bool],
        shutdown: Callable[[], None] | None = None,
        log_level: Callable[[str], str] | None = None,
        documents: Mapping[bytes, Callable[[], bytes]] | None = None,
    ) -> None:
        # Renders /metrics in Prometheus' text format: whole, or in pieces (other work on the
        # loop runs between two).
        self._metrics = metrics
        self._ready = ready
        self._shutdown = shutdown  # None: /shutdown is disabled
        # Sets the level from a request body and returns it, or raises ValueError; None:
        # PUT /proxy-log-level is not served.
        self._log_level = log_level
        # Other GET paths answered with a JSON document (application/json), made per request.
        self._documents = dict(documents or {})
        self._server: asyncio.Server | None = None
        # Open connections, oldest first; True once the request was read (it is answered).
        self._open: dict[asyncio.StreamWriter, bool] = {}
        self._render_lock = asyncio.Lock()
        self._rendered = b""
        self._render_began = -1.0  # loop time the last render began
        self._next_render = 0.0  # loop time from which another render may begin

    async def start(self, host: str, port: int) -> HostPort:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_HEAD)
        return HostPort.from_sockaddr(self._server.sockets[0].getsockname())

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        try:
            await self._answer(reader, writer)
        finally:
            self._open.pop(writer, None)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Counts a new connection in, closing the oldest past MAX_CONNECTIONS."""
        if len(self._open) >= MAX_CONNECTIONS:
            reading = [w for w, answered in self._open.items() if not answered]
            oldest = reading[0] if reading else next(iter(self._open))
            del self._open[oldest]
            oldest.transport.abort()
        self._open[writer] = False

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                content = await reader.readexactly(_content_length(head))
            if writer in self._open:
                self._open[writer] = True
            status, body = await self._respond(head, peer[0] if peer else "", content)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, body = "400 Bad Request", b"bad request\n"
        except ConnectionError:
            return
        if writer.transport.is_closing():
            return  # closed for a newer connection
        if body.startswith(b"#"):
            content_type = METRICS_CONTENT_TYPE
        elif body[:1] in (b"[", b"{"):
            content_type = "application/json"
        else:
            content_type = "text/plain"
        head_out = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}"
            "\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
                writer.write(head_out)
                view = memoryview(body)
                for at in range(0, len(body), MAX_CHUNK):
                    writer.write(view[at : at + MAX_CHUNK])
                    await writer.drain()
                await writer.drain()
        except TimeoutError:
            log.debug("admin: %r did not take its response within %gs", peer, WRITE_TIMEOUT)
            writer.transport.abort()
        except ConnectionError:
            pass

    async def _respond(self, head: bytes, peer: str, content: bytes) -> tuple[str, bytes]:
        status, body = self._route(head, peer, content)
        return status, await self._render() if body is None else body

    async def _render(self) -> bytes:
        """The metrics, from a render that began after this call: at most one at a time, the
        next RENDER_SPACING times the last's duration after it ended."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        async with self._render_lock:
            if self._render_began >= asked:
                return self._rendered  # a render that began after we asked: it is ours too
            wait = self._next_render - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._render_began = loop.time()
            rendered = self._metrics()
            took = 0.0  # the loop's time spent rendering (not the pauses between pieces)
            if not isinstance(rendered, bytes):
                pieces = []
                for piece in _timed(rendered, loop.time):
                    took += piece[1]
                    pieces.append(piece[0])
                    await asyncio.sleep(0)
                rendered = b"".join(pieces)
            else:
                took = loop.time() - self._render_began
            self._rendered = rendered
            self._next_render = loop.time() + RENDER_SPACING * took
            return rendered

    def _route(self, head: bytes, peer: str, content: bytes = b"") -> tuple[str, bytes | None]:
        """The answer to a request (a body of None: the metrics, rendered by `_render`)."""
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
            return "200 OK", None  # rendered by `_render`
        if target in self._documents:
            return "200 OK", self._documents[target]()
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


def _timed(pieces: Iterable[bytes], clock: Callable[[], float]) -> Iterator[tuple[bytes, float]]:
    """Each piece, with the time it took to make."""
    it = iter(pieces)
    while True:
        start = clock()
        piece = next(it, None)
        if piece is None:
            return
        yield piece, clock() - start


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
