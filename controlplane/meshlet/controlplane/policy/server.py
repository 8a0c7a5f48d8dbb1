"""Runs the policy controller: a cluster-state source feeding the inbound and outbound indexes,
the `io.linkerd.proxy.inbound.InboundServerPolicies` and `io.linkerd.proxy.outbound.
OutboundPolicies` gRPC services on one server (with one set of stream limits), and the admin
server."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from meshlet.api import inbound_pb2, outbound_pb2, wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.grpcmetrics import HandledCounter
from meshlet.controlplane.k8s.events import Event, Source
from meshlet.controlplane.policy.catalog import Catalog
from meshlet.controlplane.policy.index import ClusterConfig, Index
from meshlet.controlplane.policy.mailbox import Mailbox
from meshlet.controlplane.policy.outbound_index import (
    OutboundIndex,
    TargetError,
    parse_addr,
    parse_authority,
)
from meshlet.controlplane.policy.status import Indexes, Patch, StatusWriter
from meshlet.controlplane.streaming import (
    StreamingController,
    StreamLimits,
    passthrough_handler,
    peer_host,
)
from meshlet.controlplane.supervise import Supervisor

log = logging.getLogger(__name__)

GC_THRESHOLDS: Final = (50_000, 20, 20)  # gc.set_threshold's, for the controller's process
SERVICE = "io.linkerd.proxy.inbound.InboundServerPolicies"
OUTBOUND_SERVICE = "io.linkerd.proxy.outbound.OutboundPolicies"
MAX_WORKLOAD = 512  # characters of PortSpec.workload

Context = grpc.aio.ServicerContext[Any, Any]


class WorkloadError(ValueError):
    pass


def parse_workload(text: str) -> tuple[str, str]:
    """(namespace, pod) from `{"ns":"NS","pod":"NAME"}` or the older `NS:NAME`."""
    if len(text) > MAX_WORKLOAD:
        raise WorkloadError(f"invalid workload: longer than {MAX_WORKLOAD} characters")
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise WorkloadError(f"invalid workload: {text!r} is not JSON") from None
        ns, pod = (value.get("ns"), value.get("pod")) if isinstance(value, dict) else (None, None)
        if isinstance(ns, str) and isinstance(pod, str) and ns and pod:
            return ns, pod
        raise WorkloadError(f'invalid workload: {text!r}; expected {{"ns":"NS","pod":"NAME"}}')
    ns, sep, pod = text.partition(":")
    if not sep or not ns or not pod:
        raise WorkloadError(f'invalid workload: {text!r}; expected {{"ns":"NS","pod":"NAME"}}')
    return ns, pod


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    addr: HostPort
    admin_addr: HostPort
    source: Source
    cluster: ClusterConfig
    tls: tuple[Path, Path] | None = None  # (certificate chain, key) PEM files
    max_streams: int = 20_000
    max_streams_per_peer: int = 4_096
    cluster_domain: str = wellknown.CLUSTER_DOMAIN
    status_patch: Patch | None = None  # writes route status (None: the local mesh, no API)


class PolicyService:
    """GetPort and WatchPort over the index."""

    def __init__(self, index: Index, registry: CollectorRegistry, limits: StreamLimits) -> None:
        self._index = index
        self._limits = limits
        self.handled = HandledCounter(registry, SERVICE)
        self.streams = Gauge(
            "policy_watch_streams_active", "Open WatchPort streams.", registry=registry
        )

    def _target(self, request: inbound_pb2.PortSpec) -> tuple[str, str, int]:
        ns, pod = parse_workload(request.workload)
        if not 1 <= request.port <= 65535:
            raise WorkloadError(f"invalid port: {request.port}; expected 1..65535")
        return ns, pod, request.port

    async def GetPort(self, request: inbound_pb2.PortSpec, context: Context) -> bytes:
        try:
            ns, pod, port = self._target(request)
        except WorkloadError as exc:
            await self._abort(
                context, "unary", "GetPort", grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            )
        server = self._index.get(ns, pod, port)
        if server is None:
            await self._abort(
                context,
                "unary",
                "GetPort",
                grpc.StatusCode.NOT_FOUND,
                f"unknown server: no pod {ns}/{pod}",
            )
        assert server is not None
        self.handled.observe("unary", "GetPort", grpc.StatusCode.OK)
        return server.SerializeToString(deterministic=True)

    async def WatchPort(self, request: inbound_pb2.PortSpec, context: Context) -> None:
        method = "WatchPort"
        try:
            ns, pod, port = self._target(request)
        except WorkloadError as exc:
            await self._abort(
                context, "server_stream", method, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            )
        peer = peer_host(context.peer())
        refusal = self._limits.acquire(peer)
        if refusal is not None:
            await self._abort(
                context, "server_stream", method, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
            )
        wakeup = asyncio.Event()
        mailbox = Mailbox(wakeup.set)
        try:
            if not self._index.subscribe(ns, pod, port, mailbox):
                await self._abort(
                    context,
                    "server_stream",
                    method,
                    grpc.StatusCode.NOT_FOUND,
                    f"unknown server: no pod {ns}/{pod}",
                )
            await _forward(mailbox, wakeup, context, self.streams)  # until the pod is gone
        except asyncio.CancelledError:
            self.handled.observe("server_stream", method, grpc.StatusCode.CANCELLED)
            raise
        finally:
            self._index.unsubscribe(ns, pod, port, mailbox)
            self._limits.release(peer)
        self.handled.observe("server_stream", method, grpc.StatusCode.OK)

    async def _abort(
        self, context: Context, kind: str, method: str, code: grpc.StatusCode, message: str
    ) -> None:
        self.handled.observe(kind, method, code)
        await context.abort(code, message)


Target = tuple[str, str, int, str]  # (namespace, service, port, client namespace)


class OutboundService:
    """Get and Watch of `OutboundPolicies` over the outbound index: a target is a Service's
    authority (`name.ns.svc.cluster.local:port`) or one of its cluster IPs and a port."""

    def __init__(
        self,
        index: OutboundIndex,
        registry: CollectorRegistry,
        limits: StreamLimits,
        handled: HandledCounter,
    ) -> None:
        self._index = index
        self._limits = limits
        self.handled = handled.for_service(OUTBOUND_SERVICE)
        self.streams = Gauge(
            "policy_outbound_watch_streams_active",
            "Open OutboundPolicies Watch streams.",
            registry=registry,
        )

    def _target(self, request: outbound_pb2.TrafficSpec) -> Target | None:
        """The Service port asked for; None: no such Service (NOT_FOUND); WorkloadError or
        TargetError: a malformed request (INVALID_ARGUMENT)."""
        client_ns, _ = parse_workload(request.source_workload)
        which = request.WhichOneof("target")
        if which == "authority":
            found = parse_authority(request.authority, self._index.cluster_domain)
            return None if found is None else (*found, client_ns)
        if which == "addr":
            ip, port = parse_addr(request.addr)
            svc = self._index.by_ip(ip)
            return None if svc is None else (svc.namespace, svc.name, port, client_ns)
        raise TargetError("invalid target: set an authority or an addr")

    async def _resolve(self, request: outbound_pb2.TrafficSpec, context: Context, kind: str,
                       method: str) -> Target:  # fmt: skip
        try:
            target = self._target(request)
        except (WorkloadError, TargetError) as exc:
            await self._abort(context, kind, method, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if target is None or self._index.service(target[0], target[1]) is None:
            await self._abort(context, kind, method, grpc.StatusCode.NOT_FOUND, "unknown target")
        assert target is not None
        return target

    async def Get(self, request: outbound_pb2.TrafficSpec, context: Context) -> bytes:
        ns, name, port, client_ns = await self._resolve(request, context, "unary", "Get")
        policy = self._index.get(ns, name, port, client_ns)
        assert policy is not None
        self.handled.observe("unary", "Get", grpc.StatusCode.OK)
        return policy.SerializeToString(deterministic=True)

    async def Watch(self, request: outbound_pb2.TrafficSpec, context: Context) -> None:
        kind, method = "server_stream", "Watch"
        ns, name, port, client_ns = await self._resolve(request, context, kind, method)
        peer = peer_host(context.peer())
        refusal = self._limits.acquire(peer)
        if refusal is not None:
            await self._abort(context, kind, method, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        wakeup = asyncio.Event()
        mailbox = Mailbox(wakeup.set)
        try:
            if not self._index.subscribe(ns, name, port, mailbox, client_ns):
                await self._abort(
                    context, kind, method, grpc.StatusCode.NOT_FOUND, "unknown target"
                )
            await _forward(mailbox, wakeup, context, self.streams)  # until the Service is gone
        except asyncio.CancelledError:
            self.handled.observe(kind, method, grpc.StatusCode.CANCELLED)
            raise
        finally:
            self._index.unsubscribe(ns, name, port, mailbox, client_ns)
            self._limits.release(peer)
        self.handled.observe(kind, method, grpc.StatusCode.OK)

    async def _abort(
        self, context: Context, kind: str, method: str, code: grpc.StatusCode, message: str
    ) -> None:
        self.handled.observe(kind, method, code)
        await context.abort(code, message)


async def _forward(
    mailbox: Mailbox, wakeup: asyncio.Event, context: Context, streams: Gauge
) -> None:
    """Writes each policy the index leaves in `mailbox` (only the newest waits there) until the
    watched object is gone and the stream ends (the proxy asks again); `streams` counts it open."""
    streams.inc()
    try:
        while True:
            message = mailbox.take()
            if message is not None:
                await context.write(message)
                continue
            if mailbox.closed:
                return
            wakeup.clear()
            await wakeup.wait()
    finally:
        streams.dec()


def outbound_handler(service: OutboundService) -> grpc.GenericRpcHandler:
    return passthrough_handler(OUTBOUND_SERVICE, outbound_pb2.TrafficSpec, {"Get": service.Get},
                               {"Watch": service.Watch})  # fmt: skip


def rpc_handler(service: PolicyService) -> grpc.GenericRpcHandler:
    return passthrough_handler(SERVICE, inbound_pb2.PortSpec, {"GetPort": service.GetPort},
                               {"WatchPort": service.WatchPort})  # fmt: skip


class PolicyServer(StreamingController):
    def __init__(
        self,
        config: PolicyConfig,
        registry: CollectorRegistry | None = None,
        on_synced: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self._on_synced: Callable[[], None] | None = on_synced  # once, at the first sync
        self.catalog = Catalog()  # each policy object read once, for both indexes
        self.index = Index(config.cluster, self.catalog)
        self.outbound = OutboundIndex(config.cluster_domain, self.catalog)
        self.limits = StreamLimits(config.max_streams, config.max_streams_per_peer)
        self._events = Counter(
            "policy_source_events_total",
            "Cluster events applied, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self._invalid = Gauge(
            "policy_invalid_objects", "Objects ignored for their problems.", registry=self.registry
        )
        self._invalid.set_function(lambda: self.index.invalid + self.outbound.invalid)
        self._processing = Histogram(
            "policy_event_processing_seconds",
            "From an event reaching the index to every changed watch's mailbox filled.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self._admin = AdminServer(partial(generate_latest, self.registry), ready=self.ready)
        self.supervisor = Supervisor("policy")
        self.supervisor.add("the cluster-state source", partial(config.source.run, self.apply))
        self.indexes = Indexes(self.outbound, self.index, config.cluster_domain)
        self.status: StatusWriter | None = None
        if config.status_patch is not None:
            patches = Counter(
                "policy_route_status_patches_total",
                "Route status patches sent, by result (written, conflict: the route changed"
                " meanwhile, failed).",
                ["result"],
                registry=self.registry,
            )
            self.status = StatusWriter(self.indexes, config.status_patch,
                                       on_result=lambda r: patches.labels(r).inc())  # fmt: skip
            self.supervisor.add("the route status writer", self.status.run)

    def ready(self) -> bool:
        return self.grpc_port != 0 and self.supervisor.healthy and self.config.source.synced

    def apply(self, event: Event) -> None:
        started = time.perf_counter()
        self.index.apply(event)
        self.outbound.apply(event)
        self.indexes.apply(event)
        if self.status is not None:
            self.status.apply(event)
        self._processing.observe(time.perf_counter() - started)
        self._events.labels(event.kind.kind).inc()
        if self._on_synced is not None and self.config.source.synced:
            on_synced, self._on_synced = self._on_synced, None
            on_synced()

    async def start(self) -> None:
        cfg = self.config
        inbound = PolicyService(self.index, self.registry, self.limits)
        handler = rpc_handler(inbound)
        outbound = outbound_handler(
            OutboundService(self.outbound, self.registry, self.limits, inbound.handled)
        )
        await self._serve((handler, outbound), cfg.addr, cfg.admin_addr, cfg.tls)
        log.info("policy serving on :%d (admin :%d)", self.grpc_port, self.admin_port)


async def serve(config: PolicyConfig, registry: CollectorRegistry | None = None) -> int:
    """Serves until SIGTERM or SIGINT (0), or until its source fails for good (1).

    The process keeps one long-lived model per object (100,000 routes are millions of Python
    objects): with the collector's default thresholds, loading them spent most of its time
    scanning again what it had loaded, and each full collection later held the event loop for
    seconds. Young objects are collected after GC_THRESHOLDS[0] allocations rather than 700,
    and what the first sync loaded is frozen out of later collections (reference counting
    still frees each model replaced or removed: the models hold no cycles)."""
    gc.set_threshold(*GC_THRESHOLDS)
    server = PolicyServer(config, registry, on_synced=gc.freeze)
    return await serve_until_signalled(server, "policy")
