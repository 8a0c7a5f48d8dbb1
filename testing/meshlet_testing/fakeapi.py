"""Owns the in-process fake Kubernetes API server, the only stand-in for a real one in tests.

`FakeKubeAPI` speaks enough of the real HTTP protocol for the unmodified `kubernetes` client:
JSON objects and `Status` errors, one global resourceVersion, list/get/create/replace/delete,
chunked watch streams with replay, bookmarks, 410 Expired after compaction, bearer-token
authentication and TokenReview; GET /version; the pods/proxy subresource (a GET forwarded to the
pod's IP) and pods/portforward (the WebSocket channel protocol `v4.channel.k8s.io` that
`kubernetes.stream.portforward` speaks, carried to the pod's IP); and for kinds with a status
subresource (the routes) `metadata.generation` and `/status` (GET, and PATCH with a JSON merge
patch that may name the resourceVersion it expects, as a controller writes status).
`expose()` stands in for the pod network: it sends a pod IP and port to a test's server. Tests
drive changes through its thread-safe Python API.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypedDict, cast
from urllib.parse import parse_qs, unquote, urlsplit

import yaml
from kubernetes import client as k8s_client

logger = logging.getLogger(__name__)

Obj = dict[str, Any]
BEARER_TOKEN = "meshlet-fake-apiserver-token"
API_SERVER_AUDIENCES = ("https://kubernetes.default.svc.cluster.local",)
_POLL_SECONDS = 0.1  # how often a watch checks for a vanished client, a timeout or a stop
_Change = Literal["ADDED", "MODIFIED", "DELETED"]
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})


@dataclass(frozen=True)
class Resource:
    """One row of the served resource table."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    create_only: bool = False  # e.g. TokenReview: POST only, nothing is stored
    delete_returns_object: bool = True  # else DELETE answers a Success Status, as the real server
    status: bool = False  # has a status subresource: writes to the object keep its status

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "namespaces", "Namespace", namespaced=False),
    Resource("", "v1", "pods", "Pod", namespaced=True),
    Resource("", "v1", "services", "Service", namespaced=True),
    Resource("", "v1", "secrets", "Secret", namespaced=True, delete_returns_object=False),
    Resource("", "v1", "configmaps", "ConfigMap", namespaced=True, delete_returns_object=False),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", namespaced=True),
    Resource(
        "discovery.k8s.io",
        "v1",
        "endpointslices",
        "EndpointSlice",
        True,
        delete_returns_object=False,
    ),
    Resource("meshlet.io", "v1alpha1", "serviceprofiles", "ServiceProfile", namespaced=True),
    Resource("authentication.k8s.io", "v1", "tokenreviews", "TokenReview", False, create_only=True),
    Resource("apps", "v1", "deployments", "Deployment", namespaced=True),
    Resource(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
    ),
    Resource(
        "admissionregistration.k8s.io",
        "v1",
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        namespaced=False,
    ),
    Resource(
        "admissionregistration.k8s.io",
        "v1",
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        namespaced=False,
    ),
    Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    Resource(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", namespaced=True),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", namespaced=True),
)
# The policy controller's kinds (served where a test installs them, as their CRDs would).
POLICY_RESOURCES: tuple[Resource, ...] = tuple(
    Resource(group, version, plural, kind, namespaced=True, status=plural.endswith("routes"))
    for group, version, plural, kind in (
        ("policy.meshlet.io", "v1beta3", "servers", "Server"),
        ("policy.meshlet.io", "v1alpha1", "authorizationpolicies", "AuthorizationPolicy"),
        ("policy.meshlet.io", "v1alpha1", "meshtlsauthentications", "MeshTLSAuthentication"),
        ("policy.meshlet.io", "v1alpha1", "networkauthentications", "NetworkAuthentication"),
        ("policy.meshlet.io", "v1beta3", "httproutes", "HTTPRoute"),
        ("policy.meshlet.io", "v1", "grpcroutes", "GRPCRoute"),
        ("policy.meshlet.io", "v1alpha1", "httplocalratelimitpolicies", "HTTPLocalRateLimitPolicy"),
        ("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"),
        ("gateway.networking.k8s.io", "v1", "grpcroutes", "GRPCRoute"),
    )
)
# GET /version, as a 1.33 server answers it.
VERSION: dict[str, str] = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.1",
    "gitCommit": "8adc0f041b8e7ad1d30e29cc59c6ae7a15e19828",
    "gitTreeState": "clean",
    "buildDate": "2025-05-15T08:19:08Z",
    "goVersion": "go1.24.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_POD_PROXY = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/:]+):(\d+)/proxy(/[^?]*)?")
_PORT_FORWARD = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/portforward")
_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3
_WS_PROTOCOL = "v4.channel.k8s.io"  # the kubelet's port-forward protocol over WebSocket
_WS_MAX_FRAME = 1 << 24


class WatchEvent(TypedDict):
    type: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
    object: Obj


class StatusError(Exception):
    """A failure the server answers with a `Status` object; also raised by the Python API."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> Obj:
        status: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        status.update(message=self.message, reason=self.reason, code=self.code)
        if self.details is not None:
            status["details"] = self.details
        return status


def _not_found(res: Resource, name: str) -> StatusError:
    details = {"name": name, "group": res.group, "kind": res.plural}
    return StatusError(404, "NotFound", f'{res.plural} "{name}" not found', details)


def _bad_request(message: str) -> StatusError:
    return StatusError(400, "BadRequest", message)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class _Selector:
    """Equality-based label and field selectors (`a=b,c!=d`), as lists and watches take them."""

    labels: tuple[tuple[str, str, bool], ...] = ()  # (key, value, must_equal)
    fields: tuple[tuple[str, str, bool], ...] = ()

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> _Selector:
        labels = cls._terms(query.get("labelSelector", ""))
        fields = cls._terms(query.get("fieldSelector", ""))
        for key, _, _ in fields:
            if key not in ("metadata.name", "metadata.namespace"):
                raise _bad_request(f'field label not supported: "{key}"')
        return cls(labels, fields)

    @staticmethod
    def _terms(text: str) -> tuple[tuple[str, str, bool], ...]:
        terms = []
        for term in filter(None, (t.strip() for t in text.split(","))):
            op = "!=" if "!=" in term else "==" if "==" in term else "="
            key, sep, value = term.partition(op)
            if not sep or not key.strip() or any(c in term for c in " ()"):
                raise _bad_request(f"unable to parse requirement: {term!r} (only a=b, a!=b)")
            terms.append((key.strip(), value.strip(), op != "!="))
        return tuple(terms)

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        labels = meta.get("labels") or {}
        fields = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}
        return all((labels.get(k) == v) == eq for k, v, eq in self.labels) and all(
            (fields.get(k) == v) == eq for k, v, eq in self.fields
        )


@dataclass(frozen=True)
class _Route:
    resource: Resource
    namespace: str | None  # None: cluster-scoped, or all namespaces
    name: str | None  # None: the collection
    subresource: str | None = None  # "status"


@dataclass(frozen=True)
class _Event:
    rv: int
    type: _Change
    resource: Resource
    obj: Obj  # never mutated once recorded
    old: Obj | None  # the previous state of a MODIFIED object, for selector transitions


@dataclass
class _Watch:
    route: _Route
    selector: _Selector
    cursor: int  # every event up to this resourceVersion has been considered
    break_epoch: int
    bookmark_epoch: int
    bookmarks: bool
    next_bookmark: float
    deadline: float | None

    def sees(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        ns = self.route.namespace
        return (ns is None or obj["metadata"].get("namespace") == ns) and self.selector.matches(obj)

    def translate(self, event: _Event) -> WatchEvent | None:
        """What this watcher is told of `event`: selector changes turn into ADDED/DELETED."""
        now, before = self.sees(event.obj), self.sees(event.old)
        if event.resource != self.route.resource or not (now or before):
            return None
        kind = event.type
        if kind == "MODIFIED" and now != before:
            kind = "ADDED" if now else "DELETED"
        return {"type": kind, "object": event.obj}


@dataclass
class _Token:
    username: str
    audiences: tuple[str, ...]
    authenticated: bool
    uid: str
    groups: tuple[str, ...]


@dataclass
class _State:
    """Everything guarded by `FakeKubeAPI._cond`."""

    rv: int = 1
    compacted: int = 0
    objects: dict[tuple[Resource, str, str], Obj] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    tokens: dict[str, _Token] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    connections: set[socket.socket] = field(default_factory=set)
    open_watches: int = 0
    break_epoch: int = 0
    break_graceful: bool = False
    bookmark_epoch: int = 0
    stopping: bool = False
    network: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)


class FakeKubeAPI:
    """A fake API server on 127.0.0.1; `with FakeKubeAPI() as api:` starts and stops it."""

    def __init__(
        self, *, bookmark_interval: float = 1.0, resources: Sequence[Resource] = RESOURCES
    ) -> None:
        self.token = BEARER_TOKEN
        self.bookmark_interval = bookmark_interval
        self.fail_token_reviews = False
        self.forbidden: set[str] = set()  # resource plurals the token may not read (403)
        self.version: dict[str, str] = dict(VERSION)
        self._resources = {(r.group, r.version, r.plural): r for r in resources}
        self._kinds = {(r.api_version, r.kind): r for r in resources}
        self._cond = threading.Condition()
        self._state = _State()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.api = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="fakeapi", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        with self._cond:
            self._state.stopping = True
            self._cond.notify_all()
        server.shutdown()
        with self._cond:
            for conn in self._state.connections:
                _shutdown(conn)
        server.server_close()  # joins the handler threads
        thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "FakeKubeAPI is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def client_configuration(self) -> k8s_client.Configuration:
        config = k8s_client.Configuration(host=self.url, no_proxy="127.0.0.1,localhost")
        config.api_key = {"authorization": f"Bearer {self.token}"}
        return config

    def write_kubeconfig(self, path: str | os.PathLike[str]) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
            "preferences": {},
        }
        out = Path(path)
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
        return out

    # -- test-side API ---------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Creates or replaces `obj` (ignoring its resourceVersion); emits ADDED or MODIFIED."""
        res = self._kind(str(obj.get("apiVersion")), str(obj.get("kind")))
        body = copy.deepcopy(dict(obj))
        meta = body.get("metadata") or {}
        meta.pop("resourceVersion", None)
        ns, name = meta.get("namespace") or "default", meta.get("name")
        with self._cond:
            if isinstance(name, str) and _key(res, ns, name) in self._state.objects:
                return self._replace(res, ns, name, body)
            return self._create(res, ns, body)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        """Deletes an object (StatusError 404 if missing); emits DELETED with a new version."""
        with self._cond:
            return self._delete(self._kind(api_version, kind), namespace or "default", name)

    def patch_status(
        self, api_version: str, kind: str, name: str, patch: Obj, namespace: str | None = None
    ) -> Obj:
        """Merges `patch` into the status of an object, as PATCH .../status does."""
        with self._cond:
            return self._patch_status(self._kind(api_version, kind), namespace or "default",
                                      name, patch)  # fmt: skip

    def get(
        self, api_version: str, kind: str, name: str, namespace: str | None = None
    ) -> Obj | None:
        res = self._kind(api_version, kind)
        with self._cond:
            obj = self._state.objects.get(_key(res, namespace or "default", name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, api_version: str, kind: str, namespace: str | None = None) -> list[Obj]:
        route = _Route(self._kind(api_version, kind), namespace, None)
        return cast(list[Obj], self._list(route, _Selector())["items"])

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._state.rv)

    def compact(self) -> int:
        """Makes every resourceVersion before the current one too old to watch from (410)."""
        with self._cond:
            st = self._state
            st.compacted = st.rv
            st.history = [e for e in st.history if e.rv > st.compacted]
            return st.compacted

    def break_watches(self, *, graceful: bool = False) -> None:
        """Ends every open watch: abruptly (no final chunk, as a crash) or cleanly."""
        with self._cond:
            self._state.break_epoch += 1
            self._state.break_graceful = graceful
            self._cond.notify_all()

    def bookmark(self) -> None:
        """Sends a BOOKMARK now on every open watch that allows bookmarks."""
        with self._cond:
            self._state.bookmark_epoch += 1
            self._cond.notify_all()

    def expose(self, pod_ip: str, port: int, address: tuple[str, int]) -> None:
        """Makes `pod_ip:port`, as pods/proxy and pods/portforward reach it, lead to `address`
        (a server the test runs for that pod's container: tests cannot bind every pod IP)."""
        with self._cond:
            self._state.network[(pod_ip, port)] = address

    def add_token(
        self,
        token: str,
        username: str,
        audiences: Sequence[str] = ("identity.meshlet.io",),
        authenticated: bool = True,
        *,
        uid: str = "",
        groups: Sequence[str] = (),
    ) -> None:
        entry = _Token(username, tuple(audiences), authenticated, uid, tuple(groups))
        with self._cond:
            self._state.tokens[token] = entry

    @property
    def requests(self) -> list[tuple[str, str]]:
        """Every (method, path with query) received so far, oldest first."""
        with self._cond:
            return list(self._state.requests)

    @property
    def open_watches(self) -> int:
        with self._cond:
            return self._state.open_watches

    def wait_for_watches(self, count: int, timeout: float = 5.0) -> bool:
        """Waits until exactly `count` watch streams are open; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state.open_watches == count, timeout)

    # -- store (callers hold self._cond) -----------------------------------------------------

    def _kind(self, api_version: str, kind: str) -> Resource:
        res = self._kinds.get((api_version, kind))
        if res is None or res.create_only:
            raise StatusError(404, "NotFound", f"no resource for {api_version} {kind}")
        return res

    def _prepare(self, res: Resource, ns: str, body: Obj) -> Obj:
        meta = body.get("metadata")
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if body.get("kind", res.kind) != res.kind:
            raise _bad_request(f"kind {body.get('kind')!r} does not match {res.kind}")
        if res.namespaced:
            if meta.get("namespace", ns) != ns:
                raise _bad_request("the namespace of the object does not match the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        body.update(kind=res.kind, apiVersion=res.api_version)
        return body

    def _commit(self, event: _Change, res: Resource, obj: Obj) -> Obj:
        st = self._state
        st.rv += 1
        obj["metadata"]["resourceVersion"] = str(st.rv)
        key = _key(res, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        old = st.objects.pop(key, None)
        if event != "DELETED":
            st.objects[key] = obj
        st.history.append(_Event(st.rv, event, res, obj, old if event == "MODIFIED" else None))
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _create(self, res: Resource, ns: str, body: Obj) -> Obj:
        obj = self._prepare(res, ns, body)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        name = meta.get("name")
        if not isinstance(name, str) or not name:
            raise StatusError(422, "Invalid", "metadata.name: Required value: name is required")
        if _key(res, ns, name) in self._state.objects:
            details = {"name": name, "group": res.group, "kind": res.plural}
            msg = f'{res.plural} "{name}" already exists'
            raise StatusError(409, "AlreadyExists", msg, details)
        meta.pop("resourceVersion", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        if res.status:
            meta["generation"] = 1
            obj.pop("status", None)
        return self._commit("ADDED", res, obj)

    def _replace(self, res: Resource, ns: str, name: str, body: Obj) -> Obj:
        current = self._state.objects.get(_key(res, ns, name))
        if current is None:
            raise _not_found(res, name)
        obj = self._prepare(res, ns, body)
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise _bad_request("the name of the object does not match the name on the URL")
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            msg = (
                f'Operation cannot be fulfilled on {res.plural} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again"
            )
            raise StatusError(409, "Conflict", msg, {"name": name, "kind": res.plural})
        meta.update(
            name=name,
            uid=current["metadata"]["uid"],
            creationTimestamp=current["metadata"]["creationTimestamp"],
        )
        if res.status:  # the status is the subresource's; the spec's changes count
            obj.pop("status", None)
            if "status" in current:
                obj["status"] = copy.deepcopy(current["status"])
            generation = current["metadata"].get("generation", 1)
            changed = obj.get("spec") != current.get("spec")
            meta["generation"] = generation + 1 if changed else generation
        return self._commit("MODIFIED", res, obj)

    def _patch_status(self, res: Resource, ns: str, name: str, patch: Obj) -> Obj:
        current = self._state.objects.get(_key(res, ns, name))
        if current is None:
            raise _not_found(res, name)
        meta = patch.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        if rv and rv != current["metadata"]["resourceVersion"]:
            msg = (
                f'Operation cannot be fulfilled on {res.plural} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again"
            )
            raise StatusError(409, "Conflict", msg, {"name": name, "kind": res.plural})
        obj = copy.deepcopy(current)
        if "status" in patch:
            merged = _merge_patch(obj.get("status"), patch["status"])
            if merged is None:
                obj.pop("status", None)
            else:
                obj["status"] = merged
        if obj == current:  # as the real server: an empty change writes nothing
            return copy.deepcopy(current)
        return self._commit("MODIFIED", res, obj)

    def _patch(self, res: Resource, ns: str, name: str, patch: Obj) -> Obj:
        current = self._state.objects.get(_key(res, ns, name))
        if current is None:
            raise _not_found(res, name)
        if not isinstance(patch, dict) or any(
            isinstance(v, list) for v in _leaves(patch)
        ):  # fmt: skip
            raise _bad_request("this server patches maps only")
        obj = _merge_patch(copy.deepcopy(current), patch)
        for kept in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp"):
            if kept in current["metadata"]:
                obj["metadata"][kept] = current["metadata"][kept]
        if obj == current:  # as the real server: an empty change writes nothing
            return copy.deepcopy(current)
        return self._commit("MODIFIED", res, obj)

    def _delete(self, res: Resource, ns: str, name: str) -> Obj:
        current = self._state.objects.get(_key(res, ns, name))
        if current is None:
            raise _not_found(res, name)
        return self._commit("DELETED", res, copy.deepcopy(current))

    def _list(self, route: _Route, selector: _Selector) -> Obj:
        view = _Watch(route, selector, 0, 0, 0, False, 0.0, None)
        with self._cond:
            items = [
                copy.deepcopy(obj)
                for (res, _, _), obj in sorted(
                    self._state.objects.items(), key=lambda kv: kv[0][1:]
                )
                if res == route.resource and view.sees(obj)
            ]
            meta = {"resourceVersion": str(self._state.rv)}
        kind = f"{route.resource.kind}List"
        return {
            "kind": kind,
            "apiVersion": route.resource.api_version,
            "metadata": meta,
            "items": items,
        }

    # -- HTTP side ---------------------------------------------------------------------------

    def _serve(
        self, method: str, route: _Route, query: Mapping[str, str], body: Obj, content: str = ""
    ) -> tuple[int, Obj]:
        res, ns, name = route.resource, route.namespace or "", route.name
        if route.subresource == "status" and name is not None and method in ("GET", "PATCH"):
            with self._cond:
                if method == "GET":
                    obj = self._state.objects.get(_key(res, ns, name))
                    if obj is None:
                        raise _not_found(res, name)
                    return 200, copy.deepcopy(obj)
                if content != "application/merge-patch+json":
                    raise StatusError(
                        415, "UnsupportedMediaType",
                        f"the body of the request was in an unknown format ({content or 'none'});"
                        " this server accepts application/merge-patch+json on /status",
                    )  # fmt: skip
                return 200, self._patch_status(res, ns, name, body)
        if route.subresource is not None:
            pass
        elif res.namespaced and route.namespace is None and method != "GET":
            pass  # only listing and watching span all namespaces
        elif res.create_only:
            if method == "POST" and name is None:
                return 201, self._token_review(body)
        elif method == "GET" and name is None:
            return 200, self._list(route, _Selector.parse(query))
        elif method == "GET" and name is not None:
            with self._cond:
                obj = self._state.objects.get(_key(res, ns, name))
                if obj is None:
                    raise _not_found(res, name)
                return 200, copy.deepcopy(obj)
        elif method == "POST" and name is None:
            with self._cond:
                return 201, self._create(res, ns, body)
        elif method == "PUT" and name is not None:
            with self._cond:
                return 200, self._replace(res, ns, name, body)
        elif method == "PATCH" and name is not None:
            # a strategic merge patch is taken as a JSON merge patch: the same for maps (a
            # ConfigMap's data, labels); lists, which it merges by key, are not patched here
            if content not in ("application/merge-patch+json",
                               "application/strategic-merge-patch+json"):  # fmt: skip
                raise StatusError(
                    415, "UnsupportedMediaType",
                    f"the body of the request was in an unknown format ({content or 'none'});"
                    " this server accepts merge and strategic merge patches of maps",
                )  # fmt: skip
            with self._cond:
                return 200, self._patch(res, ns, name, body)
        elif method == "DELETE" and name is not None:
            with self._cond:
                obj = self._delete(res, ns, name)
            if res.delete_returns_object:
                return 200, obj
            details = {"name": name, "group": res.group, "kind": res.plural}
            details["uid"] = obj["metadata"]["uid"]
            ok = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
            return 200, {**ok, "details": details}
        msg = "the server does not allow this method on the requested resource"
        raise StatusError(405, "MethodNotAllowed", msg)

    def _token_review(self, body: Obj) -> Obj:
        if self.fail_token_reviews:
            raise StatusError(500, "InternalError", "Internal error occurred: injected failure")
        spec = body.get("spec")
        token = spec.get("token") if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or not isinstance(token, str) or not token:
            raise _bad_request("token is required for TokenReview in authentication")
        wanted = [str(a) for a in spec.get("audiences") or ()] or list(API_SERVER_AUDIENCES)
        with self._cond:
            entry = self._state.tokens.get(token)
        status: Obj = {"authenticated": False}
        if entry is None or not entry.authenticated:
            status["error"] = "[invalid bearer token, service account token has been invalidated]"
        elif not (audiences := [a for a in wanted if a in entry.audiences]):
            status["error"] = (
                f"[invalid bearer token, token audiences {_goq(entry.audiences)} is invalid "
                f"for the target audiences {_goq(wanted)}]"
            )
        else:
            user = {"username": entry.username, "uid": entry.uid, "groups": list(entry.groups)}
            status = {"authenticated": True, "user": user, "audiences": audiences}
        meta = {"creationTimestamp": None}
        kind, api_version = "TokenReview", "authentication.k8s.io/v1"
        return {
            "kind": kind,
            "apiVersion": api_version,
            "metadata": meta,
            "spec": spec,
            "status": status,
        }

    def _open_watch(
        self, route: _Route, query: Mapping[str, str]
    ) -> tuple[_Watch, list[WatchEvent], bool]:
        """Registers a watch; returns it, its first events, and whether it already ended (410)."""
        selector = _Selector.parse(query)
        timeout = _int_param(query, "timeoutSeconds")
        rv_text = query.get("resourceVersion", "")
        with self._cond:
            st = self._state
            start = st.rv if rv_text in ("", "0") else _int_param(query, "resourceVersion")
            deadline = time.monotonic() + timeout if timeout else None
            bookmarks = query.get("allowWatchBookmarks", "") in _TRUE
            nb = time.monotonic() + self.bookmark_interval
            watch = _Watch(
                route, selector, start, st.break_epoch, st.bookmark_epoch, bookmarks, nb, deadline
            )
            st.open_watches += 1
            self._cond.notify_all()
            if rv_text in ("", "0"):  # both start with synthetic ADDED events for current state
                items = self._list(route, selector)["items"]
                return watch, [{"type": "ADDED", "object": o} for o in items], False
            if start < st.compacted:
                return watch, [_expired(start, st.rv)], True
            return watch, [], False

    def _next_batch(self, w: _Watch) -> tuple[list[WatchEvent], Literal["more", "end", "abort"]]:
        with self._cond:
            st = self._state
            epochs = (w.break_epoch, w.bookmark_epoch) == (st.break_epoch, st.bookmark_epoch)
            if st.rv <= w.cursor and epochs and not st.stopping:
                self._cond.wait(_POLL_SECONDS)
            if st.stopping or w.break_epoch != st.break_epoch:
                return [], "end" if st.break_graceful and not st.stopping else "abort"
            if w.cursor < st.compacted:  # fell behind a compaction
                return [_expired(w.cursor, st.rv)], "end"
            start = bisect.bisect_right(st.history, w.cursor, key=lambda e: e.rv)
            batch = [t for e in st.history[start:] if (t := w.translate(e)) is not None]
            w.cursor = st.rv
            now = time.monotonic()
            asked, w.bookmark_epoch = w.bookmark_epoch != st.bookmark_epoch, st.bookmark_epoch
            if w.bookmarks and (asked or now >= w.next_bookmark):
                res = w.route.resource
                meta = {"resourceVersion": str(st.rv)}
                bm = {"kind": res.kind, "apiVersion": res.api_version, "metadata": meta}
                batch.append({"type": "BOOKMARK", "object": bm})
                w.next_bookmark = now + self.bookmark_interval
            return batch, "end" if w.deadline is not None and now >= w.deadline else "more"

    def _pod_proxy(
        self, namespace: str, name: str, port: str, path: str | None, query: str
    ) -> tuple[int, bytes, str]:
        """The pods/proxy subresource: a GET to the pod's IP and port, as the API server makes
        it through the kubelet."""
        with self._cond:
            pod = self._state.objects.get(_key(self._kind("v1", "Pod"), namespace, name))
        ip = ((pod or {}).get("status") or {}).get("podIP")
        if pod is None or not ip:
            status = (
                _not_found(self._kind("v1", "Pod"), name)
                if pod is None
                else StatusError(503, "ServiceUnavailable", f"pod {name} has no IP")
            )
            return status.code, json.dumps(status.status()).encode(), "application/json"
        host, mapped = self._pod_address(ip, int(port))
        url = f"http://{host}:{mapped}{path or '/'}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read()
                return response.status, body, response.headers.get("Content-Type", "text/plain")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), "text/plain"
        except OSError as exc:
            error = StatusError(503, "ServiceUnavailable", f"error trying to reach service: {exc}")
            return 503, json.dumps(error.status()).encode(), "application/json"

    def _pod_address(self, ip: str, port: int) -> tuple[str, int]:
        with self._cond:
            return self._state.network.get((ip, port), (ip, port))

    def _running_pod_ip(self, namespace: str, name: str) -> str:
        with self._cond:
            pod = self._state.objects.get(_key(self._kind("v1", "Pod"), namespace, name))
        if pod is None:
            raise _not_found(self._kind("v1", "Pod"), name)
        status = pod.get("status") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            phase = status.get("phase") or "Pending"
            raise _bad_request(f"pod {name} is not running and cannot be port-forwarded: {phase}")
        return str(status["podIP"])

    def _close_watch(self) -> None:
        with self._cond:
            self._state.open_watches -= 1
            self._cond.notify_all()

    def _track(self, method: str, path: str) -> None:
        with self._cond:
            self._state.requests.append((method, path))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: FakeKubeAPI


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    @property
    def api(self) -> FakeKubeAPI:
        return cast(_Server, self.server).api

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._state.connections.add(self.connection)
            if self.api._state.stopping:
                _shutdown(self.connection)

    def finish(self) -> None:
        with self.api._cond:
            self.api._state.connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("fakeapi: " + format, *args)

    def _dispatch(self) -> None:
        api, method = self.api, self.command
        api._track(method, self.path)
        try:
            raw = self._read_body()
            if self.headers.get("Authorization") != f"Bearer {api.token}":
                raise StatusError(401, "Unauthorized", "Unauthorized")
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            if url.path.rstrip("/") == "/version" and method == "GET":
                self._send(200, json.dumps(api.version).encode(), "application/json")
                return
            if (proxied := _POD_PROXY.fullmatch(unquote(url.path))) and method == "GET":
                namespace, name, port, path = proxied.groups()
                self._send(*api._pod_proxy(namespace, name, port, path, url.query))
                return
            if (forward := _PORT_FORWARD.fullmatch(url.path)) and method == "GET":
                namespace, name = forward.groups()
                self._port_forward(namespace, name, parse_qs(url.query))
                return
            route = _route(api, url.path)
            if route.resource.plural in api.forbidden:
                raise _forbidden(route)
            if method == "GET" and route.name is None and query.get("watch", "") in _TRUE:
                self._watch(route, query)
                return
            body: Obj = {}
            if method in ("POST", "PUT", "PATCH"):
                try:
                    body = json.loads(raw)
                except ValueError as exc:
                    raise _bad_request(f"invalid JSON body: {exc}") from None
                if not isinstance(body, dict):
                    raise _bad_request("the request body must be a JSON object")
            content = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            code, payload = api._serve(method, route, query, body, content)
        except StatusError as exc:
            code, payload = exc.code, exc.status()
        except Exception:
            logger.exception("fakeapi: %s %s failed", method, self.path)
            code, payload = 500, StatusError(500, "InternalError", "internal error").status()
        self._send(code, json.dumps(payload).encode(), "application/json")

    def _send(self, code: int, data: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise _bad_request("a body needs a valid Content-Length")
        return self.rfile.read(length)

    def _port_forward(self, namespace: str, name: str, query: Mapping[str, list[str]]) -> None:
        """pods/portforward over WebSocket: per port, channel 2i carries data and 2i+1 errors;
        each channel's first frame is the port (u16, little-endian), then bytes as they come."""
        ip = self.api._running_pod_ip(namespace, name)
        ports: list[int] = []
        for text in ",".join(query.get("ports", [])).split(","):
            if not text.strip().isdigit() or not 0 < int(text) < 65536:
                raise _bad_request(f"invalid port {text!r} in ports={','.join(query['ports'])}")
            ports.append(int(text))
        if not ports:
            raise _bad_request("at least one port must be given in ports")
        offered = [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        key = self.headers.get("Sec-WebSocket-Key")
        if self.headers.get("Upgrade", "").lower() != "websocket" or not key:
            raise _bad_request("Upgrade request required")
        if _WS_PROTOCOL not in offered:
            raise _bad_request(f"no supported port-forward protocol in {offered} ({_WS_PROTOCOL})")
        accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
        self.send_response(101, "Switching Protocols")
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.send_header("Sec-WebSocket-Protocol", _WS_PROTOCOL)
        self.end_headers()
        self.close_connection = True
        _PortForward(self, name, ip, ports).run()

    def _watch(self, route: _Route, query: Mapping[str, str]) -> None:
        watch, batch, ending = self.api._open_watch(route, query)
        outcome: Literal["more", "end", "abort"] = "end" if ending else "more"
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                for event in batch:
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                if outcome != "more":
                    break
                if _peer_closed(self.connection):
                    outcome = "abort"
                    break
                batch, outcome = self.api._next_batch(watch)
            if outcome == "end":
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            outcome = "abort"
        except Exception:
            logger.exception("fakeapi: watch %s failed", self.path)
            outcome = "abort"
        finally:
            self.api._close_watch()
        if outcome == "abort":
            self.close_connection = True
            _shutdown(self.connection)


class _PortForward:
    """One upgraded port-forward connection: client frames go to the pods' sockets, whatever
    those send comes back as frames; it ends when the client closes or every port has ended."""

    def __init__(self, handler: _Handler, pod: str, ip: str, ports: list[int]) -> None:
        self._handler, self._pod, self._ports = handler, pod, ports
        self._addresses = [handler.api._pod_address(ip, port) for port in ports]
        self._write_lock = threading.Lock()
        self._upstreams: list[socket.socket | None] = [None] * len(ports)

    def _send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            size = bytes([n])
        elif n < 1 << 16:
            size = bytes([126]) + n.to_bytes(2, "big")
        else:
            size = bytes([127]) + n.to_bytes(8, "big")
        with self._write_lock:
            self._handler.wfile.write(bytes([0x80 | opcode]) + size + payload)
            self._handler.wfile.flush()

    def _read(self) -> tuple[int, bytes] | None:
        rfile = self._handler.rfile
        head = rfile.read(2)
        if len(head) < 2:
            return None
        opcode, n = head[0] & 0x0F, head[1] & 0x7F
        if n >= 126:
            n = int.from_bytes(rfile.read(2 if n == 126 else 8), "big")
        if n > _WS_MAX_FRAME:
            return None
        mask = rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
        data = rfile.read(n)
        if len(data) < n:
            return None
        key = (mask * (n // 4 + 1))[:n]
        return opcode, (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")

    def _pump(self, index: int, upstream: socket.socket) -> None:
        channel = bytes([2 * index])
        try:
            while data := upstream.recv(65536):
                self._send(0x2, channel + data)
        except OSError:
            pass
        self._upstreams[index] = None
        upstream.close()  # the pod's side ended first (run's cleanup no longer sees it)
        if not any(self._upstreams):
            with contextlib.suppress(OSError):
                self._send(0x8, (1000).to_bytes(2, "big"))
            _shutdown(self._handler.connection)

    def run(self) -> None:
        for i, port in enumerate(self._ports):
            for channel in (2 * i, 2 * i + 1):
                self._send(0x2, bytes([channel]) + port.to_bytes(2, "little"))
        threads = []
        for i, (port, address) in enumerate(zip(self._ports, self._addresses, strict=True)):
            try:
                upstream = socket.create_connection(address, timeout=5)
            except OSError as exc:
                message = (
                    f"error forwarding port {port} to pod {self._pod}: failed to connect to "
                    f"localhost:{port} inside the pod: {exc}"
                )
                self._send(0x2, bytes([2 * i + 1]) + message.encode())
                continue
            upstream.settimeout(None)
            self._upstreams[i] = upstream
            threads.append(threading.Thread(target=self._pump, args=(i, upstream), daemon=True))
        if not any(self._upstreams):
            self._send(0x8, (1011).to_bytes(2, "big"))
            return
        for thread in threads:
            thread.start()
        try:
            while (frame := self._read()) is not None:
                opcode, data = frame
                if opcode == 0x8:
                    break
                if opcode == 0x9:
                    self._send(0xA, data)
                elif opcode in (0x0, 0x2) and data and data[0] % 2 == 0:
                    index = data[0] // 2
                    target = self._upstreams[index] if index < len(self._ports) else None
                    if target is not None:
                        target.sendall(data[1:])
        except OSError:
            pass
        finally:
            for left in self._upstreams:
                if left is not None:
                    _shutdown(left)
                    left.close()
            for thread in threads:
                thread.join(timeout=5)


def _route(api: FakeKubeAPI, path: str) -> _Route:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        rest, group, version = [], "", ""
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    sub = rest[2] if len(rest) == 3 else None
    res = api._resources.get((group, version, rest[0])) if len(rest) in (1, 2, 3) else None
    name = rest[1] if len(rest) >= 2 else None
    if (
        res is None
        or (sub is not None and (sub != "status" or not res.status))
        or (namespace is not None and not res.namespaced)
        or (namespace is None and res.namespaced and name is not None)
    ):
        msg = "the server could not find the requested resource"
        raise StatusError(404, "NotFound", msg, {})
    return _Route(res, namespace, name, sub)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge key by key, null deletes, anything else
    (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


def _forbidden(route: _Route) -> StatusError:
    res = route.resource
    verb = "list" if route.name is None else "get"
    what = f'{res.plural} "{route.name}"' if route.name else res.plural
    where = f'in the namespace "{route.namespace}"' if route.namespace else "at the cluster scope"
    message = (
        f'{what} is forbidden: User "system:serviceaccount:default:fake" cannot {verb} '
        f'resource "{res.plural}" in API group "{res.group}" {where}'
    )
    return StatusError(403, "Forbidden", message, {"name": route.name or "", "kind": res.plural})


def _key(res: Resource, ns: str, name: str) -> tuple[Resource, str, str]:
    return (res, ns if res.namespaced else "", name)


def _expired(requested: int, current: int) -> WatchEvent:
    msg = f"too old resource version: {requested} ({current})"
    return {"type": "ERROR", "object": StatusError(410, "Expired", msg).status()}


def _int_param(query: Mapping[str, str], name: str) -> int:
    try:
        return int(query.get(name) or 0)
    except ValueError:
        raise _bad_request(f"invalid {name}: {query.get(name)!r}") from None


def _goq(values: Sequence[str]) -> str:
    return "[" + " ".join(json.dumps(v) for v in values) + "]"


def _peer_closed(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _leaves(patch: Any) -> list[Any]:
    """Every value under a patch's maps."""
    if not isinstance(patch, dict):
        return [patch]
    return [leaf for value in patch.values() for leaf in _leaves(value)]
