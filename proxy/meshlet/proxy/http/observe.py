"""Access logs and trace spans: what the request driver (attempts.py) reports of each request
when the workload asks for either, and nothing otherwise.

The driver holds an `Observation` only when the connection's recorder has an observer (a
workload with `config.meshlet.io/access-log` or a trace collector); without one, the whole
cost is one check per request. One place for both engines: the observation starts when the
request is routed, notes when it was first sent upstream and the response head, and ends when
the driver records the response.

Access log lines carry linkerd2-proxy's fields. `apache` is its Apache-common-like line,

    CLIENT_ADDR CLIENT_ID - [TIMESTAMP] "METHOD URI VERSION" STATUS

and `json` one object per line with every field: `client.addr`, `client.id` (`-` without
mTLS), `timestamp` (RFC 3339, UTC), `method`, `uri`, `version`, `trace_id`, `request_bytes`
and `response_bytes` (the content-length headers, "" when absent), `status`, `total_ns` (from
the request's arrival to its response head), `processing_ns` (of which the proxy's own part:
routing, discovery and connecting, up to the first byte sent upstream), `user_agent`, `host`.
Lines go to stderr from a thread of their own behind `LOG_BUFFER` bytes: past that (stderr
slower than the traffic), lines are dropped and counted (`access_log_dropped_total`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from meshlet.proxy.http import tracing
from meshlet.proxy.http.contract import RequestTarget, RouteTarget
from meshlet.proxy.io.counters import Counted

if TYPE_CHECKING:
    from meshlet.proxy.http.export import SpanExport

log = logging.getLogger(__name__)
Header = tuple[bytes, bytes]
LOG_BUFFER: Final = 1024 * 1024
NO_ID: Final = "-"
CLOSE_TIMEOUT: Final = 2.0  # seconds to write out what is buffered at shutdown


class LineWriter:
    """Lines to a file descriptor, written by a thread of their own behind a bounded buffer,
    so that a slow reader of the descriptor never stalls the event loop."""

    def __init__(self, fd: int, dropped: Counted, limit: int = LOG_BUFFER) -> None:
        self._fd = fd
        self._dropped = dropped
        self._limit = limit
        self._lines: list[bytes] = []
        self._size = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        """Writes what is buffered, then stops the thread (blocks: call it off the loop)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT)

    def write(self, line: bytes) -> None:
        """Queues `line`, or drops it (counted) when the buffer is full; never blocks."""
        with self._lock:
            if self._size + len(line) > self._limit:
                self._dropped.inc()
                return
            self._lines.append(line)
            self._size += len(line)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="access-log", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                lines, self._lines = self._lines, []
            data = memoryview(b"".join(lines))
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError:
                pass
            with self._lock:
                self._size -= sum(map(len, lines))
                if self._closed and not self._lines:
                    return


class Entry:
    """One request as an access log line shows it."""

    __slots__ = (
        "client",
        "client_id",
        "host",
        "method",
        "processing_ns",
        "request_bytes",
        "response_bytes",
        "status",
        "timestamp",
        "total_ns",
        "trace_id",
        "uri",
        "user_agent",
        "version",
    )

    def __init__(self, client: str, client_id: str, target: RequestTarget, wall: float) -> None:
        headers: Sequence[Header] = getattr(target, "headers", ())
        self.client = client
        self.client_id = client_id or NO_ID
        self.timestamp = _rfc3339(wall)
        self.method = target.method
        self.host = _header(headers, b"host") or _header(headers, b":authority")
        authority = target.authority or self.host
        self.uri = f"http://{authority}{target.path}" if authority else target.path
        self.version = _version(target)
        self.trace_id = tracing.trace_id_of(headers)
        self.request_bytes = _header(headers, b"content-length")
        self.user_agent = _header(headers, b"user-agent")
        self.response_bytes = ""
        self.status = 0
        self.total_ns = 0
        self.processing_ns = 0


def apache(entry: Entry) -> bytes:
    return (
        f'{entry.client} {entry.client_id} - [{entry.timestamp}] "{entry.method} {entry.uri} '
        f'{entry.version}" {entry.status}\n'
    ).encode("utf-8", "replace")


def json_line(entry: Entry) -> bytes:
    fields = {
        "client.addr": entry.client,
        "client.id": entry.client_id,
        "timestamp": entry.timestamp,
        "method": entry.method,
        "uri": entry.uri,
        "version": entry.version,
        "trace_id": entry.trace_id,
        "request_bytes": entry.request_bytes,
        "status": entry.status,
        "response_bytes": entry.response_bytes,
        "total_ns": entry.total_ns,
        "processing_ns": entry.processing_ns,
        "user_agent": entry.user_agent,
        "host": entry.host,
    }
    return (json.dumps(fields, ensure_ascii=False) + "\n").encode("utf-8", "replace")


FORMATS: Final[dict[str, Callable[[Entry], bytes]]] = {"apache": apache, "json": json_line}


class Observe:
    """The proxy's access log and span export (either may be None)."""

    def __init__(
        self,
        log_format: Callable[[Entry], bytes] | None,
        writer: LineWriter | None,
        spans: SpanExport | None,
    ) -> None:
        self.format = log_format
        self.writer = writer
        self.spans = spans

    def close(self) -> None:
        """Writes out the lines and spans left (blocks: call it off the loop)."""
        if self.writer is not None:
            self.writer.close()
        if self.spans is not None:
            self.spans.close()

    def connection(self, direction: str, client: str, client_id: str) -> ConnObserver:
        return ConnObserver(self, direction, client, client_id)


class ConnObserver:
    """An `Observe` for the requests of one client connection."""

    __slots__ = ("client", "client_id", "direction", "observe")

    def __init__(self, observe: Observe, direction: str, client: str, client_id: str) -> None:
        self.observe = observe
        self.direction = direction
        self.client = client
        self.client_id = client_id

    def started(self, target: RequestTarget) -> Observation:
        return Observation(self, target)


class Observation:
    """One request's access log entry and span, from its route to its recorded response."""

    __slots__ = ("conn", "context", "entry", "response_headers", "sent_at", "span_id", "start",
                 "wall")  # fmt: skip

    def __init__(self, conn: ConnObserver, target: RequestTarget) -> None:
        self.conn = conn
        self.wall = time.time()
        self.start = time.perf_counter()
        self.sent_at = 0.0
        self.response_headers: Sequence[Header] = ()
        observe = conn.observe
        self.entry = (
            Entry(conn.client, conn.client_id, target, self.wall)
            if observe.format is not None
            else None
        )
        self.context: tracing.TraceContext | None = None
        self.span_id = ""
        if observe.spans is not None:
            context = tracing.parse(getattr(target, "headers", ()))
            if context is not None and context.sampled:
                self.context = context
                self.span_id = tracing.new_span_id()

    def routed(self, route: RouteTarget) -> RouteTarget:
        """The route the request is forwarded on: for a sampled request, its headers name the
        proxy's span as the parent."""
        context = self.context
        if context is None:
            return route
        change = tracing.continued(context, self.span_id)
        headers = route.request_headers
        return route._replace(request_headers=change if headers is None else headers.then(change))

    def sent(self) -> None:
        if not self.sent_at:
            self.sent_at = time.perf_counter()

    def finished(
        self, target: RequestTarget, status: int, grpc_status: str | None, failed: bool
    ) -> None:
        """Writes the log line and queues the span; a failure here never reaches the request."""
        try:
            self._finish(target, status, grpc_status, failed)
        except Exception:
            log.exception("recording the access log line or span of a request failed")

    def _finish(
        self, target: RequestTarget, status: int, grpc_status: str | None, failed: bool
    ) -> None:
        now = time.perf_counter()
        observe = self.conn.observe
        entry = self.entry
        if entry is not None and observe.format is not None and observe.writer is not None:
            entry.status = status
            entry.total_ns = int((now - self.start) * 1e9)
            entry.processing_ns = int(((self.sent_at or now) - self.start) * 1e9)
            entry.response_bytes = _header(self.response_headers, b"content-length")
            observe.writer.write(observe.format(entry))
        context = self.context
        if context is not None and observe.spans is not None:
            from meshlet.proxy.http.export import Span

            attributes: dict[str, str | int] = {
                "http.request.method": target.method,
                "url.path": target.path,
                "server.address": target.authority or "",
                "http.response.status_code": status,
            }
            if grpc_status is not None:
                attributes["rpc.grpc.status_code"] = (
                    int(grpc_status) if grpc_status.isdigit() else -1
                )
            start_ns = int(self.wall * 1e9)
            observe.spans.add(Span(
                context.trace_id.rjust(32, "0"), self.span_id, context.span_id,
                self.conn.direction, start_ns, start_ns + int((now - self.start) * 1e9),
                attributes, failed or status >= 500,
            ))  # fmt: skip


def _header(headers: Sequence[Header], name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _version(target: RequestTarget) -> str:
    if hasattr(target, "grpc"):  # h2headers.Request
        return "HTTP/2.0"
    return "HTTP/1.0" if getattr(target, "http10", False) else "HTTP/1.1"


def _rfc3339(wall: float) -> str:
    moment = datetime.fromtimestamp(wall, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond:06d}Z"
