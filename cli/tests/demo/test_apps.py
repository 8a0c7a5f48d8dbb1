"""The deny drill's client: how it tells an admitted connection from a refused one, as the real
process against real sockets."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
