"""What a source of cluster state emits: snapshots and changes of the kinds the controllers read.

Each controller watches its own subset (`DESTINATION_KINDS`, `POLICY_KINDS`); a source is given
the subset it feeds."""

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
    NAMESPACE = ("v1", "Namespace", "namespaces")
    SERVER = ("policy.meshlet.io/v1beta3", "Server", "servers")
    AUTHORIZATION_POLICY = (
        "policy.meshlet.io/v1alpha1", "AuthorizationPolicy", "authorizationpolicies",
    )  # fmt: skip
    MESH_TLS_AUTHENTICATION = (
        "policy.meshlet.io/v1alpha1", "MeshTLSAuthentication", "meshtlsauthentications",
    )  # fmt: skip
    NETWORK_AUTHENTICATION = (
        "policy.meshlet.io/v1alpha1", "NetworkAuthentication", "networkauthentications",
    )  # fmt: skip
    HTTP_ROUTE = ("policy.meshlet.io/v1beta3", "HTTPRoute", "httproutes")
    GATEWAY_HTTP_ROUTE = ("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes")
    GRPC_ROUTE = ("policy.meshlet.io/v1", "GRPCRoute", "grpcroutes")
    GATEWAY_GRPC_ROUTE = ("gateway.networking.k8s.io/v1", "GRPCRoute", "grpcroutes")
    RATE_LIMIT_POLICY = (
        "policy.meshlet.io/v1alpha1", "HTTPLocalRateLimitPolicy", "httplocalratelimitpolicies",
    )  # fmt: skip

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


DESTINATION_KINDS: tuple[Kind, ...] = (
    Kind.SERVICE, Kind.ENDPOINT_SLICE, Kind.POD, Kind.SERVICE_PROFILE,
)  # fmt: skip
POLICY_KINDS: tuple[Kind, ...] = (
    Kind.NAMESPACE,
    Kind.POD,
    Kind.SERVER,
    Kind.AUTHORIZATION_POLICY,
    Kind.MESH_TLS_AUTHENTICATION,
    Kind.NETWORK_AUTHENTICATION,
    Kind.HTTP_ROUTE,
    Kind.GATEWAY_HTTP_ROUTE,
    Kind.GRPC_ROUTE,
    Kind.GATEWAY_GRPC_ROUTE,
    Kind.RATE_LIMIT_POLICY,
)
# What the policy controller watches: inbound policy's kinds, Services for outbound policy, and
# ServiceProfiles to say on a route's status that a profile shadows it.
POLICY_SERVER_KINDS: tuple[Kind, ...] = (Kind.SERVICE, Kind.SERVICE_PROFILE, *POLICY_KINDS)

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
