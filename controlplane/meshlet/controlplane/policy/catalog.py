"""Owns the policy resources as the controller holds them: every object of the policy kinds
(Servers, authorizations, authentications, routes, rate limits) read once (`resources.parse`)
into its one model, kept by namespace, kind and name, for the inbound and the outbound indexes
alike.

An object with problems is logged once per distinct set of problems and ignored: the valid
version read before it stays in force, so a broken edit never silently changes a policy (a
route's broken edit neither opens a port nor reroutes a Service). `apply` answers what changed;
the indexes that share a catalog each apply every event to it, and only the first does the work
(the catalog recognizes the event it has just applied), so an object is read once however many
answers are built from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from meshlet.controlplane.k8s.events import (
    POLICY_KINDS,
    Delete,
    Event,
    Kind,
    Object,
    Snapshot,
    Upsert,
)
from meshlet.controlplane.policy import resources as r

log = logging.getLogger(__name__)

# The policy resources: what the policy controller watches but namespaces and pods.
KINDS: Final = tuple(k for k in POLICY_KINDS if k not in (Kind.NAMESPACE, Kind.POD))
ROUTE_KINDS: Final = (Kind.HTTP_ROUTE, Kind.GATEWAY_HTTP_ROUTE, Kind.GRPC_ROUTE,
                      Kind.GATEWAY_GRPC_ROUTE)  # fmt: skip

Space = dict[Kind, dict[str, r.Resource]]  # one namespace's resources, by kind and name


@dataclass(frozen=True, slots=True)
class Change:
    """An object whose model changed: what was in force before and what is now (None: none)."""

    kind: Kind
    namespace: str
    name: str
    before: r.Resource | None
    after: r.Resource | None


class Catalog:
    """The policy resources in force, by namespace; `apply` takes the source's events."""

    def __init__(self) -> None:
        self.namespaces: dict[str, Space] = {}
        self.invalid = 0  # objects ignored for their problems (counted once per version)
        self._reported: dict[tuple[Kind, str, str], tuple[str, ...]] = {}
        self._event: Event | None = None
        self._changes: tuple[Change, ...] = ()

    def space(self, namespace: str) -> Space:
        """The namespace's resources (the one dict every reader of the catalog shares)."""
        return self.namespaces.setdefault(namespace, {})

    def of(self, namespace: str, kind: Kind) -> Mapping[str, r.Resource]:
        return self.namespaces.get(namespace, {}).get(kind, {})

    def apply(self, event: Event) -> tuple[Change, ...]:
        """What the event changed (nothing for kinds not kept here). The same event applied
        again (by the next index sharing the catalog) changes nothing more and answers the same."""
        if event is self._event:
            return self._changes
        changes: list[Change] = []
        if event.kind in KINDS:
            if isinstance(event, Snapshot):
                self._replace(event.kind, event.objects, changes)
            elif isinstance(event, Upsert):
                self._upsert(event.kind, event.obj, changes)
            elif isinstance(event, Delete) and (key := object_key(event.obj)) is not None:
                self._remove(event.kind, *key, changes)
        self._event, self._changes = event, tuple(changes)
        return self._changes

    def _replace(self, kind: Kind, objects: Iterable[Object], changes: list[Change]) -> None:
        seen: set[tuple[str, str]] = set()
        for obj in objects:
            key = object_key(obj)
            if key is not None:
                seen.add(key)
                self._upsert(kind, obj, changes)
        for namespace, space in list(self.namespaces.items()):
            for name in [n for n in space.get(kind, {}) if (namespace, n) not in seen]:
                self._remove(kind, namespace, name, changes)

    def _upsert(self, kind: Kind, obj: Object, changes: list[Change]) -> None:
        key = object_key(obj)
        if key is None:
            return
        namespace, name = key
        try:
            resource = r.parse(obj)
        except r.Invalid as exc:
            self._report(kind, namespace, name, exc.problems)
            return
        self._reported.pop((kind, namespace, name), None)
        bucket = self.space(namespace).setdefault(kind, {})
        before = bucket.get(name)
        if before == resource:
            return
        bucket[name] = resource
        changes.append(Change(kind, namespace, name, before, resource))

    def _remove(self, kind: Kind, namespace: str, name: str, changes: list[Change]) -> None:
        self._reported.pop((kind, namespace, name), None)
        bucket = self.namespaces.get(namespace, {}).get(kind)
        before = bucket.pop(name, None) if bucket is not None else None
        if before is not None:
            changes.append(Change(kind, namespace, name, before, None))

    def _report(self, kind: Kind, namespace: str, name: str, problems: list[str]) -> None:
        """Logs an invalid object once per distinct set of problems; it is ignored (a valid
        version seen before stays in force)."""
        key = (kind, namespace, name)
        if self._reported.get(key) == tuple(problems):
            return
        self._reported[key] = tuple(problems)
        self.invalid += 1
        log.error("ignored %s %s/%s: %s", kind.kind, namespace, name, "; ".join(problems))


def object_key(obj: Object) -> tuple[str, str] | None:
    """(namespace, name) of a namespaced object (`default` when it names none)."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    namespace = meta.get("namespace")
    return (namespace if isinstance(namespace, str) and namespace else "default"), meta["name"]
