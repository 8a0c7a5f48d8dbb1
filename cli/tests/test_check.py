"""`meshlet check` against the fake API server, populated from what `meshlet install` renders:
the real `kubernetes` client reads it all through the real protocol."""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli.checks import POLICY_CRDS
from meshlet.controlplane.identity import ca
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.workloads import ready_pod

GOLDEN = Path(__file__).parent / "golden"
APP = Path(__file__).parent / "data" / "app.yaml"
Obj = dict[str, Any]
CROSS = "\u00d7"  # what a failed check starts with


POD_IP = "10.42.0.9"  # every pod `ready_pod` makes


class PolicyAdminFixture:
    """A test fixture standing in for the policy controller's admin server: `/ready` answers
    `code`, as `meshlet-controller policy` on --admin-addr would."""

    def __init__(self) -> None:
        self.code = 200
        fixture = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code = fixture.code if self.path == "/ready" else 404
                body = b"ready\n" if code == 200 else b"not ready\n"
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def policy_crd_stand_in(name: str) -> Obj:
    """A CustomResourceDefinition of the policy controller's kinds by name: what `meshlet
    check` looks for, whatever schema `meshlet install --crds` gives it."""
    plural, group = name.split(".", 1)
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": name},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"plural": plural, "kind": plural.title(), "singular": plural},
                 "versions": [{"name": "v1beta1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object"}}}]},
    }  # fmt: skip


class Cluster:
    def __init__(self, api: FakeKubeAPI, meshlet: Callable[..., Any], tmp_path: Path) -> None:
        self.api, self.meshlet = api, meshlet
        self.kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
        self.policy_admin = PolicyAdminFixture()
        api.expose(POD_IP, wk.POLICY_ADMIN_PORT, self.policy_admin.address)

    def apply(self, text: str, pods: bool = True) -> list[Obj]:
        docs = [d for d in yaml.safe_load_all(text) if d]
        for doc in docs:
            if doc["kind"] in ("List", "DaemonSet"):  # not served by the fake
                continue
            if pods and doc["kind"] == "Deployment":  # as the controller-manager reports it
                replicas = doc["spec"].get("replicas", 1)
                doc["status"] = {"replicas": replicas, "readyReplicas": replicas,
                                 "availableReplicas": replicas}  # fmt: skip
            self.api.apply(doc)
            if pods and doc["kind"] == "Deployment":
                ns = doc["metadata"]["namespace"]
                name = f"{doc['metadata']['name']}-5d4f8c9b7-x2x7q"
                self.api.apply(ready_pod(doc["spec"]["template"], name, ns, ip=POD_IP))
        return docs

    def crds(self) -> None:
        self.apply(self.meshlet("install", "--crds").out)
        for name in POLICY_CRDS:
            self.api.apply(policy_crd_stand_in(name))

    def install(self, *args: str) -> None:
        self.crds()
        run = self.meshlet("install", *args)
        assert run.code == 0, run.err
        self.apply(run.out)
        self.api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "emojivoto"}})
        meshed = self.meshlet("inject", "--manual", "--kubeconfig", self.kubeconfig, str(APP))
        assert meshed.code == 0, meshed.err
        self.apply(meshed.out)
        # the namespace's copy of the trust roots, which the injector writes for a pod it meshes
        roots = self.api.get("v1", "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP, "meshlet")
        assert roots is not None
        self.api.apply({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": wk.TRUST_ROOTS_COPY, "namespace": "emojivoto",
                                     "labels": {wk.TRUST_ROOTS_COPY_LABEL: "copy"}},
                        "data": roots["data"]})  # fmt: skip

    def check(self, *args: str) -> Any:
        return self.meshlet("check", "--kubeconfig", self.kubeconfig, *args)


@pytest.fixture
def cluster(api: FakeKubeAPI, meshlet: Callable[..., Any], tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(api, meshlet, tmp_path)
    try:
        yield cluster
    finally:
        cluster.policy_admin.close()


def identity_files(tmp_path: Path, issuer_lifetime: dt.timedelta) -> tuple[str, ...]:
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now, issuer_lifetime)
    files = {"anchors.pem": ca.cert_pem(anchor), "crt.pem": ca.cert_pem(issuer),
             "key.pem": ca.key_pem(issuer_key)}  # fmt: skip
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return (
        "--identity-trust-anchors-file", str(tmp_path / "anchors.pem"),
        "--identity-issuer-certificate-file", str(tmp_path / "crt.pem"),
        "--identity-issuer-key-file", str(tmp_path / "key.pem"),
    )  # fmt: skip


def test_healthy(cluster: Cluster, tmp_path: Path, golden: Callable[[Path, str], None]) -> None:
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=365)))
    run = cluster.check()
    assert run.code == 0, run.out
    golden(GOLDEN / "check-healthy.txt", run.out)
    doc = json.loads(cluster.check("-o", "json").out)
    assert doc["success"] is True
    assert [c["categoryName"] for c in doc["categories"]] == [
        "kubernetes-api", "kubernetes-version", "meshlet-crds", "meshlet-existence",
        "meshlet-identity", "meshlet-webhook", "meshlet-policy", "meshlet-data-plane",
    ]  # fmt: skip
    assert all(c["result"] == "success" for cat in doc["categories"] for c in cat["checks"])
    assert cluster.check("--fail-on-warning").code == 0


def test_missing_control_plane(cluster: Cluster, golden: Callable[[Path, str], None]) -> None:
    cluster.crds()
    run = cluster.check()
    assert run.code == 1
    golden(GOLDEN / "check-missing-control-plane.txt", run.out)
    doc = json.loads(cluster.check("-o", "json").out)
    assert doc["success"] is False
    failed = [c for cat in doc["categories"] for c in cat["checks"] if c["result"] == "error"]
    assert failed[0]["description"] == "control plane namespace exists"
    assert failed[0]["hint"] == "run: meshlet install | kubectl apply -f -"


def test_issuer_expiring_in_30_days_warns(
    cluster: Cluster, tmp_path: Path, golden: Callable[[Path, str], None]
) -> None:
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=30, hours=1)))
    run = cluster.check()
    assert run.code == 0, run.out
    golden(GOLDEN / "check-issuer-expiring.txt", run.out)
    assert cluster.check("--fail-on-warning").code == 1
    json_run = cluster.check("-o", "json", "--fail-on-warning")
    assert json_run.code == 1
    warned = [c for cat in json.loads(json_run.out)["categories"] for c in cat["checks"]
              if c["result"] == "warning"]  # fmt: skip
    assert [w["description"] for w in warned] == [
        "issuer certificate is valid for at least 60 days"
    ]
    assert "expires in 30 days" in warned[0]["error"]


def test_expired_issuer_fails(cluster: Cluster, tmp_path: Path) -> None:
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=365)))
    # Time passes: the Secret now holds an issuer (and roots) that ran out ten days ago.
    secret = cluster.api.get("v1", "Secret", wk.ISSUER_SECRET, "meshlet")
    assert secret is not None
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now - dt.timedelta(days=100))
    issuer, issuer_key = ca.create_issuer(
        anchor, anchor_key, now - dt.timedelta(days=40), dt.timedelta(days=30)
    )
    secret["data"] = {
        wk.ISSUER_CERT_KEY: base64.b64encode(ca.cert_pem(issuer)).decode(),
        wk.ISSUER_KEY_KEY: base64.b64encode(ca.key_pem(issuer_key)).decode(),
    }
    roots = cluster.api.get("v1", "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP, "meshlet")
    assert roots is not None
    roots["data"] = {wk.TRUST_ROOTS_KEY: ca.cert_pem(anchor).decode()}
    cluster.api.apply(secret)
    cluster.api.apply(roots)
    run = cluster.check("-o", "json")
    assert run.code == 1
    checks = {c["description"]: c for cat in json.loads(run.out)["categories"]
              for c in cat["checks"]}  # fmt: skip
    failed = checks["issuer certificate is within its validity period"]
    assert failed["result"] == "error" and "is not valid now" in failed["error"]
    assert failed["hint"].startswith("rotate the issuer")
    # the pods still carry the old trust root: the data plane check names them
    stale = checks["data plane proxies use the current trust root"]
    assert stale["result"] == "error" and "emojivoto/web-5d4f8c9b7-x2x7q" in stale["error"]


def test_a_rotation_step_is_safe_once_every_copy_holds_the_bundle(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Step 1 of docs/identity.md's rotation: the control plane's bundle gains an anchor. The
    meshed pods, injected with the old bundle but following their namespace's copy, are current
    once the copy is; a copy the injector has not rewritten yet is named."""
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=365)))
    roots = cluster.api.get("v1", "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP, "meshlet")
    assert roots is not None
    old = roots["data"][wk.TRUST_ROOTS_KEY]
    new, _ = ca.create_trust_anchor(dt.datetime.now(dt.UTC))
    roots["data"] = {wk.TRUST_ROOTS_KEY: old + ca.cert_pem(new).decode()}
    cluster.api.apply(roots)

    def results() -> dict[str, Any]:  # by description, without the detail a success adds
        return {c["description"].split(" (")[0]: c for cat in json.loads(
                cluster.check("-o", "json").out)["categories"] for c in cat["checks"]}  # fmt: skip

    before = results()
    copies = before["every namespace's copy of the trust roots is current"]
    assert copies["result"] == "error" and "emojivoto" in copies["error"]
    assert before["data plane proxies use the current trust root"]["result"] == "error"

    for namespace in ("emojivoto", "meshlet"):  # the injector's patch of every copy
        current = cluster.api.get("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, namespace)
        assert current is not None
        current["data"] = roots["data"]
        cluster.api.apply(current)
    after = results()
    assert after["every namespace's copy of the trust roots is current"]["result"] == "success"
    assert after["data plane proxies use the current trust root"]["result"] == "success"

    # meshed pods whose namespace has no copy (injected offline): they keep their anchors
    cluster.api.delete("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, "emojivoto")
    missing = results()["every namespace's copy of the trust roots is current"]
    assert missing["result"] == "warning" and "no copy" in missing["error"], missing
    assert "emojivoto" in missing["error"]


def test_pre(cluster: Cluster) -> None:
    """On a fresh cluster `check --pre` passes (the CRD not installed yet is a warning with
    the next step), as the install docs run it before `install --crds`."""
    run = cluster.check("--pre")
    assert run.code == 0, run.out
    assert "✓ control plane namespace does not already exist" in run.out
    assert "‼ ServiceProfile CRD is installed" in run.out
    assert "meshlet install --crds | kubectl apply -f -" in run.out
    assert cluster.check("--pre", "--fail-on-warning").code == 1
    cluster.apply(cluster.meshlet("install", "--crds").out)
    assert cluster.check("--pre", "--fail-on-warning").code == 0


def test_old_kubernetes(cluster: Cluster) -> None:
    cluster.api.version = {**cluster.api.version, "minor": "28", "gitVersion": "v1.28.9"}
    run = cluster.check("--pre")
    assert run.code == 1
    assert "Kubernetes 1.28 has no native sidecars (needs 1.29)" in run.out


def test_unreachable_cluster(
    meshlet: Callable[..., Any], tmp_path: Path, unreachable_kubeconfig: Path
) -> None:
    kubeconfig = unreachable_kubeconfig
    run = meshlet("check", "--kubeconfig", str(kubeconfig))
    assert run.code == 1
    assert f"{CROSS} can query the Kubernetes API" in run.out
    assert "meshlet-identity" not in run.out  # nothing else is tried
    run = meshlet("check", "--kubeconfig", str(tmp_path / "missing"))
    assert run.code == 1 and f"{CROSS} can initialize the client" in run.out


def checks_of(run: Any) -> dict[str, Obj]:
    return {c["description"]: c for cat in json.loads(run.out)["categories"]
            for c in cat["checks"]}  # fmt: skip


def test_the_policy_checks(cluster: Cluster, tmp_path: Path) -> None:
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=365)))
    checks = checks_of(cluster.check("-o", "json"))
    assert checks["policy CRDs are installed"]["result"] == "success"
    assert checks["policy controller Deployment is ready (1 of 1 ready)"]["result"] == "success"
    assert checks["policy controller answers on its admin /ready"]["result"] == "success"
    asked = f"/namespaces/meshlet/pods/meshlet-policy-5d4f8c9b7-x2x7q:{wk.POLICY_ADMIN_PORT}"
    assert any(unquote(p).endswith(asked + "/proxy/ready") for _, p in cluster.api.requests)

    # the controller has not synced (or is stuck): its /ready says 503
    cluster.policy_admin.code = 503
    run = cluster.check("-o", "json")
    assert run.code == 1
    failed = checks_of(run)["policy controller answers on its admin /ready"]
    assert failed["result"] == "error"
    assert failed["error"].startswith("meshlet-policy-5d4f8c9b7-x2x7q: /ready: 503")
    assert failed["hint"] == "kubectl -n meshlet logs deploy/meshlet-policy -c policy"

    # no replica ready: the Deployment says so, and the category stops there
    deploy = cluster.api.get("apps/v1", "Deployment", wk.POLICY_NAME, "meshlet")
    assert deploy is not None
    deploy["status"] = {"replicas": 1, "readyReplicas": 0}
    cluster.api.apply(deploy)
    checks = checks_of(cluster.check("-o", "json"))
    failed = checks["policy controller Deployment is ready"]
    assert failed["error"] == "Deployment meshlet/meshlet-policy: 0 of 1 replicas ready"
    assert "policy controller answers on its admin /ready" not in checks


def test_missing_policy_crds_and_controller(cluster: Cluster, tmp_path: Path) -> None:
    cluster.install(*identity_files(tmp_path, dt.timedelta(days=365)))
    cluster.api.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition",
                       "servers.policy.meshlet.io")  # fmt: skip
    cluster.api.delete("apps/v1", "Deployment", wk.POLICY_NAME, "meshlet")
    cluster.api.delete("v1", "Pod", "meshlet-policy-5d4f8c9b7-x2x7q", "meshlet")
    run = cluster.check()
    assert run.code == 1
    assert f"{CROSS} policy CRDs are installed" in run.out
    assert "CustomResourceDefinitions not found: servers.policy.meshlet.io" in run.out
    assert "✓ ServiceProfile CRD is installed" in run.out
    assert f"{CROSS} policy controller Deployment is ready" in run.out
    assert "Deployment meshlet/meshlet-policy not found" in run.out
    assert "Traceback" not in run.out


def test_routes_and_profiles_are_read_from_every_namespace(tmp_path: Path) -> None:
    """The route checks' reading, without an install (the judging is test_checks.py's)."""
    from meshlet.cli.check import snapshot
    from meshlet.cli.checks import Status, routes_accepted, routes_not_shadowed
    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES

    gw = "gateway.networking.k8s.io"
    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as api:
        for name, parent in (("web-split", "web-svc"), ("orphan", "nope")):
            api.apply({"apiVersion": f"{gw}/v1", "kind": "HTTPRoute",
                       "metadata": {"name": name, "namespace": "emojivoto"},
                       "spec": {"parentRefs": [{"group": "core", "kind": "Service",
                                                "name": parent}]}})  # fmt: skip
        ref = {"group": "core", "kind": "Service", "namespace": "emojivoto", "name": "nope"}
        condition = {"type": "Accepted", "status": "False", "reason": "NoMatchingParent",
                     "message": "Service emojivoto/nope not found",
                     "lastTransitionTime": "2026-11-27T03:00:00Z"}  # fmt: skip
        api.patch_status(f"{gw}/v1", "HTTPRoute", "orphan", {"status": {"parents": [
            {"parentRef": ref, "controllerName": wk.POLICY_CONTROLLER_NAME,
             "conditions": [condition]}]}}, "emojivoto")  # fmt: skip
        routed = {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]}
        api.apply({"apiVersion": "meshlet.io/v1alpha1", "kind": "ServiceProfile",
                   "metadata": {"name": "web-svc.emojivoto.svc.cluster.local",
                                "namespace": "emojivoto"}, "spec": routed})  # fmt: skip
        state = snapshot(api.write_kubeconfig(tmp_path / "kubeconfig"), None, "meshlet")
    assert not state.errors.get("routes") and not state.errors.get("profiles")
    assert sorted(r["metadata"]["name"] for r in state.routes) == ["orphan", "web-split"]
    assert all(r["apiVersion"] == f"{gw}/v1" for r in state.routes)
    now = dt.datetime.now(dt.UTC)
    with pytest.raises(Exception) as accepted:
        routes_accepted(state, now)
    assert getattr(accepted.value, "status", None) is Status.WARNING
    assert str(accepted.value).split("; ") == [
        f"HTTPRoute.{gw} emojivoto/orphan on Service emojivoto/nope: Accepted False"
        " (NoMatchingParent): Service emojivoto/nope not found",
        f"HTTPRoute.{gw} emojivoto/web-split: no status from the policy controller yet",
    ]
    with pytest.raises(Exception) as shadowed:
        routes_not_shadowed(state, now)
    assert str(shadowed.value) == (
        f"HTTPRoute.{gw} emojivoto/web-split: ServiceProfile"
        " emojivoto/web-svc.emojivoto.svc.cluster.local (with routes or dstOverrides) is used"
        " instead"
    )
