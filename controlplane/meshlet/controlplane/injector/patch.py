"""The proxy's containers, volumes and the RFC 6902 patch that adds them to a pod template.

The one definition of a meshed pod, used by the webhook and by `meshlet inject --manual` (and by
`meshlet install` for the control plane's own pods). Pure: values in, JSON-shaped values out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector.config import InjectConfig, Resources
from meshlet.controlplane.injector.model import (
    Container,
    EnvVar,
    Obj,
    PatchOp,
    Probe,
    Volume,
    VolumeMount,
)
from meshlet.controlplane.injector.overrides import ProxySettings, Resolved
from meshlet.controlplane.injector.owner import Owner, valid_label_value

DEFAULT_CONTAINER_ANNOTATION: Final = "kubectl.kubernetes.io/default-container"
TOKEN_LIFETIME_SECONDS: Final = 86400
XTABLES_VOLUME: Final = "meshlet-init-xtables-lock"
# Linkerd's proxy.await: the classic sidecar's postStart hook (meshlet.proxy.readiness)
AWAIT_COMMAND: Final = ["meshlet-proxy-await", "--timeout=120"]


@dataclass(frozen=True, slots=True)
class Target:
    """A pod template to mesh: where it sits in its object and what it holds."""

    path: str  # JSON pointer of the template in its object; "" for a Pod
    metadata: Mapping[str, Any]
    spec: Mapping[str, Any]
    namespace: str
    owner: Owner | None


def trust_root_sha256(anchors_pem: str) -> str:
    """The fingerprint of the trust anchors written on every meshed pod (and compared by
    `meshlet check`)."""
    return hashlib.sha256(anchors_pem.strip().encode()).hexdigest()


def _field(name: str, path: str) -> EnvVar:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _svc_addr(name: str, config: InjectConfig, port: int) -> str:
    return f"{name}.{config.control_ns}.svc.{config.cluster_domain}.:{port}"


def _probe_port(probe: Any) -> int | None:
    """A probe's `httpGet` port when it is a number (a named one is a container port already)."""
    port = ((probe or {}).get("httpGet") or {}).get("port") if isinstance(probe, dict) else None
    return port if isinstance(port, int) and not isinstance(port, bool) else None


def inbound_ports(spec: Mapping[str, Any]) -> str:
    """The ports the pod serves, whose inbound policies its proxy watches: every container's
    (init containers' too) declared ports and numeric HTTP probe ports, as Linkerd collects
    them; `"8080,9090"`, ascending, without duplicates or values that are not ports."""
    found: set[int] = set()
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for c in containers if isinstance(containers, list) else []:
            if not isinstance(c, dict):
                continue
            declared = c.get("ports")
            for p in declared if isinstance(declared, list) else []:
                port = p.get("containerPort") if isinstance(p, dict) else None
                if isinstance(port, int) and not isinstance(port, bool):
                    found.add(port)
            for probe in ("readinessProbe", "livenessProbe"):
                if (port := _probe_port(c.get(probe))) is not None:
                    found.add(port)
    return ",".join(str(p) for p in sorted(p for p in found if 0 < p < 65536))


def checked_inbound_ports(spec: Mapping[str, Any]) -> tuple[str, list[str]]:
    """`inbound_ports`, or "" with a message when the proxy's loader would refuse the list (more
    ports than it watches): the proxy then falls back to its default policy, the pod starts."""
    from meshlet.proxy import config as proxy_config

    ports = inbound_ports(spec)
    try:
        proxy_config.check(wk.ProxyEnv.INBOUND_PORTS, ports)
    except ValueError as exc:
        return "", [f"no {wk.ProxyEnv.INBOUND_PORTS}: {exc}"]
    return ports, []


def proxy_env(
    config: InjectConfig,
    settings: ProxySettings,
    identity_addr: str = "",
    ports: str = "",
) -> list[EnvVar]:
    """The proxy's environment: exactly the `MESHLET_PROXY_*` names `meshlet-proxy` reads.
    `$(_pod_*)` references are expanded by the kubelet from the fields above them.
    `identity_addr` replaces the identity Service's address; `ports` are the pod's
    (`inbound_ports`)."""
    local_name = wk.identity_name("$(_pod_sa)", "$(_pod_ns)", config.control_ns,
                                  config.trust_domain)  # fmt: skip
    context = '{"ns":"$(_pod_ns)","nodeName":"$(_pod_nodename)","pod":"$(_pod_name)"}'
    workload = '{"ns":"$(_pod_ns)","pod":"$(_pod_name)"}'
    values: list[tuple[str, str]] = [
        (wk.ProxyEnv.LOG, settings.log_level),
        # both families: a dual-stack pod's IPv6 is redirected too (meshlet-init --ipv6 auto);
        # where the pod has no IPv6, the proxy leaves the IPv6 addresses out
        (wk.ProxyEnv.INBOUND_LISTEN_ADDRS,
         f"0.0.0.0:{wk.PROXY_INBOUND_PORT},[::]:{wk.PROXY_INBOUND_PORT}"),
        (wk.ProxyEnv.OUTBOUND_LISTEN_ADDRS,
         f"127.0.0.1:{wk.PROXY_OUTBOUND_PORT},[::1]:{wk.PROXY_OUTBOUND_PORT}"),
        (wk.ProxyEnv.ADMIN_LISTEN_ADDR, f"0.0.0.0:{wk.PROXY_ADMIN_PORT}"),
        (wk.ProxyEnv.CONTROL_LISTEN_ADDR, f"0.0.0.0:{wk.PROXY_CONTROL_PORT}"),
        (wk.ProxyEnv.DESTINATION_SVC_ADDR,
         _svc_addr(wk.DESTINATION_NAME, config, wk.DESTINATION_PORT)),
        (wk.ProxyEnv.DESTINATION_SVC_NAME,
         wk.identity_name(wk.DESTINATION_NAME, config.control_ns, config.control_ns,
                          config.trust_domain)),
        (wk.ProxyEnv.DESTINATION_CONTEXT, context),
        (wk.ProxyEnv.DESTINATION_PROFILE_SUFFIXES, f"svc.{config.cluster_domain}."),
        (wk.ProxyEnv.POLICY_SVC_ADDR, _svc_addr(wk.POLICY_NAME, config, wk.POLICY_PORT)),
        (wk.ProxyEnv.POLICY_SVC_NAME,
         wk.identity_name(wk.POLICY_NAME, config.control_ns, config.control_ns,
                          config.trust_domain)),
        (wk.ProxyEnv.POLICY_WORKLOAD, workload),
        (wk.ProxyEnv.POLICY_CLUSTER_NETWORKS, config.cluster_networks),
        (wk.ProxyEnv.INBOUND_DEFAULT_POLICY, settings.default_inbound_policy),
        (wk.ProxyEnv.IDENTITY_SVC_ADDR,
         identity_addr or _svc_addr(wk.IDENTITY_NAME, config, wk.IDENTITY_PORT)),
        (wk.ProxyEnv.IDENTITY_SVC_NAME,
         wk.identity_name(wk.IDENTITY_NAME, config.control_ns, config.control_ns,
                          config.trust_domain)),
        (wk.ProxyEnv.IDENTITY_LOCAL_NAME, local_name),
        (wk.ProxyEnv.IDENTITY_TOKEN_FILE, f"{wk.TOKEN_DIR_PATH}/{wk.TOKEN_FILE}"),
        (wk.ProxyEnv.IDENTITY_TRUST_ANCHORS, config.trust_anchors_pem),
        (wk.ProxyEnv.IDENTITY_TRUST_ANCHORS_FILE, f"{wk.TRUST_ROOTS_PATH}/{wk.TRUST_ROOTS_KEY}"),
        (wk.ProxyEnv.IDENTITY_DIR, wk.IDENTITY_DIR_PATH),
        (wk.ProxyEnv.INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION, settings.opaque_ports),
        (wk.ProxyEnv.OUTBOUND_PORTS_DISABLE_PROTOCOL_DETECTION, settings.opaque_ports),
    ]  # fmt: skip
    optional = (
        (wk.ProxyEnv.INBOUND_PORTS, ports),
        (wk.ProxyEnv.INBOUND_PORTS_REQUIRE_IDENTITY, settings.require_identity_ports),
        (wk.ProxyEnv.OUTBOUND_CONNECT_TIMEOUT, settings.outbound_connect_timeout),
        (wk.ProxyEnv.SHUTDOWN_GRACE_PERIOD, settings.shutdown_grace_period),
        (wk.ProxyEnv.HTTP_STREAM_IDLE_TIMEOUT, settings.stream_idle_timeout),
        (wk.ProxyEnv.ACCESS_LOG, settings.access_log),
        (wk.ProxyEnv.INBOUND_HTTP_ESCAPED_SLASHES, settings.escaped_slashes),
        (wk.ProxyEnv.TRACE_COLLECTOR_SVC_ADDR, settings.trace_collector),
    )
    values.extend((name, value) for name, value in optional if value)
    return [
        _field("_pod_name", "metadata.name"),
        _field("_pod_ns", "metadata.namespace"),
        _field("_pod_nodename", "spec.nodeName"),
        _field("_pod_sa", "spec.serviceAccountName"),
        *(EnvVar(name=str(name), value=value) for name, value in values),
    ]


def _probe(path: str, **timing: int) -> Probe:
    probe: Probe = {"httpGet": {"path": path, "port": wk.PROXY_ADMIN_PORT}}
    probe.update(timing)  # type: ignore[typeddict-item]
    return probe


def _resources(resources: Resources) -> Obj:
    out: Obj = {}
    for section, cpu, memory in (
        ("requests", resources.cpu_request, resources.memory_request),
        ("limits", resources.cpu_limit, resources.memory_limit),
    ):
        values = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v}
        if values:
            out[section] = values
    return out


def _unprivileged(uid: int, gid: int) -> Obj:
    """A container's security context that Pod Security's `restricted` level admits."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def proxy_container(
    config: InjectConfig, settings: ProxySettings, identity_addr: str = "", ports: str = ""
) -> Container:
    """The sidecar; with `native_sidecar`, an init container that keeps running
    (`restartPolicy: Always`) and holds the app back until `/ready` answers."""
    mounts: list[VolumeMount] = [
        {"name": wk.IDENTITY_DIR_VOLUME, "mountPath": wk.IDENTITY_DIR_PATH},
        {"name": wk.TOKEN_VOLUME, "mountPath": wk.TOKEN_DIR_PATH, "readOnly": True},
        {"name": wk.TRUST_ROOTS_VOLUME, "mountPath": wk.TRUST_ROOTS_PATH, "readOnly": True},
    ]
    container: Container = {
        "name": wk.PROXY_CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": proxy_env(config, settings, identity_addr, ports),
        "ports": [
            {"containerPort": wk.PROXY_INBOUND_PORT, "name": wk.PROXY_PORT_NAME},
            {"containerPort": wk.PROXY_ADMIN_PORT, "name": wk.ADMIN_PORT_NAME},
        ],
        "readinessProbe": _probe("/ready", initialDelaySeconds=2, timeoutSeconds=1),
        "livenessProbe": _probe("/live", initialDelaySeconds=10, timeoutSeconds=1),
        "securityContext": _unprivileged(wk.PROXY_UID, wk.PROXY_GID),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }
    resources = _resources(settings.resources)
    if resources:
        container["resources"] = resources
    if settings.native_sidecar:
        container["restartPolicy"] = "Always"
        container["startupProbe"] = _probe("/ready", periodSeconds=1, failureThreshold=120)
    elif settings.proxy_await:  # the kubelet starts the app once this hook returns
        container["lifecycle"] = {"postStart": {"exec": {"command": AWAIT_COMMAND}}}
    return container


def init_container(settings: ProxySettings) -> Container:
    """`meshlet-init`: programs the pod's iptables, then exits."""
    args = [
        "--incoming-proxy-port", str(wk.PROXY_INBOUND_PORT),
        "--outgoing-proxy-port", str(wk.PROXY_OUTBOUND_PORT),
        "--proxy-uid", str(wk.PROXY_UID),
        "--mode", settings.iptables_mode,
    ]  # fmt: skip
    if settings.skip_inbound_ports:
        args += ["--inbound-ports-to-ignore", settings.skip_inbound_ports]
    if settings.skip_outbound_ports:
        args += ["--outbound-ports-to-ignore", settings.skip_outbound_ports]
    return {
        "name": wk.INIT_CONTAINER,
        "image": settings.init_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["meshlet-init"],
        "args": args,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": XTABLES_VOLUME, "mountPath": "/run"}],
    }


def validator_container(settings: ProxySettings) -> Container:
    """`meshlet-network-validator`, in place of `meshlet-init` where meshlet-cni programs the
    pod's tables: no privilege at all (Pod Security's `restricted` admits it); it fails the pod
    when its outbound TCP is not redirected."""
    return {
        "name": wk.VALIDATOR_CONTAINER,
        "image": settings.init_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["meshlet-network-validator"],
        "args": [f"--listen-addr=0.0.0.0:{wk.PROXY_OUTBOUND_PORT}", "--timeout=10"],
        "securityContext": _unprivileged(wk.VALIDATOR_UID, wk.VALIDATOR_UID),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def volumes(cni: bool = False) -> list[Volume]:
    token = {
        "serviceAccountToken": {
            "audience": wk.TOKEN_AUDIENCE,
            "expirationSeconds": TOKEN_LIFETIME_SECONDS,
            "path": wk.TOKEN_FILE,
        }
    }
    xtables: list[Volume] = [] if cni else [{"name": XTABLES_VOLUME, "emptyDir": {}}]
    return [
        *xtables,
        {"name": wk.IDENTITY_DIR_VOLUME, "emptyDir": {"medium": "Memory"}},
        {"name": wk.TOKEN_VOLUME, "projected": {"sources": [token]}},
        # the namespace's copy of the trust-roots bundle, which the proxy follows; optional:
        # without it the proxy keeps the anchors of its environment
        {"name": wk.TRUST_ROOTS_VOLUME,
         "configMap": {"name": wk.TRUST_ROOTS_COPY, "optional": True}},
    ]  # fmt: skip


def pointer(*parts: str) -> str:
    """An RFC 6901 pointer from unescaped parts."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _add(path: str, value: Any) -> PatchOp:
    return {"op": "add", "path": path, "value": value}


def _merge_map(path: str, current: Any, entries: Mapping[str, str]) -> list[PatchOp]:
    if not entries:
        return []
    if not isinstance(current, dict):
        return [_add(path, dict(entries))]
    return [_add(path + pointer(key), value) for key, value in entries.items()]


def _list_ops(path: str, current: Any, items: list[Any], at: int | None) -> list[PatchOp]:
    """Adds `items` at index `at` (None: the end), creating the list when absent."""
    ops: list[PatchOp] = []
    if not isinstance(current, list):
        ops.append(_add(path, []))
    for offset, item in enumerate(items):
        ops.append(_add(f"{path}/{'-' if at is None else at + offset}", item))
    return ops


def pod_annotations(target: Target, config: InjectConfig, resolved: Resolved) -> dict[str, str]:
    """What the injector writes on the pod: versions, the trust root, the namespace's config
    annotations in force (so the pod shows what it runs with), the default container."""
    out = {
        wk.PROXY_VERSION_ANNOTATION: config.version,
        wk.TRUST_ROOT_SHA256_ANNOTATION: trust_root_sha256(config.trust_anchors_pem),
        **resolved.inherited,
    }
    current = target.metadata.get("annotations")
    containers = target.spec.get("containers")
    if (
        not resolved.settings.native_sidecar
        and not (isinstance(current, dict) and DEFAULT_CONTAINER_ANNOTATION in current)
        and isinstance(containers, list)
        and containers
        and isinstance(containers[0], dict)
        and isinstance(containers[0].get("name"), str)
    ):
        out[DEFAULT_CONTAINER_ANNOTATION] = containers[0]["name"]
    return out


def pod_labels(target: Target, config: InjectConfig) -> tuple[dict[str, str], list[str]]:
    out = {wk.CONTROL_PLANE_NS_LABEL: config.control_ns}
    messages = []
    if target.namespace and valid_label_value(target.namespace):
        out[wk.WORKLOAD_NS_LABEL] = target.namespace
    owner = target.owner
    if owner is not None:
        key = wk.PROXY_OWNER_LABEL_PREFIX + owner.kind
        if valid_label_value(owner.name) and valid_label_value(owner.kind) and len(key) <= 63 + 11:
            out[key] = owner.name
        else:
            messages.append(f"no {key} label: {owner.name[:60]!r} is not a valid label value")
    return out, messages


def _identity_addr(target: Target, config: InjectConfig) -> str:
    """The identity service's own proxy is certified by the container beside it, over loopback:
    its Service has no ready endpoint before that proxy is ready."""
    labels = target.metadata.get("labels")
    component = labels.get(wk.CONTROL_PLANE_COMPONENT_LABEL) if isinstance(labels, dict) else None
    if component == "identity" and target.namespace == config.control_ns:
        return f"127.0.0.1:{wk.IDENTITY_PORT}"
    return ""


def patch(
    target: Target, config: InjectConfig, resolved: Resolved
) -> tuple[list[PatchOp], list[str]]:
    """The operations that mesh the template at `target.path`, and messages about them."""
    settings = resolved.settings
    meta, spec = target.path + "/metadata", target.path + "/spec"
    new_labels, messages = pod_labels(target, config)
    ports, refused = checked_inbound_ports(target.spec)
    messages += refused
    proxy = proxy_container(config, settings, _identity_addr(target, config), ports)
    ops = [
        *_merge_map(meta + "/annotations", target.metadata.get("annotations"),
                    pod_annotations(target, config, resolved)),
        *_merge_map(meta + "/labels", target.metadata.get("labels"), new_labels),
        *_list_ops(spec + "/volumes", target.spec.get("volumes"), volumes(config.cni_enabled),
                   None),
    ]  # fmt: skip
    first = validator_container(settings) if config.cni_enabled else init_container(settings)
    inits: list[Container] = [first]
    if settings.native_sidecar:
        inits.append(proxy)
    ops += _list_ops(spec + "/initContainers", target.spec.get("initContainers"), inits, 0)
    if not settings.native_sidecar:
        ops += _list_ops(spec + "/containers", target.spec.get("containers"), [proxy], 0)
    return ops, [*resolved.messages, *messages]


def encode(ops: list[PatchOp]) -> bytes:
    return json.dumps(ops, separators=(",", ":")).encode()
