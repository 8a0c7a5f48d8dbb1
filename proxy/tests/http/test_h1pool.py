"""The HTTP/1.1 keep-alive pool over real connections to a local server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from meshlet.proxy.http.contract import HttpLimits
from meshlet.proxy.http.h1pool import H1Pool, PoolKey
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.counters import TcpConn


class Server:
    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.closed = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await reader.read()  # until the pool closes its side
        self.closed += 1
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, PoolKey]]:
    srv = Server()
    listener = await asyncio.start_server(srv.serve, "127.0.0.1", 0)
    yield srv, (tcp_connector(1.0), listener.sockets[0].getsockname()[:2])
    for writer in srv.writers:
        writer.close()
    listener.close()
    await listener.wait_closed()


async def settle(condition: Any) -> None:
    async with asyncio.timeout(3):
        while not condition():  # noqa: ASYNC110 - polls state that no event announces
            await asyncio.sleep(0.01)


async def test_most_recent_idle_connection_first_and_at_most_max_idle(
    server: tuple[Server, PoolKey],
) -> None:
    srv, key = server
    pool = H1Pool(idle_timeout=10, max_idle=2)
    a, b, c = [await pool.open(key, HttpLimits(), TcpConn.uncounted()) for _ in range(3)]
    for upstream in (a, b, c):
        pool.give(key, upstream)
    assert c.closed  # over max_idle
    assert pool.take(key) is b and b.reused
    assert pool.take(key) is a
    assert pool.take(key) is None
    pool.give(key, a)
    pool.give(key, b)
    pool.close()
    assert a.closed and b.closed
    await settle(lambda: srv.closed == 3)


async def test_connection_closed_by_the_peer_while_idle_is_dropped(
    server: tuple[Server, PoolKey],
) -> None:
    srv, key = server
    pool = H1Pool(idle_timeout=10)
    upstream = await pool.open(key, HttpLimits(), TcpConn.uncounted())
    pool.give(key, upstream)
    srv.writers[0].close()
    await settle(lambda: upstream.closed)
    assert pool.take(key) is None
    pool.close()


async def test_idle_timeout_closes_and_use_restarts_the_clock(
    server: tuple[Server, PoolKey],
) -> None:
    srv, key = server
    pool = H1Pool(idle_timeout=0.3)
    upstream = await pool.open(key, HttpLimits(), TcpConn.uncounted())
    pool.give(key, upstream)
    await asyncio.sleep(0.2)
    assert pool.take(key) is upstream  # in use: the timer does not close it
    await asyncio.sleep(0.2)
    pool.give(key, upstream)  # idle again from now
    await asyncio.sleep(0.2)
    assert not upstream.closed
    await settle(lambda: upstream.closed)
    assert pool.take(key) is None
    await settle(lambda: srv.closed == 1)
    pool.close()
