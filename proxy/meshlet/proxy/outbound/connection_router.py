"""The Router of one outbound connection (the route stage): which ServiceProfile route each
request takes, and what picks its endpoints.

A connection's logical target is one of: a destination discovery knows (a service, or one pod),
a redirected address discovery does not know (sent there as is), or nothing (the connection was
not redirected: each request is routed by its authority, through discovery for cluster names and
IP literals, else by DNS). For a service the request is matched to the profile's routes (its
timeout, retries, classification and `rt_route`), retries are budgeted by the service's retry
budget, and every attempt is balanced (`Destinations.pick`).

With a policy controller, the service's outbound policy is followed from the connection's (or
the request's) first look at it (`outbound.policies`). Linkerd's precedence: while the service
has a ServiceProfile with routes or dst_overrides, the profile routes and the policy is
ignored; otherwise each request is routed by the policy (`outbound.policy_router`). The first
requests to a service wait for the controller's first answer, up to POLICY_WAIT (a split, a
redirect or a forbidding filter holds from the first request); when the controller fails the
stream (it does not know the target) or is slower than that, they take the profile's path,
and so do the service's later requests until the policy arrives (one wait, not one each).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from meshlet.api.hostport import HostPort, parse_hostport
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.authority import by_authority, by_literal
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.core.routes import DEFAULT_ROUTE, policy, route_for
from meshlet.proxy.fixed_router import FixedPicker, FixedRouter
from meshlet.proxy.http.contract import (
    Addr,
    Endpoint,
    EndpointPicker,
    RequestTarget,
    RouteError,
    RouteTarget,
    Wait,
    settle,
)
from meshlet.proxy.metrics import ProxyMetrics

if TYPE_CHECKING:  # discovery is imported only by proxies that use it
    from meshlet.proxy.discovery.outbound_policy import Followed
    from meshlet.proxy.discovery.profile import Profile
    from meshlet.proxy.discovery.resolver import Destination
    from meshlet.proxy.outbound.destinations import Destinations
    from meshlet.proxy.outbound.policies import OutboundPolicies
    from meshlet.proxy.outbound.policy_router import PolicyRouter

_UNKNOWN: Final = RouteError(502, "discovery knows nothing of the request's destination")
POLICY_WAIT: Final = 1.0  # seconds a first request waits for the service's outbound policy


@dataclass(frozen=True, slots=True)
class DiscoveredPicker:
    """Each attempt balanced over what discovery says of `destination`; `fallback` picks when
    it knows nothing (the request then goes where it was sent, or where its name resolves)."""

    mesh: Destinations
    destination: Destination
    session: SessionProtocol
    fallback: EndpointPicker | None

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError | Wait:
        picked = self.mesh.pick(self.destination, self.session, after)
        if isinstance(picked, Wait):
            return Wait(self._settle, (picked, after))
        return self._or_fallback(picked, after)

    async def _settle(self, args: tuple[Wait, Endpoint | None]) -> Endpoint | RouteError:
        waited, after = args
        return await settle(self._or_fallback(await settle(waited), after))

    def _or_fallback(
        self, picked: Endpoint | RouteError | None, after: Endpoint | None
    ) -> Endpoint | RouteError | Wait:
        if picked is not None:
            return picked
        if self.fallback is not None:
            return self.fallback.pick(after)
        return _UNKNOWN


@dataclass(frozen=True, slots=True)
class DnsPicker:
    """The address the request's authority resolves to (looked up when a pick is asked)."""

    authority: str
    self_targets: SelfTargets
    local_ip: str
    metrics: ProxyMetrics

    def pick(self, after: Endpoint | None = None) -> Wait:
        return Wait(self._lookup, after)  # a name lookup

    async def _lookup(self, after: Endpoint | None) -> Endpoint | RouteError:
        routed = await by_authority(self.authority, self.self_targets, self.local_ip)
        if isinstance(routed, RouteError):
            return routed
        return Endpoint(routed.addr, self.metrics.authority_label(routed.authority_label))


class _Known(NamedTuple):
    """The routes of one connection's discovered destination, as last built."""

    destination: Destination
    profile: Profile | None
    authority: str | None
    targets: dict[int, RouteTarget]  # by id() of the profile's route (of None: the default)


class OutboundRouter:
    """Routes the requests of one outbound connection."""

    def __init__(
        self,
        mesh: Destinations | None,
        metrics: ProxyMetrics,
        session: SessionProtocol,
        *,
        destination: Destination | None = None,
        target: Addr | None = None,
        self_targets: SelfTargets,
        local_ip: str,
        policies: OutboundPolicies | None = None,
    ) -> None:
        self._mesh = mesh
        self._policies = policies
        # the service's policy target and router, kept while discovery's answer is the same
        self._policy_router: tuple[Destination, HostPort, PolicyRouter] | None = None
        self._metrics = metrics
        self._session = session
        self._destination = destination
        self._self, self._local_ip = self_targets, local_ip
        self._fixed = FixedRouter(target, metrics) if target is not None else None
        self._fallback: EndpointPicker | None = None
        self._known: _Known | None = None
        self._literal: tuple[str, RouteTarget | RouteError] | None = None
        if target is not None:
            label = metrics.authority_label(str(target))
            self._fallback = FixedPicker(Endpoint(target, label))
        if policies is not None and destination is not None and destination.kind == "service":
            policies.follow(policy_target(destination))  # to arrive before the first request

    def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
        mesh = self._mesh
        if mesh is not None and self._destination is not None:
            return self._discovered(mesh, self._destination, request)
        if self._fixed is not None:
            return self._fixed.route(request)
        authority = request.authority
        if mesh is None:
            routed = self._by_literal(authority)
            return routed if routed is not None else Wait(self._by_authority, request)
        if authority:
            destination = mesh.known_destination(authority)
            if destination is not None:
                return self._discovered(mesh, destination, request, authority)
        return Wait(self._by_authority, request)

    def _discovered(
        self,
        mesh: Destinations,
        destination: Destination,
        request: RequestTarget,
        authority: str | None = None,
        waited: bool = False,
    ) -> RouteTarget | RouteError | Wait:
        """The request's route on `destination`; without a redirected target, requests are
        routed by `authority`, which a name lookup falls back to. A Wait: for the service's
        first outbound policy (`waited`: that wait is over)."""
        profile = destination.profile
        policies = self._policies
        if policies is not None and destination.kind == "service" and not profiled(profile):
            service, router = self._by_policy(mesh, destination)
            followed = policies.follow(service)
            if followed is not None:
                if followed.policy is not None:
                    routed = router.route(followed, request)
                    if routed is not None:
                        return routed
                elif not waited and not followed.settled.is_set():
                    return Wait(self._after_policy,
                                (followed, mesh, destination, request, authority))  # fmt: skip
        route = route_for(profile.routes, request.method, request.path) if profile else None
        # Kept for the connection's next requests, until discovery's answer changes.
        known = self._known
        if (
            known is None
            or known.destination is not destination
            or known.profile is not profile
            or known.authority != authority
        ):
            known = self._known = _Known(destination, profile, authority, {})
        # By the route's identity: the profile held here keeps each of its routes alive.
        target = known.targets.get(id(route))
        if target is None:
            fallback = self._fallback
            if authority is not None:
                fallback = DnsPicker(authority, self._self, self._local_ip, self._metrics)
            name = profile.fqn if profile is not None and profile.fqn else None
            dst = f"{name}:{destination.port}" if name else destination.target
            target = known.targets[id(route)] = RouteTarget(
                self._metrics.authority_label(dst),
                policy(route) if route is not None else DEFAULT_ROUTE,
                mesh.budget_for(destination),
                DiscoveredPicker(mesh, destination, self._session, fallback),
            )
        return target

    def _by_policy(
        self, mesh: Destinations, destination: Destination
    ) -> tuple[HostPort, PolicyRouter]:
        """The service's policy target and this connection's router by its policy, made once
        per discovery answer (not per request)."""
        held = self._policy_router
        if held is not None and held[0] is destination:
            return held[1], held[2]
        from meshlet.proxy.outbound.policy_router import PolicyRouter

        target = policy_target(destination)
        label = self._metrics.authority_label(str(target))
        router = PolicyRouter(mesh, self._metrics, self._session, label,
                              budget=mesh.budget_for(destination))  # fmt: skip
        self._policy_router = (destination, target, router)
        return target, router

    def _by_literal(self, authority: str | None) -> RouteTarget | RouteError | None:
        """Without discovery, an authority that needs no name lookup is routed at once, and
        kept for the connection's next requests (which mostly name the same one)."""
        known = self._literal
        if known is not None and known[0] == authority:
            return known[1]
        literal = by_literal(authority, self._self, self._local_ip)
        if literal is None:
            return None  # a name: looked up by `route`
        routed = self._fixed_target(literal) if isinstance(literal, Endpoint) else literal
        if authority is not None:
            self._literal = (authority, routed)
        return routed

    def _fixed_target(self, routed: Endpoint) -> RouteTarget:
        label = self._metrics.authority_label(routed.authority_label)
        return RouteTarget(label, DEFAULT_ROUTE, None, FixedPicker(Endpoint(routed.addr, label)))

    async def _after_policy(
        self, args: tuple[Followed, Destinations, Destination, RequestTarget, str | None]
    ) -> RouteTarget | RouteError | Wait:
        followed, mesh, destination, request, authority = args
        try:
            async with asyncio.timeout(POLICY_WAIT):
                await followed.settled.wait()
        except TimeoutError:
            followed.settled.set()  # a controller that does not answer holds up no other request
        return self._discovered(mesh, destination, request, authority, waited=True)

    async def _by_authority(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
        """A connection that was not redirected: discovery for cluster names and IP literals,
        else the name as DNS resolves it."""
        authority = request.authority
        if self._mesh is not None and authority:
            destination = await self._mesh.destination_for_authority(authority)
            if isinstance(destination, RouteError):
                return destination
            if destination is not None and destination.kind != "unknown":
                return self._discovered(self._mesh, destination, request, authority)
        routed = await by_authority(authority, self._self, self._local_ip)
        if isinstance(routed, RouteError):
            return routed
        return self._fixed_target(routed)


def profiled(profile: Profile | None) -> bool:
    """The service's ServiceProfile routes its requests (its routes or dst_overrides): then
    its outbound policy is not used."""
    return profile is not None and bool(profile.routes or profile.dst_overrides)


def policy_target(destination: Destination) -> HostPort:
    """What the policy controller is asked for a service: its name and port, else the address
    discovery was asked for."""
    profile = destination.profile
    if profile is not None and profile.fqn:
        return HostPort(profile.fqn, destination.port)
    return parse_hostport(destination.target)
