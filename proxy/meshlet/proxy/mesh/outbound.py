"""The client side of the mesh transport: mutual TLS to a peer proxy, then the transport header.

`mesh_connect` makes a `Connect` (http/contract.py) for one meshed endpoint. The caller passes
the endpoint's proxy address, `(endpoint_ip, opaque_transport.inbound_port)`; the connector
opens TCP, then TLS 1.3 with SNI = the server's identity, our certificate and ALPN
`transport.l5d.io/v1`, checks that the server's verified identity (its DNS SAN) is the one
discovery named and that ALPN was negotiated, writes the transport header `{port, name,
session_protocol}` and hands the transport to the caller's protocol, for which it is then a
plain connection. It fails closed, never plaintext: a failed handshake or check closes the
connection and raises `MeshConnectError` (its `reason` a bounded `Refusal` to count); a slow
peer raises `TimeoutError` and an unreachable one `OSError`, as the plain TCP connector does.

TLS 1.3 only: the client context (tls/contexts.py) refuses anything older, and the session is
checked again here. With TLS 1.3 the server verifies our certificate after our side of the
handshake is done, so a server refusing us shows as the connection closing, not as an error here.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Final, cast

from meshlet.api import transport_header
from meshlet.api.transport_header import Header, SessionProtocol
from meshlet.proxy.http.contract import Addr, Connect
from meshlet.proxy.mesh.refusal import Refusal, check_session, classify_tls_error, describe
from meshlet.proxy.tls.contexts import peer_identity
from meshlet.proxy.tls.transport import tls_connect

log = logging.getLogger(__name__)

# uvloop's own handshake timeout (a ConnectionAbortedError) only backs up ours (a TimeoutError).
_BACKSTOP: Final = 1.0


class MeshConnectError(ConnectionError):
    """A mesh connection refused by this side: the peer's certificate or session failed a check.
    The connection was closed; nothing was sent in plaintext."""

    def __init__(self, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def mesh_connect(
    client_context: ssl.SSLContext,
    server_identity: str,
    target_port: int,
    session: SessionProtocol,
    name: str = "",
    *,
    timeout: float = 1.0,
    source_ip: str | None = None,
) -> Connect:
    """A connector to the proxy of the endpoint whose identity is `server_identity`, asking it
    for `target_port` on its pod. `timeout` bounds the TCP connect and the handshake together.
    `source_ip`: the connections come from it (pods that share one host's loopback, where the
    kernel would pick 127.0.0.1 for all of them and the server could not tell them apart)."""
    header = transport_header.encode(Header(target_port, name, session))

    async def connect(
        addr: Addr, factory: Callable[[], asyncio.Protocol]
    ) -> tuple[asyncio.Transport, asyncio.Protocol]:
        return await _connect(addr, factory, client_context, server_identity, header, timeout,
                              source_ip)  # fmt: skip

    return connect


async def _connect(
    addr: Addr,
    factory: Callable[[], asyncio.Protocol],
    context: ssl.SSLContext,
    server_identity: str,
    header: bytes,
    budget: float,
    source_ip: str | None = None,
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    """Connects within `budget` seconds (TCP and TLS together)."""
    loop = asyncio.get_running_loop()
    where = str(addr)
    sock = socket.socket(socket.AF_INET6 if ":" in addr.host else socket.AF_INET)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if source_ip is not None and (":" in source_ip) == (":" in addr.host):
            sock.bind((source_ip, 0))
        async with asyncio.timeout(budget) as deadline:
            await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    session = _Session(server_identity, header, factory)
    try:
        # From here the socket is uvloop's: it closes it on failure and on cancellation.
        async with asyncio.timeout_at(deadline.when()):
            transport, _ = await tls_connect(
                sock, context, server_identity, lambda: session,
                handshake_timeout=budget + _BACKSTOP,
            )  # fmt: skip
    except TimeoutError:
        raise TimeoutError(
            f"TLS handshake with {server_identity} at {where} timed out after {budget}s"
        ) from None
    except OSError as exc:  # ssl.SSLError included
        raise _refused(classify_tls_error(exc), server_identity, where, describe(exc)) from exc
    if session.refusal is not None:
        raise _refused(session.refusal, server_identity, where, session.detail)
    assert session.inner is not None
    return transport, session.inner


def _refused(reason: Refusal, server_identity: str, where: str, detail: str) -> MeshConnectError:
    message = f"mTLS to {server_identity} at {where} refused ({reason.value}): {detail}"
    log.warning("%s; %s", message, reason.hint)
    return MeshConnectError(reason, message)


class _Session(asyncio.Protocol):
    """Checks the session the moment the handshake completes; if it holds, writes the transport
    header and hands the transport over to the caller's protocol before any byte is read."""

    def __init__(
        self, server_identity: str, header: bytes, factory: Callable[[], asyncio.Protocol]
    ) -> None:
        self._server_identity = server_identity
        self._header = header
        self._factory = factory
        self.inner: asyncio.Protocol | None = None
        self.refusal: Refusal | None = None
        self.detail = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        ssl_object = cast(ssl.SSLObject | None, tls.get_extra_info("ssl_object"))
        if ssl_object is None:
            self._refuse(tls, Refusal.HANDSHAKE_FAILED, "the connection has no TLS session")
            return
        version, alpn = ssl_object.version(), ssl_object.selected_alpn_protocol()
        server_id = peer_identity(ssl_object)
        refusal = check_session(version, alpn, server_id, self._server_identity)
        if refusal is not None:
            detail = (
                f"negotiated {version}, ALPN {alpn!r}, server identity {server_id!r}; "
                f"expected TLSv1.3, ALPN 'transport.l5d.io/v1', identity {self._server_identity!r}"
            )
            self._refuse(tls, refusal, detail)
            return
        tls.write(self._header)
        inner = self.inner = self._factory()
        tls.set_protocol(inner)
        inner.connection_made(tls)

    def _refuse(self, transport: asyncio.Transport, reason: Refusal, detail: str) -> None:
        self.refusal, self.detail = reason, detail
        transport.abort()
