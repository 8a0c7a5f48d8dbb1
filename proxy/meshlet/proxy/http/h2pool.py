"""Upstream HTTP/2 connections: one multiplexed connection per endpoint address, shared by every
downstream connection of the process.

The application makes one pool and passes it to every `serve_h2` call; the pool owns the tasks
that connect and closes its connections when its `async with` block ends. Concurrent requests to
an endpoint without a connection share one connect attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from functools import partial
from types import TracebackType

from meshlet.proxy.core.failover import Failure
from meshlet.proxy.http.attempts import Failed
from meshlet.proxy.http.contract import Addr, Connect, Endpoint, HttpLimits, Wait
from meshlet.proxy.http.h2client import H2Client
from meshlet.proxy.http.h2guard import GuardLimits
from meshlet.proxy.http.h2stream import ProxyStream
from meshlet.proxy.io.counters import TcpConn

PoolKey = tuple[Connect, Addr]  # how (the connector) and where

log = logging.getLogger(__name__)


class H2Pool:
    """Upstream connections by address. Owns its connect tasks; `aclose` (or leaving
    `async with H2Pool(...) as pool:`) cancels them and closes every connection."""

    def __init__(
        self, connect: Connect, limits: HttpLimits, guard: GuardLimits | None = None
    ) -> None:
        self._connect = connect
        self._limits = limits
        self._guard = guard or GuardLimits()
        # Keyed by how and where: an endpoint reached over the mesh has its own connector.
        self._clients: dict[PoolKey, H2Client] = {}
        self._connecting: dict[PoolKey, asyncio.Task[H2Client | Failed]] = {}
        self._keys: dict[H2Client, PoolKey] = {}

    async def __aenter__(self) -> H2Pool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def connections(self) -> int:
        return len(self._clients)

    async def aclose(self) -> None:
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        for client in list(self._clients.values()):
            client.close()
        self._clients.clear()
        self._keys.clear()

    def open(
        self, endpoint: Endpoint, stream: ProxyStream, counts: Callable[[Endpoint], TcpConn]
    ) -> Wait | None:
        """Opens `stream` upstream on the pooled connection to `endpoint` when it is up and
        has a free stream (None); else a Wait that connects when there is no connection
        (counted by `counts`) and waits while the upstream's concurrency limit is reached,
        whose result is None (opened) or why it failed. A connection made for it that closes
        before the stream is opened fails like a refused one (the request's Attempts decide
        whether to try again)."""
        key = (endpoint.connect or self._connect, endpoint.addr)
        client = self._clients.get(key)
        if client is not None and client.open(stream):
            return None
        return Wait(self._open, (key, stream, partial(counts, endpoint)))

    async def _open(
        self, args: tuple[PoolKey, ProxyStream, Callable[[], TcpConn]]
    ) -> Failed | None:
        key, stream, tcp = args
        addr = key[1]
        dialed = False
        while not stream.closed:
            client = self._clients.get(key)
            if client is None or not client.usable:
                if dialed:
                    why = f"the connection to {addr} closed at once"
                    return Failed(Failure.CONNECT, why)
                dialed = True
                got = await self._client(key, tcp)
                if isinstance(got, Failed):
                    return got
                continue
            if client.open(stream):
                break
            if client.usable and client.h2.peer_max_streams > 0:
                await client.slot()  # the upstream's concurrency: wait for a stream to end
                continue
            # It allows no stream at all: it may raise its limit soon, but no request waits
            # longer than a connect would have.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._limits.connect_timeout):
                    while client.usable and client.h2.peer_max_streams == 0:
                        await client.slot()
            if client.usable and client.h2.peer_max_streams == 0:
                return Failed(
                    Failure.REFUSED,
                    f"{addr} allows no HTTP/2 stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)",
                )
        return None

    async def _client(self, key: PoolKey, tcp: Callable[[], TcpConn]) -> H2Client | Failed:
        task = self._connecting.get(key)
        if task is None:
            task = asyncio.create_task(self._dial(key, tcp()))  # owned: `aclose` ends it
            self._connecting[key] = task
        # One waiter's cancellation (its client went away) must not cancel the shared attempt.
        return await asyncio.shield(task)

    async def _dial(self, key: PoolKey, tcp: TcpConn) -> H2Client | Failed:
        try:
            return await self._handshake(key, tcp)
        finally:
            self._connecting.pop(key, None)

    async def _handshake(self, key: PoolKey, tcp: TcpConn) -> H2Client | Failed:
        """Connects, then waits for the upstream's SETTINGS (its stream limit, its windows)."""
        connect, addr = key
        limits, guard = self._limits, self._guard
        where = str(addr)

        def client() -> H2Client:
            made = H2Client(addr, limits, guard, self._retire)
            made.tcp = tcp
            return made

        try:
            _, protocol = await connect(addr, client)
        except Exception as exc:  # refused, timed out, TLS failed: all mean "unreachable"
            log.info("connect to %s failed: %r", where, exc)
            if isinstance(exc, TimeoutError):
                return Failed(Failure.CONNECT_TIMEOUT, f"connecting to {where} timed out")
            return Failed(Failure.CONNECT, f"connect to {where} failed: {str(exc) or repr(exc)}")
        assert isinstance(protocol, H2Client)  # our factory's
        tcp.open()
        try:
            async with asyncio.timeout(limits.connect_timeout):
                await protocol.settled
        except TimeoutError:
            protocol.close()
            why = f"{where} sent no HTTP/2 SETTINGS in {limits.connect_timeout}s"
            return Failed(Failure.CONNECT_TIMEOUT, why)
        if not protocol.usable:
            return Failed(Failure.CONNECT, f"connection to {where} failed at once")
        self._clients[key] = protocol
        self._keys[protocol] = key
        return protocol

    def _retire(self, client: H2Client) -> None:
        key = self._keys.pop(client, None)
        if key is not None and self._clients.get(key) is client:
            del self._clients[key]
