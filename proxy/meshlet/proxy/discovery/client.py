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
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from meshlet.api import destination_grpc, destination_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.endpoints import Update
from meshlet.proxy.discovery.decode import decode_update
from meshlet.proxy.discovery.profile import Profile, decode_profile
from meshlet.proxy.discovery.watch import Received, StreamStats, Watch, follow
from meshlet.proxy.tls.contexts import control_client_context

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
        trust_anchors_pem: str | None,
        context_token: str,
        *,
        backoff: tuple[float, float] = (0.1, 5.0),
        rng: random.Random | None = None,
    ) -> None:
        if server_name and not trust_anchors_pem:
            raise ValueError(
                f"the destination service is verified as {server_name!r} but no trust anchors "
                "are configured; set MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"
            )
        self.addr = addr
        self.server_name = server_name or None
        self._ssl = (
            control_client_context(trust_anchors_pem) if server_name and trust_anchors_pem else None
        )
        self._context_token = context_token
        self._backoff = backoff
        self._rng = rng or random.Random()
        self._channel: Channel | None = None
        self._stub: Any = None  # the generated grpclib stub is untyped
        self._closed = False
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
        self._closed = True
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def _method(self, name: str) -> Any:
        if self._closed:
            raise RuntimeError("the destination client is closed")
        if self._stub is None:
            config = Configuration(ssl_target_name_override=self.server_name)
            self._channel = Channel(*self.addr, ssl=self._ssl, config=config)
            self._stub = destination_grpc.DestinationStub(self._channel)
        return getattr(self._stub, name)

    def _follow(
        self, method: str, path: str, decode: Callable[[Any], T]
    ) -> AsyncGenerator[Received[T], None]:
        request = destination_pb2.GetDestination(path=path, context_token=self._context_token)
        source = f"the destination service at {self.addr}"
        watch = Watch(lambda: self._method(method).open(), request, f"{method} {path}", source, log)
        backoff = Backoff(*self._backoff, self._rng)

        def refuse(exc: GRPCError) -> Exception | None:
            if exc.status is Status.INVALID_ARGUMENT:
                return StreamRefused(f"{method} {path}: {exc.message}")
            return None

        return follow(watch, decode, backoff, self.stats, refuse)
