"""The cluster state destination answers from: parsed objects and their indexes."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from meshlet.api import wellknown
from meshlet.controlplane.destination import model
from meshlet.controlplane.k8s.events import Delete, Event, Kind, Object, Snapshot, Upsert

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class Affected:
    """Services whose answers may have changed; `everything` after a snapshot."""

    services: frozenset[Key] = frozenset()
    namespaces: frozenset[str] = frozenset()
    everything: bool = False

    def touches(self, key: Key) -> bool:
        return self.everything or key in self.services or key[0] in self.namespaces


@dataclass
class ClusterState:
    cluster_domain: str = wellknown.CLUSTER_DOMAIN
    services: dict[Key, model.Service] = field(default_factory=dict)
    slices: dict[Key, model.EndpointSlice] = field(default_factory=dict)
    pods: dict[Key, model.Pod] = field(default_factory=dict)
    profiles: dict[Key, Mapping[str, Any]] = field(default_factory=dict)  # ServiceProfile specs
    _slices_by_service: defaultdict[Key, set[Key]] = field(default_factory=lambda: defaultdict(set))
    _pods_by_namespace: defaultdict[str, set[Key]] = field(default_factory=lambda: defaultdict(set))
    _pods_by_ip: dict[str, Key] = field(default_factory=dict)
    _services_by_ip: dict[str, Key] = field(default_factory=dict)

    # Reads

    def slices_of(self, key: Key) -> list[model.EndpointSlice]:
        return [self.slices[k] for k in sorted(self._slices_by_service.get(key, ()))]

    def pod_named(self, namespace: str, name: str) -> model.Pod | None:
        return self.pods.get((namespace, name))

    def pods_in(self, namespace: str) -> Iterable[model.Pod]:
        return [self.pods[k] for k in self._pods_by_namespace.get(namespace, ())]

    def service_at(self, ip: str) -> model.Service | None:
        key = self._services_by_ip.get(ip)
        return self.services.get(key) if key else None

    def profile_of(self, service: Key) -> Mapping[str, Any] | None:
        """The spec of ServiceProfile `<svc>.<ns>.svc.<cluster-domain>`, if any."""
        name = f"{service[1]}.{service[0]}.svc.{self.cluster_domain}"
        return self.profiles.get((service[0], name))

    def pod_at(self, ip: str) -> model.Pod | None:
        key = self._pods_by_ip.get(ip)
        return self.pods.get(key) if key else None

    # Writes

    def apply(self, event: Event) -> Affected:
        if isinstance(event, Snapshot):
            for key in list(self._keys(event.kind)):
                self._remove(event.kind, key)
            for obj in event.objects:
                self._upsert(event.kind, obj)
            return Affected(everything=True)
        key = _key(event.obj)
        before = self._service_of(event.kind, key)
        if isinstance(event, Upsert):
            self._upsert(event.kind, event.obj)
        elif isinstance(event, Delete):
            self._remove(event.kind, key)
        after = self._service_of(event.kind, key)
        if event.kind is Kind.POD:
            return Affected(namespaces=frozenset({key[0]}))
        return Affected(services=frozenset(k for k in (before, after) if k is not None))

    def _keys(self, kind: Kind) -> list[Key]:
        if kind is Kind.SERVICE:
            return list(self.services)
        if kind is Kind.ENDPOINT_SLICE:
            return list(self.slices)
        if kind is Kind.POD:
            return list(self.pods)
        return list(self.profiles)

    def _service_of(self, kind: Kind, key: Key) -> Key | None:
        if kind is Kind.SERVICE:
            return key
        if kind is Kind.ENDPOINT_SLICE:
            endpoint_slice = self.slices.get(key)
            return (
                (key[0], endpoint_slice.service)
                if endpoint_slice and endpoint_slice.service
                else None
            )
        if kind is Kind.SERVICE_PROFILE:
            return self._profile_service(key)
        return None

    def _profile_service(self, key: Key) -> Key | None:
        """A ServiceProfile named `<svc>.<ns>.svc.<cluster-domain>` is the profile of svc."""
        suffix = f".{key[0]}.svc.{self.cluster_domain}"
        return (key[0], key[1][: -len(suffix)]) if key[1].endswith(suffix) else None

    def _upsert(self, kind: Kind, obj: Object) -> None:
        key = _key(obj)
        self._remove(kind, key)
        try:
            parse: Callable[[Object], None] = {
                Kind.SERVICE: self._add_service,
                Kind.ENDPOINT_SLICE: self._add_slice,
                Kind.POD: self._add_pod,
                Kind.SERVICE_PROFILE: self._add_profile,
            }[kind]
            parse(obj)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("ignoring malformed %s %s/%s: %s", kind.kind, key[0], key[1], exc)

    def _add_service(self, obj: Object) -> None:
        service = model.parse_service(obj)
        self.services[service.key] = service
        for ip in service.cluster_ips:
            self._services_by_ip[ip] = service.key

    def _add_slice(self, obj: Object) -> None:
        endpoint_slice = model.parse_endpoint_slice(obj)
        self.slices[endpoint_slice.key] = endpoint_slice
        if endpoint_slice.service:
            self._slices_by_service[(endpoint_slice.namespace, endpoint_slice.service)].add(
                endpoint_slice.key
            )

    def _add_pod(self, obj: Object) -> None:
        pod = model.parse_pod(obj)
        self.pods[pod.key] = pod
        self._pods_by_namespace[pod.namespace].add(pod.key)
        if not pod.terminating:
            for ip in pod.ips:
                self._pods_by_ip[ip] = pod.key

    def _add_profile(self, obj: Object) -> None:
        key = _key(obj)
        if self._profile_service(key) is None:
            raise ValueError(f"name must be <service>.<namespace>.svc.{self.cluster_domain}")
        spec = obj.get("spec")
        if not isinstance(spec, Mapping):
            raise ValueError("spec must be a mapping")
        self.profiles[key] = spec

    def _remove(self, kind: Kind, key: Key) -> None:
        if kind is Kind.SERVICE:
            service = self.services.pop(key, None)
            for ip in service.cluster_ips if service else ():
                if self._services_by_ip.get(ip) == key:
                    del self._services_by_ip[ip]
        elif kind is Kind.ENDPOINT_SLICE:
            endpoint_slice = self.slices.pop(key, None)
            if endpoint_slice and endpoint_slice.service:
                owner = (key[0], endpoint_slice.service)
                self._slices_by_service[owner].discard(key)
                if not self._slices_by_service[owner]:
                    del self._slices_by_service[owner]
        elif kind is Kind.POD:
            pod = self.pods.pop(key, None)
            if pod is not None:
                self._pods_by_namespace[key[0]].discard(key)
                for ip in pod.ips:
                    if self._pods_by_ip.get(ip) == key:
                        del self._pods_by_ip[ip]
        else:
            self.profiles.pop(key, None)


def _key(obj: Object) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or ""
