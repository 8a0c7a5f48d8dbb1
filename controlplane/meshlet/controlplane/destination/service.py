"""The Destination gRPC service: Get and GetProfile streams over the publishers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from meshlet.api import destination_pb2, destination_pb2_grpc, wellknown
from meshlet.controlplane.destination import paths
from meshlet.controlplane.destination.listener import Overflow
from meshlet.controlplane.destination.publisher import Publishers, Subscription
from meshlet.controlplane.grpcmetrics import HandledCounter
from meshlet.controlplane.streaming import StreamLimits, passthrough_handler, peer_host

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


class DestinationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = HandledCounter(registry, "io.linkerd.proxy.destination.Destination")
        self.streams = Gauge(
            "destination_streams_active", "Open Get/GetProfile streams.", ["method"],
            registry=registry,
        )  # fmt: skip
        self.overflows = Counter(
            "destination_stream_overflow_total",
            "Streams closed because their client fell behind and the queue filled up.",
            ["method"],
            registry=registry,
        )


def rpc_handler(service: DestinationService) -> grpc.GenericRpcHandler:
    """The service's method handlers (publishers hand over already-serialized messages)."""
    return passthrough_handler(
        "io.linkerd.proxy.destination.Destination", destination_pb2.GetDestination, {},
        {"Get": service.Get, "GetProfile": service.GetProfile},
    )  # fmt: skip


class DestinationService(destination_pb2_grpc.DestinationServicer):
    def __init__(
        self,
        publishers: Publishers,
        metrics: DestinationMetrics,
        limits: StreamLimits,
        cluster_domain: str = wellknown.CLUSTER_DOMAIN,
    ) -> None:
        self._publishers = publishers
        self._metrics = metrics
        self._limits = limits
        self._domain = cluster_domain

    # Streams are written with context.write (not yielded) so that a stuck write can be
    # cancelled when the stream's queue overflows.
    async def Get(  # type: ignore[override]
        self, request: destination_pb2.GetDestination, context: Context
    ) -> None:
        await self._serve("Get", request.path, context, False, self._publishers.endpoints)

    async def GetProfile(  # type: ignore[override]
        self, request: destination_pb2.GetDestination, context: Context
    ) -> None:
        await self._serve("GetProfile", request.path, context, True, self._publishers.profile)

    async def _serve(
        self,
        method: str,
        path: str,
        context: Context,
        allow_ip: bool,
        subscribe: Callable[[Any, Callable[[], None]], Subscription],
    ) -> None:
        try:
            target = paths.parse(path, self._domain, allow_ip=allow_ip)
        except paths.PathError as exc:
            await self._abort(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        peer = peer_host(context.peer())
        refusal = self._limits.acquire(peer)
        if refusal is not None:
            await self._abort(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        subscription: Subscription | None = None

        def on_overflow() -> None:
            # Called by a publisher: no more updates for this stream. Its pending write, if
            # any, cannot be taken back (gRPC core refuses a status while a message is in
            # flight), so the stream ends with RESOURCE_EXHAUSTED as soon as that write
            # completes, or when the connection dies; it keeps its slot until then.
            self._metrics.overflows.labels(method).inc()
            log.warning("%s stream of %s for %s fell behind: no more updates; it is closed with"
                        " RESOURCE_EXHAUSTED once it reads", method, path, peer)  # fmt: skip
            if subscription is not None:
                subscription.close()

        subscription = subscribe(target, on_overflow)
        self._metrics.streams.labels(method).inc()
        try:
            while True:
                await context.write(await subscription.listener.get())
        except Overflow:
            pass
        except asyncio.CancelledError:
            self._metrics.handled.observe("server_stream", method, grpc.StatusCode.CANCELLED)
            raise  # the client went away
        finally:
            subscription.close()
            self._limits.release(peer)
            self._metrics.streams.labels(method).dec()
        await self._abort(
            context, method, grpc.StatusCode.RESOURCE_EXHAUSTED,
            "stream closed: the client fell behind; reconnect",
        )  # fmt: skip

    async def _abort(
        self, context: Context, method: str, code: grpc.StatusCode, message: str
    ) -> None:
        self._metrics.handled.observe("server_stream", method, code)
        await context.abort(code, message)
