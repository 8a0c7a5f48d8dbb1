"""The opaque relay and the listener's detection, on real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from meshlet.proxy.core.detect import Protocol
from meshlet.proxy.io import relay
from meshlet.proxy.io.listener import Accepted, Listener, bind, peek_protocol


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


@pytest.fixture
async def relay_proxy() -> AsyncIterator[tuple[int, int, dict[str, int]]]:
    """A listener relaying every connection to an echo server; yields (proxy port,
    upstream port, byte counts)."""
    server, upstream = await echo_server()
    counts = {"client": 0, "upstream": 0}
    loop = asyncio.get_running_loop()

    async def handle(accepted: Accepted) -> None:
        client_side, upstream_side, done = relay.pair(
            loop,
            lambda n: counts.__setitem__("client", counts["client"] + n),
            lambda n: counts.__setitem__("upstream", counts["upstream"] + n),
        )
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


async def test_bytes_both_ways_and_half_close(relay_proxy: tuple[int, int, dict[str, int]]) -> None:
    port, _, counts = relay_proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = bytes(range(256)) * 4096  # 1 MiB
    writer.write(payload)
    writer.write_eof()  # FIN: the echo server must see it and answer after it
    received = await asyncio.wait_for(reader.read(-1), 10)
    assert received == payload + b"<eof seen>"
    writer.close()
    assert counts["client"] == len(payload)
    assert counts["upstream"] == len(payload) + len(b"<eof seen>")


async def test_a_slow_reader_bounds_the_relay_buffers(
    relay_proxy: tuple[int, int, dict[str, int]],
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
    assert counts["client"] <= sent


async def test_detection_on_a_real_socket() -> None:
    listener_sock = bind(("127.0.0.1", 0))
    port = listener_sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    verdicts = []
    for payload, wait in ((b"GET / HTTP/1.1\r\n\r\n", 1.0), (b"", 0.2), (b"GE", 0.3)):
        client = socket.create_connection(("127.0.0.1", port))
        if payload:
            client.sendall(payload)
        conn, addr = await loop.sock_accept(listener_sock)
        conn.setblocking(False)
        accepted = Accepted(conn, addr, conn.getsockname(), None)
        verdicts.append(await peek_protocol(accepted, wait))
        # Nothing was consumed: the bytes are still there to read.
        if payload:
            assert conn.recv(100) == payload
        conn.close()
        client.close()
    http1, silent, partial = verdicts
    assert http1 is not None and http1.protocol is Protocol.HTTP1 and not http1.timed_out
    assert silent is not None and silent.protocol is Protocol.OPAQUE and silent.timed_out
    assert partial is not None and partial.protocol is Protocol.OPAQUE and partial.timed_out
    listener_sock.close()
