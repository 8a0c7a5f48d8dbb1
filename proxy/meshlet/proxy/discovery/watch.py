"""Follows one server-streaming gRPC call for as long as its consumer wants it: the loop every
control-plane stream of the proxy shares (destination `Get`/`GetProfile`, inbound `WatchPort`,
outbound `Watch`).

`follow` yields each message decoded (`Received`, saying whether it opened a new stream, so the
consumer can replace rather than merge what it built). When a stream breaks or the server ends
it, the loop waits `Backoff.next()` and opens a new one; the backoff resets once a stream has
delivered a message. A message that does not decode (DecodeError) is logged and skipped, so the
consumer keeps what it had: a controller's mistake never replaces a good answer with nothing.
Only a status the caller names as final (`refuse`) ends the loop, by the exception it maps to,
and so does the consumer's cancellation, whatever grpclib made of it: each grpclib call is
awaited `isolated` and the loop checks its task's own cancellation before retrying
(`meshlet.api.cancellation`), so a shutdown that breaks the streams it cancels still ends.
A stream that broke, or that was answered UNAVAILABLE, gives up its connection
(`ControlChannel.failed`): the next stream dials the service's address again rather than ask
the same peer, which may be a terminating pod's proxy whose controller is gone (it keeps its
connections open and answers every stream UNAVAILABLE until it exits itself).
The consumer's logger is used, so that each client's lines stay under its own name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import h2.exceptions
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from meshlet.api.backoff import Backoff
from meshlet.api.cancellation import OwnCancellation, isolated
from meshlet.api.hostport import HostPort
from meshlet.proxy.discovery.decode import DecodeError
from meshlet.proxy.identity.anchors import TrustAnchors
from meshlet.proxy.tls.contexts import control_client_context

T = TypeVar("T")
_IGNORED = "ignoring a message of %s from %s: %s; keeping what it last said"
BROKEN = (StreamTerminatedError, ProtocolError, OSError, h2.exceptions.H2Error)
# Answers that say nothing about the stream asked for but about the server behind the
# connection: the next stream dials again (a NOT_FOUND, say, is the request's own and keeps it).
RECONNECT_ON: Final = frozenset({Status.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class Received(Generic[T]):
    value: T
    first: bool  # the first message of a new stream


@dataclass(slots=True)
class StreamStats:
    """How a client's streams are doing; several streams may share one."""

    active: int = 0  # streams open now
    failures: int = 0  # streams that broke or could not be opened
    last_error: str | None = None


# HTTP/2 PINGs on every control-plane connection: one every KEEPALIVE[0] seconds, streams or
# not, and the connection closed when one is not answered within KEEPALIVE[1]. A connection
# whose peer vanished without a FIN (a pod deleted while its address is still routed, a
# terminating controller the Service still sent it to) otherwise looks open for ever, and
# every stream on it waits for messages that never come. The controllers accept a PING every
# 5 s (`streaming_server`).
KEEPALIVE: Final = (10.0, 10.0)
# Seconds to connect to a control-plane service and finish the TLS handshake.
CONNECT_TIMEOUT: Final = 5.0


class BoundedChannel(Channel):
    """grpclib's channel with a bound on opening its connection (TCP and TLS), which its own
    lacks: a connection to an address nothing answers (a pod just killed, still named by the
    Service's rules) would otherwise hold every stream of the channel for the kernel's SYN
    retries, about two minutes, before the next attempt could dial again.

    A channel closed while its connection is being made (a stream on it failed, and another was
    connecting) closes that connection when it comes, instead of keeping it for no one: grpclib
    stores a connection that completes after `close()` and leaves it open."""

    connect_timeout: float = CONNECT_TIMEOUT
    _shut = False

    def close(self) -> None:
        self._shut = True
        super().close()

    async def _create_connection(self) -> Any:
        try:
            protocol = await asyncio.wait_for(super()._create_connection(), self.connect_timeout)
        except TimeoutError:
            raise ConnectionError(f"not connected within {self.connect_timeout:g} s") from None
        if self._shut:
            protocol.processor.close()
            raise ConnectionError("the channel was closed while it connected")
        return protocol


class ControlChannel:
    """The channel every stream to one control-plane service shares (`what`: "the destination
    service"), opened at first use: over TLS verified as `server_name` against the trust anchors
    when a name is given, plaintext when none is. A name without anchors is refused, never
    quietly plaintext. Its connection is kept alive by PINGs (`keepalive`: every, within).
    Anchors that are followed (`TrustAnchors`) and change take effect on a new connection: the
    streams on the old one end and reopen."""

    def __init__(
        self,
        addr: HostPort,
        server_name: str | None,
        trust_anchors: str | TrustAnchors | None,
        what: str,
        keepalive: tuple[float, float] = KEEPALIVE,
    ) -> None:
        if isinstance(trust_anchors, str):
            trust_anchors = TrustAnchors(trust_anchors) if trust_anchors else None
        if server_name and trust_anchors is None:
            raise ValueError(
                f"{what} is verified as {server_name!r} but no trust anchors are configured;"
                " set MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"
            )
        self.addr = addr
        self.what = what
        self.server_name = server_name or None
        self._anchors = trust_anchors if server_name else None
        self._ssl = None if self._anchors is None else control_client_context(self._anchors.pem)
        if self._anchors is not None:
            self._anchors.on_change(self._anchors_changed)
        self._keepalive = keepalive
        self._channel: Channel | None = None
        self._closed = False

    @property
    def source(self) -> str:
        return f"{self.what} at {self.addr}"

    def channel(self) -> Channel:
        if self._closed:
            raise RuntimeError(f"the client of {self.what} is closed")
        if self._channel is None:
            every, within = self._keepalive
            config = Configuration(
                ssl_target_name_override=self.server_name,
                _keepalive_time=every,
                _keepalive_timeout=within,
                _keepalive_permit_without_calls=True,
                _http2_max_pings_without_data=0,  # no limit: streams are mostly quiet
                # below `every`: a timer firing a hair early must not skip a PING
                _http2_min_sent_ping_interval_without_data=every / 2,
            )
            self._channel = BoundedChannel(*self.addr, ssl=self._ssl, config=config)
        return self._channel

    def _anchors_changed(self) -> None:
        assert self._anchors is not None
        self._ssl = control_client_context(self._anchors.pem)
        if self._channel is not None:
            self.failed(self._channel)

    def failed(self, channel: Channel) -> None:
        """A stream on `channel` failed as a dead peer's would: the next stream opens a new
        connection, and the streams still on this one end and reopen there. Once per
        connection: the streams that end with it find it replaced already."""
        if self._channel is channel:
            self._channel = None
            channel.close()

    def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            self._channel.close()
            self._channel = None


@dataclass(frozen=True, slots=True)
class Watch:
    """Where the messages come from and how they are reported. `open` opens the method's
    stream on a channel of `control` (a grpclib method's `.open`); `what` names the call in
    log lines ("WatchPort :8080")."""

    control: ControlChannel
    open: Callable[[Channel], AbstractAsyncContextManager[Any]]
    request: Any
    what: str
    log: logging.Logger

    @property
    def source(self) -> str:
        """The server, for log lines: "the policy controller at 10.0.0.1:8090"."""
        return self.control.source


async def follow(
    watch: Watch,
    decode: Callable[[Any], T],
    backoff: Backoff,
    stats: StreamStats,
    refuse: Callable[[GRPCError], Exception | None] = lambda _: None,
    failed: Callable[[], None] = lambda: None,
) -> AsyncGenerator[Received[T], None]:
    """Every decoded message of `watch`, across reconnections, until the consumer stops;
    `failed` is told of each failed stream before the backoff."""
    own = OwnCancellation()
    loop = asyncio.get_running_loop()
    while True:
        first = True
        began = loop.time()
        channel = watch.control.channel()
        try:
            async with watch.open(channel) as stream:
                await isolated(stream.send_message(watch.request, end=True))
                stats.active += 1
                try:
                    while (message := await isolated(stream.recv_message())) is not None:
                        try:
                            value = decode(message)
                        except DecodeError as exc:
                            watch.log.warning(_IGNORED, watch.what, watch.source, exc)
                            continue
                        backoff.reset()
                        yield Received(value, first)
                        first = False
                    # Read here rather than on leaving the block, which would await it in
                    # this task: its status (a GRPCError) is the stream's end.
                    await isolated(stream.recv_trailing_metadata())
                finally:
                    stats.active -= 1
            problem = "the server ended the stream"
        except GRPCError as exc:
            own.check()
            final = refuse(exc)
            if final is not None:
                raise final from None
            problem = f"{exc.status.name}: {exc.message}"
            if exc.status in RECONNECT_ON:
                watch.control.failed(channel)
        except BROKEN as exc:
            own.check()  # a shutdown's cancel that grpclib turned into a broken stream
            problem = f"{type(exc).__name__}: {exc}"
            watch.control.failed(channel)
        own.check()
        stats.failures += 1
        stats.last_error = problem
        failed()
        delay = backoff.next()
        # every failure is told (a retry's at most once per backoff step): a stream that takes
        # long to come back says why, and how long each attempt took
        level = logging.WARNING if backoff.failures == 1 else logging.INFO
        watch.log.log(level, "%s from %s failed after %.1fs (%s, attempt %d); keeping what it"
                      " last said and retrying in %.2fs", watch.what, watch.source,
                      loop.time() - began, problem, backoff.failures, delay)  # fmt: skip
        await asyncio.sleep(delay)
