"""Proxy tests run on uvloop, as the proxy does; `engine_proxy` serves an HTTP engine;
`accept` and `connections` let a stack handle real accepted connections while recording how
it has them served."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop

from meshlet.api.hostport import HostPort
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.contract import (
    Endpoint,
    HttpConn,
    HttpLimits,
    RequestTarget,
    RouteError,
    RouteTarget,
    Wait,
)
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.counters import ConnLabels, TcpConn
from meshlet.proxy.io.listener import Accepted, Listener, bind
from meshlet.proxy.metrics import ProxyMetrics

Engine = Callable[[HttpConn], Awaitable[None]]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async proxy test runs on uvloop."""
    return {"uvloop": uvloop.new_event_loop}


@dataclass
class EngineProxy:
    """An HTTP engine behind a real listener on 127.0.0.1."""

    port: int
    metrics: ProxyMetrics
    closing: asyncio.Event
    listener: Listener
    routes: list[str | None] = field(default_factory=list)  # authorities asked for
    paths: list[str] = field(default_factory=list)  # the paths routed, in order
    awaited: int = 0  # of those, answered only after a Wait


@pytest.fixture
async def engine_proxy() -> AsyncIterator[Callable[..., Awaitable[EngineProxy]]]:
    """`await engine_proxy(engine, upstream_addr, limits=HttpLimits(...))` → EngineProxy.

    With `upstream_addr=None` requests are routed by their authority (`host:port`), or answered
    400 without one, as the outbound proxy does when a connection was not redirected."""
    started: list[tuple[EngineProxy, asyncio.Task[None]]] = []

    async def start(
        engine: Engine, upstream: tuple[str, int] | None, limits: HttpLimits | None = None,
        waits: bool = False, h2: bool = False, **conn: Any,
    ) -> EngineProxy:  # fmt: skip
        """`waits`: routing and picking answer only when awaited (as while discovery has
        not answered), so the engine takes its slower path for every request. `h2`: the
        upstream is a peer proxy that takes HTTP/2 (`Endpoint.h2`, over plain TCP)."""
        metrics = ProxyMetrics()
        closing = asyncio.Event()
        proxy: EngineProxy

        class Picker(FixedPicker):
            def pick(self, after: Endpoint | None = None) -> Wait:  # type: ignore[override]
                return Wait(self._later, after)

            async def _later(self, after: Endpoint | None) -> Endpoint:
                return self.endpoint

        class Router:
            """Every request to `upstream`, or, without one, to its authority."""

            def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
                return Wait(self._later, request) if waits else self.routed(request)

            async def _later(self, request: RequestTarget) -> RouteTarget | RouteError:
                proxy.awaited += 1
                return self.routed(request)

            def routed(self, request: RequestTarget) -> RouteTarget | RouteError:
                authority = request.authority
                proxy.routes.append(authority)
                proxy.paths.append(request.path)
                if upstream is not None:
                    addr = HostPort(*upstream)
                    endpoint = Endpoint(addr, str(addr))
                    if h2:  # a peer proxy: its own error headers are relayed
                        endpoint = Endpoint(addr, str(addr), connect, h2=connect)
                elif not authority:
                    return RouteError(400, "no authority")
                else:
                    host, _, port = authority.rpartition(":")
                    if not port.isdigit():
                        return RouteError(400, "authority without port")
                    endpoint = Endpoint(HostPort(host.strip("[]"), int(port)), authority)
                picker = Picker(endpoint) if waits else FixedPicker(endpoint)
                return RouteTarget(endpoint.authority_label, DEFAULT_ROUTE, None, picker)

        connect = tcp_connector((limits or HttpLimits()).connect_timeout)

        async def handle(accepted: Accepted) -> None:
            await engine(
                HttpConn(
                    sock=accepted.sock,
                    router=Router(),
                    connect=connect,
                    metrics=metrics,
                    labels=metrics.conn("outbound", str(accepted.local)),
                    limits=limits or HttpLimits(),
                    closing=closing,
                    **conn,
                )
            )

        listener = Listener(bind(("127.0.0.1", 0)), handle, "test")
        proxy = EngineProxy(listener.address[1], metrics, closing, listener)
        started.append((proxy, asyncio.create_task(listener.serve())))
        return proxy

    yield start
    for proxy, task in started:
        proxy.listener.stop_accepting()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await proxy.listener.drain(grace=1.0)


@dataclass
class Served:
    """How a stack had a connection served: `http/1`, `h2` or `opaque`, with what routes it
    (a Router for HTTP, an EndpointPicker for opaque TCP), its labels and its relay guard."""

    how: str
    routing: Any
    labels: ConnLabels
    guard: Any = None
    add_headers: Sequence[tuple[bytes, bytes]] = ()


class ServingRecorded(Connections):
    """The connections shared by the stacks, serving nothing: each connection a stack hands to
    an engine or the relay is recorded (and closed); counting and refusing are the real ones."""

    def __init__(self) -> None:
        async def no_connect(addr: Any, factory: Any) -> Any:
            raise AssertionError("nothing is connected: serving is recorded")

        super().__init__(ProxyMetrics(), HttpLimits(), no_connect, asyncio.Event())
        self.served: list[Served] = []

    async def http(
        self, h2: bool, router: Any, labels: ConnLabels, tcp: TcpConn, *,
        accepted: Accepted | None = None, handoff: Any = None,
        add_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:  # fmt: skip
        self.served.append(Served("h2" if h2 else "http/1", router, labels, None, add_headers))
        if accepted is not None:
            accepted.sock.close()

    async def relay(
        self, accepted: Accepted, endpoints: Any, labels: ConnLabels, tcp: TcpConn,
        guard: Any = None,
    ) -> None:  # fmt: skip
        self.served.append(Served("opaque", endpoints, labels, guard))
        accepted.sock.close()

    def counter(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        return sum(
            sample.value
            for metric in self.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


@pytest.fixture
def connections() -> ServingRecorded:
    return ServingRecorded()


Accept = Callable[..., Awaitable[tuple[Accepted, socket.socket]]]


@pytest.fixture
async def accept() -> AsyncIterator[Accept]:
    """`await accept(first_bytes, original_dst=None, close=False, local=None)` → (Accepted,
    the client's socket): a real loopback connection whose client sent `first_bytes` (and
    half-closed with `close`), accepted as a listener accepts it, with the original destination
    given (and the local address, as a pod's proxy sees it, when given)."""
    listening = bind(("127.0.0.1", 0))
    opened: list[socket.socket] = []

    async def connect(
        first: bytes = b"",
        original_dst: tuple[str, int] | None = None,
        close: bool = False,
        local: tuple[str, int] | None = None,
    ) -> tuple[Accepted, socket.socket]:
        loop = asyncio.get_running_loop()
        client = socket.create_connection(listening.getsockname()[:2])
        opened.append(client)
        if first:
            client.sendall(first)
        if close:
            client.shutdown(socket.SHUT_WR)
        sock, addr = await loop.sock_accept(listening)
        opened.append(sock)
        sock.setblocking(False)
        here = HostPort(*local) if local else HostPort.from_sockaddr(sock.getsockname())
        dst = HostPort(*original_dst) if original_dst else None
        return Accepted(sock, HostPort.from_sockaddr(addr), here, dst, loop.time()), client

    yield connect
    for sock in opened:
        sock.close()
    listening.close()
