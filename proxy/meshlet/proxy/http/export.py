"""Exporting the proxy's spans over OTLP/HTTP, batched and bounded, from a thread of its own.

`opentelemetry` is imported only here, and this module only when a collector is configured:
a proxy without one never loads it (it costs some 20 MB). A span is queued when its request
ends; past `QUEUE_LIMIT` spans waiting, new ones are dropped and counted
(`trace_spans_dropped_total`), so a slow or absent collector never holds a request up. The
thread sends up to `BATCH` spans at a time, at least every `INTERVAL` seconds.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Final, NamedTuple

from meshlet.proxy.io.counters import Counted

log = logging.getLogger(__name__)

QUEUE_LIMIT: Final = 2048
BATCH: Final = 512
INTERVAL: Final = 1.0
EXPORT_TIMEOUT: Final = 5.0


class Span(NamedTuple):
    """One hop of a sampled request, as the proxy saw it (times in Unix nanoseconds)."""

    trace_id: str
    span_id: str
    parent_id: str
    direction: str  # inbound (a server span) or outbound (a client span)
    start_ns: int
    end_ns: int
    attributes: dict[str, str | int]
    error: bool


class SpanExport:
    def __init__(
        self,
        endpoint: str,
        service_name: str,
        exported: Counted,
        dropped: Counted,
        queue_limit: int = QUEUE_LIMIT,
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource

        self._exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT)
        self._resource = Resource.create({"service.name": service_name})
        self._queue: deque[Span] = deque()
        self._limit = queue_limit
        self._exported = exported
        self._dropped = dropped
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, span: Span) -> None:
        """Queues `span` (or drops it, counted, when the queue is full); never blocks."""
        if len(self._queue) >= self._limit:
            self._dropped.inc()
            return
        self._queue.append(span)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
            self._thread.start()
        if len(self._queue) >= BATCH:
            self._wake.set()

    def close(self) -> None:
        """Sends what is queued, then stops the thread."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(EXPORT_TIMEOUT + 1)

    def _run(self) -> None:
        while True:
            if not self._stopped:
                self._wake.wait(INTERVAL)
            self._wake.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                self._send(batch)
            if self._stopped:
                return

    def _send(self, batch: list[Span]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export([self._readable(span) for span in batch])
        except Exception:
            log.exception("exporting %d spans failed", len(batch))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._exported.inc(len(batch))
        else:
            self._dropped.inc(len(batch))

    def _readable(self, span: Span) -> Any:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        trace_id = int(span.trace_id, 16)
        sampled = TraceFlags(TraceFlags.SAMPLED)
        return ReadableSpan(
            name=span.direction,
            context=SpanContext(trace_id, int(span.span_id, 16), False, sampled),
            parent=SpanContext(trace_id, int(span.parent_id, 16), True, sampled),
            resource=self._resource,
            attributes=span.attributes,
            kind=SpanKind.SERVER if span.direction == "inbound" else SpanKind.CLIENT,
            status=Status(StatusCode.ERROR if span.error else StatusCode.UNSET),
            start_time=span.start_ns,
            end_time=span.end_ns,
        )
