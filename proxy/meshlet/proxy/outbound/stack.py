"""The outbound stack: what happens to a connection the app opened, stage by stage.

accepted (io/listener)
  → OrigDst: where the app meant to connect (SO_ORIGINAL_DST; none: not redirected, so
    each HTTP request is routed by its authority); the proxy's own ports are refused
  → Logical: what discovery says of that address (a service, a pod, or nothing), leased
    for the connection's life; an opaque port or profile skips detection
  → detected: HTTP/1, HTTP/2, or opaque (core/detect.py, io/listener.py)
  → HTTP: the engine asks `outbound.connection_router.OutboundRouter` for each request's route
    (profile route, retry budget; or the service's outbound policy: outbound/policy_router.py)
    and endpoints (balanced per request, reached over mTLS
    when meshed: outbound/destinations.py, mesh/outbound.py)
  → opaque: relayed to the endpoint picked for the connection (connections.Connections).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlet.api.ports import PortRanges
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.detect import Protocol
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.contract import Addr, Endpoint, EndpointPicker, RouteError
from meshlet.proxy.io.listener import Accepted, peek_protocol

if TYPE_CHECKING:
    from meshlet.proxy.discovery.resolver import Destination
    from meshlet.proxy.outbound.connection_router import OutboundRouter
    from meshlet.proxy.outbound.destinations import Destinations
    from meshlet.proxy.outbound.policies import OutboundPolicies

log = logging.getLogger(__name__)
DIRECTION = "outbound"


@dataclass(frozen=True, slots=True)
class OrigDst:
    accepted: Accepted
    target: Addr | None  # None: not redirected


@dataclass(frozen=True, slots=True)
class Logical:
    orig: OrigDst
    destination: Destination | None  # None: no discovery (or not asked)
    opaque: bool  # relay without protocol detection


class OutboundStack:
    def __init__(
        self,
        connections: Connections,
        mesh: Destinations | None,
        *,
        self_targets: SelfTargets,
        detect_timeout: float,
        opaque_ports: PortRanges,
        policies: OutboundPolicies | None = None,
    ) -> None:
        self._conns = connections
        self._policies = policies
        self._mesh = mesh
        self._timeout = detect_timeout
        self._opaque_ports = opaque_ports
        self.self_targets = self_targets  # the proxy's own ports, as bound

    async def handle(self, accepted: Accepted) -> None:
        orig = OrigDst(accepted, accepted.original_dst)
        target = orig.target
        if target is not None and self.self_targets.loops(target, accepted.local[0]):
            self._conns.refuse(accepted, DIRECTION, "loop",
                               f"{target} is the proxy's own port")  # fmt: skip
            return
        if target is None or self._mesh is None:
            await self._serve(Logical(orig, None, self._opaque(target, None)))
            return
        destination = await self._mesh.destination(target)
        if isinstance(destination, RouteError):
            self._conns.refuse(accepted, DIRECTION, "discovery_full", destination.reason)
            return
        async with destination.use():
            await self._serve(Logical(orig, destination, self._opaque(target, destination)))

    def _opaque(self, target: Addr | None, destination: Destination | None) -> bool:
        if target is None:
            return False
        profile = destination.profile if destination is not None else None
        return target[1] in self._opaque_ports or bool(profile and profile.opaque)

    async def _serve(self, logical: Logical) -> None:
        accepted, target = logical.orig.accepted, logical.orig.target
        conns = self._conns
        labels = conns.metrics.conn(
            DIRECTION, str(target) if target else "authority",
            peer=str(accepted.client),
        )  # fmt: skip
        async with conns.counted(labels) as tcp:
            if logical.opaque:
                await conns.relay(accepted, self._endpoints(logical), labels, tcp)
                return
            detected = await peek_protocol(accepted, self._timeout)
            if detected is None:
                accepted.sock.close()
                return
            if detected.protocol in (Protocol.HTTP1, Protocol.HTTP2):
                h2 = detected.protocol is Protocol.HTTP2
                session = SessionProtocol.HTTP2 if h2 else SessionProtocol.HTTP1
                await conns.http(h2, self._router(logical, session), labels, tcp,
                                 accepted=accepted)  # fmt: skip
                return
            if detected.timed_out:
                conns.detect_timed_out(DIRECTION, self._timeout, target[1] if target else None)
            if target is None:
                conns.refuse(
                    accepted, DIRECTION, "no_original_dst",
                    "opaque TCP (or TLS) reached the outbound listener without an original "
                    "destination; only iptables-redirected connections can be relayed",
                )  # fmt: skip
                return
            # The destination's own inbound proxy checks what reaches its app: no guard here.
            await conns.relay(accepted, self._endpoints(logical), labels, tcp)

    def _endpoints(self, logical: Logical) -> EndpointPicker:
        """What picks the endpoint of an opaque connection."""
        target = logical.orig.target
        assert target is not None
        fixed = FixedPicker(Endpoint(target, str(target)))
        if logical.destination is None or self._mesh is None:
            return fixed
        from meshlet.proxy.outbound.connection_router import DiscoveredPicker

        return DiscoveredPicker(self._mesh, logical.destination, SessionProtocol.OPAQUE, fixed)

    def _router(self, logical: Logical, session: SessionProtocol) -> OutboundRouter:
        from meshlet.proxy.outbound.connection_router import OutboundRouter

        accepted = logical.orig.accepted
        return OutboundRouter(
            self._mesh, self._conns.metrics, session, destination=logical.destination,
            target=logical.orig.target, self_targets=self.self_targets,
            local_ip=accepted.local[0], policies=self._policies,
        )  # fmt: skip
