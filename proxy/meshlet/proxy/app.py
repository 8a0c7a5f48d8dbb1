"""The running proxy: its lifecycle (listeners, admin, identity, discovery, drain).

What happens to each connection is the business of the two stacks: `outbound.stack` (the app's
own connections) and `inbound.stack` (connections for this pod); `connections` holds what they
share (engines, pools, the relay, counting).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from meshlet.api import wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.target import EscapedSlashes
from meshlet.proxy import logs, memory
from meshlet.proxy.config import ProxyConfig
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.authz import Network, default_policy
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.core.pressure import PressureLimits
from meshlet.proxy.http.contract import Addr, HttpLimits
from meshlet.proxy.identity.anchors import TrustAnchors
from meshlet.proxy.inbound.authz import InboundPolicy
from meshlet.proxy.inbound.stack import InboundStack
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Listener, bind
from meshlet.proxy.io.shedder import LoadShedder
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.outbound.stack import OutboundStack

if TYPE_CHECKING:
    from meshlet.proxy.discovery.inbound_policy import PolicyWatcher
    from meshlet.proxy.http.observe import Observe
    from meshlet.proxy.identity.manager import IdentityManager
    from meshlet.proxy.outbound.destinations import Destinations
    from meshlet.proxy.outbound.policies import OutboundPolicies
    from meshlet.proxy.tap.server import TapServer

log = logging.getLogger(__name__)


class Proxy:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        self.limits = HttpLimits(
            max_header_bytes=config.http1_max_header_bytes,
            max_headers=config.http1_max_headers,
            header_read_timeout=config.http1_header_read_timeout,
            idle_timeout=config.http_idle_timeout,
            stream_idle_timeout=config.http_stream_idle_timeout,
            connect_timeout=config.outbound_connect_timeout,
            pool_idle_timeout=config.http1_pool_idle_timeout,
            max_concurrent_streams=config.http2_max_concurrent_streams,
        )
        self.closing = asyncio.Event()
        self.stopped = asyncio.Event()
        self.anchors = _anchors(config, self.metrics)
        self.identity = _identity(config, self.metrics, self.anchors)
        self.router = _router(config, self.identity, self.metrics, self.anchors)
        self.policy, self.policy_watcher = _inbound_policy(config, self.metrics, self.anchors)
        self.outbound_policies = (
            _outbound_policies(config, self.anchors) if self.router is not None else None
        )
        self.shedder = LoadShedder(
            PressureLimits(
                connections=config.load_shed_connections, streams=config.load_shed_streams,
                buffered=config.load_shed_buffered_bytes,
            ),
            self.metrics,
        )  # fmt: skip
        self.connections = Connections(
            self.metrics, self.limits, tcp_connector(config.outbound_connect_timeout),
            self.closing, self.shedder, _observe(config, self.metrics),
            EscapedSlashes(config.inbound_http_escaped_slashes),
        )  # fmt: skip
        # Built by `start` once the listeners are bound, from the ports as bound.
        self.outbound: OutboundStack
        self.inbound: InboundStack
        self.listeners: list[Listener] = []
        self._supervisor: asyncio.Task[None] | None = None
        self.failure: str | None = None  # why an essential task stopped, when one did
        self._admin = AdminServer(
            self.metrics.registry.render_chunks,
            ready=self.ready,
            shutdown=self.request_shutdown if config.admin_shutdown_enabled else None,
            log_level=logs.set_level,
        )
        self.admin_port = 0
        self._tap: TapServer | None = None

    @property
    def tap_address(self) -> tuple[str, int] | None:
        """Where the tap server listens (None: identity is off, so tap is too)."""
        return None if self._tap is None else self._tap.address

    def ready(self) -> bool:
        """Serving, and holding a certificate when identity is configured."""
        identity_ready = self.identity is None or self.identity.ready
        return bool(self.listeners) and not self.closing.is_set() and identity_ready

    async def start(self) -> None:
        """Binds the listeners and the admin server (ListenError when one cannot), builds the
        stacks from the ports as bound, then runs the essential tasks (listeners, identity)
        under one supervisor: if one stops, the proxy records why (`failure`) and shuts
        down."""
        cfg = self.config
        bound: list[socket.socket] = []
        try:
            outbound_socks = _bind_all(cfg.outbound_addrs, "outbound")
            bound += outbound_socks
            inbound_socks = _bind_all(cfg.inbound_addrs, "inbound")
            bound += inbound_socks
            try:
                _, self.admin_port = await self._admin.start(*cfg.admin_listen_addr)
            except OSError as exc:
                raise ListenError(cfg.admin_listen_addr, "admin", exc) from None
        except ListenError:
            for sock in bound:
                sock.close()
            raise
        if self.identity is not None:  # tap is served over mTLS: without identity, it is off
            try:
                self._tap = _tap_server(cfg, self.identity, self.metrics)
            except ListenError:
                for sock in bound:
                    sock.close()
                await self._admin.close()
                raise
        # Ports as bound (a configured port 0 is ephemeral): none of them is ever a target.
        own = SelfTargets(
            [*(Addr(*sock.getsockname()[:2]) for sock in bound),
             Addr(cfg.admin_listen_addr.host, self.admin_port), cfg.control_listen_addr]
        )  # fmt: skip
        self.outbound = OutboundStack(
            self.connections, self.router, self_targets=own,
            detect_timeout=cfg.outbound_detect_timeout,
            opaque_ports=cfg.outbound_ports_disable_protocol_detection,
            policies=self.outbound_policies,
        )  # fmt: skip
        self.inbound = InboundStack(
            self.connections, self.identity, port=inbound_socks[0].getsockname()[1],
            self_targets=own, detect_timeout=cfg.inbound_detect_timeout,
            opaque_ports=cfg.inbound_ports_disable_protocol_detection,
            require_identity=cfg.inbound_ports_require_identity, policy=self.policy,
        )  # fmt: skip
        self.listeners = [
            *(Listener(sock, self.outbound.handle, "outbound") for sock in outbound_socks),
            *(Listener(sock, self.inbound.handle, "inbound") for sock in inbound_socks),
        ]
        essentials = [(f"the {lst.name} listener", lst.serve()) for lst in self.listeners]
        if self.identity is not None:
            essentials.append(("the identity client", self.identity.run()))
        if self.anchors is not None and self.anchors.path is not None:
            essentials.append(("the trust-anchor file's follower", self.anchors.follow()))
        if self.policy_watcher is not None:
            essentials.append(("the policy watch", self.policy_watcher.run()))
        if self._tap is not None:
            essentials.append(("the tap server", self._tap.run()))
        trim = memory.malloc_trim()
        if trim is not None:
            memory.keep_pages()  # the trimmer returns what they keep
            essentials.append(("the heap trimmer", memory.trim_forever(trim)))
        self._supervisor = asyncio.create_task(self._supervise(essentials))
        log.info(
            "proxy listening: outbound %s, inbound %s, admin :%d",
            " ".join(str(lst.address) for lst in self.listeners if lst.name == "outbound"),
            " ".join(str(lst.address) for lst in self.listeners if lst.name == "inbound"),
            self.admin_port,
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
        if self.outbound_policies is not None:
            await self.outbound_policies.aclose()
        if self.router is not None:
            await self.router.aclose()
        await self.connections.aclose()
        observe = self.connections.observe
        if observe is not None:
            await asyncio.to_thread(observe.close)
        self.shedder.close()
        await self._admin.close()
        self.stopped.set()


def _anchors(config: ProxyConfig, metrics: ProxyMetrics) -> TrustAnchors | None:
    """The trust anchors, followed in their file when one is named; None without anchors."""
    if not config.identity_trust_anchors:
        return None
    anchors = TrustAnchors(config.identity_trust_anchors, config.identity_trust_anchors_file,
                           counted=metrics.identity_trust_anchors_reload_total.labels)  # fmt: skip
    metrics.identity_trust_anchors.set(anchors.count)
    anchors.on_change(lambda: metrics.identity_trust_anchors.set(anchors.count))
    return anchors


def _identity(
    config: ProxyConfig, metrics: ProxyMetrics, anchors: TrustAnchors | None
) -> IdentityManager | None:
    if config.identity is None:
        return None
    from meshlet.proxy.identity.manager import IdentityManager

    return IdentityManager(config.identity, metrics, anchors=anchors)


def tap_identity(config: ProxyConfig) -> str:
    """The one identity the tap server answers: MESHLET_PROXY_TAP_SVC_NAME, else the tap
    controller's service account in the control plane this proxy's identity names."""
    if config.tap_svc_name:
        return config.tap_svc_name
    parsed = wellknown.parse_identity_name(config.identity_local_name)
    if parsed is None:
        return wellknown.identity_name(wellknown.TAP_NAME, wellknown.CONTROL_PLANE_NAMESPACE)
    _, _, control_ns, trust_domain = parsed
    return wellknown.identity_name(wellknown.TAP_NAME, control_ns, control_ns, trust_domain)


def _tap_server(config: ProxyConfig, identity: IdentityManager, metrics: ProxyMetrics) -> TapServer:
    from meshlet.proxy.metrics import TapCounts
    from meshlet.proxy.tap.server import TapServer
    from meshlet.proxy.tap.taps import Taps

    sock = _bind(config.control_listen_addr, "control")
    counts = TapCounts(metrics)
    taps = metrics.taps = Taps(counts, local_id=identity.local_name)
    return TapServer(sock, taps, identity, tap_identity(config), counts=counts)


def _router(
    config: ProxyConfig,
    identity: IdentityManager | None,
    metrics: ProxyMetrics,
    anchors: TrustAnchors | None,
) -> Destinations | None:
    """Discovery and balancing, when a destination service is configured."""
    settings = config.destination
    if settings is None:
        return None
    from meshlet.proxy.discovery.client import DestinationClient
    from meshlet.proxy.discovery.resolver import Resolver
    from meshlet.proxy.outbound.destinations import Destinations

    client = DestinationClient(settings.svc_addr, settings.svc_name, anchors, settings.context)
    return Destinations(
        client, Resolver(client), identity, metrics,
        connect_timeout=config.outbound_connect_timeout, clock=time.monotonic,
        profile_suffixes=settings.profile_suffixes, namespace=settings.namespace,
        source_ip=config.outbound_mesh_source_ip,
        http1_over_h2=config.outbound_http1_over_h2,
    )  # fmt: skip


def _inbound_policy(
    config: ProxyConfig, metrics: ProxyMetrics, anchors: TrustAnchors | None
) -> tuple[InboundPolicy, PolicyWatcher | None]:
    """The inbound ports' policies: the default policy until the policy controller answers for
    a port (and for ports it is not asked about, or without a controller)."""
    from meshlet.proxy.discovery.inbound_policy import Policies, PolicyWatcher

    cluster = tuple(Network(net) for net in config.policy_cluster_networks)
    policies = Policies(default_policy(config.inbound_default_policy, cluster))
    settings = config.policy
    watcher = None
    if settings is not None and settings.ports:
        watcher = PolicyWatcher(
            policies, settings.svc_addr, settings.svc_name, anchors, settings.workload,
            settings.ports,
        )  # fmt: skip
    return InboundPolicy(policies.get, metrics), watcher


def _outbound_policies(
    config: ProxyConfig, anchors: TrustAnchors | None
) -> OutboundPolicies | None:
    """The outbound policies of the services the proxy's traffic targets, when a policy
    controller is configured (else each service is routed by its ServiceProfile alone)."""
    settings = config.policy
    if settings is None:
        return None
    from meshlet.proxy.discovery.outbound_policy import WatchOutbound
    from meshlet.proxy.outbound.policies import OutboundPolicies

    client = WatchOutbound(settings.svc_addr, settings.svc_name, anchors, settings.workload)
    return OutboundPolicies(client, time.monotonic)


class ListenError(OSError):
    """A listener could not be bound: the one line a user needs."""

    def __init__(self, addr: Addr, name: str, cause: OSError) -> None:
        why = cause.strerror or str(cause)
        super().__init__(f"cannot listen on {addr} ({name}): {why}")
        self.cause = cause


def _bind_all(addrs: tuple[Addr, ...], name: str) -> list[socket.socket]:
    """A listener's sockets, one per address. An IPv6 address beside others is left out, with a
    warning, where the network namespace has no IPv6 (meshlet-init then programs no IPv6 rules
    either), so one environment serves IPv4-only and dual-stack pods alike."""
    socks: list[socket.socket] = []
    try:
        for addr in addrs:
            try:
                socks.append(_bind(addr, name))
            except ListenError as exc:
                no_ipv6 = exc.cause.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
                if not (no_ipv6 and ":" in addr.host and len(addrs) > 1):
                    raise
                log.warning("%s listener: not on %s (no IPv6 here: %s)", name, addr, exc.cause)
    except ListenError:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise ListenError(addrs[0], name, OSError(errno.EADDRNOTAVAIL, "no address could bind"))
    return socks


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


def _observe(config: ProxyConfig, metrics: ProxyMetrics) -> Observe | None:
    """Access logs and span export, as configured; None (nothing loaded) when neither is."""
    if not config.access_log and not config.trace_collector_svc_addr:
        return None
    import sys

    from meshlet.proxy.http.observe import FORMATS, LineWriter, Observe

    writer = None
    if config.access_log:
        writer = LineWriter(sys.stderr.fileno(), metrics.access_log_dropped_total.labels())
    spans = None
    if config.trace_collector_svc_addr:
        from meshlet.proxy.http.export import SpanExport

        spans = SpanExport(
            config.trace_collector_svc_addr, config.trace_service_name,
            metrics.trace_spans_exported_total.labels(), metrics.trace_spans_dropped_total.labels(),
        )  # fmt: skip
    return Observe(FORMATS.get(config.access_log), writer, spans)
