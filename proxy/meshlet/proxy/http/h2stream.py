"""One request relayed from a downstream HTTP/2 stream to an upstream one, and its response back.

Bodies flow under end-to-end flow control: bytes read from one side are credited back to that
side (`acknowledge_received_data`) only once they were given to the other side's h2, so a stream
never holds more than the window the proxy granted its source. Trailers follow the body; resets
cross over with their code; a stream whose upstream fails before the response is answered by the
proxy (502, or gRPC UNAVAILABLE), after it is reset (never a truncated body passed off as whole).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError

from meshlet.proxy.http.contract import Endpoint
from meshlet.proxy.http.h2conn import Peer, error_name
from meshlet.proxy.http.h2headers import (
    GRPC_UNAVAILABLE,
    Header,
    Request,
    Response,
    Trailers,
    local_response,
)

if TYPE_CHECKING:
    from meshlet.proxy.http.h2client import H2Client
    from meshlet.proxy.http.h2server import H2Server

log = logging.getLogger(__name__)

MAX_ATTEMPTS: Final = 2  # a request the upstream never processed is tried once more


class Pipe:
    """One direction of a body: bytes taken from the source and not yet given to the sink."""

    __slots__ = ("chunks", "done", "ended", "size", "trailers")

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.ended = False  # the source sent END_STREAM
        self.trailers: list[Header] | None = None
        self.done = False  # END_STREAM given to the sink

    def push(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)

    @property
    def holding(self) -> bool:
        """Something (bytes or the end) is waiting for the sink."""
        return bool(self.chunks) or (self.ended and not self.done)

    def give(self, sink: Peer, stream_id: int) -> int:
        """Gives the sink what its flow-control windows and its transport allow, then the end
        of the body (trailers or END_STREAM) once everything is given. Returns the bytes given.
        Raises h2's ProtocolError when h2 already closed the sink's stream."""
        chunks = self.chunks
        sent = 0
        if chunks:
            if not sink.writable:
                return 0
            h2 = sink.h2
            window = h2.local_flow_control_window(stream_id)
            frame_max = h2.max_outbound_frame_size
            while chunks and window > 0:
                chunk = chunks[0]
                n = min(len(chunk), window, frame_max)
                if n < len(chunk):
                    chunks[0] = chunk[n:]
                    chunk = chunk[:n]
                else:
                    chunks.popleft()
                last = not chunks and self.ended and self.trailers is None
                h2.send_data(stream_id, chunk, end_stream=last)
                self.done = last
                sent += n
                window -= n
            self.size -= sent
        if self.ended and not chunks and not self.done:
            if self.trailers is not None:
                sink.h2.send_headers(stream_id, self.trailers, end_stream=True)
            else:
                sink.h2.end_stream(stream_id)
            self.done = True
        return sent


class ProxyStream:
    """A downstream stream and the upstream stream it is relayed to."""

    __slots__ = (
        "attempts",
        "client",
        "closed",
        "down_id",
        "endpoint",
        "grpc_status",
        "latency_ms",
        "req",
        "req_sent",
        "request",
        "resp",
        "responded",
        "server",
        "started",
        "status",
        "task",
        "up_closed",
        "up_id",
    )

    def __init__(self, server: H2Server, down_id: int, request: Request, started: float) -> None:
        self.server = server
        self.down_id = down_id
        self.request = request
        self.started = started
        self.client: H2Client | None = None
        self.up_id = 0
        self.req = Pipe()  # downstream → upstream
        self.resp = Pipe()  # upstream → downstream
        self.endpoint: Endpoint | None = None
        self.attempts = 1
        self.req_sent = 0  # request body bytes given upstream: past 0 it cannot be retried
        self.responded = False  # a final response head went downstream
        self.up_closed = False  # the upstream stream takes no more request bytes
        self.status = 0
        self.grpc_status: str | None = None
        self.latency_ms: float | None = None
        self.closed = False
        self.task: asyncio.Task[None] | None = None  # routing and opening it upstream

    # -- downstream events (H2Server) --

    def on_request_data(self, data: bytes, flow_len: int, end: bool) -> None:
        if flow_len > len(data):  # padding is not relayed: credit it at once
            self.server.h2.acknowledge_received_data(flow_len - len(data), self.down_id)
        if data:
            self.req.push(data)
        if end:
            self.req.ended = True
        if self.client is not None:
            self.pump_request()

    def on_request_trailers(self, headers: list[Header]) -> None:
        self.req.trailers = headers
        self.req.ended = True
        if self.client is not None:
            self.pump_request()

    def on_down_reset(self, code: int) -> None:
        """The client reset the stream: so is the upstream stream, with the same code."""
        if self.client is not None:
            self.client.reset(self.up_id, code)
        elif self.task is not None:
            self.task.cancel()  # still routing, connecting or waiting for a slot
        self._close()

    def down_gone(self) -> None:
        """The downstream connection is gone."""
        self.on_down_reset(ErrorCodes.CANCEL)

    # -- upstream side (H2Client) --

    def attach(self, client: H2Client, up_id: int, headers_ended: bool) -> None:
        self.client = client
        self.up_id = up_id
        if headers_ended:
            self.req.done = True
        elif self.req.holding:
            self.pump_request()

    def on_informational(self, response: Response) -> None:
        self._send_head(response.headers, end=False)

    def on_response(self, response: Response, end: bool) -> None:
        self.responded = True
        if self.endpoint is not None and self.endpoint.lease is not None:
            self.endpoint.lease.responded()
        self.status = response.status
        self.grpc_status = response.grpc_status
        self.latency_ms = (self.server.loop.time() - self.started) * 1000.0
        if not self._send_head(response.headers, end):
            return
        if end:
            self.resp.ended = self.resp.done = True
            self._maybe_finish()

    def on_response_data(self, data: bytes, flow_len: int, end: bool) -> None:
        if flow_len > len(data) and self.client is not None:
            self.client.h2.acknowledge_received_data(flow_len - len(data), self.up_id)
        if data:
            self.resp.push(data)
        if end:
            self.resp.ended = True
        self.pump_response()

    def on_response_trailers(self, trailers: Trailers) -> None:
        if trailers.grpc_status is not None:
            self.grpc_status = trailers.grpc_status
        self.resp.trailers = list(trailers.headers)
        self.resp.ended = True
        self.pump_response()

    def on_up_reset(self, code: int, reason: str = "") -> None:
        """The upstream reset the stream (or sent something the proxy will not relay)."""
        if self.closed:
            return
        if self.resp.ended:
            self._upstream_done()
            return
        if not self.responded:
            if code == ErrorCodes.REFUSED_STREAM:
                self.up_gone("upstream refused the stream", unprocessed=True)
            else:
                self._detach()
                self.answer(502, reason or f"upstream reset the stream ({error_name(code)})")
            return
        self.server.reset(self.down_id, code)
        self._close(failed=True)

    def up_gone(self, reason: str, unprocessed: bool) -> None:
        """The upstream connection failed, or went away (GOAWAY) without this stream
        (`unprocessed`: the upstream says it never acted on it)."""
        if self.closed:
            return
        if self.resp.ended:
            self._upstream_done()
            return
        self._detach()
        if self.responded:
            self.server.reset(self.down_id, ErrorCodes.INTERNAL_ERROR)
            self._close(failed=True)
        elif unprocessed and self.req_sent == 0 and self.attempts < MAX_ATTEMPTS:
            self.attempts += 1
            if self.endpoint is not None and self.endpoint.lease is not None:
                self.endpoint.lease.release()  # routed again: a new lease
            self.req.done = False  # the head (and any trailers) go again on the next upstream
            self.server.forward(self)
        elif unprocessed:
            self.server.reset(self.down_id, ErrorCodes.REFUSED_STREAM)
            self._close()
        else:
            self.answer(502, reason)

    def _upstream_done(self) -> None:
        """The whole response arrived; the upstream takes no more of the request."""
        self.up_closed = True
        self._drop_request_body()
        self._detach()
        self.pump_response()

    # -- relaying --

    def pump_request(self) -> None:
        client = self.client
        if client is None or self.up_closed:
            return
        req = self.req
        was_done = req.done
        try:
            sent = req.give(client, self.up_id)
        except ProtocolError:
            return  # h2 closed the upstream stream; its reset event is on its way
        if sent:
            self.req_sent += sent
            client.guard.data_sent(1 + sent // 16384)
            server = self.server
            server.h2.acknowledge_received_data(sent, self.down_id)
            server.flush_soon()
        if sent or req.done != was_done:
            client.flush_soon()
        if req.holding:
            client.waiting[self.up_id] = self
        else:
            client.waiting.pop(self.up_id, None)
            if req.done:
                self._maybe_finish()

    def pump_response(self) -> None:
        server = self.server
        resp = self.resp
        was_done = resp.done
        try:
            sent = resp.give(server, self.down_id)
        except ProtocolError:
            return  # h2 closed the downstream stream; its reset event is on its way
        if sent:
            client = self.client
            if client is not None:
                client.h2.acknowledge_received_data(sent, self.up_id)
                client.flush_soon()
            server.guard.data_sent(1 + sent // 16384)
        if sent or resp.done != was_done:
            server.flush_soon()
        if resp.holding:
            server.waiting[self.down_id] = self
        else:
            server.waiting.pop(self.down_id, None)
            if resp.done:
                self._maybe_finish()

    def answer(self, status: int, reason: str) -> None:
        """Answers the request from the proxy (routing failed, upstream unreachable...)."""
        if self.closed or self.responded:
            return
        grpc = self.request.grpc
        self.responded = True
        self.status = 200 if grpc else status
        self.grpc_status = GRPC_UNAVAILABLE if grpc else None
        self.latency_ms = (self.server.loop.time() - self.started) * 1000.0
        self.up_closed = True
        self._drop_request_body()
        self.server.count_error(status)
        if not self._send_head(local_response(status, reason, grpc), end=True):
            return
        self.resp.ended = self.resp.done = True
        self._maybe_finish()

    def _send_head(self, headers: Iterable[Header], end: bool) -> bool:
        server = self.server
        try:
            server.h2.send_headers(self.down_id, headers, end_stream=end)
        except ProtocolError:
            return False  # h2 closed the downstream stream; its reset event is on its way
        server.flush_soon()
        return True

    def _maybe_finish(self) -> None:
        if self.closed or not self.resp.done or not (self.req.done or self.up_closed):
            return
        if not self.req.ended:  # a complete response: the rest of the upload is not wanted
            self.server.reset(self.down_id, ErrorCodes.NO_ERROR)
        self._close(record=True)

    def _drop_request_body(self) -> None:
        req = self.req
        if req.size:
            self.server.h2.acknowledge_received_data(req.size, self.down_id)
            self.server.flush_soon()
        req.chunks.clear()
        req.size = 0

    def _detach(self) -> None:
        client = self.client
        if client is not None:
            client.forget(self)
            self.client = None
            if self.resp.size:
                client.h2.acknowledge_received_data(self.resp.size, self.up_id)

    def _close(self, record: bool = False, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.endpoint is not None and self.endpoint.lease is not None:
            self.endpoint.lease.release()
        self._drop_request_body()
        self._detach()
        self.server.forget(self)
        if record or failed:
            self.server.record(self, failed)
