"""The loop every control-plane stream of the proxy shares (`watch.follow`), against real
grpclib servers on 127.0.0.1: at the instant a shutdown's cancel meets a lost connection, and
when the peer of its connection answers UNAVAILABLE for good (a terminating pod's proxy whose
controller is gone) while the service's address already leads elsewhere.

grpclib wakes a task blocked on a stream whose connection was lost by cancelling it, then raises
StreamTerminatedError in place of the CancelledError; when the loop's owner cancels it in that
same instant, the owner's CancelledError is replaced too. The loop must end all the same, and a
lost connection alone must be reopened without leaving a cancel request on the consumer's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from meshlet.api import destination_grpc, destination_pb2
from meshlet.api.backoff import Backoff
from meshlet.proxy.discovery.decode import decode_update
from meshlet.proxy.discovery.watch import ControlChannel, StreamStats, Watch, follow
from meshlet_testing.polling import eventually

WEB = "web.emojivoto.svc.cluster.local:80"
UPDATE = destination_pb2.Update(no_endpoints=destination_pb2.NoEndpoints(exists=True))


class Holding(destination_grpc.DestinationBase):
    """Answers each Get with one message, then holds the stream open."""

    async def Get(self, stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(UPDATE)
        await asyncio.Event().wait()

    async def GetProfile(self, stream: Any) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)


@dataclass
class Following:
    control: ControlChannel
    task: asyncio.Task[None]  # the consumer: the task the loop runs in
    firsts: asyncio.Queue[int]  # at each stream's first message: the task's pending cancels
    stats: StreamStats

    def lose_the_connection(self, then: Callable[[], object] = lambda: None) -> None:
        """Resets the client's connection, as when the controller dies; `then` runs in the same
        callback as grpclib's connection_lost (which wakes the loop), before the loop runs."""
        protocol: Any = self.control.channel()._protocol
        lost = protocol.connection_lost

        def connection_lost(exc: BaseException | None) -> None:
            lost(exc)
            then()

        protocol.connection_lost = connection_lost
        protocol.connection._transport.abort()

    async def next_first(self) -> int:
        async with asyncio.timeout(5):
            return await self.firsts.get()


def _get(channel: Channel) -> Any:
    return destination_grpc.DestinationStub(channel).Get.open()


@asynccontextmanager
async def following() -> AsyncIterator[Following]:
    """A grpclib server holding Get streams open, and a task following one through `follow`."""
    server = Server([Holding()])
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock=sock)
    control = ControlChannel(("127.0.0.1", sock.getsockname()[1]), None, None, "the test's server")
    watch = Watch(control, _get, destination_pb2.GetDestination(path=WEB), f"Get {WEB}",
                  logging.getLogger(__name__))  # fmt: skip
    stats = StreamStats()
    firsts: asyncio.Queue[int] = asyncio.Queue()

    async def consume() -> None:
        backoff = Backoff(0.01, 0.02, random.Random(1))
        async for received in follow(watch, decode_update, backoff, stats):
            if received.first:
                task = asyncio.current_task()
                assert task is not None
                firsts.put_nowait(task.cancelling())

    task = asyncio.create_task(consume())
    try:
        yield Following(control, task, firsts, stats)
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        control.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("race", [True, False], ids=["cancel-meets-the-wake-up", "cancel-first"])
async def test_a_cancel_that_meets_a_lost_connection_ends_the_loop(race: bool) -> None:
    """The race: the owner's cancel lands between grpclib's wake-up (connection_lost) and the
    loop's next step, so grpclib raises StreamTerminatedError in place of it. Cancel first: the
    loop runs before grpclib learns of the loss and sees the CancelledError itself."""
    async with following() as f:
        await f.next_first()
        await asyncio.sleep(0.05)  # the loop waits for the stream's next message
        if race:
            f.lose_the_connection(then=f.task.cancel)
        else:
            f.task.cancel()
            f.lose_the_connection()
        await asyncio.wait({f.task}, timeout=2)
        assert f.task.done(), (
            f"the loop reopened the stream instead of ending ({f.stats.failures} failures,"
            f" last: {f.stats.last_error})"
        )
        assert f.task.cancelled()
        assert f.stats.failures == 0  # ended, not counted as a broken stream


async def test_a_lost_connection_alone_is_reopened_and_leaves_no_cancel_request() -> None:
    async with following() as f:
        assert await f.next_first() == 0
        for lost in range(1, 4):
            f.lose_the_connection()
            assert await f.next_first() == 0, f"a cancel request left after loss {lost}"
            assert f.stats.failures == lost
        f.task.cancel()  # the loop still ends at its owner's first cancel
        await asyncio.wait({f.task}, timeout=2)
        assert f.task.cancelled()


class Refusing(destination_grpc.DestinationBase):
    """Answers each Get with `status` at once and keeps the connection: for UNAVAILABLE, what a
    terminating pod's proxy answers once its controller is gone (a trailers-only grpc-status
    14, h2headers)."""

    def __init__(self, status: Status, path: str | None = None) -> None:
        self.status, self.path = status, path  # path: only this path is refused

    async def Get(self, stream: Any) -> None:
        request = await stream.recv_message()
        if self.path is not None and request.path != self.path:
            await Holding().Get(_Replayed(stream, request))
        raise GRPCError(self.status, "upstream connection refused")

    async def GetProfile(self, stream: Any) -> None:
        raise GRPCError(Status.UNIMPLEMENTED)


@dataclass
class _Replayed:
    """A server stream whose request was read already."""

    stream: Any
    request: Any

    async def recv_message(self) -> Any:
        return self.request

    async def send_message(self, message: Any) -> None:
        await self.stream.send_message(message)


class Address:
    """A service's address, as kube-proxy makes one: each new connection is relayed to the
    backend of the moment (`lead_to`); connections made keep their backend."""

    def __init__(self, backend: int) -> None:
        self.backend = backend
        self.dialed: list[int] = []  # each connection's backend, in order
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> tuple[asyncio.Server, int]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    def lead_to(self, backend: int) -> None:
        self.backend = backend

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.dialed.append(self.backend)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    sink.write(data)
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


@asynccontextmanager
async def grpc_server(*handlers: Any) -> AsyncIterator[int]:
    server = Server(list(handlers))
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock=sock)
    try:
        yield sock.getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def following_web(
    control: ControlChannel,
) -> tuple[StreamStats, asyncio.Queue[Any], asyncio.Task[None]]:
    """A task following Get for WEB through `control`: its stats and the messages received."""
    watch = Watch(control, _get, destination_pb2.GetDestination(path=WEB), f"Get {WEB}",
                  logging.getLogger(__name__))  # fmt: skip
    stats = StreamStats()
    received: asyncio.Queue[Any] = asyncio.Queue()

    async def consume() -> None:
        async for message in follow(watch, decode_update, Backoff(0.01, 0.05, random.Random(1)),
                                    stats):  # fmt: skip
            received.put_nowait(message)

    return stats, received, asyncio.create_task(consume())


async def test_a_stream_answered_unavailable_dials_the_address_again() -> None:
    """The drill that showed it: a destination pod deleted, its proxy outliving its controller
    (a native sidecar stops after the app) keeps the connection and answers UNAVAILABLE, while
    the Service already leads to the new pod. Each retry dials the address again, so the stream
    is back as soon as the address leads somewhere that serves (on the old connection it would
    stay refused for as long as that proxy lives)."""
    async with grpc_server(Refusing(Status.UNAVAILABLE)) as old, grpc_server(Holding()) as new:
        address = Address(old)
        relay, port = await address.start()
        control = ControlChannel(("127.0.0.1", port), None, None, "the destination")
        stats, received, task = following_web(control)
        try:
            await eventually(lambda: stats.failures >= 3)
            assert address.dialed[:3] == [old, old, old]  # a new connection for each retry
            address.lead_to(new)
            async with asyncio.timeout(2):
                assert (await received.get()).first
            assert address.dialed[-1] == new
        finally:
            task.cancel()
            await asyncio.wait({task}, timeout=5)
            control.close()
            relay.close()


async def test_a_refusal_of_the_request_itself_keeps_the_connection_and_its_other_streams() -> None:
    """NOT_FOUND is about the request (a pod the controller does not know yet): the stream asks
    again on the same connection, and the other streams on it are left alone."""
    other = "api.emojivoto.svc.cluster.local:8080"
    async with grpc_server(Refusing(Status.NOT_FOUND, path=other)) as backend:
        address = Address(backend)
        relay, port = await address.start()
        control = ControlChannel(("127.0.0.1", port), None, None, "the destination")
        stats = StreamStats()
        firsts: list[str] = []

        async def consume(path: str) -> None:
            watch = Watch(control, _get, destination_pb2.GetDestination(path=path),
                          f"Get {path}", logging.getLogger(__name__))  # fmt: skip
            backoff = Backoff(0.01, 0.05, random.Random(1))
            async for message in follow(watch, decode_update, backoff, stats):
                if message.first:
                    firsts.append(path)

        tasks = [asyncio.create_task(consume(path)) for path in (WEB, other)]
        try:
            await eventually(lambda: stats.failures >= 5)
            assert firsts == [WEB]  # never reopened
            assert address.dialed == [backend]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5)
            control.close()
            relay.close()


async def test_a_connection_nothing_answers_is_given_up_within_the_bound(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Service address that leads to a backend swallowing the connection (a pod just killed
    whose Service rules still name it: the SYN, here the TLS handshake, never answered) holds
    a stream for the bound only, not the kernel's two minutes of SYN retries or asyncio's 60 s
    TLS handshake timeout; each retry dials again, is logged with how long it took, and once the
    address leads to a serving controller the stream opens."""
    from meshlet.proxy.discovery.watch import BoundedChannel
    from meshlet.proxy.tls.contexts import direct_server_context
    from meshlet_testing.testca import make_ca

    monkeypatch.setattr(BoundedChannel, "connect_timeout", 0.3)
    name = "meshlet-destination.meshlet.serviceaccount.identity.meshlet.cluster.local"
    authority = make_ca(tmp_path)
    authority.write()
    chain, key = authority.serving_cert(name, tmp_path / "serving")
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    silent = await asyncio.start_server(swallow, "127.0.0.1", 0)
    server = Server([Holding()])
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock=sock, ssl=direct_server_context(chain, key, authority.anchors_pem))
    address = Address(silent.sockets[0].getsockname()[1])
    relay, port = await address.start()
    control = ControlChannel(("127.0.0.1", port), name, authority.anchors_pem, "the destination")
    caplog.set_level(logging.INFO, logger=__name__)
    started = asyncio.get_running_loop().time()
    stats, received, task = following_web(control)
    try:
        await eventually(lambda: stats.failures >= 3, within=5)
        elapsed = asyncio.get_running_loop().time() - started
        assert 0.9 <= elapsed < 3, elapsed  # three attempts of 0.3 s each, and the backoff
        assert "not connected within 0.3 s" in (stats.last_error or "")
        lines = [r.getMessage() for r in caplog.records if "Get " + WEB in r.getMessage()]
        assert len(lines) >= 3 and all("failed after 0." in line for line in lines), lines
        assert "attempt 3" in lines[2]
        address.lead_to(sock.getsockname()[1])
        async with asyncio.timeout(3):
            assert (await received.get()).first
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        control.close()
        relay.close()
        silent.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_channel_closed_while_it_connects_keeps_no_connection() -> None:
    """A stream on the channel failed (`ControlChannel.failed` closes it) while another was
    connecting: the connection that completes after the close is closed at once, and the
    connecting stream fails as on a refused connection; nothing is left open for the garbage
    collector to find (grpclib itself would store it and warn `Unclosed connection`)."""
    from meshlet.proxy.discovery.watch import BoundedChannel

    peers: list[asyncio.StreamReader] = []
    writers: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(reader)
        writers.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    channel = BoundedChannel("127.0.0.1", server.sockets[0].getsockname()[1])
    try:
        connecting = asyncio.ensure_future(channel.__connect__())
        await asyncio.sleep(0)  # the connect is under way
        channel.close()
        with pytest.raises(ConnectionError, match="closed while it connected"):
            await connecting
        assert channel._protocol is None
        await eventually(lambda: len(peers) == 1)
        async with asyncio.timeout(5):
            while await peers[0].read(65536):  # the client's preface, then its FIN
                pass
    finally:
        channel.close()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
