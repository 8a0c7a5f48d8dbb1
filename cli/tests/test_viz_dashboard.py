"""`meshlet viz dashboard` (a process): a port-forward through the fake Kubernetes API to the
web container of the tap pod, where `meshlet-controller web` (a process) answers; and a kept
local mesh's dashboard, whose address it prints."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli.demo.supervisor import Record
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.sockets import free_port as _free_port

TAP_POD, TAP_IP = "meshlet-tap-6b7c8d9f5-q1w2e", "10.42.0.88"


@pytest.fixture
def web() -> Iterator[int]:
    """`meshlet-controller web` on loopback, its Prometheus and tap controller absent."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", "web", "--addr", f"127.0.0.1:{port}",
         "--admin-addr", "127.0.0.1:0", "--prometheus-url", "http://127.0.0.1:1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    yield port
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err


def dashboard(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshlet.cli.main", "viz", "dashboard", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_through_a_port_forward_to_the_web_container(
    api: FakeKubeAPI, web: int, tmp_path: Path
) -> None:
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "meshlet"}})
    api.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": TAP_POD, "namespace": "meshlet",
                     "labels": {wellknown.CONTROL_PLANE_COMPONENT_LABEL: "tap"}},
        "spec": {"containers": [{"name": "tap", "image": "meshlet/controller"},
                                {"name": "web", "image": "meshlet/controller"}]},
        "status": {"phase": "Running", "podIP": TAP_IP,
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip
    api.expose(TAP_IP, wellknown.WEB_PORT, ("127.0.0.1", web))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    proc = dashboard("--port", "0", "--kubeconfig", str(kubeconfig))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("meshlet dashboard at http://127.0.0.1:"), proc.stderr
        assert f"meshlet/{TAP_POD}:{wellknown.WEB_PORT} (port-forward" in line
        url = line.split()[3]
        status, page = fetch(f"{url}tap?resource=deploy/web")
        assert status == 200 and "id=tap-form" in page and 'value="deploy/web"' in page
        status, page = fetch(url)
        assert status == 503 and "cannot reach Prometheus" in page
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    forwarded = [p for _, p in api.requests if "/portforward" in p]
    assert forwarded[-1] == f"/api/v1/namespaces/meshlet/pods/{TAP_POD}/portforward?ports=8084"


def test_a_kept_local_mesh_gets_its_address_printed(
    tmp_path: Path, meshlet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshlet.cli.demo import supervisor

    root = tmp_path / "meshlet-demo"
    root.mkdir()
    url = f"http://10.77.0.2:{wellknown.WEB_PORT}"
    Record("netns", str(root), str(tmp_path / "shm"), processes={"web": os.getpid()},
           urls={"dashboard": url}).save()  # fmt: skip
    monkeypatch.setattr(supervisor, "state_root", lambda: root)  # this test's demo, not the user's
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config: no cluster named
    run = meshlet("viz", "dashboard")
    assert run.code == 0, run.err
    assert run.out == f"meshlet dashboard at {url}/ (the local mesh's dashboard)\n"
