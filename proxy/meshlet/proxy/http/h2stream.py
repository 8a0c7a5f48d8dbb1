"""One request relayed from a downstream HTTP/2 stream to an upstream one, and its response back.

Bodies flow under end-to-end flow control: bytes read from one side are credited back to that
side (`acknowledge`) only once they were given to the other side's h2, so a stream
never holds more than the window the proxy granted its source. Trailers follow the body; resets
cross over with their code; a stream whose upstream fails before the response is answered by the
proxy (502, or gRPC UNAVAILABLE), after it is reset (never a truncated body passed off as whole).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from meshlet.proxy.core.failover import Failure
from meshlet.proxy.http.attempts import PASS, REFUSE, Answer, Attempts, Failed, Step
from meshlet.proxy.http.contract import (
    MAX_INFORMATIONAL,
    QUEUED,
    REPLAY_LIMIT,
    Endpoint,
    GrpcFailure,
    Later,
    RouteTarget,
    Wait,
)
from meshlet.proxy.http.h2codec import ErrorCode, StreamClosed, error_name
from meshlet.proxy.http.h2conn import MAX_RTT, MIN_RTT, Peer
from meshlet.proxy.http.h2headers import (
    GRPC_DEADLINE_EXCEEDED,
    Header,
    Request,
    Response,
    Trailers,
    grpc_status_of,
    local_response,
    modify_request,
)

if TYPE_CHECKING:
    from meshlet.proxy.http.h2client import H2Client
    from meshlet.proxy.http.h2pool import Queued
    from meshlet.proxy.http.h2server import H2Server
    from meshlet.proxy.http.orig_proto import Downgrade

log = logging.getLogger(__name__)


class Pipe:
    """One direction of a body: bytes taken from the source and not yet given to the sink."""

    __slots__ = ("chunks", "done", "ended", "kept", "kept_size", "size", "trailers")

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.ended = False  # the source sent END_STREAM
        self.trailers: list[Header] | None = None
        self.done = False  # END_STREAM given to the sink
        # Bytes given to the sink, kept for a replay (None: not kept, or too many to keep).
        self.kept: list[bytes] | None = None
        self.kept_size = 0

    def replay(self) -> None:
        """Everything given so far is to be given again (to another sink)."""
        kept = self.kept or []
        self.chunks.extendleft(reversed(kept))
        self.size += self.kept_size
        self.kept, self.kept_size = [], 0
        self.done = False

    def push(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)

    @property
    def holding(self) -> bool:
        """Something (bytes or the end) is waiting for the sink."""
        return bool(self.chunks) or (self.ended and not self.done)

    def give(self, sink: Peer[Any] | Downgrade, stream_id: int) -> int:
        """Gives the sink what its flow-control windows and its transport allow, then the end
        of the body (trailers or END_STREAM) once everything is given. Returns the bytes given.
        Raises StreamClosed when the sink's stream is already closed."""
        chunks = self.chunks
        sent = 0
        if chunks:
            if not sink.writable:
                return 0
            h2 = sink.h2
            window = h2.window(stream_id)
            frame_max = h2.peer_max_frame
            while chunks and window > 0:
                chunk = chunks[0]
                n = min(len(chunk), window, frame_max)
                if n < len(chunk):
                    chunks[0] = chunk[n:]
                    chunk = chunk[:n]
                else:
                    chunks.popleft()
                last = not chunks and self.ended and self.trailers is None
                h2.send_data(stream_id, chunk, last)
                self.done = last
                sent += n
                window -= n
                if self.kept is not None:
                    self.kept.append(chunk)
                    self.kept_size += n
                    if self.kept_size > REPLAY_LIMIT:
                        self.kept = None
            self.size -= sent
        if self.ended and not chunks and not self.done:
            if self.trailers is not None:
                sink.h2.send_headers(stream_id, self.trailers, True)
            else:
                sink.h2.end_stream(stream_id)
            self.done = True
        return sent


class ProxyStream:
    """A downstream stream and the upstream stream it is relayed to: for its request's
    `Attempts`, the `Upstream` that sends it."""

    __slots__ = (
        "att",
        "client",
        "closed",
        "down_id",
        "grpc_status",
        "held",
        "informational",
        "moved",
        "moved_seen",
        "queued",
        "quiet_since",
        "req",
        "req_left",
        "req_sent",
        "request",
        "resp",
        "resp_left",
        "responded",
        "sent_at",
        "server",
        "started",
        "status",
        "task",
        "timer",
        "timer_at",
        "up_closed",
        "up_id",
    )

    def __init__(self, server: H2Server, down_id: int, request: Request, att: Attempts) -> None:
        self.server = server
        self.down_id = down_id
        self.request = request
        self.att = att
        self.started = att.arrived
        # The upstream connection it is on: HTTP/2, or HTTP/1.1 for a request a peer proxy
        # sent as HTTP/1.1 (`request.orig_proto`: orig_proto.Downgrade).
        self.client: H2Client | Downgrade | None = None
        self.up_id = 0
        self.req = Pipe()  # downstream → upstream
        self.resp = Pipe()  # upstream → downstream
        # Body bytes still due by the message's content-length (-1: none declared): a body
        # that does not add up is malformed (RFC 9113 §8.1.1) and never relayed whole.
        self.req_left = request.length
        self.resp_left = -1
        self.informational = 0  # 1xx heads relayed
        self.sent_at = 0.0  # loop time the request's head last went upstream
        self.timer: asyncio.TimerHandle | None = None  # the route's timeout, or the attempt's
        self.timer_at: float | None = None  # when it fires
        self.req_sent = 0  # request body bytes given to the current upstream stream
        self.responded = False  # a final response head went downstream
        self.up_closed = False  # the upstream stream takes no more request bytes
        self.status = 0
        self.grpc_status: str | None = None
        # A gRPC response's head held back until its trailers show whether it is retried.
        self.held: list[Header] | None = None
        self.closed = False
        self.task: asyncio.Task[None] | None = None  # routing and opening it upstream
        self.queued: Queued | None = None  # waiting in line for an upstream stream
        # Body bytes moved either way so far; what the last idle check saw, and since when.
        self.moved = 0
        self.moved_seen = 0
        self.quiet_since = att.arrived

    # -- attempts.Upstream: what the request's Attempts has done --

    def gone(self) -> bool:
        return self.closed

    def routed(self, route: RouteTarget) -> None:
        """The request's route is known: its filters change the head, its timeout is armed,
        and the body given upstream is kept for a replay (up to REPLAY_LIMIT): a stream the
        upstream refuses, or its GOAWAY excludes, was never processed and is sent again
        whatever its method; the failover policy decides the rest."""
        if route.request_headers is not None:
            self.request = modify_request(self.request, route.request_headers)
        if route.policy.idle_timeout is not None:
            self.server.watch_idle(route.policy.idle_timeout)
        self._arm(self.att.due)
        self.req.kept = []

    def send(self, endpoint: Endpoint, fresh: bool) -> Wait | Later | None:
        if self.att.try_deadline is not None:  # this attempt's own timeout, maybe the sooner
            due = self.att.due
            if due != self.timer_at:
                self._arm(due)
        if self.request.orig_proto:
            return self.server.downgrade(self, endpoint, fresh)
        server = self.server
        opened = server.pool.open(endpoint, self, server.upstream_counts, queue=self)
        if opened is None or isinstance(opened, Wait):
            return opened
        self.queued = opened
        return QUEUED

    def _arm(self, due: float | None) -> None:
        self._stop_timer()
        if due is not None:
            self.timer = self.server.loop.call_at(due, self._timed_out)
            self.timer_at = due

    # -- downstream events (H2Server) --

    def on_request_data(self, data: bytes, flow_len: int, end: bool) -> None:
        self.moved += flow_len
        if flow_len > len(data):  # padding is not relayed: credit it at once
            self.server.h2.acknowledge(self.down_id, flow_len - len(data))
        left = self.req_left
        if left >= 0:
            left = self.req_left = left - len(data)
            if left < 0 or (end and left):
                self.server.h2.acknowledge(self.down_id, len(data))
                self.malformed_request("a request body that does not match its content-length")
                return
        if data:
            self.req.push(data)
        if end:
            self.req.ended = True
        if self.client is not None:
            self.pump_request()

    def on_request_trailers(self, headers: list[Header]) -> None:
        if self.req_left > 0:
            self.malformed_request("a request body shorter than its content-length")
            return
        self.moved += 1
        self.req.trailers = headers
        self.req.ended = True
        if self.client is not None:
            self.pump_request()

    def early(self, now: float) -> bool:
        """Whether a client's reset at `now` comes before the upstream could have answered:
        no response yet, and less than a round trip to the upstream (MAX_RTT while none is
        attached) since the request arrived. CVE-2023-44487's resets come at once; a deadline
        or a cancel comes later, however long the request waited in the proxy."""
        if self.responded:
            return False
        client = self.client
        return now - self.started < (client.rtt if client is not None else MAX_RTT)

    def on_down_reset(self, code: int) -> None:
        """The client reset the stream: so is the upstream stream, with the same code."""
        if self.client is not None:
            self.client.reset(self.up_id, code)
        elif self.task is not None:
            self.task.cancel()  # still routing, connecting or waiting for a slot
        elif self.queued is not None:
            self.queued.cancel()
            self.queued = None
        self._close()

    def down_gone(self) -> None:
        """The downstream connection is gone."""
        self.on_down_reset(ErrorCode.CANCEL)

    # -- upstream side (h2client.H2Sink) --

    def head(self) -> tuple[Sequence[Header], bool, int]:
        req = self.req
        request = self.request
        return request.headers, req.ended and not req.chunks and req.trailers is None, request.size

    def attach(self, client: H2Client | Downgrade, up_id: int, headers_ended: bool) -> None:
        self.client = client
        self.up_id = up_id
        self.sent_at = client.loop.time()
        if headers_ended:
            self.req.done = True
        elif self.req.holding:
            self.pump_request()

    def refused(self, status: int, reason: str) -> None:
        self.answer(status, reason)

    def dequeued(self, failed: Failed | None) -> None:
        """Its turn in the pool's line came: opened upstream (attached already), or not."""
        self.queued = None
        if self.closed:
            return
        if failed is None:
            self.att.sent()
        else:
            self.server.forward(self, self.att.connect_failed(failed))

    def on_informational(self, response: Response) -> None:
        self.informational += 1
        self.moved += 1
        if self.informational > MAX_INFORMATIONAL:
            self.malformed_response(f"more than {MAX_INFORMATIONAL} informational responses")
            return
        self._send_head(response.headers, end=False)

    def on_response(self, response: Response, end: bool) -> None:
        client = self.client
        if client is not None and client.rtt > MIN_RTT:  # an answer bounds the round trip
            client.rtt = max(min(client.rtt, client.loop.time() - self.sent_at), MIN_RTT)
        if self.request.method == "HEAD" or response.status in (204, 304):
            self.resp_left = 0  # no content, whatever content-length says
        else:
            self.resp_left = response.length
            if end and response.length > 0:
                self.malformed_response("a response without the body its content-length says")
                return
        att = self.att
        now = self.server.loop.time()
        kept = self.req.kept is not None
        step = att.response(response.status, response.grpc_status, kept, now, response.headers)
        if step is not PASS:
            self._retry(step)
            return
        self.status = response.status
        self.grpc_status = response.grpc_status
        route = att.route
        headers = response.headers
        if route is not None and route.response_headers is not None:
            headers = route.response_headers.apply(headers)
        if (
            response.grpc_status is None
            and not end
            and self.request.grpc
            and att.holds_for_trailers(kept)
        ):
            self.held = list(headers)
            return
        self.responded = True
        self.moved += 1
        self._stop_timer()
        if not self._send_head(headers, end):
            return
        if end:
            self.resp.ended = self.resp.done = True
            self._maybe_finish()

    def on_response_data(self, data: bytes, flow_len: int, end: bool) -> None:
        if flow_len > len(data) and self.client is not None:
            self.client.h2.acknowledge(self.up_id, flow_len - len(data))
        left = self.resp_left
        if left >= 0:
            left = self.resp_left = left - len(data)
            if left < 0 or (end and left):
                if self.client is not None:
                    self.client.h2.acknowledge(self.up_id, len(data))
                self.malformed_response("a response body that does not match its content-length")
                return
        if data:
            self.resp.push(data)
        if end:
            self.resp.ended = True
        if self.held is not None:
            if end:
                self._release_held()  # a gRPC response without trailers: nothing to wait for
            else:  # what came with the first bytes (in the same read) is seen first
                self.server.loop.call_soon(self._release_held, self.att.sends)
            return
        self.pump_response()

    def on_response_trailers(self, trailers: Trailers) -> None:
        if self.resp_left > 0:
            self.malformed_response("a response body shorter than its content-length")
            return
        if self.held is not None:
            now = self.server.loop.time()
            step = self.att.trailers(trailers.grpc_status, self.req.kept is not None, now)
            if step is not PASS:
                self._retry(step)
                return
        if trailers.grpc_status is not None:
            self.grpc_status = trailers.grpc_status
        self.moved += 1
        self.resp.trailers = list(trailers.headers)
        self.resp.ended = True
        if self.held is not None:
            self._release_held()
            return
        self.pump_response()

    def _release_held(self, sends: int | None = None) -> None:
        """The held head goes to the client, then what came after it (`sends`: only if the
        attempt it was held for is still the current one)."""
        headers = self.held
        if headers is None or self.closed or (sends is not None and sends != self.att.sends):
            return
        self.held = None
        self.responded = True
        self.moved += 1
        self._stop_timer()
        if self._send_head(headers, False):
            self.pump_response()

    def on_up_reset(self, code: int, reason: str = "") -> None:
        """The upstream reset the stream (or sent something the proxy will not relay)."""
        if self.closed:
            return
        if self.resp.ended:
            self._upstream_done()
            return
        if not self.responded:
            if code == ErrorCode.REFUSED_STREAM:
                self.up_gone("upstream refused the stream", unprocessed=True)
            else:
                self._after_reset(reason or f"upstream reset the stream ({error_name(code)})")
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
        if self.responded:
            self._detach()
            self.server.reset(self.down_id, ErrorCode.INTERNAL_ERROR)
            self._close(failed=True)
        elif unprocessed:
            # The upstream never acted on it: as a connection that failed, nothing was sent.
            replayable = self.req_sent == 0 or self.req.kept is not None
            step = self.att.unprocessed(replayable)
            if step is REFUSE:
                self._detach()
                self.server.reset(self.down_id, ErrorCode.REFUSED_STREAM)
                self._close()
            else:
                self._retry(step)
        else:
            self._after_reset(reason)

    def _after_reset(self, reason: str) -> None:
        """The upstream failed after the request was sent, before any response byte."""
        now = self.server.loop.time()
        step = self.att.failed(Failure.RESET, self.req.kept is not None, False, now)
        if isinstance(step, Answer):
            self._detach()
            self.answer(step.status, reason)
            return
        self._retry(step)

    # -- retries and timeouts --

    def _retry(self, step: Step) -> None:
        """Sends the request again, from the start, as `step` says (the upstream stream it was
        on is cancelled: that upstream sees a RST_STREAM)."""
        client = self.client
        if client is not None:
            client.reset(self.up_id, ErrorCode.CANCEL)
            client.flush_soon()
        self._again(step)

    def _again(self, step: Step) -> None:
        self._detach()
        self.held = None
        self.req.replay()
        self.req_sent = 0
        self.up_closed = False
        self.resp = Pipe()
        self.server.forward(self, step)

    def _timed_out(self) -> None:
        """The request's timeout, or its attempt's, passed before the response went to the
        client: the upstream stream is cancelled; 504 (gRPC DEADLINE_EXCEEDED), or the
        attempt's retry."""
        self.timer = self.timer_at = None
        if self.closed or self.responded:
            return
        self._cancel_upstream()
        step = self.att.expired(self.server.loop.time(), self.req.kept is not None)
        if isinstance(step, Answer):
            self.answer(step.status, step.reason, grpc_status=GRPC_DEADLINE_EXCEEDED)
        else:
            self._arm(self.att.due)  # the request's timeout goes on over the retry
            self._again(step)

    def malformed_request(self, reason: str) -> None:
        """The client's request broke HTTP/2's message rules (a body that does not add up to its
        content-length): its stream is reset (PROTOCOL_ERROR), and the upstream's, which never
        sees the request whole, cancelled. Nothing of the excess is relayed."""
        if self.closed:
            return
        log.debug("stream %d: malformed request: %s", self.down_id, reason)
        self._cancel_upstream()
        server = self.server
        server.count_error(ErrorCode.PROTOCOL_ERROR)
        server.reset(self.down_id, ErrorCode.PROTOCOL_ERROR)
        server.malformed()
        self._close()

    def malformed_response(self, reason: str) -> None:
        """The upstream's response broke HTTP/2's message rules: its stream is reset
        (PROTOCOL_ERROR, a stream error: the shared connection lives); the client gets 502, or,
        with the response begun, a reset: never a body passed off as whole."""
        if self.closed:
            return
        log.info("upstream %s: malformed response on stream %d: %s", self.att.endpoint, self.up_id,
                 reason)  # fmt: skip
        client = self.client
        if client is not None:
            client.reset(self.up_id, ErrorCode.PROTOCOL_ERROR)
            client.flush_soon()
        self._detach()
        if self.responded:
            self.server.reset(self.down_id, ErrorCode.INTERNAL_ERROR)
            self._close(failed=True)
        else:
            self.answer(502, f"bad upstream response: {reason}")

    def _cancel_upstream(self) -> None:
        """The upstream stream (or the task still routing or connecting it) is cancelled."""
        client = self.client
        if client is not None:
            client.reset(self.up_id, ErrorCode.CANCEL)
            client.flush_soon()
        elif self.task is not None:
            self.task.cancel()
        elif self.queued is not None:
            self.queued.cancel()
            self.queued = None
        self._detach()

    def idle_timeout(self) -> float | None:
        """How long the stream may stay quiet: its route's idle timeout, else the
        workload's (None: no limit, the default)."""
        route = self.att.route
        if route is not None and route.policy.idle_timeout is not None:
            return route.policy.idle_timeout
        return self.server.conn.limits.stream_idle_timeout

    def quiet_for(self, now: float) -> float:
        """Seconds since a body byte or a head last moved on the stream (as of the checks)."""
        if self.moved != self.moved_seen:
            self.moved_seen = self.moved
            self.quiet_since = now
        return now - self.quiet_since

    def idle_out(self, idle: float) -> None:
        """The stream moved no byte either way for its idle timeout: the upstream stream is
        cancelled; the client gets 408 while its body was due, 504 while the response was
        awaited, a reset once the response began."""
        if self.closed:
            return
        why = f"no bytes either way for {idle:g}s (the idle timeout)"
        log.debug("stream %d: %s", self.down_id, why)
        self._cancel_upstream()
        if self.responded:
            self.server.reset(self.down_id, ErrorCode.CANCEL)
            self._close(failed=True)
        elif not self.req.ended:
            self.answer(408, f"request body stalled: {why}")
        else:
            self.answer(504, f"no response: {why}", grpc_status=GRPC_DEADLINE_EXCEEDED)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = self.timer_at = None

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
        except StreamClosed:
            return  # the upstream stream is closed; its reset is on its way
        if sent:
            self.req_sent += sent
            client.guard.data_sent(1 + sent // 16384)
            server = self.server
            if server.h2.acknowledge(self.down_id, sent):
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
        if self.held is not None:
            return  # nothing goes before the held head
        server = self.server
        resp = self.resp
        was_done = resp.done
        try:
            sent = resp.give(server, self.down_id)
        except StreamClosed:
            return  # the downstream stream is closed; its reset is on its way
        if sent:
            self.moved += sent
            self.att.resp_bytes += sent
            client = self.client
            if client is not None and client.h2.acknowledge(self.up_id, sent):
                client.flush_soon()  # a WINDOW_UPDATE (most acknowledgements wait for more)
            server.guard.data_sent(1 + sent // 16384)
        if sent or resp.done != was_done:
            server.flush_soon()
        if resp.holding:
            server.waiting[self.down_id] = self
        else:
            server.waiting.pop(self.down_id, None)
            if resp.done:
                self._maybe_finish()

    def answer(self, status: int, reason: str, grpc_status: str | None = None) -> None:
        """Answers the request from the proxy (routing failed, upstream unreachable, a
        timeout, a policy...); a gRPC request gets `grpc_status` instead of `status` (by
        default the one that `status` means: h2headers.GRPC_STATUS_OF)."""
        if self.closed or self.responded:
            return
        grpc = self.request.grpc
        self.responded = True
        self.held = None
        self._stop_timer()
        self.att.answered(self.server.loop.time())
        self.status = 200 if grpc else status
        if grpc and grpc_status is None:
            coded = reason.code if isinstance(reason, GrpcFailure) else None
            grpc_status = coded or grpc_status_of(status)
        self.grpc_status = grpc_status if grpc else None
        self.up_closed = True
        self._drop_request_body()
        self.server.count_error(status)
        if not self._send_head(local_response(status, reason, grpc, grpc_status), end=True):
            return
        self.resp.ended = self.resp.done = True
        self._maybe_finish()

    def _send_head(self, headers: Iterable[Header], end: bool) -> bool:
        server = self.server
        try:
            server.h2.send_headers(self.down_id, headers, end)
        except StreamClosed:
            return False  # the downstream stream is closed; its reset is on its way
        server.flush_soon()
        return True

    def _maybe_finish(self) -> None:
        if self.closed or not self.resp.done or not (self.req.done or self.up_closed):
            return
        if not self.req.ended:  # a complete response: the rest of the upload is not wanted
            self.server.reset(self.down_id, ErrorCode.NO_ERROR)
        self._close(record=True)

    def _drop_request_body(self) -> None:
        req = self.req
        if req.size and self.server.h2.acknowledge(self.down_id, req.size):
            self.server.flush_soon()
        req.chunks.clear()
        req.size = 0

    def _detach(self) -> None:
        client = self.client
        if client is not None:
            client.forget(self)
            self.client = None
            if self.resp.size:
                client.h2.acknowledge(self.up_id, self.resp.size)

    def _close(self, record: bool = False, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop_timer()
        if record or failed:  # before the release, which reports the outcome to the lease
            self.att.record(self.status, self.grpc_status, failed)
        self.att.finish(record and not failed)
        self.att.release()
        self._drop_request_body()
        self._detach()
        self.server.forget(self)
