"""Runs the tap controller: a pod cache fed by a cluster-state source, the tap API over HTTP,
and the admin server.

The API is one endpoint, `GET /api/v1/tap?resource=deploy/web&namespace=emojivoto[&to=…]
[&to_namespace=…][&method=GET][&path=/prefix][&authority=…][&max_rps=N]`, answered with
`application/x-ndjson`: one JSON object a line, a tap event (`type` req, rsp or end), a
`dropped` count (requests past the rate), or an `error` of one proxy (its stream failed; the
others go on). A browser reads it with `fetch` and a stream reader, `curl -N` prints it. Each
proxy is asked `io.linkerd.proxy.tap.Tap/Observe` over mutual TLS with the controller's own
certificate, the proxy's verified against the trust anchors for its pod's identity. The
streams merge into one bounded queue: a slow reader slows the proxies' streams (gRPC flow
control), it never grows memory."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from meshlet.api import tap_pb2, tap_pb2_grpc, wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.cancellation import OwnCancellation
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.k8s.events import Delete, Event, Kind, Snapshot, Source, Upsert
from meshlet.controlplane.listen import bind, start_admin
from meshlet.controlplane.supervise import Supervisor
from meshlet.controlplane.tap import events, targets
from meshlet.controlplane.tap.bounds import RequestRate, TapSlots

log = logging.getLogger(__name__)

PATH: Final = "/api/v1/tap"
QUEUE: Final = 256  # events between the proxies' streams and the reader
# Requests one Observe asks for (the proxy's cap, Linkerd's too): when a proxy's stream ends
# after them, it is opened again, so a tap runs until its reader leaves.
OBSERVE_LIMIT: Final = 10_000
REOPEN_AFTER: Final = 1.0  # seconds before asking again a proxy whose stream ended empty
TAP_KINDS: Final = (Kind.POD,)

Item = dict[str, Any] | tuple[str, tap_pb2.TapEvent] | None  # None: a proxy's stream ended


@dataclass(frozen=True, slots=True)
class TapConfig:
    addr: HostPort
    admin_addr: HostPort
    source: Source
    tls: tuple[Path, Path]  # the controller's certificate chain and key (PEM)
    trust_anchors: Path
    max_taps: int = 100
    max_rps: float = 100.0  # the ceiling of a tap's requests per second
    proxy_port: int = wellknown.PROXY_CONTROL_PORT
    control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE
    trust_domain: str = wellknown.TRUST_DOMAIN


class TapRequestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TapRequest:
    resource: targets.Resource
    namespace: str
    to: targets.Resource | None
    to_namespace: str
    filters: events.Filters
    max_rps: float


def parse_request(query: dict[str, str], ceiling: float) -> TapRequest:
    """A tap's parameters from the query string; every problem reported at once."""
    problems = []
    unknown = set(query) - {"resource", "namespace", "to", "to_namespace", "method", "path",
                            "authority", "max_rps"}  # fmt: skip
    if unknown:
        problems.append(f"unknown parameters: {', '.join(sorted(unknown))}")
    resource = to = None
    try:
        resource = targets.parse_resource(query.get("resource", ""))
    except targets.ResourceError as exc:
        problems.append(str(exc))
    if query.get("to"):
        try:
            to = targets.parse_resource(query["to"])
        except targets.ResourceError as exc:
            problems.append(f"to: {exc}")
    filters = events.Filters(
        query.get("method", ""), query.get("path", ""), query.get("authority", "")
    )
    problems.extend(filters.problems())
    max_rps = ceiling
    if "max_rps" in query:
        try:
            max_rps = float(query["max_rps"])
        except ValueError:
            max_rps = -1.0
        if not 0 < max_rps <= ceiling:
            problems.append(f"max_rps {query['max_rps']!r} must be a number in (0, {ceiling:g}]")
    if problems or resource is None:
        raise TapRequestError("; ".join(problems))
    namespace = query.get("namespace") or "default"
    return TapRequest(resource, namespace, to, query.get("to_namespace") or namespace, filters,
                      max_rps)  # fmt: skip


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"type": "error", "message": message}, status=status)


class TapServer:
    def __init__(
        self,
        config: TapConfig,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.clock = clock
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.slots = TapSlots(config.max_taps)
        self._synced = False
        self._active = Gauge("tap_active", "Taps being served.", registry=self.registry)
        self._active.set_function(lambda: self.slots.active)
        self._events = Counter(
            "tap_events_total",
            "Tap events from proxies, by what became of them (sent, dropped, filtered).",
            ["result"],
            registry=self.registry,
        )
        self._refused = Counter(
            "tap_refused_total", "Taps refused, by reason.", ["reason"], registry=self.registry
        )
        self._proxy_errors = Counter(
            "tap_proxy_errors_total", "Proxy streams that failed.", registry=self.registry
        )
        self._admin = AdminServer(partial(generate_latest, self.registry), ready=self.ready)
        self.supervisor = Supervisor("tap")
        self.supervisor.add("the cluster-state source", partial(config.source.run, self.apply))
        self._runner: web.AppRunner | None = None
        self._supervising: asyncio.Task[None] | None = None
        self.port = 0
        self.admin_port = 0

    def ready(self) -> bool:
        return self.port != 0 and self.supervisor.healthy and self.config.source.synced

    def apply(self, event: Event) -> None:
        if isinstance(event, Snapshot):
            self.pods = {_key(obj): obj for obj in event.objects}
        elif isinstance(event, Upsert):
            self.pods[_key(event.obj)] = event.obj
        elif isinstance(event, Delete):
            self.pods.pop(_key(event.obj), None)

    async def start(self) -> None:
        cfg = self.config
        self._supervising = asyncio.create_task(self.supervisor.run())
        app = web.Application()
        app.router.add_get(PATH, self.tap)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,  # a reader that leaves ends its tap and frees its slot
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        sock = bind(cfg.addr, "tap API")
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        self.admin_port = await start_admin(self._admin, cfg.admin_addr)
        log.info("tap serving on :%d (admin :%d)", self.port, self.admin_port)

    async def stop(self, grace: float = 1.0) -> None:
        self.supervisor.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        await self._admin.close()

    def _credentials(self) -> grpc.ChannelCredentials:
        chain, key = (path.read_bytes() for path in self.config.tls)  # re-read: rotated files
        return grpc.ssl_channel_credentials(
            root_certificates=self.config.trust_anchors.read_bytes(),
            private_key=key,
            certificate_chain=chain,
        )

    async def tap(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        try:
            ask = parse_request(dict(request.query), cfg.max_rps)
        except TapRequestError as exc:
            self._refused.labels("invalid").inc()
            return error_response(400, str(exc))
        found = targets.select(ask.resource, ask.namespace, self.pods.values(), cfg.control_ns,
                               cfg.trust_domain)  # fmt: skip
        if not found:
            self._refused.labels("no_pods").inc()
            where = f"{ask.resource.kind}/{ask.resource.name}"
            return error_response(404, f"no running meshed pods of {where} in {ask.namespace}")
        refusal = self.slots.acquire()
        if refusal is not None:
            self._refused.labels("busy").inc()
            return error_response(429, refusal)
        try:
            response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await response.prepare(request)
            await self._merge(ask, found, response)
            return response
        finally:
            self.slots.release()

    async def _merge(
        self, ask: TapRequest, found: list[targets.Target], response: web.StreamResponse
    ) -> None:
        queue: asyncio.Queue[Item] = asyncio.Queue(QUEUE)
        observe = events.observe_request(ask.filters, OBSERVE_LIMIT)
        credentials = self._credentials()
        rate = RequestRate(ask.max_rps)
        async with asyncio.TaskGroup() as group:
            readers = [
                group.create_task(self._read(target, observe, credentials, queue))
                for target in found
            ]
            try:
                ended = 0
                while ended < len(readers):
                    item = await queue.get()
                    if item is None:
                        ended += 1
                        continue
                    line = self._decide(ask, rate, item)
                    if line is not None:
                        await response.write(json.dumps(line).encode() + b"\n")
            finally:
                for reader in readers:
                    reader.cancel()

    def _decide(
        self,
        ask: TapRequest,
        rate: RequestRate,
        item: dict[str, Any] | tuple[str, tap_pb2.TapEvent],
    ) -> dict[str, Any] | None:
        if isinstance(item, dict):
            return item
        proxy, event = item
        kind, _, key = events.stream_key(proxy, event)
        if kind == "req":
            if not events.admits(ask.filters, event) or (
                ask.to is not None and not _to(ask.to, ask.to_namespace, event)
            ):
                self._events.labels("filtered").inc()
                return None
            passed = rate.request(key, self.clock())
        else:
            passed = bool(kind) and rate.follows(key, end=kind == "end")
        if not passed:
            self._events.labels("dropped").inc()
            return None
        self._events.labels("sent").inc()
        line = events.to_json(proxy, event)
        dropped = rate.take_dropped()
        if line is not None and dropped:
            line["dropped_before"] = dropped
        return line

    async def _read(
        self,
        target: targets.Target,
        observe: tap_pb2.ObserveRequest,
        credentials: grpc.ChannelCredentials,
        queue: asyncio.Queue[Item],
    ) -> None:
        proxy = f"{target.namespace}/{target.pod}"
        address = f"{target.ip}:{self.config.proxy_port}"
        if ":" in target.ip:
            address = f"[{target.ip}]:{self.config.proxy_port}"
        options = [
            ("grpc.ssl_target_name_override", target.identity),
            ("grpc.enable_http_proxy", 0),
        ]
        own = OwnCancellation()
        async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
            stub = tap_pb2_grpc.TapStub(channel)
            try:
                while True:
                    received = 0
                    async for event in stub.Observe(observe):
                        received += 1
                        await queue.put((proxy, event))
                    own.check()  # a stream that ended because we were cancelled: not reopened
                    await asyncio.sleep(0 if received else REOPEN_AFTER)
            except grpc.aio.AioRpcError as exc:
                own.check()
                self._proxy_errors.inc()
                message = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    message += f" (is {address} a proxy with identity {target.identity}?)"
                await queue.put({"type": "error", "proxy": proxy, "message": message})
        await queue.put(None)  # this proxy's stream ended


def _to(to: targets.Resource, namespace: str, event: tap_pb2.TapEvent) -> bool:
    """`--to`: an outbound request whose destination the proxy labels as `to`."""
    if event.proxy_direction != tap_pb2.TapEvent.OUTBOUND:
        return False
    return targets.matches(to, namespace, dict(event.destination_meta.labels))


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "default")), str(meta.get("name", ""))


async def serve(config: TapConfig, registry: CollectorRegistry | None = None) -> int:
    """Serves until SIGTERM or SIGINT (0), or until its source fails for good (1)."""
    return await serve_until_signalled(TapServer(config, registry), "tap")
