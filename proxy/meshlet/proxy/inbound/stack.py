"""The inbound stack: what happens to a connection for this pod, stage by stage.

accepted (io/listener)
  → to the inbound port itself: mutual TLS from another proxy, terminated
    (mesh/inbound.py: client certificate checked, transport header read) → Session, with
    the client's identity and the pod's port it asks for; otherwise a plain connection to
    one of the pod's ports (refused where identity is required)
  → detected: HTTP/1, HTTP/2 or opaque, from the first bytes; a mesh session's declared
    protocol is not trusted on ports that are not opaque: it is detected like any other
  → authorized by the port's policy (inbound/authz.py): opaque TCP once, before it is
    relayed (a port whose policy is opaque is not detected); HTTP and gRPC per request, by
    the connection's router
  → forwarded to the pod's own address at that port: HTTP through the engines (over mTLS
    with `meshlet-client-id` set from the verified certificate, any client-sent one
    removed), opaque TCP through the relay (guarded against HTTP that arrives after a
    silent start).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlet.api.ports import PortRanges
from meshlet.api.transport_header import SessionProtocol
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.authz import PortProtocol
from meshlet.proxy.core.detect import NEED_MORE, PEEK_BYTES, Protocol, detect
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.fixed_router import FixedPicker, FixedRouter
from meshlet.proxy.http.contract import CLIENT_ID_HEADER, Addr, Endpoint, Router
from meshlet.proxy.inbound.authz import InboundPolicy, PolicyRouter, client_of
from meshlet.proxy.io import relay
from meshlet.proxy.io.counters import ConnLabels, TcpConn
from meshlet.proxy.io.listener import Accepted, first_byte, peek_protocol

if TYPE_CHECKING:
    from meshlet.proxy.identity.manager import IdentityManager
    from meshlet.proxy.mesh.inbound import Terminated

log = logging.getLogger(__name__)
DIRECTION = "inbound"
_TLS_HANDSHAKE = b"\x16"  # a TLS record of type handshake: a ClientHello begins so


@dataclass(frozen=True, slots=True)
class Session:
    """A terminated mesh connection: who the client is and which of the pod's ports it asks."""

    terminated: Terminated
    client_id: str
    target: Addr


@dataclass(frozen=True, slots=True)
class Forward:
    """A detected connection, bound for `target` on the pod."""

    protocol: SessionProtocol
    target: Addr
    guard: relay.FirstBytesCheck | None  # for opaque TCP whose client sent nothing at first


class InboundStack:
    def __init__(
        self,
        connections: Connections,
        identity: IdentityManager | None,
        *,
        port: int,
        self_targets: SelfTargets,
        detect_timeout: float,
        opaque_ports: PortRanges,
        require_identity: PortRanges,
        policy: InboundPolicy | None = None,
    ) -> None:
        self._conns = connections
        self._policy = policy  # None: every client is allowed
        self._identity = identity
        self._timeout = detect_timeout
        self._opaque_ports = opaque_ports
        self._require_identity = require_identity
        self.self_targets = self_targets  # the proxy's own ports, as bound
        self.port = port  # the inbound listener's port, as bound: mesh traffic

    async def handle(self, accepted: Accepted) -> None:
        target = accepted.target
        if target[1] == self.port:
            await self._mesh(accepted)
            return
        if target[1] in self._require_identity:
            self._conns.refuse(accepted, DIRECTION, "identity_required",
                               f"port {target[1]} accepts only meshed (mTLS) clients")  # fmt: skip
            return
        if self.self_targets.loops(target, accepted.local[0]):
            self._conns.refuse(accepted, DIRECTION, "loop",
                               f"{target} is the proxy's own port")  # fmt: skip
            return
        if await self._tls_for_us(accepted, target):
            await self._direct(accepted, target)
            return
        await self._plain(accepted, target)

    # -- plain connections to one of the pod's ports ------------------------------------------

    async def _plain(self, accepted: Accepted, target: Addr) -> None:
        conns = self._conns
        labels = conns.metrics.conn(DIRECTION, str(target), peer=_peer(accepted))
        async with conns.counted(labels) as tcp:
            forward = await self._detect_plain(accepted, target)
            if forward is None:
                return
            if forward.protocol is SessionProtocol.OPAQUE:
                if not self._tcp_allowed(accepted.client[0], None, target, labels):
                    accepted.sock.close()
                    return
                endpoint = Endpoint(target, str(target))
                await conns.relay(accepted, FixedPicker(endpoint), labels, tcp, forward.guard)
                return
            h2 = forward.protocol is SessionProtocol.HTTP2
            router = self._router(accepted.client[0], None, target, labels)
            await conns.http(h2, router, labels, tcp, accepted=accepted)

    def _router(self, ip: str, client_id: str | None, target: Addr, labels: ConnLabels) -> Router:
        fixed = FixedRouter(target, self._conns.metrics)
        if self._policy is None:
            return fixed
        client = client_of(ip, client_id, client_id is not None)
        return PolicyRouter(fixed, self._policy, client, target[1], labels)

    def _tcp_allowed(
        self, ip: str, client_id: str | None, target: Addr, labels: ConnLabels
    ) -> bool:
        if self._policy is None:
            return True
        client = client_of(ip, client_id, client_id is not None)
        return self._policy.connection(client, target[1], labels)

    def _opaque_by_policy(self, port: int) -> bool:
        if self._policy is None:
            return False
        return self._policy.policies(port).protocol in (PortProtocol.OPAQUE, PortProtocol.TLS)

    async def _detect_plain(self, accepted: Accepted, target: Addr) -> Forward | None:
        if target[1] in self._opaque_ports or self._opaque_by_policy(target[1]):
            return Forward(SessionProtocol.OPAQUE, target, None)
        detected = await peek_protocol(accepted, self._timeout)
        if detected is None:
            accepted.sock.close()
            return None
        if detected.protocol is Protocol.HTTP1:
            return Forward(SessionProtocol.HTTP1, target, None)
        if detected.protocol is Protocol.HTTP2:
            return Forward(SessionProtocol.HTTP2, target, None)
        guard = None
        if detected.timed_out:
            self._conns.detect_timed_out(DIRECTION, self._timeout, target[1])
            if not detected.first_bytes:
                client = str(accepted.client)
                guard = self._conns.late_http_check(client, target[1], self._timeout)
        return Forward(SessionProtocol.OPAQUE, target, guard)

    # -- TLS for this proxy's identity on one of the pod's ports -------------------------------

    async def _tls_for_us(self, accepted: Accepted, target: Addr) -> bool:
        """Whether the connection may be TLS addressed to this proxy: it has a certificate,
        the port is not opaque (an opaque port's TLS is the app's, relayed untouched) and the
        client's first byte opens a TLS handshake record."""
        identity = self._identity
        if identity is None or not identity.ready or target[1] in self._opaque_ports:
            return False
        if self._opaque_by_policy(target[1]):
            return False
        return await first_byte(accepted, self._timeout) == _TLS_HANDSHAKE

    async def _direct(self, accepted: Accepted, target: Addr) -> None:
        """TLS whose hello names this proxy's identity, sent straight to the pod's port (a
        proxy calling a meshed controller): terminated here, then detected, authorized and
        forwarded as a mesh session is, with the client's identity when it proved one. TLS for
        any other name is the app's own: relayed as it came."""
        from meshlet.proxy.mesh.inbound import MeshInbound, Refused, Terminated

        conns = self._conns
        identity = self._identity
        assert identity is not None
        mesh = MeshInbound(identity.server_context(), identity.local_name, self.self_targets,
                           self._timeout)  # fmt: skip
        outcome = await mesh.accept_direct(accepted, identity.direct_context())
        if isinstance(outcome, Refused):
            conns.metrics.fail_fast_total.labels(DIRECTION, outcome.reason.value).inc()
            return
        if not isinstance(outcome, Terminated):
            await self._plain(accepted, target)  # the app's TLS: nothing was read
            return
        await self._serve_session(accepted, Session(outcome, outcome.client_id, target))

    # -- mutual TLS from another proxy --------------------------------------------------------

    async def _mesh(self, accepted: Accepted) -> None:
        from meshlet.proxy.mesh.inbound import MeshInbound, PassThrough, Refused

        conns = self._conns
        identity = self._identity
        if identity is None or not identity.ready:
            why = "a mesh connection arrived before this proxy has a certificate"
            conns.refuse(accepted, DIRECTION, "no_identity", why)
            return
        mesh = MeshInbound(identity.server_context(), identity.local_name, self.self_targets,
                           self._timeout)  # fmt: skip
        outcome = await mesh.accept(accepted)
        if isinstance(outcome, Refused):
            conns.metrics.fail_fast_total.labels(DIRECTION, outcome.reason.value).inc()
            return
        if isinstance(outcome, PassThrough):
            conns.refuse(accepted, DIRECTION, "not_our_identity",
                         f"TLS for {outcome.sni!r} reached the inbound port")  # fmt: skip
            return
        await self._serve_session(accepted, Session(outcome, outcome.client_id, outcome.target))

    async def _serve_session(self, accepted: Accepted, session: Session) -> None:
        """A terminated TLS session: counted under the client's identity, detected, authorized
        by the port's policy and forwarded; HTTP carries `meshlet-client-id` when the client
        proved an identity (a session terminated by `_direct` may have none: "")."""
        conns = self._conns
        target = session.target
        client_id = session.client_id or None
        labels = conns.metrics.conn(
            DIRECTION, str(target), tls="true", no_tls_reason="",
            client_id=session.client_id, peer=_peer(accepted),
        )  # fmt: skip
        async with conns.counted(labels) as tcp:
            forward = await self._detect_session(session)
            if forward.protocol is SessionProtocol.OPAQUE:
                if not self._tcp_allowed(accepted.client[0], client_id, target, labels):
                    session.terminated.close()
                    return
                await self._relay_session(session, forward, tcp)
                return
            headers = ((CLIENT_ID_HEADER, client_id.encode()),) if client_id else ()
            await conns.http(
                forward.protocol is SessionProtocol.HTTP2,
                self._router(accepted.client[0], client_id, target, labels),
                labels,
                tcp,
                handoff=session.terminated,
                add_headers=headers,
                from_proxy=client_id is not None,
            )

    async def _detect_session(self, session: Session) -> Forward:
        """The client proxy's word (the transport header) is not enough: a session declared
        opaque to a port that is not opaque here is detected, so that HTTP cannot reach the
        app without the HTTP defences and with a `meshlet-client-id` of the client's own."""
        declared = session.terminated.header.protocol
        target = session.target
        if self._opaque_by_policy(target[1]):
            return Forward(SessionProtocol.OPAQUE, target, None)
        if declared is not SessionProtocol.OPAQUE or target[1] in self._opaque_ports:
            return Forward(declared, target, None)
        first = await session.terminated.sniff(_decided, self._timeout)
        protocol = detect(first, final=True)
        if protocol is Protocol.HTTP1:
            return Forward(SessionProtocol.HTTP1, target, None)
        if protocol is Protocol.HTTP2:
            return Forward(SessionProtocol.HTTP2, target, None)
        guard = None
        if not first:
            self._conns.detect_timed_out(DIRECTION, self._timeout, target[1])
            guard = self._conns.late_http_check(session.client_id, target[1], self._timeout)
        return Forward(SessionProtocol.OPAQUE, target, guard)

    async def _relay_session(self, session: Session, forward: Forward, tcp: TcpConn) -> None:
        from meshlet.proxy.mesh.inbound import relay as mesh_relay

        app = self._conns.metrics.dst_conn(DIRECTION, session.target, None)
        try:
            await mesh_relay(session.terminated, self._conns.connect, tcp, app, forward.guard,
                             self._conns.shedder)  # fmt: skip
        except (OSError, TimeoutError) as exc:
            log.info("inbound: connect to %s failed: %s", session.target, exc)


def _decided(first: bytes) -> bool:
    return detect(first, final=len(first) >= PEEK_BYTES) is not NEED_MORE


def _peer(accepted: Accepted) -> str:
    return str(accepted.client)
