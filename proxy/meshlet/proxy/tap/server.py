"""Linkerd's `io.linkerd.proxy.tap.Tap/Observe` on the proxy's control port, over mTLS, on the
proxy's own HTTP/2 engine.

Any pod can reach the control port (iptables does not redirect it), so who may call is
decided before anything else: the TLS handshake requires a client certificate that verifies
against the trust anchors (a client without one, or with one that does not verify, fails the
handshake within `handshake_timeout`), and right after it the certificate's identity is
checked (conn.py `admit`): only the tap controller's (`allowed`) is served; another identity's
calls are answered PERMISSION_DENIED from their heads, their messages never read. At most
`max_connections` connections are open at once, handshakes included: past that, a new
connection takes the place of the oldest one not proven to be the tap controller's (so that
no one can hold the port by keeping handshakes or refused connections open), or is closed
when every one is the controller's. Every bound is in `TapLimits` (conn.py), and docs/tap.md
lists them.

Each call (`Observe`) parses its one request message (at most `max_message` bytes), compiles its
match (tap/match.py: INVALID_ARGUMENT past its bounds), opens one tap (tap/taps.py:
RESOURCE_EXHAUSTED past the proxy's most taps) and streams its events until its limit is
reached or the client goes away; the tap is closed either way.

The listening socket is bound with the others; the server starts once the proxy holds a
certificate, and each handshake uses the certificate of the moment (a renewal serves new
connections).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import TYPE_CHECKING, Final

from google.protobuf.message import DecodeError

from meshlet.api import tap_pb2
from meshlet.api.cancellation import OwnCancellation
from meshlet.proxy.tap.conn import Refusals, TapConnection, TapLimits
from meshlet.proxy.tap.grpcwire import Refusal, Status
from meshlet.proxy.tap.match import InvalidMatch, compile_match
from meshlet.proxy.tap.taps import Tap, Taps, TooManyTaps
from meshlet.proxy.tls.transport import tls_accept

if TYPE_CHECKING:
    from meshlet.proxy.identity.manager import IdentityManager

log = logging.getLogger(__name__)

# accept() errors that pass (out of descriptors or memory, a client gone before it was taken).
_PASSING: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                             errno.ECONNABORTED, errno.EPROTO, errno.EPERM})  # fmt: skip


def wants_headers(request: tap_pb2.ObserveRequest) -> bool:
    extract = request.extract
    return extract.WhichOneof("extract") == "http" and (
        extract.http.WhichOneof("extract") == "headers"
    )


class Observe:
    """The Observe service: a call's request message in, the tap it opens out."""

    def __init__(self, taps: Taps) -> None:
        self.taps = taps

    def open(self, message: bytes) -> Tap | Refusal:
        try:
            request = tap_pb2.ObserveRequest.FromString(message)
        except DecodeError:
            return Refusal(Status.INVALID_ARGUMENT, "the request message is not an ObserveRequest")
        try:
            match = compile_match(request.match)
        except InvalidMatch as exc:
            return Refusal(Status.INVALID_ARGUMENT, str(exc))
        try:
            return self.taps.add(match, request.limit, wants_headers(request))
        except TooManyTaps as exc:
            return Refusal(Status.RESOURCE_EXHAUSTED, str(exc))

    def close(self, tap: Tap) -> None:
        self.taps.remove(tap)


class _Uncounted:
    def refused(self, reason: str) -> None:
        pass


class TapServer:
    """The control port's Tap server, started once the proxy holds a certificate."""

    def __init__(
        self,
        sock: socket.socket,
        taps: Taps,
        identity: IdentityManager,
        allowed: str,
        limits: TapLimits | None = None,
        counts: Refusals | None = None,
    ) -> None:
        self.sock = sock
        self.identity = identity
        self.allowed = allowed
        self.limits = limits or TapLimits()
        self.counts: Refusals = counts or _Uncounted()
        self.observe = Observe(taps)
        self.connections = 0  # open now, handshakes included
        # Connections not proven to be the tap controller's, oldest first: evicted for new ones.
        self._unproven: dict[asyncio.Task[None], None] = {}
        self._certified = asyncio.Event()
        identity.on_change(self._certified.set)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    async def run(self) -> None:
        """Serves until cancelled; then every connection is closed."""
        try:
            while not self.identity.ready:
                self._certified.clear()
                await self._certified.wait()
            log.info("tap: serving on %s:%d for %s", *self.address, self.allowed)
            async with asyncio.TaskGroup() as tasks:
                await self._accept(tasks)
        finally:
            self.sock.close()

    async def _accept(self, tasks: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        own = OwnCancellation()
        while True:
            try:
                sock, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                own.check()  # never accept again once cancelled, whatever the error says
                if exc.errno not in _PASSING:
                    raise
                log.warning("tap: accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if self.connections >= self.limits.max_connections and not self._evict():
                sock.close()
                self.counts.refused("busy")
                continue
            sock.setblocking(False)
            self.connections += 1
            task = tasks.create_task(self._serve(sock))
            self._unproven[task] = None

    def _evict(self) -> bool:
        """Makes room for a new connection by closing the oldest one not yet proven to be the
        tap controller's (a handshake under way, or another identity's): flooders push each
        other out, and the tap controller, proven within its handshake, always gets in."""
        if not self._unproven:
            return False
        oldest = next(iter(self._unproven))
        del self._unproven[oldest]
        oldest.cancel()
        self.counts.refused("busy")
        return True

    async def _serve(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        conn: TapConnection | None = None
        try:
            limits = self.limits
            _, conn = await tls_accept(
                sock, self.identity.control_context(),
                lambda: TapConnection(self.observe, self.allowed, limits, self.counts),
                handshake_timeout=limits.handshake_timeout,
            )  # fmt: skip
            if conn.refusal is None and task is not None:
                self._unproven.pop(task, None)  # the tap controller's: never evicted
            await conn.done
        except (OSError, TimeoutError) as exc:  # ssl.SSLError included: no or a bad certificate
            self.counts.refused("handshake")
            log.debug("tap: handshake refused: %r", exc)
        except Exception:  # a bug: this connection ends, the server goes on
            log.exception("tap: a connection failed")
        finally:
            self.connections -= 1
            if task is not None:
                self._unproven.pop(task, None)
            if conn is not None:
                conn.abort()
