"""A real `meshlet-controller injector` process on loopback, for tests that need what it serves
or counts (its admin port's metrics): HTTPS with a certificate for its Service name from a CA
made here, no Kubernetes access (only the pods' own annotations count)."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlet.api import wellknown as wk
from meshlet_testing.processes import stop
from meshlet_testing.sockets import free_port as _free_port

SERVICE = f"{wk.INJECTOR_NAME}.{wk.CONTROL_PLANE_NAMESPACE}.svc"


@dataclass
class Injector:
    proc: subprocess.Popen[Any]
    port: int
    admin: int
    anchors: Path

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.admin}"

    def post(self, body: bytes, path: str = "/inject") -> tuple[int, bytes]:
        """POSTs over TLS, verifying the injector's certificate for its Service name."""
        context = ssl.create_default_context(cafile=str(self.anchors))
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.sock = context.wrap_socket(raw, server_hostname=SERVICE)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.admin_address}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def review(self, review: dict[str, Any], path: str = "/inject") -> dict[str, Any]:
        status, body = self.post(json.dumps(review).encode(), path)
        assert status == 200, body
        return json.loads(body)["response"]  # type: ignore[no-any-return]

    def wait_ready(self, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.admin_address}/ready", timeout=1):
                    return
            except OSError:
                assert self.proc.poll() is None, f"the injector exited: {self.proc.returncode}"
                assert time.monotonic() < deadline, f"the injector not ready in {within:g}s"
                time.sleep(0.1)


@contextmanager
def started(root: Path) -> Iterator[Injector]:
    """Started, not yet ready (`wait_ready`): the caller may do other work meanwhile. Its log
    is `root/injector.log`."""
    from meshlet.controlplane.identity import ca, signer

    root.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer_cert, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    issuer = ca.Issuer(chain=(issuer_cert,), key=issuer_key, anchors=(anchor,))
    cert, key = signer.write_serving_files(issuer, SERVICE, root / "tls", now, signer.LEAF_LIFETIME)
    anchors = root / "anchors.pem"
    anchors.write_bytes(ca.cert_pem(anchor))
    port, admin = _free_port(), _free_port()
    argv = [
        sys.executable, "-m", "meshlet.controlplane.main", "injector",
        "--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
        "--tls-cert", str(cert), "--tls-key", str(key), "--trust-anchors", str(anchors),
    ]  # fmt: skip
    with (root / "injector.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        yield Injector(proc, port, admin, anchors)
    finally:
        stop(proc)
