"""Owns the status the policy controller writes back on the routes it reads, so that a route the
proxies do not use says why where its owner looks (`kubectl get httproute -o yaml`).

The shape and meanings are Linkerd's status controller's (`policy-controller/k8s/status`): one
`status.parents[]` entry per parent this controller serves (a Service: outbound; a Server:
inbound), under the controller name `meshlet.io/policy-controller`, beside the entries of other
controllers (kept as they are). A Service parent gets `Accepted` (True; or False with
`NoMatchingParent` for a Service that does not exist or has no ClusterIP, `RouteReasonConflicted`
for an HTTPRoute beside a GRPCRoute on the same parent, `UnsupportedValue` for a route the index
refuses) and `ResolvedRefs` (False with `BackendNotFound` or `InvalidKind` when a backendRef
names a missing Service or another kind); a Server parent gets `Accepted` alone.

meshlet adds one condition Linkerd has not, `meshlet.io/ServiceProfile` (True while the parent
Service has a ServiceProfile with `routes` or `dstOverrides`: the proxies then use the profile
and ignore the route, as Linkerd's do). `Accepted` stays True, since the controller does serve
the route and a Gateway API client (Flagger, kubectl wait) reads `Accepted` as Gateway API
defines it; the extra condition carries the precedence, domain-prefixed as the Gateway API asks
of implementation-specific types.

The decisions are pure (`parent_statuses`, `merged`, `Pacer`); `StatusWriter` is the shell: it
coalesces changes by route (a burst of edits to one route is one patch), paces patches with a
token bucket, and patches only a status that differs from the one it last saw, by a JSON merge
patch on the status subresource that names the resourceVersion it was computed from. The
controller has no leader election: every replica writes, and the resourceVersion precondition
makes the replicas that computed from an older object fail with 409 and recompute from the one
they are about to see, instead of overwriting each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from meshlet.api import wellknown as W
from meshlet.api.cancellation import OwnCancellation
from meshlet.controlplane.k8s.events import Delete, Event, Kind, Object, Snapshot, Upsert
from meshlet.controlplane.policy import resources as r
from meshlet.controlplane.policy.index import Index
from meshlet.controlplane.policy.outbound import Service
from meshlet.controlplane.policy.outbound_index import OutboundIndex

log = logging.getLogger(__name__)

CONTROLLER_NAME: Final = W.POLICY_CONTROLLER_NAME
ROUTE_KINDS: Final = (
    Kind.HTTP_ROUTE,
    Kind.GATEWAY_HTTP_ROUTE,
    Kind.GRPC_ROUTE,
    Kind.GATEWAY_GRPC_ROUTE,
)
SERVICE_PROFILE_CONDITION: Final = "meshlet.io/ServiceProfile"
MAX_MESSAGE: Final = 1024  # characters of a condition's message (the API allows 32768)
MAX_PARENTS: Final = 32  # status.parents entries the Gateway API CRDs allow


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # "True" or "False"
    reason: str
    message: str = ""


def accepted() -> Condition:
    return Condition("Accepted", "True", "Accepted")


def no_matching_parent(message: str) -> Condition:
    return Condition("Accepted", "False", "NoMatchingParent", message)


def conflicted() -> Condition:
    return Condition(
        "Accepted", "False", "RouteReasonConflicted",
        "a GRPCRoute attaches to the same parent; GRPCRoutes take precedence over HTTPRoutes",
    )  # fmt: skip


def unsupported(problems: Iterable[str]) -> Condition:
    return Condition("Accepted", "False", "UnsupportedValue", _cap("; ".join(problems)))


def resolved_refs() -> Condition:
    return Condition("ResolvedRefs", "True", "ResolvedRefs")


def backend_not_found(message: str) -> Condition:
    return Condition("ResolvedRefs", "False", "BackendNotFound", message)


def invalid_kind(message: str) -> Condition:
    return Condition("ResolvedRefs", "False", "InvalidKind", message)


def shadowed(profile: str) -> Condition:
    return Condition(
        SERVICE_PROFILE_CONDITION, "True", "ServiceProfileExists",
        f"ServiceProfile {profile} has routes or dstOverrides for this Service: proxies use it and"
        " ignore this route and the Service's retry and timeout annotations until it has neither",
    )  # fmt: skip


def _cap(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


class Cluster(Protocol):
    """What the conditions depend on besides the route itself."""

    def service(self, namespace: str, name: str) -> Service | None: ...

    def server(self, namespace: str, name: str) -> bool: ...

    def grpc_parented(self, namespace: str, name: str, port: int | None) -> bool:
        """Whether a (valid) GRPCRoute attaches to that Service and port."""
        ...

    def profile(self, namespace: str, name: str) -> str | None:
        """The name of the ServiceProfile of that Service, if one exists."""
        ...


# -- the decisions (pure) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parent:
    kind: str  # Service or Server
    namespace: str
    name: str
    port: int | None = None

    def ref(self) -> dict[str, Any]:
        """The `parentRef` of its status entry, as Linkerd writes it."""
        if self.kind == "Server":
            return {"group": W.POLICY_API_GROUP, "kind": "Server", "namespace": self.namespace,
                    "name": self.name}  # fmt: skip
        out: dict[str, Any] = {"group": "core", "kind": "Service", "namespace": self.namespace,
                               "name": self.name}  # fmt: skip
        if self.port is not None:
            out["port"] = self.port
        return out


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _namespace(obj: Mapping[str, Any]) -> str:
    ns = _meta(obj).get("namespace")
    return ns if isinstance(ns, str) and ns else "default"


def _items(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def parents(obj: Mapping[str, Any]) -> list[Parent]:
    """The parents of a route this controller serves, in order, without repeats; a parentRef
    of another kind (a Gateway) is another controller's."""
    ns = _namespace(obj)
    out: list[Parent] = []
    for ref in _items(_spec(obj).get("parentRefs"))[:MAX_PARENTS]:
        kind, name = ref.get("kind"), ref.get("name")
        group = ref.get("group", "core" if kind == "Service" else r.GATEWAY_GROUP)
        if not isinstance(name, str) or not name:
            continue
        refns = ref.get("namespace")
        refns = refns if isinstance(refns, str) and refns else ns
        port = ref.get("port")
        port = port if isinstance(port, int) and not isinstance(port, bool) else None
        if isinstance(kind, str) and kind.lower() == "service" and group in ("", "core"):
            parent = Parent("Service", refns, name, port)
        elif kind == "Server" and group == W.POLICY_API_GROUP:
            parent = Parent("Server", refns, name)
        else:
            continue
        if parent not in out:
            out.append(parent)
    return out


def backend_condition(obj: Mapping[str, Any], cluster: Cluster) -> Condition:
    """ResolvedRefs of a route's backendRefs (Linkerd's: the first bad one decides)."""
    ns = _namespace(obj)
    for rule in _items(_spec(obj).get("rules")):
        for ref in _items(rule.get("backendRefs")):
            kind, group = ref.get("kind", "Service"), ref.get("group", "")
            name = ref.get("name")
            if kind != "Service" or group not in ("", "core"):
                return invalid_kind(f"backendRef {name!s}: {group or 'core'} {kind!s} is not a"
                                    " Service")  # fmt: skip
            refns = ref.get("namespace")
            refns = refns if isinstance(refns, str) and refns else ns
            if not isinstance(name, str) or cluster.service(refns, name) is None:
                return backend_not_found(f"Service {refns}/{name!s} not found")
    return resolved_refs()


def parent_statuses(
    obj: Mapping[str, Any], cluster: Cluster
) -> list[tuple[Parent, list[Condition]]]:
    """Each parent this controller serves, with its conditions (lastTransitionTime apart)."""
    problems = r.problems(obj)
    kind = str(obj.get("kind"))
    backends: Condition | None = None
    out = []
    for parent in parents(obj):
        if parent.kind == "Server":
            ok = cluster.server(parent.namespace, parent.name)
            found = unsupported(problems) if problems else accepted()
            out.append((parent, [found if ok else no_matching_parent(
                f"Server {parent.namespace}/{parent.name} not found")]))  # fmt: skip
            continue
        svc = cluster.service(parent.namespace, parent.name)
        if problems:
            condition = unsupported(problems)
        elif svc is None:
            condition = no_matching_parent(f"Service {parent.namespace}/{parent.name} not found")
        elif not svc.cluster_ips:
            condition = no_matching_parent("parent service must have a ClusterIP")
        elif kind == "HTTPRoute" and cluster.grpc_parented(parent.namespace, parent.name,
                                                           parent.port):  # fmt: skip
            condition = conflicted()
        else:
            condition = accepted()
        if backends is None:
            backends = backend_condition(obj, cluster)
        conditions = [condition, backends]
        profile = cluster.profile(parent.namespace, parent.name) if svc is not None else None
        if profile is not None:
            conditions.append(shadowed(profile))
        out.append((parent, conditions))
    return out


def _same_ref(entry: Mapping[str, Any], ref: Mapping[str, Any]) -> bool:
    raw = entry.get("parentRef")
    return (
        isinstance(raw, Mapping)
        and all(raw.get(k) == v for k, v in ref.items())
        and all(k in ref for k, v in raw.items() if v is not None and k != "sectionName")
    )


def merged(obj: Mapping[str, Any], cluster: Cluster, now: str) -> list[dict[str, Any]] | None:
    """The `status.parents` to write on `obj`, or None when its status already says it.

    Other controllers' entries are kept as they are and where they are (so two controllers never
    reorder each other's lists back and forth); ours are recomputed in place, new ones appended,
    stale ones dropped; each condition keeps its `lastTransitionTime` while its status
    (True/False) is unchanged (the Kubernetes condition convention), `observedGeneration` the
    route's generation."""
    status = obj.get("status")
    current = _items(status.get("parents")) if isinstance(status, Mapping) else []
    generation = _meta(obj).get("generation")
    generation = generation if isinstance(generation, int) else None
    fresh = []
    for parent, conditions in parent_statuses(obj, cluster):
        ref = parent.ref()
        before = next(
            (
                e
                for e in current
                if e.get("controllerName") == CONTROLLER_NAME and _same_ref(e, ref)
            ),
            None,
        )
        old = {c.get("type"): c for c in _items(before.get("conditions") if before else None)}
        fresh.append((ref, _entry(ref, conditions, old, generation, now)))
    out: list[dict[str, Any]] = []
    placed: set[int] = set()
    for e in current:
        if e.get("controllerName") != CONTROLLER_NAME:
            out.append(dict(e))
            continue
        i = next((i for i, (ref, _) in enumerate(fresh) if i not in placed and _same_ref(e, ref)),
                 None)  # fmt: skip
        if i is not None:
            out.append(fresh[i][1])
            placed.add(i)
    out += [entry for i, (_, entry) in enumerate(fresh) if i not in placed]
    out = out[:MAX_PARENTS]
    return None if out == [dict(e) for e in current] else out


def _entry(
    ref: dict[str, Any],
    conditions: list[Condition],
    old: Mapping[Any, Mapping[str, Any]],
    generation: int | None,
    now: str,
) -> dict[str, Any]:
    written = []
    for c in conditions:
        prior = old.get(c.type)
        since = now
        if (
            prior is not None
            and prior.get("status") == c.status
            and isinstance(prior.get("lastTransitionTime"), str)
        ):
            since = prior["lastTransitionTime"]
        item: dict[str, Any] = {"type": c.type, "status": c.status, "reason": c.reason,
                                "message": c.message, "lastTransitionTime": since}  # fmt: skip
        if generation is not None:
            item["observedGeneration"] = generation
        written.append(item)
    return {"parentRef": ref, "controllerName": CONTROLLER_NAME, "conditions": written}


def patch_body(obj: Mapping[str, Any], parents: list[dict[str, Any]]) -> dict[str, Any]:
    """The merge patch of the status subresource: the whole `parents` list (a merge patch
    replaces lists), preconditioned on the resourceVersion it was computed from."""
    meta: dict[str, Any] = {}
    version = _meta(obj).get("resourceVersion")
    if isinstance(version, str) and version:
        meta["resourceVersion"] = version
    return {"metadata": meta, "status": {"parents": parents}}


def timestamp(when: float) -> str:
    """A Kubernetes `metav1.Time`: RFC 3339 in UTC, whole seconds."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class Pacer:
    """A token bucket of `rate` patches a second, `burst` at once. `delay(now)` reserves the
    next token and says how long to wait for it (0: now); reservations may run the bucket
    below zero, so each caller waits its own turn."""

    rate: float
    burst: float
    tokens: float = -1.0
    at: float = 0.0
    started: bool = False

    def delay(self, now: float) -> float:
        if not self.started:
            self.tokens, self.at, self.started = self.burst, now, True
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


# -- the shell -------------------------------------------------------------------------------

RouteKey = tuple[Kind, str, str]  # (kind, namespace, name)
Ref = tuple[str, str, str]  # (Service or Server, namespace, name)
Patch = Callable[[Kind, str, str, dict[str, Any]], Awaitable[None]]


class PatchConflict(Exception):
    """The object changed since the status was computed (409): recomputed when it is seen."""


@dataclass(slots=True)
class StatusWriter:
    """Keeps the last seen version of every route; writes the status of those marked dirty.

    `apply` takes the policy controller's events (routes, and the Services, Servers and
    ServiceProfiles their conditions depend on); `run` writes until cancelled."""

    cluster: Cluster
    patch: Patch
    interval: float = 0.2  # changes arriving within it are written together
    retry_delay: float = 5.0  # after a batch with a failed patch
    pacer: Pacer = field(default_factory=lambda: Pacer(rate=20.0, burst=50.0))
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    routes: dict[RouteKey, Object] = field(default_factory=dict)
    named: dict[RouteKey, frozenset[Ref]] = field(default_factory=dict)  # what each names
    refs: dict[Ref, set[RouteKey]] = field(default_factory=dict)  # the routes naming each
    versions: dict[tuple[Kind, Ref], str] = field(default_factory=dict)  # Services, Servers...
    dirty: set[RouteKey] = field(default_factory=set)
    patched: int = 0
    failed: int = 0
    on_result: Callable[[str], None] = lambda _: None  # "written", "conflict" or "failed"
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def apply(self, event: Event) -> None:
        if event.kind in ROUTE_KINDS:
            if isinstance(event, Snapshot):
                keys = {k for obj in event.objects if (k := _route_key(event.kind, obj))}
                for gone in [k for k in self.routes if k[0] is event.kind and k not in keys]:
                    self._drop(gone)
                for obj in event.objects:
                    self._put(event.kind, obj)
            elif isinstance(event, Upsert):
                self._put(event.kind, event.obj)
            elif isinstance(event, Delete) and (key := _route_key(event.kind, event.obj)):
                self._drop(key)
        elif event.kind in (Kind.SERVICE, Kind.SERVER, Kind.SERVICE_PROFILE):
            if isinstance(event, Snapshot):  # a relist: only what changed since counts
                seen = {v for obj in event.objects if (v := self._seen(event.kind, obj))}
                for old in [v for v in self.versions if v[0] is event.kind and v not in seen]:
                    del self.versions[old]
                    self.dirty.update(self.refs.get(old[1], ()))
            elif isinstance(event, Upsert):
                self._seen(event.kind, event.obj)
            elif (ref := _object_ref(event.kind, event.obj)) is not None:
                self.versions.pop((event.kind, ref), None)
                self.dirty.update(self.refs.get(ref, ()))
        else:
            return
        if self.dirty:
            self._wake.set()

    def _seen(self, kind: Kind, obj: Object) -> tuple[Kind, Ref] | None:
        """Records a Service, Server or ServiceProfile; marks the routes naming it when it is
        new or changed (an unchanged one, as a relist brings back, marks none)."""
        ref = _object_ref(kind, obj)
        if ref is None:
            return None
        version = _version(obj)
        if not version or self.versions.get((kind, ref)) != version:
            self.versions[(kind, ref)] = version
            self.dirty.update(self.refs.get(ref, ()))
        return (kind, ref)

    def _put(self, kind: Kind, obj: Object) -> None:
        key = _route_key(kind, obj)
        if key is None:
            return
        version = _version(obj)
        known = self.routes.get(key)
        if version and known is not None and _version(known) == version:
            return  # a relist brought it back unchanged
        self._drop(key)
        names = references(obj)
        self.named[key] = names
        for ref in names:
            self.refs.setdefault(ref, set()).add(key)
        self.routes[key] = obj
        self.dirty.add(key)
        if kind.kind == "GRPCRoute":  # it may conflict with the HTTPRoutes of its parents
            self._touch_siblings(names)

    def _drop(self, key: RouteKey) -> None:
        self.routes.pop(key, None)
        self.dirty.discard(key)
        names = self.named.pop(key, frozenset())
        for ref in names:
            holders = self.refs.get(ref)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self.refs[ref]
        if key[0].kind == "GRPCRoute":
            self._touch_siblings(names)

    def _touch_siblings(self, names: frozenset[Ref]) -> None:
        for ref in names:
            if ref[0] == "Service":
                self.dirty.update(k for k in self.refs.get(ref, ()) if k in self.routes)

    async def run(self) -> None:
        own = OwnCancellation()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.interval)
            self._wake.clear()
            batch, self.dirty = self.dirty, set()
            failed = self.failed
            for key in sorted(batch, key=lambda k: (k[1], k[2], k[0].api_version)):
                obj = self.routes.get(key)
                if obj is None:
                    continue
                parents = merged(obj, self.cluster, timestamp(self.wall()))
                if parents is None:
                    continue
                wait = self.pacer.delay(self.clock())
                if wait:
                    await asyncio.sleep(wait)
                await self._write(key, obj, parents)
                own.check()  # a failed write made of our own cancellation is not retried
            if self.failed != failed:
                await asyncio.sleep(self.retry_delay)

    async def _write(self, key: RouteKey, obj: Object, parents: list[dict[str, Any]]) -> None:
        kind, namespace, name = key
        try:
            await self.patch(kind, namespace, name, patch_body(obj, parents))
        except PatchConflict:
            log.debug("status of %s %s/%s changed meanwhile", kind.kind, namespace, name)
            self.on_result("conflict")
            return
        except Exception as exc:  # the API is down or refuses: retried, paced by the bucket
            self.failed += 1
            self.on_result("failed")
            self.dirty.add(key)
            self._wake.set()
            log.warning("could not write the status of %s %s/%s: %s", kind.kind, namespace,
                        name, exc)  # fmt: skip
            return
        self.patched += 1
        self.on_result("written")
        log.info("wrote the status of %s %s/%s", kind.kind, namespace, name)


def kubernetes_patch(api_client: Any, timeout: float = 10.0) -> Patch:
    """A `Patch` through the `kubernetes` client: a JSON merge patch of the status subresource;
    409 (the resourceVersion precondition failed) raises PatchConflict."""
    from kubernetes import client

    api = client.CustomObjectsApi(api_client)

    def call(kind: Kind, namespace: str, name: str, body: dict[str, Any]) -> None:
        group, version = kind.api_version.split("/")
        try:
            api.patch_namespaced_custom_object_status(
                group, version, namespace, kind.plural, name, body,
                _content_type="application/merge-patch+json", _request_timeout=timeout,
                _preload_content=False,
            )  # fmt: skip
        except client.ApiException as exc:
            if exc.status == 409:
                raise PatchConflict(str(exc.reason)) from None
            raise RuntimeError(f"{exc.status} {exc.reason}") from None

    async def patch(kind: Kind, namespace: str, name: str, body: dict[str, Any]) -> None:
        await asyncio.to_thread(call, kind, namespace, name, body)

    return patch


def references(obj: Mapping[str, Any]) -> frozenset[Ref]:
    """The Services and Servers a route's conditions depend on: its parents and backends."""
    ns = _namespace(obj)
    out: set[Ref] = {(p.kind, p.namespace, p.name) for p in parents(obj)}
    for rule in _items(_spec(obj).get("rules")):
        for ref in _items(rule.get("backendRefs")):
            name, refns = ref.get("name"), ref.get("namespace")
            if isinstance(name, str):
                out.add(("Service", refns if isinstance(refns, str) and refns else ns, name))
    return frozenset(out)


def _object_ref(kind: Kind, obj: Mapping[str, Any]) -> Ref | None:
    """The Service or Server an event's object is, or whose profile it is."""
    name = _meta(obj).get("name")
    if not isinstance(name, str):
        return None
    ns = _namespace(obj)
    if kind is Kind.SERVER:
        return ("Server", ns, name)
    if kind is Kind.SERVICE_PROFILE:
        service, _, rest = name.partition(".")
        return ("Service", ns, service) if rest.startswith(f"{ns}.svc.") else None
    return ("Service", ns, name)


def _version(obj: Mapping[str, Any]) -> str:
    version = _meta(obj).get("resourceVersion")
    return version if isinstance(version, str) else ""


def _route_key(kind: Kind, obj: Mapping[str, Any]) -> RouteKey | None:
    name = _meta(obj).get("name")
    return (kind, _namespace(obj), name) if isinstance(name, str) and name else None


@dataclass(slots=True)
class Indexes:
    """`Cluster` over the policy controller's indexes, and the ServiceProfiles it watches only
    for this (`<svc>.<ns>.svc.<cluster-domain>` in the Service's namespace, as the destination
    controller finds them)."""

    outbound: OutboundIndex
    inbound: Index
    cluster_domain: str = W.CLUSTER_DOMAIN
    profiles: set[tuple[str, str]] = field(default_factory=set)  # (namespace, name)

    def apply(self, event: Event) -> None:
        if event.kind is not Kind.SERVICE_PROFILE:
            return
        if isinstance(event, Snapshot):
            self.profiles = {
                k for obj in event.objects if overrides_policy(obj) and (k := _profile_key(obj))
            }
        elif (key := _profile_key(event.obj)) is not None:
            if isinstance(event, Upsert) and overrides_policy(event.obj):
                self.profiles.add(key)
            else:
                self.profiles.discard(key)

    def service(self, namespace: str, name: str) -> Service | None:
        return self.outbound.service(namespace, name)

    def server(self, namespace: str, name: str) -> bool:
        return name in self.inbound.catalog.of(namespace, Kind.SERVER)

    def grpc_parented(self, namespace: str, name: str, port: int | None) -> bool:
        target = (namespace, name)
        return any(
            rt.kind == "GRPCRoute" and (namespace, name, port) in rt.services
            for space in self.outbound.spaces.values()
            for rt in space.by_parent.get(target, {}).values()
        )

    def profile(self, namespace: str, name: str) -> str | None:
        fqn = f"{name}.{namespace}.svc.{self.cluster_domain}"
        return fqn if (namespace, fqn) in self.profiles else None


def overrides_policy(profile: Mapping[str, Any]) -> bool:
    """Whether a ServiceProfile takes precedence over its Service's policy in the proxies: it
    has `routes` or `dstOverrides` (an empty profile leaves the routes in force)."""
    spec = _spec(profile)
    return any(isinstance(spec.get(k), list) and spec[k] for k in ("routes", "dstOverrides"))


def _profile_key(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    name = _meta(obj).get("name")
    return (_namespace(obj), name) if isinstance(name, str) and name else None
