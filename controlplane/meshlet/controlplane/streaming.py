"""What the controllers that stream to proxies (destination, policy) share: caps on their
streams, and a gRPC server sized to those caps beside their admin server, started and stopped
in one order; and the quiet a client's departure deserves (`ClientGone`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane.listen import ListenError, add_grpc_port, start_admin
from meshlet.controlplane.supervise import Supervisor


class StreamLimits:
    """Caps on concurrent streams, overall and per client address."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self._by_peer: Tally[str] = Tally()

    def acquire(self, peer: str) -> str | None:
        """None when admitted, else why not."""
        if sum(self._by_peer.values()) >= self.total:
            return f"the server holds its maximum of {self.total} streams"
        if self._by_peer[peer] >= self.per_peer:
            return f"{peer} holds its maximum of {self.per_peer} streams"
        self._by_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    @property
    def active(self) -> int:
        return sum(self._by_peer.values())


class ClientGone(logging.Filter):
    """gRPC's asyncio server logs at ERROR, with a traceback, an answer it could not send
    because the call had ended meanwhile: a client that cancelled its call (or whose deadline
    passed) while a Get's answer or a Watch's update was on its way. A client going away is
    normal, so such a record becomes one DEBUG line. A batch gRPC refused to start at all
    (`Failed grpc_call_start_batch`: a misuse, such as a status sent behind a message still in
    flight) stays an error."""

    LOGGER: str = "grpc._cython.cygrpc"

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (
            record.levelno < logging.ERROR
            or type(error).__name__ != "ExecuteBatchError"
            or not str(error).startswith('Failed "execute_batch"')
        ):
            return True
        record.msg = "%s: the client went away before the answer was sent"
        record.args = (record.getMessage(),)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


CLIENT_GONE = ClientGone()


def peer_host(peer: str) -> str:
    """`ipv4:127.0.0.1:5000` → `127.0.0.1`; `ipv6:[::1]:5000` → `::1`."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    return address.rsplit(":", 1)[0].strip("[]")


def streaming_server(limits: StreamLimits) -> grpc.aio.Server:
    """A gRPC server for long-lived streams within `limits`.

    Calls wait in gRPC core's queue until the service takes them, one at a time: past its
    default limits (1,000 soft, 3,000 hard) core drops them at random and the client sees a
    bare CANCELLED. With the queue as deep as the stream caps, every call reaches the admission
    check, which answers RESOURCE_EXHAUSTED with a reason."""
    queue = limits.total + limits.per_peer
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 16 * 1024),
            ("grpc.max_concurrent_streams", 10_000),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.http2.max_pings_without_data", 0),
            # The proxies PING every 10 s, streams or not (meshlet.proxy.discovery.watch):
            # accept one every 5 s rather than answer them with GOAWAY ENHANCE_YOUR_CALM.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.server.max_pending_requests", queue),
            ("grpc.server.max_pending_requests_hard_limit", queue),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
        ]
    )


class StreamingController:
    """The serving half of a streaming controller: its subclass sets `supervisor`, `limits`
    and `_admin`, then `start` calls `_serve` with its RPC handler."""

    supervisor: Supervisor
    limits: StreamLimits
    _admin: AdminServer
    grpc_port = 0
    admin_port = 0
    _grpc: grpc.aio.Server | None = None
    _supervising: asyncio.Task[None] | None = None

    async def _serve(
        self,
        handlers: tuple[grpc.GenericRpcHandler, ...],
        addr: HostPort,
        admin_addr: HostPort,
        tls: tuple[Path, Path] | None,
    ) -> None:
        self._supervising = asyncio.create_task(self.supervisor.run())
        logging.getLogger(ClientGone.LOGGER).addFilter(CLIENT_GONE)  # once: the same filter
        self._grpc = streaming_server(self.limits)
        self._grpc.add_generic_rpc_handlers(handlers)
        credentials = None
        if tls is not None:
            chain, key = (path.read_bytes() for path in tls)
            credentials = grpc.ssl_server_credentials([(key, chain)])
        try:
            self.grpc_port = add_grpc_port(self._grpc, addr, credentials)
            await self._grpc.start()
            self.admin_port = await start_admin(self._admin, admin_addr)
        except ListenError:
            await self.stop(grace=0)
            raise

    async def stop(self, grace: float = 5.0) -> None:
        self.supervisor.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        await self._admin.close()


def passthrough_handler(
    service: str,
    request_type: Any,
    unary: Mapping[str, Callable[..., Any]],
    streaming: Mapping[str, Callable[..., Any]],
) -> grpc.GenericRpcHandler:
    """A gRPC service's method handlers (`unary` answer once, `streaming` stream) for requests
    of `request_type`; the methods hand over responses already serialized (each message is
    encoded once for every stream that sends it), so the response serializer passes bytes
    through."""

    def passthrough(message: bytes) -> bytes:
        return message

    def read(data: bytes) -> Any:
        return request_type.FromString(data)

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=read, response_serializer=passthrough
        )
        for name, method in unary.items()
    } | {
        name: grpc.unary_stream_rpc_method_handler(
            method, request_deserializer=read, response_serializer=passthrough
        )
        for name, method in streaming.items()
    }
    return grpc.method_handlers_generic_handler(service, handlers)
