"""Plain TCP connections to endpoints, with the proxy's connect timeout."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from meshlet.proxy.http.contract import Addr, Connect


def tcp_connector(timeout: float) -> Connect:
    async def connect(
        addr: Addr, factory: Callable[[], asyncio.Protocol]
    ) -> tuple[asyncio.Transport, asyncio.Protocol]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            transport, protocol = await loop.create_connection(factory, addr[0], addr[1])
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return transport, protocol

    return connect
