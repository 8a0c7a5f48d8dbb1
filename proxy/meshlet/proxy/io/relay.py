"""Opaque TCP relay between two transports: bytes both ways, half-close, back-pressure.

Each side is a Protocol whose peer is the other side's transport. When a peer's write buffer
passes its high-water mark, this side stops reading until it drains (`pause_writing` /
`resume_writing`), so memory per connection stays bounded by the buffer limits. A FIN from one
side is passed on as a FIN (`write_eof`) while the other direction keeps flowing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

from meshlet.proxy.io.counters import TcpConn

HIGH_WATER: Final = 256 * 1024
LOW_WATER: Final = 64 * 1024
GUARD_BYTES: Final = 512  # held at most by a CheckedSide before it must decide
# (refuse(first bytes, final) -> True / False / None: not known yet, refused()) for CheckedSide.
FirstBytesCheck = tuple[Callable[[bytes, bool], bool | None], Callable[[], None]]


class RelaySide(asyncio.Protocol):
    """One side's connection; `tcp` counts its bytes (read here, written by the peer) and is
    closed with it."""

    def __init__(self, done: asyncio.Future[None], tcp: TcpConn) -> None:
        self._done = done
        self.tcp = tcp
        self.transport: asyncio.Transport | None = None
        self.peer: RelaySide | None = None
        self._pending = bytearray()  # bytes read before the peer was attached
        self._eof = False
        self._eof_passed = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(HIGH_WATER, LOW_WATER)

    def flush(self) -> None:
        """Passes on what arrived before the peer's transport existed (a server that speaks
        first can send, and even close, before the client side is attached)."""
        if self._pending:
            self._forward(b"")
        if self._eof:
            self._pass_eof()

    def data_received(self, data: bytes) -> None:
        self._forward(data)

    def _forward(self, data: bytes) -> None:
        """Writes `data` to the peer, after whatever waited for it: bytes keep their order
        whether they arrive before the peer is attached, between the attach and `flush`, or
        after."""
        peer = self.peer
        if peer is None or peer.transport is None:
            self._pending += data
            return
        if self._pending:
            data = bytes(self._pending) + data
            self._pending.clear()
        if data:
            self.tcp.read += len(data)
            peer.tcp.written += len(data)
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self._eof = True
        self._pass_eof()
        # Keep our write side open for the other direction (the proxy's TLS transport can:
        # close_notify closes one direction, tls/transport.py).
        return self.transport is None or self.transport.can_write_eof()

    def _pass_eof(self) -> None:
        """Passes our FIN on once, after the bytes before it (no peer yet: `flush` will)."""
        peer = self.peer
        if peer is None or peer.transport is None or self._eof_passed:
            return
        self._forward(b"")
        self._eof_passed = True
        if not peer.transport.is_closing():
            if peer.transport.can_write_eof():
                peer.transport.write_eof()
            else:  # a transport that cannot half-close: close after what is buffered
                peer.transport.close()
        if peer._eof:
            self._close_both()

    # The peer's transport calls these on *its* protocol; we pause the side feeding it.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.tcp.close(exc)
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            if exc is None:
                peer.transport.close()  # flushes what is buffered first
            else:
                peer.transport.abort()  # a reset is passed on as a reset
        if not self._done.done() and (peer is None or peer.closed):
            self._done.set_result(None)

    def _close_both(self) -> None:
        for side in (self, self.peer):
            if side is not None and side.transport is not None:
                side.transport.close()


class CheckedSide(RelaySide):
    """A client side whose first bytes are held until `refuse(bytes, final)` decides (None: not
    known yet; `final` when no more will be awaited: the client half-closed, or GUARD_BYTES are
    held). Refused: both connections are reset and `refused()` is called; else the bytes pass
    and the side relays as any other. Used where detection was skipped after a silent client (a
    server-speaks-first protocol), so that an HTTP request arriving late is not relayed."""

    def __init__(self, done: asyncio.Future[None], tcp: TcpConn, guard: FirstBytesCheck):
        super().__init__(done, tcp)
        self._refuse, self._refused = guard
        self._held: bytearray | None = bytearray()

    def data_received(self, data: bytes) -> None:
        held = self._held
        if held is None:
            super().data_received(data)
            return
        held += data
        self._judge(final=len(held) >= GUARD_BYTES)

    def eof_received(self) -> bool:
        if self._held is not None:
            self._judge(final=True)
            if self._held is not None:  # refused
                return False
        return super().eof_received()

    def _judge(self, final: bool) -> None:
        held = self._held
        assert held is not None
        verdict = self._refuse(bytes(held), final)
        if verdict is None:
            return
        if verdict:
            for side in (self, self.peer):
                if side is not None and side.transport is not None:
                    side.transport.abort()
            self._refused()
            return
        self._held = None
        if held:
            super().data_received(bytes(held))


class RelayLoad:
    """A relayed connection as the load shedder weighs it (core.pressure.Peer): the client
    side's bytes, what both transports hold unsent; shedding aborts both."""

    __slots__ = ("client", "upstream")

    def __init__(self, client: RelaySide, upstream: RelaySide) -> None:
        self.client, self.upstream = client, upstream

    def progress(self) -> int:
        return self.client.tcp.read + self.client.tcp.written

    def holds(self) -> tuple[int, int]:
        transports = (self.client.transport, self.upstream.transport)
        return 0, sum(t.get_write_buffer_size() for t in transports if t is not None)

    def shed(self, why: str) -> None:
        for side in (self.client, self.upstream):
            if side.transport is not None:
                side.transport.abort()


def pair(
    loop: asyncio.AbstractEventLoop,
    client_tcp: TcpConn | None = None,
    guard: FirstBytesCheck | None = None,
    upstream_tcp: TcpConn | None = None,
) -> tuple[RelaySide, RelaySide, asyncio.Future[None]]:
    """Two linked sides and a future resolved once both connections are closed. Once both
    transports are connected, call `flush()` on both. With a `guard`, the client side is a
    CheckedSide. Connections without a TcpConn are not counted (the upstream's can be set
    until it connects)."""
    done: asyncio.Future[None] = loop.create_future()
    client_tcp = client_tcp or TcpConn.uncounted()
    client = RelaySide(done, client_tcp) if guard is None else CheckedSide(done, client_tcp, guard)
    upstream = RelaySide(done, upstream_tcp or TcpConn.uncounted())
    client.peer, upstream.peer = upstream, client
    return client, upstream, done
