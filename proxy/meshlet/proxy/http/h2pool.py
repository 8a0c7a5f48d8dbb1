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
from meshlet.proxy.http.h2client import H2Client, H2Sink, Line, Queueable, wake_all, wake_one
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
        self._slots: dict[PoolKey, Line] = {}
        self._connecting: dict[PoolKey, asyncio.Task[H2Client | Failed]] = {}
        self._keys: dict[H2Client, PoolKey] = {}
        self._gone: dict[PoolKey, int] = {}  # requests that left each line before their turn
        self._closing = False

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

    @property
    def in_line(self) -> int:
        """The places held in the lines for a stream (one whose request went away holds its
        place until its turn, or the line's next sweep)."""
        return sum(len(line) for line in self._slots.values())

    async def aclose(self) -> None:
        self._closing = True  # what its closing connections wake dials no more
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
        self._gone.clear()

    def open(
        self,
        endpoint: Endpoint,
        stream: H2Sink,
        counts: Callable[[Endpoint], TcpConn],
        queue: Queueable | None = None,
    ) -> Wait | Queued | None:
        """Opens `stream` upstream on the pooled connection to `endpoint` when it is up and
        has a free stream (None); else a Wait that connects when there is no connection
        (counted by `counts`) and waits while the upstream's concurrency limit is reached,
        whose result is None (opened) or why it failed. A connection made for it that closes
        before the stream is opened fails like a refused one (the request's Attempts decide
        whether to try again). With `queue` (the stream itself), a request that can only wait
        for a stream (every connection the pool makes to the endpoint is full, or others wait
        before it) waits in line without a task: Queued, whose `cancel` takes it out; at its
        turn the pool calls `queue.dequeued`."""
        key = (endpoint.connect, endpoint.addr)
        clients = self._clients.get(key)
        if clients is None:
            return Wait(self._open, (key, stream, partial(counts, endpoint)))
        line = self._slots.get(key)
        if not line:  # nobody waits before it
            for client in clients:
                if client.open(stream):
                    return None
        if (
            queue is not None
            and (line or len(clients) >= MAX_CONNECTIONS)
            and _allow_streams(clients)
        ):
            queued = Queued(self, key, queue, partial(counts, endpoint))
            self._slots.setdefault(key, deque()).append(queued)
            return queued
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
            if _allow_streams(clients):
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
        if self._closing:
            return Failed(Failure.CONNECT, "the proxy is shutting down")
        # One waiter's cancellation (its client went away) must not cancel the shared attempt.
        return await asyncio.shield(self._connect_once(key, tcp))

    def _connect_once(
        self, key: PoolKey, tcp: Callable[[], TcpConn]
    ) -> asyncio.Task[H2Client | Failed]:
        task = self._connecting.get(key)
        if task is None:
            task = asyncio.create_task(self._dial(key, tcp()))  # owned: `aclose` ends it
            self._connecting[key] = task
        return task

    async def _dial(self, key: PoolKey, tcp: TcpConn) -> H2Client | Failed:
        try:
            got = await self._handshake(key, tcp)
        finally:
            self._connecting.pop(key, None)
        line = self._slots.get(key)
        if line:
            if isinstance(got, Failed):
                self._fail_line(key, line, got)
            else:
                wake_all(line)  # its streams are free: the line takes them
        return got

    def _fail_line(self, key: PoolKey, line: Line, failed: Failed) -> None:
        """No connection for the requests queued in `line`: each fails as its connect would
        (its Attempts decide what follows) while no connection to the endpoint is left."""
        if any(client.usable for client in self._clients.get(key, ())):
            return  # they wait for a stream to end there
        for waiter in list(line):
            if isinstance(waiter, Queued):
                line.remove(waiter)
                waiter.fail(failed)
        if not line and key not in self._clients:
            self._slots.pop(key, None)
            self._gone.pop(key, None)

    def _cancelled(self, key: PoolKey) -> None:
        """A request left the line: once half the line has, the line is swept (so that
        requests queued and reset while no stream ends cost no memory past their turn)."""
        line = self._slots.get(key)
        if line is None:
            return
        gone = self._gone.get(key, 0) + 1
        if gone < 32 or gone * 2 < len(line):
            self._gone[key] = gone
            return
        self._gone.pop(key, None)
        kept = [w for w in line if not (isinstance(w, Queued) and w.sink is None)]
        line.clear()
        line.extend(kept)

    def _grow(self, key: PoolKey, tcp: Callable[[], TcpConn]) -> None:
        """A request in line found no stream: another connection when the pool may make one
        (the new connection's streams go to the line)."""
        usable = sum(client.usable for client in self._clients.get(key, ()))
        if usable < MAX_CONNECTIONS and not self._closing:
            self._connect_once(key, tcp)

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
                self._gone.pop(key, None)
                line = self._slots.pop(key, None)
                if line:  # with no connection left, they dial (Queued: the pool, for them)
                    wake_all(line)


def _allow_streams(clients: list[H2Client]) -> bool:
    return any(client.usable and client.h2.peer_max_streams > 0 for client in clients)


class Queued:
    """A request waiting in an endpoint's line for a stream, without a task (H2Pool.open with
    `queue`): at its turn it is opened on a connection with a free stream, then told
    (`Queueable.dequeued`)."""

    __slots__ = ("_key", "_pool", "_tcp", "sink")

    def __init__(
        self, pool: H2Pool, key: PoolKey, sink: Queueable, tcp: Callable[[], TcpConn]
    ) -> None:
        self._pool, self._key, self._tcp = pool, key, tcp
        self.sink: Queueable | None = sink

    def cancel(self) -> None:
        """Its request went away, or goes elsewhere: it passes its turn."""
        if self.sink is not None:
            self.sink = None
            self._pool._cancelled(self._key)

    def fail(self, failed: Failed) -> None:
        sink, self.sink = self.sink, None
        if sink is not None and not sink.closed:
            sink.dequeued(failed)

    def turn(self, front: bool) -> bool:
        sink = self.sink
        if sink is None or sink.closed:
            return False
        pool, key = self._pool, self._key
        clients = [client for client in pool._clients.get(key, ()) if client.usable]
        for client in clients:
            if client.open(sink):
                self.sink = None
                sink.dequeued(None)
                return True
        if clients and not _allow_streams(clients):
            # It allows no stream now: the request goes elsewhere, or is refused, at once.
            self.sink = None
            sink.dequeued(Failed(Failure.REFUSED, f"{key[1]} allows no HTTP/2 stream now"))
            return False
        line = pool._slots.setdefault(key, deque())
        if front:
            line.appendleft(self)
        else:
            line.append(self)
        pool._grow(key, self._tcp)
        return True
