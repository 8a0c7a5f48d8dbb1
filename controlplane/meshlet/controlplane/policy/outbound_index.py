"""Owns the outbound state: the cluster's Services (their routes are the catalog's, read once
and shared with the inbound index) and the `OutboundPolicy` of each watched (namespace, service,
port, client namespace), recomputed when something it depends on changes and published only when
its bytes change; and what a proxy asks for, a Service's authority or one of its cluster IPs
(`parse_authority`, `parse_addr`)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from meshlet.api import net_pb2, outbound_pb2, wellknown
from meshlet.controlplane.k8s.events import Event, Kind, Object, Snapshot, Upsert
from meshlet.controlplane.policy.catalog import ROUTE_KINDS, Catalog, object_key
from meshlet.controlplane.policy.mailbox import Mailbox
from meshlet.controlplane.policy.outbound import Key, Service, Space, Translator, service_of
from meshlet.controlplane.policy.routes import Route

log = logging.getLogger(__name__)

W = wellknown
DEFAULT_AUTHORITY_PORT: Final = 80


# -- targets ---------------------------------------------------------------------------------


class TargetError(ValueError):
    """A TrafficSpec target that is malformed (INVALID_ARGUMENT)."""


def parse_authority(text: str, cluster_domain: str) -> tuple[str, str, int] | None:
    """(namespace, service, port) of `name.ns.svc[.cluster-domain][:port]` (port 80 when
    absent); None when the host is not a Service's name (Linkerd: NOT_FOUND); TargetError
    when it is not an authority at all."""
    if not text or len(text) > 512 or any(ch in text for ch in "/?#@ \t"):
        raise TargetError(f"invalid authority: {text[:80]!r}")
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    port = DEFAULT_AUTHORITY_PORT
    if sep:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise TargetError(f"invalid authority: {text!r} has no port in 1..65535")
        port = int(port_text)
    host = host.rstrip(".").lower()
    suffix = "." + cluster_domain
    if host.endswith(suffix):
        host = host[: -len(suffix)]
    parts = host.split(".")
    if len(parts) != 3 or parts[2] != "svc" or not parts[0] or not parts[1]:
        return None
    return parts[1], parts[0], port


def parse_addr(addr: net_pb2.TcpAddress) -> tuple[str, int]:
    """(IP text, port) of a TcpAddress; TargetError when it has no IP or a bad port."""
    if not 1 <= addr.port <= 65535:
        raise TargetError(f"invalid port: {addr.port}; expected 1..65535")
    which = addr.ip.WhichOneof("ip") if addr.HasField("ip") else None
    if which == "ipv4":
        return str(ipaddress.IPv4Address(addr.ip.ipv4)), addr.port
    if which == "ipv6":
        value = (addr.ip.ipv6.first << 64) | addr.ip.ipv6.last
        return str(ipaddress.IPv6Address(value)), addr.port
    raise TargetError("invalid target: the address has no IP")


# -- the index (state and watches) -----------------------------------------------------------

WatchKey = tuple[str, str, int, str]  # (namespace, service, port, client namespace)


@dataclass(slots=True)
class _Watch:
    message: bytes
    backends: frozenset[Key]  # the other Services its policy depends on
    mailboxes: set[Mailbox] = field(default_factory=set)


class OutboundIndex:
    """Applies source events (Services and routes; other kinds are ignored); answers `get`
    and keeps `subscribe`d mailboxes current. The routes are `catalog`'s (its own, or one
    shared with the inbound index)."""

    def __init__(self, cluster_domain: str = W.CLUSTER_DOMAIN, catalog: Catalog | None = None
                 ) -> None:  # fmt: skip
        self.cluster_domain = cluster_domain
        self._own_catalog = catalog is None
        self.catalog = catalog or Catalog()
        self.spaces: dict[str, Space] = {}
        self.translator = Translator(cluster_domain, self.spaces)
        self._watches: dict[WatchKey, _Watch] = {}
        self._by_ip: dict[str, Key] = {}
        self.recomputed = 0  # watches recomputed (for tests and metrics)
        self._reported: dict[tuple[str, str], tuple[str, ...]] = {}
        self._services_invalid = 0

    @property
    def invalid(self) -> int:
        """Services whose annotations were ignored, and, when the catalog is this index's
        own, the routes ignored (a shared catalog counts them once, for both indexes)."""
        return self._services_invalid + (self.catalog.invalid if self._own_catalog else 0)

    # -- questions --

    def service(self, namespace: str, name: str) -> Service | None:
        space = self.spaces.get(namespace)
        return space.services.get(name) if space is not None else None

    def by_ip(self, ip: str) -> Service | None:
        key = self._by_ip.get(ip)
        return self.service(*key) if key is not None else None

    def get(
        self, namespace: str, name: str, port: int, client_ns: str = ""
    ) -> outbound_pb2.OutboundPolicy | None:
        """The policy of a Service port for clients in `client_ns` (default: its own)."""
        svc = self.service(namespace, name)
        return self.translator.policy(svc, port, client_ns) if svc is not None else None

    def subscribe(
        self, namespace: str, name: str, port: int, mailbox: Mailbox, client_ns: str = ""
    ) -> bool:
        """Puts the port's policy in `mailbox` now and at each change; False: no such Service."""
        svc = self.service(namespace, name)
        if svc is None:
            return False
        key = (namespace, name, port, client_ns or namespace)
        watch = self._watches.get(key)
        if watch is None:
            policy = self.translator.policy(svc, port, key[3])
            backends = self.translator.backends(svc, port, key[3])
            watch = _Watch(policy.SerializeToString(deterministic=True), backends)
            self._watches[key] = watch
        watch.mailboxes.add(mailbox)
        mailbox.put(watch.message)
        return True

    def unsubscribe(
        self, namespace: str, name: str, port: int, mailbox: Mailbox, client_ns: str = ""
    ) -> None:
        key = (namespace, name, port, client_ns or namespace)
        watch = self._watches.get(key)
        if watch is None:
            return
        watch.mailboxes.discard(mailbox)
        if not watch.mailboxes:
            del self._watches[key]

    @property
    def watched(self) -> int:
        return len(self._watches)

    # -- changes --

    def apply(self, event: Event) -> int:
        """Applies a source event; the number of watches whose policy changed."""
        if event.kind in ROUTE_KINDS:
            return self._routes(event)
        if event.kind is not Kind.SERVICE:
            return 0
        if isinstance(event, Snapshot):
            seen = set()
            for obj in event.objects:
                self._upsert_service(obj)
                key = object_key(obj)
                if key is not None:
                    seen.add(key)
            for namespace, space in list(self.spaces.items()):
                for name in [n for n in space.services if (namespace, n) not in seen]:
                    self._remove_service(namespace, name)
            return self._refresh(None)
        key = object_key(event.obj)
        if key is None:
            return 0
        if isinstance(event, Upsert):
            if not self._upsert_service(event.obj):
                return 0
        else:
            self._remove_service(*key)
        # its own watches, and those routing to it
        return self._refresh(lambda w, watch: w[:2] == key or key in watch.backends)

    def _routes(self, event: Event) -> int:
        """A route's change (the catalog's reading of it, shared): filed under the Services it
        names; the watches of its namespace's Services and of clients there recomputed."""
        changes = self.catalog.apply(event)
        for change in changes:
            space = self.spaces.setdefault(change.namespace, Space())
            key = (change.kind, change.name)
            if isinstance(change.before, Route):
                space.drop(key, change.before)
            if isinstance(change.after, Route):
                space.put(key, change.after)
        if not changes:
            return 0  # a route read the same (its status written, say): nothing to do
        if isinstance(event, Snapshot):
            return self._refresh(None)
        touched = {change.namespace for change in changes}
        return self._refresh(lambda w, _: w[0] in touched or w[3] in touched)

    def _upsert_service(self, obj: Object) -> bool:
        key = object_key(obj)
        svc = service_of(obj) if key is not None else None
        if key is None or svc is None:
            return False
        namespace, name = key
        space = self.spaces.setdefault(namespace, Space())
        if svc.problems:
            self._report(namespace, name, list(svc.problems))
        else:
            self._reported.pop((namespace, name), None)
        self._forget_ips(space.services.get(name))
        space.services[name] = svc
        self._by_ip.update((ip, key) for ip in svc.cluster_ips)
        return True

    def _remove_service(self, namespace: str, name: str) -> None:
        space = self.spaces.get(namespace)
        if space is None:
            return
        gone = space.services.pop(name, None)
        self._forget_ips(gone)
        if gone is not None:
            for key in [k for k in self._watches if k[:2] == (namespace, name)]:
                for mailbox in self._watches.pop(key).mailboxes:
                    mailbox.close()

    def _forget_ips(self, svc: Service | None) -> None:
        if svc is None:
            return
        for ip in svc.cluster_ips:
            if self._by_ip.get(ip) == (svc.namespace, svc.name):
                del self._by_ip[ip]

    def _refresh(self, affects: Callable[[WatchKey, _Watch], bool] | None) -> int:
        """Recomputes the watches `affects` names (None: all); publishes the changed ones."""
        changed = 0
        for key, watch in self._watches.items():
            if affects is not None and not affects(key, watch):
                continue
            namespace, name, port, client_ns = key
            svc = self.service(namespace, name)
            if svc is None:
                continue
            self.recomputed += 1
            watch.backends = self.translator.backends(svc, port, client_ns)
            policy = self.translator.policy(svc, port, client_ns)
            message = policy.SerializeToString(deterministic=True)
            if message == watch.message:
                continue
            watch.message = message
            changed += 1
            for mailbox in watch.mailboxes:
                mailbox.put(message)
        return changed

    def _report(self, namespace: str, name: str, problems: list[str]) -> None:
        key = (namespace, name)
        if self._reported.get(key) == tuple(problems):
            return
        self._reported[key] = tuple(problems)
        self._services_invalid += 1
        log.warning("ignored annotations of Service %s/%s: %s", namespace, name,
                    "; ".join(problems))  # fmt: skip
