"""The opaque relay and the listener's detection, on real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from meshlet.proxy.core.detect import Protocol, may_be_http
from meshlet.proxy.io import relay
from meshlet.proxy.io.counters import TcpConn
from meshlet.proxy.io.listener import Accepted, Listener, bind, peek_protocol
from meshlet_testing.polling import eventually


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write(b"<eof seen>")  # the other direction still flows after our FIN
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@dataclass
class Counts:
    """The relayed connections' byte counts: (client side, upstream side) per connection."""

    conns: list[tuple[TcpConn, TcpConn]] = field(default_factory=list)

    def read(self, side: int) -> int:
        return sum(pair[side].read for pair in self.conns)

    def written(self, side: int) -> int:
        return sum(pair[side].written for pair in self.conns)


@pytest.fixture
async def relay_proxy() -> AsyncIterator[tuple[int, int, Counts]]:
    """A listener relaying every connection to an echo server; yields (proxy port,
    upstream port, byte counts)."""
    server, upstream = await echo_server()
    counts = Counts()
    loop = asyncio.get_running_loop()

    async def handle(accepted: Accepted) -> None:
        client_tcp, upstream_tcp = TcpConn.uncounted(), TcpConn.uncounted()
        counts.conns.append((client_tcp, upstream_tcp))
        client_side, upstream_side, done = relay.pair(loop, client_tcp, None, upstream_tcp)
        await loop.create_connection(lambda: upstream_side, "127.0.0.1", upstream)
        await loop.connect_accepted_socket(lambda: client_side, sock=accepted.sock)
        upstream_side.flush()
        client_side.flush()
        await done

    listener = Listener(bind(("127.0.0.1", 0)), handle, "relay")
    task = asyncio.create_task(listener.serve())
    yield listener.address[1], upstream, counts
    listener.stop_accepting()
    task.cancel()
    await listener.drain(1.0)
    server.close()


async def test_bytes_both_ways_and_half_close(relay_proxy: tuple[int, int, Counts]) -> None:
    port, _, counts = relay_proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = bytes(range(256)) * 4096  # 1 MiB
    writer.write(payload)
    writer.write_eof()  # FIN: the echo server must see it and answer after it
    received = await asyncio.wait_for(reader.read(-1), 10)
    assert received == payload + b"<eof seen>"
    writer.close()
    client, upstream = 0, 1
    assert counts.read(client) == counts.written(upstream) == len(payload)
    assert counts.read(upstream) == counts.written(client) == len(payload) + len(b"<eof seen>")


async def test_a_slow_reader_bounds_the_relay_buffers(
    relay_proxy: tuple[int, int, Counts],
) -> None:
    port, _, counts = relay_proxy
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    chunk = b"x" * 65536
    sent = 0
    stalled_for = 0.0
    # Write while never reading the echo: the relay must stop reading from us, so our sends
    # stall (the kernel buffers fill) instead of the proxy buffering without bound.
    while stalled_for < 1.0 and sent < 256 * 1024 * 1024:
        try:
            sent += sock.send(chunk)
            stalled_for = 0.0
        except BlockingIOError:
            await asyncio.sleep(0.05)
            stalled_for += 0.05
    sock.close()
    assert stalled_for >= 1.0, f"sent {sent} bytes without stalling: the relay never pushed back"
    assert sent < 64 * 1024 * 1024  # kernel buffers on both hops, plus the relay's bound
    assert counts.read(0) <= sent


async def test_detection_on_a_real_socket() -> None:
    listener_sock = bind(("127.0.0.1", 0))
    port = listener_sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    verdicts = []
    cases = [
        (b"GET / HTTP/1.1\r\n\r\n", 1.0, False),
        (b"", 0.2, False),
        (b"GE", 0.3, False),  # a prefix of a request, then silence
        (b"GE", 5.0, True),  # the same, then a FIN: decided without waiting
        (b"GET /" + b"a" * 4000, 1.0, False),  # longer than the peek: decided by its start
        (b"\x00\x01binary", 1.0, False),
    ]
    for payload, wait, shut in cases:
        client = socket.create_connection(("127.0.0.1", port))
        if payload:
            client.sendall(payload)
        if shut:
            client.shutdown(socket.SHUT_WR)
        conn, addr = await loop.sock_accept(listener_sock)
        conn.setblocking(False)
        accepted = Accepted(conn, addr, conn.getsockname(), None, loop.time())
        started = loop.time()
        verdicts.append((await peek_protocol(accepted, wait), loop.time() - started))
        # Nothing was consumed: the bytes are still there to read.
        if payload:
            assert conn.recv(100) == payload[:100]
        conn.close()
        client.close()
    listener_sock.close()
    expected = [
        (Protocol.HTTP1, False),
        (Protocol.OPAQUE, True),  # the client sent nothing: a server-speaks-first protocol
        (Protocol.HTTP1, True),  # stays HTTP: the engine answers 408
        (Protocol.HTTP1, False),
        (Protocol.HTTP1, False),
        (Protocol.OPAQUE, False),
    ]
    for (detected, elapsed), (protocol, timed_out), (_, wait, _) in zip(
        verdicts, expected, cases, strict=True
    ):
        assert detected is not None
        assert (detected.protocol, detected.timed_out) == (protocol, timed_out), detected
        assert elapsed < wait + 0.5
    assert verdicts[3][1] < 1.0  # the FIN was noticed


async def test_detection_deadline_counts_from_the_accept() -> None:
    listener_sock = bind(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    client = socket.create_connection(listener_sock.getsockname())
    conn, addr = await loop.sock_accept(listener_sock)
    conn.setblocking(False)
    accepted = Accepted(conn, addr, conn.getsockname(), None, loop.time() - 0.9)
    started = loop.time()
    detected = await peek_protocol(accepted, 1.0)
    assert detected is not None and detected.timed_out
    assert loop.time() - started < 0.5
    for sock in (conn, client, listener_sock):
        sock.close()


async def test_a_reset_during_detection_is_no_connection() -> None:
    listener_sock = bind(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    client = socket.create_connection(listener_sock.getsockname())
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn, addr = await loop.sock_accept(listener_sock)
    conn.setblocking(False)
    client.close()  # a reset
    await asyncio.sleep(0.05)
    assert await peek_protocol(Accepted(conn, addr, conn.getsockname(), None), 1.0) is None
    conn.close()
    listener_sock.close()


@pytest.fixture
async def guarded_proxy() -> AsyncIterator[tuple[int, list[bytes], list[str]]]:
    """A relay whose client side is guarded against HTTP to a server that speaks first; yields
    (proxy port, what the server received per connection, refusals)."""
    received: list[bytes] = []
    refusals: list[str] = []

    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 ready\r\n")
        got = b""
        try:
            while data := await reader.read(65536):
                got += data
                writer.write(b"ok\r\n")
        except ConnectionError:
            pass
        received.append(got)
        writer.close()

    server = await asyncio.start_server(banner, "127.0.0.1", 0)
    upstream = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    guard: relay.FirstBytesCheck = (
        lambda first, final: may_be_http(first, final=final),
        lambda: refusals.append("late_http"),
    )

    async def handle(accepted: Accepted) -> None:
        client_side, upstream_side, done = relay.pair(loop, None, guard)
        await loop.create_connection(lambda: upstream_side, "127.0.0.1", upstream)
        await loop.connect_accepted_socket(lambda: client_side, sock=accepted.sock)
        upstream_side.flush()
        client_side.flush()
        await done

    listener = Listener(bind(("127.0.0.1", 0)), handle, "guarded")
    task = asyncio.create_task(listener.serve())
    yield listener.address[1], received, refusals
    listener.stop_accepting()
    task.cancel()
    await listener.drain(1.0)
    server.close()


async def test_a_guarded_relay_passes_a_protocol_that_is_not_http(
    guarded_proxy: tuple[int, list[bytes], list[str]],
) -> None:
    port, received, refusals = guarded_proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await reader.readline() == b"220 ready\r\n"  # the server spoke first
    writer.write(b"EH")  # undecided: held
    await asyncio.sleep(0.05)
    writer.write(b"LO client\r\n")
    assert await asyncio.wait_for(reader.readline(), 5) == b"ok\r\n"
    writer.write(b"GET / HTTP/1.1\r\n\r\n")  # later bytes are not the guard's concern
    assert await asyncio.wait_for(reader.readline(), 5) == b"ok\r\n"
    writer.close()
    await eventually(lambda: bool(received))  # the server saw the connection end
    assert received == [b"EHLO client\r\nGET / HTTP/1.1\r\n\r\n"]
    assert refusals == []


@pytest.mark.parametrize(
    "pieces",
    [
        [b"GET / HTTP/1.1\r\nmeshlet-client-id: forged\r\n\r\n"],
        [b"G", b"E", b"T", b" /"],  # a method trickled byte by byte
        [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"],
        [b"GE"],  # then a FIN: still a prefix of HTTP
    ],
)
async def test_a_guarded_relay_refuses_http_and_forwards_none_of_it(
    guarded_proxy: tuple[int, list[bytes], list[str]], pieces: list[bytes]
) -> None:
    port, received, refusals = guarded_proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await reader.readline() == b"220 ready\r\n"
    for piece in pieces:
        writer.write(piece)
        await asyncio.sleep(0.02)
    writer.write_eof()
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(100), 5) == b""
    writer.close()
    await eventually(lambda: bool(received))  # the server saw the connection end
    assert received == [b""]  # and none of the bytes
    assert refusals == ["late_http"]


async def test_what_waited_for_the_client_side_goes_first() -> None:
    """A server that speaks first: its banner arrives before the client side is attached and
    waits; its FIN arrives after the attach but before `flush`. The client still gets the
    banner, then the FIN, never the FIN first (which would lose the banner)."""
    loop = asyncio.get_running_loop()
    close_now = asyncio.Event()

    async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 ready\r\n")
        await close_now.wait()
        writer.write(b"bye\r\n")
        writer.write_eof()
        await reader.read()
        writer.close()

    server = await asyncio.start_server(banner, "127.0.0.1", 0)
    client_side, upstream_side, done = relay.pair(loop)
    await loop.create_connection(lambda: upstream_side, *server.sockets[0].getsockname()[:2])
    listener_sock = bind(("127.0.0.1", 0))
    reader, writer = await asyncio.open_connection(*listener_sock.getsockname()[:2])
    conn, _ = await loop.sock_accept(listener_sock)
    for _ in range(100):  # the banner waits in the upstream side
        if upstream_side._pending:
            break
        await asyncio.sleep(0.01)
    await loop.connect_accepted_socket(lambda: client_side, sock=conn)
    close_now.set()
    for _ in range(100):  # more bytes and the FIN arrive before flush
        if upstream_side._eof:
            break
        await asyncio.sleep(0.01)
    upstream_side.flush()
    client_side.flush()
    async with asyncio.timeout(5):
        assert await reader.read() == b"220 ready\r\nbye\r\n"
    writer.close()
    async with asyncio.timeout(5):
        await done
    server.close()
    listener_sock.close()
