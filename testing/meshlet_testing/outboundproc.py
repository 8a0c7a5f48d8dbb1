"""A real `meshlet-proxy` process following real `meshlet-controller destination` and `policy`
processes over one manifests folder, for tests of what its outbound side does with Services,
routes and their annotations (plain TCP to the controllers, unmeshed pods: the outbound
listener is reached on loopback, each request routed by its authority)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from meshlet.api import wellknown as wk
from meshlet_testing.processes import stop
from meshlet_testing.sockets import free_port


@dataclass(frozen=True)
class OutboundProxy:
    outbound: int  # the proxy's outbound listener on 127.0.0.1
    admin: int  # its admin port (metrics, readiness)
    log: Path  # the proxy's log


def ready(port: int) -> bool:
    """Whether the admin server on `port` answers `/ready` with 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as response:
            return int(response.status) == 200
    except OSError:
        return False


def start(
    stack: contextlib.ExitStack, root: Path, manifests: Path, ns: str, within: float = 30.0
) -> OutboundProxy:
    """Starts the two controllers over `manifests` and the proxy (workload `client-1` in `ns`),
    each stopped when `stack` closes; returns once all three are ready. Logs go to `root`."""

    def started(argv: list[str], log: Path, **env: str) -> None:
        out = stack.enter_context(log.open("wb"))
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env={**os.environ, **env})
        stack.callback(stop, proc)

    ports = {name: (free_port(), free_port()) for name in ("destination", "policy")}
    for name, (port, admin) in ports.items():
        started([sys.executable, "-m", "meshlet.controlplane.main", name, "--addr",
                 f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
                 "--manifests", str(manifests)], root / f"{name}.log")  # fmt: skip
    outbound, admin = free_port(), free_port()
    p = wk.PROXY_ENV_PREFIX
    started([sys.executable, "-m", "meshlet.proxy.main"], root / "proxy.log", **{
        f"{p}OUTBOUND_LISTEN_ADDR": f"127.0.0.1:{outbound}",
        f"{p}INBOUND_LISTEN_ADDR": f"127.0.0.1:{free_port()}",
        f"{p}ADMIN_LISTEN_ADDR": f"127.0.0.1:{admin}",
        f"{p}CONTROL_LISTEN_ADDR": f"127.0.0.1:{free_port()}",
        f"{p}DESTINATION_SVC_ADDR": f"127.0.0.1:{ports['destination'][0]}",
        f"{p}DESTINATION_CONTEXT": json.dumps({"ns": ns, "nodeName": "node-1"}),
        f"{p}POLICY_SVC_ADDR": f"127.0.0.1:{ports['policy'][0]}",
        f"{p}POLICY_WORKLOAD": json.dumps({"ns": ns, "pod": "client-1"}),
        f"{p}SHUTDOWN_GRACE_PERIOD": "1s",
    })  # fmt: skip
    end = time.monotonic() + within
    for port in (ports["destination"][1], ports["policy"][1], admin):
        while not ready(port):
            assert time.monotonic() < end, f"the admin server on :{port} was not ready in time"
            time.sleep(0.05)
    return OutboundProxy(outbound, admin, root / "proxy.log")


def apps(stack: contextlib.ExitStack, script: str) -> str:
    """Runs `script` (a test module run as its pods' apps) until `stack` closes (the apps' process
    ends when its stdin closes); returns the first line it prints: what it serves."""
    argv = [sys.executable, script]
    proc = stack.enter_context(
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    )
    assert proc.stdout is not None and proc.stdin is not None
    stack.callback(proc.stdin.close)
    return proc.stdout.readline().strip()
