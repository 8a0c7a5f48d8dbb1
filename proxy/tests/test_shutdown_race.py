"""SIGTERM while the control streams break: a real `meshlet-proxy` process following real
`meshlet-controller destination` and `policy` processes (WatchPort streams for its inbound
ports; Get, GetProfile and outbound Watch streams for the services it was asked for) is told to
stop in the instant both controllers are killed, round after round. grpclib turns a cancel that
meets a broken connection into a broken-stream error; the proxy must still end every time within
its grace period, never reconnect for ever (HARDENING: every port the proxy serves)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder
from meshlet_testing.outboundproc import free_port, ready
from meshlet_testing.processes import stop

NS: Final = "shop"
PROXIES: Final = 5  # stopped together each round
ROUNDS: Final = 4
SERVICES: Final = 4  # outbound targets asked for: Get, GetProfile and Watch streams each
INBOUND_PORTS: Final = tuple(range(8080, 8096))  # a WatchPort stream each
GRACE: Final = 1.0  # the proxies' MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD
# The grace period, then the rest of the shutdown and the interpreter's exit on a busy machine.
EXIT_WITHIN: Final = GRACE + 5.0


@dataclass
class Controllers:
    manifests: Path
    logs: Path
    ports: dict[str, tuple[int, int]]  # name: (gRPC, admin)
    procs: dict[str, subprocess.Popen[bytes]]

    def start(self) -> None:
        """Starts each controller not running (on its ports of before), returns once ready."""
        for name, (port, admin) in self.ports.items():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                continue
            argv = [
                sys.executable,
                "-m",
                "meshlet.controlplane.main",
                name,
                "--addr",
                f"127.0.0.1:{port}",
                "--admin-addr",
                f"127.0.0.1:{admin}",
                "--manifests",
                str(self.manifests),
            ]
            with (self.logs / f"{name}.log").open("ab") as log:
                self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=log)
        for _, admin in self.ports.values():
            until(lambda admin=admin: ready(admin), 30.0, f"controller admin :{admin} ready")

    def signal(self, how: signal.Signals) -> None:
        for proc in self.procs.values():
            proc.send_signal(how)

    def reap(self) -> None:
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def streams(self, name: str, metric: str) -> float:
        _, admin = self.ports[name]
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=2) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(metric) and not line.startswith("#")
        )


def until(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        time.sleep(0.02)


@pytest.fixture
def controllers(tmp_path: Path) -> Iterator[Controllers]:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    folder = ManifestsFolder(manifests)
    folder.put(
        "client",
        objects.pod(
            "client-1",
            "127.0.0.1",
            NS,
            app="client",
            sa="client",
            container_ports=[(f"p{p}", p) for p in INBOUND_PORTS],
        ),
    )
    for i in range(SERVICES):
        name = f"svc-{i}"
        folder.put(
            name,
            objects.service(
                name,
                NS,
                ports=[("http", 80, 8080)],
                selector={"app": name},
                cluster_ip=f"10.96.9.{i + 1}",
            ),
        )
    found = Controllers(
        manifests,
        tmp_path,
        {name: (free_port(), free_port()) for name in ("destination", "policy")},
        {},
    )
    try:
        found.start()
        yield found
    finally:
        for proc in found.procs.values():
            stop(proc)


def start_proxy(controllers: Controllers, log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """A proxy following both controllers (not waited for); its process, outbound and admin
    ports."""
    outbound, admin = free_port(), free_port()
    p = wk.PROXY_ENV_PREFIX
    env = {
        **os.environ,
        f"{p}OUTBOUND_LISTEN_ADDR": f"127.0.0.1:{outbound}",
        f"{p}INBOUND_LISTEN_ADDR": f"127.0.0.1:{free_port()}",
        f"{p}ADMIN_LISTEN_ADDR": f"127.0.0.1:{admin}",
        f"{p}CONTROL_LISTEN_ADDR": f"127.0.0.1:{free_port()}",
        f"{p}DESTINATION_SVC_ADDR": f"127.0.0.1:{controllers.ports['destination'][0]}",
        f"{p}DESTINATION_CONTEXT": json.dumps({"ns": NS, "nodeName": "node-1"}),
        f"{p}POLICY_SVC_ADDR": f"127.0.0.1:{controllers.ports['policy'][0]}",
        f"{p}POLICY_WORKLOAD": json.dumps({"ns": NS, "pod": "client-1"}),
        f"{p}INBOUND_PORTS": ",".join(map(str, INBOUND_PORTS)),
        f"{p}SHUTDOWN_GRACE_PERIOD": f"{GRACE:g}s",
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshlet.proxy.main"], stdout=out, stderr=out, env=env
        )
    return proc, outbound, admin


def ask_for(outbound: int, service: str) -> None:
    """One HTTP/1.1 request for `service` through the outbound listener: its discovery and
    policy streams open (the answer does not matter: the Service has no endpoints)."""
    with socket.create_connection(("127.0.0.1", outbound), timeout=10) as sock:
        host = f"{service}.{NS}.svc.cluster.local:80"
        sock.sendall(f"GET / HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass


@pytest.mark.timeout(300)
def test_sigterm_ends_every_proxy_within_its_grace_period_while_its_control_streams_break(
    controllers: Controllers, tmp_path: Path
) -> None:
    """Each round, PROXIES proxies open every stream, then they and both controllers are told
    to stop at once (the controllers gracefully, sending GOAWAY, or killed, every other round),
    as when a node or a whole deployment goes down: on a busy machine some proxy's cancels then
    meet its broken streams."""
    exits: list[float] = []
    for round_ in range(ROUNDS):
        controllers.start()
        logs = [tmp_path / f"proxy-{round_}-{i}.log" for i in range(PROXIES)]
        proxies = [start_proxy(controllers, log) for log in logs]
        try:
            for _, outbound, admin in proxies:
                until(lambda admin=admin: ready(admin), 30.0, f"the proxy on admin :{admin} ready")
                for i in range(SERVICES):
                    ask_for(outbound, f"svc-{i}")
            until(
                lambda: (
                    controllers.streams("policy", "policy_watch_streams_active ")
                    >= len(INBOUND_PORTS) * PROXIES
                    and controllers.streams("policy", "policy_outbound_watch_streams_active ")
                    >= SERVICES * PROXIES
                    and controllers.streams("destination", "destination_streams_active")
                    >= 2 * SERVICES * PROXIES
                ),
                30.0,
                "every WatchPort, outbound Watch, Get and GetProfile stream open",
            )
            how = signal.SIGTERM if round_ % 2 == 0 else signal.SIGKILL
            controllers.signal(how)
            for proc, _, _ in proxies:
                proc.send_signal(signal.SIGTERM)
            started = time.monotonic()
            for (proc, _, _), log in zip(proxies, logs, strict=True):
                try:
                    status: int | None = proc.wait(
                        timeout=max(0.0, started + EXIT_WITHIN - time.monotonic())
                    )
                except subprocess.TimeoutExpired:
                    status = None
                exits.append(time.monotonic() - started)
                tail = log.read_text(errors="replace")[-2000:]
                assert status == 0, (
                    f"round {round_} (controllers sent {how.name}): a proxy "
                    f"{'still ran' if status is None else f'exited {status}'} {EXIT_WITHIN:g}s"
                    f" after SIGTERM; its log ends:\n{tail}"
                )
        finally:
            for proc, _, _ in proxies:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            controllers.reap()
    assert max(exits) < EXIT_WITHIN
