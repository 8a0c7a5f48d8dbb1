"""Which pods a resource named on the command line stands for (pure): resource arguments as
kubectl and linkerd take them (`deploy`, `deploy/web`, `po web-1`), Deployments' selectors, the
labels the injector writes on meshed pods, and the port each proxy serves its admin on."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshlet.api import wellknown as wk

Obj = dict[str, Any]
TERMINATED = frozenset({"Succeeded", "Failed"})


class Kind(enum.Enum):
    DEPLOYMENT = "deployment"
    POD = "pod"


KINDS: Mapping[str, Kind] = {
    "deploy": Kind.DEPLOYMENT,
    "deployment": Kind.DEPLOYMENT,
    "deployments": Kind.DEPLOYMENT,
    "po": Kind.POD,
    "pod": Kind.POD,
    "pods": Kind.POD,
}


@dataclass(frozen=True, slots=True)
class Resources:
    """A kind and the names asked for (none: every one in the namespace)."""

    kind: Kind
    names: tuple[str, ...] = ()


def _kind(text: str) -> Kind:
    try:
        return KINDS[text.lower()]
    except KeyError:
        known = ", ".join(KINDS)
        raise ValueError(f"unknown resource type {text!r}; expected one of {known}") from None


def parse_resources(args: Sequence[str]) -> Resources:
    """`TYPE [NAME...]` or `TYPE/NAME...` (one type); ValueError says what is wrong."""
    if not args:
        raise ValueError("name a resource type: deploy or pod, then optionally names")
    if "/" not in args[0]:
        kind, names = _kind(args[0]), tuple(args[1:])
        if any("/" in name for name in names):
            raise ValueError("give either TYPE NAME... or TYPE/NAME..., not both")
    else:
        if any("/" not in arg for arg in args):
            raise ValueError("give resources of one type, all as TYPE/NAME")
        parts = [arg.split("/", 1) for arg in args]
        kinds = {_kind(k) for k, _ in parts}
        if len(kinds) > 1:
            raise ValueError("give resources of one type, all as TYPE/NAME")
        kind, names = kinds.pop(), tuple(name for _, name in parts)
    if any(not name for name in names):
        raise ValueError("a resource name is empty")
    return Resources(kind, tuple(dict.fromkeys(names)))


def parse_target(arg: str) -> Resources:
    """One pod or one workload: `POD`, `po/POD`, `deploy/NAME`."""
    if "/" not in arg:
        return Resources(Kind.POD, (arg,))
    kind, _, name = arg.partition("/")
    if not name:
        raise ValueError(f"{arg!r} names no resource; expected TYPE/NAME")
    return Resources(_kind(kind), (name,))


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    phase: str
    labels: Mapping[str, str]
    meshed: bool  # the injector labelled it
    admin_port: int  # where its proxy serves /metrics

    @property
    def running(self) -> bool:
        return self.phase == "Running"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def admin_port(spec: Mapping[str, Any]) -> int:
    """The container port named `meshlet-admin` (the proxy is a native sidecar, so an init
    container, or a classic one); 4191 when none is named."""
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if port.get("name") == wk.ADMIN_PORT_NAME and isinstance(number, int):
                return number
    return wk.PROXY_ADMIN_PORT


def pod_of(obj: Mapping[str, Any]) -> Pod:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    return Pod(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        phase=str((obj.get("status") or {}).get("phase") or "Pending"),
        labels=labels,
        meshed=wk.CONTROL_PLANE_NS_LABEL in labels,
        admin_port=admin_port(spec),
    )


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (`matchLabels`, `matchExpressions`) against a pod's labels, as the
    policy controller matches its Servers' selectors."""
    from meshlet.controlplane.policy.resources import Expression, Selector

    expressions = tuple(
        Expression(
            str(e.get("key")), str(e.get("operator")), tuple(map(str, e.get("values") or ()))
        )
        for e in selector.get("matchExpressions") or ()
        if isinstance(e, Mapping)
    )
    pairs = tuple((str(k), str(v)) for k, v in (selector.get("matchLabels") or {}).items())
    return Selector(pairs, expressions).matches(labels)


@dataclass(frozen=True, slots=True)
class Workload:
    """A row of `meshlet stat`: a Deployment with its live pods, or one pod."""

    kind: Kind
    namespace: str
    name: str
    pods: tuple[Pod, ...]  # not Succeeded or Failed

    @property
    def meshed_pods(self) -> tuple[Pod, ...]:
        return tuple(p for p in self.pods if p.meshed)

    @property
    def meshed(self) -> str:
        return f"{len(self.meshed_pods)}/{len(self.pods)}"

    @property
    def status(self) -> str:
        """A pod's phase (empty for a Deployment)."""
        return self.pods[0].phase if self.kind is Kind.POD and self.pods else ""


def deployments(objs: Iterable[Mapping[str, Any]], pods: Iterable[Pod]) -> list[Workload]:
    """Each Deployment with the live pods its selector picks or the injector labelled as its."""
    live = [p for p in pods if p.phase not in TERMINATED]
    owner_label = wk.PROXY_OWNER_LABEL_PREFIX + Kind.DEPLOYMENT.value
    out = []
    for obj in objs:
        meta = obj.get("metadata") or {}
        ns, name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
        selector = (obj.get("spec") or {}).get("selector") or {}
        members = tuple(
            p for p in live
            if p.namespace == ns
            and (selects(selector, p.labels) or p.labels.get(owner_label) == name)
        )  # fmt: skip
        out.append(Workload(Kind.DEPLOYMENT, ns, name, members))
    return sorted(out, key=lambda w: (w.namespace, w.name))


def pod_workloads(pods: Iterable[Pod]) -> list[Workload]:
    """One row per live pod."""
    rows = [
        Workload(Kind.POD, p.namespace, p.name, (p,)) for p in pods if p.phase not in TERMINATED
    ]
    return sorted(rows, key=lambda w: (w.namespace, w.name))
