"""The patch that meshes a pod: golden files, the Kubernetes 1.33 schema, and the contracts
with the programs that read what it writes (`meshlet-proxy`'s env, `meshlet-init`'s flags)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector import review
from meshlet.controlplane.injector.config import InjectConfig, ProxyDefaults, Resources
from meshlet.controlplane.injector.patch import XTABLES_VOLUME as XTABLES
from meshlet.controlplane.injector.patch import inbound_ports, pointer, trust_root_sha256
from meshlet.init import main as init_main
from meshlet.proxy import config as proxy_config
from meshlet_testing import kubelet, schema
from meshlet_testing.workloads import deployment, pod

GOLDEN = Path(__file__).parent / "golden"
ENABLED = {wk.INJECT_ANNOTATION: wk.INJECT_ENABLED}
NS_ENABLED = {
    wk.INJECT_ANNOTATION: wk.INJECT_ENABLED,
    wk.PROXY_LOG_LEVEL_ANNOTATION: "debug",
    wk.OPAQUE_PORTS_ANNOTATION: "3306, 5432",
}

CASES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "pod-native-sidecar": (pod(ENABLED), {}),
    "pod-with-init-containers": (pod(ENABLED, init=True), {}),
    "pod-classic-sidecar": (pod({**ENABLED, wk.PROXY_NATIVE_SIDECAR_ANNOTATION: "false"}), {}),
    "pod-namespace-enabled": (pod(None), NS_ENABLED),
    "pod-overrides": (
        pod(
            {
                **ENABLED,
                wk.SKIP_INBOUND_PORTS_ANNOTATION: "9090",
                wk.SKIP_OUTBOUND_PORTS_ANNOTATION: "443,6443",
                wk.REQUIRE_IDENTITY_PORTS_ANNOTATION: "8080",
                wk.PROXY_CPU_LIMIT_ANNOTATION: "1",
                wk.PROXY_MEMORY_LIMIT_ANNOTATION: "128Mi",
                wk.PROXY_IMAGE_ANNOTATION: "registry.local/meshlet/proxy:dev",
                wk.SHUTDOWN_GRACE_PERIOD_ANNOTATION: "30s",
                wk.IDLE_TIMEOUT_ANNOTATION: "5m",
            }
        ),
        {},
    ),
    "deployment": (deployment(ENABLED), {}),
    "pod-inbound-policy": (
        pod({**ENABLED, wk.DEFAULT_INBOUND_POLICY_ANNOTATION: "deny"}, probes=True),
        {wk.DEFAULT_INBOUND_POLICY_ANNOTATION: "cluster-authenticated"},
    ),
}


def mesh(obj: dict[str, Any], ns: dict[str, str], config: InjectConfig) -> review.Outcome:
    request = review.Request("uid-1", obj["kind"], "emojivoto", "CREATE", obj)
    return review.admit(request, ns, config)


def patched(obj: dict[str, Any], outcome: review.Outcome) -> dict[str, Any]:
    result: dict[str, Any] = jsonpatch.apply_patch(obj, list(outcome.patch))
    return result


def template(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"] if obj["kind"] == "Deployment" else obj


def proxy_of(pod_obj: dict[str, Any]) -> dict[str, Any]:
    spec = pod_obj["spec"]
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    return next(c for c in containers if c["name"] == wk.PROXY_CONTAINER)


def as_scheduled(pod_template: dict[str, Any]) -> dict[str, Any]:
    """The pod the API server stores: namespace and node filled in."""
    scheduled = copy.deepcopy(pod_template)
    scheduled.setdefault("metadata", {}).update(name="web-5d4f8c9b7-x2x7q", namespace="emojivoto")
    scheduled["spec"]["nodeName"] = "node-1"
    return scheduled


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_patch(case: str, config: InjectConfig, golden: Callable[[Path, str], None]) -> None:
    obj, ns = CASES[case]
    outcome = mesh(copy.deepcopy(obj), ns, config)
    assert outcome.skip_reason == ""
    golden(GOLDEN / f"{case}.patch.json", json.dumps(list(outcome.patch), indent=2) + "\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_patched_object_is_schema_valid(case: str, config: InjectConfig) -> None:
    obj, ns = CASES[case]
    result = patched(copy.deepcopy(obj), mesh(copy.deepcopy(obj), ns, config))
    schema.validate(result)
    names = [c["name"] for c in template(result)["spec"].get("initContainers", [])]
    assert names[0] == wk.INIT_CONTAINER  # iptables first, before anything else starts


@pytest.mark.parametrize("case", sorted(CASES))
def test_proxy_env_loads_with_the_proxys_own_loader(case: str, config: InjectConfig) -> None:
    obj, ns = CASES[case]
    meshed = as_scheduled(template(patched(copy.deepcopy(obj), mesh(obj, ns, config))))
    env = kubelet.container_env(meshed, proxy_of(meshed))
    loaded = proxy_config.load(env)  # raises ConfigError naming every unknown or bad variable
    assert loaded.identity_local_name == wk.identity_name("web", "emojivoto")
    assert loaded.identity_svc_name == wk.IDENTITY_SERVICE_NAME
    assert loaded.destination_svc_name == wk.DESTINATION_SERVICE_NAME
    assert json.loads(loaded.destination_context) == {
        "ns": "emojivoto",
        "nodeName": "node-1",
        "pod": "web-5d4f8c9b7-x2x7q",
    }
    assert loaded.identity_trust_anchors == config.trust_anchors_pem
    assert loaded.admin_listen_addr[1] == wk.PROXY_ADMIN_PORT


def test_the_env_table_is_exactly_what_the_proxy_reads() -> None:
    """One table (wellknown.ProxyEnv): the proxy's loader parses every name in it and no
    other, so whatever the injector writes from it, the proxy understands."""
    known = {name for name, _ in proxy_config.defaults_table()}
    assert known == {str(name) for name in wk.ProxyEnv}


def test_overrides_reach_the_proxy_and_init(config: InjectConfig) -> None:
    obj, ns = CASES["pod-overrides"]
    meshed = as_scheduled(patched(copy.deepcopy(obj), mesh(obj, ns, config)))
    loaded = proxy_config.load(kubelet.container_env(meshed, proxy_of(meshed)))
    assert str(loaded.inbound_ports_require_identity) == "8080"
    assert loaded.shutdown_grace_period == 30.0
    assert loaded.http_stream_idle_timeout == 300.0
    assert proxy_of(meshed)["resources"] == {"limits": {"cpu": "1", "memory": "128Mi"}}
    assert proxy_of(meshed)["image"] == "registry.local/meshlet/proxy:dev"
    # ...but never the init container's, which runs as root with NET_ADMIN and NET_RAW
    init = meshed["spec"]["initContainers"][0]
    assert init["name"] == wk.INIT_CONTAINER
    assert init["image"] == config.proxy.image != "registry.local/meshlet/proxy:dev"


def test_namespace_settings_apply_and_are_copied_onto_the_pod(config: InjectConfig) -> None:
    obj, ns = CASES["pod-namespace-enabled"]
    meshed = as_scheduled(patched(copy.deepcopy(obj), mesh(obj, ns, config)))
    loaded = proxy_config.load(kubelet.container_env(meshed, proxy_of(meshed)))
    assert loaded.log == "debug"
    assert str(loaded.inbound_ports_disable_protocol_detection) == "3306,5432"
    annotations = meshed["metadata"]["annotations"]
    assert annotations[wk.OPAQUE_PORTS_ANNOTATION] == "3306, 5432"
    assert wk.INJECT_ANNOTATION not in annotations  # only config.meshlet.io/* is copied


@pytest.mark.parametrize("case", ["pod-native-sidecar", "pod-overrides"])
def test_init_container_args_are_accepted_by_meshlet_init(
    case: str, config: InjectConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    obj, ns = CASES[case]
    meshed = patched(copy.deepcopy(obj), mesh(obj, ns, config))
    init = meshed["spec"]["initContainers"][0]
    assert init["command"] == ["meshlet-init"]
    init_main.main([*init["args"], "--simulate"])
    rules = capsys.readouterr().out
    assert "--to-ports 4143" in rules and "--to-ports 4140" in rules
    if case == "pod-overrides":
        assert "9090" in rules and "6443" in rules


def test_native_sidecar_holds_the_app_until_ready(config: InjectConfig) -> None:
    obj, ns = CASES["pod-with-init-containers"]
    meshed = patched(copy.deepcopy(obj), mesh(obj, ns, config))
    inits = meshed["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [wk.INIT_CONTAINER, wk.PROXY_CONTAINER, "migrate"]
    proxy = inits[1]
    assert proxy["restartPolicy"] == "Always"
    assert proxy["startupProbe"]["httpGet"] == {"path": "/ready", "port": wk.PROXY_ADMIN_PORT}
    assert [c["name"] for c in meshed["spec"]["containers"]] == ["web"]


def test_classic_sidecar_is_the_first_container(config: InjectConfig) -> None:
    obj, ns = CASES["pod-classic-sidecar"]
    meshed = patched(copy.deepcopy(obj), mesh(obj, ns, config))
    assert [c["name"] for c in meshed["spec"]["containers"]] == [wk.PROXY_CONTAINER, "web"]
    assert "restartPolicy" not in meshed["spec"]["containers"][0]
    assert meshed["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "web"
    # Linkerd's proxy.await: the kubelet starts "web" once the proxy is ready
    hook = meshed["spec"]["containers"][0]["lifecycle"]["postStart"]["exec"]["command"]
    assert hook == ["meshlet-proxy-await", "--timeout=120"]
    off = pod({**ENABLED, wk.PROXY_NATIVE_SIDECAR_ANNOTATION: "false",
               wk.PROXY_AWAIT_ANNOTATION: "disabled"})  # fmt: skip
    meshed = patched(copy.deepcopy(off), mesh(off, ns, config))
    assert "lifecycle" not in meshed["spec"]["containers"][0]


def test_labels_token_and_admin_port(config: InjectConfig) -> None:
    obj, ns = CASES["pod-native-sidecar"]
    meshed = patched(copy.deepcopy(obj), mesh(obj, ns, config))
    labels = meshed["metadata"]["labels"]
    assert labels[wk.CONTROL_PLANE_NS_LABEL] == "meshlet"
    assert labels["meshlet.io/proxy-deployment"] == "web"
    token = next(v for v in meshed["spec"]["volumes"] if v["name"] == wk.TOKEN_VOLUME)
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == (
        "identity.meshlet.io"
    )
    ports = {p["name"]: p["containerPort"] for p in proxy_of(meshed)["ports"]}
    assert ports[wk.ADMIN_PORT_NAME] == 4191
    annotations = meshed["metadata"]["annotations"]
    assert annotations[wk.TRUST_ROOT_SHA256_ANNOTATION] == trust_root_sha256(
        config.trust_anchors_pem
    )


def test_deployment_template_gets_the_owner_label(config: InjectConfig) -> None:
    obj, ns = CASES["deployment"]
    meshed = patched(copy.deepcopy(obj), mesh(obj, ns, config))
    assert meshed["spec"]["template"]["metadata"]["labels"]["meshlet.io/proxy-deployment"] == "web"
    assert meshed["metadata"] == obj["metadata"]  # the Deployment's own metadata is untouched


def test_mesh_wide_defaults_reach_the_proxy(config: InjectConfig) -> None:
    defaults = ProxyDefaults(
        log_level="warn",
        native_sidecar=False,
        resources=Resources(cpu_request="100m", memory_request="20Mi"),
    )
    custom = InjectConfig(trust_anchors_pem=config.trust_anchors_pem, proxy=defaults)
    meshed = as_scheduled(patched(pod(ENABLED), mesh(pod(ENABLED), {}, custom)))
    proxy = proxy_of(meshed)
    assert proxy["resources"] == {"requests": {"cpu": "100m", "memory": "20Mi"}}
    assert proxy_config.load(kubelet.container_env(meshed, proxy)).log == "warning"
    schema.validate(meshed)


def test_pointer_escapes() -> None:
    assert pointer("metadata", "annotations", "meshlet.io/inject") == (
        "/metadata/annotations/meshlet.io~1inject"
    )
    assert pointer("a~b") == "/a~0b"


def test_the_policy_settings_the_proxy_gets(config: InjectConfig) -> None:
    """Where the policy controller is and who it must be, which workload to ask for, which
    ports, and the default policy until it answers: the pod's annotation here."""
    obj, ns = CASES["pod-inbound-policy"]
    meshed = as_scheduled(patched(copy.deepcopy(obj), mesh(obj, ns, config)))
    env = kubelet.container_env(meshed, proxy_of(meshed))
    assert env[wk.ProxyEnv.POLICY_SVC_ADDR] == "meshlet-policy.meshlet.svc.cluster.local.:8090"
    assert env[wk.ProxyEnv.POLICY_SVC_NAME] == wk.POLICY_SERVICE_NAME
    assert json.loads(env[wk.ProxyEnv.POLICY_WORKLOAD]) == {
        "ns": "emojivoto",
        "pod": "web-5d4f8c9b7-x2x7q",
    }
    assert env[wk.ProxyEnv.POLICY_CLUSTER_NETWORKS] == config.cluster_networks
    assert env[wk.ProxyEnv.INBOUND_DEFAULT_POLICY] == "deny"
    assert env[wk.ProxyEnv.INBOUND_PORTS] == "8080,9090,9091"


def test_the_default_inbound_policy_comes_from_the_namespace_or_the_installation(
    config: InjectConfig,
) -> None:
    def policy(pod_obj: dict[str, Any], ns: dict[str, str], cfg: InjectConfig) -> str:
        meshed = as_scheduled(patched(copy.deepcopy(pod_obj), mesh(pod_obj, ns, cfg)))
        return kubelet.container_env(meshed, proxy_of(meshed))[wk.ProxyEnv.INBOUND_DEFAULT_POLICY]

    annotation = wk.DEFAULT_INBOUND_POLICY_ANNOTATION
    assert policy(pod(ENABLED), {}, config) == "all-unauthenticated"
    assert policy(pod(ENABLED), {annotation: "audit"}, config) == "audit"
    strict = InjectConfig(
        trust_anchors_pem=config.trust_anchors_pem,
        proxy=ProxyDefaults(default_inbound_policy="all-authenticated"),
    )
    assert policy(pod(ENABLED), {}, strict) == "all-authenticated"
    # an unknown name never reaches the proxy: the pod starts with the namespace's policy
    bad = pod({**ENABLED, annotation: "allow-all"})
    outcome = mesh(copy.deepcopy(bad), {annotation: "audit"}, config)
    assert policy(bad, {annotation: "audit"}, config) == "audit"
    assert outcome.warnings == (
        f"pod annotation {annotation}='allow-all' ignored: expected one of all-unauthenticated,"
        " all-authenticated, cluster-unauthenticated, cluster-authenticated, deny, audit",
    )


def test_inbound_ports_are_the_pods_declared_and_probed_ports() -> None:
    spec: dict[str, Any] = {
        "initContainers": [{"name": "sidecar", "ports": [{"containerPort": 9100}]}],
        "containers": [
            {"name": "a", "ports": [{"containerPort": 8080}, {"containerPort": 80}],
             "readinessProbe": {"httpGet": {"path": "/ready", "port": 8081}},
             "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}}},
            {"name": "b", "ports": [{"containerPort": 8080}],
             "startupProbe": {"httpGet": {"path": "/", "port": 7000}}},
        ],
    }  # fmt: skip
    assert inbound_ports(spec) == "80,8080,8081,9100"  # numeric order, named probe ports skipped
    assert inbound_ports({"containers": [{"name": "a"}]}) == ""
    junk: dict[str, Any] = {"containers": [
        {"name": "a", "ports": [{"containerPort": 0}, {"containerPort": 70000},
                                {"containerPort": "80"}, {"containerPort": True}, "x"],
         "readinessProbe": {"httpGet": {"port": -1}}, "livenessProbe": "x"},
        "not a container",
    ], "initContainers": {"not": "a list"}}  # fmt: skip
    assert inbound_ports(junk) == ""


def test_a_pod_without_ports_gets_no_inbound_ports_variable(config: InjectConfig) -> None:
    bare = pod(ENABLED)
    del bare["spec"]["containers"][0]["ports"]
    meshed = as_scheduled(patched(copy.deepcopy(bare), mesh(bare, {}, config)))
    assert wk.ProxyEnv.INBOUND_PORTS not in kubelet.container_env(meshed, proxy_of(meshed))


def test_more_ports_than_the_proxy_watches_are_left_out_with_a_message(
    config: InjectConfig,
) -> None:
    """The proxy's loader refuses more than MAX_INBOUND_PORTS ports (it would exit and the pod
    never start): the variable is left out, the pod starts with its default policy."""
    crowded = pod(ENABLED)
    crowded["spec"]["containers"][0]["ports"] = [
        {"containerPort": 10000 + i, "name": f"p{i}"}
        for i in range(proxy_config.MAX_INBOUND_PORTS + 1)
    ]
    outcome = mesh(copy.deepcopy(crowded), {}, config)
    meshed = as_scheduled(patched(copy.deepcopy(crowded), outcome))
    env = kubelet.container_env(meshed, proxy_of(meshed))
    assert wk.ProxyEnv.INBOUND_PORTS not in env
    assert outcome.warnings == (f"no {wk.ProxyEnv.INBOUND_PORTS}: more than 1000 ports",)
    proxy_config.load(env)


def test_access_log_and_trace_collector_annotations_reach_the_proxy(config: InjectConfig) -> None:
    """Off by default; the annotations become the proxy's env, and a value the proxy would
    refuse is dropped (the pod still starts, without it)."""
    plain = as_scheduled(patched(pod(ENABLED), mesh(pod(ENABLED), {}, config)))
    env = kubelet.container_env(plain, proxy_of(plain))
    assert wk.ProxyEnv.ACCESS_LOG not in env and wk.ProxyEnv.TRACE_COLLECTOR_SVC_ADDR not in env
    annotations = {**ENABLED, wk.ACCESS_LOG_ANNOTATION: "JSON",
                   wk.TRACE_COLLECTOR_ANNOTATION: "http://collector.tracing:4318"}  # fmt: skip
    meshed = as_scheduled(patched(pod(annotations), mesh(pod(annotations), {}, config)))
    loaded = proxy_config.load(kubelet.container_env(meshed, proxy_of(meshed)))
    assert loaded.access_log == "json"
    assert loaded.trace_collector_svc_addr == "http://collector.tracing:4318/v1/traces"
    bad = {**ENABLED, wk.ACCESS_LOG_ANNOTATION: "combined",
           wk.TRACE_COLLECTOR_ANNOTATION: "collector:4317"}  # fmt: skip
    meshed = as_scheduled(patched(pod(bad), mesh(pod(bad), {}, config)))
    env = kubelet.container_env(meshed, proxy_of(meshed))
    assert wk.ProxyEnv.ACCESS_LOG not in env and wk.ProxyEnv.TRACE_COLLECTOR_SVC_ADDR not in env


# Pod Security's `restricted` level (Kubernetes 1.33), the checks a pod's spec is held to.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}  # fmt: skip


def restricted_violations(pod_obj: dict[str, Any]) -> list[str]:
    spec = pod_obj["spec"]
    pod_ctx = spec.get("securityContext") or {}
    found = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        found += [f"volume {volume['name']}: {k}" for k in kinds - RESTRICTED_VOLUMES]
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        ctx, name = c.get("securityContext") or {}, c["name"]
        caps = ctx.get("capabilities") or {}
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds {caps['add']}")
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name}: does not drop ALL capabilities")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot unset")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile")) or {}
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: no seccomp profile")
    return found


def test_with_meshlet_cni_the_meshed_pod_is_admitted_by_restricted(config: InjectConfig) -> None:
    """cniEnabled: the validator replaces the privileged init container, and a pod that meets
    `restricted` still meets it once meshed (without meshlet-cni it cannot)."""
    app = pod(ENABLED)
    app["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip
    for c in app["spec"]["containers"]:
        c["securityContext"] = {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}  # fmt: skip
    assert restricted_violations(app) == []
    with_init = patched(copy.deepcopy(app), mesh(copy.deepcopy(app), {}, config))
    assert "meshlet-init: adds ['NET_ADMIN', 'NET_RAW']" in restricted_violations(with_init)

    cni = InjectConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                          "cni_enabled": True})  # fmt: skip
    meshed = patched(copy.deepcopy(app), mesh(copy.deepcopy(app), {}, cni))
    schema.validate(meshed)
    assert restricted_violations(meshed) == []
    inits = meshed["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [wk.VALIDATOR_CONTAINER, wk.PROXY_CONTAINER]
    validator = inits[0]
    assert validator["command"] == ["meshlet-network-validator"]
    assert validator["securityContext"]["runAsUser"] not in (0, wk.PROXY_UID)
    assert validator["image"] == config.proxy.image
    assert XTABLES not in {v["name"] for v in meshed["spec"]["volumes"]}
    # the CNI plugin reads what marks a meshed pod, from the pod's own annotations
    assert wk.PROXY_VERSION_ANNOTATION in meshed["metadata"]["annotations"]


def test_the_validators_flags_are_the_validators(config: InjectConfig) -> None:
    from meshlet.init import validate

    cni = InjectConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                          "cni_enabled": True})  # fmt: skip
    meshed = patched(pod(ENABLED), mesh(pod(ENABLED), {}, cni))
    validator = meshed["spec"]["initContainers"][0]
    args = validate.parser().parse_args(validator["args"])
    assert args.listen_addr == ("0.0.0.0", wk.PROXY_OUTBOUND_PORT)
