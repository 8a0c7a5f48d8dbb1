"""`meshlet diagnostics proxy-metrics` through the fake API server's pod proxy, and `meshlet
diagnostics endpoints` asking a real `DestinationServer`: through a port-forward to the
destination pod (the server watching the same fake API), or directly over TLS as in the local
mesh (the server reading a manifests folder)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from meshlet.api import wellknown as wk
from meshlet.api.hostport import HostPort
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.informer import KubernetesSource
from meshlet.controlplane.k8s.manifests import ManifestsFolder, ManifestsSource
from meshlet_testing.background import BackgroundLoop
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.meshed import NS, SILENT, Emojivoto, closed_port

GOLDEN = Path(__file__).parent / "golden"
WEB = f"web.{NS}.svc.cluster.local:80"
DESTINATION_IP = "10.42.0.5"


# -- proxy-metrics ----------------------------------------------------------------------------


def sections(text: str) -> dict[str, str]:
    """`# POD name (i of n)` → what follows it."""
    out: dict[str, str] = {}
    for chunk in text.split("#\n# POD ")[1:]:
        title, _, body = chunk.partition("\n#\n")
        out[title] = body
    return out


def test_proxy_metrics_of_a_deployment(emojivoto: Emojivoto) -> None:
    web = emojivoto.proxies.metrics["web-6c8f9d7b5-k2x7q"]
    web.fail_fast_total.labels("inbound", "no_identity").inc(3)
    run = emojivoto.run("diagnostics", "proxy-metrics", "-n", NS, "deploy/web")
    assert run.code == 0, run.err
    parts = sections(run.out)
    assert list(parts) == ["web-6c8f9d7b5-k2x7q (1 of 2)", "web-6c8f9d7b5-m4p8z (2 of 2)"]
    first = parts["web-6c8f9d7b5-k2x7q (1 of 2)"]
    assert 'fail_fast_total{direction="inbound",reason="no_identity"} 3.0\n' in first
    assert "# TYPE response_latency_ms histogram" in first  # the proxy's own families
    assert "fail_fast_total{" not in parts["web-6c8f9d7b5-m4p8z (2 of 2)"]


def test_proxy_metrics_of_one_pod(emojivoto: Emojivoto) -> None:
    for target in ("store-7f6d8b9c4-q7r8s", "po/store-7f6d8b9c4-q7r8s"):
        run = emojivoto.run("diagnostics", "proxy-metrics", "-n", NS, target)
        assert run.code == 0, run.err
        assert list(sections(run.out)) == ["store-7f6d8b9c4-q7r8s (1 of 1)"]
        assert "# HELP tcp_open_total TCP connections opened." in run.out


def test_proxy_metrics_names_what_it_could_not_read(emojivoto: Emojivoto) -> None:
    run = emojivoto.run("diagnostics", "proxy-metrics", "-n", NS, "deploy/api")
    assert run.code == 1  # after printing every pod
    parts = sections(run.out)
    assert len(parts) == 3
    silent = parts[f"{SILENT} (3 of 3)"]
    assert silent.startswith("# ERROR: 503 Service Unavailable: error trying to reach service")
    assert "# TYPE request_total counter" in parts["api-5b7d9c4f8-a1b2c (1 of 3)"]
    run = emojivoto.run("diagnostics", "proxy-metrics", "-n", NS, "deploy/legacy")
    assert run.code == 1
    assert "# ERROR: not meshed (no meshlet.io/control-plane-ns label)" in run.out


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("po/nope",), 1, "Error: pod emojivoto/nope not found"),
        (("deploy/nope",), 1, "Error: deployment emojivoto/nope not found"),
        (("svc/web",), 64, "unknown resource type 'svc'"),
        (("deploy/",), 64, "names no resource"),
    ],
)
def test_proxy_metrics_mistakes(
    emojivoto: Emojivoto, args: tuple[str, ...], code: int, message: str
) -> None:
    run = emojivoto.run("diagnostics", "proxy-metrics", "-n", NS, *args)
    assert (run.code, run.out) == (code, "")
    assert message in run.err and "Traceback" not in run.err


# -- endpoints through a port-forward -------------------------------------------------------


def wait_ready(server: DestinationServer) -> None:
    deadline = time.monotonic() + 10
    while not server.ready():
        assert time.monotonic() < deadline, "the destination did not sync"
        time.sleep(0.02)


class ControlPlane:
    """A destination pod in namespace meshlet whose port 8086 is a real `DestinationServer`
    watching the fake API, as `meshlet-controller destination --in-cluster` does."""

    def __init__(self, api: FakeKubeAPI, background: BackgroundLoop) -> None:
        self.api, self.background = api, background
        self.api_client = client.ApiClient(api.client_configuration())
        source = KubernetesSource(self.api_client, watch_timeout=2.0, backoff=(0.05, 0.2))
        self.server = DestinationServer(
            DestinationConfig(
                addr=HostPort("127.0.0.1", 0),
                admin_addr=("127.0.0.1", 0),
                source=source,
                derive_from_pods=False,
            )
        )
        background.run(self.server.start())

    def destination_pod(self, name: str = "meshlet-destination-7c9d8f6b5-w2x3y") -> None:
        self.api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "meshlet"}})
        labels = {wk.CONTROL_PLANE_COMPONENT_LABEL: "destination"}
        self.api.apply({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "meshlet", "labels": labels},
            "spec": {"containers": [{"name": "destination", "image": "meshlet/controller",
                                     "ports": [{"name": "grpc", "containerPort": 8086}]}]},
            "status": {"phase": "Running", "podIP": DESTINATION_IP,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })  # fmt: skip
        self.api.expose(DESTINATION_IP, wk.DESTINATION_PORT, ("127.0.0.1", self.server.grpc_port))

    def close(self) -> None:
        self.background.run(self.server.stop(grace=0))
        self.api_client.close()


def services(api: FakeKubeAPI) -> None:
    """web (two meshed pods), store (opaque port), legacy (unmeshed), empty (no endpoints)."""
    ports = [("http", 8080)]
    api.apply(objects.service("web", NS, cluster_ip="10.96.0.10"))
    api.apply(objects.endpoint_slice("web-abcde", "web", [
        ("10.42.1.11", True, "web-6c8f9d7b5-k2x7q"), ("10.42.1.12", True, "web-6c8f9d7b5-m4p8z"),
        ("10.42.1.9", False, "web-6c8f9d7b5-old01"),  # not ready: not an endpoint
    ], NS, ports=ports))  # fmt: skip
    opaque = {"config.meshlet.io/opaque-ports": "7000"}
    api.apply(objects.service("store", NS, ports=[("tcp", 7000, 7000)], cluster_ip="10.96.0.12",
                              annotations=opaque))  # fmt: skip
    api.apply(objects.endpoint_slice("store-abcde", "store",
                                     [("10.42.3.31", True, "store-7f6d8b9c4-q7r8s")], NS,
                                     ports=[("tcp", 7000)], zone="zone-b"))  # fmt: skip
    api.apply(objects.service("legacy", NS, cluster_ip="10.96.0.13"))
    api.apply(objects.endpoint_slice("legacy-abcde", "legacy",
                                     [("10.42.4.41", True, "legacy-8d9f7c6b5-t9u1v")], NS,
                                     ports=ports))  # fmt: skip
    api.apply(objects.service("empty", NS, cluster_ip="10.96.0.14"))


@pytest.fixture
def control_plane(emojivoto: Emojivoto, background: BackgroundLoop) -> Iterator[ControlPlane]:
    services(emojivoto.api)
    cp = ControlPlane(emojivoto.api, background)
    try:
        wait_ready(cp.server)
        cp.destination_pod()
        yield cp
    finally:
        cp.close()


def endpoints(emojivoto: Emojivoto, *args: str) -> Any:
    return emojivoto.run("diagnostics", "endpoints", *args)


def test_endpoints_through_a_port_forward(
    emojivoto: Emojivoto, control_plane: ControlPlane, golden: Callable[[Path, str], None]
) -> None:
    run = endpoints(emojivoto, WEB, f"store.{NS}.svc.cluster.local:7000",
                    f"legacy.{NS}.svc.cluster.local:80")  # fmt: skip
    assert run.code == 0, run.err
    golden(GOLDEN / "endpoints.txt", run.out)
    assert run.err == ""
    forwarded = [p for _, p in emojivoto.api.requests if "/portforward" in p]
    assert forwarded == ["/api/v1/namespaces/meshlet/pods/meshlet-destination-7c9d8f6b5-w2x3y"
                         "/portforward?ports=8086"]  # fmt: skip
    wide = endpoints(emojivoto, "web", "store", "-n", NS, "--port", "80", "-o", "wide")
    assert wide.code == 0, wide.err
    golden(GOLDEN / "endpoints-wide.txt", wide.out)
    assert wide.err == f"No endpoints for store.{NS}.svc.cluster.local:80: the service exists" \
        " but has no ready endpoints.\n"  # fmt: skip


def test_endpoints_as_json(emojivoto: Emojivoto, control_plane: ControlPlane) -> None:
    run = endpoints(emojivoto, WEB, f"store.{NS}.svc.cluster.local:7000", "-o", "json")
    assert run.code == 0, run.err
    docs = json.loads(run.out)
    assert [(d["ip"], d["port"], d["pod"]) for d in docs] == [
        ("10.42.1.11", 8080, "web-6c8f9d7b5-k2x7q"), ("10.42.1.12", 8080, "web-6c8f9d7b5-m4p8z"),
        ("10.42.3.31", 7000, "store-7f6d8b9c4-q7r8s"),
    ]  # fmt: skip
    web = docs[0]
    assert web["authority"] == WEB and web["service"] == f"web.{NS}" and web["weight"] == 10000
    assert web["identity"] == f"web.{NS}.serviceaccount.identity.meshlet.cluster.local"
    assert web["server_name"] == web["identity"]
    assert (web["protocol"], web["opaque_transport_port"]) == ("h2", 4143)
    assert web["labels"]["deployment"] == "web" and web["labels"]["namespace"] == NS
    assert web["labels"]["pod"] == "web-6c8f9d7b5-k2x7q" and web["labels"]["zone"] == "zone-a"
    assert docs[2]["protocol"] == "opaque"


def test_endpoints_of_unknown_and_empty_services(
    emojivoto: Emojivoto, control_plane: ControlPlane
) -> None:
    run = endpoints(emojivoto, "empty", "nothing", "-n", NS)
    assert (run.code, run.out) == (0, "")
    assert run.err == (
        f"No endpoints for empty.{NS}.svc.cluster.local:80: the service exists but has no ready"
        f" endpoints.\nNo endpoints for nothing.{NS}.svc.cluster.local:80: no such service.\n"
    )
    assert endpoints(emojivoto, "nothing", "-n", NS, "-o", "json").out == "[]\n"


def test_endpoints_refused_or_unreachable(
    emojivoto: Emojivoto, control_plane: ControlPlane
) -> None:
    run = endpoints(emojivoto, "10.42.1.11:8080")
    assert run.code == 1
    assert run.err.startswith("Error: the destination refused 10.42.1.11:8080: INVALID_ARGUMENT")
    assert "[meshlet/meshlet-destination-7c9d8f6b5-w2x3y:8086 (port-forward)]" in run.err
    # the pod is there, nothing listens on its port: the kubelet's words reach the user
    emojivoto.api.expose(DESTINATION_IP, wk.DESTINATION_PORT, ("127.0.0.1", closed_port()))
    run = endpoints(emojivoto, WEB, "--timeout", "2s")
    assert run.code == 1
    assert run.err.startswith("Error: cannot reach the destination service")
    assert "error forwarding port 8086 to pod meshlet-destination-7c9d8f6b5-w2x3y" in run.err
    assert "Traceback" not in run.err


def test_endpoints_without_a_destination_pod(emojivoto: Emojivoto) -> None:
    run = endpoints(emojivoto, WEB)
    assert run.code == 1
    assert run.err.startswith(
        "Error: no running, ready destination pod in namespace 'meshlet'"
        " (meshlet.io/control-plane-component=destination); is meshlet installed?"
    )
    run = endpoints(emojivoto, WEB, "--timeout", "soon")
    assert run.code == 64 and "expected a duration" in run.err


# -- endpoints directly, over TLS, as in the local mesh --------------------------------------


@pytest.fixture
def local_destination(
    tmp_path: Path, test_ca: Any, background: BackgroundLoop
) -> Iterator[DestinationServer]:
    """`meshlet-controller destination --manifests DIR --tls-cert … --tls-key …`, as the demo
    runs it."""
    folder = ManifestsFolder(tmp_path / "manifests")
    folder.root.mkdir()
    folder.put("svc", objects.service("api", "demo", ports=[("grpc", 9090, 9090)]))
    folder.put("api-1", objects.pod("api-1", "10.77.1.21", "demo", app="api", sa="api",
                                    container_ports=[("grpc", 9090)]))  # fmt: skip
    chain, key = test_ca.serving_cert(wk.DESTINATION_SERVICE_NAME, tmp_path / "tls")
    server = DestinationServer(
        DestinationConfig(
            addr=HostPort("127.0.0.1", 0),
            admin_addr=("127.0.0.1", 0),
            source=ManifestsSource(folder.root, poll_interval=0.05),
            derive_from_pods=True,
            tls=(chain, key),
        )
    )
    background.run(server.start())
    wait_ready(server)
    try:
        yield server
    finally:
        background.run(server.stop(grace=0))


def test_endpoints_from_a_destination_address_over_tls(
    meshlet: Callable[..., Any], local_destination: DestinationServer, test_ca: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    addr = f"127.0.0.1:{local_destination.grpc_port}"
    anchors = str(test_ca.anchors_path)
    run = meshlet("diagnostics", "endpoints", "api.demo.svc.cluster.local:9090",
                  "--destination-addr", addr, "--destination-ca", anchors)  # fmt: skip
    assert run.code == 0, run.err
    assert run.out.splitlines()[1].split() == [
        "demo", "10.77.1.21", "9090", "api-1", "api.demo", "10000", "h2",
        "api.demo.serviceaccount.identity.meshlet.cluster.local",
    ]  # fmt: skip
    # another CA's anchors: the destination's certificate is not trusted
    import datetime as dt

    from meshlet.controlplane.identity import ca

    other, _ = ca.create_trust_anchor(dt.datetime.now(dt.UTC))
    (tmp_path / "other.pem").write_bytes(ca.cert_pem(other))
    other_pem = str(tmp_path / "other.pem")
    run = meshlet("diagnostics", "endpoints", "api.demo.svc.cluster.local:9090", "--timeout",
                  "2s", "--destination-addr", addr, "--destination-ca", other_pem)  # fmt: skip
    assert run.code == 1
    assert run.err.startswith("Error: cannot reach the destination service: ")
    assert f"[{addr}]" in run.err and "Traceback" not in run.err
    run = meshlet("diagnostics", "endpoints", "api.demo.svc.cluster.local:9090", "--timeout",
                  "2s", "--destination-addr", addr)  # fmt: skip
    assert run.code == 1  # plaintext to a TLS server
    assert run.err.rstrip().endswith("if it serves TLS (the local mesh's destination does), give"
                                      " --destination-ca")  # fmt: skip
    run = meshlet("diagnostics", "endpoints", "api", "--destination-ca", anchors)
    assert run.code == 64 and "--destination-ca goes with --destination-addr" in run.err
