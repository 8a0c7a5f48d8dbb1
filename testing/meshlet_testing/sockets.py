"""Ports for servers a test starts later; sockets that misbehave on purpose, for tests of
connect failures; reading a raw socket to its end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

_HANDED_OUT: set[int] = set()
_LOWEST = 10000  # below: ports that well-known servers on a developer's machine may hold
_LOWEST_SPAN = 1024  # at least this many ports, even where the ephemeral range starts low


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a server the caller starts later (or restarts on the
    same port). It lies below the kernel's ephemeral range, so no outgoing connection and no
    port-0 bind in any process can be handed it in between, and this process never hands it out
    twice. Processes running side by side start their search at different places."""
    low, _ = _ephemeral_range()
    high = max(low, _LOWEST + _LOWEST_SPAN)
    span = high - _LOWEST
    start = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "big")).randrange(span)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for i in range(span):
        port = _LOWEST + (start + i) % span
        if port in _HANDED_OUT:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port on {host} between {_LOWEST} and {high}")


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
