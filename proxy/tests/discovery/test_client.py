"""The grpclib client against the real destination service on 127.0.0.1: TLS verified by name
against the anchors, refusal of impossible paths, and reconnection with backoff."""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from meshlet.api import destination_grpc, destination_pb2
from meshlet.api.hostport import HostPort
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.identity import ca
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder, ManifestsSource
from meshlet.proxy.core.endpoints import Add, NoEndpoints
from meshlet.proxy.discovery.client import Backoff, DestinationClient, StreamRefused
from meshlet.proxy.identity.anchors import TrustAnchors

DEST_ID = "meshlet-destination.meshlet.serviceaccount.identity.meshlet.cluster.local"
WEB = "web.emojivoto.svc.cluster.local:80"


async def start_server(
    root: Path, port: int = 0, tls: tuple[Path, Path] | None = None
) -> DestinationServer:
    server = DestinationServer(
        DestinationConfig(
            addr=HostPort("127.0.0.1", port),
            admin_addr=HostPort("127.0.0.1", 0),
            source=ManifestsSource(root, poll_interval=0.02),
            derive_from_pods=True,
            tls=tls,
        )
    )
    await server.start()
    await eventually(server.ready)
    return server


async def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    root = tmp_path / "manifests"
    root.mkdir()
    ManifestsFolder(root).put("web", objects.service("web"), objects.pod("web-1", "10.0.0.1"))
    return root


@pytest.fixture
async def tls_server(
    manifests: Path, test_ca: Any, tmp_path: Path
) -> AsyncIterator[DestinationServer]:
    server = await start_server(manifests, tls=test_ca.serving_cert(DEST_ID, tmp_path))
    yield server
    await server.stop(grace=0)


async def first_of(stream: AsyncIterator[Any], within: float = 3.0) -> Any:
    async with asyncio.timeout(within):
        return await anext(stream)


# --- backoff (pure) ------------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_up_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.1, 5.0, random.Random(3))
    delays = [backoff.next() for _ in range(9)]
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)  # jittered: no two clients retry in lockstep
    backoff.reset()
    assert 0.05 <= backoff.next() <= 0.1


def test_backoff_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="base <= cap"):
        Backoff(1.0, 0.5, random.Random())


# --- TLS -----------------------------------------------------------------------------------------


async def test_streams_over_tls_verified_by_name_against_the_anchors(
    tls_server: DestinationServer, test_ca: Any
) -> None:
    client = DestinationClient(
        ("127.0.0.1", tls_server.grpc_port), DEST_ID, test_ca.anchors_pem, '{"ns":"emojivoto"}'
    )
    try:
        async with aclosing(client.profiles(WEB)) as profiles:
            received = await first_of(profiles)
            assert received.first
            assert received.value.fqn == "web.emojivoto.svc.cluster.local"
        async with aclosing(client.updates(WEB)) as updates:
            update = (await first_of(updates)).value
            assert isinstance(update, Add)
            [endpoint] = update.endpoints
            assert endpoint.addr == ("10.0.0.1", 8080)
            assert endpoint.identity is not None
            assert endpoint.identity.name.startswith("web.emojivoto.serviceaccount.")
        assert client.failures == 0
    finally:
        await client.aclose()


@pytest.mark.parametrize("problem", ["wrong name", "other anchors"])
async def test_a_destination_service_that_fails_verification_is_refused(
    tls_server: DestinationServer, test_ca: Any, problem: str
) -> None:
    name, anchors = DEST_ID, test_ca.anchors_pem
    if problem == "wrong name":
        name = "meshlet-identity.meshlet.serviceaccount.identity.meshlet.cluster.local"
    else:
        other, _ = ca.create_trust_anchor(dt.datetime.now(dt.UTC))
        anchors = ca.cert_pem(other).decode()
    client = DestinationClient(
        ("127.0.0.1", tls_server.grpc_port), name, anchors, "", backoff=(0.02, 0.05)
    )
    try:
        async with aclosing(client.profiles(WEB)) as profiles:
            with pytest.raises(TimeoutError):
                await first_of(profiles, within=0.5)
        assert client.failures >= 2  # kept retrying, never trusting
        assert client.last_error is not None
        assert "CERTIFICATE_VERIFY_FAILED" in client.last_error
        assert tls_server.limits.active == 0  # no stream ever reached the service
    finally:
        await client.aclose()


async def test_new_anchors_in_the_followed_file_take_effect_on_the_next_connection(
    tls_server: DestinationServer, test_ca: Any, tmp_path: Path
) -> None:
    """The anchors in force refuse the service (it is served from an anchor they lack): the
    streams keep failing, and once the followed bundle adds that anchor they open."""
    other, _ = ca.create_trust_anchor(dt.datetime.now(dt.UTC))
    bundle = tmp_path / "ca-bundle.crt"
    bundle.write_bytes(ca.cert_pem(other))
    anchors = TrustAnchors(ca.cert_pem(other).decode(), bundle)
    client = DestinationClient(
        ("127.0.0.1", tls_server.grpc_port), DEST_ID, anchors, "", backoff=(0.02, 0.05)
    )
    try:
        async with following(client.profiles(WEB)) as profiles:
            await eventually(lambda: client.failures >= 2)
            assert "CERTIFICATE_VERIFY_FAILED" in (client.last_error or "")
            assert profiles.empty()
            bundle.write_bytes(ca.cert_pem(other, test_ca.anchor))
            assert anchors.check()
            assert (await next_in(profiles)).first
    finally:
        await client.aclose()


def test_a_server_name_without_anchors_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="TRUST_ANCHORS"):
        DestinationClient(("127.0.0.1", 8086), DEST_ID, None, "")


# --- refusals and reconnection -------------------------------------------------------------------


async def test_an_impossible_path_is_refused_for_good(manifests: Path) -> None:
    server = await start_server(manifests)
    client = DestinationClient(("127.0.0.1", server.grpc_port), None, None, "")
    try:
        async with aclosing(client.updates("10.0.0.1:8080")) as updates:  # an IP: never a Get path
            with pytest.raises(StreamRefused, match="not a service name"):
                await first_of(updates)
        assert client.failures == 0  # not retried
    finally:
        await client.aclose()
        await server.stop(grace=0)


class RecordingRandom(random.Random):
    """Records the ceiling of each backoff draw."""

    def __init__(self) -> None:
        super().__init__(5)
        self.ceilings: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.ceilings.append(b)
        return super().uniform(a, b)


@asynccontextmanager
async def following(stream: AsyncIterator[Any]) -> AsyncIterator[asyncio.Queue[Any]]:
    """Reads `stream` in a task of its own into a queue, so the test can watch time pass."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def read() -> None:
        async for item in stream:
            queue.put_nowait(item)

    async with asyncio.TaskGroup() as tasks:
        reader = tasks.create_task(read())
        try:
            yield queue
        finally:
            reader.cancel()


async def next_in(queue: asyncio.Queue[Any], within: float = 3.0) -> Any:
    async with asyncio.timeout(within):
        return await queue.get()


async def test_a_broken_stream_is_reopened_with_backoff_and_its_first_message_flagged(
    manifests: Path,
) -> None:
    server = await start_server(manifests)
    port = server.grpc_port
    rng = RecordingRandom()
    client = DestinationClient(("127.0.0.1", port), None, None, "", backoff=(0.02, 0.16), rng=rng)
    try:
        async with following(client.updates(WEB)) as updates:
            received = await next_in(updates)
            assert received.first and isinstance(received.value, Add)

            await server.stop(grace=0)
            ManifestsFolder(manifests).put("web", objects.service("web"))  # the pod is gone
            # several failed attempts, each waiting longer
            await eventually(lambda: client.failures >= 5, within=10.0)
            assert updates.empty()
            assert rng.ceilings[:5] == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.16])
            assert client.last_error is not None

            server = await start_server(manifests, port=port)  # the same port
            received = await next_in(updates)
            assert received.first  # a new stream: its consumer replaces, never merges
            assert received.value == NoEndpoints(exists=True)

            draws = len(rng.ceilings)
            await server.stop(grace=0)  # after a healthy stream the backoff starts over
            await eventually(lambda: len(rng.ceilings) > draws)
            assert rng.ceilings[draws] == pytest.approx(0.02)
    finally:
        await client.aclose()
        await server.stop(grace=0)


class ScriptedDestination(destination_grpc.DestinationBase):
    """A grpclib destination service that records requests and plays a script of messages,
    then ends the stream with OK."""

    def __init__(self, script: list[destination_pb2.Update]) -> None:
        self.requests: list[destination_pb2.GetDestination] = []
        self.script = script

    async def Get(self, stream: Any) -> None:
        self.requests.append(await stream.recv_message())
        for update in self.script:
            await stream.send_message(update)

    async def GetProfile(self, stream: Any) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)


async def test_requests_carry_the_context_token_and_broken_messages_are_skipped() -> None:
    ok = destination_pb2.Update(no_endpoints=destination_pb2.NoEndpoints(exists=True))
    service = ScriptedDestination([destination_pb2.Update(), ok])  # the first sets nothing
    server = Server([service])
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await server.start(sock=sock)
    token = '{"ns":"emojivoto","nodeName":"node-1","pod":"web-1"}'
    client = DestinationClient(("127.0.0.1", port), None, None, token, backoff=(0.02, 0.02))
    try:
        async with aclosing(client.updates(WEB)) as updates:
            received = await first_of(updates)
            assert received.first  # the first message that could be read
            assert received.value == NoEndpoints(exists=True)
            again = await first_of(updates)  # the server ended the stream: a new one
            assert again.first
        assert client.last_error == "the server ended the stream"
        assert [(r.path, r.context_token) for r in service.requests[:2]] == [(WEB, token)] * 2
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


class FreezableRelay:
    """A TCP relay to the server; `freeze()` stops carrying bytes on the connections it has
    (they stay open: a peer that vanished without a FIN), while new ones are carried."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.transports: list[asyncio.Transport] = []
        self.server: asyncio.Server | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        self.writers += [writer, up_writer]
        self.transports += [writer.transport, up_writer.transport]  # type: ignore[list-item]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                sink.write(data)
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer),
                             return_exceptions=True)  # fmt: skip

    def freeze(self) -> None:
        for transport in self.transports:
            transport.pause_reading()
        self.transports = []

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()


@pytest.mark.timeout(120)
async def test_pings_keep_a_quiet_stream_and_find_a_vanished_server(manifests: Path) -> None:
    """Keepalive PINGs (here every 6 s, 1 s to answer): a quiet stream stays up while the
    server answers them (it accepts one every 5 s; by gRPC's defaults it would not),
    and when the connection goes silent without closing, the client closes it and reopens its
    stream on a new one."""
    server = await start_server(manifests)
    relay = FreezableRelay(server.grpc_port)
    port = await relay.start()
    client = DestinationClient(("127.0.0.1", port), None, None, "", backoff=(0.02, 0.16),
                               keepalive=(6.0, 1.0))  # fmt: skip
    try:
        async with following(client.updates(WEB)) as updates:
            assert (await next_in(updates)).first
            # four PINGs answered: no GOAWAY (gRPC's default strikes out the third unwelcome
            # one, the fourth PING), no reconnection
            await asyncio.sleep(26)
            assert client.failures == 0 and updates.empty() and client.active == 1

            relay.freeze()
            ManifestsFolder(manifests).put("web", objects.service("web"))  # the pod is gone
            # at most a PING's period and its wait, then a new stream (room for a busy machine)
            received = await next_in(updates, within=20.0)
            assert received.first and received.value == NoEndpoints(exists=True)
            assert client.failures == 1
    finally:
        await client.aclose()
        await relay.close()
        await server.stop(grace=0)
