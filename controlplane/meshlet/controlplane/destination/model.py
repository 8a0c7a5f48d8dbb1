"""Typed views of the Kubernetes objects destination reads, parsed once at the edge (pure)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshlet.api import wellknown
from meshlet.api.ports import PortRanges, scan_ports

log = logging.getLogger(__name__)

Labels = Mapping[str, str]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


DEFAULT_OPAQUE_PORTS = PortRanges.of(wellknown.DEFAULT_OPAQUE_PORTS)


def parse_port_set(text: str) -> PortRanges:
    """`"3306,5000-5010"` → the ports (the one port-list grammar); junk items are skipped with
    a log line: a cluster's annotation cannot be refused."""
    ports, problems = scan_ports(text)
    for problem in problems:
        log.warning("ignoring part of a port list: %.120s", problem)
    return ports


def _opaque_ports(annotations: Mapping[str, str]) -> PortRanges:
    text = annotations.get(wellknown.OPAQUE_PORTS_ANNOTATION)
    return DEFAULT_OPAQUE_PORTS if text is None else parse_port_set(text)


def _meta(obj: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or "", meta


@dataclass(frozen=True, slots=True)
class ServicePort:
    port: int
    name: str
    target_port: int | str  # a number or a container port name


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    cluster_ips: tuple[str, ...]
    ports: tuple[ServicePort, ...]
    selector: tuple[tuple[str, str], ...] | None
    opaque_ports: PortRanges
    external_name: str | None

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def port(self, number: int) -> ServicePort:
        """The service port `number`; a port the service does not list targets itself."""
        for port in self.ports:
            if port.port == number:
                return port
        return ServicePort(number, "", number)


def parse_service(obj: Mapping[str, Any]) -> Service:
    ns, name, meta = _meta(obj)
    spec = obj.get("spec") or {}
    ips = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip and ip != "None"]
    ports = tuple(
        ServicePort(
            port=int(p["port"]),
            name=p.get("name") or "",
            target_port=p.get("targetPort") or int(p["port"]),
        )
        for p in spec.get("ports") or []
        if isinstance(p, Mapping) and isinstance(p.get("port"), int)
    )
    selector = spec.get("selector")
    return Service(
        namespace=ns,
        name=name,
        cluster_ips=tuple(ips),
        ports=ports,
        selector=tuple(sorted(selector.items())) if isinstance(selector, Mapping) else None,
        opaque_ports=_opaque_ports(meta.get("annotations") or {}),
        external_name=spec.get("externalName") if spec.get("type") == "ExternalName" else None,
    )


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    ip: str | None
    labels: tuple[tuple[str, str], ...]
    service_account: str
    node_name: str
    owner_kind: str | None  # "deployment", "statefulset", … (lower case, as metric label)
    owner_name: str | None
    control_plane_ns: str | None  # set on meshed pods
    opaque_ports: PortRanges
    container_ports: tuple[tuple[str, int], ...]  # named ports
    terminating: bool
    # every address of the pod (status.podIPs: a dual-stack pod has an IPv4 and an IPv6 one),
    # the primary `ip` first, in the canonical text ipaddress prints
    ips: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def matches(self, selector: tuple[tuple[str, str], ...]) -> bool:
        labels = dict(self.labels)
        return bool(selector) and all(labels.get(k) == v for k, v in selector)

    def named_port(self, name: str) -> int | None:
        return dict(self.container_ports).get(name)


def _owner(meta: Mapping[str, Any], labels: Labels) -> tuple[str | None, str | None]:
    for ref in meta.get("ownerReferences") or []:
        if not isinstance(ref, Mapping) or not ref.get("controller", True):
            continue
        kind, name = str(ref.get("kind", "")), str(ref.get("name", ""))
        if kind == "ReplicaSet":
            template_hash = labels.get("pod-template-hash")
            if template_hash and name.endswith("-" + template_hash):
                return "deployment", name[: -len(template_hash) - 1]
            return "replicaset", name
        if kind:
            return kind.lower(), name
    return None, None


def parse_pod(obj: Mapping[str, Any]) -> Pod:
    ns, name, meta = _meta(obj)
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    owner_kind, owner_name = _owner(meta, labels)
    named = [
        (str(p["name"]), int(p["containerPort"]))
        for c in spec.get("containers") or []
        for p in (c.get("ports") or [])
        if isinstance(p, Mapping) and p.get("name") and isinstance(p.get("containerPort"), int)
    ]
    return Pod(
        namespace=ns,
        name=name,
        ip=status.get("podIP") or None,
        labels=tuple(sorted(labels.items())),
        service_account=spec.get("serviceAccountName") or "default",
        node_name=spec.get("nodeName") or "",
        owner_kind=owner_kind,
        owner_name=owner_name,
        control_plane_ns=labels.get(wellknown.CONTROL_PLANE_NS_LABEL),
        opaque_ports=_opaque_ports(meta.get("annotations") or {}),
        container_ports=tuple(named),
        terminating=bool(meta.get("deletionTimestamp"))
        or status.get("phase") in ("Succeeded", "Failed"),
        ips=_pod_ips(status),
    )


def _pod_ips(status: Mapping[str, Any]) -> tuple[str, ...]:
    """status.podIP and each status.podIPs[].ip, canonical, without repeats; what does not
    parse as an IP address is left out."""
    found: list[str] = []
    listed = [item.get("ip") for item in status.get("podIPs") or [] if isinstance(item, Mapping)]
    for raw in (status.get("podIP"), *listed):
        try:
            found.append(ipaddress.ip_address(str(raw)).compressed)
        except ValueError:
            continue
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    addresses: tuple[str, ...]
    ready: bool
    pod: str | None  # targetRef name when it is a Pod
    zone: str


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service: str | None
    ports: tuple[tuple[str, int], ...]  # (service port name, target port)
    endpoints: tuple[SliceEndpoint, ...]

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


def parse_endpoint_slice(obj: Mapping[str, Any]) -> EndpointSlice:
    ns, name, meta = _meta(obj)
    endpoints = []
    for ep in obj.get("endpoints") or []:
        if not isinstance(ep, Mapping):
            continue
        conditions = ep.get("conditions") or {}
        ref = ep.get("targetRef") or {}
        endpoints.append(
            SliceEndpoint(
                addresses=tuple(str(a) for a in ep.get("addresses") or []),
                # Kubernetes: a nil `ready` means ready; a terminating endpoint is not ready.
                ready=conditions.get("ready") is not False,
                pod=ref.get("name") if ref.get("kind") == "Pod" else None,
                zone=ep.get("zone") or "",
            )
        )
    return EndpointSlice(
        namespace=ns,
        name=name,
        service=(meta.get("labels") or {}).get(SERVICE_NAME_LABEL),
        ports=tuple(
            (p.get("name") or "", int(p["port"]))
            for p in obj.get("ports") or []
            if isinstance(p, Mapping) and isinstance(p.get("port"), int)
        ),
        endpoints=tuple(endpoints),
    )
