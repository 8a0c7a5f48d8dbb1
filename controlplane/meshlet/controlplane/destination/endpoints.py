"""Which endpoints a service port has, with the metadata proxies need (pure)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from meshlet.api import wellknown
from meshlet.controlplane.destination.model import EndpointSlice, Pod, Service

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Endpoint:
    ip: str
    port: int
    labels: tuple[tuple[str, str], ...]  # pod, <owner-kind>, serviceaccount, zone
    identity: str | None  # meshed pods only
    opaque: bool

    @property
    def address(self) -> Address:
        return self.ip, self.port


@dataclass(frozen=True, slots=True)
class Resolution:
    """What a Get stream reports: whether the service exists, and its ready endpoints."""

    exists: bool
    endpoints: Mapping[Address, Endpoint] = field(default_factory=dict)


UNKNOWN = Resolution(exists=False)


def endpoint_for(
    ip: str,
    port: int,
    pod: Pod | None,
    zone: str,
    service_opaque: bool,
    trust_domain: str,
) -> Endpoint:
    labels: list[tuple[str, str]] = []
    identity = None
    opaque = service_opaque
    if pod is not None:
        labels.append(("pod", pod.name))
        if pod.owner_kind and pod.owner_name:
            labels.append((pod.owner_kind, pod.owner_name))
        labels.append(("serviceaccount", pod.service_account))
        if pod.control_plane_ns:
            identity = wellknown.identity_name(
                pod.service_account, pod.namespace, pod.control_plane_ns, trust_domain
            )
        opaque = opaque or port in pod.opaque_ports
    else:
        opaque = opaque or port in wellknown.DEFAULT_OPAQUE_PORTS
    if zone:
        labels.append(("zone", zone))
    return Endpoint(ip, port, tuple(sorted(labels)), identity, opaque)


def _valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def resolve(
    service: Service | None,
    port: int,
    slices: Iterable[EndpointSlice],
    pod_named: Callable[[str, str], Pod | None],
    pods_in_namespace: Callable[[str], Iterable[Pod]],
    *,
    derive_from_pods: bool,
    trust_domain: str = wellknown.TRUST_DOMAIN,
) -> Resolution:
    """The ready endpoints of `service` on service port `port`.

    EndpointSlices are the truth; with `derive_from_pods` (the manifests source) a service
    without slices gets its endpoints from its selector and the Pods' IPs, as the Kubernetes
    endpoints controller would.
    """
    if service is None:
        return UNKNOWN
    if service.external_name is not None:
        return Resolution(exists=True)
    service_port = service.port(port)
    service_opaque = port in service.opaque_ports
    found: dict[Address, Endpoint] = {}
    slices = list(slices)
    for endpoint_slice in slices:
        target = dict(endpoint_slice.ports).get(service_port.name)
        if target is None:
            continue
        for ep in endpoint_slice.endpoints:
            if not ep.ready:
                continue
            pod = pod_named(endpoint_slice.namespace, ep.pod) if ep.pod else None
            for ip in ep.addresses:
                if _valid_ip(ip):
                    found[(ip, target)] = endpoint_for(
                        ip, target, pod, ep.zone, service_opaque, trust_domain
                    )
    if not slices and derive_from_pods and service.selector:
        for pod in pods_in_namespace(service.namespace):
            if pod.ip is None or pod.terminating or not pod.matches(service.selector):
                continue
            target_port = service_port.target_port
            number = pod.named_port(target_port) if isinstance(target_port, str) else target_port
            if number is not None and _valid_ip(pod.ip):
                found[(pod.ip, number)] = endpoint_for(
                    pod.ip, number, pod, "", service_opaque, trust_domain
                )
    return Resolution(exists=True, endpoints=found)
