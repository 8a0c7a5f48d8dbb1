"""meshlet on a real cluster (k3d): install, check, mesh the demo, observe mTLS and balancing.

Run by `make e2e`, never by `make test`. Needs docker, k3d and kubectl; without them every
test is skipped with a message naming what is missing. Set MESHLET_E2E_KEEP=1 to keep the
cluster afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent
CLUSTER = "meshlet-e2e"
REGISTRY, TAG = "ghcr.io/meshlet", "dev"
MESHLET = str(ROOT / ".venv" / "bin" / "meshlet")


def _missing() -> list[str]:
    missing = [tool for tool in ("docker", "k3d", "kubectl") if shutil.which(tool) is None]
    if "docker" not in missing:
        engine = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
        if engine.returncode != 0:
            missing.append("a running Docker engine")
    return missing


MISSING = _missing()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"e2e needs {', '.join(MISSING)} (not available on this machine)"
)


def sh(*argv: str, stdin: str | None = None, timeout: float = 600) -> str:
    result = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def eventually(what: str, probe: object, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            return probe()  # type: ignore[operator,no-any-return]
        except AssertionError as exc:
            last = str(exc)
        time.sleep(3)
    pytest.fail(f"{what} not reached in {timeout:.0f}s: {last}")


def metrics(namespace: str, pod: str) -> str:
    return sh("kubectl", "get", "--raw",
              f"/api/v1/namespaces/{namespace}/pods/{pod}:4191/proxy/metrics")  # fmt: skip


def pods(namespace: str, selector: str) -> list[dict[str, object]]:
    out = sh("kubectl", "get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    return list(json.loads(out)["items"])


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    sh("k3d", "cluster", "create", "--config", str(HERE / "k3d.yaml"), "--wait")
    try:
        sh("make", "images", f"REGISTRY={REGISTRY}", f"TAG={TAG}", timeout=1800)
        sh("k3d", "image", "import", "-c", CLUSTER,
           f"{REGISTRY}/controller:{TAG}", f"{REGISTRY}/proxy:{TAG}")  # fmt: skip
        sh("kubectl", "apply", "-f", "-", stdin=sh(MESHLET, "install", "--crds"))
        manifests = sh(MESHLET, "install", "--set",
                       f"image.tag={TAG},image.pullPolicy=Never")  # fmt: skip
        sh("kubectl", "apply", "-f", "-", stdin=manifests)
        yield
    finally:
        if os.environ.get("MESHLET_E2E_KEEP") != "1":
            subprocess.run(["k3d", "cluster", "delete", CLUSTER], check=False)


def test_check_passes(cluster: None) -> None:
    eventually("meshlet check passing", lambda: sh(MESHLET, "check", "--fail-on-warning"))


def test_demo_is_meshed_with_mtls_and_balanced(cluster: None) -> None:
    sh("kubectl", "apply", "-f", str(HERE / "demo.yaml"))
    sh("kubectl", "wait", "-n", "demo", "--for=condition=Available", "deploy", "--all",
       "--timeout=300s")  # fmt: skip
    for pod in pods("demo", "app"):
        spec = pod["spec"]
        assert isinstance(spec, dict)
        names = [c["name"] for c in [*spec.get("initContainers", []), *spec["containers"]]]
        assert "meshlet-proxy" in names and "meshlet-init" in names

    def served() -> str:
        counts = {}
        for pod in pods("demo", "app=web"):
            name = pod["metadata"]["name"]  # type: ignore[index]
            text = metrics("demo", name)
            found = re.findall(
                r'request_total\{[^}]*direction="inbound"[^}]*tls="true"[^}]*\} (\d+)', text
            )
            assert found, f"{name}: no mTLS inbound requests yet"
            counts[name] = sum(int(float(n)) for n in found)
        slow = [n for n in counts if n.startswith("web-slow")]
        fast = [n for n in counts if not n.startswith("web-slow")]
        assert sum(counts[n] for n in fast) > 200, counts
        assert all(counts[s] * 3 < min(counts[f] for f in fast) for s in slow), counts
        return json.dumps(counts)

    eventually("mTLS traffic balanced away from the slow replica", served)


def test_stat_and_diagnostics(cluster: None) -> None:
    """meshlet stat reads the web replicas' proxies through the API server; endpoints asks the
    destination through a port-forward; proxy-metrics prints what the proxies count."""
    sh("kubectl", "apply", "-f", str(HERE / "demo.yaml"))
    sh("kubectl", "wait", "-n", "demo", "--for=condition=Available", "deploy", "--all",
       "--timeout=300s")  # fmt: skip

    def stat() -> str:
        out = sh(MESHLET, "stat", "deploy", "-n", "demo", "-t", "10s", "-o", "json")
        rows = {row["name"]: row for row in json.loads(out)}
        web = rows.get("web")
        assert web is not None and web["meshed"] == "2/2", rows
        assert web["rps"] and web["rps"] > 5 and web["success"] == 1.0, web
        assert web["mtls"] == 1.0 and not web["unreachable"], web
        return out

    eventually("meshlet stat showing mTLS traffic to web", stat)
    table = sh(MESHLET, "stat", "pods", "-n", "demo", "-t", "2s")
    assert table.splitlines()[0].split()[:3] == ["NAME", "STATUS", "MESHED"], table
    endpoints = json.loads(sh(MESHLET, "diagnostics", "endpoints",
                              "web.demo.svc.cluster.local:80", "-o", "json"))  # fmt: skip
    assert len(endpoints) == 3, endpoints
    assert {e["identity"] for e in endpoints} == {
        "web.demo.serviceaccount.identity.meshlet.cluster.local"
    }
    assert all(e["protocol"] == "h2" and e["opaque_transport_port"] == 4143 for e in endpoints)
    raw = sh(MESHLET, "diagnostics", "proxy-metrics", "-n", "demo", "deploy/web")
    assert raw.count("# POD web-") == 2 and 'direction="inbound"' in raw
