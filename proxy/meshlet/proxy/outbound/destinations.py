"""Where outbound traffic goes once discovery knows the destination: the endpoint (balanced per
request or per connection), and how to reach it (plain TCP, or mTLS to its proxy).

- an unknown destination: the original destination as is, unmeshed (`pick` returns None);
- a pod (`kind == "endpoint"`): that endpoint;
- a service: `dst_overrides` split traffic by weight between services first; then P2C over
  peak-EWMA among its endpoints. No endpoints fails fast (503 / a closed connection), and so
  does a service whose endpoints failure accrual has all ejected (`failure_accrual`, per
  service: outbound/balance.py).

A meshed endpoint (it has a TLS identity and an inbound port) is reached over the mesh transport
(mesh/outbound.py) with our current client certificate; without a certificate the request
fails closed, never plaintext.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Callable, Iterator
from typing import Final

from meshlet.api.hostport import format_hostport
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.authority import split_authority
from meshlet.proxy.core.accrual import FailureAccrual
from meshlet.proxy.core.endpoints import DiscoveredEndpoint, EndpointSet, Hint, Status
from meshlet.proxy.core.retry_budget import RetryBudget
from meshlet.proxy.discovery.client import DestinationClient
from meshlet.proxy.discovery.profile import DstOverride, RetryBudgetSpec
from meshlet.proxy.discovery.resolver import Destination, Resolver, ResolverFull
from meshlet.proxy.http.contract import Addr, Connect, Endpoint, RouteError, Wait
from meshlet.proxy.identity.manager import IdentityManager
from meshlet.proxy.io.counters import dst_values
from meshlet.proxy.mesh.outbound import MeshConnectError, mesh_connect
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.outbound.balance import AllEjected, Balancer, Lease, NoEndpoints
from meshlet.proxy.series import Family

log = logging.getLogger(__name__)

ENDPOINTS_WAIT: Final = 3.0  # seconds a new service may take to report its endpoints
MAX_CACHED: Final = 10_000  # entries in each per-request lookup cache (cleared when full)
MAX_PARENTS: Final = 100  # parent Services one backend's balancer gauge is reported under


class Destinations:
    """The destinations discovery knows, their retry budgets, and the pick of an endpoint for
    each request or connection (the outbound stack's one instance)."""

    def __init__(
        self,
        client: DestinationClient,
        resolver: Resolver,
        identity: IdentityManager | None,
        metrics: ProxyMetrics,
        *,
        connect_timeout: float,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        profile_suffixes: tuple[str, ...] = ("svc.cluster.local",),
        namespace: str | None = None,
        source_ip: str | None = None,
        failure_accrual: FailureAccrual | None = None,
        http1_over_h2: bool = False,
    ) -> None:
        self.resolver = resolver
        self._http1_over_h2 = http1_over_h2
        self._client = client
        self._identity = identity
        self._metrics = metrics
        self._timeout = connect_timeout
        self._clock = clock
        self._rng = rng or random.Random()
        self._suffixes = profile_suffixes
        self._namespace = namespace
        self._source_ip = source_ip  # what mTLS connections to other proxies come from
        # A Service's short names (`web`, `web.ns`, `web.ns.svc`) complete under this suffix.
        self._services = next((x for x in profile_suffixes if x.startswith("svc.")), None)
        self._balancers: dict[str, tuple[EndpointSet, Balancer[Addr]]] = {}
        # How each (endpoint, protocol, authority) is reached; cleared when the certificate
        # changes, so that new connections present the new one.
        self._reaches: dict[tuple[Addr, str, int | None, SessionProtocol, str], Endpoint] = {}
        self._targets: dict[str, str | None] = {}  # request authority -> discovery target
        self._budgets: dict[str, tuple[RetryBudgetSpec, RetryBudget]] = {}  # per service
        self._accrual = failure_accrual  # every service's, unless set for it
        self._accruals: dict[str, FailureAccrual | None] = {}  # per service `name:port`
        self._parents: dict[str, list[dict[str, str]]] = {}  # per backend `name:port`
        if identity is not None:
            identity.on_change(self._reaches.clear)
        metrics.registry.register(self)

    def collect(self) -> Iterator[Family]:
        """Linkerd's `outbound_http_balancer_endpoints` gauge: each service's endpoints that
        are ready, and those pending (ejected by failure accrual, being probed, or backing
        off after a failed connection), under each parent Service whose outbound policy
        routes to it (`route_parent`; Linkerd keeps a balancer per parent and backend), else
        with the service as its own parent."""
        doc = "The number of endpoints currently in a HTTP request balancer."
        family = Family("outbound_http_balancer_endpoints", "gauge", doc)
        for authority, (_, balancer) in self._balancers.items():
            backend = _service_labels("backend", authority)
            ready = balancer.ready()
            pending = len(balancer.endpoints) - ready
            parents = self._parents.get(authority)
            for parent in parents or (_service_labels("parent", authority),):
                labels = {**parent, **backend}
                family.add_sample(family.name, {**labels, "endpoint_state": "ready"}, ready)
                family.add_sample(family.name, {**labels, "endpoint_state": "pending"}, pending)
        yield family

    def route_parent(self, authority: str, parent: dict[str, str]) -> None:
        """An outbound policy routes requests for the Service `parent` (its `parent_*`
        labels) to the backend `authority`: its balancer is reported under that parent (up to
        MAX_PARENTS of them)."""
        parents = self._parents.get(authority)
        if parents is None:
            if len(self._parents) >= MAX_CACHED:
                self._parents.clear()
            parents = self._parents[authority] = []
        if parent not in parents and len(parents) < MAX_PARENTS:
            parents.append(parent)

    async def aclose(self) -> None:
        """Ends discovery: the resolver's streams, then the connection to the destination
        service."""
        await self.resolver.aclose()
        await self._client.aclose()

    async def destination(self, target: Addr) -> Destination | RouteError:
        """Discovery of a redirected connection's original destination; a RouteError when
        discovery is full (the connection is refused rather than sent unmeshed)."""
        try:
            return await self.resolver.resolve(str(target))
        except ResolverFull as exc:
            return RouteError(503, str(exc))  # the caller refuses the connection and counts it

    async def destination_for_authority(self, authority: str) -> Destination | RouteError | None:
        """What discovery says of a request that was not redirected, by its authority: asked
        for IP literals and names under the profile suffixes; None for anything else (the
        caller then resolves the name itself)."""
        try:
            target = self._targets[authority]
        except KeyError:
            if len(self._targets) >= MAX_CACHED:
                self._targets.clear()
            target = self._targets[authority] = self._discovery_target(authority)
        if target is None:
            return None
        try:
            return await self.resolver.resolve(target)
        except ResolverFull as exc:
            return self._fail_fast(str(exc), "discovery_full")

    async def existing(self, authority: str) -> Destination | RouteError | None:
        """`destination_for_authority` when it names a pod or a Service that exists (its first
        endpoints awaited, up to ENDPOINTS_WAIT); else None: discovery is not asked for the
        name, or knows nothing of it."""
        destination = await self.destination_for_authority(authority)
        if destination is None or isinstance(destination, RouteError):
            return destination
        if destination.kind == "service" and destination.endpoints.status is Status.PENDING:
            try:
                async with asyncio.timeout(ENDPOINTS_WAIT):
                    await destination.wait_endpoints()
            except TimeoutError:
                return self._fail_fast("the destination service has not reported endpoints")
        if destination.kind == "unknown" or (
            destination.kind == "service" and destination.endpoints.status is Status.UNKNOWN
        ):
            return None
        return destination

    def known_destination(self, authority: str) -> Destination | None:
        """What discovery already says of a request's authority, without waiting: None when
        it is not asked, not answered yet, or knows nothing (`destination_for_authority`
        then tells)."""
        target = self._targets.get(authority)
        if target is None:
            return None
        destination = self.resolver.known(target)
        if destination is None or destination.kind == "unknown":
            return None
        return destination

    def budget_for(self, destination: Destination) -> RetryBudget | None:
        """The retry budget of the service `destination` is (shared by every connection to it,
        renewed when the profile changes it); None for what is not a service."""
        profile = destination.profile
        if destination.kind != "service" or profile is None:
            return None
        key = f"{profile.fqn}:{destination.port}"
        settings = profile.retry_budget
        held = self._budgets.get(key)
        if held is None or held[0] != settings:
            if len(self._budgets) >= MAX_CACHED:
                self._budgets.clear()
            budget = RetryBudget(settings.ratio, settings.min_per_second,
                                 min(60.0, max(1.0, settings.ttl)), self._clock())  # fmt: skip
            held = self._budgets[key] = (settings, budget)
        return held[1]

    def set_failure_accrual(self, authority: str, accrual: FailureAccrual | None) -> None:
        """Failure accrual for the service `authority` (`fqn:port`, as its balancer is keyed;
        None: off), from its outbound policy; applied to the next pick."""
        if authority not in self._accruals and len(self._accruals) >= MAX_CACHED:
            self._accruals.clear()
        self._accruals[authority] = accrual
        held = self._balancers.get(authority)
        if held is not None:
            held[1].set_accrual(accrual)

    def _discovery_target(self, authority: str) -> str | None:
        """`host:port` as discovery is asked for it, or None when discovery is not asked."""
        parts = split_authority(authority)
        if parts is None:
            return None
        host = parts.host.rstrip(".").lower()
        if not self._discoverable(host):
            full = self._full_name(host)
            if full is None:
                return None
            host = full
        return format_hostport(host, parts.port)

    def _full_name(self, host: str) -> str | None:
        """A Service's short name completed as a pod's DNS search list would (`web` in the
        pod's namespace; `web.ns`; `web.ns.svc`): `web.ns.svc.cluster.local`. Other names are
        None. When discovery knows nothing of the full name, the request goes where the name
        as written resolves."""
        suffix = self._services
        labels = host.split(".")
        if suffix is None or not all(labels):
            return None
        if len(labels) == 1 and self._namespace is not None:
            return f"{host}.{self._namespace}.{suffix}"
        if len(labels) == 2 or (len(labels) == 3 and labels[2] == "svc"):
            return f"{labels[0]}.{labels[1]}.{suffix}"
        return None

    def _discoverable(self, host: str) -> bool:
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        return any(
            not suffix or host == suffix or host.endswith("." + suffix) for suffix in self._suffixes
        )

    def pick(
        self, destination: Destination, session: SessionProtocol, after: Endpoint | None = None
    ) -> Endpoint | RouteError | Wait | None:
        """The endpoint for one request or connection (not `after`, where its previous attempt
        went, while another is left); None when discovery does not know the destination (it is
        then sent where it was going, unmeshed); a Wait when a traffic split is to be followed
        or endpoints are not reported yet."""
        if destination.kind == "unknown":
            return None
        if destination.kind == "endpoint":
            endpoint = destination.endpoint
            if endpoint is None:
                return None
            return self._reach(endpoint, session, destination.target, None)
        profile = destination.profile
        if profile is not None and profile.dst_overrides:
            return Wait(self._pick_later, (destination, session, after))
        if destination.endpoints.status is Status.PENDING:
            return Wait(self._pick_later, (destination, session, after))
        return self._balanced(destination, session, after)

    async def _pick_later(
        self, args: tuple[Destination, SessionProtocol, Endpoint | None]
    ) -> Endpoint | RouteError | None:
        destination, session, after = args
        profile = destination.profile
        if profile is not None and profile.dst_overrides:
            chosen = self._split(profile.dst_overrides)
            if chosen != f"{profile.fqn}:{destination.port}":
                destination = await self.resolver.resolve(chosen)
        if destination.endpoints.status is Status.PENDING:
            try:
                async with asyncio.timeout(ENDPOINTS_WAIT):
                    await destination.wait_endpoints()
            except TimeoutError:
                return self._fail_fast("the destination service has not reported endpoints")
        return self._balanced(destination, session, after)

    def pick_backend(
        self, path: str, session: SessionProtocol, after: Endpoint | None = None
    ) -> Endpoint | RouteError | Wait:
        """An endpoint of an outbound policy's backend, the service discovery names `path`
        (`name:port`), balanced as a dst_override's service is (the same balancer); the
        backend's own profile does not split it further."""
        destination = self.resolver.known(path)
        if destination is None or destination.endpoints.status is Status.PENDING:
            return Wait(self._backend_later, (path, session, after))
        return self._backend(destination, session, after)

    async def _backend_later(
        self, args: tuple[str, SessionProtocol, Endpoint | None]
    ) -> Endpoint | RouteError:
        path, session, after = args
        try:
            destination = await self.resolver.resolve(path)
        except ResolverFull as exc:
            return self._fail_fast(str(exc), "discovery_full")
        except ValueError:
            return RouteError(500, f"backend {path[:80]!r} is not a name:port")
        if destination.endpoints.status is Status.PENDING:
            try:
                async with asyncio.timeout(ENDPOINTS_WAIT):
                    await destination.wait_endpoints()
            except TimeoutError:
                return self._fail_fast(f"backend {path} has not reported endpoints")
        return self._backend(destination, session, after)

    def _backend(
        self, destination: Destination, session: SessionProtocol, after: Endpoint | None
    ) -> Endpoint | RouteError:
        picked = self._balanced(destination, session, after)
        if picked is None:
            return self._fail_fast(f"discovery knows nothing of backend {destination.target}")
        return picked

    def reach(
        self, endpoint: DiscoveredEndpoint, session: SessionProtocol
    ) -> Endpoint | RouteError:
        """How a request reaches one endpoint named without discovery (an outbound policy's
        forward backend): over mTLS when it has an identity, as a discovered one."""
        return self._reach(endpoint, session, str(endpoint.addr), None)

    def _split(self, overrides: tuple[DstOverride, ...]) -> str:
        """An override's authority, drawn by weight (the first when all weigh nothing)."""
        weights = [max(0, o.weight) for o in overrides]
        if sum(weights) == 0:
            return overrides[0].authority
        return self._rng.choices(overrides, weights=weights)[0].authority

    def _balanced(
        self, destination: Destination, session: SessionProtocol, after: Endpoint | None
    ) -> Endpoint | RouteError | None:
        endpoints = destination.endpoints
        name = destination.profile.fqn if destination.profile else None
        authority = f"{name}:{destination.port}" if name else destination.target
        if endpoints.status is Status.UNKNOWN:
            return None
        # The balancer follows the snapshot it was last given: two destinations (the Service
        # asked for by name and by cluster IP) share one authority, and their snapshots'
        # versions count separately, so a version alone would leave it on another's endpoints.
        held, balancer = self._balancers.get(authority) or (None, self._new_balancer(authority))
        if held is not endpoints:
            balancer.update(endpoints.endpoints)
            self._balancers[authority] = (endpoints, balancer)
        try:
            lease = balancer.pick(after.lease.endpoint if after and after.lease else None)
        except AllEjected as exc:
            return self._fail_fast(f"{authority}: {exc}", "all_endpoints_ejected")
        except NoEndpoints:
            return self._fail_fast(f"{authority} has no endpoints")
        return self._reach(endpoints.endpoints[lease.endpoint], session, authority, lease)

    def _reach(
        self,
        endpoint: DiscoveredEndpoint,
        session: SessionProtocol,
        authority: str,
        lease: Lease[Addr] | None,
    ) -> Endpoint | RouteError:
        identity = endpoint.identity
        meshed = identity is not None and endpoint.opaque_transport_port is not None
        if meshed:
            manager = self._identity
            if manager is None or not manager.ready:
                if lease is not None:
                    lease.release()
                return self._fail_fast(
                    f"{authority} is meshed but this proxy has no certificate yet: not sending"
                    " it in plaintext"
                )
        key = (endpoint.addr, identity.name if identity is not None else "",
               endpoint.opaque_transport_port, session, authority)  # fmt: skip
        reach = self._reaches.get(key)
        if reach is None:
            if len(self._reaches) >= MAX_CACHED:
                self._reaches.clear()
            reach = self._reaches[key] = self._how_to_reach(endpoint, session, authority)
        return Endpoint(reach.addr, reach.authority_label, reach.connect, lease, reach.labels,
                        reach.h2)  # fmt: skip

    def _how_to_reach(
        self, endpoint: DiscoveredEndpoint, session: SessionProtocol, authority: str
    ) -> Endpoint:
        """How requests for `authority` reach `endpoint` (kept until the certificate changes):
        plain TCP, or a mesh connector to its proxy, with the metric labels they carry."""
        label = self._label(authority)
        identity = endpoint.identity
        where = str(endpoint.addr)
        if identity is None or endpoint.opaque_transport_port is None:
            labels = self._metrics.conn(
                "outbound", where, dst_values(endpoint.labels),
                no_tls_reason="not_provided_by_service_discovery",
            ).values()  # fmt: skip
            return Endpoint(endpoint.addr, label, labels=labels)
        assert self._identity is not None  # `_reach` checked it
        proxy_addr = Addr(endpoint.addr.host, endpoint.opaque_transport_port)
        context = self._identity.client_context()
        connect = self._counted(
            mesh_connect(context, identity.name, endpoint.addr[1], session, authority,
                         timeout=self._timeout, source_ip=self._source_ip)
        )  # fmt: skip
        # An HTTP/1 client's requests go to a proxy that takes HTTP/2 as streams of one HTTP/2
        # session (orig_proto.py); those HTTP/2 cannot carry still use `connect`.
        h2 = None
        if session is SessionProtocol.HTTP1 and endpoint.hint is Hint.H2 and self._http1_over_h2:
            h2 = self._counted(
                mesh_connect(context, identity.name, endpoint.addr[1], SessionProtocol.HTTP2,
                             authority, timeout=self._timeout, source_ip=self._source_ip)
            )  # fmt: skip
        labels = self._metrics.conn(
            "outbound", where, dst_values(endpoint.labels), tls="true", no_tls_reason="",
            server_id=identity.name,
        ).values()  # fmt: skip
        return Endpoint(proxy_addr, label, connect, labels=labels, h2=h2)

    def _counted(self, connect: Connect) -> Connect:
        """`connect`, counting the connections this side refuses (the peer's certificate or
        session failed a check) by reason."""
        refused = self._metrics.fail_fast_total

        async def counted(
            addr: Addr, factory: Callable[[], asyncio.Protocol]
        ) -> tuple[asyncio.Transport, asyncio.Protocol]:
            try:
                return await connect(addr, factory)
            except MeshConnectError as exc:
                refused.labels("outbound", exc.reason.value).inc()
                raise

        return counted

    def _new_balancer(self, authority: str) -> Balancer[Addr]:
        accrual = self._accruals.get(authority, self._accrual)
        return Balancer(clock=self._clock, rng=self._rng, accrual=accrual)

    def _fail_fast(self, why: str, reason: str = "no_endpoints") -> RouteError:
        self._metrics.fail_fast_total.labels("outbound", reason).inc()
        return RouteError(503, why)

    def _label(self, authority: str) -> str:
        return self._metrics.authority_label(authority)


def _service_labels(side: str, authority: str) -> dict[str, str]:
    """Linkerd's parent or backend (`side`) labels of a balancer keyed
    `name.namespace.svc...:port` (or `ip:port`: that name and no namespace)."""
    host, _, port = authority.rpartition(":")
    name, namespace = host, ""
    parts = host.split(".")
    if len(parts) > 2 and parts[2] == "svc":
        name, namespace = parts[0], parts[1]
    return {f"{side}_group": "core", f"{side}_kind": "Service", f"{side}_namespace": namespace,
            f"{side}_name": name, f"{side}_port": port}  # fmt: skip
