"""The loop every control-plane stream of the proxy shares (`watch.follow`), against a real
grpclib server on 127.0.0.1, at the instant a shutdown's cancel meets a lost connection.

grpclib wakes a task blocked on a stream whose connection was lost by cancelling it, then raises
StreamTerminatedError in place of the CancelledError; when the loop's owner cancels it in that
same instant, the owner's CancelledError is replaced too. The loop must end all the same, and a
lost connection alone must be reopened without leaving a cancel request on the consumer's task.
"""

from __future__ import annotations

import asyncio
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
from meshlet.proxy.discovery.watch import StreamStats, Watch, follow

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
    channel: Channel
    task: asyncio.Task[None]  # the consumer: the task the loop runs in
    firsts: asyncio.Queue[int]  # at each stream's first message: the task's pending cancels
    stats: StreamStats

    def lose_the_connection(self, then: Callable[[], object] = lambda: None) -> None:
        """Resets the client's connection, as when the controller dies; `then` runs in the same
        callback as grpclib's connection_lost (which wakes the loop), before the loop runs."""
        protocol: Any = self.channel._protocol
        lost = protocol.connection_lost

        def connection_lost(exc: BaseException | None) -> None:
            lost(exc)
            then()

        protocol.connection_lost = connection_lost
        protocol.connection._transport.abort()

    async def next_first(self) -> int:
        async with asyncio.timeout(5):
            return await self.firsts.get()


@asynccontextmanager
async def following() -> AsyncIterator[Following]:
    """A grpclib server holding Get streams open, and a task following one through `follow`."""
    server = Server([Holding()])
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock=sock)
    channel = Channel("127.0.0.1", sock.getsockname()[1])
    stub = destination_grpc.DestinationStub(channel)
    request = destination_pb2.GetDestination(path=WEB)
    watch = Watch(stub.Get.open, request, f"Get {WEB}", "the test's server",
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
        yield Following(channel, task, firsts, stats)
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        channel.close()
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
