"""What a source of cluster state emits: snapshots and changes of the kinds destination reads."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Kind(enum.Enum):
    """The watched kinds: (apiVersion, kind, plural)."""

    SERVICE = ("v1", "Service", "services")
    ENDPOINT_SLICE = ("discovery.k8s.io/v1", "EndpointSlice", "endpointslices")
    POD = ("v1", "Pod", "pods")
    SERVICE_PROFILE = ("meshlet.io/v1alpha1", "ServiceProfile", "serviceprofiles")

    @property
    def api_version(self) -> str:
        return self.value[0]

    @property
    def kind(self) -> str:
        return self.value[1]

    @property
    def plural(self) -> str:
        return self.value[2]

    @classmethod
    def of(cls, api_version: str, kind: str) -> Kind | None:
        for member in cls:
            if member.api_version == api_version and member.kind == kind:
                return member
        return None


Object = dict[str, Any]  # a Kubernetes object as JSON


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every object of `kind` (after a list or relist): replaces what was known of the kind."""

    kind: Kind
    objects: tuple[Object, ...]


@dataclass(frozen=True, slots=True)
class Upsert:
    kind: Kind
    obj: Object


@dataclass(frozen=True, slots=True)
class Delete:
    kind: Kind
    obj: Object


Event = Snapshot | Upsert | Delete
Sink = Callable[[Event], None]


class Source(Protocol):
    """Feeds events to `sink`, always on the event loop that runs `run`. The first event of
    each kind is a Snapshot; `synced` turns true once every kind has had one."""

    @property
    def synced(self) -> bool: ...

    async def run(self, sink: Sink) -> None:
        """Runs until cancelled."""
        ...
