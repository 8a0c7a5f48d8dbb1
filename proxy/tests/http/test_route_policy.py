"""A request's route policy, one table of behaviours run against both engines (they share one
request driver, http/attempts.py): retries within the budget and its time window, retries on
another endpoint, failover of connections, timeouts that answer 504 and cancel the upstream
and that count discovery waits, latency from arrival, and per-route metrics. Real sockets on
127.0.0.1: clients, the engine under a listener, and upstreams whose answer to each request is
scripted."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest

from meshlet.proxy.core.retry_budget import RetryBudget
from meshlet.proxy.core.routes import RoutePolicy
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
from meshlet.proxy.http.h1 import serve_h1
from meshlet.proxy.http.h2server import serve_h2
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Accepted, Listener, bind
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.lease import RecordingLease

ROUTE = "GET /items/{id}"


@dataclass
class Script:
    """What the upstream does with its n-th request (0-based): a status, after a delay; or
    `reset` it before answering."""

    status: Callable[[int], int] = lambda n: 200
    delay: float = 0.0
    reset: Callable[[int], bool] = lambda n: False
    seen: list[str] = field(default_factory=list)  # method and path of each request
    cancelled: int = 0  # requests whose client (the proxy) went away before the answer

    def next(self) -> int:
        return len(self.seen)


# -- upstreams ------------------------------------------------------------------------------


async def h1_upstream(script: Script) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gone = (ConnectionError, asyncio.IncompleteReadError)
        with contextlib.closing(writer), contextlib.suppress(*gone):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = script.next()
                script.seen.append(head.split(b"\r\n", 1)[0].rsplit(b" ", 1)[0].decode())
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                await reader.readexactly(length)
                if script.reset(n):
                    writer.transport.abort()
                    return
                if script.delay:
                    try:
                        await asyncio.wait_for(reader.read(1), script.delay)
                        script.cancelled += 1  # the proxy closed the connection: a cancel
                        return
                    except TimeoutError:
                        pass
                body = b"answer %d" % n
                status = script.status(n)
                head = b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (status, len(body))
                writer.write(head + body)
                await writer.drain()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


class H2Upstream(asyncio.Protocol):
    def __init__(self, script: Script) -> None:
        self.script = script
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.transport: Any = None
        self.waiting: dict[int, asyncio.TimerHandle] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                fields = dict(event.headers or ())
                n = self.script.next()
                self.script.seen.append(
                    f"{fields[b':method'].decode()} {fields[b':path'].decode()}"
                )
                if self.script.reset(n):
                    self.h2.reset_stream(event.stream_id, 2)  # INTERNAL_ERROR
                else:
                    loop = asyncio.get_running_loop()
                    self.waiting[event.stream_id] = loop.call_later(
                        self.script.delay, self.answer, event.stream_id, n
                    )
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length or 0,
                                                  event.stream_id)  # fmt: skip
            elif isinstance(event, h2.events.StreamReset):
                timer = self.waiting.pop(event.stream_id, None)
                if timer is not None:
                    timer.cancel()
                    self.script.cancelled += 1
        self.transport.write(self.h2.data_to_send())

    def answer(self, stream_id: int, n: int) -> None:
        self.waiting.pop(stream_id, None)
        body = b"answer %d" % n
        self.h2.send_headers(stream_id, [(":status", str(self.script.status(n))),
                                         ("content-length", str(len(body)))])  # fmt: skip
        self.h2.send_data(stream_id, body, end_stream=True)
        self.transport.write(self.h2.data_to_send())


# -- the engine under test, routed by a route with a policy -----------------------------------


@dataclass
class Policy:
    retryable: bool = False
    timeout: float | None = None
    budget: RetryBudget | None = None
    route_wait: float = 0.0  # routing waits this long (discovery not yet answered)


class Spread:
    """Balanced picks over endpoints in order, avoiding the one a retry comes from; each pick
    with a lease of its own (so a failed connection may be tried elsewhere)."""

    def __init__(self, addrs: list[tuple[str, int]]) -> None:
        self.addrs = addrs
        self.leases: list[RecordingLease] = []

    def pick(self, after: Endpoint | None = None) -> Endpoint:
        addr = next(a for a in self.addrs if after is None or a != after.addr)
        self.leases.append(RecordingLease())
        return Endpoint(addr, "items:80", lease=self.leases[-1])


def refused_addr() -> tuple[str, int]:
    """An address nothing listens on (a port bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    addr: tuple[str, int] = sock.getsockname()
    sock.close()
    return addr


@dataclass
class Engine:
    port: int
    metrics: ProxyMetrics
    h2: bool

    def sample(self, name: str, **labels: str) -> float:
        total = 0.0
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total


@pytest.fixture(params=["http/1.1", "h2"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Awaitable[Engine]]]:
    started: list[tuple[Listener, asyncio.Task[None]]] = []
    servers: list[asyncio.Server] = []
    use_h2 = request.param == "h2"

    async def start(
        script: Script, policy: Policy, *more: Script, dead_first: bool = False
    ) -> Engine:
        """An engine routing to `script`'s upstream, or balancing over it and `more`'s (a
        refused address first, with `dead_first`)."""
        loop = asyncio.get_running_loop()
        addrs = [refused_addr()] if dead_first else []
        for each in (script, *more):
            if use_h2:
                server = await loop.create_server(lambda s=each: H2Upstream(s), "127.0.0.1", 0)
            else:
                server = await h1_upstream(each)
            servers.append(server)
            addrs.append(server.sockets[0].getsockname()[:2])
        metrics = ProxyMetrics()
        picker = FixedPicker(Endpoint(addrs[0], "items:80")) if len(addrs) == 1 else Spread(addrs)
        route = RouteTarget("items.ns.svc.cluster.local:80",
                            RoutePolicy(ROUTE, policy.timeout, policy.retryable),
                            policy.budget, picker)  # fmt: skip

        class Router:
            def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
                return Wait(self._later, request) if policy.route_wait else route

            async def _later(self, request: RequestTarget) -> RouteTarget | RouteError:
                await asyncio.sleep(policy.route_wait)
                return route

        closing = asyncio.Event()

        async def handle(accepted: Accepted) -> None:
            labels = metrics.conn("outbound", "items:80")
            conn = HttpConn(accepted.sock, Router(), tcp_connector(1.0), metrics, labels,
                            HttpLimits(), closing)  # fmt: skip
            await (serve_h2 if use_h2 else serve_h1)(conn)

        listener = Listener(bind(("127.0.0.1", 0)), handle, "outbound")
        started.append((listener, asyncio.create_task(listener.serve())))
        return Engine(listener.address[1], metrics, use_h2)

    yield start
    for listener, task in started:
        listener.stop_accepting()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await listener.drain(grace=1.0)
    for server in servers:
        server.close()


async def get(engine: Engine, count: int, method: str = "GET") -> list[tuple[int, bytes]]:
    """`count` requests one after the other on one connection: (status, response head or
    headers as bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    results = []
    try:
        if engine.h2:
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            for i in range(count):
                stream_id = 1 + 2 * i
                conn.send_headers(stream_id, [(":method", method), (":scheme", "http"),
                                              (":authority", "items"), (":path", f"/items/{i}")],
                                  end_stream=True)  # fmt: skip
                writer.write(conn.data_to_send())
                status, head = 0, b""
                async with asyncio.timeout(10):
                    while not status:
                        data = await reader.read(65536)
                        assert data, "the proxy closed the connection"
                        for event in conn.receive_data(data):
                            if isinstance(event, h2.events.ResponseReceived):
                                fields = dict(event.headers or ())
                                status = int(fields[b":status"])
                                head = b"\n".join(b"%s: %s" % kv for kv in fields.items())
                        writer.write(conn.data_to_send())
                results.append((status, head))
        else:
            for i in range(count):
                writer.write(f"{method} /items/{i} HTTP/1.1\r\nHost: items\r\n\r\n".encode())
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
                    await reader.readexactly(length)
                results.append((int(head.split(b" ")[1]), head))
    finally:
        writer.close()
    return results


def every_fifth_fails(n: int) -> int:
    return 500 if n % 5 == 4 else 200


async def test_a_retryable_route_hides_failures_its_twin_shows(engine: Any) -> None:
    """One attempt in five fails with 500: the retryable route answers every request; the
    same upstream behind a route that is not retryable fails one in five."""
    retried = await engine(Script(status=every_fifth_fails), Policy(retryable=True))
    twin = await engine(Script(status=every_fifth_fails), Policy(retryable=False))
    ok = sum(status == 200 for status, _ in await get(retried, 100))
    assert ok == 100
    assert sum(status == 200 for status, _ in await get(twin, 100)) == 80
    assert retried.sample("route_actual_request_total", rt_route=ROUTE) == 124  # 100 + retries
    assert retried.sample("route_request_total", rt_route=ROUTE) == 100
    assert retried.sample("route_response_total", rt_route=ROUTE, classification="success") == 100
    assert retried.sample("route_actual_response_total", rt_route=ROUTE,
                          classification="failure") == 24  # fmt: skip


async def test_the_budget_caps_retries_when_everything_fails(engine: Any) -> None:
    """Every attempt fails: retries stop at the budget (20 % of requests, no floor here), so
    retries do not multiply the load on a failing service."""
    script = Script(status=lambda n: 503)
    budget = RetryBudget(0.2, 0, 10.0, now=asyncio.get_running_loop().time())
    proxy = await engine(script, Policy(retryable=True, budget=budget))
    results = await get(proxy, 50)
    assert all(status == 503 for status, _ in results)  # the upstream's own answer, passed on
    retries = len(script.seen) - 50
    assert 0 < retries <= 10  # 0.2 x 50
    # Each request ends with one retry the budget refused (after its first failure, or after
    # the failure of the one retry it got).
    assert proxy.sample("retry_skipped_total", rt_route=ROUTE) == 50


async def test_a_route_timeout_answers_504_and_cancels_the_upstream(engine: Any) -> None:
    script = Script(delay=1.5)
    proxy = await engine(script, Policy(timeout=0.2))
    loop = asyncio.get_running_loop()
    started = loop.time()
    ((status, head),) = await get(proxy, 1)
    elapsed = loop.time() - started
    assert status == 504
    assert b"timeout of 0.2s passed" in head
    # The timeout (the loop's timers round to whole milliseconds), not the upstream's 1.5 s;
    # the rest is slack for a busy machine.
    assert 0.199 <= elapsed < 1.0
    async with asyncio.timeout(3):
        while script.cancelled == 0:  # noqa: ASYNC110 - the upstream notices the cancel
            await asyncio.sleep(0.02)
    assert script.cancelled == 1
    assert proxy.sample("route_response_total", rt_route=ROUTE, status_code="504") == 1


async def test_a_reset_before_the_response_retries_idempotent_requests_once(engine: Any) -> None:
    """Not a retryable route: a GET the upstream reset is sent once more (and succeeds); a POST
    is not (502)."""
    script = Script(reset=lambda n: n in (0, 2))
    proxy = await engine(script, Policy())
    ((status, _),) = await get(proxy, 1)
    assert status == 200
    assert script.seen == ["GET /items/0", "GET /items/0"]
    ((status, _),) = await get(proxy, 1, method="POST")
    assert status == 502
    assert len(script.seen) == 3


async def test_without_a_budget_no_status_is_retried(engine: Any) -> None:
    """A failure status on a route that is not retryable is the client's answer."""
    script = Script(status=lambda n: 500 if n == 0 else 200)
    proxy = await engine(script, Policy(retryable=False))
    ((status, _),) = await get(proxy, 1)
    assert status == 500 and len(script.seen) == 1


async def test_a_retry_goes_to_another_endpoint(engine: Any) -> None:
    failing, healthy = Script(status=lambda n: 500), Script()
    proxy = await engine(failing, Policy(retryable=True), healthy)
    ((status, _),) = await get(proxy, 1)
    assert status == 200
    assert failing.seen == ["GET /items/0"] and healthy.seen == ["GET /items/0"]


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_a_refused_connection_is_tried_on_another_endpoint(engine: Any, method: str) -> None:
    """Nothing was sent: any method goes elsewhere, and the balancer is told the endpoint
    failed."""
    script = Script()
    proxy = await engine(script, Policy(), dead_first=True)
    ((status, _),) = await get(proxy, 1, method=method)
    assert status == 200 and script.seen == [f"{method} /items/0"]


async def test_a_discovery_wait_counts_against_the_route_timeout(engine: Any) -> None:
    script = Script()
    proxy = await engine(script, Policy(timeout=0.2, route_wait=0.5))
    ((status, head),) = await get(proxy, 1)
    assert status == 504 and b"timeout of 0.2s passed" in head
    assert proxy.sample("response_total", status_code="504") == 1


async def test_latency_runs_from_the_requests_arrival(engine: Any) -> None:
    """Routing waited 0.3 s (discovery): the latency recorded includes it."""
    proxy = await engine(Script(), Policy(route_wait=0.3))
    ((status, _),) = await get(proxy, 1)
    assert status == 200
    latency = proxy.sample("response_latency_ms_sum", status_code="200")
    assert 300 - 1e-6 <= latency < 5000  # the loop clock's float arithmetic, not a shortfall


@pytest.mark.parametrize(("ttl", "pause", "retried"), [(10.0, 0.0, True), (1.0, 1.2, False)],
                         ids=["within the window", "after it"])  # fmt: skip
async def test_the_budgets_window_runs_on_the_engines_clock(
    engine: Any, ttl: float, pause: float, retried: bool
) -> None:
    """Four failing requests deposit 0.8 of a retry (20 %, no floor); a fifth gets its retry
    while they are within the budget's window, not once they slid out of it."""
    script = Script(status=lambda n: 503)
    budget = RetryBudget(0.2, 0, ttl, now=asyncio.get_running_loop().time())
    proxy = await engine(script, Policy(retryable=True, budget=budget))
    await get(proxy, 4)
    assert len(script.seen) == 4
    await asyncio.sleep(pause)
    await get(proxy, 1)
    assert len(script.seen) == 5 + retried
