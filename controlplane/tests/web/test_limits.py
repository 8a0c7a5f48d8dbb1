"""What a client may hold of the dashboard, on real sockets: a request head that does not
arrive in time closes its connection (a first one with a 408), a kept-alive connection between
requests is not cut by it, and a flood of pages while Prometheus hangs is answered 503 at once
beyond the pages computed and waiting, not queued; `Heads`' transcripts without sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from meshlet.api.hostport import HostPort
from meshlet.controlplane.web.limits import Heads
from meshlet.controlplane.web.server import WebConfig, WebServer

LOOPBACK = HostPort("127.0.0.1", 0)
HEAD_TIMEOUT = 0.5


def test_a_head_is_awaited_from_the_accept_until_its_end_and_again_from_a_next_byte() -> None:
    heads = Heads()
    assert heads.pending  # the accept: the first head is due
    assert heads.feed(b"GET / HTTP/1.1\r\nHost: x\r\n") is True
    assert heads.feed(b"\r") is True
    assert heads.feed(b"\n") is False and heads.answered == 1  # its end, split across reads
    assert heads.feed(b"G") is True  # the next head began
    assert heads.feed(b"ET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n") is False
    assert heads.answered == 3
    assert heads.feed(b"GET /c HTTP/1.1\r\n\r\nGET /d") is True and heads.answered == 4


@pytest.fixture
def hung_prometheus() -> Iterator[str]:
    """A Prometheus that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
async def server(hung_prometheus: str) -> AsyncIterator[WebServer]:
    config = WebConfig(LOOPBACK, LOOPBACK, hung_prometheus, HostPort("127.0.0.1", 1),
                       head_timeout=HEAD_TIMEOUT, page_workers=2, page_waiting=2,
                       page_timeout=1.0)  # fmt: skip
    web = WebServer(config)
    await web.start()
    yield web
    await web.stop()


async def _read_all(reader: asyncio.StreamReader, within: float) -> bytes:
    return await asyncio.wait_for(reader.read(), within)


async def test_a_head_that_does_not_arrive_in_time_closes_the_connection(
    server: WebServer,
) -> None:
    # half a head, then nothing: 408 and closed at the head timeout
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    began = time.monotonic()
    writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    answer = await _read_all(reader, 5)
    took = time.monotonic() - began
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert HEAD_TIMEOUT * 0.9 <= took < HEAD_TIMEOUT + 1.0, took
    # a byte every 0.1 s: the head's time runs from the accept, not from the last byte
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    began = time.monotonic()

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: yes\r\n" * 3:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)

    dripping = asyncio.create_task(drip())
    answer = await _read_all(reader, 5)
    took = time.monotonic() - began
    dripping.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dripping
    assert answer.startswith(b"HTTP/1.1 408 ") and took < HEAD_TIMEOUT + 1.0, (answer, took)
    writer.close()
    # a connection with nothing sent at all
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert (await _read_all(reader, 5)).startswith(b"HTTP/1.1 408 ")
    writer.close()


async def test_a_kept_alive_connection_waits_between_requests_and_a_late_second_head_ends_it(
    server: WebServer,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    request = b"GET /static/dashboard.css HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for _ in range(2):  # quiet between them for longer than the head timeout: kept
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 "), head
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))  # fmt: skip
        await reader.readexactly(length)
        await asyncio.sleep(HEAD_TIMEOUT * 2)
    writer.write(b"GET / HTTP/1.1\r\n")  # a second head that never ends: closed, no 408
    began = time.monotonic()
    assert await _read_all(reader, 5) == b""
    assert time.monotonic() - began < HEAD_TIMEOUT + 1.0
    writer.close()
    assert _refused(server, "head_timeout") == 1


def _refused(server: WebServer, reason: str) -> float:
    return server.registry.get_sample_value("web_refused_total", {"reason": reason}) or 0.0


async def test_a_flood_of_pages_is_answered_503_at_once_past_those_computed_and_waiting(
    server: WebServer,
) -> None:
    """30 pages at once while Prometheus hangs: 2 are computed, 2 wait, 26 are told at once
    that the dashboard is busy; the 4 end within their own time (1 s each, two rounds)."""
    url = f"http://127.0.0.1:{server.port}/namespaces/demo"
    began = time.monotonic()
    ended: list[tuple[int, float, str]] = []

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.get(url) as response:
            body = await response.text()
            ended.append((response.status, time.monotonic() - began, body))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.wait_for(asyncio.gather(*(one(session) for _ in range(30))), 15)
    busy = [took for status, took, body in ended if status == 503 and "busy" in body]
    computed = [took for status, took, body in ended if "Prometheus cannot answer" in body]
    assert len(busy) == 26 and max(busy) < 1.0, sorted(busy)
    assert len(computed) == 4 and max(computed) < 4.0, sorted(computed)
    assert _refused(server, "overloaded") == 26
    # the flood over, pages are computed again
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 503 and "Prometheus cannot answer" in await response.text()
