"""Sockets that misbehave on purpose, for tests of connect failures."""

from __future__ import annotations

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
