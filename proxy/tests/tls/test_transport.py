"""TLS that can half-close, between real sockets on 127.0.0.1 with mutual TLS 1.3 from the
project's test CA: what each side's protocol is told, in order, and the bytes byte-exact; the
same wire as uvloop's TLS, and the same handshake errors."""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca, signer
from meshlet.proxy.mesh.refusal import Refusal, classify_tls_error
from meshlet.proxy.tls import contexts
from meshlet.proxy.tls.transport import TlsTransport, TruncatedError, tls_accept, tls_connect

SERVER = wellknown.identity_name("db", "emojivoto")
CLIENT = wellknown.identity_name("web", "emojivoto")
WAIT = 5.0  # for any one thing to happen; a passing test waits far less
MiB = 1024 * 1024


def pattern(size: int) -> bytes:
    """Bytes whose order shows: a lost, doubled or swapped chunk changes them."""
    return os.urandom(size)


class Recorder(asyncio.Protocol):
    """Records what its transport delivers, as a transcript; `keep_open` is what
    eof_received answers. Nothing may be delivered while its reading is paused."""

    def __init__(self, keep_open: bool = True) -> None:
        self.keep_open = keep_open
        self.transport: Any = None
        self.data = bytearray()
        self.events: list[str] = []  # "eof", "lost", "lost: <Error>"
        self.writing: list[str] = []  # "pause", "resume": its transport's back-pressure
        self.exc: Exception | None = None
        self.delivered_while_paused = False
        self.on_data: Callable[[Recorder, bytes], None] | None = None
        self._changed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._check_reading()
        self.data += data
        if self.on_data is not None:
            self.on_data(self, data)
        self._changed.set()

    def eof_received(self) -> bool:
        self._check_reading()
        self._record("eof")
        return self.keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self.exc = exc
        self._record("lost" if exc is None else f"lost: {type(exc).__name__}")

    def pause_writing(self) -> None:
        self.writing.append("pause")

    def resume_writing(self) -> None:
        self.writing.append("resume")

    def _check_reading(self) -> None:
        if self.transport is not None and not self.transport.is_reading():
            self.delivered_while_paused = True

    def _record(self, event: str) -> None:
        self.events.append(event)
        self._changed.set()

    async def until(self, done: Callable[[], bool], what: str) -> None:
        """Waits (WAIT seconds at most) until `done()`."""
        try:
            async with asyncio.timeout(WAIT):
                while not done():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"no {what} within {WAIT}s; saw {self.events}") from None

    async def received(self, size: int) -> bytes:
        await self.until(lambda: len(self.data) >= size, f"{size} bytes")
        return bytes(self.data)

    async def closed(self) -> None:
        await self.until(lambda: any(e.startswith("lost") for e in self.events), "close")


class PausedAtOnce(Recorder):
    """Pauses reading as soon as it is connected (as the mesh inbound does until its
    hand-over)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.pause_reading()


@dataclass
class Side:
    transport: TlsTransport
    app: Recorder


@dataclass
class Mesh:
    """Two identities under the test CA and their mTLS contexts; connects pairs of sockets and
    aborts whatever is left open at the end."""

    server_context: ssl.SSLContext
    client_context: ssl.SSLContext
    anchors: str
    listener: socket.socket
    opened: list[socket.socket] = field(default_factory=list)
    transports: list[asyncio.BaseTransport] = field(default_factory=list)

    async def sockets(self) -> tuple[socket.socket, socket.socket]:
        """(server, client): a connected pair of non-blocking TCP sockets."""
        loop = asyncio.get_running_loop()
        client = socket.socket()
        client.setblocking(False)
        self.opened.append(client)
        await loop.sock_connect(client, self.listener.getsockname())
        server, _ = await loop.sock_accept(self.listener)
        server.setblocking(False)
        self.opened.append(server)
        return server, client

    async def pair(
        self,
        server_app: Callable[[], Recorder] = Recorder,
        client_app: Callable[[], Recorder] = Recorder,
    ) -> tuple[Side, Side]:
        """(server, client) over TlsTransport."""
        server_sock, client_sock = await self.sockets()
        return await self.tls(server_sock, client_sock, server_app, client_app)

    async def pair_and_raw(self) -> tuple[Side, Side, socket.socket]:
        """(server, client, the client's raw socket, duplicated): the connection is not
        closed until both the client's transport and the duplicate are."""
        server_sock, client_sock = await self.sockets()
        raw = client_sock.dup()
        self.opened.append(raw)
        return (*await self.tls(server_sock, client_sock, Recorder, Recorder), raw)

    async def tls(
        self,
        server_sock: socket.socket,
        client_sock: socket.socket,
        server_app: Callable[[], Recorder],
        client_app: Callable[[], Recorder],
    ) -> tuple[Side, Side]:
        (server, server_proto), (client, client_proto) = await asyncio.gather(
            tls_accept(server_sock, self.server_context, server_app, handshake_timeout=WAIT),
            tls_connect(
                client_sock, self.client_context, SERVER, client_app, handshake_timeout=WAIT
            ),
        )
        self.transports += [server, client]
        return Side(server, server_proto), Side(client, client_proto)


@pytest.fixture
async def mesh(test_ca: Any, tmp_path: Path) -> AsyncIterator[Mesh]:
    server_chain, server_key = test_ca.serving_cert(SERVER, tmp_path / "server")
    client_chain, client_key = test_ca.serving_cert(CLIENT, tmp_path / "client")
    anchors = test_ca.anchors_pem
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    mesh = Mesh(
        contexts.server_context(server_chain, server_key, anchors, require_client_cert=True),
        contexts.client_context(client_chain, client_key, anchors),
        anchors,
        listener,
    )
    yield mesh
    for transport in mesh.transports:
        transport.abort()
    await asyncio.sleep(0)  # the aborted transports close their sockets
    for sock in mesh.opened:
        sock.close()
    listener.close()


def other_ca_leaf(name: str, directory: Path) -> tuple[Path, Path]:
    """(chain, key) for `name` from a CA the mesh does not trust."""
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    return signer.write_serving_files(
        ca.Issuer((issuer,), issuer_key, (anchor,)), name, directory, now, dt.timedelta(hours=1)
    )


def client_hello(context: ssl.SSLContext) -> bytes:
    sslobj = context.wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname=SERVER)
    with pytest.raises(ssl.SSLWantReadError):
        sslobj.do_handshake()
    return outgoing.read()


# -- bytes both ways --


async def test_a_request_and_its_response_both_ways(mesh: Mesh) -> None:
    server, client = await mesh.pair()
    client.transport.writelines([b"GET ", b"/ping", b"\n"])
    assert await server.app.received(10) == b"GET /ping\n"
    server.transport.write(b"pong\n")
    assert await client.app.received(5) == b"pong\n"
    server.transport.write(b"and a word from the server\n")  # either side may speak
    assert await client.app.received(32) == b"pong\nand a word from the server\n"
    assert server.app.events == client.app.events == []


async def test_the_client_half_closes_and_receives_the_whole_reply(mesh: Mesh) -> None:
    reply = pattern(8 * MiB)

    def answer(server: Recorder, data: bytes) -> None:
        if server.data == b"the whole request":
            assert server.transport.can_write_eof()

    server, client = await mesh.pair()
    server.app.on_data = answer
    client.transport.write(b"the whole request")
    client.transport.write_eof()  # close_notify, then FIN: `nc -N`
    assert not client.transport.is_closing()
    await server.app.until(lambda: server.app.events == ["eof"], "the client's close_notify")
    assert server.app.data == b"the whole request"
    server.transport.write(reply[: 3 * MiB])  # after the client's EOF, the reply still goes
    server.transport.writelines([reply[3 * MiB : 5 * MiB], reply[5 * MiB :]])
    server.transport.close()
    await client.app.closed()
    await server.app.closed()
    assert client.app.data == reply
    assert client.app.events == ["eof", "lost"]  # the server's close_notify, then a clean close
    assert server.app.events == ["eof", "lost"]


async def test_the_server_half_closes_first_and_the_client_keeps_sending(mesh: Mesh) -> None:
    upload = pattern(3 * MiB)
    server, client = await mesh.pair()
    server.transport.write(b"220 ready, send your data\n")
    server.transport.write_eof()
    await client.app.until(lambda: client.app.events == ["eof"], "the server's close_notify")
    assert client.app.data == b"220 ready, send your data\n"
    client.transport.write(upload)
    client.transport.write_eof()  # both directions done: the connection closes
    assert client.transport.is_closing()
    assert await server.app.received(len(upload)) == upload
    await server.app.closed()
    await client.app.closed()
    assert server.app.events == ["eof", "lost"]
    assert client.app.events == ["eof", "lost"]


async def test_writing_after_write_eof_is_an_error_and_after_close_nothing(mesh: Mesh) -> None:
    server, client = await mesh.pair()
    client.transport.write_eof()
    client.transport.write_eof()  # once is enough; again is nothing
    with pytest.raises(RuntimeError, match="write_eof"):
        client.transport.write(b"late")
    await server.app.until(lambda: server.app.events == ["eof"], "the client's close_notify")
    server.transport.close()
    server.transport.write(b"dropped, as asyncio's TLS transport drops it")
    await client.app.closed()
    assert client.app.data == b""
    assert client.app.events == ["eof", "lost"]


# -- closing --


async def test_an_app_that_answers_and_closes_inside_data_received(mesh: Mesh) -> None:
    def answer_and_close(server: Recorder, data: bytes) -> None:
        server.transport.write(b"HTTP/1.0 200 OK\r\n\r\nbye")
        server.transport.close()

    server, client = await mesh.pair()
    server.app.on_data = answer_and_close
    client.transport.write(b"GET / HTTP/1.0\r\n\r\n")
    client.transport.write_eof()  # most likely read with the request: never delivered
    await client.app.closed()
    await server.app.closed()
    assert client.app.data == b"HTTP/1.0 200 OK\r\n\r\nbye"
    assert client.app.events == ["eof", "lost"]
    assert server.app.events == ["lost"]


async def test_close_sends_close_notify_and_the_peer_sees_an_eof(mesh: Mesh) -> None:
    server, client = await mesh.pair(client_app=lambda: Recorder(keep_open=False))
    server.transport.write(b"bye")
    server.transport.close()
    assert server.transport.is_closing()
    await client.app.closed()
    await server.app.closed()
    assert client.app.data == b"bye"
    assert client.app.events == ["eof", "lost"]  # not an error: the close was announced
    assert server.app.events == ["lost"]  # its close_notify went out before the peer's came


async def test_an_eof_received_answering_false_closes_with_close_notify(mesh: Mesh) -> None:
    server, client = await mesh.pair(server_app=lambda: Recorder(keep_open=False))
    client.transport.write_eof()
    await server.app.closed()
    await client.app.closed()
    assert server.app.events == ["eof", "lost"]
    assert client.app.events == ["eof", "lost"]  # the server's close_notify came back


async def test_abort_closes_at_once_and_the_peer_sees_no_eof(mesh: Mesh) -> None:
    server, client = await mesh.pair()
    client.transport.write(b"half a conversation")
    await server.app.received(19)
    client.transport.abort()
    assert client.transport.is_closing()
    await client.app.closed()
    await server.app.closed()
    assert client.app.events == ["lost"]
    assert server.app.events == ["lost: TruncatedError"]  # a FIN with no close_notify


async def test_a_truncated_session_is_an_error_never_an_eof(mesh: Mesh) -> None:
    server, client, raw = await mesh.pair_and_raw()
    client.transport.write(b"the first half of a message")
    await server.app.received(27)
    raw.shutdown(socket.SHUT_WR)  # a FIN with no close_notify before it
    await server.app.closed()
    assert server.app.events == ["lost: TruncatedError"]
    assert isinstance(server.app.exc, TruncatedError)
    assert server.app.exc.errno == errno.ECONNRESET  # counted as a reset
    assert server.app.data == b"the first half of a message"


async def test_a_corrupt_record_aborts_the_connection_with_the_tls_error(mesh: Mesh) -> None:
    server, _, raw = await mesh.pair_and_raw()
    raw.send(b"\x17\x03\x03\x00\x20" + bytes(32))  # application data that does not decrypt
    await server.app.closed()
    assert isinstance(server.app.exc, ssl.SSLError)
    assert server.app.exc.reason == "DECRYPTION_FAILED_OR_BAD_RECORD_MAC"
    assert server.app.events == ["lost: SSLError"]


# -- back-pressure and pausing --


async def test_a_paused_reader_bounds_the_writers_memory_and_resumes_losslessly(
    mesh: Mesh,
) -> None:
    payload = pattern(24 * MiB)
    chunk = 256 * 1024

    server, client = await mesh.pair(server_app=PausedAtOnce)
    client.transport.set_write_buffer_limits(high=256 * 1024, low=64 * 1024)
    writing = asyncio.Event()
    writing.set()
    client.app.pause_writing = writing.clear  # type: ignore[method-assign]
    client.app.resume_writing = writing.set  # type: ignore[method-assign]
    sent = 0
    while writing.is_set():  # until the kernel's buffers and then the plain transport's fill
        client.transport.write(payload[sent : sent + chunk])
        sent += chunk
        assert sent < len(payload), "the writer was never paused"
    assert client.transport.get_write_buffer_size() >= 256 * 1024
    assert sent <= 20 * MiB  # the kernels' buffers and one high-water mark, not the payload
    assert server.app.data == b""  # nothing delivered while paused

    async def write_the_rest() -> None:
        nonlocal sent
        while sent < len(payload):
            await writing.wait()
            client.transport.write(payload[sent : sent + chunk])
            sent += chunk
        client.transport.write_eof()

    server.transport.resume_reading()
    async with asyncio.timeout(WAIT):
        await write_the_rest()
    assert await server.app.received(len(payload)) == payload
    await server.app.until(lambda: server.app.events == ["eof"], "the close_notify")
    assert not server.app.delivered_while_paused


async def test_a_close_notify_read_while_paused_is_delivered_after_resuming(mesh: Mesh) -> None:
    def pause_and_ack(server: Recorder, data: bytes) -> None:
        server.transport.pause_reading()
        server.transport.write(b"ack")

    server, client = await mesh.pair()
    server.app.on_data = pause_and_ack
    client.transport.write(b"last words")
    client.transport.write_eof()  # its close_notify right behind, most likely in the same read
    await client.app.received(3)
    assert server.app.data == b"last words"
    assert server.app.events == []
    assert not server.transport.is_reading()
    server.transport.resume_reading()
    assert server.app.events == []  # nothing before resume_reading returns
    await server.app.until(lambda: server.app.events == ["eof"], "the held close_notify")
    assert not server.app.delivered_while_paused


class Eager(Recorder):
    """Writes the moment it is connected: its bytes follow the client's Finished at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.write(b"sent as the handshake ends")


async def test_bytes_sent_with_the_clients_finished_reach_the_server_at_once(mesh: Mesh) -> None:
    server, _ = await mesh.pair(client_app=Eager)
    assert await server.app.received(26) == b"sent as the handshake ends"


async def test_bytes_sent_with_the_clients_finished_wait_for_a_reader_paused_at_once(
    mesh: Mesh,
) -> None:
    server, _ = await mesh.pair(server_app=PausedAtOnce, client_app=Eager)
    assert server.app.data == b""
    server.transport.resume_reading()
    assert server.app.data == b""  # nothing before resume_reading returns
    assert await server.app.received(26) == b"sent as the handshake ends"
    assert not server.app.delivered_while_paused


# -- the handshake: the wire and the errors uvloop's TLS has --


async def test_alpn_and_the_peer_identity_are_read_from_ssl_object(mesh: Mesh) -> None:
    server, client, raw = await mesh.pair_and_raw()
    for side, peer in ((server, CLIENT), (client, SERVER)):
        ssl_object = side.transport.get_extra_info("ssl_object")
        assert ssl_object.version() == "TLSv1.3"
        assert ssl_object.selected_alpn_protocol() == wellknown.TRANSPORT_ALPN
        assert contexts.peer_identity(ssl_object) == peer
        assert side.transport.get_extra_info("peercert") == ssl_object.getpeercert()
    assert client.transport.get_extra_info("sockname") == raw.getsockname()
    assert server.transport.get_extra_info("peername") == raw.getsockname()
    assert client.transport.get_extra_info("socket").fileno() >= 0
    assert server.transport.get_extra_info("no such thing", "default") == "default"


async def test_a_client_against_uvloops_tls_server(mesh: Mesh) -> None:
    loop = asyncio.get_running_loop()
    accepted: list[Recorder] = []

    def app() -> Recorder:
        accepted.append(Recorder(keep_open=False))
        return accepted[-1]

    uvloop_server = await loop.create_server(app, sock=mesh.listener, ssl=mesh.server_context)
    client_sock = socket.socket()
    client_sock.setblocking(False)
    mesh.opened.append(client_sock)
    await loop.sock_connect(client_sock, mesh.listener.getsockname())
    client, client_app = await tls_connect(
        client_sock, mesh.client_context, SERVER, Recorder, handshake_timeout=WAIT
    )
    mesh.transports.append(client)
    request = pattern(MiB)
    client.write(request)
    await client_app.until(lambda: bool(accepted), "the server's connection")
    assert await accepted[0].received(len(request)) == request
    accepted[0].transport.write(b"answered by uvloop")
    assert await client_app.received(18) == b"answered by uvloop"
    client.close()
    await client_app.closed()
    await accepted[0].closed()
    assert accepted[0].events == ["eof", "lost"]  # uvloop read our close_notify
    assert client_app.events == ["lost"]
    uvloop_server.close()


async def test_uvloops_tls_client_against_tls_accept(mesh: Mesh) -> None:
    loop = asyncio.get_running_loop()
    server_sock, client_sock = await mesh.sockets()
    (server, server_app), (client, client_app) = await asyncio.gather(
        tls_accept(
            server_sock,
            mesh.server_context,
            lambda: Recorder(keep_open=False),
            handshake_timeout=WAIT,
        ),
        loop.create_connection(
            lambda: Recorder(keep_open=False),
            sock=client_sock,
            ssl=mesh.client_context,
            server_hostname=SERVER,
        ),
    )
    mesh.transports += [server, client]
    request = pattern(MiB)
    client.write(request)
    assert await server_app.received(len(request)) == request
    server.write(b"answered through TlsTransport")
    assert await client_app.received(29) == b"answered through TlsTransport"
    client.close()  # uvloop's TLS: close_notify, then it waits for ours
    await server_app.closed()
    await client_app.closed()
    assert server_app.events == ["eof", "lost"]
    assert client_app.events[-1] == "lost"  # after ours: a clean close


Terminate = Callable[[Mesh, socket.socket, ssl.SSLContext], Awaitable[object]]


async def ours(mesh: Mesh, sock: socket.socket, context: ssl.SSLContext) -> object:
    return await tls_accept(sock, context, Recorder, handshake_timeout=WAIT)


async def uvloops(mesh: Mesh, sock: socket.socket, context: ssl.SSLContext) -> object:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(Recorder, sock=sock, ssl=context)
    mesh.transports.append(transport)
    return transport


@pytest.mark.parametrize("terminate", [ours, uvloops], ids=["TlsTransport", "uvloop"])
async def test_a_client_certificate_from_another_ca_is_refused_as_uvloop_refuses_it(
    mesh: Mesh, tmp_path: Path, terminate: Terminate
) -> None:
    stranger = contexts.client_context(*other_ca_leaf(CLIENT, tmp_path / "other"), mesh.anchors)
    server_sock, client_sock = await mesh.sockets()
    client = asyncio.ensure_future(
        tls_connect(client_sock, stranger, SERVER, Recorder, handshake_timeout=WAIT)
    )
    with pytest.raises(ssl.SSLCertVerificationError) as refused:
        await terminate(mesh, server_sock, mesh.server_context)
    assert classify_tls_error(refused.value) is Refusal.UNTRUSTED
    # TLS 1.3: the client's handshake completed before the server verified its certificate.
    transport, app = await client
    mesh.transports.append(transport)
    await app.closed()
    assert isinstance(app.exc, (ssl.SSLError, ConnectionResetError))
    assert "eof" not in app.events


async def test_a_server_with_another_name_is_refused_by_the_client(mesh: Mesh) -> None:
    server_sock, client_sock = await mesh.sockets()
    server = asyncio.ensure_future(
        tls_accept(server_sock, mesh.server_context, Recorder, handshake_timeout=WAIT)
    )
    with pytest.raises(ssl.SSLCertVerificationError) as refused:
        await tls_connect(
            client_sock, mesh.client_context, CLIENT, Recorder, handshake_timeout=WAIT
        )
    assert classify_tls_error(refused.value) is Refusal.WRONG_IDENTITY
    with pytest.raises(ssl.SSLError, match="ALERT"):  # the client told it why
        await server


async def test_a_protocol_factory_that_fails_fails_the_accept_and_closes_the_socket(
    mesh: Mesh,
) -> None:
    def broken() -> Recorder:
        raise LookupError("no protocol for this connection")

    server_sock, client_sock = await mesh.sockets()
    client = asyncio.ensure_future(
        tls_connect(client_sock, mesh.client_context, SERVER, Recorder, handshake_timeout=WAIT)
    )
    with pytest.raises(LookupError):
        await tls_accept(server_sock, mesh.server_context, broken, handshake_timeout=WAIT)
    transport, app = await client
    mesh.transports.append(transport)
    await app.closed()
    assert app.events == ["lost: TruncatedError"]


async def test_a_half_sent_client_hello_times_out_and_the_socket_is_closed(mesh: Mesh) -> None:
    loop = asyncio.get_running_loop()
    server_sock, client_sock = await mesh.sockets()
    hello = client_hello(mesh.client_context)
    await loop.sock_sendall(client_sock, hello[: len(hello) // 2])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 0\.3s"):
        await tls_accept(server_sock, mesh.server_context, Recorder, handshake_timeout=0.3)
    assert 0.25 < time.monotonic() - started < 0.3 + 1.0  # (the loop clock counts in ms)
    async with asyncio.timeout(WAIT):
        assert await loop.sock_recv(client_sock, 100) == b""  # closed: a FIN


async def test_a_caller_giving_up_on_the_handshake_closes_the_socket(mesh: Mesh) -> None:
    loop = asyncio.get_running_loop()
    server_sock, client_sock = await mesh.sockets()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):  # the caller's deadline, shorter than ours
            await tls_accept(server_sock, mesh.server_context, Recorder, handshake_timeout=WAIT)
    async with asyncio.timeout(WAIT):
        assert await loop.sock_recv(client_sock, 100) == b""


@pytest.mark.parametrize("terminate", [ours, uvloops], ids=["TlsTransport", "uvloop"])
async def test_a_client_closing_during_the_handshake_is_a_reset_as_with_uvloop(
    mesh: Mesh, terminate: Terminate
) -> None:
    loop = asyncio.get_running_loop()
    server_sock, client_sock = await mesh.sockets()
    hello = client_hello(mesh.client_context)
    await loop.sock_sendall(client_sock, hello[:100])
    client_sock.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError) as refused:
        await terminate(mesh, server_sock, mesh.server_context)
    assert classify_tls_error(refused.value) is Refusal.HANDSHAKE_FAILED
