"""Upstream HTTP/2 connections: one multiplexed connection per endpoint address, shared by every
downstream connection of the process, and more when it is full.

The application makes one pool and passes it to every `serve_h2` call; the pool owns the tasks
that connect and closes its connections when its `async with` block ends. Concurrent requests to
an endpoint without a connection share one connect attempt. When every connection to an
endpoint has as many streams open as the upstream allows (its SETTINGS_MAX_CONCURRENT_STREAMS),
a request opens another connection, as Envoy's pool does, up to MAX_CONNECTIONS; past that it
waits its turn: each stream that ends on any of them is the next waiter's, in the order they
came (so a queue of n requests costs n wake-ups, not n² / 2). An upstream that allows no stream
at all gets no second connection: it said it is busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Final

from meshlet.proxy.core.failover import Failure
from meshlet.proxy.http.attempts import Failed
from meshlet.proxy.http.contract import Addr, Connect, Endpoint, HttpLimits, Wait
from meshlet.proxy.http.h2client import H2Client, H2Sink, wake_one
from meshlet.proxy.http.h2guard import GuardLimits
from meshlet.proxy.io.counters import TcpConn

# how (an endpoint's own connector, over the mesh; None: the pool's) and where
PoolKey = tuple[Connect | None, Addr]

# Connections to one endpoint when each is full (every stream its upstream allows in use).
MAX_CONNECTIONS: Final = 4

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
        # Usually one connection each; its waiters for a stream, shared by all of them.
        self._clients: dict[PoolKey, list[H2Client]] = {}
        self._slots: dict[PoolKey, deque[asyncio.Future[None]]] = {}
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
        return sum(len(clients) for clients in self._clients.values())

    async def aclose(self) -> None:
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        for clients in list(self._clients.values()):
            for client in list(clients):
                client.close()
        self._clients.clear()
        self._slots.clear()
        self._keys.clear()

    def open(
        self, endpoint: Endpoint, stream: H2Sink, counts: Callable[[Endpoint], TcpConn]
    ) -> Wait | None:
        """Opens `stream` upstream on the pooled connection to `endpoint` when it is up and
        has a free stream (None); else a Wait that connects when there is no connection
        (counted by `counts`) and waits while the upstream's concurrency limit is reached,
        whose result is None (opened) or why it failed. A connection made for it that closes
        before the stream is opened fails like a refused one (the request's Attempts decide
        whether to try again)."""
        key = (endpoint.connect, endpoint.addr)
        clients = self._clients.get(key)
        if clients is not None and not self._slots.get(key):  # nobody waits before it
            for client in clients:
                if client.open(stream):
                    return None
        return Wait(self._open, (key, stream, partial(counts, endpoint)))

    async def _open(self, args: tuple[PoolKey, H2Sink, Callable[[], TcpConn]]) -> Failed | None:
        key, stream, tcp = args
        addr = key[1]
        dialed = woken = False
        turn = not self._slots.get(key)  # else it waits behind those before it
        while not stream.closed:
            clients = [client for client in self._clients.get(key, ()) if client.usable]
            if not clients:
                if dialed:
                    why = f"the connection to {addr} closed at once"
                    return Failed(Failure.CONNECT, why)
                dialed = True
                got = await self._client(key, tcp)
                if isinstance(got, Failed):
                    return got
                continue
            if turn and any(client.open(stream) for client in clients):
                return None
            client = clients[0]
            if any(each.h2.peer_max_streams > 0 for each in clients):
                # every stream the upstream allows is in use: another connection, or a turn
                # at the next stream to end on any of them
                if turn and len(clients) < MAX_CONNECTIONS:
                    got = await self._client(key, tcp)
                    if not isinstance(got, Failed):
                        continue
                await client.slot(first=woken)  # a turn taken before it ran: still first
                turn = woken = True
                continue
            # It allows no stream at all: it may raise its limit soon, but no request waits
            # longer than a connect would have.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._limits.connect_timeout):
                    while client.usable and client.h2.peer_max_streams == 0:
                        await client.slot()
            turn = True
            if client.usable and client.h2.peer_max_streams == 0:
                return Failed(
                    Failure.REFUSED,
                    f"{addr} allows no HTTP/2 stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)",
                )
        slots = self._slots.get(key)
        if woken and slots is not None:
            wake_one(slots)  # its request went away with the turn: the next waiter's
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
        own, addr = key
        connect = own or self._connect
        limits, guard = self._limits, self._guard
        where = str(addr)

        def client() -> H2Client:
            made = H2Client(addr, limits, guard, self._retire, peer_proxy=own is not None,
                            slots=self._slots.setdefault(key, deque()))  # fmt: skip
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
        self._clients.setdefault(key, []).append(protocol)
        self._keys[protocol] = key
        return protocol

    def _retire(self, client: H2Client) -> None:
        key = self._keys.pop(client, None)
        if key is None:
            return
        clients = self._clients.get(key)
        if clients is not None and client in clients:
            clients.remove(client)
            if not clients:
                del self._clients[key]
                self._slots.pop(key, None)  # its waiters are woken by the retiring client
