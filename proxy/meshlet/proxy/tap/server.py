"""Linkerd's `io.linkerd.proxy.tap.Tap/Observe` on the proxy's control port, over mTLS.

The server presents the proxy's own certificate and verifies the client's against the trust
anchors (a certificate that does not verify fails the handshake). It answers one client
identity, the tap controller's (`allowed`): another verified identity gets PERMISSION_DENIED, a
client that sent no certificate UNAUTHENTICATED. Each call opens one tap (taps.py:
RESOURCE_EXHAUSTED past the proxy's most taps, INVALID_ARGUMENT for a malformed match) and
streams its events until its limit is reached or the client goes away; the tap is closed
either way.

grpclib, as the proxy's own gRPC clients: it runs on the proxy's loop (uvloop), with no
threads. The listening socket is bound with the others; the server starts once the proxy holds
a certificate, and a renewed certificate serves new connections from then on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import weakref
from typing import TYPE_CHECKING, Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from meshlet.api import tap_pb2
from meshlet.api.tap_grpc import TapBase
from meshlet.proxy.tap.match import InvalidMatch, compile_match
from meshlet.proxy.tap.taps import Taps, TooManyTaps

if TYPE_CHECKING:
    from meshlet.proxy.identity.manager import IdentityManager

log = logging.getLogger(__name__)

ObserveStream = Stream[tap_pb2.ObserveRequest, tap_pb2.TapEvent]


def peer_identity(cert: dict[str, Any] | None) -> str | None:
    """The DNS SAN of a verified client certificate (`getpeercert()`), or None."""
    if not cert:
        return None
    for entry in cert.get("subjectAltName", ()):
        if isinstance(entry, tuple) and entry[0] == "DNS":
            return str(entry[1])
    return None


def wants_headers(request: tap_pb2.ObserveRequest) -> bool:
    extract = request.extract
    return extract.WhichOneof("extract") == "http" and (
        extract.http.WhichOneof("extract") == "headers"
    )


class TapService(TapBase):
    def __init__(self, taps: Taps, allowed: str) -> None:
        self.taps = taps
        self.allowed = allowed

    async def Observe(self, stream: ObserveStream) -> None:
        request = await stream.recv_message()
        client = peer_identity(stream.peer.cert())
        if client is None:
            raise GRPCError(Status.UNAUTHENTICATED, "tap needs a client certificate")
        if client != self.allowed:
            raise GRPCError(Status.PERMISSION_DENIED, f"{client} may not tap this proxy")
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no ObserveRequest")
        try:
            match = compile_match(request.match)
        except InvalidMatch as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        try:
            tap = self.taps.add(match, request.limit, wants_headers(request))
        except TooManyTaps as exc:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
        queued = asyncio.Event()
        tap.wake = queued.set
        try:
            while True:
                while tap.events:
                    await stream.send_message(tap.events.popleft())
                if tap.done:
                    return
                queued.clear()
                if not tap.events:
                    await queued.wait()
        finally:
            tap.wake = None
            self.taps.remove(tap)


class TapServer:
    """The control port's gRPC server (Tap), started once the proxy holds a certificate."""

    def __init__(
        self, sock: socket.socket, taps: Taps, identity: IdentityManager, allowed: str
    ) -> None:
        self.sock = sock
        self.identity = identity
        self.allowed = allowed
        self.server = Server([TapService(taps, allowed)])
        # Every connection the server made, aborted at shutdown: grpclib's close ends calls, not
        # connections, and a connection left open outlives the proxy's loop.
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        made = self.server._protocol_factory

        def tracked() -> Any:
            protocol = made()
            self._protocols.add(protocol)
            return protocol

        self.server._protocol_factory = tracked  # type: ignore[method-assign]
        self._certified = asyncio.Event()
        identity.on_change(self._certified.set)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def _context(self) -> ssl.SSLContext:
        """The current certificate's context, switched to at each handshake (after a renewal,
        new connections get the new certificate)."""
        context = self.identity.control_context()

        def current(conn: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            conn.context = self.identity.control_context()

        context.sni_callback = current
        return context

    async def run(self) -> None:
        """Serves until cancelled."""
        try:
            while not self.identity.ready:
                self._certified.clear()
                await self._certified.wait()
        except asyncio.CancelledError:
            self.sock.close()
            raise
        await self.server.start(sock=self.sock, ssl=self._context())
        log.info("tap: serving on %s:%d for %s", *self.address, self.allowed)
        try:
            await asyncio.Future()
        finally:
            self.server.close()
            for protocol in list(self._protocols):
                connection = getattr(protocol, "connection", None)
                if connection is not None:
                    connection._transport.abort()
            await self.server.wait_closed()
