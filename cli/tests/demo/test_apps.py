"""The deny drill's client: how it tells an admitted connection from a refused one, as the real
process against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshlet.cli.demo.apps import store_attempt


@pytest.mark.parametrize(
    ("banner", "error", "outcome"),
    [
        (b"STORE store-1 ready\n", None, "admitted"),
        (b"", None, "refused"),  # closed before the banner: a denial, as a TCP client sees it
        (None, ConnectionResetError(), "refused"),
        (None, asyncio.IncompleteReadError(b"", None), "refused"),
        (None, TimeoutError(), "timeout"),
        (None, ConnectionRefusedError(), "ConnectionRefusedError"),
        (b"HTTP/1.1 400\r\n", None, "unexpected banner"),
    ],
)
def test_how_an_attempt_ended(
    banner: bytes | None, error: BaseException | None, outcome: str
) -> None:
    assert store_attempt(banner, error) == outcome


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    """(a store that greets, a server that closes every connection at once): ports."""
    sockets = []
    for _ in range(2):
        s = socket.create_server(("127.0.0.1", 0))
        s.settimeout(0.2)
        sockets.append(s)
    stop = threading.Event()

    def serve(s: socket.socket, greeting: bytes) -> None:
        while not stop.is_set():
            try:
                conn, _ = s.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(greeting)

    threads = [threading.Thread(target=serve, args=(s, g))
               for s, g in zip(sockets, (b"STORE store-1 ready\n", b""), strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        yield sockets[0].getsockname()[1], sockets[1].getsockname()[1]
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in sockets:
            s.close()


@pytest.mark.parametrize("which", ["greets", "closes"])
def test_the_intruder_counts_each_attempt(
    servers: tuple[int, int], tmp_path: Path, which: str
) -> None:
    port = servers[0] if which == "greets" else servers[1]
    stats = tmp_path / "intruder.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.cli.main", "demo", "app", "intruder",
         "--target", f"127.0.0.1:{port}", "--rate", "20", "--stats", str(stats)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not stats.exists() or json.loads(stats.read_text())["attempts"] < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    seen = json.loads(stats.read_text())
    outcome = "admitted" if which == "greets" else "refused"
    assert seen["outcomes"] == {outcome: seen["attempts"]}
    assert seen["attempts"] >= 5


def test_the_api_answers_internal_while_its_fault_flag_exists(tmp_path: Path) -> None:
    """The failing-replica drill's switch, as the real process and a grpcio client see it: the
    pod's answer, INTERNAL while the flag file exists, the pod's answer again once it is gone."""
    import grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flag = tmp_path / "faults" / "api-9.fail"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.cli.main", "demo", "app", "api",
         "--listen", f"127.0.0.1:{port}", "--pod", "api-9", "--fail-flag", str(flag)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    quote = channel.unary_unary("/demo.Api/Quote")

    def answer() -> str:
        """The pod's name, or the error's code and details."""
        try:
            return str(json.loads(quote(b"{}", timeout=5))["pod"])
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    def within(seconds: float, want: str) -> str:
        deadline = time.monotonic() + seconds
        while (got := answer()) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        return got

    failing = f"INTERNAL: api-9 fails every call ({flag})"
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        assert answer() == "api-9"
        flag.parent.mkdir()
        flag.touch()
        assert within(1.0, failing) == failing  # the app looks every 0.1 s
        assert answer() == failing
        flag.unlink()
        assert within(1.0, "api-9") == "api-9"
    finally:
        channel.close()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out


def test_the_load_counts_webs_reasons_for_its_errors() -> None:
    from meshlet.cli.demo.apps import _Stats

    stats = _Stats()
    stats.record("http 502", 3.0, {"error": "api: UNAVAILABLE: failed to connect to all addresses"})
    stats.record("http 502", 3.0, {"error": "store: ConnectionRefusedError(111, 'refused')"})
    stats.record("http 502", 3.0, {"error": "api: UNAVAILABLE: reset"})
    stats.record("timeout", 0.0, None)
    seen = stats.as_json()
    assert seen["failed"] == {"http 502": 3, "timeout": 1}
    assert seen["why"] == {"api: UNAVAILABLE": 2, "store: ConnectionRefusedError": 1}
    assert [pod for _, _, pod in seen["recent"]] == ["", "", "", ""]


def test_a_paused_load_generator_counts_its_missed_calls_late_not_dropped(tmp_path: Path) -> None:
    """The real load process against a real HTTP server, stopped (SIGSTOP) for 3 s as a busy
    machine may leave it unscheduled: the calls it could not send on time are counted `late`
    and never sent in a burst, so none is counted as dropped (over capacity), and the longest
    lag says how long it was paused."""
    import http.server

    class Web(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = b'{"api": "api-1", "store": "store-1"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Web)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stats = tmp_path / "load.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.cli.main", "demo", "app", "load",
         "--target", f"127.0.0.1:{server.server_address[1]}", "--rate", "20",
         "--stats", str(stats)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def seen() -> dict[str, Any]:
        return dict(json.loads(stats.read_text())) if stats.exists() else {"ok": 0}

    try:
        deadline = time.monotonic() + 30
        while seen()["ok"] < 20:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        proc.send_signal(signal.SIGCONT)
        before = seen()["sent"]
        while seen()["sent"] < before + 20:  # a second of calls after the pause
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, out
    final = seen()
    # (a call in flight when the process stopped may outlive its 5 s budget: one timeout)
    assert final["dropped"] == 0 and set(final["failed"]) <= {"timeout"}, final
    assert final["failed"].get("timeout", 0) <= 1, final
    # paused 3 s or more (a busy machine wakes it later): at 20/s, the calls more than
    # LATE_AFTER (1 s) overdue when it woke are late, about 40
    lag = final["lag_max_ms"] / 1000
    assert lag >= 2.9, final
    assert abs(final["late"] - 20 * (lag - 1)) <= 3, final
    assert final["ok"] + final["failed"].get("timeout", 0) == final["sent"], final


async def test_the_load_never_reuses_a_connection_a_server_may_have_closed_as_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that closes a connection idle for 0.5 s (as the proxy does after 60 s): calls a
    second apart find their kept-alive connection closed. The load closes a connection idle past
    KEEPALIVE_FOR (0.3 s here, 15 s in the demo) instead of reusing it, so no call meets a
    connection's EOF in place of its answer (IncompleteReadError), as aiohttp's client avoids
    it."""
    from meshlet.cli.demo import apps

    body = b'{"api": "api-1", "store": "store-1"}'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            while True:
                async with asyncio.timeout(0.5):  # the server's idle timeout
                    await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    monkeypatch.setattr(apps, "KEEPALIVE_FOR", 0.3)
    seen = await _load_against(serve, 1.0, 4.5, tmp_path)
    assert seen["ok"] >= 3 and seen["failed"] == {}, seen


async def _load_against(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    rate: float,
    seconds: float,
    tmp_path: Path,
) -> dict[str, Any]:
    """The load generator's stats after `seconds` of calls at `rate` to a server running
    `serve` for each connection."""
    from meshlet.cli.demo import apps

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stats = tmp_path / "load.json"
    load = asyncio.create_task(apps._load(f"127.0.0.1:{port}", rate, stats, ""))
    try:
        await asyncio.sleep(seconds)
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        server.close()
        await server.wait_closed()
    return dict(json.loads(stats.read_text()))


async def test_the_load_connects_afresh_after_an_error_answer(tmp_path: Path) -> None:
    """A kept-alive connection that answered an error is not reused: a load that resolved its
    target's name to a deleted Service's address (a DNS cache's answer) reaches the new one
    once the name resolves again, instead of holding on to the old connection. Here the first
    connection answers every request 404, the later ones 200: one 404, then every call ok."""

    body = b'{"api": "api-1", "store": "store-1"}'
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        status, answer = (b"404 Not Found", b"{}") if connections == 1 else (b"200 OK", body)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(answer), answer))  # fmt: skip
                await writer.drain()
        writer.close()

    seen = await _load_against(serve, 10.0, 2.5, tmp_path)
    assert seen["failed"] == {"http 404": 1} and seen["ok"] >= 15, seen
    assert connections == 2, connections
