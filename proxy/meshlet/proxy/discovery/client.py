"""Follows `Get` and `GetProfile` streams of the destination service over grpclib, reconnecting
with jittered exponential backoff.

`DestinationClient.profiles(path)` and `.updates(path)` are async iterators that never end on
their own: when a stream breaks (the control plane is away, restarting, or closed the stream)
they wait `Backoff.next()` and open a new one; each item says whether it is the first message of
its stream (`Received.first`), so the consumer can replace, not merge, what it built before.
The backoff resets once a stream has delivered a message. The only way out is `StreamRefused`:
the server answered INVALID_ARGUMENT, which no retry will change.

One HTTP/2 channel is shared by every stream; it is opened on first use (it needs the running
loop) and, over TLS, verifies the server by `server_name` against the trust anchors. Without a
server name the channel is plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import h2.exceptions
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from meshlet.api import destination_grpc, destination_pb2
from meshlet.api.backoff import Backoff
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.endpoints import Update
from meshlet.proxy.discovery.decode import DecodeError, decode_update
from meshlet.proxy.discovery.profile import Profile, decode_profile
from meshlet.proxy.tls.contexts import control_client_context

log = logging.getLogger(__name__)

T = TypeVar("T")
_BROKEN = (StreamTerminatedError, ProtocolError, OSError, h2.exceptions.H2Error)


@dataclass(frozen=True, slots=True)
class Received(Generic[T]):
    value: T
    first: bool  # the first message of a new stream


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
        self.active = 0  # streams open now
        self.failures = 0  # streams that broke or could not be opened
        self.last_error: str | None = None

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

    async def _follow(
        self, method: str, path: str, decode: Callable[[Any], T]
    ) -> AsyncGenerator[Received[T], None]:
        request = destination_pb2.GetDestination(path=path, context_token=self._context_token)
        backoff = Backoff(*self._backoff, self._rng)
        while True:
            first = True
            try:
                async with aclosing(self._stream(method, request)) as messages:
                    async for message in messages:
                        try:
                            value = decode(message)
                        except DecodeError as exc:
                            log.warning("ignoring a %s message for %s: %s", method, path, exc)
                            continue
                        backoff.reset()  # a healthy stream
                        yield Received(value, first)
                        first = False
                problem = "the server ended the stream"
            except GRPCError as exc:
                if exc.status is Status.INVALID_ARGUMENT:
                    raise StreamRefused(f"{method} {path}: {exc.message}") from None
                problem = f"{exc.status.name}: {exc.message}"
            except _BROKEN as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self.failures += 1
            self.last_error = problem
            delay = backoff.next()
            level = logging.WARNING if backoff.failures == 1 else logging.DEBUG
            log.log(
                level,
                "%s %s from the destination service at %s failed (%s); keeping what it "
                "last said and retrying in %.2fs",
                method,
                path,
                self.addr,
                problem,
                delay,
            )
            await asyncio.sleep(delay)

    async def _stream(
        self, method: str, request: destination_pb2.GetDestination
    ) -> AsyncGenerator[Any, None]:
        """The messages of one stream, until it ends or breaks."""
        async with self._method(method).open() as stream:
            await stream.send_message(request, end=True)
            self.active += 1
            try:
                while (message := await stream.recv_message()) is not None:
                    yield message
            finally:
                self.active -= 1
