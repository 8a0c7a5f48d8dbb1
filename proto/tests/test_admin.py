"""The admin server (every meshlet process's /metrics, /ready, /live) under the abuse any pod can
send it, on a real socket: slow partial heads, more connections than it keeps, clients that ask
for the metrics and never read them, and floods of scrapes against an expensive render."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import admin
from meshlet.api.admin import MAX_CONNECTIONS, RENDER_SPACING, AdminServer


@asynccontextmanager
async def serving(
    metrics: Callable[[], bytes | Iterable[bytes]] = lambda: b"# m 1\n",
) -> AsyncIterator[int]:
    server = AdminServer(metrics, ready=lambda: True)
    port = (await server.start("127.0.0.1", 0)).port
    try:
        yield port
    finally:
        await server.close()


async def get(port: int, path: str = "/ready") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    """A connected non-blocking socket (its receive buffer `rcvbuf` bytes when given)."""
    sock = socket.socket()
    sock.setblocking(False)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def send(sock: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(sock, data)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def closed(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the server closed `sock` (a FIN or a reset) within `within` seconds."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        async with asyncio.timeout(within):
            while True:
                if not await loop.sock_recv(sock, 65536):
                    return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def test_a_slow_partial_head_is_answered_400_and_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(admin, "READ_TIMEOUT", 0.2)
    async with serving() as port:
        with await connect(port) as slow:
            await send(slow, b"GET /metrics HTTP/1.1\r\nHost")
            started = time.monotonic()
            assert await closed(slow)
            assert time.monotonic() - started < 2


async def test_past_the_most_connections_the_oldest_are_closed_and_probes_answered() -> None:
    async with serving() as port:
        idle = []
        for _ in range(MAX_CONNECTIONS * 2):
            sock = await connect(port)
            await send(sock, b"GET /live HTTP/1.1\r\n")  # a head that never ends
            idle.append(sock)
        assert await get(port, "/ready") == (200, b"ready\n")
        # the oldest were closed to make room; the newest are still held
        assert all([await closed(sock, 0.5) for sock in idle[:MAX_CONNECTIONS]])
        assert not await closed(idle[-1], 0.2)
        for sock in idle:
            sock.close()


async def test_a_client_that_does_not_read_holds_a_chunk_not_the_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 clients ask for 20 MB of metrics and never read: each holds what its socket takes,
    not a copy of the body, and is cut off after WRITE_TIMEOUT."""
    monkeypatch.setattr(admin, "WRITE_TIMEOUT", 1.0)
    body = b"# " + b"x" * (20 << 20) + b"\n"
    async with serving(lambda: body) as port:
        before = rss_mib()
        readers = []
        for _ in range(20):
            sock = await connect(port, rcvbuf=4096)
            await send(sock, b"GET /metrics HTTP/1.1\r\n\r\n")
            readers.append(sock)
        await asyncio.sleep(0.5)
        grown = rss_mib() - before
        assert grown < 100, f"the server grew by {grown:.0f} MiB for 20 clients not reading"
        await asyncio.sleep(1.0)  # past WRITE_TIMEOUT
        taken = []
        loop = asyncio.get_running_loop()
        for sock in readers:  # cut off: what arrives ends before the whole body
            received = 0
            try:
                async with asyncio.timeout(10):
                    while chunk := await loop.sock_recv(sock, 1 << 20):
                        received += len(chunk)
            except ConnectionError:
                pass
            taken.append(received)
            sock.close()
        assert all(n < len(body) for n in taken), taken
        status, whole = await get(port, "/metrics")  # a client that reads gets it all
        assert status == 200 and whole == body


async def test_a_scrape_flood_takes_a_bounded_share_of_the_loop() -> None:
    """A render costing 20 ms, 8 clients scraping as fast as they can for 2 s: renders are
    spaced so that the loop stays free for other work, and every answer is a render that
    began after its request arrived."""
    renders = 0

    def expensive() -> bytes:
        nonlocal renders
        renders += 1
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
        return b"# render %d\n" % renders

    async with serving(expensive) as port:
        stale: list[tuple[int, int]] = []
        lateness: list[float] = []
        stop = time.monotonic() + 2.0

        async def scrape() -> None:
            while time.monotonic() < stop:
                asked = renders
                status, body = await get(port, "/metrics")
                assert status == 200
                got = int(body.split()[-1])
                if got <= asked:
                    stale.append((asked, got))

        async def ticks() -> None:  # what other work on the loop sees
            while time.monotonic() < stop:
                before = time.monotonic()
                await asyncio.sleep(0.001)
                lateness.append(time.monotonic() - before - 0.001)

        await asyncio.gather(*(scrape() for _ in range(8)), ticks())
    assert not stale
    # without spacing the loop would render back to back: 100 renders in 2 s
    assert renders <= 2.0 / (0.02 * (1 + RENDER_SPACING)) + 2
    busy = renders * 0.02 / 2.0
    assert busy < 0.3, f"renders took {busy:.0%} of the loop"
    assert max(lateness) < 0.3  # a render at a time (20 ms), with room for a busy machine


async def test_the_metrics_are_fresh_for_a_client_that_asks_again(tmp_path: Any) -> None:
    value = [0]
    async with serving(lambda: b"# value %d\n" % value[0]) as port:
        for n in range(5):
            value[0] = n
            assert (await get(port, "/metrics"))[1] == b"# value %d\n" % n


async def test_a_render_given_in_pieces_lets_other_work_run_between_them() -> None:
    """A 1 s render in 100 pieces: other work on the loop waits for about one piece (10 ms;
    the bound leaves room for a busy machine), never the whole render."""

    def pieces() -> Iterator[bytes]:
        for n in range(100):
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                pass
            yield b"# piece %d\n" % n

    async with serving(pieces) as port:
        lateness: list[float] = []
        scrape = asyncio.ensure_future(get(port, "/metrics"))
        while not scrape.done():
            before = time.monotonic()
            await asyncio.sleep(0.001)
            lateness.append(time.monotonic() - before - 0.001)
        status, body = await scrape
    assert status == 200 and body == b"".join(b"# piece %d\n" % n for n in range(100))
    assert max(lateness) < 0.3, f"the loop was held for {max(lateness):.3f}s"
