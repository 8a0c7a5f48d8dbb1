"""Which proxies a tap reads: a resource (`deploy/web`, `pod/web-1`, `ns/emojivoto`) resolved
against the known pods to their addresses and the identities their certificates must carry.

Pure: the pods come in as Kubernetes JSON, the targets go out as values; the server owns the
cache that feeds it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown

KINDS: Final = {
    "deploy": "deployment", "deployment": "deployment", "deployments": "deployment",
    "po": "pod", "pod": "pod", "pods": "pod",
    "ns": "namespace", "namespace": "namespace", "namespaces": "namespace",
}  # fmt: skip
MAX_NAME: Final = 253


class ResourceError(ValueError):
    """A resource the tap cannot read; the message says what is accepted."""


@dataclass(frozen=True, slots=True)
class Resource:
    kind: str  # deployment | pod | namespace
    name: str


@dataclass(frozen=True, slots=True)
class Target:
    """One meshed pod's proxy: where its tap server listens and who it must prove to be."""

    namespace: str
    pod: str
    ip: str
    identity: str
    deployment: str | None


def parse_resource(text: str) -> Resource:
    """`deploy/web` → Resource("deployment", "web"); the kinds are Linkerd's short names."""
    kind, sep, name = text.partition("/")
    if not sep or not name or "/" in name or len(name) > MAX_NAME:
        raise ResourceError(
            f"invalid resource {text!r}: expected KIND/NAME with KIND one of deploy, pod, ns"
        )
    if kind.lower() not in KINDS:
        raise ResourceError(f"invalid resource {text!r}: {kind!r} is not one of deploy, pod, ns")
    return Resource(KINDS[kind.lower()], name)


def deployment_of(pod: dict[str, Any]) -> str | None:
    """The Deployment owning a pod through its ReplicaSet (`web-5d8f7` with the pod's
    `pod-template-hash` label `5d8f7` → `web`), or None."""
    meta = pod.get("metadata") or {}
    template_hash = (meta.get("labels") or {}).get("pod-template-hash")
    for owner in meta.get("ownerReferences") or ():
        if owner.get("kind") == "ReplicaSet" and owner.get("controller") and template_hash:
            name = str(owner.get("name", ""))
            if name.endswith("-" + template_hash):
                return name[: -len(template_hash) - 1]
    return None


def _target(pod: dict[str, Any], control_ns: str, trust_domain: str) -> Target | None:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return None
    if labels.get(wellknown.CONTROL_PLANE_NS_LABEL) is None:
        return None  # not meshed: no proxy to tap
    ns, sa = str(meta.get("namespace", "default")), str(spec.get("serviceAccountName", "default"))
    return Target(
        namespace=ns,
        pod=str(meta.get("name")),
        ip=str(ip),
        identity=wellknown.identity_name(sa, ns, control_ns, trust_domain),
        deployment=deployment_of(pod),
    )


def select(
    resource: Resource,
    namespace: str,
    pods: Iterable[dict[str, Any]],
    control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE,
    trust_domain: str = wellknown.TRUST_DOMAIN,
) -> list[Target]:
    """The running meshed pods of `resource` (in `namespace` unless it is a namespace), sorted."""
    wanted_ns = resource.name if resource.kind == "namespace" else namespace
    found = []
    for pod in pods:
        target = _target(pod, control_ns, trust_domain)
        if target is None or target.namespace != wanted_ns:
            continue
        if resource.kind == "pod" and target.pod != resource.name:
            continue
        if resource.kind == "deployment" and target.deployment != resource.name:
            continue
        found.append(target)
    return sorted(found, key=lambda t: t.pod)


def matches(resource: Resource, namespace: str, labels: dict[str, str]) -> bool:
    """Whether a destination, described by the proxy's endpoint labels (`namespace`, `pod`,
    `deployment`), is `resource` in `namespace`: what `--to` filters on."""
    if resource.kind == "namespace":
        return labels.get("namespace") == resource.name
    if labels.get("namespace") != namespace:
        return False
    key = "pod" if resource.kind == "pod" else "deployment"
    return labels.get(key) == resource.name
