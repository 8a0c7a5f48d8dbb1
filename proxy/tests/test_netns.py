"""Redirected traffic through real iptables: two pods as network namespaces on a veth pair.

Pod A (client) and pod B (server) each run `meshlet-init` and a proxy with GID 2102, whose own
connections skip the redirect. A's connections to B go A outbound → B inbound → B's app.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlet.api import wellknown

SERVER_A, SERVER_B = "10.254.0.1", "10.254.0.2"

APP = textwrap.dedent(
    """
    import socket, sys, threading
    def http(port):
        s = socket.create_server(("0.0.0.0", port))
        while True:
            c, _ = s.accept()
            def serve(c):
                buf = b""
                while b"\\r\\n\\r\\n" not in buf:
                    chunk = c.recv(4096)
                    if not chunk:
                        return c.close()
                    buf += chunk
                body = b"hello from pod b"
                head = b"HTTP/1.1 200 OK\\r\\nConnection: close\\r\\n"
                c.sendall(head + b"Content-Length: %d\\r\\n\\r\\n" % len(body) + body)
                c.close()
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    def greeter(port):
        s = socket.create_server(("0.0.0.0", port))
        while True:
            c, _ = s.accept()
            c.sendall(b"220 greetings\\r\\n")
            c.close()
    def recorder(port):  # HTTP that answers every head and writes down every byte it gets
        s = socket.create_server(("0.0.0.0", port))
        while True:
            c, _ = s.accept()
            def serve(c):
                buf = b""
                while chunk := c.recv(65536):
                    with open(sys.argv[1], "ab") as log:
                        log.write(chunk)
                    buf += chunk
                    while b"\\r\\n\\r\\n" in buf:
                        _, buf = buf.split(b"\\r\\n\\r\\n", 1)
                        c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n")
                c.close()
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    for target, port in ((http, 8080), (greeter, 3306), (greeter, 2525), (recorder, 8081)):
        threading.Thread(target=target, args=(port,), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    host, port, send = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
    started = time.monotonic()
    s = socket.create_connection((host, port), timeout=10)
    if send:
        s.sendall(send.replace(b"|", b"\\r\\n"))
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    print(round(time.monotonic() - started, 3))
    sys.stdout.write(data.decode())
    """
)


# Sends `steps` (JSON: [[text, seconds to wait after it], ...]) on one connection, then reads
# until the server closes (or 5 s of nothing): prints what came back.
ATTACKER = textwrap.dedent(
    """
    import json, socket, sys, time
    host, port, steps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    s = socket.create_connection((host, port), timeout=5)
    try:
        for text, pause in steps:
            s.sendall(text.encode())
            time.sleep(pause)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    except OSError as exc:
        data = f"<{type(exc).__name__}>".encode()
    sys.stdout.write(data.decode(errors="replace"))
    """
)


@dataclass
class Pod:
    ns: str
    processes: list[subprocess.Popen[str]]

    def run(self, *argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
            timeout=30, **kw,  # type: ignore[call-overload]
        )  # fmt: skip

    def spawn(self, *argv: str, env: dict[str, str] | None = None, gid: int | None = None) -> None:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, *argv],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, group=gid,
        )  # fmt: skip
        self.processes.append(proc)

    def attack(self, host: str, port: int, steps: list[tuple[str, float]]) -> str:
        """Runs ATTACKER with the proxy's GID, so that its connection skips this pod's own
        proxy: what reaches the other pod is exactly what it sent."""
        result = subprocess.run(
            ["ip", "netns", "exec", self.ns, sys.executable, "-c", ATTACKER, host, str(port),
             json.dumps(steps)],
            capture_output=True, text=True, timeout=30, group=wellknown.PROXY_GID,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    def connect(self, host: str, port: int, send: str = "") -> tuple[float, str]:
        result = self.run(sys.executable, "-c", CLIENT, host, str(port), send)
        assert result.returncode == 0, result.stderr
        elapsed, _, data = result.stdout.partition("\n")
        return float(elapsed), data


def _proxy_env(detect: str) -> dict[str, str]:
    return {
        "MESHLET_PROXY_OUTBOUND_LISTEN_ADDR": "127.0.0.1:4140",
        "MESHLET_PROXY_INBOUND_LISTEN_ADDR": "0.0.0.0:4143",
        "MESHLET_PROXY_ADMIN_LISTEN_ADDR": "127.0.0.1:4191",
        "MESHLET_PROXY_OUTBOUND_DETECT_TIMEOUT": detect,
        "MESHLET_PROXY_INBOUND_DETECT_TIMEOUT": detect,
        "MESHLET_PROXY_HTTP1_HEADER_READ_TIMEOUT": "1s",
        "MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD": "1s",
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file where pod B's recording app (port 8081) appends every byte it receives."""
    return tmp_path_factory.mktemp("recorder") / "received"


@pytest.fixture(scope="module")
def pods(netns_available: None, recorded: Path) -> Iterator[tuple[Pod, Pod]]:
    tag = f"{os.getpid() % 10000}"
    a, b = Pod(f"mlt-a-{tag}", []), Pod(f"mlt-b-{tag}", [])
    subprocess.run(["ip", "netns", "add", a.ns], check=True)
    subprocess.run(["ip", "netns", "add", b.ns], check=True)
    try:
        subprocess.run(
            ["ip", "link", "add", "veth-a", "netns", a.ns, "type", "veth", "peer", "name",
             "veth-b", "netns", b.ns], check=True,
        )  # fmt: skip
        for pod, dev, ip in ((a, "veth-a", SERVER_A), (b, "veth-b", SERVER_B)):
            for cmd in (
                ["ip", "addr", "add", f"{ip}/24", "dev", dev],
                ["ip", "link", "set", dev, "up"],
                ["ip", "link", "set", "lo", "up"],
                [sys.executable, "-m", "meshlet.init.main", "--proxy-gid",
                 str(wellknown.PROXY_GID)],
            ):  # fmt: skip
                result = pod.run(*cmd)
                assert result.returncode == 0, result.stderr
        recorded.touch()
        b.spawn(sys.executable, "-c", APP, str(recorded))
        for pod in (a, b):
            pod.spawn(sys.executable, "-m", "meshlet.proxy.main", env=_proxy_env("500ms"),
                      gid=wellknown.PROXY_GID)  # fmt: skip
        deadline = time.monotonic() + 20
        for pod in (a, b):
            while pod.run("python3", "-c", _READY).returncode != 0:
                for proc in pod.processes:
                    assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "proxy never ready"
                time.sleep(0.1)
        yield a, b
    finally:
        for pod in (a, b):
            for proc in pod.processes:
                proc.terminate()
            for proc in pod.processes:
                try:
                    _, err = proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, err = proc.communicate()
                if os.environ.get("MESHLET_TEST_DEBUG"):  # the pods' logs, when debugging
                    print(pod.ns, proc.args[-1], err[-3000:])
            subprocess.run(["ip", "netns", "del", pod.ns], check=False)


_READY = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:4191/ready', timeout=1)"


@pytest.mark.netns
def test_http_through_both_proxies(pods: tuple[Pod, Pod]) -> None:
    a, _ = pods
    _, data = a.connect(SERVER_B, 8080, f"GET / HTTP/1.1|Host: {SERVER_B}:8080|Connection: close||")
    assert data.startswith("HTTP/1.1 200")
    assert data.endswith("hello from pod b")
    for pod, direction in ((pods[0], "outbound"), (pods[1], "inbound")):
        metrics = pod.run("python3", "-c", _METRICS).stdout
        assert re.search(
            rf'^request_total{{authority="{SERVER_B}:8080",[^}}]*direction="{direction}"[^}}]*}} 1',
            metrics,
            re.MULTILINE,
        ), metrics


_METRICS = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:4191/metrics').read().decode())"


@pytest.mark.netns
def test_server_speaks_first_on_an_opaque_port_is_immediate(pods: tuple[Pod, Pod]) -> None:
    a, _ = pods
    elapsed, data = a.connect(SERVER_B, 3306)
    assert data.strip() == "220 greetings"
    assert elapsed < 0.4  # no wait for detection (0.5 s); the rest is slack for a busy machine


@pytest.mark.netns
def test_server_speaks_first_elsewhere_waits_for_detection_then_works(
    pods: tuple[Pod, Pod],
) -> None:
    a, _ = pods
    elapsed, data = a.connect(SERVER_B, 2525)
    assert data.strip() == "220 greetings"
    assert 0.4 < elapsed < 3.0  # outbound detection (0.5 s), then inbound detection
    metrics = a.run("python3", "-c", _METRICS).stdout
    assert 'protocol_detect_timeout_total{direction="outbound",port="2525"} 1.0' in metrics


# --- hostile clients against pod B's inbound proxy (REDIRECT to :4143, no mTLS) --------------

FORGED = "meshlet-client-id: admin.kube-system.serviceaccount.identity.meshlet.cluster.local"


def request(target_bytes: int, *extra: str) -> str:
    target = "/" + "a" * (target_bytes - 1)
    return "\r\n".join((f"GET {target} HTTP/1.1", f"Host: {SERVER_B}:8081", *extra, "", ""))


SMUGGLE = (
    "POST /" + "a" * 3999 + " HTTP/1.1\r\nHost: b\r\nContent-Length: 44\r\n"
    "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: b\r\n\r\n"
)
ATTACKS = {
    "600-byte request line": ([(request(600, FORGED), 0)], "HTTP/1.1 200"),
    "4000-byte request line": ([(request(4000, FORGED), 0)], "HTTP/1.1 200"),
    "8000-byte request line": ([(request(8000, FORGED), 0)], "HTTP/1.1 200"),
    "method split over reads": ([("GE", 0.2), ("T /split HTTP/1.1\r\n" + FORGED + "\r\n\r\n", 0)],
                                "HTTP/1.1 200"),
    # detection (0.5 s) and the head deadline (1 s from the accept) both pass: 408
    "first byte then silence": ([("G", 1.5), (request(20, FORGED), 0)], "HTTP/1.1 408"),
    "CL+TE smuggle behind a long line": ([(SMUGGLE, 0)], "HTTP/1.1 400"),
    # HTTP/1 servers skip empty lines before a request line: so must detection
    "empty lines before the request line": ([("\r\n\n" + request(20, FORGED), 0)],
                                            "HTTP/1.1 200"),
    "empty line then a CL+TE smuggle": ([("\r\n", 0.2), (SMUGGLE, 0)], "HTTP/1.1 400"),
    # nothing within the detection timeout: relayed as opaque, then HTTP arrives: closed
    "silence then HTTP": ([("", 0.8), (request(20, FORGED), 0)], ""),
}  # fmt: skip


@pytest.mark.netns
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_app_never_receives_a_forged_identity_or_a_smuggled_request(
    pods: tuple[Pod, Pod], recorded: Path, attack: str
) -> None:
    a, _ = pods
    steps, answer = ATTACKS[attack]
    before = recorded.stat().st_size
    response = a.attack(SERVER_B, 8081, steps)
    assert response.startswith(answer), response[:200]
    time.sleep(0.1)
    with recorded.open("rb") as log:
        log.seek(before)
        received = log.read()
    assert b"meshlet-client-id" not in received.lower()
    assert b"smuggled" not in received
    assert b"Transfer-Encoding" not in received and b"POST" not in received
    if answer.endswith("200"):
        assert received.startswith(b"GET /"), received[:100]  # the request itself got through
    else:
        assert received == b""  # refused: nothing of it was forwarded
