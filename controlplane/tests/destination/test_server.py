"""The destination service over real gRPC on 127.0.0.1, fed by the manifests source."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from meshlet.api import addr, destination_pb2, destination_pb2_grpc
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.events import Event
from meshlet.controlplane.k8s.manifests import ManifestsFolder, ManifestsSource
from meshlet.controlplane.supervise import MAX_FAILURES

WEB = "web.emojivoto.svc.cluster.local:80"


Cluster = ManifestsFolder  # the cluster, as its manifests folder says


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    root = tmp_path / "manifests"
    root.mkdir()
    return Cluster(root)


async def start(cluster: Cluster, **overrides: Any) -> DestinationServer:
    config = DestinationConfig(
        **{
            "addr": HostPort("127.0.0.1", 0),
            "admin_addr": HostPort("127.0.0.1", 0),
            "source": ManifestsSource(cluster.root, poll_interval=0.02),
            "derive_from_pods": True,
            **overrides,
        }
    )
    server = DestinationServer(config)
    await server.start()
    for _ in range(100):
        if server.ready():
            break
        await asyncio.sleep(0.02)
    assert server.ready()
    return server


@pytest.fixture
async def server(cluster: Cluster) -> AsyncIterator[DestinationServer]:
    srv = await start(cluster)
    yield srv
    await srv.stop(grace=0)


@pytest.fixture
async def stub(server: DestinationServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield destination_pb2_grpc.DestinationStub(channel)


def describe(update: destination_pb2.Update) -> tuple[str, Any]:
    kind = update.WhichOneof("update")
    if kind == "no_endpoints":
        return kind, update.no_endpoints.exists
    entries = update.add.addrs if kind == "add" else update.remove.addrs
    tcps = [e.addr for e in entries] if kind == "add" else list(entries)
    return kind, sorted(f"{ip}:{port}" for ip, port in map(addr.tcp_from_proto, tcps))


async def next_update(stream: Any) -> tuple[str, Any]:
    async with asyncio.timeout(3.0):
        return describe(await stream.read())


def web_pod(name: str, ip: str, **kw: Any) -> dict[str, Any]:
    return objects.pod(name, ip, **kw)


async def test_get_follows_the_cluster(cluster: Cluster, stub: Any) -> None:
    stream = stub.Get(destination_pb2.GetDestination(path=WEB))
    assert await next_update(stream) == ("no_endpoints", False)  # unknown service

    cluster.put("svc", objects.service("web"))
    assert await next_update(stream) == ("no_endpoints", True)  # exists, no endpoints

    cluster.put("web-1", web_pod("web-1", "10.0.0.1"))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080"])

    cluster.put("web-2", web_pod("web-2", "10.0.0.2"))
    assert await next_update(stream) == ("add", ["10.0.0.2:8080"])  # a delta, not the set

    cluster.remove("web-1")  # pod deleted
    assert await next_update(stream) == ("remove", ["10.0.0.1:8080"])

    cluster.remove("web-2")
    assert await next_update(stream) == ("remove", ["10.0.0.2:8080"])
    assert await next_update(stream) == ("no_endpoints", True)

    cluster.put("web-3", web_pod("web-3", "10.0.0.3"))
    assert await next_update(stream) == ("add", ["10.0.0.3:8080"])
    cluster.remove("svc")  # service deleted
    assert await next_update(stream) == ("remove", ["10.0.0.3:8080"])
    assert await next_update(stream) == ("no_endpoints", False)
    cluster.put("svc", objects.service("web"))  # and re-created
    assert await next_update(stream) == ("add", ["10.0.0.3:8080"])
    stream.cancel()


async def test_endpoint_slices_take_precedence_and_readiness_counts(
    cluster: Cluster, server: DestinationServer, stub: Any
) -> None:
    cluster.put("svc", objects.service("web"))
    cluster.put("pods", web_pod("web-1", "10.0.0.1"), web_pod("web-2", "10.0.0.2"))
    cluster.put("slice", objects.endpoint_slice("web-a", "web", [("10.0.0.1", True, "web-1")]))
    state = server.state
    await applied(lambda: bool(state.slices_of(("emojivoto", "web"))) and len(state.pods) == 2)
    stream = stub.Get(destination_pb2.GetDestination(path=WEB))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080"])
    cluster.put(
        "slice",
        objects.endpoint_slice(
            "web-a", "web", [("10.0.0.1", False, "web-1"), ("10.0.0.2", True, "web-2")]
        ),
    )
    assert await next_update(stream) == ("add", ["10.0.0.2:8080"])
    assert await next_update(stream) == ("remove", ["10.0.0.1:8080"])
    stream.cancel()


@pytest.mark.parametrize(
    "path",
    [
        "10.1.2.3:8080",
        "",
        "web.emojivoto.svc.cluster.local:0",
        "web.emojivoto.svc.cluster.local:70000",
        "x" * 300 + ".emojivoto.svc.cluster.local:80",
        "wéb.emojivoto.svc.cluster.local:80",
        "example.com:80",
    ],
)
async def test_bad_paths_are_invalid_argument(stub: Any, path: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Get(destination_pb2.GetDestination(path=path)).read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_namespace_does_not_exist(stub: Any) -> None:
    stream = stub.Get(destination_pb2.GetDestination(path="web.nowhere.svc.cluster.local:80"))
    assert await next_update(stream) == ("no_endpoints", False)
    stream.cancel()


async def test_streams_opened_and_dropped_leave_nothing(
    server: DestinationServer, stub: Any
) -> None:
    for batch in range(20):  # 10,000 streams, 500 open at a time
        streams = [
            stub.Get(destination_pb2.GetDestination(path=f"s{batch}-{i}.ns.svc.cluster.local:80"))
            for i in range(500)
        ]
        for stream in streams:
            await stream.read()
        assert server.limits.active == 500
        for stream in streams:
            stream.cancel()
    for _ in range(100):
        if server.limits.active == 0 and server.publishers.counts == (0, 0):
            break
        await asyncio.sleep(0.02)
    assert server.limits.active == 0
    assert server.publishers.counts == (0, 0)


async def test_streams_per_client_are_capped(cluster: Cluster) -> None:
    srv = await start(cluster, max_streams_per_peer=5)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            stub = destination_pb2_grpc.DestinationStub(channel)
            held = [stub.Get(destination_pb2.GetDestination(path=WEB)) for _ in range(5)]
            for stream in held:
                await stream.read()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Get(destination_pb2.GetDestination(path=WEB)).read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held[0].cancel()
            async with asyncio.timeout(10):  # the server sees the cancel: a slot frees up
                while True:
                    again = stub.Get(destination_pb2.GetDestination(path=WEB))
                    try:
                        first = await again.read()
                        break
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        await asyncio.sleep(0.02)
            assert first.WhichOneof("update") == "no_endpoints"
            for stream in [*held, again]:
                stream.cancel()
    finally:
        await srv.stop(grace=0)


def stuck_client(port: int, path: str) -> tuple[socket.socket, h2.connection.H2Connection]:
    """An HTTP/2 client that opens a Get stream with a zero flow-control window and then
    never reads: the server cannot send it anything."""
    sock = socket.create_connection(("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    )
    conn.initiate_connection()
    body = destination_pb2.GetDestination(path=path).SerializeToString()
    conn.send_headers(
        1,
        [
            (":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
            (":path", "/io.linkerd.proxy.destination.Destination/Get"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ],
    )  # fmt: skip
    conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    sock.sendall(conn.data_to_send())
    return sock, conn


def catch_up(sock: socket.socket, conn: h2.connection.H2Connection) -> dict[bytes, bytes]:
    """The stuck client opens its window and reads until the stream's trailers."""
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    conn.increment_flow_control_window(1 << 20)
    sock.sendall(conn.data_to_send())
    sock.settimeout(10)
    while True:
        data = sock.recv(65536)
        assert data, "the server closed the connection without trailers"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length or 0, 1)
            if isinstance(event, h2.events.TrailersReceived):
                return dict(event.headers or ())
        sock.sendall(conn.data_to_send())


async def test_a_stuck_client_never_delays_others(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that stops reading overflows its queue: it gets no more updates (and no
    publisher keeps it), the others are served without delay, and once it reads again it is
    told RESOURCE_EXHAUSTED; it holds its stream slot until then. Nothing logs an error."""
    srv = await start(cluster, stream_queue=4)
    sock, conn = await asyncio.to_thread(stuck_client, srv.grpc_port, WEB)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            stub = destination_pb2_grpc.DestinationStub(channel)
            healthy = stub.Get(destination_pb2.GetDestination(path=WEB))
            assert await next_update(healthy) == ("no_endpoints", False)
            for _ in range(50):
                if srv.limits.active == 2:
                    break
                await asyncio.sleep(0.02)
            assert srv.limits.active == 2
            cluster.put("svc", objects.service("web"))
            assert await next_update(healthy) == ("no_endpoints", True)
            for i in range(1, 12):
                loop = asyncio.get_running_loop()
                started = loop.time()
                cluster.put(f"pod-{i}", web_pod(f"web-{i}", f"10.0.0.{i}"))
                assert await next_update(healthy) == ("add", [f"10.0.0.{i}:8080"])
                assert loop.time() - started < 1.0
            overflow = srv.registry.get_sample_value(
                "destination_stream_overflow_total", {"method": "Get"}
            )
            assert overflow == 1.0
            healthy.cancel()
            for _ in range(100):
                if srv.publishers.counts == (0, 0):
                    break
                await asyncio.sleep(0.02)
            assert srv.publishers.counts == (0, 0)  # the stuck stream is subscribed to nothing
            assert srv.limits.active == 1  # but its call is not over: it keeps its slot
            trailers = await asyncio.to_thread(catch_up, sock, conn)
            assert trailers[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
            assert b"the client fell behind" in trailers[b"grpc-message"]
            for _ in range(100):
                if srv.limits.active == 0:
                    break
                await asyncio.sleep(0.02)
            assert srv.limits.active == 0
    finally:
        sock.close()
        await srv.stop(grace=0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def burst_client(
    port: int, source: str, path: str, held: list[socket.socket]
) -> tuple[str, str]:
    """One Get stream on its own connection from `source`, left open (in `held`):
    (grpc-status, grpc-message) of its end, or ("data", "") when it was admitted."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    held.append(sock)
    sock.setblocking(False)
    sock.bind((source, 0))
    await loop.sock_connect(sock, ("127.0.0.1", port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    body = destination_pb2.GetDestination(path=path).SerializeToString()
    conn.send_headers(
        1,
        [(":method", "POST"), (":scheme", "http"), (":authority", "destination"),
         (":path", "/io.linkerd.proxy.destination.Destination/Get"),
         ("content-type", "application/grpc"), ("te", "trailers")],
    )  # fmt: skip
    conn.send_data(1, b"\x00" + len(body).to_bytes(4, "big") + body, end_stream=True)
    await loop.sock_sendall(sock, conn.data_to_send())
    async with asyncio.timeout(30):
        while data := await loop.sock_recv(sock, 65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    return "data", ""
                if isinstance(event, h2.events.StreamReset):
                    return "reset", str(event.error_code)
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    fields = dict(event.headers or ())
                    if b"grpc-status" in fields:
                        return fields[b"grpc-status"].decode(), fields.get(
                            b"grpc-message", b""
                        ).decode()
            await loop.sock_sendall(sock, conn.data_to_send())
    return "closed", ""


async def test_a_burst_from_many_addresses_is_refused_with_a_reason(cluster: Cluster) -> None:
    """1,500 streams at once from 1,500 addresses against a cap of 300: past gRPC core's own
    queue limits (1,000) core used to drop calls at random, which clients saw as a bare
    CANCELLED. Every stream is now admitted or refused RESOURCE_EXHAUSTED with its reason."""
    srv = await start(cluster, max_streams=300)
    held: list[socket.socket] = []
    try:
        results = await asyncio.gather(*(
            burst_client(srv.grpc_port, f"127.0.{1 + i // 250}.{1 + i % 250}",
                         f"s{i}.ns.svc.cluster.local:80", held)
            for i in range(1500)
        ))  # fmt: skip
    finally:
        for sock in held:
            sock.close()
        await srv.stop(grace=0)
    outcomes = Counter(results)
    assert outcomes == {
        ("data", ""): 300,
        ("8", "the server holds its maximum of 300 streams"): 1200,
    }, outcomes


async def test_admin_reports_streams_and_handled(server: DestinationServer, stub: Any) -> None:
    stream = stub.Get(destination_pb2.GetDestination(path=WEB))
    await stream.read()
    assert server.registry.get_sample_value("destination_streams_active", {"method": "Get"}) == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Get(destination_pb2.GetDestination(path="1.2.3.4:80")).read()
    assert server.registry.get_sample_value(
        "grpc_server_handled_total",
        {"grpc_type": "server_stream", "grpc_service": "io.linkerd.proxy.destination.Destination",
         "grpc_method": "Get", "grpc_code": "INVALID_ARGUMENT"},
    ) == 1.0  # fmt: skip
    stream.cancel()


async def applied(condition: Callable[[], bool]) -> None:
    """Until the server's state shows what the test put in the folder."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - the source polls the folder
            await asyncio.sleep(0.02)


async def next_profile(stream: Any) -> destination_pb2.DestinationProfile:
    async with asyncio.timeout(3.0):
        message: destination_pb2.DestinationProfile = await stream.read()
        return message


ROUTES = {
    "routes": [
        {
            "name": "GET /api/list",
            "condition": {"method": "GET", "pathRegex": "/api/list"},
            "isRetryable": True,
            "timeout": "300ms",
        }
    ]
}


async def test_get_profile_by_name_follows_its_service_profile(
    cluster: Cluster, server: DestinationServer, stub: Any
) -> None:
    cluster.put("svc", objects.service("web"))
    await applied(lambda: ("emojivoto", "web") in server.state.services)
    stream = stub.GetProfile(destination_pb2.GetDestination(path=WEB))
    first = await next_profile(stream)
    assert first.fully_qualified_name == "web.emojivoto.svc.cluster.local"
    assert list(first.routes) == []
    assert first.retry_budget.retry_ratio == pytest.approx(0.2)
    assert first.retry_budget.min_retries_per_second == 10
    assert first.retry_budget.ttl.seconds == 10

    cluster.put("profile", objects.profile("web", ROUTES))
    second = await next_profile(stream)
    [route] = second.routes
    assert route.is_retryable
    assert route.timeout.ToMilliseconds() == 300
    assert dict(route.metrics_labels) == {"route": "GET /api/list"}

    cluster.put("profile", objects.profile("web", {"routes": [{"name": "x"}]}))  # invalid
    third = await next_profile(stream)
    assert list(third.routes) == []  # the default, not a half-parsed profile
    stream.cancel()


async def test_get_profile_by_ip(cluster: Cluster, server: DestinationServer, stub: Any) -> None:
    cluster.put("svc", objects.service("web", cluster_ip="10.96.0.10"))
    cluster.put("pod", web_pod("web-1", "10.0.0.1"))
    cluster.put("db", objects.service("db", ports=[("mysql", 3306, 3306)], cluster_ip="10.96.0.20"))
    state = server.state
    await applied(  # read from the folder (a sleep was not always enough on a busy machine)
        lambda: None not in (state.service_at("10.96.0.10"), state.service_at("10.96.0.20"),
                             state.pod_at("10.0.0.1"))
    )  # fmt: skip

    by_cluster_ip = stub.GetProfile(destination_pb2.GetDestination(path="10.96.0.10:80"))
    profile = await next_profile(by_cluster_ip)
    assert profile.fully_qualified_name == "web.emojivoto.svc.cluster.local"
    assert not profile.HasField("endpoint")

    by_pod_ip = stub.GetProfile(destination_pb2.GetDestination(path="10.0.0.1:8080"))
    profile = await next_profile(by_pod_ip)
    assert profile.fully_qualified_name == ""
    ip, port = addr.tcp_from_proto(profile.endpoint.addr)
    assert (str(ip), port) == ("10.0.0.1", 8080)
    assert profile.endpoint.tls_identity.dns_like_identity.name.startswith("web.emojivoto.")

    opaque = stub.GetProfile(destination_pb2.GetDestination(path="10.96.0.20:3306"))
    assert (await next_profile(opaque)).opaque_protocol

    unknown = stub.GetProfile(destination_pb2.GetDestination(path="192.0.2.1:80"))
    profile = await next_profile(unknown)
    assert profile.fully_qualified_name == ""
    assert not profile.opaque_protocol
    for stream in (by_cluster_ip, by_pod_ip, opaque, unknown):
        stream.cancel()


class BreakingSource:
    """The manifests source with a sink that raises while `breaks` is above zero, as a bug in
    applying an event would: the source's run dies with it. A run after the first waits for
    `resume`, and is not synced until it has listed again."""

    def __init__(self, root: Path) -> None:
        self._source = ManifestsSource(root, poll_interval=0.02)
        self.breaks = 0
        self.runs = 0
        self.resume = asyncio.Event()
        self._waiting = False

    @property
    def synced(self) -> bool:
        return not self._waiting and self._source.synced

    async def run(self, sink: Callable[[Event], None]) -> None:
        self.runs += 1
        if self.runs > 1:
            self._waiting = True
            await self.resume.wait()
            self._waiting = False

        def apply(event: Event) -> None:
            if self.breaks:
                self.breaks -= 1
                raise RuntimeError("cannot apply the event")
            sink(event)

        await self._source.run(apply)


async def get_status(port: int, path: str) -> int:
    """The status of GET `path` from the admin server, over a real connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode())
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


async def status_becomes(port: int, path: str, status: int, within: float = 20.0) -> None:
    async with asyncio.timeout(within):
        while await get_status(port, path) != status:  # noqa: ASYNC110 - polls over HTTP
            await asyncio.sleep(0.005)


async def test_a_dead_source_makes_it_unready_at_once_until_restarted(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = BreakingSource(cluster.root)
    server = await start(cluster, source=source)
    try:
        cluster.put("svc", objects.service("web"))
        await applied(lambda: ("emojivoto", "web") in server.state.services)
        assert await get_status(server.admin_port, "/ready") == 200
        source.breaks = 1
        with caplog.at_level(logging.ERROR):
            cluster.put("web-1", web_pod("web-1", "10.0.0.1"))  # this change kills the source
            await status_becomes(server.admin_port, "/ready", 503)
        assert "the cluster-state source stopped (RuntimeError: cannot apply the event)" in (
            caplog.text
        )
        await applied(lambda: source.runs == 2)  # restarted, after a backoff
        assert await get_status(server.admin_port, "/ready") == 503  # not listed again yet
        source.resume.set()
        await status_becomes(server.admin_port, "/ready", 200)
        assert server.state.pod_named("emojivoto", "web-1") is not None  # listed again
    finally:
        await server.stop(grace=0)


async def test_a_source_that_keeps_dying_ends_the_service_with_exit_code_1(
    cluster: Cluster,
) -> None:
    source = BreakingSource(cluster.root)
    source.breaks = 1_000_000  # every run dies on its first event
    source.resume.set()
    server = DestinationServer(
        DestinationConfig(
            addr=("127.0.0.1", 0), admin_addr=("127.0.0.1", 0), source=source,
            derive_from_pods=True,
        )
    )  # fmt: skip
    async with asyncio.timeout(60):
        code = await serve_until_signalled(server, "destination")
    assert code == 1
    assert source.runs == MAX_FAILURES
    assert server.supervisor.failure is not None
    assert server.supervisor.failure.startswith(
        f"the cluster-state source failed {MAX_FAILURES} times in a row"
    )
    with pytest.raises(ConnectionRefusedError):  # stopped: the admin server is closed
        await get_status(server.admin_port, "/ready")
