"""Endpoints as the proxy sees them: typed values decoded from `WeightedAddr`, and the set that a
`Get` stream builds (pure: no I/O, no clock).

Stream rules (DESIGN §4), applied by `EndpointSet.apply`:

- `Add` upserts by address (a changed endpoint replaces the old one), `Remove` deletes (an
  address not in the set is ignored), `NoEndpoints(exists)` empties the set and records whether
  the service exists. `Add` and `Remove` imply that it does.
- The first message of a new stream (`first=True`) replaces whatever earlier streams built:
  after a reconnect the cache is replaced, never merged. A stream that breaks changes nothing:
  the last known endpoints stay until the next stream's first message.

Decoding never downgrades security: an address whose `tls_identity` is present but unusable is
rejected (reported in `Add.rejected`), never kept as a plaintext endpoint.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from meshlet.api import addr, destination_pb2, net_pb2
from meshlet.api.hostport import HostPort

Addr = HostPort  # (IP literal, port), as the proxy connects to it
Labels = tuple[tuple[str, str], ...]  # sorted by name


class DecodeError(ValueError):
    """A message that breaks the contract; the text says which field."""


class Hint(enum.Enum):
    """What the endpoint's proxy accepts (`ProtocolHint.protocol`)."""

    H2 = "h2"  # HTTP/2 between proxies
    OPAQUE = "opaque"  # opaque TCP only


@dataclass(frozen=True, slots=True)
class TlsIdentity:
    """The identity to verify (`name`) and the SNI to send (`server_name`)."""

    name: str
    server_name: str
    kind: Literal["dns", "uri"] = "dns"


@dataclass(frozen=True, slots=True)
class Endpoint:
    addr: Addr
    weight: int
    labels: Labels  # set-level labels, overridden by per-address ones
    identity: TlsIdentity | None  # None: not meshed, plaintext
    hint: Hint | None
    opaque_transport_port: int | None  # the peer proxy's inbound port, for the transport header
    authority_override: str | None = None


@dataclass(frozen=True, slots=True)
class Add:
    endpoints: tuple[Endpoint, ...]
    rejected: tuple[str, ...] = ()  # why some addresses were left out


@dataclass(frozen=True, slots=True)
class Remove:
    addrs: tuple[Addr, ...]
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NoEndpoints:
    exists: bool


Update = Add | Remove | NoEndpoints


def decode_addr(msg: net_pb2.TcpAddress) -> Addr:
    try:
        ip, port = addr.tcp_from_proto(msg)
    except ValueError as exc:
        raise DecodeError(f"address: {exc}") from None
    if not 1 <= port <= 65535:
        raise DecodeError(f"address {ip}: port {port} is not in 1-65535")
    return HostPort(str(ip), port)


def _identity(msg: destination_pb2.TlsIdentity) -> TlsIdentity:
    strategy = msg.WhichOneof("strategy")
    server_name = msg.server_name.name if msg.HasField("server_name") else ""
    if strategy == "dns_like_identity" and msg.dns_like_identity.name:
        name = msg.dns_like_identity.name
        return TlsIdentity(name, server_name or name)
    if strategy == "uri_like_identity" and msg.uri_like_identity.uri and server_name:
        return TlsIdentity(msg.uri_like_identity.uri, server_name, "uri")
    raise DecodeError("tls_identity is set without a usable name (or a URI without server_name)")


def decode_endpoint(msg: destination_pb2.WeightedAddr, set_labels: Mapping[str, str]) -> Endpoint:
    """One `WeightedAddr`; DecodeError when it cannot be used safely."""
    if not msg.HasField("addr"):
        raise DecodeError("WeightedAddr without addr")
    address = decode_addr(msg.addr)
    identity = _identity(msg.tls_identity) if msg.HasField("tls_identity") else None
    hint: Hint | None = None
    transport_port: int | None = None
    if msg.HasField("protocol_hint"):
        protocol = msg.protocol_hint.WhichOneof("protocol")
        hint = Hint.H2 if protocol == "h2" else Hint.OPAQUE if protocol == "opaque" else None
        if msg.protocol_hint.HasField("opaque_transport"):
            transport_port = msg.protocol_hint.opaque_transport.inbound_port
            if not 1 <= transport_port <= 65535:
                raise DecodeError(f"{address[0]}: opaque_transport port {transport_port}")
    override = msg.authority_override.authority_override or None
    return Endpoint(
        addr=address,
        weight=msg.weight,
        labels=tuple(sorted({**set_labels, **msg.metric_labels}.items())),
        identity=identity,
        hint=hint,
        opaque_transport_port=transport_port,
        authority_override=override,
    )


def _decode_all(
    items: Iterable[destination_pb2.WeightedAddr], set_labels: Mapping[str, str]
) -> tuple[tuple[Endpoint, ...], tuple[str, ...]]:
    endpoints, rejected = [], []
    for item in items:
        try:
            endpoints.append(decode_endpoint(item, set_labels))
        except DecodeError as exc:
            rejected.append(str(exc))
    return tuple(endpoints), tuple(rejected)


def decode_update(msg: destination_pb2.Update) -> Update:
    """An `Update`; malformed addresses are left out and named in `rejected`. DecodeError when no
    update is set at all."""
    kind = msg.WhichOneof("update")
    if kind == "add":
        endpoints, rejected = _decode_all(msg.add.addrs, msg.add.metric_labels)
        return Add(endpoints, rejected)
    if kind == "remove":
        addrs, problems = [], []
        for item in msg.remove.addrs:
            try:
                addrs.append(decode_addr(item))
            except DecodeError as exc:
                problems.append(str(exc))
        return Remove(tuple(addrs), tuple(problems))
    if kind == "no_endpoints":
        return NoEndpoints(msg.no_endpoints.exists)
    raise DecodeError("Update with no update set")


class Status(enum.Enum):
    PENDING = "pending"  # no answer yet
    READY = "ready"  # at least one endpoint
    EMPTY = "empty"  # the service exists without endpoints: fail fast
    UNKNOWN = "unknown"  # no such service: forward to the original destination


@dataclass(frozen=True, slots=True)
class EndpointSet:
    """An immutable snapshot; `apply` returns the next one. Equality ignores `version`."""

    endpoints: Mapping[Addr, Endpoint] = field(default_factory=dict)
    exists: bool | None = None  # None until the first message
    version: int = field(default=0, compare=False)  # +1 per applied update

    @property
    def status(self) -> Status:
        if self.exists is None:
            return Status.PENDING
        if self.endpoints:
            return Status.READY
        return Status.EMPTY if self.exists else Status.UNKNOWN

    def __len__(self) -> int:
        return len(self.endpoints)

    def apply(self, update: Update, *, first: bool = False) -> EndpointSet:
        """The set after `update`; with `first` (the first message of a new stream) earlier
        contents are dropped first."""
        base: Mapping[Addr, Endpoint] = {} if first else self.endpoints
        exists = None if first else self.exists
        version = self.version + 1
        if isinstance(update, Add):
            merged = dict(base)
            merged.update((ep.addr, ep) for ep in update.endpoints)
            return EndpointSet(merged, True, version)
        if isinstance(update, Remove):
            gone = set(update.addrs)
            kept = {a: ep for a, ep in base.items() if a not in gone}
            return EndpointSet(kept, True if exists is None else exists, version)
        return EndpointSet({}, update.exists, version)

    def replaced(self) -> EndpointSet:
        """An empty, pending set whose version continues this one's (a new stream path)."""
        return EndpointSet({}, None, self.version + 1)
