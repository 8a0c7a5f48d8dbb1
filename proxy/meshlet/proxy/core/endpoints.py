"""Endpoints as the proxy sees them: typed values (decoded from `WeightedAddr` by
`discovery/decode.py`), and the set that a `Get` stream builds (pure: no I/O, no clock).

Stream rules (DESIGN §4), applied by `EndpointSet.apply`:

- `Add` upserts by address (a changed endpoint replaces the old one), `Remove` deletes (an
  address not in the set is ignored), `NoEndpoints(exists)` empties the set and records whether
  the service exists. `Add` and `Remove` imply that it does.
- The first message of a new stream (`first=True`) replaces whatever earlier streams built:
  after a reconnect the cache is replaced, never merged. A stream that breaks changes nothing:
  the last known endpoints stay until the next stream's first message.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from meshlet.api.hostport import HostPort

Addr = HostPort  # (IP literal, port), as the proxy connects to it
Labels = tuple[tuple[str, str], ...]  # sorted by name


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
class DiscoveredEndpoint:
    addr: Addr
    weight: int
    labels: Labels  # set-level labels, overridden by per-address ones
    identity: TlsIdentity | None  # None: not meshed, plaintext
    hint: Hint | None
    opaque_transport_port: int | None  # the peer proxy's inbound port, for the transport header
    authority_override: str | None = None


@dataclass(frozen=True, slots=True)
class Add:
    endpoints: tuple[DiscoveredEndpoint, ...]
    rejected: tuple[str, ...] = ()  # why some addresses were left out


@dataclass(frozen=True, slots=True)
class Remove:
    addrs: tuple[Addr, ...]
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NoEndpoints:
    exists: bool


Update = Add | Remove | NoEndpoints


class Status(enum.Enum):
    PENDING = "pending"  # no answer yet
    READY = "ready"  # at least one endpoint
    EMPTY = "empty"  # the service exists without endpoints: fail fast
    UNKNOWN = "unknown"  # no such service: forward to the original destination


@dataclass(frozen=True, slots=True)
class EndpointSet:
    """An immutable snapshot; `apply` returns the next one. Equality ignores `version`."""

    endpoints: Mapping[Addr, DiscoveredEndpoint] = field(default_factory=dict)
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
        base: Mapping[Addr, DiscoveredEndpoint] = {} if first else self.endpoints
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
