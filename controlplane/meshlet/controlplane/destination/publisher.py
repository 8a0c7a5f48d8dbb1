"""Publishers: one per watched service port or profile target, fanning changes to listeners."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from meshlet.api import destination_pb2, wellknown
from meshlet.controlplane.destination import profiles
from meshlet.controlplane.destination.endpoints import Resolution, endpoint_for, resolve
from meshlet.controlplane.destination.listener import Listener
from meshlet.controlplane.destination.model import DEFAULT_OPAQUE_PORTS
from meshlet.controlplane.destination.paths import IPPort, ServiceName
from meshlet.controlplane.destination.state import Affected, ClusterState, Key
from meshlet.controlplane.destination.translator import updates, weighted_addr

log = logging.getLogger(__name__)

Profile = destination_pb2.DestinationProfile


class _Publisher:
    """Fans serialized messages out to its listeners."""

    def __init__(self) -> None:
        self.listeners: set[Listener[bytes]] = set()

    def _broadcast(self, messages: list[bytes]) -> None:
        for listener in list(self.listeners):
            listener.offer(messages)


class EndpointPublisher(_Publisher):
    """The endpoints of one service port."""

    def __init__(self, target: ServiceName, state: ClusterState, derive_from_pods: bool) -> None:
        super().__init__()
        self.target = target
        self._state = state
        self._derive = derive_from_pods
        self._labels = {"service": target.name, "namespace": target.namespace}
        self.current = self._resolve()

    @property
    def service(self) -> Key:
        return self.target.namespace, self.target.name

    def _resolve(self) -> Resolution:
        state = self._state
        return resolve(
            state.services.get(self.service),
            self.target.port,
            state.slices_of(self.service),
            state.pod_named,
            state.pods_in,
            derive_from_pods=self._derive,
        )

    def subscribe(self, listener: Listener[bytes]) -> None:
        listener.offer([m.SerializeToString() for m in updates(None, self.current, self._labels)])
        self.listeners.add(listener)

    def refresh(self) -> None:
        new = self._resolve()
        messages = updates(self.current, new, self._labels)
        self.current = new
        # Serialized once here, not once per stream: a hot service may have thousands.
        self._broadcast([m.SerializeToString() for m in messages])


class ProfilePublisher(_Publisher):
    """The profile of a service port (by name or ClusterIP) or of a pod IP."""

    def __init__(self, target: ServiceName | IPPort, state: ClusterState) -> None:
        super().__init__()
        self.target = target
        self._state = state
        self.current = self._compute()
        self._wire = self.current.SerializeToString(deterministic=True)

    def _compute(self) -> Profile:
        state, target = self._state, self.target
        if isinstance(target, ServiceName):
            return self._service_profile((target.namespace, target.name), target.port)
        ip = str(target.ip)
        service = state.service_at(ip)
        if service is not None:
            return self._service_profile(service.key, target.port)
        pod = state.pod_at(ip)
        if pod is not None:
            endpoint = endpoint_for(ip, target.port, pod, "", False, wellknown.TRUST_DOMAIN)
            profile = profiles.default_profile("", opaque=endpoint.opaque)
            profile.endpoint.CopyFrom(weighted_addr(endpoint))
            return profile
        return profiles.default_profile("", opaque=target.port in wellknown.DEFAULT_OPAQUE_PORTS)

    def _service_profile(self, key: Key, port: int) -> Profile:
        state = self._state
        service = state.services.get(key)
        fqn = f"{key[1]}.{key[0]}.svc.{state.cluster_domain}"
        opaque = port in (service.opaque_ports if service else DEFAULT_OPAQUE_PORTS)
        spec = state.profile_of(key)
        if spec is None:
            return profiles.default_profile(fqn, opaque=opaque)
        profile, error = profiles.profile_or_default(spec, fqn=fqn, opaque=opaque, port=port)
        if error:
            log.warning("ServiceProfile of %s is invalid, serving the default: %s", fqn, error)
        return profile

    def subscribe(self, listener: Listener[bytes]) -> None:
        listener.offer([self._wire])
        self.listeners.add(listener)

    def refresh(self) -> None:
        new = self._compute()
        wire = new.SerializeToString(deterministic=True)
        if wire != self._wire:
            self.current, self._wire = new, wire
            self._broadcast([wire])


@dataclass(frozen=True, slots=True)
class Subscription:
    listener: Listener[bytes]
    close: Callable[[], None]


class Publishers:
    """Owns the publishers of watched targets; applies cluster events to state, then refreshes
    the publishers the event may have changed."""

    def __init__(self, state: ClusterState, *, derive_from_pods: bool, capacity: int) -> None:
        self.state = state
        self._derive = derive_from_pods
        self._capacity = capacity
        self._endpoints: dict[ServiceName, EndpointPublisher] = {}
        self._profiles: dict[ServiceName | IPPort, ProfilePublisher] = {}

    def refresh(self, affected: Affected) -> None:
        for publisher in list(self._endpoints.values()):
            if affected.touches(publisher.service):
                publisher.refresh()
        for profile in list(self._profiles.values()):
            target = profile.target
            if isinstance(target, IPPort) or affected.touches((target.namespace, target.name)):
                profile.refresh()

    def endpoints(
        self, target: ServiceName, on_overflow: Callable[[], None] | None = None
    ) -> Subscription:
        publisher = self._endpoints.get(target)
        if publisher is None:
            publisher = self._endpoints[target] = EndpointPublisher(
                target, self.state, self._derive
            )
        listener: Listener[bytes] = Listener(self._capacity, on_overflow)
        publisher.subscribe(listener)

        def close() -> None:
            publisher.listeners.discard(listener)
            if not publisher.listeners and self._endpoints.get(target) is publisher:
                del self._endpoints[target]

        return Subscription(listener, close)

    def profile(
        self, target: ServiceName | IPPort, on_overflow: Callable[[], None] | None = None
    ) -> Subscription:
        publisher = self._profiles.get(target)
        if publisher is None:
            publisher = self._profiles[target] = ProfilePublisher(target, self.state)
        listener: Listener[bytes] = Listener(self._capacity, on_overflow)
        publisher.subscribe(listener)

        def close() -> None:
            publisher.listeners.discard(listener)
            if not publisher.listeners and self._profiles.get(target) is publisher:
                del self._profiles[target]

        return Subscription(listener, close)

    @property
    def counts(self) -> tuple[int, int]:
        return len(self._endpoints), len(self._profiles)
