"""Failure accrual through real sockets: three replicas of a service (HTTP/1.1 and HTTP/2 on
one port, a grpcio server on another), one of them failing every request; the outbound stack
(its listener, detection, the engines, the balancer) over scripted discovery, with and
without failure accrual. Clients are the `h2` library and grpcio; HTTP/1.1 is written by hand
on a socket, as curl would send it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.api.ports import parse_ports
from meshlet.proxy.connections import Connections
from meshlet.proxy.core.accrual import FailureAccrual
from meshlet.proxy.core.endpoints import DiscoveredEndpoint
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.discovery.resolver import Resolver
from meshlet.proxy.http.contract import HttpLimits
from meshlet.proxy.io.connect import tcp_connector
from meshlet.proxy.io.listener import Listener, bind
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.outbound.destinations import Destinations
from meshlet.proxy.outbound.stack import OutboundStack

from .conftest import NS, ScriptedClient, fqn

HTTP = f"{fqn('web')}:80"
GRPC = f"{fqn('web')}:9090"
UNARY = "/meshlet.test.Echo/Unary"
ERROR = wellknown.PROXY_ERROR_HEADER
REQUESTS = 1000
# Ejected after 2 failures in a row; a probe after 1.5 s, then 3 s: over 1,000 requests (well
# under a second each way) 2 failures, those already in flight to it (the HTTP/2 and gRPC
# clients keep four requests going) and a probe at most: >= 99.5 % succeed.
STEADY = FailureAccrual(max_failures=2, min_penalty=1.5, max_penalty=3.0, jitter=0.0)
# Short penalties, for healing and for every replica failing.
QUICK = FailureAccrual(max_failures=3, min_penalty=0.2, max_penalty=0.4, jitter=0.0)


@dataclass
class Replica:
    name: str
    failing: bool = False
    cutting: bool = False  # HTTP/1.1: a 200 head, then the connection closes mid-body
    served: Counter[str] = field(default_factory=Counter)  # by protocol
    http: asyncio.Server | None = None
    grpc: grpc.aio.Server | None = None
    grpc_port: int = 0
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self) -> None:
        self.http = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        server = self.grpc = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(self._unary)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("meshlet.test.Echo", {"Unary": handler}),)
        )
        self.grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

    @property
    def http_port(self) -> int:
        assert self.http is not None
        return int(self.http.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace=None)
        if self.http is not None:
            self.http.close()
            for writer in list(self.writers):
                writer.transport.abort()
            await self.http.wait_closed()

    def _status(self, protocol: str) -> int:
        self.served[protocol] += 1
        return 500 if self.failing else 200

    async def _unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.served["grpc"] += 1
        if self.failing:
            await context.send_initial_metadata(())  # so the status comes in trailers
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} is sick")
        return self.name.encode()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"PRI * HTTP/2.0"):
                await self._h2(head + await reader.readexactly(6), reader, writer)
                return
            while head:
                status = self._status("http/1")
                if self.cutting:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nok")
                    break
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\n\r\nok" % status)
                head = await reader.readuntil(b"\r\n\r\n")
        self.writers.discard(writer)
        writer.close()

    async def _h2(
        self, preface: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        data = preface
        while data:
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    status = self._status("h2")
                    conn.send_headers(event.stream_id, [(":status", str(status)),
                                                        ("content-length", "2")])  # fmt: skip
                    conn.send_data(event.stream_id, b"ok", end_stream=True)
            writer.write(conn.data_to_send())
            data = await reader.read(65536)


@dataclass
class Service:
    replicas: list[Replica]
    client: ScriptedClient

    @property
    def sick(self) -> Replica:
        return self.replicas[0]


def endpoint(pod: str, port: int) -> DiscoveredEndpoint:
    """An unmeshed endpoint on 127.0.0.1, as discovery reports it."""
    return DiscoveredEndpoint(HostPort("127.0.0.1", port), 10_000, (("pod", pod),), None, None,
                              None)  # fmt: skip


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    replicas = [Replica(f"web-{i}") for i in range(3)]
    try:
        for replica in replicas:
            await replica.start()
        replicas[0].failing = True
        client = ScriptedClient()
        for authority_port, port_of in ((80, "http_port"), (9090, "grpc_port")):
            endpoints = [endpoint(r.name, getattr(r, port_of)) for r in replicas]
            client.service("web", authority_port, *endpoints)
        yield Service(replicas, client)
    finally:
        for replica in replicas:
            await replica.stop()


@contextlib.asynccontextmanager
async def outbound(
    service: Service, accrual: FailureAccrual | None
) -> AsyncIterator[tuple[HostPort, ProxyMetrics]]:
    """The outbound stack on a listener of its own, balancing with `accrual`."""
    metrics = ProxyMetrics()
    resolver = Resolver(service.client, profile_timeout=0.5)
    mesh = Destinations(service.client, resolver, None, metrics, connect_timeout=1.0,
                        clock=time.monotonic, rng=random.Random(7),
                        failure_accrual=accrual)  # fmt: skip
    closing = asyncio.Event()
    connections = Connections(metrics, HttpLimits(), tcp_connector(1.0), closing)
    stack = OutboundStack(connections, mesh, self_targets=SelfTargets([]), detect_timeout=1.0,
                          opaque_ports=parse_ports(""))  # fmt: skip
    listener = Listener(bind(HostPort("127.0.0.1", 0)), stack.handle, "outbound")
    task = asyncio.create_task(listener.serve())
    try:
        yield listener.address, metrics
    finally:
        closing.set()
        listener.stop_accepting()
        await listener.drain(grace=1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await connections.aclose()
        await resolver.aclose()


# -- clients: each sends `n` requests and returns (status, meshlet-proxy-error) of each -------

Result = tuple[int, str]
Send = Callable[[HostPort, int], Awaitable[list[Result]]]


async def h1(proxy: HostPort, n: int) -> list[Result]:
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    results = []
    try:
        for _ in range(n):
            writer.write(f"GET / HTTP/1.1\r\nhost: {HTTP}\r\n\r\n".encode())
            head = (await reader.readuntil(b"\r\n\r\n")).decode().lower().split("\r\n")
            fields = dict(line.split(": ", 1) for line in head[1:] if line)
            await reader.readexactly(int(fields.get("content-length", "0")))
            results.append((int(head[0].split()[1]), fields.get(ERROR, "")))
            if fields.get("connection") == "close":
                writer.close()
                reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    finally:
        writer.close()
    return results


async def h2c(proxy: HostPort, n: int, window: int = 4) -> list[Result]:
    """HTTP/2 with prior knowledge, `window` streams at a time."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    results: list[Result] = []
    heads: dict[int, Result] = {}
    try:
        while len(results) < n:
            for _ in range(min(window, n - len(results))):
                stream = conn.get_next_available_stream_id()
                conn.send_headers(stream, [(":method", "GET"), (":scheme", "http"),
                                           (":authority", HTTP), (":path", "/")],
                                  end_stream=True)  # fmt: skip
                heads[stream] = (0, "")
            writer.write(conn.data_to_send())
            while heads:
                data = await reader.read(65536)
                assert data, "the proxy closed the connection"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        fields = {bytes(k).decode(): bytes(v).decode() for k, v in event.headers}
                        heads[event.stream_id] = (int(fields[":status"]), fields.get(ERROR, ""))
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length,
                                                       event.stream_id)  # fmt: skip
                    elif isinstance(event, h2.events.StreamEnded):
                        results.append(heads.pop(event.stream_id))
                writer.write(conn.data_to_send())
    finally:
        writer.close()
    return results


async def grpc_calls(proxy: HostPort, n: int) -> list[Result]:
    """Unary calls, four at a time; a call's result is 200 when it succeeded, else its code's
    number, with the proxy's reason when the proxy answered."""
    options = [("grpc.default_authority", GRPC)]
    results: list[Result] = []
    async with grpc.aio.insecure_channel(str(proxy), options=options) as channel:
        call = channel.unary_unary(UNARY)

        async def one() -> Result:
            try:
                await call(b"hi", timeout=5)
                return 200, ""
            except grpc.aio.AioRpcError as exc:
                metadata = [*(exc.initial_metadata() or ()), *(exc.trailing_metadata() or ())]
                why = next((str(v) for k, v in metadata if k == ERROR), "")
                return exc.code().value[0], why

        while len(results) < n:
            results += await asyncio.gather(*(one() for _ in range(min(4, n - len(results)))))
    return results


SENDERS: dict[str, tuple[Send, str]] = {
    "http/1.1": (h1, "http/1"),
    "h2": (h2c, "h2"),
    "grpc": (grpc_calls, "grpc"),
}
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def ok(results: list[Result]) -> float:
    return sum(status == 200 for status, _ in results) / len(results)


def endpoints(metrics: ProxyMetrics, served_as: str) -> dict[str, float]:
    """`outbound_http_balancer_endpoints` of the service's port, by `endpoint_state`."""
    port = "9090" if served_as == "grpc" else "80"
    pairs = (("group", "core"), ("kind", "Service"), ("namespace", NS), ("name", "web"),
             ("port", port))  # fmt: skip
    labels = {f"{side}_{name}": value for side in ("parent", "backend") for name, value in pairs}
    return {
        state: metrics.registry.get_sample_value(
            "outbound_http_balancer_endpoints", {**labels, "endpoint_state": state}
        )
        or 0.0
        for state in ("ready", "pending")
    }


@pytest.mark.parametrize("protocol", list(SENDERS))
async def test_failure_accrual_keeps_a_failing_replica_out_heals_and_fails_fast(
    service: Service, protocol: str
) -> None:
    send, served_as = SENDERS[protocol]
    async with outbound(service, None) as (proxy, _):
        without = ok(await send(proxy, REQUESTS))
    # Without accrual the failing replica keeps a share (a third when the replicas' latencies
    # tie; P2C on peak EWMA gives it more or less, as its fast 500s compare with the others':
    # 11.5 % once on a machine busy with two other suites). What matters is the contrast with
    # accrual below, which lets at most one failure in 200 through.
    assert without <= 0.95, without
    assert service.sick.served[served_as] >= 0.05 * REQUESTS

    async with outbound(service, STEADY) as (proxy, metrics):
        started = time.monotonic()
        with_accrual = ok(await send(proxy, REQUESTS))
        took = time.monotonic() - started
    assert with_accrual >= 0.995, (with_accrual, took)

    async with outbound(service, QUICK) as (proxy, metrics):
        await send(proxy, 50)  # ejected
        assert endpoints(metrics, served_as) == {"ready": 2, "pending": 1}
        before = service.sick.served[served_as]
        service.sick.failing = False
        await asyncio.sleep(QUICK.max_penalty)
        assert ok(await send(proxy, 300)) == 1.0
        assert service.sick.served[served_as] - before > 30  # a probe, then its share again

        for replica in service.replicas:
            replica.failing = True
        await send(proxy, 30)  # each fails three in a row: all ejected
        assert endpoints(metrics, served_as) == {"ready": 0, "pending": 3}
        started = time.monotonic()
        results = await send(proxy, 20)
        fast = time.monotonic() - started
        expected = UNAVAILABLE if protocol == "grpc" else 503
        refused = [why for status, why in results if status == expected and why]
        assert len(refused) >= 18  # a probe or two may be due meanwhile
        assert "ejected by failure accrual" in refused[0] and fqn("web") in refused[0]
        assert fast < 1.0
        assert (metrics.registry.get_sample_value(
            "fail_fast_total", {"direction": "outbound", "reason": "all_endpoints_ejected"}
        ) or 0) >= 18  # fmt: skip


async def test_http1_responses_cut_mid_body_count_as_failures(service: Service) -> None:
    """A replica sends a 200 head and closes the connection mid-body: each client sees its
    connection cut, and after three in a row the replica is ejected."""
    service.sick.failing, service.sick.cutting = False, True
    cut = 0
    seen = []  # the balancer's endpoints after each request
    async with outbound(service, QUICK) as (proxy, metrics):
        for _ in range(40):
            reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
            writer.write(f"GET / HTTP/1.1\r\nhost: {HTTP}\r\n\r\n".encode())
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(100 if b"content-length: 100" in head.lower() else 2)
            except (asyncio.IncompleteReadError, ConnectionError):
                cut += 1
            writer.close()
            seen.append(endpoints(metrics, "http/1"))
    # ejected after the third cut (on a busy machine the short penalty may be over, and the
    # replica up for a probe again, by the last request: the state is read after each one)
    assert {"ready": 2, "pending": 1} in seen, seen
    # three in a row, then only probes (one each time a penalty is over): each one cut
    assert cut >= 3 and cut == service.sick.served["http/1"], (cut, service.sick.served)
