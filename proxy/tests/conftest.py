"""Proxy tests run on uvloop, as the proxy does; `engine_proxy` serves an HTTP engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvloop

from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.http.contract import (
    Endpoint,
    HttpConn,
    HttpLimits,
    RequestTarget,
    RouteError,
    RouteTarget,
)
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Accepted, Listener, bind
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.routing import FixedPicker

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

        class Router:
            """Every request to `upstream`, or, without one, to its authority."""

            async def route(self, request: RequestTarget) -> RouteTarget | RouteError:
                authority = request.authority
                proxy.routes.append(authority)
                if upstream is not None:
                    endpoint = Endpoint(upstream, f"{upstream[0]}:{upstream[1]}")
                elif not authority:
                    return RouteError(400, "no authority")
                else:
                    host, _, port = authority.rpartition(":")
                    if not port.isdigit():
                        return RouteError(400, "authority without port")
                    endpoint = Endpoint((host.strip("[]"), int(port)), authority)
                return RouteTarget(endpoint.authority_label, DEFAULT_ROUTE, None,
                                   FixedPicker(endpoint))  # fmt: skip

        async def handle(accepted: Accepted) -> None:
            await engine(
                HttpConn(
                    sock=accepted.sock,
                    router=Router(),
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
