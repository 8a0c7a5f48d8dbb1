"""meshlet on a real Kubernetes, as a user meets it: install, check, mesh the demo, observe.

Run by `make e2e`, never by `make test`. The tests run in the order written, each a step of what
a user does; a step builds on the ones before (the cluster is the session's, see conftest.py).
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.kit import ARTIFACTS, REGISTRY, TAG, VENV_BIN, Cluster, eventually
from meshlet.cli.demo import kube, topology

NS = "meshlet"
DEMO = topology.NAMESPACE
WEB_IDENTITY = f"web.{DEMO}.serviceaccount.identity.meshlet.cluster.local"
INSTALL_VALUES = (
    f"prometheus.enabled=true,prometheus.image={REGISTRY}/prometheus:{TAG},"
    "prometheus.scrapeConfig=true,prometheus.discovery=meshlet"
)


def demo_yaml() -> str:
    return yaml.safe_dump_all(kube.manifests(f"{REGISTRY}/demo:{TAG}"))


def load_stats(cluster: Cluster) -> dict[str, Any]:
    """What the demo's load generator saw (its stats file, read in its pod)."""
    pod = cluster.pods(DEMO, "app=load")[0]["metadata"]["name"]
    return dict(
        json.loads(
            cluster.kubectl("exec", "-n", DEMO, pod, "-c", "load", "--", "cat", "/tmp/stats.json")
        )
    )


def counter(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include those given."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_install_crds(cluster: Cluster) -> None:
    crds = cluster.meshlet("install", "--crds")
    cluster.kubectl("apply", "-f", "-", stdin=crds)
    names = [d["metadata"]["name"] for d in yaml.safe_load_all(crds) if d]
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names]
    )


def test_install_control_plane(cluster: Cluster) -> None:
    manifests = cluster.meshlet("install", "--set", INSTALL_VALUES)
    (ARTIFACTS / "install.yaml").write_text(manifests)
    cluster.kubectl("apply", "-f", "-", stdin=manifests)
    cluster.kubectl(
        "wait",
        "-n",
        NS,
        "--for=condition=Available",
        "deploy",
        "--all",
        "--timeout=300s",
        timeout=320,
    )
    for pod in cluster.pods(NS):
        for container in pod["spec"]["containers"]:
            assert container["image"].startswith(REGISTRY), container["image"]


def test_check_is_green(cluster: Cluster) -> None:
    def check() -> str:
        result = cluster.sh(
            str(cluster.env.get("MESHLET", "")) or ".venv/bin/meshlet", "check", check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    out = eventually("meshlet check passing", check, timeout=120)
    (ARTIFACTS / "check.txt").write_text(out)


def test_demo_pods_are_injected_by_the_webhook(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=demo_yaml())
    cluster.kubectl(
        "wait",
        "-n",
        DEMO,
        "--for=condition=Available",
        "deploy",
        "--all",
        "--timeout=300s",
        timeout=320,
    )
    pods = cluster.pods(DEMO)
    assert len(pods) == 7, [p["metadata"]["name"] for p in pods]
    for pod in pods:
        spec = pod["spec"]
        names = [c["name"] for c in [*spec.get("initContainers", []), *spec["containers"]]]
        assert "meshlet-proxy" in names and "meshlet-init" in names, names


def test_traffic_is_mtls_with_reviewed_identities(cluster: Cluster) -> None:
    """Each api pod's proxy sees web's calls over mTLS with web's identity, which the identity
    service issued after the real TokenReview accepted web's ServiceAccount token."""

    def meshed() -> dict[str, float]:
        seen = {}
        for pod in cluster.pods(DEMO, "app=api"):
            name = pod["metadata"]["name"]
            text = cluster.metrics(DEMO, name)
            seen[name] = counter(
                text, "request_total", direction="inbound", tls="true", client_id=WEB_IDENTITY
            )
        assert seen and all(n > 0 for n in seen.values()), seen
        return seen

    eventually("web's mTLS calls reaching every api replica", meshed)
    stats = eventually("the load generator's calls answered", lambda: _answered(cluster))
    assert stats["ok"] > 20, stats


def _answered(cluster: Cluster) -> dict[str, Any]:
    stats = load_stats(cluster)
    assert stats["ok"] > 20, stats
    return stats


def test_store_refuses_another_identity(cluster: Cluster) -> None:
    """The deny drill: from an api pod (api's identity), the store's port refuses the
    connection before its banner; web's calls to the store go on."""
    api = cluster.pods(DEMO, "deployment=api")[0]["metadata"]["name"]
    probe = (
        "import socket\n"
        "s = socket.create_connection(('store.demo.svc.cluster.local', 7000), timeout=5)\n"
        "s.settimeout(5)\n"
        "try:\n    print(repr(s.recv(100)))\n"
        "except OSError as e:\n    print('error', e)\n"
    )
    out = cluster.kubectl("exec", "-n", DEMO, api, "-c", "api", "--", "python3", "-c", probe)
    assert "STORE" not in out, out
    store = cluster.pods(DEMO, "app=store")[0]["metadata"]["name"]
    text = cluster.metrics(DEMO, store)
    assert counter(text, "inbound_tcp_authz_deny_total") >= 1, text
    assert counter(text, "inbound_tcp_authz_allow_total") >= 1, text


def test_canary_route_status_and_split(cluster: Cluster) -> None:
    def accepted() -> list[Any]:
        route = cluster.json(
            "get", "httproute.gateway.networking.k8s.io", "-n", DEMO, topology.API_ROUTE
        )
        parents = route.get("status", {}).get("parents", [])
        ours = [p for p in parents if p.get("controllerName") == "meshlet.io/policy-controller"]
        assert ours, route.get("status")
        conditions = {c["type"]: c["status"] for c in ours[0]["conditions"]}
        assert conditions.get("Accepted") == "True", ours
        assert conditions.get("ResolvedRefs") == "True", ours
        return parents

    eventually("api-split Accepted by meshlet's policy controller", accepted, timeout=60)

    def split() -> dict[str, int]:
        by_api = load_stats(cluster)["by_api"]
        canary = sum(n for pod, n in by_api.items() if pod.startswith(topology.CANARY))
        total = sum(by_api.values())
        assert total > 200 and 0.03 < canary / total < 0.2, by_api
        return dict(by_api)

    eventually("about 10 % of api's calls on the canary", split, timeout=120)


def test_failure_accrual_ejects_a_failing_replica(cluster: Cluster) -> None:
    """An api replica made to fail every call: its proxy sees few of web's calls once the
    breaker ejected it (probes only), its healthy twin takes them, and retries keep what the
    load generator sees almost clean."""
    failing, healthy = (p["metadata"]["name"] for p in cluster.pods(DEMO, "deployment=api"))

    def inbound(pod: str) -> float:
        return counter(cluster.metrics(DEMO, pod), "request_total", direction="inbound",
                       client_id=WEB_IDENTITY)  # fmt: skip

    cluster.kubectl("exec", "-n", DEMO, failing, "-c", "api", "--", "touch", kube.FAULT_FLAG)
    try:
        time.sleep(10)  # the breaker's consecutive failures, then ejection
        before = load_stats(cluster), inbound(failing), inbound(healthy)
        time.sleep(20)
        after = load_stats(cluster), inbound(failing), inbound(healthy)
        to_failing, to_healthy = after[1] - before[1], after[2] - before[2]
        answered = after[0]["ok"] - before[0]["ok"]
        failed = sum(after[0]["failed"].values()) - sum(before[0]["failed"].values())
        assert answered > 100, (before, after)
        assert to_healthy > 50 and to_failing < to_healthy * 0.1, (to_failing, to_healthy)
        assert failed <= answered * 0.02, (failed, answered)
    finally:
        cluster.kubectl("exec", "-n", DEMO, failing, "-c", "api", "--", "rm", "-f",
                        kube.FAULT_FLAG)  # fmt: skip


def test_viz_commands(cluster: Cluster) -> None:
    def stat() -> list[Any]:
        rows = json.loads(cluster.meshlet("viz", "stat", "deploy", "-n", DEMO, "-o", "json"))
        web = [r for r in rows if r.get("name") == "web"]
        assert web and web[0].get("success") == 1.0, rows
        return list(rows)

    eventually("viz stat reporting web", stat, timeout=180, every=5)
    edges = cluster.meshlet("viz", "edges", "deploy", "-n", DEMO)
    assert "web" in edges and "api" in edges, edges
    routes = cluster.meshlet("viz", "routes", "deploy/api", "-n", DEMO)
    assert routes.strip(), routes
    lines = _first_lines(cluster, [_meshlet(), "viz", "tap", "deploy/web", "-n", DEMO], 6)
    assert any(line.startswith("req ") and f":authority=web.{DEMO}" in line for line in lines)
    assert any(line.startswith("rsp ") and ":status=200" in line for line in lines), lines


def _first_lines(cluster: Cluster, argv: list[str], count: int, timeout: float = 60) -> list[str]:
    """The first lines a long-running command prints (then it is ended, as Ctrl-C would)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=cluster.env) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            while len(lines) < count and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.rstrip("\n"))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
    assert len(lines) >= count, (lines, err)
    return lines


def _meshlet() -> str:
    return str(VENV_BIN / "meshlet")


def test_authz_and_diagnostics(cluster: Cluster) -> None:
    authz = cluster.meshlet("authz", "-n", DEMO, "deploy/store")
    assert "store" in authz and "web" in authz, authz
    endpoints = json.loads(
        cluster.meshlet(
            "diagnostics",
            "endpoints",
            f"api.{DEMO}.svc.cluster.local:{topology.API_PORT}",
            "-o",
            "json",
        )
    )
    assert len(endpoints) == 3, endpoints


def test_malformed_policy_and_profile_are_refused(cluster: Cluster) -> None:
    bad_policy = {
        "apiVersion": "policy.meshlet.io/v1alpha1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "bad", "namespace": DEMO},
        "spec": {"targetRef": {"kind": "Server"}, "requiredAuthenticationRefs": "nobody"},
    }
    bad_profile = {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": f"api.{DEMO}.svc.cluster.local", "namespace": DEMO},
        "spec": {"routes": [{"name": "x", "condition": {"pathRegex": "(unclosed"}}]},
    }
    for obj in (bad_policy, bad_profile):
        result = cluster.sh("kubectl", "apply", "-f", "-", stdin=json.dumps(obj), check=False)
        assert result.returncode != 0, result.stdout
        assert "denied" in result.stderr or "invalid" in result.stderr.lower(), result.stderr


def test_a_namespace_without_injection_is_left_alone(cluster: Cluster) -> None:
    cluster.kubectl("create", "namespace", "plain")
    cluster.kubectl(
        "run",
        "-n",
        "plain",
        "lone",
        f"--image={REGISTRY}/demo:{TAG}",
        "--image-pull-policy=IfNotPresent",
        "--command",
        "--",
        "sleep",
        "3600",
    )
    pod = cluster.json("get", "pod", "-n", "plain", "lone")
    names = [c["name"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
    assert names == ["lone"], names


def test_dashboard_in_a_browser(cluster: Cluster) -> None:
    """`meshlet viz dashboard` (a port-forward through the API server to the tap pod's web
    container) opened in headless Chromium: the namespaces, then the demo's deployments, with
    a screenshot of each kept in e2e/artifacts."""
    pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    with subprocess.Popen([_meshlet(), "viz", "dashboard", "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=cluster.env) as proc:  # fmt: skip
        assert proc.stdout is not None
        try:
            announced = proc.stdout.readline()
            found = re.search(r"http://\S+/", announced)
            assert found, announced
            url = found.group(0)
            options = Options()
            options.binary_location = "/usr/bin/chromium"
            for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                         "--no-first-run", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync",
                         "--window-size=1400,900"):  # fmt: skip
                options.add_argument(flag)
            driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
            try:
                driver.get(url)
                eventually("the dashboard listing the demo namespace as meshed",
                           lambda: _shows(driver, DEMO), timeout=60)  # fmt: skip
                driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
                driver.get(f"{url}namespaces/{DEMO}")
                eventually("the demo's deployments with their traffic",
                           lambda: _shows(driver, "api-slow"), timeout=60)  # fmt: skip
                driver.save_screenshot(str(ARTIFACTS / "dashboard-demo.png"))
            finally:
                driver.quit()
        finally:
            proc.terminate()
            proc.communicate(timeout=10)


def _shows(driver: Any, text: str) -> None:
    body = driver.find_element("tag name", "body").text
    assert re.search(rf"\b{text}\b", body), body[:500]


def _demo_on_cluster(cluster: Cluster, drill: str, seconds: int = 60) -> dict[str, Any]:
    """`meshlet demo --cluster --drill DRILL --keep` for `seconds` from an empty namespace: what
    its summary says (the view's last screen, the summary and the pods' logs kept in
    e2e/artifacts), then `meshlet demo down --cluster` deleting the namespace."""
    cluster.meshlet("demo", "down", "--cluster", timeout=240)  # the earlier steps' demo
    summary = ARTIFACTS / f"demo-cluster-{drill}.json"
    out = cluster.meshlet("demo", "--cluster", "--duration", str(seconds), "--drill", drill,
                          "--keep", "--summary-json", str(summary), timeout=900)  # fmt: skip
    (ARTIFACTS / f"demo-cluster-{drill}.txt").write_text(out)
    logs = [cluster.sh("kubectl", "logs", "-n", DEMO, "--all-containers", "--prefix",
                       "--tail=300", "-l", f"app={app}", check=False).stdout
            for app in ("load", "web", "api", "store")]  # fmt: skip
    logs.append(cluster.sh("kubectl", "logs", "-n", NS, "--all-containers", "--prefix",
                           "--tail=300", "-l", "app.kubernetes.io/name=destination",
                           check=False).stdout)  # fmt: skip
    (ARTIFACTS / f"demo-cluster-{drill}.log").write_text("\n".join(logs))
    down = cluster.meshlet("demo", "down", "--cluster", timeout=240)
    assert f"deleted namespace {DEMO}" in down, down
    assert cluster.sh("kubectl", "get", "namespace", DEMO, check=False).returncode != 0
    result: dict[str, Any] = json.loads(summary.read_text())
    client = result["client"]
    assert client["sent"] > 500 and client["success_rate"] >= 0.98, client
    # every request (and every store connection) between the demo's pods over mTLS; the
    # kubelet's probes of web and api are plaintext connections, not requests
    mtls = {name: workload["mtls"] for name, workload in result["workloads"].items()}
    assert all(share == 1.0 for share in mtls.values()), mtls
    return result


def test_demo_on_the_cluster_survives_a_replica_killed(cluster: Cluster) -> None:
    """`meshlet demo --cluster --drill kill-replica`: api-2's pod deleted mid-run, its Deployment
    makes another, the callers' balancers move on without the load noticing."""
    result = _demo_on_cluster(cluster, "kill-replica")
    checks = result["checks"]
    after = checks["calls_after_kill"]
    assert after.get("api-2", 0) == 0, after
    assert after.get("api-1", 0) > 0 and after.get("api-3", 0) > 0, after
    assert checks["failed_during_drill"] <= 0.02 * result["client"]["sent"], checks
    assert any("new pod api-4" in what for _, what in result["events"]), result["events"]


def test_demo_on_the_cluster_survives_the_destination_killed(cluster: Cluster) -> None:
    """`--drill kill-destination`: the destination's pod deleted, its Deployment starts another,
    the proxies reopen their discovery streams, then api-1's pod is replaced: the replacement
    gets calls, which only discovery could have told the callers."""
    result = _demo_on_cluster(cluster, "kill-destination", seconds=90)
    checks = result["checks"]
    # (1 s typically; once 16+ s on a busy run: the old pod's end decides it, see
    # oncluster.RESUBSCRIBE_WITHIN; the timeline is in the summary's streams_after_back)
    assert checks["resubscribed_after_s"] < 30, checks
    by_pod = checks["api_calls_by_pod_at_end"]
    assert by_pod.get("api-4", 0) > 0, by_pod


def _demo_proxies(cluster: Cluster) -> dict[str, str]:
    """Each running demo pod's proxy metrics, by pod name."""
    return {
        p["metadata"]["name"]: cluster.metrics(DEMO, p["metadata"]["name"])
        for p in cluster.pods(DEMO)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    }


def _gauge(text: str, name: str) -> float:
    """A metric without labels."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


def _check_result(cluster: Cluster, description: str) -> str:
    doc = json.loads(cluster.sh(_meshlet(), "check", "-o", "json", check=False).stdout)
    for category in doc["categories"]:
        for check in category["checks"]:
            if check["description"].split(" (")[0] == description:
                return str(check["result"])
    raise AssertionError(f"no check {description!r}")


def _anchors_everywhere(cluster: Cluster, count: int) -> None:
    """Every namespace's copy current (meshlet check) and every demo proxy on `count` anchors:
    the bundle reached each pod's volume (the kubelet's sync) and each proxy took it."""
    assert _check_result(cluster, "every namespace's copy of the trust roots is current") == (
        "success"
    )
    held = {
        pod: _gauge(text, "identity_trust_anchors") for pod, text in _demo_proxies(cluster).items()
    }
    assert held and all(n == count for n in held.values()), held


def test_trust_anchor_rotation_under_load(cluster: Cluster, tmp_path: Any) -> None:
    """docs/identity.md's three steps on the cluster while the demo's load runs, no pod
    restarted during them: the new anchor added to the bundle, an issuer signed by it, the old
    anchor removed. Not one of the load's calls fails, and at the end a client trusting only the
    old anchor cannot reach a meshed pod. (Set-up: 60 s certificates, and the control plane's
    pods restarted to hold them, so that every proxy renews from the new issuer within the
    step; with the default 24 h a rotation waits up to ~17 h between steps 2 and 3.)"""
    manifests = cluster.meshlet("upgrade", "--set", "identity.issuer.issuanceLifetime=60s")
    cluster.kubectl("apply", "-f", "-", stdin=manifests)
    cluster.kubectl("rollout", "restart", "-n", NS, "deploy")
    _controllers_available(cluster)
    cluster.meshlet("demo", "down", "--cluster", timeout=240)
    cluster.kubectl("apply", "-f", "-", stdin=demo_yaml())
    cluster.kubectl("wait", "-n", DEMO, "--for=condition=Available", "deploy", "--all",
                    "--timeout=300s", timeout=320)  # fmt: skip
    eventually("the load's calls succeeding", lambda: _load_ok(cluster), timeout=120)
    before = load_stats(cluster)

    roots = cluster.json("get", "configmap", "-n", NS, "meshlet-identity-trust-roots")
    old = roots["data"]["ca-bundle.crt"]
    ca_dir = tmp_path / "new-ca"
    cluster.meshlet("identity", "ca", "create", "--out", str(ca_dir))
    new = (ca_dir / "trust-anchors.pem").read_text()

    def set_bundle(pem: str) -> None:
        patch = json.dumps({"data": {"ca-bundle.crt": pem}})
        cluster.kubectl("patch", "configmap", "-n", NS, "meshlet-identity-trust-roots",
                        "--type", "merge", "-p", patch)  # fmt: skip

    # 1. both anchors (the old bundle may hold more than one)
    both = old.count("BEGIN CERTIFICATE") + 1
    set_bundle(old + new)
    eventually("the new anchor beside the old in every proxy",
               lambda: _anchors_everywhere(cluster, both), timeout=240, every=5)  # fmt: skip
    # 2. the issuer signed by the new anchor; every proxy renews from it at its time
    issuer = {key: base64.b64encode((ca_dir / "issuer" / key).read_bytes()).decode()
              for key in ("crt.pem", "key.pem")}  # fmt: skip
    cluster.kubectl("patch", "secret", "-n", NS, "meshlet-identity-issuer", "--type", "merge",
                    "-p", json.dumps({"data": issuer}))  # fmt: skip
    rolled = time.time() + 10  # the identity service reads its issuer every 5 s
    # ... and the tap controller's certificate re-issued from it (the docs' step 2)
    upgraded = cluster.sh(_meshlet(), "upgrade", check=False)
    assert "the tap controller's certificate was issued by an earlier issuer" in upgraded.stderr
    cluster.kubectl("apply", "-f", "-", stdin=upgraded.stdout)

    def renewed() -> None:
        stale = {
            pod: stamp
            for pod, text in _demo_proxies(cluster).items()
            if (stamp := _gauge(text, "identity_cert_refresh_timestamp_seconds")) < rolled
        }
        assert not stale, stale  # fmt: skip

    eventually("every demo proxy renewed from the new issuer", renewed, timeout=240, every=5)
    time.sleep(60)  # the control plane's proxies renew on the same 60 s certificates
    # 3. the old anchor removed
    set_bundle(new)
    eventually("the new anchor alone in every proxy", lambda: _anchors_everywhere(cluster, 1),
               timeout=240, every=5)  # fmt: skip
    time.sleep(10)  # calls keep going on the new anchor alone
    after = load_stats(cluster)
    failed = {k: v - before["failed"].get(k, 0) for k, v in after["failed"].items()
              if v != before["failed"].get(k, 0)}  # fmt: skip
    (ARTIFACTS / "rotation.json").write_text(json.dumps({"before": before, "after": after}))
    assert after["ok"] - before["ok"] > 1000, (before, after)
    assert not failed, failed

    # a client left on the old anchor cannot reach web's proxy (from web's own container, on
    # loopback, which the pod's rules do not redirect; the name its proxy answers for)
    probe = (
        "import socket, ssl, sys\n"
        "ctx = ssl.create_default_context(cadata=sys.stdin.read())\n"
        "ctx.check_hostname = False\n"
        "sock = socket.create_connection(('127.0.0.1', 4143), timeout=5)\n"
        "try:\n"
        f"    ctx.wrap_socket(sock, server_hostname='{WEB_IDENTITY}')\n"
        "    print('accepted')\n"
        "except ssl.SSLCertVerificationError as exc:\n"
        "    print('refused', exc.verify_message)\n"
    )
    web = cluster.pods(DEMO, "app=web")[0]["metadata"]["name"]
    for anchors, expected in ((old, "refused"), (new, "accepted")):
        seen = cluster.kubectl("exec", "-i", "-n", DEMO, web, "-c", "web", "--", "python3", "-c",
                               probe, stdin=anchors)  # fmt: skip
        assert seen.startswith(expected), seen
    # and tap still reaches the proxies, with its certificate from the new issuer
    lines = _first_lines(cluster, [_meshlet(), "viz", "tap", "deploy/web", "-n", DEMO], 4,
                         timeout=120)  # fmt: skip
    assert any(line.startswith("rsp ") and ":status=200" in line for line in lines), lines


def _load_ok(cluster: Cluster) -> None:
    stats = load_stats(cluster)
    assert stats.get("ok", 0) > 100, stats


RESTRICTED = "restricted"
# k3s's CNI folders (the k3d backend); the node backend says its own (MESHLET_CNI_SETS)
K3S_CNI_SETS = "destCNINetDir=/var/lib/rancher/k3s/agent/etc/cni/net.d,destCNIBinDir=/bin"
RESTRICTED_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _restricted_app(name: str, command: list[str]) -> list[dict[str, Any]]:
    """A Deployment (and Service) whose pods meet Pod Security's `restricted` level."""
    labels = {"app": name}
    deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": RESTRICTED},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"serviceAccountName": name, "containers": [{
                "name": name, "image": f"{REGISTRY}/demo:{TAG}",
                "imagePullPolicy": "IfNotPresent", "command": command,
                "ports": [{"containerPort": 8080}],
                "securityContext": RESTRICTED_CONTEXT}]}}},
    }  # fmt: skip
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": name, "namespace": RESTRICTED}}  # fmt: skip
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": RESTRICTED},
               "spec": {"selector": labels, "ports": [{"port": 8080}]}}  # fmt: skip
    return [account, deploy, service]


def _cni_sets(cluster: Cluster) -> str:
    return str(cluster.env.get("MESHLET_CNI_SETS") or K3S_CNI_SETS)


def test_cni_meshes_a_restricted_namespace(cluster: Cluster, tmp_path: Any) -> None:
    """meshlet-cni from its DaemonSet (`meshlet install-cni`), the control plane upgraded to
    cniEnabled: in a namespace where Pod Security enforces `restricted`, the real API server
    admits meshed pods (the validator holds no privilege), and their traffic goes through
    their proxies, mTLS with their identities; the control plane's own pods, rolled, start
    with the validator too. A pod on a node without meshlet-cni fails on its validator."""
    cni = cluster.meshlet("install-cni", "--set", _cni_sets(cluster))
    (ARTIFACTS / "install-cni.yaml").write_text(cni)
    cluster.kubectl("apply", "-f", "-", stdin=cni)
    cluster.kubectl("rollout", "status", "-n", "meshlet-cni", "daemonset/meshlet-cni",
                    "--timeout=300s", timeout=320)  # fmt: skip
    upgrade = cluster.meshlet("upgrade", "--set", "cniEnabled=true")
    (ARTIFACTS / "upgrade-cni.yaml").write_text(upgrade)
    cluster.kubectl("apply", "-f", "-", stdin=upgrade)
    _controllers_available(cluster)
    for pod in cluster.pods(NS, "meshlet.io/control-plane-component"):
        names = [c["name"] for c in pod["spec"].get("initContainers", [])]
        every = names + [c["name"] for c in pod["spec"]["containers"]]
        if pod["metadata"].get("deletionTimestamp") or "meshlet-proxy" not in every:
            continue  # a pod on its way out, or one that is not meshed (Prometheus)
        assert names[0] == "meshlet-network-validator" and "meshlet-init" not in names, names

    cluster.kubectl("create", "namespace", RESTRICTED)
    cluster.kubectl("label", "namespace", RESTRICTED,
                    "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")  # fmt: skip
    cluster.kubectl("annotate", "namespace", RESTRICTED, "meshlet.io/inject=enabled")
    apps = [*_restricted_app("server", ["python3", "-m", "http.server", "8080"]),
            *_restricted_app("client", ["sleep", "infinity"])]  # fmt: skip
    applied = cluster.sh("kubectl", "apply", "-f", "-", stdin=yaml.safe_dump_all(apps))
    assert "would violate PodSecurity" not in applied.stderr, applied.stderr
    cluster.kubectl("wait", "-n", RESTRICTED, "--for=condition=Available", "deploy", "--all",
                    "--timeout=300s", timeout=320)  # fmt: skip
    # the API server's verdict on one pod meshed each way (a server-side dry run)
    spec = _restricted_app("server", ["sleep", "1"])[1]["spec"]["template"]["spec"]
    pod_file = tmp_path / "pod.json"
    meta = {"name": "verdict", "namespace": RESTRICTED}
    pod_file.write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                    "spec": spec}))  # fmt: skip
    anchors = tmp_path / "anchors.pem"
    anchors.write_text(cluster.json("get", "configmap", "-n", NS, "meshlet-identity-trust-roots")
                       ["data"]["ca-bundle.crt"])  # fmt: skip
    for cni_enabled, admitted in (("false", False), ("true", True)):
        meshed = cluster.meshlet("inject", "--manual", "--ignore-cluster",
                                 f"--identity-trust-anchors-file={anchors}",
                                 "--set", f"cniEnabled={cni_enabled}", str(pod_file))  # fmt: skip
        verdict = cluster.sh("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=meshed,
                             check=False)  # fmt: skip
        assert (verdict.returncode == 0) == admitted, verdict.stdout + verdict.stderr
        if not admitted:
            assert 'violates PodSecurity "restricted' in verdict.stderr, verdict.stderr
            assert 'container "meshlet-init" must not include "NET_ADMIN"' in verdict.stderr
    server = cluster.pods(RESTRICTED, "app=server")[0]
    inits = [c["name"] for c in server["spec"]["initContainers"]]
    assert inits == ["meshlet-network-validator", "meshlet-proxy"], inits
    client = cluster.pods(RESTRICTED, "app=client")[0]["metadata"]["name"]
    fetch = ("import urllib.request\n"
             "for _ in range(5):\n"
             "    r = urllib.request.urlopen('http://server.restricted.svc.cluster.local:8080/',"
             " timeout=10)\n"
             "    print(r.status)\n")  # fmt: skip
    out = cluster.kubectl("exec", "-n", RESTRICTED, client, "-c", "client", "--", "python3",
                          "-c", fetch)  # fmt: skip
    assert out.split() == ["200"] * 5, out
    client_id = f"client.{RESTRICTED}.serviceaccount.identity.meshlet.cluster.local"

    def redirected() -> float:
        text = cluster.metrics(RESTRICTED, server["metadata"]["name"])
        seen = counter(text, "request_total", direction="inbound", tls="true",
                       client_id=client_id)  # fmt: skip
        assert seen >= 5, text
        return seen

    eventually("the client's calls through both proxies, mTLS", redirected, timeout=60)

    # a pod made while meshlet-cni is missing from the node's configuration: its validator
    # fails it, naming the cause (the DaemonSet's pods gone, meshlet-cni taken out)
    nowhere = {"spec": {"template": {"spec": {"nodeSelector": {"meshlet.io/none": "x"}}}}}
    cluster.kubectl("patch", "daemonset", "-n", "meshlet-cni", "meshlet-cni", "--type=merge",
                    "-p", json.dumps(nowhere))  # fmt: skip
    eventually("the installer gone", lambda: _assert_empty(cluster.pods("meshlet-cni")),
               timeout=120)  # fmt: skip
    try:
        cluster.kubectl("run", "-n", RESTRICTED, "bare", f"--image={REGISTRY}/demo:{TAG}",
                        "--image-pull-policy=IfNotPresent",
                        f"--overrides={json.dumps(_overrides())}", "--command", "--", "sleep",
                        "3600")  # fmt: skip

        def refused() -> str:
            pod = cluster.json("get", "pod", "-n", RESTRICTED, "bare")
            states = pod["status"].get("initContainerStatuses") or []
            validator = next((s for s in states if s["name"] == "meshlet-network-validator"),
                             None)  # fmt: skip
            assert validator is not None, pod["status"]  # not reported by the kubelet yet
            ended = validator.get("lastState", {}).get("terminated") or validator["state"].get(
                "terminated") or {}  # fmt: skip
            assert ended.get("exitCode") == 1, validator
            return str(ended.get("message", ""))

        message = eventually("the validator failing the pod", refused, timeout=120)
        assert "was not redirected" in message and "meshlet-cni" in message, message
    finally:
        cluster.kubectl("delete", "pod", "-n", RESTRICTED, "bare", "--ignore-not-found",
                        "--wait=false")  # fmt: skip
        back = [{"op": "remove", "path": "/spec/template/spec/nodeSelector/meshlet.io~1none"}]
        cluster.kubectl("patch", "daemonset", "-n", "meshlet-cni", "meshlet-cni", "--type=json",
                        "-p", json.dumps(back))  # fmt: skip
        cluster.kubectl("rollout", "status", "-n", "meshlet-cni", "daemonset/meshlet-cni",
                        "--timeout=300s", timeout=320)  # fmt: skip
        # its pods' CPU requests freed for the next step's rollout on this 2-core node
        cluster.kubectl("delete", "namespace", RESTRICTED, "--wait=true", timeout=300)


def _overrides() -> dict[str, Any]:
    """`kubectl run`'s pod, made to meet `restricted`."""
    return {"apiVersion": "v1", "spec": {"containers": [{
        "name": "bare", "image": f"{REGISTRY}/demo:{TAG}", "imagePullPolicy": "IfNotPresent",
        "command": ["sleep", "3600"], "securityContext": RESTRICTED_CONTEXT}]}}  # fmt: skip


CONTROLLERS = ("destination", "identity", "proxy-injector", "policy", "tap")
# --ha on this one 2-core node: anti-affinity off (it would leave two replicas of each controller
# pending), and CPU requests cut to 10m: --ha's 15 pods each request 100m for the controller and
# 100m for its proxy, 3 CPUs the node does not have (the scheduler leaves them pending)
HA_ON_ONE_NODE = ",".join(
    f"{key}=10m"
    for key in ("controllerResources.requests.cpu", "policyController.resources.requests.cpu",
                "tap.resources.requests.cpu", "web.resources.requests.cpu",
                "proxy.resources.cpu.request")
) + ",enablePodAntiAffinity=false"  # fmt: skip


def _controllers_available(cluster: Cluster) -> None:
    cluster.kubectl("wait", "-n", NS, "--for=condition=Available", "deploy", "--all",
                    "--timeout=600s", timeout=620)  # fmt: skip
    cluster.kubectl("rollout", "status", "-n", NS, "deploy", "--timeout=600s", timeout=620)


def _standing(cluster: Cluster, component: str) -> list[str]:
    """The component's pods that are running and not being deleted."""
    return [
        p["metadata"]["name"]
        for p in cluster.pods(NS, f"meshlet.io/control-plane-component={component}")
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def test_ha_a_drain_keeps_the_budgets_and_a_down_injector_refuses_pods(cluster: Cluster) -> None:
    """`meshlet upgrade --ha` (on one 2-core node: HA_ON_ONE_NODE); `meshlet check` runs its
    HA checks and says what one node leaves exposed; `kubectl drain` of the node's controllers,
    through the eviction API, evicts one pod of each and then waits on the budgets until its
    timeout (the cordoned node cannot take the replacements), leaving two of each running;
    with every injector down, a pod in a meshed namespace is refused instead of starting
    unmeshed, and once the injector is back the same pod is admitted with its proxy."""
    manifests = cluster.meshlet("upgrade", "--ha", "--set", HA_ON_ONE_NODE)
    (ARTIFACTS / "upgrade-ha.yaml").write_text(manifests)
    cluster.kubectl("apply", "-f", "-", stdin=manifests)
    _controllers_available(cluster)
    for component in CONTROLLERS:
        assert len(_standing(cluster, component)) == 3, component
    check = cluster.sh(_meshlet(), "check", check=False)
    (ARTIFACTS / "check-ha.txt").write_text(check.stdout)
    assert check.returncode == 0, check.stdout + check.stderr  # warnings only
    assert "meshlet-ha-checks" in check.stdout
    assert "3 pods on 1 node(s)" in check.stdout, check.stdout

    node = cluster.json("get", "nodes")["items"][0]["metadata"]["name"]
    try:
        drain = cluster.sh("kubectl", "drain", node, "--ignore-daemonsets",
                           "--delete-emptydir-data",  # the proxies' identity volume
                           "--pod-selector=meshlet.io/control-plane-component",
                           "--timeout=45s", check=False, timeout=120)  # fmt: skip
        (ARTIFACTS / "drain-ha.txt").write_text(drain.stdout + drain.stderr)
        assert drain.returncode != 0, drain.stdout  # it could not finish: the budgets held
        assert "violate the pod's disruption budget" in drain.stdout + drain.stderr
        for component in CONTROLLERS:
            assert len(_standing(cluster, component)) == 2, (component, drain.stdout)
    finally:
        cluster.kubectl("uncordon", node)
    _controllers_available(cluster)

    cluster.kubectl("create", "namespace", "ha-probe")
    cluster.kubectl("annotate", "namespace", "ha-probe", "meshlet.io/inject=enabled")
    probe = ("run", "-n", "ha-probe", "probe", f"--image={REGISTRY}/demo:{TAG}",
             "--image-pull-policy=IfNotPresent", "--command", "--", "sleep", "3600")  # fmt: skip
    cluster.kubectl("scale", "-n", NS, "deploy/meshlet-proxy-injector", "--replicas=0")
    try:
        injectors = "meshlet.io/control-plane-component=proxy-injector"
        eventually("the injector's pods gone",
                   lambda: _assert_empty(cluster.pods(NS, injectors)), timeout=120)  # fmt: skip
        refused = cluster.sh("kubectl", *probe, check=False)
        assert refused.returncode != 0, refused.stdout
        assert "meshlet-proxy-injector.meshlet.io" in refused.stderr, refused.stderr
        assert cluster.sh("kubectl", "get", "pod", "-n", "ha-probe", "probe",
                          check=False).returncode != 0  # fmt: skip
    finally:
        cluster.kubectl("scale", "-n", NS, "deploy/meshlet-proxy-injector", "--replicas=3")
    _controllers_available(cluster)
    eventually("a pod admitted once the injector is back",
               lambda: cluster.kubectl(*probe), timeout=60)  # fmt: skip
    pod = cluster.json("get", "pod", "-n", "ha-probe", "probe")
    names = [c["name"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])]
    assert "meshlet-proxy" in names, names
    cluster.kubectl("delete", "namespace", "ha-probe", "--wait=false")


def _assert_empty(items: list[Any]) -> None:
    assert not items, [i["metadata"]["name"] for i in items]


def test_uninstall_leaves_nothing(cluster: Cluster) -> None:
    cluster.kubectl("delete", "namespace", DEMO, "plain", "ha-probe", RESTRICTED,
                    "--ignore-not-found", "--wait=true", timeout=300)  # fmt: skip
    cni = cluster.meshlet("install-cni", "--set", _cni_sets(cluster))
    cluster.kubectl("delete", "--ignore-not-found", "--wait=true", "-f", "-", stdin=cni,
                    timeout=300)  # fmt: skip
    sets = dict(item.split("=", 1) for item in _cni_sets(cluster).split(","))
    if cluster.kind == "node":  # the node's folders are this machine's: meshlet-cni is gone
        for path in Path(sets["destCNINetDir"]).iterdir():
            assert "meshlet-cni" not in path.read_text(), path
        assert not (Path(sets["destCNIBinDir"]) / "meshlet-cni").exists()
        assert list(Path(sets["destRootDir"]).iterdir()) == []
    refs = cluster.meshlet("uninstall", "--crds")
    cluster.kubectl(
        "delete", "--ignore-not-found", "--wait=true", "-f", "-", stdin=refs, timeout=300
    )
    left = cluster.kubectl(
        "get",
        "all,crd,clusterrole,clusterrolebinding,"
        "mutatingwebhookconfiguration,validatingwebhookconfiguration",
        "-A",
        "-o",
        "name",
    )
    assert "meshlet" not in left, left
