"""The real cluster the end-to-end suite runs on, and the tools it drives it with.

Where Docker answers and k3d is installed, a k3d cluster (e2e/k3d.yaml); otherwise the
single-node Kubernetes of `make cluster` (cluster/node.py: upstream Kubernetes, etcd, CoreDNS,
containerd; root). The images come from `make images` and are imported into the cluster: nothing
is pulled. MESHLET_E2E_KEEP=1 leaves the cluster running afterwards (`make cluster-down` ends it);
MESHLET_REQUIRE_E2E=1 (CI) fails where no cluster can be made instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent
VENV_BIN = ROOT / ".venv" / "bin"
REGISTRY = "ghcr.io/meshlet"
TAG = "0.1.0"  # the chart's appVersion: `meshlet install` runs these images unchanged
IMAGES = tuple(f"{REGISTRY}/{name}:{TAG}" for name in ("controller", "proxy", "demo", "prometheus"))
K3D_CLUSTER = "meshlet-e2e"
ARTIFACTS = ROOT / "e2e" / "artifacts"  # screenshots and logs of the last run

T = TypeVar("T")


def _docker_engine() -> bool:
    if shutil.which("docker") is None or shutil.which("k3d") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _why_no_cluster() -> str | None:
    if _docker_engine():
        return None
    if os.geteuid() != 0:
        return "the single-node cluster needs root (and no Docker engine with k3d is here)"
    if shutil.which("go") is None:
        return "the single-node cluster is built with Go, which is not installed"
    return None


@dataclass
class Cluster:
    """How the suite reaches the cluster: every command runs with its KUBECONFIG and PATH."""

    kind: str  # "node" (make cluster) or "k3d"
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))

    def sh(
        self, *argv: str, stdin: str | None = None, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=self.env,
            check=False,
        )
        if check:
            assert result.returncode == 0, (
                f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def out(self, *argv: str, stdin: str | None = None, timeout: float = 300) -> str:
        return self.sh(*argv, stdin=stdin, timeout=timeout).stdout

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 300) -> str:
        return self.out("kubectl", *args, stdin=stdin, timeout=timeout)

    def meshlet(self, *args: str, stdin: str | None = None, timeout: float = 300) -> str:
        return self.out(str(VENV_BIN / "meshlet"), *args, stdin=stdin, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["get", "pods", "-n", namespace] + (["-l", selector] if selector else [])
        return list(self.json(*args)["items"])

    def metrics(self, namespace: str, pod: str, port: int = 4191) -> str:
        """A proxy's /metrics through the API server's pods/proxy (the kubelet's proxy)."""
        return self.kubectl(
            "get", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/metrics"
        )


def eventually(what: str, probe: Callable[[], T], timeout: float = 180, every: float = 2) -> T:
    """probe() until it returns without an AssertionError; the last one is the failure."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            return probe()
        except AssertionError as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached in {timeout:.0f} s: {last}")
        time.sleep(every)


def _log(message: str) -> None:
    print(f"e2e: {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    why = _why_no_cluster()
    if why:
        if os.environ.get("MESHLET_REQUIRE_E2E") == "1":  # CI: a skip would hide it
            pytest.fail(why)
        pytest.skip(why)
    keep = os.environ.get("MESHLET_E2E_KEEP") == "1"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    if _docker_engine():
        yield from _k3d(keep)
    else:
        yield from _node(keep)


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}\n"
            f"{result.stderr[-4000:]}"
        )
    return result.stdout


def _node(keep: bool) -> Iterator[Cluster]:
    """`make images`, `make cluster`, the images imported, the suite, `make cluster-down`. A
    cluster already running (MESHLET_E2E_KEEP=1 left it) is used as it is, and kept."""
    python = str(VENV_BIN / "python")
    node = str(ROOT / "cluster" / "node.py")
    running = subprocess.run([python, node, "status"], capture_output=True, check=False)
    reuse = running.returncode == 0
    if os.environ.get("MESHLET_E2E_IMAGES", "1") != "0":
        started = time.monotonic()
        _run(["make", "images"], timeout=1800)
        _log(f"images built in {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    env_lines = _run([python, node, "env" if reuse else "up"], timeout=3600)
    _log(f"cluster {'reused' if reuse else 'up'} in {time.monotonic() - started:.0f} s")
    env = dict(os.environ)
    for line in env_lines.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.replace("$PATH", env.get("PATH", ""))
    try:
        _run([python, node, "import", *IMAGES], timeout=600)
        yield Cluster("node", env)
    finally:
        _collect_logs(env)
        if not (keep or reuse):  # `make cluster-down`: it fails naming anything left
            _run([python, node, "down"], timeout=300)


def _k3d(keep: bool) -> Iterator[Cluster]:
    _run(["k3d", "cluster", "create", "--config", str(HERE / "k3d.yaml"), "--wait"], 600)
    try:
        _run(["make", "images", "ENGINE=docker"], timeout=1800)
        _run(["k3d", "image", "import", "-c", K3D_CLUSTER, *IMAGES], timeout=600)
        yield Cluster("k3d")
    finally:
        if not keep:
            subprocess.run(["k3d", "cluster", "delete", K3D_CLUSTER], check=False)


def _collect_logs(env: dict[str, str]) -> None:
    """The control plane's logs, kept with the screenshots for a failed run to be read."""
    result = subprocess.run(
        [
            "kubectl",
            "logs",
            "-n",
            "meshlet",
            "--all-containers",
            "--prefix",
            "--tail=400",
            "-l",
            "app.kubernetes.io/part-of=meshlet",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    (ARTIFACTS / "control-plane.log").write_text(result.stdout + result.stderr)
