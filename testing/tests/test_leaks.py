"""`sockets_closed` waits for what it is asked about, and only that."""

from __future__ import annotations

import asyncio
import socket
import time

from meshlet_testing.leaks import open_sockets, sockets_closed


async def test_it_waits_until_the_sockets_on_the_named_ends_are_closed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        before = open_sockets()
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        port = client.getsockname()[1]

        def close() -> None:
            client.close()
            accepted.close()

        asyncio.get_running_loop().call_later(0.3, close)
        started = time.monotonic()
        await sockets_closed(before, [("127.0.0.1", port)], within=5)
        assert 0.3 <= time.monotonic() - started < 4  # ended by the close, not the deadline
        assert not (open_sockets() - before)


async def test_sockets_on_other_ends_are_not_waited_for() -> None:
    before = open_sockets()
    with socket.create_server(("127.0.0.1", 0)):
        started = time.monotonic()
        await sockets_closed(before, ["127.0.0.9"], within=5)
        assert time.monotonic() - started < 1
