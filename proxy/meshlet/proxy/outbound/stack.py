"""The outbound stack: what happens to a connection the app opened, stage by stage.

accepted (io/listener)
  → OrigDst: where the app meant to connect (SO_ORIGINAL_DST; none: not redirected, so
    each HTTP request is routed by its authority, and a first request CONNECT opens a tunnel
    to its authority: outbound/tunnel.py); the proxy's own ports are refused
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

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlet.api.ports import PortRanges
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.authority import by_authority, by_literal
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.detect import Protocol
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.contract import Addr, Endpoint, EndpointPicker, RouteError
from meshlet.proxy.io.listener import Accepted, Detected, peek_protocol
from meshlet.proxy.outbound import tunnel

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
    target: Addr | None  # None: not redirected (or tunneled to a destination discovery knows)
    tunneled: str | None = None  # the authority a CONNECT named, when the connection is its


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
        if target is None:
            detected = await peek_protocol(accepted, self._timeout)
            if detected is None:
                accepted.sock.close()
            elif detected.protocol is Protocol.HTTP1 and tunnel.is_connect(detected.first_bytes):
                await self._tunnel(accepted)
            else:
                await self._serve(Logical(orig, None, False), detected)
            return
        if self._mesh is None:
            await self._serve(Logical(orig, None, self._opaque(target[1], None)))
            return
        destination = await self._mesh.destination(target)
        if isinstance(destination, RouteError):
            self._conns.refuse(accepted, DIRECTION, "discovery_full", destination.reason)
            return
        async with destination.use():
            await self._serve(Logical(orig, destination, self._opaque(target[1], destination)))

    async def _tunnel(self, accepted: Accepted) -> None:
        """A CONNECT request (outbound/tunnel.py): once answered 200, the connection's bytes
        are an outbound connection to its authority: a destination discovery knows by that name
        (a service, under the profile suffixes or the pod's namespace search), else the
        address the name resolves to, as if the app had connected there. Where it goes is
        known before the 200: a name that neither discovery nor DNS knows is answered 502."""
        head = await tunnel.read_head(accepted, self._conns.limits.header_read_timeout)
        if head is None:
            accepted.sock.close()
            return
        if isinstance(head, RouteError):
            self._refuse_tunnel(accepted, head)
            return
        literal = by_literal(head, self.self_targets, accepted.local[0])
        if isinstance(literal, RouteError):  # the proxy's own ports, however spelt
            self._refuse_tunnel(accepted, literal)
            return
        found = await self._mesh.existing(head) if self._mesh is not None else None
        if isinstance(found, RouteError):
            self._refuse_tunnel(accepted, found)
            return
        destination = found
        target = None
        if destination is None:
            routed = await by_authority(head, self.self_targets, accepted.local[0])
            if isinstance(routed, RouteError):
                self._refuse_tunnel(accepted, routed)
                return
            target = routed.addr
        if not tunnel.established(accepted.sock):
            accepted.sock.close()
            return
        inner = Accepted(accepted.sock, accepted.client, accepted.local, target,
                         asyncio.get_running_loop().time())  # fmt: skip
        if destination is None:
            await self.handle(inner)  # as a connection redirected to `target`
            return
        async with destination.use():
            opaque = self._opaque(destination.port, destination)
            await self._serve(Logical(OrigDst(inner, None, head), destination, opaque))

    def _refuse_tunnel(self, accepted: Accepted, error: RouteError) -> None:
        self._conns.metrics.fail_fast_total.labels(DIRECTION, "connect").inc()
        log.info("CONNECT from %s refused: %s", accepted.client, error.reason)
        tunnel.answer(accepted.sock, error)

    def _opaque(self, port: int, destination: Destination | None) -> bool:
        profile = destination.profile if destination is not None else None
        return port in self._opaque_ports or bool(profile and profile.opaque)

    async def _serve(self, logical: Logical, detected: Detected | None = None) -> None:
        """`detected`: the protocol, when it was detected before (for a connection that was not
        redirected, to find a CONNECT)."""
        accepted, target = logical.orig.accepted, logical.orig.target
        conns = self._conns
        labels = conns.metrics.conn(
            DIRECTION, str(target) if target else logical.orig.tunneled or "authority",
            peer=str(accepted.client),
        )  # fmt: skip
        async with conns.counted(labels) as tcp:
            if logical.opaque:
                await conns.relay(accepted, self._endpoints(logical), labels, tcp)
                return
            if detected is None:
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
                port = target[1] if target else (logical.destination.port
                                                  if logical.destination else None)  # fmt: skip
                conns.detect_timed_out(DIRECTION, self._timeout, port)
            if target is None and logical.destination is None:
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
        fixed = FixedPicker(Endpoint(target, str(target))) if target is not None else None
        if logical.destination is None or self._mesh is None:
            assert fixed is not None
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
