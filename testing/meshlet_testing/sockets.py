"""Sockets that misbehave on purpose, for tests of connect failures; reading a raw socket to
its end."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator


@contextlib.contextmanager
def hanging_port() -> Iterator[int]:
    """A loopback port where connecting hangs: its listener's accept queue is full, so the
    kernel drops further SYNs (a connect then ends only by its own timeout)."""
    with contextlib.ExitStack() as stack:
        full = stack.enter_context(socket.socket())
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        for _ in range(3):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        yield port


async def read_until_closed(sock: socket.socket, within: float = 10.0) -> bytes:
    """Everything a non-blocking socket receives until the peer closes (a reset counts as
    closed) within `within` seconds; then the socket is closed."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(within):
        while True:
            try:
                data = await loop.sock_recv(sock, 1 << 20)
            except ConnectionError:
                break
            if not data:
                break
            received += data
    sock.close()
    return bytes(received)
