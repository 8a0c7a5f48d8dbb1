"""The server side of the mesh transport: terminates mutual TLS addressed to this proxy and reads
the transport header.

`MeshInbound.accept` takes an accepted connection whose first bytes are a TLS ClientHello (still
in the socket: detection only peeks) and answers one of:

- `PassThrough(sni)`: the hello names someone else (or is not a well-formed hello); nothing was
  read, and the app relays the connection as opaque TCP to its original destination;
- `Terminated`: the hello named our identity; TLS 1.3 was terminated with a client certificate
  verified against the trust anchors, ALPN `transport.l5d.io/v1`, and the transport header was
  read. It carries the header, the client's identity and the target (the pod's own IP, the
  header's port); reading is paused until `adopt` hands it to the next protocol (it is an
  `http.contract.Handoff`): HTTP/1 → `serve_h1`, HTTP/2 → `serve_h2`, each with
  `add_headers=[(b"meshlet-client-id", client_id)]`, opaque → `relay` here;
- `Refused(reason, detail)`: the connection was closed, and logged with what to check; the app
  counts `reason.value`. Handshake failures (a certificate from other anchors, expired, not yet
  valid, none at all, TLS below 1.3), a session without the mesh ALPN, a stalled hello,
  handshake or header, bytes that are not a transport header, a header naming one of the
  proxy's own ports.

One `timeout` (the inbound detect timeout) bounds the hello, the handshake and the header
together; the header is bounded in size by `transport_header.MAX_HEADER_SIZE`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, cast

from meshlet.api import transport_header
from meshlet.api.transport_header import Header, Incomplete, SessionProtocol, TransportHeaderError
from meshlet.proxy.core import sni
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.http.contract import Addr, Connect, Shedder
from meshlet.proxy.io import relay as relay_sides
from meshlet.proxy.io.counters import TcpConn
from meshlet.proxy.io.listener import Accepted
from meshlet.proxy.io.sockets import peer_closed
from meshlet.proxy.mesh.refusal import Refusal, check_session, classify_tls_error, describe
from meshlet.proxy.tls.contexts import peer_identity
from meshlet.proxy.tls.transport import tls_accept

log = logging.getLogger(__name__)

_FIRST_PEEK: Final = 2048  # most ClientHellos fit; a larger one is peeked again at its size
_REPEEK_FIRST: Final = 0.001
_REPEEK_MAX: Final = 0.05
# uvloop's own handshake timeout (a ConnectionAbortedError) only backs up ours (a TimeoutError).
_BACKSTOP: Final = 1.0
# What a session terminated by `accept_direct` carries, by its ALPN.
_ALPN_PROTOCOLS: Final = {"h2": SessionProtocol.HTTP2, "http/1.1": SessionProtocol.HTTP1}


@dataclass(frozen=True, slots=True)
class PassThrough:
    """TLS for someone else: `sni` is the name asked for (None: none, or not a ClientHello)."""

    sni: str | None


@dataclass(frozen=True, slots=True)
class Refused:
    """The connection was closed; `reason` is the metric label, `detail` what happened."""

    reason: Refusal
    detail: str


@dataclass(frozen=True, slots=True, eq=False)
class Terminated:
    """A mesh connection, TLS terminated and its transport header read, reading paused."""

    transport: asyncio.Transport
    header: Header
    client_id: str
    target: Addr  # the pod's own IP and the header's port
    initial: bytes  # read past the header: the first bytes for the next protocol
    _reader: _HeaderReader = field(repr=False)

    def adopt(self, protocol: asyncio.Protocol) -> None:
        """Hands the connection to `protocol` (see `http.contract.Handoff`)."""
        self._reader.hand_over(protocol, self.initial)

    async def sniff(self, enough: Callable[[bytes], bool], give_up_after: float) -> bytes:
        """The session's first bytes: reads on until `enough(bytes)`, the client closes, or
        `give_up_after` seconds pass, then pauses again. Nothing is consumed: `adopt` replays
        them."""
        return await self._reader.sniff(self.initial, enough, give_up_after)

    def close(self) -> None:
        """Aborts the connection (e.g. when its target cannot be reached)."""
        self.transport.abort()


Outcome = Terminated | PassThrough | Refused


class MeshInbound:
    """Terminates mesh connections for `local_identity`. `server_context` should demand a client
    certificate (`contexts.server_context(..., require_client_cert=True)`); a session without a
    client identity is refused either way."""

    def __init__(
        self,
        server_context: ssl.SSLContext,
        local_identity: str,
        self_targets: SelfTargets,
        timeout: float,
    ) -> None:
        self._context = server_context
        self._identity = local_identity
        self._self = self_targets
        self._timeout = timeout

    async def accept(self, accepted: Accepted) -> Outcome:
        """Decides a connection whose first bytes are a ClientHello (see the module docstring).
        `PassThrough` leaves the socket untouched; `Refused` has closed it; `Terminated` owns it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        decided = await self._hello_for_us(accepted, deadline)
        return decided if decided is not None else await self._terminate(accepted, deadline)

    async def accept_direct(
        self, accepted: Accepted, context: ssl.SSLContext
    ) -> Terminated | PassThrough | Refused:
        """TLS addressed to us on one of the pod's own ports, without the transport header: what
        a proxy sends a meshed controller (its gRPC client verifies the controller's identity,
        as Linkerd's proxies do). Terminated when the hello names our identity, with TLS 1.3,
        ALPN h2, http/1.1 or none, and a client certificate verified when one is sent (the
        client's identity is then `client_id`, else ""); the session's protocol is the ALPN's
        (none: opaque, which the stack detects). PassThrough when the hello names another
        name: the app's own TLS, relayed untouched. The hello and the handshake must be done
        within the timeout of the accept (the detection's window: the stack peeked already)."""
        deadline = accepted.deadline(self._timeout)
        decided = await self._hello_for_us(accepted, deadline)
        if decided is not None:
            return decided
        port = accepted.target.port
        reader = _HeaderReader(asyncio.get_running_loop(), Header(port))
        transport = await self._handshake(accepted, context, reader, deadline)
        if isinstance(transport, Refused):
            return transport
        ssl_object = cast(ssl.SSLObject, transport.get_extra_info("ssl_object"))
        version, alpn = ssl_object.version(), ssl_object.selected_alpn_protocol()
        if version != "TLSv1.3":
            transport.abort()
            reader.discard()
            return _refused(accepted, Refusal.TLS_VERSION, f"negotiated {version}")
        protocol = _ALPN_PROTOCOLS.get(alpn or "", SessionProtocol.OPAQUE)
        header = Header(port, protocol=protocol)
        client_id = peer_identity(ssl_object) or ""
        return Terminated(transport, header, client_id, Addr(accepted.target.host, port), b"",
                          reader)  # fmt: skip

    async def _hello_for_us(
        self, accepted: Accepted, deadline: float
    ) -> PassThrough | Refused | None:
        """None when the (peeked) ClientHello names our identity; else what the connection is."""
        hello = await _peek_hello(accepted.sock, deadline)
        if isinstance(hello, Refusal):
            accepted.sock.close()
            why = {
                Refusal.CLOSED: "the client closed before its ClientHello was complete",
                Refusal.HELLO_TIMEOUT: f"no complete ClientHello within {self._timeout}s",
            }[hello]
            return _refused(accepted, hello, why)
        if isinstance(hello, sni.NotTls) or hello.name != self._identity:
            return PassThrough(None if isinstance(hello, sni.NotTls) else hello.name)
        return None

    async def _handshake(
        self, accepted: Accepted, context: ssl.SSLContext, reader: _HeaderReader, deadline: float
    ) -> asyncio.Transport | Refused:
        try:
            # From here the socket is uvloop's: it closes it on failure and on cancellation.
            async with asyncio.timeout_at(deadline):
                transport, _ = await tls_accept(
                    accepted.sock, context, lambda: reader,
                    handshake_timeout=self._timeout + _BACKSTOP,
                )  # fmt: skip
        except TimeoutError:
            why = f"the TLS handshake did not complete within {self._timeout}s"
            return _refused(accepted, Refusal.HANDSHAKE_TIMEOUT, why)
        except OSError as exc:  # ssl.SSLError included
            return _refused(
                accepted, classify_tls_error(exc), f"TLS handshake failed: {describe(exc)}"
            )
        return transport

    async def _terminate(self, accepted: Accepted, deadline: float) -> Outcome:
        reader = _HeaderReader(asyncio.get_running_loop())
        transport = await self._handshake(accepted, self._context, reader, deadline)
        if isinstance(transport, Refused):
            return transport
        try:
            return await self._session(accepted, transport, reader, deadline)
        except BaseException:
            transport.abort()
            reader.discard()
            raise

    async def _session(
        self,
        accepted: Accepted,
        transport: asyncio.Transport,
        reader: _HeaderReader,
        deadline: float,
    ) -> Outcome:
        ssl_object = cast(ssl.SSLObject, transport.get_extra_info("ssl_object"))
        version, alpn = ssl_object.version(), ssl_object.selected_alpn_protocol()
        client_id = peer_identity(ssl_object)
        refusal = check_session(version, alpn, client_id, None)
        if refusal is not None or client_id is None:  # (no identity is a refusal: for mypy)
            refusal = refusal or Refusal.NO_CLIENT_CERTIFICATE
            why = f"negotiated {version}, ALPN {alpn!r}, client identity {client_id!r}"
            return self._close(accepted, transport, reader, refusal, why)
        try:
            async with asyncio.timeout_at(deadline):
                header, initial = await reader.header
        except TimeoutError:
            why = f"no transport header within {self._timeout}s of the ClientHello"
            return self._close(accepted, transport, reader, Refusal.HEADER_TIMEOUT, why)
        except TransportHeaderError as exc:
            return self._close(accepted, transport, reader, Refusal.BAD_HEADER, str(exc))
        except ConnectionError as exc:
            return self._close(accepted, transport, reader, Refusal.CLOSED, str(exc))
        target = Addr(accepted.target.host, header.port)
        local_ip = accepted.local.host
        if self._self.loops(Addr(local_ip, header.port), local_ip):  # any of our ports, on any IP
            why = f"the header asks for port {header.port}, one of the proxy's own"
            return self._close(accepted, transport, reader, Refusal.LOOP, why)
        return Terminated(transport, header, client_id, target, initial, reader)

    @staticmethod
    def _close(
        accepted: Accepted,
        transport: asyncio.Transport,
        reader: _HeaderReader,
        reason: Refusal,
        why: str,
    ) -> Refused:
        transport.abort()
        reader.discard()
        return _refused(accepted, reason, why)


def _refused(accepted: Accepted, reason: Refusal, why: str) -> Refused:
    level = logging.INFO if reason is Refusal.CLOSED else logging.WARNING
    log.log(level, "inbound mTLS from %s refused (%s): %s; %s", accepted.client, reason.value, why,
            reason.hint)  # fmt: skip
    return Refused(reason, why)


async def _peek_hello(sock: socket.socket, deadline: float) -> sni.Sni | sni.NotTls | Refusal:
    """Peeks (nothing is consumed) until the ClientHello is complete, or CLOSED / HELLO_TIMEOUT."""
    loop = asyncio.get_running_loop()
    size = _FIRST_PEEK
    delay = _REPEEK_FIRST
    while True:
        try:
            data = sock.recv(size, socket.MSG_PEEK)
        except BlockingIOError:
            data = None
        except OSError:  # reset
            return Refusal.CLOSED
        if data == b"":
            return Refusal.CLOSED
        if data is not None:
            result = sni.parse_sni(data)
            if not isinstance(result, sni.Incomplete):
                return result
            size = max(size, result.needed)
            if peer_closed(sock):  # a FIN behind a partial hello: peeking never shows it
                return Refusal.CLOSED
        left = deadline - loop.time()
        if left <= 0:
            return Refusal.HELLO_TIMEOUT
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, _REPEEK_MAX)


class _HeaderReader(asyncio.Protocol):
    """The TLS session's first protocol: reads the transport header, pauses reading, and later
    hands the connection over, with whatever arrived or happened in between."""

    def __init__(self, loop: asyncio.AbstractEventLoop, header: Header | None = None) -> None:
        self.header: asyncio.Future[tuple[Header, bytes]] = loop.create_future()
        self._preset = header is not None  # no header on the wire: reading pauses at once
        if header is not None:
            self.header.set_result((header, b""))
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._next: asyncio.Protocol | None = None
        self._late = bytearray()  # read after the header, before the hand-over
        self._eof = False
        self._lost = False
        self._lost_exc: Exception | None = None
        self._arrived: asyncio.Event | None = None  # set while `sniff` waits for bytes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if self._preset:
            self._transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        if self._next is not None:
            self._next.data_received(data)
            return
        if self.header.done():
            self._late += data
            self._wake()
            return
        self._buf += data
        try:
            decoded = transport_header.decode(self._buf)
        except TransportHeaderError as exc:
            self.header.set_exception(exc)
            return
        if isinstance(decoded, Incomplete):
            return
        assert self._transport is not None
        self._transport.pause_reading()
        initial = bytes(self._buf[decoded.consumed :])
        self._buf = bytearray()
        self.header.set_result((decoded.header, initial))

    def eof_received(self) -> bool | None:
        if self._next is not None:
            return self._next.eof_received()
        if not self.header.done():
            self._fail("the client closed before sending the transport header")
            return False
        self._eof = True
        self._wake()
        return True  # passed on at the hand-over

    def connection_lost(self, exc: Exception | None) -> None:
        if self._next is not None:
            self._next.connection_lost(exc)
            return
        if not self.header.done():
            self._fail(f"the connection was lost before the transport header: {exc}")
        self._lost, self._lost_exc = True, exc
        self._wake()

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()

    async def sniff(
        self, initial: bytes, enough: Callable[[bytes], bool], give_up_after: float
    ) -> bytes:
        """See `Terminated.sniff`."""
        transport = self._transport
        assert transport is not None and self._next is None
        arrived = self._arrived = asyncio.Event()
        if not self._lost:
            transport.resume_reading()
        try:
            async with asyncio.timeout(give_up_after):
                while not (enough(initial + self._late) or self._eof or self._lost):
                    arrived.clear()
                    await arrived.wait()
        except TimeoutError:
            pass
        finally:
            self._arrived = None
            if not self._lost:
                transport.pause_reading()
        return initial + bytes(self._late)

    def _fail(self, why: str) -> None:
        self.header.set_exception(ConnectionResetError(why))

    def discard(self) -> None:
        """The header is no longer awaited: retrieves or cancels it (no unhandled warnings)."""
        if not self.header.done():
            self.header.cancel()
        elif not self.header.cancelled():
            self.header.exception()

    def hand_over(self, protocol: asyncio.Protocol, initial: bytes) -> None:
        transport = self._transport
        assert transport is not None and self._next is None, "a connection is adopted once"
        self._next = protocol
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if not self._lost:
            transport.resume_reading()  # delivers nothing before this call returns
        data = initial + self._late if self._late else initial
        self._late = bytearray()
        if data:
            protocol.data_received(data)
        if self._eof and not protocol.eof_received():
            transport.close()
        if self._lost:
            protocol.connection_lost(self._lost_exc)


async def relay(
    terminated: Terminated,
    connect: Connect,
    client_tcp: TcpConn | None = None,
    upstream_tcp: TcpConn | None = None,
    guard: relay_sides.FirstBytesCheck | None = None,
    shedder: Shedder | None = None,
) -> None:
    """Relays an opaque mesh connection to its target until both sides close. Raises what
    `connect` raises (OSError, TimeoutError) when the target cannot be reached, after closing
    the mesh connection (the client proxy sees it closed). With `guard`, the client's first
    bytes are checked as `relay.CheckedSide` does. `upstream_tcp` is opened once connected.
    With `shedder`, the relay is registered for load shedding while it lives."""
    loop = asyncio.get_running_loop()
    client, upstream, done = relay_sides.pair(loop, client_tcp, guard, upstream_tcp)
    try:
        await connect(terminated.target, lambda: upstream)
    except BaseException:
        terminated.close()
        raise
    upstream.tcp.open()
    terminated.adopt(client)
    upstream.flush()
    client.flush()
    load = relay_sides.RelayLoad(client, upstream)
    if shedder is not None:
        shedder.add(load, "inbound")
    try:
        await done
    except asyncio.CancelledError:
        for side in (client, upstream):
            if side.transport is not None:
                side.transport.abort()
        raise
    finally:
        if shedder is not None:
            shedder.remove(load)
