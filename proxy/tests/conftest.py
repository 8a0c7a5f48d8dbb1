"""Proxy tests run on uvloop, as the proxy does; `engine_proxy` serves an HTTP engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop

from meshlet.proxy.http.contract import Endpoint, HttpConn, HttpLimits, RouteError
from meshlet.proxy.io.connect import tcp_connector
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


def fixed_route(addr: tuple[str, int]) -> Callable[[str | None], Awaitable[Endpoint]]:
    async def route(authority: str | None) -> Endpoint:
        return Endpoint(addr, f"{addr[0]}:{addr[1]}")

    return route


@pytest.fixture
async def engine_proxy() -> AsyncIterator[Callable[..., Awaitable[EngineProxy]]]:
    """`await engine_proxy(engine, upstream_addr, limits=HttpLimits(...))` → EngineProxy.

    With `upstream_addr=None` requests are routed by their authority (`host:port`), or answered
    400 without one, as the outbound proxy does when a connection was not redirected."""
    started: list[tuple[EngineProxy, asyncio.Task[None]]] = []

    async def start(
        engine: Engine, upstream: tuple[str, int] | None, limits: HttpLimits | None = None,
        **conn: Any,
    ) -> EngineProxy:  # fmt: skip
        metrics = ProxyMetrics()
        closing = asyncio.Event()
        proxy: EngineProxy

        async def route(authority: str | None) -> Endpoint | RouteError:
            proxy.routes.append(authority)
            if upstream is not None:
                return Endpoint(upstream, f"{upstream[0]}:{upstream[1]}")
            if not authority:
                return RouteError(400, "no authority")
            host, _, port = authority.rpartition(":")
            if not port.isdigit():
                return RouteError(400, "authority without port")
            return Endpoint((host.strip("[]"), int(port)), authority)

        async def handle(accepted: Accepted) -> None:
            await engine(
                HttpConn(
                    sock=accepted.sock,
                    route=route,
                    connect=tcp_connector((limits or HttpLimits()).connect_timeout),
                    metrics=metrics,
                    labels=metrics.conn("outbound", f"{accepted.local[0]}:{accepted.local[1]}"),
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
