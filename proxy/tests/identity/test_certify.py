"""The Certify client against a grpclib identity service on 127.0.0.1 (TLS from the test CA) that
holds the call: a cancel that meets the lost connection is a cancel, never an outage to retry."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from grpclib.server import Server

from meshlet.api import identity_grpc, wellknown
from meshlet.proxy.identity.certify import CertifyClient, CertifyFailed


class Holding(identity_grpc.IdentityBase):
    """Reads the request and never answers."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def Certify(self, stream: Any) -> None:
        await stream.recv_message()
        self.asked.set()
        await asyncio.Event().wait()


async def held_call(
    test_ca: Any, tmp_path: Path
) -> tuple[CertifyClient, asyncio.Task[Any], Server]:
    cert, key = test_ca.serving_cert(wellknown.IDENTITY_SERVICE_NAME, tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    service = Holding()
    server = Server([service])
    sock = socket.create_server(("127.0.0.1", 0))
    await server.start(sock=sock, ssl=context)
    client = CertifyClient(
        "127.0.0.1",
        sock.getsockname()[1],
        wellknown.IDENTITY_SERVICE_NAME,
        test_ca.anchors_pem,
        timeout=30,
    )
    task = asyncio.create_task(client.certify("web", b"token", b"csr"))
    async with asyncio.timeout(5):
        await service.asked.wait()
    return client, task, server


def lose_the_connection(client: CertifyClient, then: Callable[[], object] = lambda: None) -> None:
    """Resets the client's connection, as when the identity service dies; `then` runs in the same
    callback as grpclib's connection_lost (which wakes the call), before the call runs again."""
    protocol: Any = client._channel._protocol
    lost = protocol.connection_lost

    def connection_lost(exc: BaseException | None) -> None:
        lost(exc)
        then()

    protocol.connection_lost = connection_lost
    protocol.connection._transport.abort()


@pytest.mark.parametrize("cancelled", [True, False], ids=["lost-then-cancelled", "lost"])
async def test_a_cancel_that_meets_a_lost_connection_is_a_cancel(
    test_ca: Any, tmp_path: Path, cancelled: bool
) -> None:
    client, task, server = await held_call(test_ca, tmp_path)
    try:
        if cancelled:  # the same instant: the manager's owner stops it
            lose_the_connection(client, then=task.cancel)
            with pytest.raises(asyncio.CancelledError):
                await task
        else:  # a lost connection alone is an outage, retried by the manager
            lose_the_connection(client)
            with pytest.raises(CertifyFailed, match="UNAVAILABLE"):
                await task
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0
    finally:
        task.cancel()
        client.close()
        server.close()
        await server.wait_closed()
