"""Load shedding with real clients: quiet connections live while the proxy is under its marks;
past one, those that moved least are shed (HTTP/1: 503 and a close; HTTP/2, in test_h2.py:
GOAWAY), the others go on, and each is counted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshlet.proxy.core.pressure import PressureLimits
from meshlet.proxy.http.h1 import serve_h1
from meshlet.proxy.io import shedder as shedder_module
from meshlet.proxy.io.shedder import LoadShedder
from meshlet.proxy.metrics import ProxyMetrics

GRACE = 0.2


async def origin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request head with 200 `ok` once its declared body arrived."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    writer.close()


@pytest.fixture
async def origin_addr() -> AsyncIterator[tuple[str, int]]:
    server = await asyncio.start_server(origin, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[:2]
    server.close()


def shed_count(metrics: ProxyMetrics, resource: str) -> float:
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "load_shed_total" and sample.labels.get("resource") == resource
    )


async def get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET / HTTP/1.1\r\nHost: svc\r\n\r\n")
    async with asyncio.timeout(3):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
    return head


async def test_quiet_connections_live_while_the_proxy_is_under_its_marks(
    engine_proxy: Any, origin_addr: tuple[str, int]
) -> None:
    metrics = ProxyMetrics()
    shedder = LoadShedder(PressureLimits(connections=100, grace=GRACE), metrics)
    proxy = await engine_proxy(serve_h1, origin_addr, shedder=shedder)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: svc\r\nContent-Length: 4\r\n\r\nab")
        await asyncio.sleep(GRACE + shedder_module.PERIOD + 0.2)  # a periodic check passed
        writer.write(b"cd")
        async with asyncio.timeout(3):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert shed_count(metrics, "connections") == 0
    finally:
        writer.close()
        shedder.close()


async def test_past_the_connection_mark_the_slowloris_goes_first(
    engine_proxy: Any, origin_addr: tuple[str, int]
) -> None:
    """Two clients that sent a head and then a byte of a 1 MB body hold the proxy's
    connections; a busy client makes progress. The next client crowds the proxy: the two
    slow ones are shed with 503 and closed, the busy one and the newcomer are served."""
    metrics = ProxyMetrics()
    limits = PressureLimits(connections=3, low_water=0.67, grace=GRACE)
    shedder = LoadShedder(limits, metrics)
    proxy = await engine_proxy(serve_h1, origin_addr, shedder=shedder)
    opened: list[asyncio.StreamWriter] = []

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        opened.append(writer)
        return reader, writer

    try:
        slow = [await connect() for _ in range(2)]
        for _, writer in slow:
            writer.write(b"POST /up HTTP/1.1\r\nHost: svc\r\nContent-Length: 1000000\r\n\r\nx")
        busy = await connect()
        loop = asyncio.get_running_loop()
        until = loop.time() + GRACE + 0.1
        while loop.time() < until:  # the busy client keeps making progress
            assert (await get(*busy)).startswith(b"HTTP/1.1 200")
        newcomer = await connect()
        for reader, _ in slow:
            async with asyncio.timeout(3):
                reply = await reader.read()  # until the proxy closes
            assert reply.startswith(b"HTTP/1.1 503") and b"shed under load" in reply
        assert (await get(*busy)).startswith(b"HTTP/1.1 200")
        assert (await get(*newcomer)).startswith(b"HTTP/1.1 200")
        assert shed_count(metrics, "connections") == 2
    finally:
        for writer in opened:
            writer.close()
        shedder.close()
