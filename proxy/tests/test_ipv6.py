"""The proxy on IPv6 loopback: an address prints as `[::1]:port` in metric labels, error
responses and logs, never as `::1:port`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

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


async def test_a_dual_stack_proxy_listens_on_both_families_on_one_port() -> None:
    """OUTBOUND_LISTEN_ADDRS and INBOUND_LISTEN_ADDRS (Linkerd's names): each listener on
    127.0.0.1 and [::1] at once on the same port (the IPv6 socket is IPv6-only, so the two can
    bind), and a request through either address of the outbound listener reaches the upstream."""
    from meshlet_testing.sockets import free_port

    outbound, inbound = free_port(), free_port()
    config = load(
        {
            "MESHLET_PROXY_OUTBOUND_LISTEN_ADDRS": f"127.0.0.1:{outbound},[::1]:{outbound}",
            "MESHLET_PROXY_INBOUND_LISTEN_ADDRS": f"127.0.0.1:{inbound},[::1]:{inbound}",
            "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "1s",
        }
    )
    proxy = Proxy(config)
    await proxy.start()
    try:
        assert sorted((lst.name, str(lst.address)) for lst in proxy.listeners) == [
            ("inbound", f"127.0.0.1:{inbound}"), ("inbound", f"[::1]:{inbound}"),
            ("outbound", f"127.0.0.1:{outbound}"), ("outbound", f"[::1]:{outbound}"),
        ]  # fmt: skip
        server, port = await http_upstream()
        async with server:
            for host in ("127.0.0.1", "::1"):
                reader, writer = await asyncio.open_connection(host, outbound)
                writer.write(b"GET / HTTP/1.1\r\nHost: [::1]:%d\r\n\r\n" % port)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                assert head.startswith(b"HTTP/1.1 200"), (host, head)
                writer.close()
    finally:
        await proxy.shutdown()


def test_listen_addresses_are_checked() -> None:
    from meshlet.proxy.config import ConfigError

    for bad, why in (("127.0.0.1:4143,[::]:4144", "the same port"),
                     (",", "one or more ip:port"), ("localhost:4143", "")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            load({"MESHLET_PROXY_INBOUND_LISTEN_ADDRS": bad})
        assert "MESHLET_PROXY_INBOUND_LISTEN_ADDRS" in str(error.value) and why in str(error.value)


DUAL_STACK_PROXY = """
import asyncio, logging, sys
from meshlet.proxy.app import Proxy
from meshlet.proxy.config import load
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
async def main():
    p = Proxy(load({"MESHLET_PROXY_OUTBOUND_LISTEN_ADDRS": "127.0.0.1:4140,[::1]:4140",
                    "MESHLET_PROXY_INBOUND_LISTEN_ADDRS": "0.0.0.0:4143,[::]:4143",
                    "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:4191",
                    "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "1s"}))
    await p.start()
    print("listening:", " ".join(sorted(f"{lst.name}={lst.address}" for lst in p.listeners)))
    await asyncio.sleep(0)
    await p.shutdown()
asyncio.run(main())
"""


@pytest.mark.netns
@pytest.mark.parametrize("ipv6", [True, False])
def test_the_injected_listen_addresses_serve_ipv4_only_and_dual_stack_pods(
    netns: Callable[..., subprocess.CompletedProcess[str]], ipv6: bool
) -> None:
    """The injector gives every proxy both families' addresses; in a pod whose namespace has
    IPv6 off, the proxy leaves [::1] out with a warning instead of failing to start, and
    meshlet-init (auto) leaves the IPv6 table alone, so nothing is redirected to it."""
    if not ipv6:
        netns("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    out = netns(sys.executable, "-c", DUAL_STACK_PROXY).stdout
    listening = out.split("listening: ")[1].split()
    expected = {"inbound=0.0.0.0:4143", "inbound=[::]:4143", "outbound=127.0.0.1:4140"}
    assert set(listening) == expected | ({"outbound=[::1]:4140"} if ipv6 else set()), out
    assert ("outbound listener: not on [::1]:4140 (no IPv6 here" in out) == (not ipv6), out
    init = netns(str(Path(sys.executable).with_name("meshlet-init"))).stdout
    assert ("changes to the IPv6 nat table" in init) == ipv6, init
