"""A listener: accepts raw sockets, peeks to detect the protocol, hands each off.

The socket is accepted raw so that the proxy can look at the first bytes without consuming
them (`MSG_PEEK`); the chosen handler then attaches a Protocol (with TLS when it terminates it)
through `loop.connect_accepted_socket`, and nothing sent by the client is lost.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from meshlet.api.cancellation import OwnCancellation
from meshlet.proxy.core.detect import NEED_MORE, PEEK_BYTES, Protocol, detect
from meshlet.proxy.io.sockets import Addr, original_dst, peer_closed

log = logging.getLogger(__name__)

# accept() errors that pass (out of descriptors or memory, a client gone before it was taken):
# the listener waits a moment and goes on; any other error ends `serve`.
_PASSING: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                             errno.ECONNABORTED, errno.EPROTO, errno.EPERM})  # fmt: skip
# After the first bytes arrive, an ambiguous prefix is re-peeked on this schedule.
_REPEEK_FIRST: Final = 0.001
_REPEEK_MAX: Final = 0.05


@dataclass(frozen=True, slots=True)
class Accepted:
    """An accepted connection, before any byte is read."""

    sock: socket.socket
    client: Addr
    local: Addr
    original_dst: Addr | None  # set when iptables redirected the connection
    at: float | None = None  # the event loop's time at accept: detection and head deadlines

    @property
    def target(self) -> Addr:
        """Where the client meant to connect."""
        return self.original_dst or self.local

    def deadline(self, seconds: float) -> float:
        """The loop time `seconds` after the accept (after now, when the accept time is not
        known)."""
        start = self.at if self.at is not None else asyncio.get_running_loop().time()
        return start + seconds


@dataclass(frozen=True, slots=True)
class Detected:
    accepted: Accepted
    protocol: Protocol
    timed_out: bool  # detection gave up waiting; `protocol` is what the bytes so far settle as
    first_bytes: bytes


Handler = Callable[[Accepted], Awaitable[None]]


def bind(addr: Addr, backlog: int = 1024) -> socket.socket:
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:  # IPv6 only, so that [::]:4143 and 0.0.0.0:4143 both bind
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(addr)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


async def readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def peek_until(sock: socket.socket, done: Callable[[bytes], bool], limit: int) -> bytes:
    """The bytes the client sent so far, peeked (not consumed) until `done(them)` holds,
    `limit` bytes came or the client half-closed (then what came: b"" when nothing). The
    caller's timeout bounds the wait."""
    delay = _REPEEK_FIRST
    await readable(sock)
    while True:
        try:
            data = sock.recv(limit, socket.MSG_PEEK)
        except BlockingIOError:  # woken with nothing to read
            await readable(sock)
            continue
        if not data or done(data) or len(data) >= limit or peer_closed(sock):
            return data
        await asyncio.sleep(delay)
        delay = min(delay * 2, _REPEEK_MAX)


async def peek_protocol(accepted: Accepted, give_up_after: float) -> Detected | None:
    """Peeks until the bytes name a protocol, PEEK_BYTES were seen, the client half-closed, or
    `give_up_after` seconds passed since the accept (then `timed_out`). Bytes that are still a
    prefix of an HTTP request then settle as HTTP/1 (`detect(final=True)`): only a client that
    sent nothing is handled as opaque. None when the client closed before sending anything."""
    sock = accepted.sock
    try:
        async with asyncio.timeout_at(accepted.deadline(give_up_after)):
            data = await peek_until(sock, _named, PEEK_BYTES)
    except TimeoutError:
        data = _peeked(sock)
        return Detected(accepted, detect(data, final=True), True, data)
    except OSError as exc:  # reset before anything could be read
        log.debug("connection from %s lost during detection: %s", accepted.client, exc)
        return None
    if not data:
        return None
    # The bytes named a protocol, or no more will be waited for (PEEK_BYTES came, or the
    # client half-closed): either way `final` settles them as they are.
    return Detected(accepted, detect(data, final=True), False, data)


def _named(data: bytes) -> bool:
    """Whether the bytes so far name a protocol."""
    return detect(data, final=False) is not NEED_MORE


def _peeked(sock: socket.socket) -> bytes:
    """What the client sent so far, without waiting (b"" when nothing, or the socket failed)."""
    try:
        return sock.recv(PEEK_BYTES, socket.MSG_PEEK)
    except OSError:  # BlockingIOError: nothing
        return b""


async def first_byte(accepted: Accepted, give_up_after: float) -> bytes:
    """The client's first byte, peeked (nothing is consumed): b"" when it closed, or sent
    nothing within `give_up_after` seconds of the accept."""
    sock = accepted.sock
    try:
        async with asyncio.timeout_at(accepted.deadline(give_up_after)):
            while True:
                await readable(sock)
                try:
                    return sock.recv(1, socket.MSG_PEEK)
                except BlockingIOError:  # woken with nothing to read
                    continue
    except (TimeoutError, OSError):
        return b""


class Listener:
    """Accepts connections forever, running `handler` for each in a task it owns."""

    def __init__(self, sock: socket.socket, handler: Handler, name: str) -> None:
        self.sock = sock
        self.name = name
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepting = True

    @property
    def address(self) -> Addr:
        return Addr.from_sockaddr(self.sock.getsockname())

    @property
    def stopped(self) -> bool:
        return not self._accepting

    @property
    def active(self) -> int:
        return len(self._tasks)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        own = OwnCancellation()
        while self._accepting:
            try:
                conn, client = await loop.sock_accept(self.sock)
            except OSError as exc:
                own.check()  # never accept again once cancelled, whatever the error says
                if self.stopped:
                    return
                if exc.errno not in _PASSING:
                    raise  # the listening socket itself is broken: the supervisor decides
                log.warning("%s: accept failed: %s", self.name, exc)
                await asyncio.sleep(0.05)  # e.g. EMFILE: let connections drain
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local = Addr.from_sockaddr(conn.getsockname())
            accepted = Accepted(
                conn, Addr.from_sockaddr(client), local, original_dst(conn), loop.time()
            )
            task = asyncio.create_task(self._run(accepted))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, accepted: Accepted) -> None:
        try:
            await self._handler(accepted)
        except Exception:
            log.exception("%s: connection from %s failed", self.name, accepted.client)
            accepted.sock.close()

    def stop_accepting(self) -> None:
        self._accepting = False
        self.sock.close()

    async def drain(self, grace: float) -> None:
        """Waits up to `grace` seconds for connections to finish, then cancels the rest."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
