"""gRPC through the HTTP/2 engine, unchanged: a grpcio client and a grpcio server on 127.0.0.1
with the proxy between them (generic handlers over raw bytes: no .proto needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
import pytest

from meshlet.proxy.http.contract import HttpLimits
from meshlet.proxy.http.h2pool import H2Pool
from meshlet.proxy.http.h2server import serve_h2
from meshlet_testing.grpcload import deadline_storm

SERVICE = "meshlet.test.Echo"


class Echo:
    """The upstream service: unary, server-streaming, a failing call and a slow one."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, str | bytes]] = []
        self.slow_cancelled = asyncio.Event()

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.metadata = list(context.invocation_metadata() or ())
        await context.send_initial_metadata((("x-initial", "yes"),))
        context.set_trailing_metadata((("x-trailing", "yes"),))
        return b"echo:" + request

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        count, size = (int(part) for part in request.split(b","))
        for i in range(count):
            yield bytes([i % 256]) * size

    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: " + request.decode())
        raise AssertionError("unreachable")

    async def chat(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for message in requests:
            yield b"echo:" + message

    async def slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.slow_cancelled.set()
            raise
        return b""


async def grpc_connect(
    addr: tuple[str, int], factory: Callable[[], asyncio.Protocol]
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(factory, addr[0], addr[1])
    return transport, protocol  # type: ignore[return-value]


@pytest.fixture
async def echo_server() -> AsyncIterator[tuple[Echo, tuple[str, int]]]:
    echo = Echo()
    server = grpc.aio.server()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(echo.unary),
        "Stream": grpc.unary_stream_rpc_method_handler(echo.stream),
        "Fail": grpc.unary_unary_rpc_method_handler(echo.fail),
        "Slow": grpc.unary_unary_rpc_method_handler(echo.slow),
        "Chat": grpc.stream_stream_rpc_method_handler(echo.chat),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield echo, ("127.0.0.1", port)
    await server.stop(grace=None)


@pytest.fixture
async def grpc_proxy(
    engine_proxy: Any,
) -> AsyncIterator[Callable[[tuple[str, int]], Awaitable[tuple[Any, grpc.aio.Channel]]]]:
    """`await grpc_proxy(upstream_addr)` → (EngineProxy, a grpc.aio channel to the proxy)."""
    opened: list[tuple[Any, H2Pool, grpc.aio.Channel]] = []

    async def start(
        addr: tuple[str, int], limits: HttpLimits | None = None
    ) -> tuple[Any, grpc.aio.Channel]:
        limits = limits or HttpLimits()
        pool = H2Pool(grpc_connect, limits)
        proxy = await engine_proxy(partial(serve_h2, pool=pool), addr, limits=limits)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}")
        opened.append((proxy, pool, channel))
        return proxy, channel

    yield start
    for proxy, pool, channel in opened:
        proxy.closing.set()  # GOAWAY: idle connections close at once
        await channel.close()
        await pool.aclose()


def sample(proxy: Any, name: str, **labels: str) -> float:
    return sum(
        s.value
        for metric in proxy.metrics.registry.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_unary_call_passes_through_unchanged(echo_server, grpc_proxy) -> None:
    echo, addr = echo_server
    proxy, channel = await grpc_proxy(addr)
    call = channel.unary_unary(f"/{SERVICE}/Unary")(
        b"hello", metadata=(("x-request", "r1"),), timeout=5
    )
    assert await call == b"echo:hello"
    assert ("x-initial", "yes") in tuple(await call.initial_metadata())
    assert ("x-trailing", "yes") in tuple(await call.trailing_metadata())
    assert await call.code() == grpc.StatusCode.OK
    assert ("x-request", "r1") in echo.metadata
    assert sample(proxy, "response_total", grpc_status="0", classification="success") == 1
    assert sample(proxy, "request_total", authority=f"{addr[0]}:{addr[1]}") == 1


async def test_a_server_streaming_call_passes_through_under_flow_control(
    echo_server, grpc_proxy
) -> None:
    _, addr = echo_server
    _, channel = await grpc_proxy(addr)
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"64,65536", timeout=5)  # 4 MiB
    messages = [message async for message in call]
    assert [len(m) for m in messages] == [65536] * 64
    assert all(m == bytes([i]) * 65536 for i, m in enumerate(messages))
    assert await call.code() == grpc.StatusCode.OK


async def test_many_concurrent_calls_on_one_channel(echo_server, grpc_proxy) -> None:
    _, addr = echo_server
    proxy, channel = await grpc_proxy(addr)
    unary = channel.unary_unary(f"/{SERVICE}/Unary")
    replies = await asyncio.gather(*(unary(b"%d" % i, timeout=5) for i in range(200)))
    assert replies == [b"echo:%d" % i for i in range(200)]
    assert sample(proxy, "response_total", grpc_status="0") == 200


async def test_a_grpc_error_status_is_relayed_in_trailers(echo_server, grpc_proxy) -> None:
    _, addr = echo_server
    proxy, channel = await grpc_proxy(addr)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(f"/{SERVICE}/Fail")(b"x42", timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details() == "no such thing: x42"
    failed = {"grpc_status": "5", "classification": "failure", "status_code": "200"}
    assert sample(proxy, "response_total", **failed) == 1
    assert sample(proxy, "response_latency_ms_count", **failed) == 1


async def test_a_client_deadline_cancels_the_upstream_call(echo_server, grpc_proxy) -> None:
    echo, addr = echo_server
    _, channel = await grpc_proxy(addr)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(echo.slow_cancelled.wait(), 3)  # the reset reached the server


async def test_an_unreachable_upstream_is_unavailable(grpc_proxy) -> None:
    proxy, channel = await grpc_proxy(("127.0.0.1", 1))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"hello", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details().startswith("connect to 127.0.0.1:1 failed")
    assert sample(proxy, "response_total", grpc_status="14", classification="failure") == 1


async def test_a_thousand_deadline_expiries_leave_other_calls_and_the_connection_alone(
    echo_server, grpc_proxy
) -> None:
    """1,000 calls whose deadline passes (the client resets each one, after the upstream got
    it) beside ordinary calls on the same channel: every deadline is DEADLINE_EXCEEDED, every
    other call succeeds, and the client's one connection lives (no ENHANCE_YOUR_CALM)."""
    _, addr = echo_server
    proxy, channel = await grpc_proxy(addr)
    storm = await deadline_storm(
        channel.unary_unary(f"/{SERVICE}/Slow"), channel.unary_unary(f"/{SERVICE}/Unary")
    )
    assert storm.deadlines == {grpc.StatusCode.DEADLINE_EXCEEDED: 1000}
    assert storm.replies == [b"echo:%d" % i for i in range(100)]
    assert storm.seconds < 10.0
    assert sample(proxy, "http_client_errors_total") == 0  # no GOAWAY, no refused stream


async def test_a_bidi_stream_quiet_for_longer_than_the_idle_timeout_lives(
    echo_server, grpc_proxy
) -> None:
    """A watch or chat stream: the client says something, then nothing for five times the
    connection idle timeout (shortened here; nothing else times a stream), then more."""
    _, addr = echo_server
    _, channel = await grpc_proxy(addr, HttpLimits(idle_timeout=0.2))
    call = channel.stream_stream(f"/{SERVICE}/Chat")(timeout=30)
    await call.write(b"hello")
    assert await call.read() == b"echo:hello"
    await asyncio.sleep(1.0)
    await call.write(b"still here")
    assert await call.read() == b"echo:still here"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
