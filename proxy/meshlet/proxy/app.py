"""The running proxy: listeners → detection → HTTP engines or the opaque relay, plus admin.

A connection reads top-down as its stages: accepted (listener) → detected (peek) → routed
(original destination, or the request's authority when nothing redirected it) → relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshlet.api.admin import AdminServer
from meshlet.api.ports import PortRanges
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy import logs
from meshlet.proxy.config import ProxyConfig
from meshlet.proxy.core.detect import NEED_MORE, PEEK_BYTES, Protocol, detect, may_be_http
from meshlet.proxy.http.contract import (
    CLIENT_ID_HEADER,
    MAX_CONNECT_ATTEMPTS,
    Addr,
    Endpoint,
    HttpConn,
    HttpLimits,
    Lease,
    Route,
    RouteError,
)
from meshlet.proxy.io import relay
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Accepted, Listener, bind, peek_protocol
from meshlet.proxy.metrics import ConnLabels, ProxyMetrics
from meshlet.proxy.targets import SelfTargets, by_authority

if TYPE_CHECKING:
    from meshlet.proxy.discovery.resolver import Destination
    from meshlet.proxy.http.h1pool import H1Pool
    from meshlet.proxy.http.h2pool import H2Pool
    from meshlet.proxy.identity.manager import IdentityManager
    from meshlet.proxy.mesh.inbound import Terminated
    from meshlet.proxy.outbound.router import MeshRouter

log = logging.getLogger(__name__)

HttpEngine = Callable[[HttpConn], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Side:
    """What differs between the inbound and the outbound listener."""

    direction: str
    detect_timeout: float
    opaque_ports: PortRanges


class Proxy:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        self.limits = HttpLimits(
            max_header_bytes=config.http1_max_header_bytes,
            max_headers=config.http1_max_headers,
            header_read_timeout=config.http1_header_read_timeout,
            idle_timeout=config.http_idle_timeout,
            connect_timeout=config.outbound_connect_timeout,
            pool_idle_timeout=config.http1_pool_idle_timeout,
            max_concurrent_streams=config.http2_max_concurrent_streams,
        )
        self.closing = asyncio.Event()
        self.stopped = asyncio.Event()
        self._connect = tcp_connector(config.outbound_connect_timeout)
        self._self = SelfTargets(
            [config.inbound_listen_addr, config.outbound_listen_addr,
             config.admin_listen_addr, config.control_listen_addr]
        )  # fmt: skip
        self._outbound = Side(
            "outbound", config.outbound_detect_timeout,
            config.outbound_ports_disable_protocol_detection,
        )  # fmt: skip
        self._inbound = Side(
            "inbound", config.inbound_detect_timeout,
            config.inbound_ports_disable_protocol_detection,
        )  # fmt: skip
        # Upstream pools shared by every connection; made when the protocol is first seen, so an
        # idle proxy never imports the engines it does not use.
        self._h1_pool: H1Pool | None = None
        self._h2_pool: H2Pool | None = None
        self.listeners: list[Listener] = []
        self._supervisor: asyncio.Task[None] | None = None
        self.failure: str | None = None  # why an essential task stopped, when one did
        self._admin = AdminServer(
            self.metrics.registry,
            ready=self.ready,
            shutdown=self.request_shutdown if config.admin_shutdown_enabled else None,
            log_level=logs.set_level,
        )
        self.admin_port = 0
        self.identity = _identity(config, self.metrics)
        self.router = _router(config, self.identity, self.metrics)

    # Lifecycle

    def ready(self) -> bool:
        """Serving, and holding a certificate when identity is configured."""
        identity_ready = self.identity is None or self.identity.ready
        return bool(self.listeners) and not self.closing.is_set() and identity_ready

    async def start(self) -> None:
        """Binds the listeners and the admin server (ListenError when one cannot), then runs
        the essential tasks (listeners, identity) under one supervisor: if one stops, the
        proxy records why (`failure`) and shuts down."""
        cfg = self.config
        try:
            for addr, handler, name in (
                (cfg.outbound_listen_addr, self.handle_outbound, "outbound"),
                (cfg.inbound_listen_addr, self.handle_inbound, "inbound"),
            ):
                self.listeners.append(Listener(_bind(addr, name), handler, name))
            try:
                _, self.admin_port = await self._admin.start(*cfg.admin_listen_addr)
            except OSError as exc:
                raise ListenError(cfg.admin_listen_addr, "admin", exc) from None
        except ListenError:
            for listener in self.listeners:
                listener.stop_accepting()
            self.listeners.clear()
            raise
        essentials = [(f"the {lst.name} listener", lst.serve()) for lst in self.listeners]
        if self.identity is not None:
            essentials.append(("the identity client", self.identity.run()))
        self._supervisor = asyncio.create_task(self._supervise(essentials))
        # Ports as bound (a configured port 0 is ephemeral): none of them is ever a target.
        self._self = SelfTargets(
            [*(listener.address for listener in self.listeners),
             (cfg.admin_listen_addr[0], self.admin_port), cfg.control_listen_addr]
        )  # fmt: skip
        log.info(
            "proxy listening: outbound %s, inbound %s, admin :%d",
            self.listeners[0].address, self.listeners[1].address, self.admin_port,
        )  # fmt: skip

    async def _supervise(self, essentials: list[tuple[str, Coroutine[Any, Any, None]]]) -> None:
        async with asyncio.TaskGroup() as tasks:
            for name, work in essentials:
                tasks.create_task(self._essential(name, work), name=name)

    async def _essential(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        """Runs `work`; if it ends before shutdown, the proxy cannot do its job: shut down."""
        try:
            await work
            why = "it returned"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if not self.closing.is_set():
            self.failure = f"{name} stopped ({why})"
            log.error("%s; the proxy shuts down", self.failure)
            self.closing.set()

    def request_shutdown(self) -> None:
        self.closing.set()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight work finish within the grace period, then close."""
        self.closing.set()
        for listener in self.listeners:
            listener.stop_accepting()
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        await asyncio.gather(
            *(listener.drain(self.config.shutdown_grace_period) for listener in self.listeners)
        )
        if self.router is not None:
            await self.router.aclose()
        if self._h1_pool is not None:
            self._h1_pool.close()
        if self._h2_pool is not None:
            await self._h2_pool.aclose()
        await self._admin.close()
        self.stopped.set()

    # Connections

    async def handle_outbound(self, accepted: Accepted) -> None:
        target = accepted.original_dst  # None: not redirected, route HTTP by authority
        if target is None or self.router is None or self._self.loops(target, accepted.local[0]):
            await self._handle(accepted, self._outbound, target)
            return
        destination = await self.router.destination(target)
        if isinstance(destination, RouteError):
            self._refuse(accepted, self._outbound, "discovery_full", destination.reason)
            return
        async with destination.use():
            await self._handle(accepted, self._outbound, target, destination)

    async def handle_inbound(self, accepted: Accepted) -> None:
        target = accepted.target
        if target[1] == self.listeners[1].address[1]:  # to the inbound port itself: the mesh
            await self._mesh_inbound(accepted)
            return
        if target[1] in self.config.inbound_ports_require_identity:
            self._refuse(accepted, self._inbound, "identity_required",
                         f"port {target[1]} accepts only meshed (mTLS) clients")  # fmt: skip
            return
        await self._handle(accepted, self._inbound, target)

    async def _handle(
        self,
        accepted: Accepted,
        side: Side,
        target: Addr | None,
        destination: Destination | None = None,
    ) -> None:
        target_label = f"{target[0]}:{target[1]}" if target else "authority"
        labels = self.metrics.conn(side.direction, target_label)
        if target is not None and self._self.loops(target, accepted.local[0]):
            self._refuse(accepted, side, "loop", f"{target_label} is the proxy's own port")
            return
        async with self._counted(labels):
            await self._dispatch(accepted, side, target, labels, destination)

    @contextlib.asynccontextmanager
    async def _counted(self, labels: ConnLabels) -> AsyncIterator[None]:
        self.metrics.tcp_open_total.labels(*labels.values()).inc()
        gauge = self.metrics.tcp_open_connections.labels(*labels.values())
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()
            self.metrics.tcp_close_total.labels(*labels.values(), "").inc()

    async def _dispatch(
        self,
        accepted: Accepted,
        side: Side,
        target: Addr | None,
        labels: ConnLabels,
        destination: Destination | None,
    ) -> None:
        opaque_profile = destination is not None and bool(
            destination.profile and destination.profile.opaque
        )
        if target is not None and (target[1] in side.opaque_ports or opaque_profile):
            await self._relay(accepted, target, labels, destination)
            return
        detected = await peek_protocol(accepted, side.detect_timeout)
        if detected is None:
            accepted.sock.close()
            return
        protocol = detected.protocol
        if protocol is Protocol.HTTP1:
            await self._http(accepted, self._http1(), target, labels, destination,
                             SessionProtocol.HTTP1)  # fmt: skip
        elif protocol is Protocol.HTTP2:
            await self._http(accepted, self._http2(), target, labels, destination,
                             SessionProtocol.HTTP2)  # fmt: skip
        else:
            if detected.timed_out:
                self._detect_timed_out(side, target)
            if target is None:
                self._refuse(
                    accepted, side, "no_original_dst",
                    "opaque TCP (or TLS) reached the outbound listener without an original "
                    "destination; only iptables-redirected connections can be relayed",
                )  # fmt: skip
                return
            guard = None
            if detected.timed_out and not detected.first_bytes:
                client = f"{accepted.client[0]}:{accepted.client[1]}"
                guard = self._late_http_guard(side, client, target)
            await self._relay(accepted, target, labels, destination, guard)

    def _detect_timed_out(self, side: Side, target: Addr | None) -> None:
        port = str(target[1]) if target else "unknown"
        self.metrics.detect_timeout_total.labels(side.direction, port).inc()
        log.warning(
            "protocol detection timed out after %gs on port %s (%s); handling it as opaque TCP."
            " If the server speaks first, mark the port opaque with "
            "config.meshlet.io/opaque-ports", side.detect_timeout, port, side.direction,
        )  # fmt: skip

    def _late_http_guard(self, side: Side, client: str, target: Addr) -> relay.Guard | None:
        """For an inbound connection relayed as opaque because its client sent nothing within
        the detection timeout: an HTTP request arriving afterwards would reach the app with no
        HTTP defence and a client-chosen `meshlet-client-id`, so it is refused."""
        if side is not self._inbound:
            return None  # the destination's own inbound proxy checks what reaches its app

        def refused() -> None:
            self.metrics.fail_fast_total.labels(side.direction, "late_http").inc()
            log.warning(
                "inbound connection from %s to port %d closed: it sent nothing for %gs, so it "
                "was relayed as a server-speaks-first protocol, then sent HTTP; HTTP clients "
                "must send their request within the detection timeout",
                client, target[1], side.detect_timeout,
            )  # fmt: skip

        return lambda first, final: may_be_http(first, final=final), refused

    def _refuse(self, accepted: Accepted, side: Side, reason: str, why: str) -> None:
        self.metrics.fail_fast_total.labels(side.direction, reason).inc()
        log.warning("%s connection from %s refused: %s", side.direction, accepted.client, why)
        accepted.sock.close()

    def _route(
        self,
        target: Addr | None,
        local_ip: str,
        destination: Destination | None = None,
        session: SessionProtocol = SessionProtocol.HTTP1,
    ) -> Route:
        metrics = self.metrics
        router = self.router
        if target is not None:
            fixed = Endpoint(target, metrics.authority_label(f"{target[0]}:{target[1]}"))
            if destination is None or router is None:
                # Labelled by the request's authority, as Linkerd does (the target's address
                # when the request names none); one Endpoint per label, of which there are few.
                labelled = {fixed.authority_label: fixed}

                async def to_target(authority: str | None) -> Endpoint | RouteError:
                    if not authority:
                        return fixed
                    label = metrics.authority_label(authority)
                    endpoint = labelled.get(label)
                    if endpoint is None:
                        endpoint = labelled[label] = Endpoint(target, label)
                    return endpoint

                return to_target

            async def discovered(authority: str | None) -> Endpoint | RouteError:
                return await router.pick(destination, session) or fixed

            return discovered

        async def to_authority(authority: str | None) -> Endpoint | RouteError:
            if router is not None and authority:
                pick = await router.pick_authority(authority, session)
                if pick is not None:
                    return pick
            routed = await by_authority(authority, self._self, local_ip)
            if isinstance(routed, RouteError):
                return routed
            return Endpoint(routed.addr, metrics.authority_label(routed.authority_label))

        return to_authority

    async def _http(
        self,
        accepted: Accepted,
        engine: HttpEngine,
        target: Addr | None,
        labels: ConnLabels,
        destination: Destination | None = None,
        session: SessionProtocol = SessionProtocol.HTTP1,
    ) -> None:
        await engine(
            HttpConn(
                sock=accepted.sock,
                route=self._route(target, accepted.local[0], destination, session),
                connect=self._connect,
                metrics=self.metrics,
                labels=labels,
                limits=self.limits,
                closing=self.closing,
                accepted_at=accepted.at,
            )
        )

    def _http1(self) -> HttpEngine:
        from meshlet.proxy.http.h1 import serve_h1
        from meshlet.proxy.http.h1pool import H1Pool

        if self._h1_pool is None:
            self._h1_pool = H1Pool(self.limits.pool_idle_timeout)
        return functools.partial(serve_h1, pool=self._h1_pool)

    def _http2(self) -> HttpEngine:
        from meshlet.proxy.http.h2pool import H2Pool
        from meshlet.proxy.http.h2server import serve_h2

        if self._h2_pool is None:
            self._h2_pool = H2Pool(self._connect, self.limits)
        return functools.partial(serve_h2, pool=self._h2_pool)

    async def _relay(
        self,
        accepted: Accepted,
        target: Addr,
        labels: ConnLabels,
        destination: Destination | None = None,
        guard: relay.Guard | None = None,
    ) -> None:
        """Opaque TCP to `target`, or, with discovery, to the endpoint picked for this
        connection (over the mesh transport when it is meshed). An endpoint that cannot be
        reached is skipped by the balancer and another is picked, up to MAX_CONNECT_ATTEMPTS.
        `guard` checks the client's first bytes (`relay.GuardedSide`)."""
        loop = asyncio.get_running_loop()
        read = self.metrics.tcp_read_bytes_total.labels(*labels.values())
        written = self.metrics.tcp_write_bytes_total.labels(*labels.values())
        client, upstream, done = relay.pair(loop, read.inc, written.inc, guard)
        lease: Lease | None = None
        for attempt in range(1, MAX_CONNECT_ATTEMPTS + 1):
            addr, connect, lease = target, self._connect, None
            if destination is not None and self.router is not None:
                pick = await self.router.pick(destination, SessionProtocol.OPAQUE)
                if isinstance(pick, RouteError):  # counted by the router
                    log.info("outbound connection from %s refused: %s", accepted.client,
                             pick.reason)  # fmt: skip
                    _reset(accepted.sock)
                    return
                if pick is not None:
                    addr, connect, lease = pick.addr, pick.connect or self._connect, pick.lease
            try:
                await connect(addr, lambda: upstream)
                break
            except (OSError, TimeoutError) as exc:
                log.info("%s: connect to %s:%d failed: %s", labels.direction, *addr, exc)
                if lease is not None:
                    lease.failed()
                if lease is None or attempt == MAX_CONNECT_ATTEMPTS:
                    _reset(accepted.sock)
                    return
        if lease is not None:
            lease.responded()  # per connection: the connect time is the sample
        try:
            await loop.connect_accepted_socket(lambda: client, sock=accepted.sock)
            upstream.flush()
            client.flush()
            await done
        finally:
            if lease is not None:
                lease.release()

    async def _mesh_inbound(self, accepted: Accepted) -> None:
        """A connection to the inbound port itself: mutual TLS from another proxy."""
        from meshlet.proxy.mesh.inbound import MeshInbound, PassThrough, Refused
        from meshlet.proxy.mesh.inbound import relay as mesh_relay

        side = self._inbound
        identity = self.identity
        if identity is None or not identity.ready:
            why = "a mesh connection arrived before this proxy has a certificate"
            self._refuse(accepted, side, "no_identity", why)
            return
        mesh = MeshInbound(identity.server_context(), identity.local_name, self._self,
                           side.detect_timeout)  # fmt: skip
        outcome = await mesh.accept(accepted)
        if isinstance(outcome, Refused):
            self.metrics.fail_fast_total.labels("inbound", outcome.reason.value).inc()
            return
        if isinstance(outcome, PassThrough):
            self._refuse(accepted, side, "not_our_identity",
                         f"TLS for {outcome.sni!r} reached the inbound port")  # fmt: skip
            return
        target = outcome.target
        labels = self.metrics.conn(
            "inbound", f"{target[0]}:{target[1]}", tls="true", no_tls_reason="",
            client_id=outcome.client_id,
        )  # fmt: skip
        async with self._counted(labels):
            protocol, guard = outcome.header.protocol, None
            if protocol is SessionProtocol.OPAQUE and target[1] not in side.opaque_ports:
                # The client proxy's word is not enough: HTTP declared opaque would reach the
                # app without the HTTP defences, with a `meshlet-client-id` of the client's own.
                protocol, guard = await self._detect_session(outcome, side)
            if protocol is SessionProtocol.OPAQUE:
                read = self.metrics.tcp_read_bytes_total.labels(*labels.values())
                written = self.metrics.tcp_write_bytes_total.labels(*labels.values())
                try:
                    await mesh_relay(outcome, self._connect, read.inc, written.inc, guard)
                except (OSError, TimeoutError) as exc:
                    log.info("inbound: connect to %s:%d failed: %s", *target, exc)
                return
            engine = self._http1() if protocol is SessionProtocol.HTTP1 else self._http2()
            await engine(
                HttpConn(
                    sock=None,
                    route=self._route(target, target[0]),
                    connect=self._connect,
                    metrics=self.metrics,
                    labels=labels,
                    limits=self.limits,
                    closing=self.closing,
                    add_headers=((CLIENT_ID_HEADER, outcome.client_id.encode()),),
                    handoff=outcome,
                )
            )

    async def _detect_session(
        self, terminated: Terminated, side: Side
    ) -> tuple[SessionProtocol, relay.Guard | None]:
        """Detection on a mesh session whose header says opaque: what it really speaks, and the
        guard for its relay when the client sent nothing (a server-speaks-first protocol)."""
        first = await terminated.sniff(_detected, side.detect_timeout)
        protocol = detect(first, final=True)
        if protocol is Protocol.HTTP1:
            return SessionProtocol.HTTP1, None
        if protocol is Protocol.HTTP2:
            return SessionProtocol.HTTP2, None
        guard = None
        if not first:
            self._detect_timed_out(side, terminated.target)
            guard = self._late_http_guard(side, terminated.client_id, terminated.target)
        return SessionProtocol.OPAQUE, guard


def _detected(first: bytes) -> bool:
    return detect(first, final=len(first) >= PEEK_BYTES) is not NEED_MORE


def _reset(sock: socket.socket) -> None:
    """Closes `sock` with a TCP reset, as a failed connection looks to the client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _identity(config: ProxyConfig, metrics: ProxyMetrics) -> IdentityManager | None:
    if config.identity is None:
        return None
    from meshlet.proxy.identity.manager import IdentityManager

    return IdentityManager(config.identity, metrics)


def _router(
    config: ProxyConfig, identity: IdentityManager | None, metrics: ProxyMetrics
) -> MeshRouter | None:
    """Discovery and balancing, when a destination service is configured."""
    settings = config.destination
    if settings is None:
        return None
    from meshlet.proxy.discovery.client import DestinationClient
    from meshlet.proxy.discovery.resolver import Resolver
    from meshlet.proxy.outbound.router import MeshRouter

    client = DestinationClient(
        settings.svc_addr, settings.svc_name, settings.trust_anchors_pem, settings.context
    )
    return MeshRouter(
        client, Resolver(client), identity, metrics,
        connect_timeout=config.outbound_connect_timeout, clock=time.monotonic,
        profile_suffixes=settings.profile_suffixes,
    )  # fmt: skip


class ListenError(OSError):
    """A listener could not be bound: the one line a user needs."""

    def __init__(self, addr: Addr, name: str, cause: OSError) -> None:
        why = cause.strerror or str(cause)
        super().__init__(f"cannot listen on {addr[0]}:{addr[1]} ({name}): {why}")


def _bind(addr: Addr, name: str) -> socket.socket:
    try:
        return bind(addr)
    except OSError as exc:
        raise ListenError(addr, name, exc) from None


async def run(config: ProxyConfig) -> int:
    """Runs until SIGTERM/SIGINT (or POST /shutdown), then drains; the exit code (1 when an
    essential task stopped)."""
    proxy = Proxy(config)
    await proxy.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, proxy.request_shutdown)
    await proxy.closing.wait()
    log.info("shutting down: draining for up to %gs", config.shutdown_grace_period)
    await proxy.shutdown()
    return 1 if proxy.failure else 0
