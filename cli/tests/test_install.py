"""`meshlet install`: golden output, helm lint through the SDK, every document valid against
the Kubernetes 1.33 schema, the names other components rely on, certificates made or checked."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli import charts
from meshlet.cli.main import main
from meshlet.controlplane.identity import ca
from meshlet.controlplane.injector.webhook import VALIDATE_PATH
from meshlet.proxy import config as proxy_config
from meshlet_testing import kubelet, pki, schema

GOLDEN = Path(__file__).parent / "golden"
FIXED = ("--values", str(pki.VALUES))


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


@pytest.fixture(scope="module")
def installed() -> list[dict[str, Any]]:

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["install", *FIXED])
    return docs(out.getvalue())


@pytest.mark.parametrize(("name", "args"), [("install", FIXED), ("install-crds", ("--crds",))])
def test_golden(
    name: str,
    args: tuple[str, ...],
    meshlet: Callable[..., Any],
    golden: Callable[[Path, str], None],
) -> None:
    run = meshlet("install", *args)
    assert run.code == 0, run.err
    golden(GOLDEN / f"{name}.yaml", run.out)


@pytest.mark.parametrize("args", [FIXED, ("--crds",), (*FIXED, "--ha")])
def test_every_document_is_schema_valid(args: tuple[str, ...], meshlet: Callable[..., Any]) -> None:
    objects = docs(meshlet("install", *args).out)
    assert objects
    for obj in objects:
        schema.validate(obj)


@pytest.mark.parametrize("chart", [charts.CRDS, charts.CONTROL_PLANE, charts.CNI])
def test_helm_lint_is_clean(chart: str) -> None:
    values = yaml.safe_load(pki.VALUES.read_text()) if chart == charts.CONTROL_PLANE else {}
    assert charts.lint(chart, values, wk.CONTROL_PLANE_NAMESPACE) == []


def test_lint_finds_problems() -> None:
    # A test that could not fail would prove nothing: the same call reports a broken chart.
    found = charts.lint(charts.CONTROL_PLANE, {"proxy": {"logLevel": "loud"}}, "meshlet")
    assert any("logLevel" in f for f in found)


def test_the_names_other_components_rely_on(installed: list[dict[str, Any]]) -> None:
    ns = wk.CONTROL_PLANE_NAMESPACE
    for service, port in (
        (wk.DESTINATION_NAME, wk.DESTINATION_PORT),
        (wk.IDENTITY_NAME, wk.IDENTITY_PORT),
        (wk.INJECTOR_NAME, wk.INJECTOR_SERVICE_PORT),
        (wk.POLICY_NAME, wk.POLICY_PORT),
    ):
        svc = find(installed, "Service", service)
        assert svc["metadata"]["namespace"] == ns
        assert svc["spec"]["ports"][0]["port"] == port
    secret = find(installed, "Secret", wk.ISSUER_SECRET)
    assert set(secret["data"]) == {wk.ISSUER_CERT_KEY, wk.ISSUER_KEY_KEY}
    roots = find(installed, "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP)
    assert roots["data"][wk.TRUST_ROOTS_KEY].strip() == pki.anchors_pem().strip()
    assert find(installed, "Secret", wk.INJECTOR_TLS_SECRET)["type"] == "kubernetes.io/tls"
    assert wk.CONFIG_KEY in find(installed, "ConfigMap", wk.CONFIG_CONFIGMAP)["data"]
    injector = find(installed, "Deployment", wk.INJECTOR_NAME)
    args = injector["spec"]["template"]["spec"]["containers"][-1]["args"]
    assert "--tls-cert=/var/run/meshlet/tls/tls.crt" in args


def test_crds(meshlet: Callable[..., Any]) -> None:
    crds = {c["metadata"]["name"]: c for c in docs(meshlet("install", "--crds").out)}
    versions = {name: [v["name"] for v in crd["spec"]["versions"]] for name, crd in crds.items()}
    assert versions == {
        wk.SERVICEPROFILE_CRD: ["v1alpha1"],  # what destination reads
        # one served and stored version of each policy kind: Linkerd's newest
        f"servers.{wk.POLICY_API_GROUP}": ["v1beta3"],
        f"authorizationpolicies.{wk.POLICY_API_GROUP}": ["v1alpha1"],
        f"meshtlsauthentications.{wk.POLICY_API_GROUP}": ["v1alpha1"],
        f"networkauthentications.{wk.POLICY_API_GROUP}": ["v1alpha1"],
        f"httproutes.{wk.POLICY_API_GROUP}": ["v1beta3"],
        f"grpcroutes.{wk.POLICY_API_GROUP}": ["v1"],
        f"httplocalratelimitpolicies.{wk.POLICY_API_GROUP}": ["v1alpha1"],
    }


def test_webhook_configuration(installed: list[dict[str, Any]]) -> None:
    (config,) = [o for o in installed if o["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["clientConfig"]["service"] == {
        "name": wk.INJECTOR_NAME,
        "namespace": "meshlet",
        "path": "/inject",
        "port": 443,
    }
    excluded = hook["namespaceSelector"]["matchExpressions"][0]
    assert excluded["operator"] == "NotIn"
    assert set(excluded["values"]) == {"kube-system", "meshlet"}
    ca_bundle = base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    assert ca_bundle == yaml.safe_load(pki.VALUES.read_text())["proxyInjector"]["caBundle"]


def test_validating_webhook_configuration(
    installed: list[dict[str, Any]], meshlet: Callable[..., Any]
) -> None:
    (config,) = [o for o in installed if o["kind"] == "ValidatingWebhookConfiguration"]
    (mutating,) = [o for o in installed if o["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore"  # as Linkerd's validators
    assert hook["clientConfig"] == {
        **mutating["webhooks"][0]["clientConfig"],
        "service": {
            "name": wk.INJECTOR_NAME,
            "namespace": "meshlet",
            "path": VALIDATE_PATH,
            "port": 443,
        },
    }
    assert hook["namespaceSelector"] == {
        "matchExpressions": [
            {
                "key": "config.meshlet.io/admission-webhooks",
                "operator": "NotIn",
                "values": ["disabled"],
            }
        ]
    }
    judged = {
        (group, resource)
        for rule in hook["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        if rule["operations"] == ["CREATE", "UPDATE"]
    }
    crds = {
        (c["spec"]["group"], c["spec"]["names"]["plural"])
        for c in docs(meshlet("install", "--crds").out)
    }
    # every meshlet kind, and the Gateway API routes the policy controller also reads
    gateway = {
        ("gateway.networking.k8s.io", "httproutes"),
        ("gateway.networking.k8s.io", "grpcroutes"),
    }
    assert judged == crds | gateway


def test_control_plane_pods_are_meshed(installed: list[dict[str, Any]]) -> None:
    for name in (wk.DESTINATION_NAME, wk.IDENTITY_NAME, wk.INJECTOR_NAME, wk.POLICY_NAME):
        template = find(installed, "Deployment", name)["spec"]["template"]
        spec = template["spec"]
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        proxy = next(c for c in containers if c["name"] == wk.PROXY_CONTAINER)
        pod = {"metadata": {"name": f"{name}-0", "namespace": "meshlet"}, "spec": {
            **spec, "serviceAccountName": name, "nodeName": "n"}}  # fmt: skip
        env = kubelet.container_env(pod, proxy)
        loaded = proxy_config.load(env)
        assert loaded.identity_local_name == wk.identity_name(name, "meshlet")
        init = spec["initContainers"][0]
        assert init["name"] == wk.INIT_CONTAINER
        assert "443,6443" in init["args"]  # the API server is reached directly
        if name == wk.IDENTITY_NAME:
            # certified by the container beside it; a native sidecar would wait for itself
            assert loaded.identity_svc_addr == "127.0.0.1:8080"
            assert proxy in spec["containers"]
        else:
            assert proxy in spec["initContainers"]


def test_a_ca_is_generated_when_none_is_given(meshlet: Callable[..., Any]) -> None:
    run = meshlet("install")
    assert run.code == 0, run.err
    assert "generated a trust anchor and issuer" in run.err
    objects = docs(run.out)
    secret = find(objects, "Secret", wk.ISSUER_SECRET)["data"]
    anchors = find(objects, "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP)["data"][wk.TRUST_ROOTS_KEY]
    issuer = ca.load_issuer(
        base64.b64decode(secret[wk.ISSUER_CERT_KEY]),
        base64.b64decode(secret[wk.ISSUER_KEY_KEY]),
        anchors.encode(),
    )
    assert issuer.cert.subject.rfc4514_string() == f"CN={ca.ISSUER_NAME}"


def test_identity_files(meshlet: Callable[..., Any], test_ca: Any) -> None:
    issuer = test_ca.issuer_dir
    run = meshlet(
        "install",
        "--identity-trust-anchors-file", str(test_ca.anchors_path),
        "--identity-issuer-certificate-file", str(issuer / "crt.pem"),
        "--identity-issuer-key-file", str(issuer / "key.pem"),
    )  # fmt: skip
    assert run.code == 0, run.err
    roots = find(docs(run.out), "ConfigMap", wk.TRUST_ROOTS_CONFIGMAP)["data"]
    assert roots[wk.TRUST_ROOTS_KEY].strip() == test_ca.anchors_pem.strip()

    run = meshlet("install", "--identity-trust-anchors-file", str(test_ca.anchors_path))
    assert run.code == 64
    assert "missing --identity-issuer-certificate-file, --identity-issuer-key-file" in run.err


def test_an_issuer_from_another_anchor_is_refused(
    meshlet: Callable[..., Any], test_ca: Any
) -> None:
    run = meshlet(
        "install",
        "--identity-trust-anchors-file", str(pki.TRUST_ANCHORS),
        "--identity-issuer-certificate-file", str(test_ca.issuer_dir / "crt.pem"),
        "--identity-issuer-key-file", str(test_ca.issuer_dir / "key.pem"),
    )  # fmt: skip
    assert run.code == 64
    assert "does not chain to the trust anchors" in run.err


def test_bad_values_name_every_problem(meshlet: Callable[..., Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("proxy: [1]\n")
    run = meshlet("install", *FIXED, "--set", "proxy.logLevel=loud", "--set", "colour=blue")
    assert run.code == 64
    assert "at '/proxy/logLevel': value must be one of" in run.err
    assert "additional properties 'colour' not allowed" in run.err
    assert "Traceback" not in run.err
    run = meshlet("install", "--values", str(bad), "--set", "novalue")
    assert run.code == 64
    assert 'key "novalue" has no value' in run.err


def test_set_reaches_the_proxies(meshlet: Callable[..., Any]) -> None:
    run = meshlet("install", *FIXED, "--set", "proxy.logLevel=debug,image.tag=dev")
    objects = docs(run.out)
    values = yaml.safe_load(find(objects, "ConfigMap", wk.CONFIG_CONFIGMAP)["data"]["values"])
    assert values["proxy"]["logLevel"] == "debug"
    assert values["proxy"]["image"] == "ghcr.io/meshlet/proxy:dev"


def test_the_policy_controller(installed: list[dict[str, Any]]) -> None:
    """Its own Deployment, ServiceAccount and read access; meshed like destination, so that its
    proxy serves the mesh's mTLS as meshlet-policy's identity, the name proxies are given."""
    deploy = find(installed, "Deployment", wk.POLICY_NAME)
    spec = deploy["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == wk.POLICY_NAME
    (policy,) = [c for c in spec["containers"] if c["name"] == "policy"]
    assert policy["args"] == [
        "policy", "--in-cluster", "--control-plane-namespace=meshlet",
        "--trust-domain=cluster.local",
        "--cluster-networks=10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8",
        "--default-policy=all-unauthenticated", "--log-level=info",
    ]  # fmt: skip
    ports = {p["name"]: p["containerPort"] for p in policy["ports"]}
    assert ports == {"grpc": wk.POLICY_PORT, "admin-http": wk.POLICY_ADMIN_PORT}
    assert policy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin-http"}
    assert not any(a.startswith("--tls-") for a in policy["args"])  # its proxy terminates mTLS
    proxy = next(c for c in spec["initContainers"] if c["name"] == wk.PROXY_CONTAINER)
    pod = {"metadata": {"name": "meshlet-policy-0", "namespace": "meshlet"},
           "spec": {**spec, "nodeName": "n"}}  # fmt: skip
    env = kubelet.container_env(pod, proxy)
    assert env[wk.ProxyEnv.IDENTITY_LOCAL_NAME] == wk.POLICY_SERVICE_NAME
    assert env[wk.ProxyEnv.POLICY_SVC_NAME] == wk.POLICY_SERVICE_NAME
    assert env[wk.ProxyEnv.INBOUND_PORTS] == "8090,9997"
    assert find(installed, "ServiceAccount", wk.POLICY_NAME)["metadata"]["namespace"] == "meshlet"
    role = find(installed, "ClusterRole", "meshlet-meshlet-policy")
    reads = {(g, r) for rule in role["rules"] if "watch" in rule["verbs"]
             for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert {("", "pods"), ("", "namespaces"), ("", "serviceaccounts"),
            ("policy.meshlet.io", "servers"), ("policy.meshlet.io", "authorizationpolicies"),
            ("gateway.networking.k8s.io", "httproutes"),
            ("gateway.networking.k8s.io", "grpcroutes")} <= reads  # fmt: skip
    from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS
    from meshlet.controlplane.policy.status import ROUTE_KINDS

    def group(kind: Any) -> str:
        return kind.api_version.rpartition("/")[0]

    assert {(group(k), k.plural) for k in POLICY_SERVER_KINDS} <= reads  # all it watches
    patches = {(g, r) for rule in role["rules"] if rule["verbs"] == ["patch"]
               for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    assert {(group(k), f"{k.plural}/status") for k in ROUTE_KINDS} <= patches
    assert all(r.endswith("/status") for _, r in patches)  # nothing else is written
    binding = find(installed, "ClusterRoleBinding", "meshlet-meshlet-policy")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": wk.POLICY_NAME, "namespace": "meshlet"}
    ]


def test_the_default_inbound_policy_reaches_proxies_not_the_control_plane(
    meshlet: Callable[..., Any],
) -> None:
    """The mesh-wide default goes to the injector's configuration and the controller; the
    control plane's own pods stay reachable (all-unauthenticated), as Linkerd's do."""
    run = meshlet("install", *FIXED, "--set", "proxy.defaultInboundPolicy=deny",
                  "--set", "clusterNetworks=10.42.0.0/16")  # fmt: skip
    assert run.code == 0, run.err
    objects = docs(run.out)
    values = yaml.safe_load(find(objects, "ConfigMap", wk.CONFIG_CONFIGMAP)["data"]["values"])
    assert values["proxy"]["defaultInboundPolicy"] == "deny"
    assert values["clusterNetworks"] == "10.42.0.0/16"
    spec = find(objects, "Deployment", wk.POLICY_NAME)["spec"]["template"]["spec"]
    args = next(c for c in spec["containers"] if c["name"] == "policy")["args"]
    assert "--default-policy=deny" in args and "--cluster-networks=10.42.0.0/16" in args
    for name in (wk.DESTINATION_NAME, wk.IDENTITY_NAME, wk.INJECTOR_NAME, wk.POLICY_NAME):
        template = find(objects, "Deployment", name)["spec"]["template"]
        containers = [*template["spec"]["initContainers"], *template["spec"]["containers"]]
        proxy = next(c for c in containers if c["name"] == wk.PROXY_CONTAINER)
        env = {e["name"]: e.get("value") for e in proxy["env"]}
        assert env[wk.ProxyEnv.INBOUND_DEFAULT_POLICY] == "all-unauthenticated", name
        assert env[wk.ProxyEnv.POLICY_CLUSTER_NETWORKS] == "10.42.0.0/16"
    run = meshlet("install", *FIXED, "--set", "proxy.defaultInboundPolicy=allow")
    assert run.code == 64
    assert "at '/proxy/defaultInboundPolicy': value must be one of" in run.err
    run = meshlet("install", *FIXED, "--set", "clusterNetworks=10.0.0.1/8")
    assert run.code == 64
    assert "clusterNetworks='10.0.0.1/8': expected CIDRs" in run.err
    assert "Traceback" not in run.err


def test_the_tap_controller_gets_a_certificate_of_its_identity_from_the_mesh_issuer(
    meshlet: Callable[..., Any],
) -> None:
    import base64

    from cryptography import x509

    from meshlet.api import wellknown

    objects = docs(meshlet("install", "--set", "identityTrustDomain=example.org").out)
    secret = find(objects, "Secret", "meshlet-tap-k8s-tls")
    chain = x509.load_pem_x509_certificates(base64.b64decode(secret["data"]["tls.crt"]))
    names = chain[0].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        wellknown.identity_name(wellknown.TAP_NAME, "meshlet", "meshlet", "example.org")
    ]
    anchors = find(objects, "ConfigMap", "meshlet-identity-trust-roots")["data"]["ca-bundle.crt"]
    anchor = x509.load_pem_x509_certificate(anchors.encode())
    chain[-1].verify_directly_issued_by(anchor)
    args = find(objects, "Deployment", "meshlet-tap")["spec"]["template"]["spec"]["containers"]
    assert "--max-taps=100" in next(c for c in args if c["name"] == "tap")["args"]


def test_the_tap_api_is_reached_only_through_a_port_forward(meshlet: Callable[..., Any]) -> None:
    """Live requests are for whoever may port-forward to the tap pod (Kubernetes RBAC): the
    API listens on the pod's loopback, and no Service leads to it."""
    objects = docs(meshlet("install").out)
    assert not [
        o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "meshlet-tap"
    ]
    containers = find(objects, "Deployment", "meshlet-tap")["spec"]["template"]["spec"][
        "containers"
    ]
    tap = next(c for c in containers if c["name"] == "tap")
    assert "--addr=127.0.0.1:8088" in tap["args"]
    assert [p["containerPort"] for p in tap["ports"]] == [9998]  # admin only


def test_the_dashboard_sits_beside_the_tap_controller_on_the_loopback(
    meshlet: Callable[..., Any], tmp_path: Path
) -> None:
    """The dashboard relays taps, so it is reached as the tap API is: on the pod's loopback,
    through a port-forward; its admin port is the one kubelet probes."""
    regex = r"^(localhost|dash\.example\.org)(:\d+)?$"
    values = tmp_path / "web.yaml"
    values.write_text(yaml.safe_dump({"web": {"prometheusUrl": "http://prom.example:9090",
                                              "enforcedHost": regex}}))  # fmt: skip
    objects = docs(meshlet("install", "--values", str(values)).out)
    pod = find(objects, "Deployment", "meshlet-tap")["spec"]["template"]["spec"]
    web = next(c for c in pod["containers"] if c["name"] == "web")
    assert "--addr=127.0.0.1:8084" in web["args"]
    assert "--tap-addr=127.0.0.1:8088" in web["args"]
    assert "--prometheus-url=http://prom.example:9090" in web["args"]
    assert f"--enforced-host={regex}" in web["args"]
    ports = {p["name"]: p["containerPort"] for p in web["ports"]}
    assert ports == {"http": 8084, "web-admin": 9994}
    assert web["readinessProbe"]["httpGet"]["port"] == "web-admin"
    off = docs(meshlet("install", "--set", "web.enabled=false").out)
    containers = find(off, "Deployment", "meshlet-tap")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["tap"]
    bad = meshlet("install", "--set", "web.prometheusUrl=ftp://x")
    assert bad.code != 0 and "prometheusUrl" in bad.err


GATEWAY_CRDS = {"httproutes.gateway.networking.k8s.io", "grpcroutes.gateway.networking.k8s.io"}


def crd_names(text: str) -> set[str]:
    return {d["metadata"]["name"] for d in docs(text)}


def test_the_gateway_api_crds_only_when_the_cluster_lacks_them(
    meshlet: Callable[..., Any], tmp_path: Path, unreachable_kubeconfig: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """As Linkerd's `installGatewayAPI`: absent → installed; installed by meshlet → kept;
    installed by someone else → left alone, and installing over them is refused."""
    from meshlet.cli.install import GatewayAPI, _install_gateway_api, gateway_api
    from meshlet_testing.fakeapi import FakeKubeAPI

    with FakeKubeAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        absent = meshlet("install", "--crds", "--kubeconfig", str(kubeconfig))
        assert absent.code == 0, absent.err
        assert crd_names(absent.out) >= GATEWAY_CRDS
        ours = [d for d in docs(absent.out) if d["metadata"]["name"] in GATEWAY_CRDS]
        for crd in ours:
            api.apply(crd)
        assert _install_gateway_api({}, kubeconfig) is True  # meshlet's: kept up to date
        for crd in ours:  # now as a Gateway API release installs them
            crd["metadata"]["labels"] = {"gateway.networking.k8s.io/policy": "standard"}
            api.apply(crd)
        assert _install_gateway_api({}, kubeconfig) is False
        refused = meshlet("install", "--crds", "--kubeconfig", str(kubeconfig),
                          "--set", "installGatewayAPI=true")  # fmt: skip
        assert refused.code == 64 and refused.out == ""
        assert "use --set installGatewayAPI=false" in refused.err
        assert "Traceback" not in refused.err

    capsys.readouterr()
    assert _install_gateway_api({}, unreachable_kubeconfig) is False
    assert (
        "note: cannot tell whether the cluster has the Gateway API CRDs" in capsys.readouterr().err
    )
    assert _install_gateway_api({"installGatewayAPI": True}, unreachable_kubeconfig) is True
    junk = meshlet("install", "--crds", "--set", "installGatewayAPI=maybe")
    assert junk.code == 64 and "installGatewayAPI: 'maybe' is not true or false" in junk.err
    mine = {"metadata": {"labels": {"app.kubernetes.io/part-of": "meshlet"}}}
    assert gateway_api([None, None]) is GatewayAPI.ABSENT
    assert gateway_api([mine, None]) is GatewayAPI.MESHLET
    assert gateway_api([mine, {"metadata": {}}]) is GatewayAPI.EXTERNAL


def test_the_gateway_api_crds_lint_and_validate() -> None:
    values = {"installGatewayAPI": True}
    assert charts.lint(charts.CRDS, values, "meshlet") == []
    for bad, said in (({"installGatewayAPI": "yes"}, "got string, want boolean"),
                      ({"installGatewayApi": True}, "not allowed")):  # fmt: skip
        with pytest.raises(charts.ChartError, match=said):
            charts.render(charts.CRDS, bad, "meshlet")
    rendered = {m.doc["metadata"]["name"]: m.doc for m in charts.render(charts.CRDS, values, "m")}
    for name in GATEWAY_CRDS:
        crd = rendered[name]
        schema.validate(crd)
        assert crd["metadata"]["annotations"]["api-approved.kubernetes.io"].startswith("https://")
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        versions = [(v["name"], v["storage"]) for v in crd["spec"]["versions"]]
        assert versions[0] == ("v1", True)
        for version in crd["spec"]["versions"]:
            assert version["subresources"] == {"status": {}}
            assert schema.structural_problems(version["schema"]["openAPIV3Schema"]) == []


def test_ha_renders_three_spread_replicas_a_budget_each_and_a_webhook_that_fails_closed(
    meshlet: Callable[..., Any],
) -> None:
    """`--ha` (with --ignore-cluster, as Linkerd's): every controller 3 replicas that the
    scheduler keeps off each other's node, a PodDisruptionBudget selecting exactly each
    Deployment's pods, one pod down at a time in a rollout; the webhook refuses pods while no
    injector answers, except in kube-system and the control plane's own namespace; what the user
    set wins over values-ha.yaml; and without --ha nothing of it is rendered."""
    from meshlet.cli.checks import CONTROLLERS

    run = meshlet("install", "--ignore-cluster", "--ha", "--set", "tap.replicas=2", *FIXED)
    assert run.code == 0, run.err
    objects = docs(run.out)
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == set(CONTROLLERS)
    for name, component in CONTROLLERS.items():
        deploy = find(objects, "Deployment", name)
        spec = deploy["spec"]
        assert spec["replicas"] == (2 if name == wk.TAP_NAME else 3), name
        assert spec["strategy"] == {"rollingUpdate": {"maxUnavailable": 1, "maxSurge": "25%"}}
        pod_labels = spec["template"]["metadata"]["labels"]
        selector = budgets[name]["spec"]["selector"]["matchLabels"]
        assert selector == {wk.CONTROL_PLANE_COMPONENT_LABEL: component}
        assert selector.items() <= pod_labels.items()
        assert budgets[name]["spec"]["maxUnavailable"] == 1
        anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
        (required,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert required == {"labelSelector": {"matchLabels": selector},
                            "topologyKey": "kubernetes.io/hostname"}  # fmt: skip
        for container in spec["template"]["spec"]["containers"]:
            if container["name"] != wk.PROXY_CONTAINER:
                assert container["resources"]["requests"]["cpu"], (name, container["name"])
                assert container["resources"]["limits"]["memory"], (name, container["name"])
    (config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    (names,) = [e for e in hook["namespaceSelector"]["matchExpressions"]
                if e["key"] == "kubernetes.io/metadata.name"]  # fmt: skip
    assert names["operator"] == "NotIn"
    assert {"kube-system", wk.CONTROL_PLANE_NAMESPACE} <= set(names["values"])
    # kept for `meshlet upgrade`: HA stays on
    kept = yaml.safe_load(find(objects, "ConfigMap", wk.CONFIG_CONFIGMAP)["data"]["install-values"])
    assert kept["webhookFailurePolicy"] == "Fail" and kept["tap"]["replicas"] == 2

    plain = docs(meshlet("install", "--ignore-cluster", *FIXED).out)
    assert not [o for o in plain if o["kind"] == "PodDisruptionBudget"]
    destination = find(plain, "Deployment", wk.DESTINATION_NAME)["spec"]
    assert destination["replicas"] == 1 and "strategy" not in destination
    assert "affinity" not in destination["template"]["spec"]


def test_install_cni_renders_an_installer_per_node_with_its_settings(
    meshlet: Callable[..., Any],
) -> None:
    from meshlet.init import cni, cni_install

    run = meshlet("install-cni", "--set", "destCNINetDir=/var/lib/k/net.d,ignoreOutboundPorts=5432")
    assert run.code == 0, run.err
    objects = docs(run.out)
    for obj in objects:
        schema.validate(obj)
    namespace = find(objects, "Namespace", "meshlet-cni")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    ds = find(objects, "DaemonSet", "meshlet-cni")
    pod_spec = ds["spec"]["template"]["spec"]
    assert pod_spec["tolerations"] == [{"operator": "Exists"}]
    (container,) = pod_spec["containers"]
    assert container["image"] == "ghcr.io/meshlet/proxy:0.1.0"
    # the flags are the installer's own, and its settings are the plugin's
    args = cni_install.parser().parse_args(container["args"])
    assert args.host_conf_dir == "/host/var/lib/k/net.d"
    assert args.node_root_dir == "/opt/meshlet-cni"
    settings = cni_install._settings(args.settings)
    assert settings["outbound-ports-to-ignore"] == "5432" and set(settings) <= set(cni.SETTINGS)
    assert cni.init_argv({"meshlet": settings}, "apply")  # meshlet-init's flags, by name
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/host/var/lib/k/net.d", "/host/opt/cni/bin", "/host/opt/meshlet-cni"} <= mounts
    assert container["securityContext"].get("privileged") is not True

    bad = meshlet("install-cni", "--set", "iptablesMode=ebpf")
    assert bad.code == 64 and "iptablesMode" in bad.err and "Traceback" not in bad.err


def test_cni_enabled_meshes_the_control_plane_without_meshlet_init(
    meshlet: Callable[..., Any],
) -> None:
    objects = docs(meshlet("install", *FIXED, "--set", "cniEnabled=true").out)
    config = find(objects, "ConfigMap", "meshlet-config")
    assert "cniEnabled: true" in config["data"]["values"]
    for obj in objects:
        if obj["kind"] == "Deployment":
            names = [c["name"] for c in obj["spec"]["template"]["spec"]["initContainers"]]
            assert wk.INIT_CONTAINER not in names and names[0] == wk.VALIDATOR_CONTAINER, names
