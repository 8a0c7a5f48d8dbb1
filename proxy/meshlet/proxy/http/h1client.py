"""An upstream HTTP/1.1 connection: carries one request at a time and parses its response.

`H1Upstream` is the Protocol of a connection the proxy opened to an endpoint. The engine writes a
request on it, then the response is parsed with httptools and handed to a `ResponseSink` as a
stream of calls (head, body pieces, end), never buffered whole. Between requests the connection
sits in an `H1Pool`; one that closes or speaks while idle is dropped from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import httptools

from meshlet.proxy.http.contract import MAX_INFORMATIONAL, HttpLimits
from meshlet.proxy.http.h1head import Body, Header
from meshlet.proxy.io.counters import TcpConn
from meshlet.proxy.io.sockets import write_pieces


class UpstreamError(Exception):
    """The upstream broke HTTP/1.1 (malformed or oversized response)."""


class ResponseSink(Protocol):
    """What receives an upstream response; calls come from the upstream's `data_received`."""

    def response_informational(self, status: int, fields: list[Header]) -> None: ...

    def response_head(self, status: int, fields: list[Header]) -> Body | None:
        """Returns how the body is delimited, or None after aborting the exchange."""

    def response_body(self, data: bytes) -> None: ...

    def response_end(self, trailers: list[Header], reusable: bool) -> None: ...

    def response_upgraded(self, rest: bytes) -> None: ...

    def upstream_lost(self, exc: BaseException | None, got_bytes: bool) -> None:
        """The connection ended (or broke the protocol) before the response ended."""

    def upstream_pause_writing(self) -> None: ...

    def upstream_resume_writing(self) -> None: ...

    def flush(self) -> None:
        """End of one read from the upstream: write what was produced."""


class UpstreamConn(Protocol):
    """An exchange's way upstream, as the HTTP/1 engine (h1exchange) uses it: a connection to
    the endpoint (`H1Upstream`), or a stream on a peer proxy's HTTP/2 connection
    (orig_proto.Upgrade). The engine writes the request as it would go on the wire, head first."""

    transport: asyncio.Transport | None
    tcp: TcpConn
    reused: bool  # a pooled connection: one that closes before answering may be stale

    def begin(self, sink: ResponseSink, head_only: bool) -> None: ...

    def write(self, data: bytes) -> None: ...

    def writelines(self, data: Sequence[bytes]) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def detach(self) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class H1Upstream(asyncio.Protocol):
    """One connection to an endpoint. `begin` hands it a sink for the next response."""

    def __init__(self, limits: HttpLimits, tcp: TcpConn | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.tcp = tcp or TcpConn.uncounted()
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None
        self.on_idle_lost: Callable[[H1Upstream], None] | None = None
        self._limits = limits
        self._sink: ResponseSink | None = None
        self._parser: Any = None
        self._parser_clean = False
        self._fields: list[Header] = []
        self._size = 0
        self._informational = 0
        self._final = False
        self._head_only = False
        self._until_eof = False
        self._reusable = False
        self._got_bytes = False
        self._broken = False
        self._reading_paused = False

    # -- used by the engine ---------------------------------------------------------------

    def begin(self, sink: ResponseSink, head_only: bool) -> None:
        """Starts an exchange: the response to the request about to be written goes to `sink`."""
        self._sink = sink
        if not self._parser_clean:  # a parser is reused only between two complete messages
            self._parser = httptools.HttpResponseParser(self)
        self._parser_clean = False
        self._fields = []
        self._size = self._informational = 0
        self._final = self._until_eof = self._got_bytes = False
        self._head_only = head_only

    def detach(self) -> None:
        """The sink no longer wants calls; the connection is then given back or closed."""
        self._sink = None
        self.resume_reading()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.tcp.written += len(data)
            self.transport.write(data)

    def writelines(self, data: Sequence[bytes]) -> None:
        if not self.closed and self.transport is not None:
            self.tcp.written += write_pieces(self.transport, data)

    def pause_reading(self) -> None:
        if not self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and not self.closed and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self._sink = None
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        self._sink = None
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        high = self._limits.max_body_buffer
        self.transport.set_write_buffer_limits(high, high // 4)

    def data_received(self, data: bytes) -> None:
        self.tcp.read += len(data)
        sink = self._sink
        if sink is None:  # bytes while idle: the connection cannot be trusted
            self.abort()
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            if self._sink is not None:
                self._sink = None
                sink.response_upgraded(data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback raised, behind llhttp's own words
            why = cause if isinstance(cause, UpstreamError) else exc
            self._fail(sink, UpstreamError(f"invalid response from upstream: {why}"))
        if self._broken:
            self._fail(sink, UpstreamError("upstream sent bytes after its response"))
        sink.flush()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.tcp.close(exc)
        sink = self._sink
        if sink is None:
            if self.on_idle_lost is not None:
                self.on_idle_lost(self)
            return
        self._sink = None
        if exc is None and self._final and self._until_eof:
            sink.response_end([], False)  # a body delimited by the close is complete
        else:
            sink.upstream_lost(exc, self._got_bytes)
        sink.flush()

    def pause_writing(self) -> None:
        if self._sink is not None:
            self._sink.upstream_pause_writing()

    def resume_writing(self) -> None:
        if self._sink is not None:
            self._sink.upstream_resume_writing()

    # -- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        fields = self._fields
        fields.append((name, value))
        self._size += len(name) + len(value) + 4
        limits = self._limits
        if self._size > limits.max_header_bytes or len(fields) > limits.max_headers:
            raise UpstreamError("upstream response head is over the header limits")

    def on_headers_complete(self) -> None:
        sink = self._sink
        if sink is None:
            return
        status: int = self._parser.get_status_code()
        fields, self._fields, self._size = self._fields, [], 0
        if status < 200 and status != 101:
            self._informational += 1
            if self._informational > MAX_INFORMATIONAL:
                raise UpstreamError(f"more than {MAX_INFORMATIONAL} informational responses")
            sink.response_informational(status, fields)
            return
        self._final = True
        self._reusable = self._parser.should_keep_alive()
        body = sink.response_head(status, fields)
        if body is None:
            return
        self._until_eof = body is Body.EOF
        if self._head_only or body is Body.NONE:
            self._end()

    def on_body(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            sink.response_body(data)
        elif self._final:
            self._broken = True

    def on_message_complete(self) -> None:
        # After a 101 llhttp ends the message, then raises HttpParserUpgrade: not an end.
        if self._final and self._sink is not None and not self._until_eof:
            self._parser_clean = True
            self._end()

    def _end(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.response_end(self._fields, self._reusable)

    def _fail(self, sink: ResponseSink, exc: Exception) -> None:
        got = self._got_bytes
        was_ours = self._sink is sink
        self.abort()
        if was_ours:
            sink.upstream_lost(exc, got)
