"""The proxy as a whole on 127.0.0.1: listeners, detection, routing, refusals, admin, drain."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import AsyncIterator

import pytest

from meshlet.proxy.app import Proxy
from meshlet.proxy.config import load
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.polling import eventually
from meshlet_testing.sockets import free_port as _free_port


async def http_upstream() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            path = head.split(b" ")[1]
            body = b"hello from " + path
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def proxy() -> AsyncIterator[Proxy]:
    config = load(
        {
            "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_OUTBOUND_DETECT_TIMEOUT": "300ms",
            "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "2s",
        }
    )
    p = Proxy(config)
    await p.start()
    yield p
    if not p.stopped.is_set():
        await p.shutdown()


async def refused(reader: asyncio.StreamReader) -> bool:
    """The proxy closed the connection: a FIN, or a reset when our bytes were left unread."""
    try:
        return await asyncio.wait_for(reader.read(100), 5) == b""
    except ConnectionResetError:
        return True


def outbound_port(p: Proxy) -> int:
    return p.listeners[0].address[1]


async def test_unredirected_http_is_routed_by_authority(proxy: Proxy) -> None:
    server, port = await http_upstream()
    reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(proxy))
    sent = received = 0
    for path in (b"/a", b"/b"):  # keep-alive: two requests on one connection
        request = b"GET %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (path, port)
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(len(b"hello from ") + 2) == b"hello from " + path
        sent, received = sent + len(request), received + len(head) + len(b"hello from /a")
    writer.close()
    server.close()
    metrics = proxy.metrics.registry
    src = {"peer": "src", "direction": "outbound", "target_addr": "authority",
           "tls": "no_identity", "no_tls_reason": "not_provided_by_remote"}  # fmt: skip
    assert metrics.get_sample_value("tcp_open_total", src) == 1.0
    # The client connection's bytes, counted as the HTTP engine reads and writes them.
    assert metrics.get_sample_value("tcp_read_bytes_total", src) == sent
    assert metrics.get_sample_value("tcp_write_bytes_total", src) == received
    # The connection the proxy opened to the upstream (one, reused).
    dst = {"peer": "dst", "direction": "outbound", "target_addr": f"127.0.0.1:{port}",
           "tls": "no_identity", "no_tls_reason": "not_provided_by_service_discovery"}  # fmt: skip
    assert metrics.get_sample_value("tcp_open_total", dst) == 1.0
    assert metrics.get_sample_value("tcp_read_bytes_total", dst) > 0


async def test_request_to_the_proxy_itself_is_refused(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(proxy))
    writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % outbound_port(proxy))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 403")
    assert b"meshlet-proxy-error: the request targets the proxy itself" in head
    writer.close()


async def test_opaque_tcp_without_original_destination_is_refused(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(proxy))
    writer.write(b"\x00\x01binary protocol")
    assert await refused(reader)
    writer.close()
    assert (
        proxy.metrics.registry.get_sample_value(
            "fail_fast_total", {"direction": "outbound", "reason": "no_original_dst"}
        )
        == 1.0
    )


async def test_plaintext_to_the_inbound_port_is_refused_without_identity(proxy: Proxy) -> None:
    """A connection to the inbound port itself is a mesh connection: this proxy has no
    certificate (identity is not configured), so it is refused, never forwarded to itself."""
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listeners[1].address[1])
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await refused(reader)
    writer.close()
    assert (
        proxy.metrics.registry.get_sample_value(
            "fail_fast_total", {"direction": "inbound", "reason": "no_identity"}
        )
        == 1.0
    )


async def test_silent_client_times_out_detection_and_is_refused(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(proxy))
    assert await refused(reader)  # after the 300ms detection
    writer.close()
    assert (
        proxy.metrics.registry.get_sample_value(
            "protocol_detect_timeout_total", {"direction": "outbound", "port": "unknown"}
        )
        == 1.0
    )


def _get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_admin_and_drain(proxy: Proxy) -> None:
    assert await asyncio.to_thread(_get, proxy.admin_port, "/ready") == 200
    assert await asyncio.to_thread(_get, proxy.admin_port, "/live") == 200
    assert await asyncio.to_thread(_get, proxy.admin_port, "/shutdown") == 404  # not enabled
    await proxy.shutdown()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", outbound_port(proxy)), timeout=1)


def test_bad_environment_exits_64_naming_every_problem() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshlet.proxy.main"],
        env={"MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "nowhere", "MESHLET_PROXY_BOGUS": "1",
             "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 64
    assert "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR" in result.stderr
    assert "MESHLET_PROXY_BOGUS: unknown setting" in result.stderr


async def test_sigterm_finishes_in_flight_requests_then_exits_0() -> None:
    arrived, release = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        arrived.set()
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nslow")
        await writer.drain()
        writer.close()

    upstream = await asyncio.start_server(slow, "127.0.0.1", 0)
    upstream_port = upstream.sockets[0].getsockname()[1]
    outbound, admin = _free_port(), _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshlet.proxy.main",
        env={"PATH": "/usr/bin:/bin",
             "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": f"127.0.0.1:{outbound}",
             "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "127.0.0.1:0",
             "MESHLET_PROXY_ADMIN_LISTEN_ADDR": f"127.0.0.1:{admin}",
             "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "10s"},
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        for _ in range(100):
            if await asyncio.to_thread(_get_or_zero, admin, "/ready") == 200:
                break
            await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", outbound)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % upstream_port)
        async with asyncio.timeout(10):
            await arrived.wait()  # the request is in flight upstream
        proc.terminate()
        await eventually(lambda: not _accepts(outbound))  # no longer accepting
        release.set()
        response = await asyncio.wait_for(reader.read(-1), 5)
        assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"slow")
        writer.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        assert proc.stderr is not None
        await proc.stderr.read()
        upstream.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _get_or_zero(port: int, path: str) -> int:
    try:
        return _get(port, path)
    except OSError:
        return 0


async def test_client_chosen_authorities_do_not_grow_metric_labels(proxy: Proxy) -> None:
    """750 distinct Host values (all reaching one upstream bound on every loopback address)
    leave at most 500 authority label values plus `overflow`."""

    async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(ok, "0.0.0.0", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(proxy))
    for i in range(750):
        host = f"127.0.{i // 250}.{i % 250 + 1}:{port}"
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
    writer.close()
    server.close()
    authorities = {
        sample.labels["authority"]
        for metric in proxy.metrics.registry.collect()
        if metric.name == "request"
        for sample in metric.samples
    }
    assert len(authorities) == 501
    assert "overflow" in authorities


async def exchange(port: int, request: bytes) -> bytes:
    """Sends `request` on a fresh connection; the response head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("target_bytes", "version", "status"),
    [
        (600, b"HTTP/1.1", b"200"),
        (4_000, b"HTTP/1.1", b"200"),
        (8_000, b"HTTP/1.1", b"200"),
        (16 * 1024, b"HTTP/1.1", b"414"),
        (20, b"HTTP/2.0", b"505"),
    ],
)
async def test_long_request_lines_are_http_answered_by_the_engine(
    proxy: Proxy, target_bytes: int, version: bytes, status: bytes
) -> None:
    """Detection decides from the method, so a request line longer than its peek is HTTP: the
    engine answers it (200, or 414 / 505 by its own limits), never a reset; the next request
    succeeds."""
    server, port = await http_upstream()
    target = b"/" + b"a" * (target_bytes - 1)
    host = b"Host: 127.0.0.1:%d\r\n\r\n" % port
    head = await exchange(outbound_port(proxy), b"GET %s %s\r\n%s" % (target, version, host))
    assert head.startswith(b"HTTP/1.1 " + status), head[:100]
    head = await exchange(outbound_port(proxy), b"GET /next HTTP/1.1\r\n" + host)
    assert head.startswith(b"HTTP/1.1 200")
    server.close()


@pytest.mark.parametrize("sent", [b"G", b"GET / HT"])
async def test_a_client_trickling_its_first_bytes_gets_408(sent: bytes) -> None:
    """Bytes that are a prefix of a request when detection gives up stay HTTP (`G`, then
    silence), as do requests decided from their method and then trickled: the head-read
    timeout, counted from the accept, answers 408."""
    config = load(
        {
            "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:0",
            "MESHLET_PROXY_OUTBOUND_DETECT_TIMEOUT": "500ms",
            "MESHLET_PROXY_HTTP1_HEADER_READ_TIMEOUT": "500ms",
        }
    )
    p = Proxy(config)
    await p.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", outbound_port(p))
        started = asyncio.get_running_loop().time()
        for byte in sent:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.1)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        elapsed = asyncio.get_running_loop().time() - started
        assert head.startswith(b"HTTP/1.1 408"), head
        assert elapsed < 1.5  # the head deadline ran from the accept, not after detection
        writer.close()
    finally:
        await p.shutdown()


def test_a_port_in_use_is_one_clear_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "meshlet.proxy.main"],
            env={"PATH": "/usr/bin:/bin",
                 "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:0",
                 "MESHLET_PROXY_INBOUND_LISTEN_ADDR": f"127.0.0.1:{port}",
                 "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:0"},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"meshlet-proxy: cannot listen on 127.0.0.1:{port} (inbound): Address already in use"
    ]


async def test_an_essential_task_that_stops_shuts_the_proxy_down(proxy: Proxy) -> None:
    """A listener whose socket breaks cannot serve again: the proxy says why and stops, instead
    of staying up and unready."""
    proxy.listeners[0].sock.shutdown(socket.SHUT_RDWR)  # accept() now fails with EINVAL
    async with asyncio.timeout(5):
        await proxy.closing.wait()
    assert proxy.failure is not None
    assert proxy.failure.startswith("the outbound listener stopped (OSError")
    assert not proxy.ready()


def _put(port: int, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("PUT", "/proxy-log-level", body=body)
    response = conn.getresponse()
    return response.status, response.read()


async def test_the_log_level_changes_at_run_time_from_loopback(proxy: Proxy) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        assert await asyncio.to_thread(_put, proxy.admin_port, b"debug") == (
            200,
            b"log level debug\n",
        )
        assert root.level == logging.DEBUG
        status, body = await asyncio.to_thread(_put, proxy.admin_port, b"loud")
        assert status == 400 and b"unknown log level 'loud'" in body
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(before)


def test_only_loopback_may_change_the_log_level() -> None:
    from meshlet.api.admin import AdminServer
    from meshlet.proxy import logs

    admin = AdminServer(
        ProxyMetrics().registry.render, ready=lambda: True, log_level=logs.set_level
    )
    head = b"PUT /proxy-log-level HTTP/1.1\r\nContent-Length: 5\r\n\r\n"
    assert admin._route(head, "10.0.0.7", b"debug")[0] == "403 Forbidden"
    assert admin._route(head, "::1", b"error")[0] == "200 OK"


def test_json_logs_are_one_object_per_line_with_controls_escaped() -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import logging
            from meshlet.proxy import logs
            logs.setup("info", "json")
            logging.getLogger("meshlet.test").warning("sni %r", "evil\\nINFO forged line")
            logs.setup("info", "plain")
            logging.getLogger("meshlet.test").warning("host %s", "evil\\r\\nforged\\x1b[31m")
        """)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    json_line, plain_line = result.stderr.strip().splitlines()
    record = json.loads(json_line)
    assert record["level"] == "WARNING" and record["logger"] == "meshlet.test"
    assert record["message"] == "sni 'evil\\nINFO forged line'"
    assert plain_line.endswith("host evil\\x0d\\x0aforged\\x1b[31m")


def test_outbound_policies_are_followed_only_with_a_policy_controller_and_discovery() -> None:
    base = {
        "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:0",
        "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "127.0.0.1:0",
        "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:0",
    }
    discovery = {"MESHLET_PROXY_DESTINATION_SVC_ADDR": "127.0.0.1:1"}
    policy = {
        "MESHLET_PROXY_POLICY_SVC_ADDR": "127.0.0.1:1",
        "MESHLET_PROXY_POLICY_WORKLOAD": '{"ns":"shop","pod":"web-1"}',
    }
    assert Proxy(load({**base, **discovery})).outbound_policies is None  # today's routing
    assert Proxy(load({**base, **policy})).outbound_policies is None  # nothing to route by
    followed = Proxy(load({**base, **discovery, **policy})).outbound_policies
    assert (
        followed is not None and followed.client.workload == policy["MESHLET_PROXY_POLICY_WORKLOAD"]
    )
