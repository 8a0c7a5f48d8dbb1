"""Follows `Get` and `GetProfile` streams of the destination service over grpclib, reconnecting
with jittered exponential backoff.

`DestinationClient.profiles(path)` and `.updates(path)` are async iterators that never end on
their own (`watch.follow`, the loop every control-plane stream shares): when a stream breaks
(the control plane is away, restarting, or closed the stream) they wait `Backoff.next()` and open
a new one; each item says whether it is the first message of its stream (`Received.first`), so
the consumer can replace, not merge, what it built before. The only way out is `StreamRefused`:
the server answered INVALID_ARGUMENT, which no retry will change.

One HTTP/2 channel is shared by every stream; it is opened on first use (it needs the running
loop) and, over TLS, verifies the server by `server_name` against the trust anchors. Without a
server name the channel is plaintext.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from meshlet.api import destination_grpc, destination_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.endpoints import Update
from meshlet.proxy.discovery.decode import decode_update
from meshlet.proxy.discovery.profile import Profile, decode_profile
from meshlet.proxy.discovery.watch import (
    KEEPALIVE,
    ControlChannel,
    Received,
    StreamStats,
    Watch,
    follow,
)
from meshlet.proxy.identity.anchors import TrustAnchors

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Backoff", "DestinationClient", "Received", "StreamRefused"]


class StreamRefused(Exception):
    """The destination service will never answer this path (INVALID_ARGUMENT)."""


class DestinationClient:
    """Streams from one destination service. `aclose()` closes the channel: cancel the
    iterators' consumers first (`Resolver.aclose` does); any still running end in RuntimeError.
    `active`, `failures` and `last_error` say how the streams are doing."""

    def __init__(
        self,
        addr: HostPort,
        server_name: str | None,
        trust_anchors: str | TrustAnchors | None,
        context_token: str,
        *,
        backoff: tuple[float, float] = (0.1, 5.0),
        rng: random.Random | None = None,
        keepalive: tuple[float, float] = KEEPALIVE,
    ) -> None:
        self._control = ControlChannel(addr, server_name, trust_anchors,
                                       "the destination service", keepalive)  # fmt: skip
        self.addr = addr
        self._context_token = context_token
        self._backoff = backoff
        self._rng = rng or random.Random()
        self.stats = StreamStats()

    @property
    def active(self) -> int:
        return self.stats.active

    @property
    def failures(self) -> int:
        return self.stats.failures

    @property
    def last_error(self) -> str | None:
        return self.stats.last_error

    def profiles(self, path: str) -> AsyncGenerator[Received[Profile], None]:
        """`GetProfile(path)`: `path` is `ip:port` or `<svc>.<ns>.svc.<domain>:port`."""
        return self._follow("GetProfile", path, decode_profile)

    def updates(self, path: str) -> AsyncGenerator[Received[Update], None]:
        """`Get(path)`: `path` is `<svc>.<ns>.svc.<domain>:port` (never an IP)."""
        return self._follow("Get", path, decode_update)

    async def aclose(self) -> None:
        self._control.close()

    def _follow(
        self, method: str, path: str, decode: Callable[[Any], T]
    ) -> AsyncGenerator[Received[T], None]:
        request = destination_pb2.GetDestination(path=path, context_token=self._context_token)

        def open_on(channel: Channel) -> Any:
            return getattr(destination_grpc.DestinationStub(channel), method).open()

        watch = Watch(self._control, open_on, request, f"{method} {path}", log)
        backoff = Backoff(*self._backoff, self._rng)

        def refuse(exc: GRPCError) -> Exception | None:
            if exc.status is Status.INVALID_ARGUMENT:
                return StreamRefused(f"{method} {path}: {exc.message}")
            return None

        return follow(watch, decode, backoff, self.stats, refuse)
