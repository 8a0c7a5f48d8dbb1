"""The proxy on IPv6 loopback: an address prints as `[::1]:port` in metric labels, error
responses and logs, never as `::1:port`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator

import pytest

from meshlet.proxy.app import Proxy
from meshlet.proxy.config import load

# `::1` followed by `:port` without the closing bracket before it: the hand-made format.
UNBRACKETED = re.compile(r"(?<![\[\w:])::1:\d")


async def http_upstream() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "::1", 0)
    return server, server.sockets[0].getsockname()[1]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1)")


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    config = load(
        {
            "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "[::1]:0",
            "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "[::1]:0",
            "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "[::1]:0",
            "MESHLET_PROXY_OUTBOUND_DETECT_TIMEOUT": "300ms",
            "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "2s",
        }
    )
    p = Proxy(config)
    await p.start()
    yield p
    if not p.stopped.is_set():
        await p.shutdown()


def label_values(p: Proxy) -> list[str]:
    return [
        value
        for metric in p.metrics.registry.collect()
        for sample in metric.samples
        for value in sample.labels.values()
    ]


async def test_an_ipv6_upstream_is_labelled_and_reported_in_brackets(
    proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    listener = proxy.listeners[0].address
    assert str(listener) == f"[::1]:{listener.port}"
    server, port = await http_upstream()
    async with server:
        reader, writer = await asyncio.open_connection("::1", listener.port)
        writer.write(b"GET /a HTTP/1.1\r\nHost: [::1]:%d\r\n\r\n" % port)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        writer.close()
        await writer.wait_closed()

    # Nothing listens there: the error names the address as it is written.
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        closed = sock.getsockname()[1]
    reader, writer = await asyncio.open_connection("::1", listener.port)
    writer.write(b"GET /b HTTP/1.1\r\nHost: [::1]:%d\r\n\r\n" % closed)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 502")
    assert b"connecting to [::1]:%d failed" % closed in head
    writer.close()

    # Opaque bytes without an original destination: refused, and the client logged.
    reader, writer = await asyncio.open_connection("::1", listener.port)
    client = writer.get_extra_info("sockname")[1]
    writer.write(b"\x00\x01binary protocol")
    with contextlib.suppress(ConnectionResetError):  # a reset when our bytes were left unread
        assert await asyncio.wait_for(reader.read(100), 5) == b""
    writer.close()

    metrics = proxy.metrics.registry
    upstream = f"[::1]:{port}"
    dst = {"peer": "dst", "direction": "outbound", "target_addr": upstream,
           "tls": "no_identity", "no_tls_reason": "not_provided_by_service_discovery"}  # fmt: skip
    assert metrics.get_sample_value("tcp_open_total", dst) == 1.0
    requests = {"direction": "outbound", "target_addr": "authority", "tls": "no_identity",
                "no_tls_reason": "not_provided_by_remote", "authority": upstream}  # fmt: skip
    assert metrics.get_sample_value("request_total", requests) == 1.0
    refusal = f"outbound connection from [::1]:{client} refused"
    assert any(refusal in message for message in caplog.messages), caplog.messages

    assert not [value for value in label_values(proxy) if UNBRACKETED.search(value)]
    assert not [message for message in caplog.messages if UNBRACKETED.search(message)]
