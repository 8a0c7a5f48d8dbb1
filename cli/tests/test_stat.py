"""`meshlet stat` against the fake API server (the `emojivoto` fixture: Deployments meshed by
`meshlet inject --manual`, their pods, and behind each meshed pod's IP and admin port a proxy
metrics registry served by the proxy's own admin server, read through the API server's pod
proxy). Traffic is recorded as the proxy's HTTP engines and relay record it, during the window:
the clock is the test's."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshlet.cli import stat as stat_command
from meshlet.cli.scrape import Failure, Metrics
from meshlet.cli.workloads import Kind, Workload, pod_of
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.meshed import NS, PODS, SILENT, Emojivoto

GOLDEN = Path(__file__).parent / "golden"
LOAD_ID = "load.emojivoto.serviceaccount.identity.meshlet.cluster.local"
WEB_ID = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"


def serve(metrics: ProxyMetrics, status: int, ms: float, client_id: str = "") -> None:
    """One inbound HTTP request and its response, as the proxy's HTTP engines record them."""
    tls = {"tls": "true", "client_id": client_id} if client_id else {}
    conn = metrics.conn("inbound", "10.42.1.11:8080", **tls).values()
    metrics.request_total.labels(*conn, "web.emojivoto.svc.cluster.local").inc()
    values = (*conn, "web.emojivoto.svc.cluster.local", str(status), "",
              "success" if status < 500 else "failure")  # fmt: skip
    metrics.response_total.labels(*values).inc()
    metrics.response_latency_ms.labels(*values).observe(ms)


def connect(metrics: ProxyMetrics, client_id: str, *, still_open: bool) -> None:
    """One inbound opaque TCP connection over mTLS, as the relay records it."""
    conn = metrics.conn("inbound", "10.42.3.31:7000", tls="true", client_id=client_id).values()
    accepted = metrics.tcp.conn("src", conn)
    app = metrics.dst_conn("inbound", ("10.42.3.31", 7000), None)
    for tcp in (accepted, app):
        tcp.open()
        tcp.read, tcp.written = 300, 1200
        if not still_open:
            tcp.close()


@dataclass
class FakeClock:
    """The window passes at once: `during` is the traffic of the window."""

    t: float = 1000.0
    during: list[Callable[[], None]] = field(default_factory=list)
    slept: list[float] = field(default_factory=list)

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        for traffic in self.during:
            traffic()
        self.t += seconds


def traffic_before(world: Emojivoto) -> None:
    for _ in range(100):  # earlier traffic: not in the window
        serve(world.proxies.metrics["web-6c8f9d7b5-k2x7q"], 200, 1, LOAD_ID)


def traffic_during(world: Emojivoto) -> None:
    m = world.proxies.metrics
    for _ in range(10):
        serve(m["web-6c8f9d7b5-k2x7q"], 200, 3, LOAD_ID)
    for _ in range(9):
        serve(m["web-6c8f9d7b5-m4p8z"], 200, 4)  # from a client outside the mesh
    serve(m["web-6c8f9d7b5-m4p8z"], 503, 1)
    for i in range(20):
        serve(m["api-5b7d9c4f8-a1b2c"], 200, 20 + i, WEB_ID)
        serve(m["api-5b7d9c4f8-d3e4f"], 200 if i else 500, 60, WEB_ID)
    for i in range(4):
        connect(m["store-7f6d8b9c4-q7r8s"], WEB_ID, still_open=i < 2)


class Mesh:
    """The emojivoto namespace with traffic before the window and during it."""

    def __init__(self, world: Emojivoto, clock: FakeClock) -> None:
        self.world, self.api = world, world.api
        traffic_before(world)
        clock.during.append(lambda: traffic_during(world))

    def stat(self, *args: str) -> Any:
        return self.world.run("stat", *args)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(stat_command, "CLOCK", stat_command.Clock(fake.now, fake.sleep))
    return fake


@pytest.fixture
def mesh(emojivoto: Emojivoto, clock: FakeClock) -> Mesh:
    return Mesh(emojivoto, clock)


def test_deployments(mesh: Mesh, clock: FakeClock, golden: Callable[[Path, str], None]) -> None:
    run = mesh.stat("deploy", "-n", NS)
    assert run.code == 0, run.err
    golden(GOLDEN / "stat-deploy.txt", run.out)
    assert clock.slept == [10.0]  # the default window, between the two scrapes
    assert run.err.startswith("could not read 1 of 6 proxies (their rows count the others):\n")
    assert f"  {NS}/{SILENT}: 503 Service Unavailable: error trying to reach service" in run.err
    assert "Traceback" not in run.err


def test_pods_and_every_namespace_wide(mesh: Mesh, golden: Callable[[Path, str], None]) -> None:
    run = mesh.stat("pods", "-n", NS, "--window", "20s")
    assert run.code == 0, run.err
    golden(GOLDEN / "stat-pods.txt", run.out)
    run = mesh.stat("deploy", "-A", "-o", "wide", "--unmeshed")
    assert run.code == 0, run.err
    golden(GOLDEN / "stat-deploy-all-wide.txt", run.out)


def test_json(mesh: Mesh) -> None:
    run = mesh.stat("deploy/web", "deploy/api", "deploy/store", "-n", NS, "-o", "json")
    assert run.code == 0, run.err
    rows = {row["name"]: row for row in json.loads(run.out)}
    assert list(rows) == ["api", "store", "web"]
    web = rows["web"]
    assert web == {
        "namespace": NS, "kind": "deployment", "name": "web", "meshed": "2/2",
        "success": 0.95, "rps": 2.0, "latency_ms_p50": web["latency_ms_p50"],
        "latency_ms_p95": web["latency_ms_p95"], "latency_ms_p99": web["latency_ms_p99"],
        "tcp_open_connections": 0.0, "tcp_read_bytes_rate": 0.0, "tcp_write_bytes_rate": 0.0,
        "mtls": 0.5, "unreachable": {},
    }  # fmt: skip
    assert 2 < web["latency_ms_p50"] < web["latency_ms_p99"] <= 4
    api = rows["api"]
    assert (api["meshed"], api["success"], api["rps"], api["mtls"]) == ("3/3", 0.975, 4.0, 1.0)
    assert list(api["unreachable"]) == [SILENT]
    assert api["unreachable"][SILENT].startswith(
        "503 Service Unavailable: error trying to reach service"
    )
    store = rows["store"]
    assert (store["success"], store["rps"], store["latency_ms_p50"]) == (None, 0.0, None)
    assert (store["tcp_open_connections"], store["mtls"]) == (2.0, 1.0)
    assert (store["tcp_read_bytes_rate"], store["tcp_write_bytes_rate"]) == (120.0, 480.0)
    assert "could not read 1 of 6 proxies" in run.err  # reported, whatever the format


def test_namespace_comes_from_the_kubeconfig_context(mesh: Mesh) -> None:
    kubeconfig = Path(mesh.world.kubeconfig)
    doc = yaml.safe_load(kubeconfig.read_text())
    doc["contexts"][0]["context"]["namespace"] = NS
    kubeconfig.write_text(yaml.safe_dump(doc))
    run = mesh.stat("po", "-o", "json")
    assert run.code == 0, run.err
    assert {row["name"] for row in json.loads(run.out)} == {p for p in PODS if "legacy" not in p}
    assert all(row["status"] == "Running" for row in json.loads(run.out))


def test_a_user_confined_to_namespaces(mesh: Mesh) -> None:
    """Without the right to read Namespace objects, the namespace is not checked; without the
    right to list pods, the refusal is named."""
    mesh.api.forbidden.add("namespaces")
    run = mesh.stat("deploy/web", "-n", NS, "-o", "json")
    assert run.code == 0, run.err
    assert [row["name"] for row in json.loads(run.out)] == ["web"]
    mesh.api.forbidden.add("pods")
    run = mesh.stat("deploy/web", "-n", NS)
    assert run.code == 1
    assert run.err == "Error: the Kubernetes API refused to read pods (403 Forbidden); check the" \
        " kubeconfig's user and its RBAC permissions\n"  # fmt: skip


def test_nothing_meshed(mesh: Mesh) -> None:
    mesh.api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "empty"}})
    run = mesh.stat("deploy", "-n", "empty")
    assert (run.code, run.out, run.err) == (0, "", "No meshed deployments in namespace empty.\n")
    assert mesh.stat("deploy", "-n", "empty", "-o", "json").out == "[]\n"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("deploy", "-n", "nope"), 1,
         "Error: namespace 'nope' not found; list them with kubectl get namespaces"),
        (("deploy", "web", "gone", "-n", NS), 1,
         "Error: no deployment gone in namespace 'emojivoto'"),
        (("svc", "-n", NS), 64, "unknown resource type 'svc'; expected one of deploy,"),
        (("deploy/web", "po/x"), 64, "give resources of one type"),
        (("deploy", "-t", "10x"), 64, "expected a duration such as 500ms, 10s or 2m"),
        (("deploy", "-t", "0s"), 64, "0s is outside 1s..1h"),
        (("deploy", "-o", "yaml"), 64, "'yaml' is not one of 'table', 'json', 'wide'"),
    ],
)  # fmt: skip
def test_mistakes_are_named_without_a_traceback(
    mesh: Mesh, args: tuple[str, ...], code: int, message: str
) -> None:
    run = mesh.stat(*args)
    assert run.code == code
    assert message in run.err
    assert "Traceback" not in run.err and run.out == ""


def test_unreachable_cluster(
    meshlet: Callable[..., Any], tmp_path: Path, unreachable_kubeconfig: Path
) -> None:
    kubeconfig = unreachable_kubeconfig
    run = meshlet("stat", "deploy", "--kubeconfig", str(kubeconfig))
    assert run.code == 1
    assert run.err.startswith("Error: cannot reach the Kubernetes API (")
    assert "Traceback" not in run.err
    run = meshlet("stat", "deploy", "--kubeconfig", str(tmp_path / "missing"))
    assert run.code == 1 and run.err.startswith(f"Error: kubeconfig {tmp_path}/missing not found")


def test_a_real_window(emojivoto: Emojivoto) -> None:
    """Without the test's clock: two scrapes a real second apart, traffic in between."""
    web = emojivoto.proxies.metrics["web-6c8f9d7b5-k2x7q"]

    def traffic() -> None:
        time.sleep(0.3)
        for _ in range(10):
            serve(web, 200, 2, LOAD_ID)

    thread = threading.Thread(target=traffic)
    thread.start()
    run = emojivoto.run("stat", "deploy/web", "-n", NS, "-t", "1s", "-o", "json")
    thread.join()
    assert run.code == 0, run.err
    (row,) = json.loads(run.out)
    assert 7 <= row["rps"] <= 11 and row["success"] == 1.0 and row["mtls"] == 1.0


def test_measure_leaves_out_what_it_cannot_read() -> None:
    """Pure: a failed read, and a port that answers something other than Prometheus text."""
    meta = {"namespace": NS, "labels": {"meshlet.io/control-plane-ns": "meshlet"}}
    pods = [pod_of({"metadata": {**meta, "name": n}, "status": {"phase": "Running"}})
            for n in ("a", "b", "c")]  # fmt: skip
    good = ProxyMetrics()
    serve(good, 200, 5, LOAD_ID)
    text = good.registry.render().decode()
    first = {pods[0].key: Metrics(pods[0], "", 0.0), pods[1].key: Failure(pods[1], "503 no"),
             pods[2].key: Metrics(pods[2], "<html>", 0.0)}  # fmt: skip
    second = {pods[0].key: Metrics(pods[0], text, 2.0), pods[1].key: Metrics(pods[1], text, 2.0),
              pods[2].key: Metrics(pods[2], "<html>", 2.0)}  # fmt: skip
    (result,) = stat_command.measure([Workload(Kind.DEPLOYMENT, NS, "w", tuple(pods))], first,
                                     second)  # fmt: skip
    assert result.row is not None and result.row.rps == 0.5 and result.row.success == 1.0
    assert result.unreachable["b"] == "503 no"
    assert result.unreachable["c"].startswith("its admin port did not answer Prometheus text")
    assert "could not read 2 of 3 proxies" in stat_command.unreachable_report([result])


def test_when_no_proxy_can_be_read_the_command_fails(mesh: Mesh) -> None:
    run = mesh.stat(f"po/{SILENT}", "-n", NS)
    assert run.code == 1
    assert run.err.startswith("could not read 1 of 1 proxies")
    assert "Traceback" not in run.err
    assert mesh.stat(f"po/{SILENT}", "-n", NS, "-o", "json").code == 1
