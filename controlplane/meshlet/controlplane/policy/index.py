"""Owns the policy model: pods, namespaces and policy resources in memory, and the inbound
`Server` message of each watched (namespace, pod, port), recomputed when something it depends on
changes and published only when its bytes change.

The translation is Linkerd's policy controller's (`k8s/index/src/inbound/index.rs`,
`grpc/src/inbound.rs`): the oldest Server (then by name) that selects a pod's port wins it; its
authorizations come from AuthorizationPolicies that target it or its namespace, plus its
`accessPolicy` as a default authorization; routes attached to it carry the policies that target
them, and a `default` route (with a `probe` route for the pod's HTTP probes) stands in when none
is attached. A port no Server selects gets the default policy: the pod's
`config.meshlet.io/default-inbound-policy`, else its namespace's, else the controller's.

The policy resources themselves are the catalog's (meshlet.controlplane.policy.catalog: each
object read once, shared with the outbound index); this index keeps the pods and namespaces,
and the watches.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from google.protobuf import duration_pb2

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
    wellknown,
)
from meshlet.api.ports import parse_ports
from meshlet.controlplane.k8s.events import Delete, Event, Kind, Object, Snapshot, Upsert
from meshlet.controlplane.policy import resources as r
from meshlet.controlplane.policy.catalog import KINDS, Catalog, Space
from meshlet.controlplane.policy.mailbox import Mailbox
from meshlet.controlplane.policy.routes import GrpcMatch, HttpMatch, Route
from meshlet.controlplane.policy.wire import header_match, host_match, http_match, request_modifier

log = logging.getLogger(__name__)

ALL_NETWORKS: Final = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
LINKERD_CLUSTER_NETWORKS: Final = "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8"

Key = tuple[str, str]  # (namespace, name)
PortKey = tuple[str, str, int]  # (namespace, pod, port)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    networks: tuple[r.Network, ...]  # what `cluster-*` defaults admit
    default_policy: str = "all-unauthenticated"
    control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE
    trust_domain: str = wellknown.TRUST_DOMAIN
    probe_networks: tuple[r.Network, ...] = ALL_NETWORKS
    detect_timeout: float = wellknown.DETECT_TIMEOUT_SECONDS

    def identity(self, serviceaccount: str, namespace: str) -> str:
        return wellknown.identity_name(
            serviceaccount, namespace, self.control_ns, self.trust_domain
        )


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    serviceaccount: str
    ports: Mapping[str, frozenset[int]]  # container port name → numbers
    probes: Mapping[int, frozenset[str]]  # port → HTTP probe paths


def pod_of(obj: Mapping[str, Any]) -> Pod | None:
    """The parts of a Pod object policy reads; None without a name. Lenient: a malformed field
    is read as absent (the API server has validated pods)."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    assert isinstance(meta, dict) and isinstance(spec, dict)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    ports: dict[str, set[int]] = {}
    probes: dict[int, set[str]] = {}
    for container in _dicts(spec.get("containers")):
        named: dict[str, int] = {}
        for port in _dicts(container.get("ports")):
            number, pname = port.get("containerPort"), port.get("name")
            if port.get("protocol", "TCP") != "TCP" or not isinstance(number, int):
                continue
            if isinstance(pname, str) and pname:
                ports.setdefault(pname, set()).add(number)
                named[pname] = number
        for probe_field in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(probe_field)
            get = probe.get("httpGet") if isinstance(probe, dict) else None
            if not isinstance(get, dict):
                continue
            port_ref = get.get("port")
            number = named.get(port_ref) if isinstance(port_ref, str) else port_ref
            path = get.get("path") or "/"
            if isinstance(number, int) and isinstance(path, str):
                probes.setdefault(number, set()).add(path)
    return Pod(
        namespace=str(meta.get("namespace") or "default"),
        name=name,
        labels=_strings(meta.get("labels")),
        annotations=_strings(meta.get("annotations")),
        serviceaccount=str(spec.get("serviceAccountName") or "default"),
        ports={k: frozenset(v) for k, v in ports.items()},
        probes={k: frozenset(v) for k, v in probes.items()},
    )


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _strings(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


# -- the translation (pure) ------------------------------------------------------------------


@dataclass(slots=True)
class Namespace:
    """One namespace's objects: its pods and annotations, and its policy resources (the
    catalog's, shared)."""

    annotations: Mapping[str, str] = field(default_factory=dict)
    pods: dict[str, Pod] = field(default_factory=dict)
    resources: Space = field(default_factory=dict)

    def of(self, kind: Kind) -> dict[str, Any]:
        return self.resources.get(kind, {})


def _net(network: r.Network) -> net_pb2.IPNetwork:
    if network.version == 4:
        ip = net_pb2.IPAddress(ipv4=int(network.network_address))
    else:
        value = int(network.network_address)
        ip = net_pb2.IPAddress(ipv6=net_pb2.IPv6(first=value >> 64, last=value & (2**64 - 1)))
    return net_pb2.IPNetwork(ip=ip, prefix_len=network.prefixlen)


def _labels(group: str, kind: str, name: str) -> dict[str, str]:
    return {"group": group, "kind": kind, "name": name}


def _authz(
    ref: tuple[str, str],  # ("default", policy name) or ("authorizationpolicy", name)
    networks: Iterable[r.NetworkMatch],
    identities: tuple[str, ...] | None,  # None: unauthenticated; else names and `*` forms
) -> inbound_pb2.Authz:
    kind, name = ref
    if kind == "default":
        metadata = meta_pb2.Metadata(default=name)
        labels = _labels("", "default", name)
    else:
        metadata = meta_pb2.Metadata(
            resource=meta_pb2.Resource(group=r.GROUP, kind=kind, name=name)
        )
        labels = _labels(r.GROUP, kind, name)
    nets = [
        inbound_pb2.Network(net=_net(n.net), **{"except": [_net(e) for e in n.excepts]})
        for n in networks
    ]
    if identities is None:
        authn = inbound_pb2.Authn(unauthenticated=inbound_pb2.Authn.PermitUnauthenticated())
    else:
        clients = inbound_pb2.Authn.PermitMeshTLS.PermitClientIdentities(
            identities=[inbound_pb2.Identity(name=i) for i in identities if not i.startswith("*")],
            suffixes=[
                inbound_pb2.IdentitySuffix(parts=[] if i == "*" else i[2:].split("."))
                for i in identities
                if i.startswith("*")
            ],
        )
        authn = inbound_pb2.Authn(meshTLS=inbound_pb2.Authn.PermitMeshTLS(identities=clients))
    return inbound_pb2.Authz(networks=nets, authentication=authn, labels=labels, metadata=metadata)


def _plain(networks: Iterable[r.Network]) -> tuple[r.NetworkMatch, ...]:
    return tuple(r.NetworkMatch(n, ()) for n in networks)


def default_authzs(policy: str, cluster: ClusterConfig) -> list[inbound_pb2.Authz]:
    """A default policy's authorizations, as Linkerd's `DefaultPolicy::default_authzs`: `deny`
    none; `audit` every client, named `audit` so the proxy allows and reports."""
    if policy == "deny":
        return []
    if policy == "audit":
        return [_authz(("default", policy), _plain(ALL_NETWORKS), None)]
    scope, _, auth = policy.partition("-")
    networks = cluster.networks if scope == "cluster" else ALL_NETWORKS
    identities = ("*",) if auth == "authenticated" else None
    return [_authz(("default", policy), _plain(networks), identities)]


class Translator:
    """Computes the Server message of a pod's port from the index's namespaces."""

    def __init__(self, cluster: ClusterConfig, namespaces: Mapping[str, Namespace]) -> None:
        self.cluster = cluster
        self.namespaces = namespaces

    def server(self, pod: Pod, port: int) -> inbound_pb2.Server:
        ns = self.namespaces.get(pod.namespace) or Namespace()
        selected = self._select(ns, pod, port)
        if selected is None:
            return self._default(ns, pod, port)
        srv: r.Server = selected
        authzs = self._policy_authzs(
            ns,
            pod.namespace,
            lambda t: (
                (t.targets(r.GROUP, "Server") and t.name == srv.meta.name)
                or t.targets("", "Namespace")
            ),
        )
        authzs += default_authzs(srv.access_policy, self.cluster)
        protocol = self._protocol(ns, pod, port, srv)
        return inbound_pb2.Server(
            protocol=protocol,
            authorizations=authzs,
            labels=_labels(r.GROUP, "server", srv.meta.name),
        )

    def _select(self, ns: Namespace, pod: Pod, port: int) -> r.Server | None:
        """The oldest (then first by name) Server selecting the port: Linkerd's tie-break."""
        servers: list[r.Server] = sorted(
            ns.of(Kind.SERVER).values(), key=lambda s: (s.meta.created, s.meta.name)
        )
        for srv in servers:
            if not srv.selector.matches(pod.labels):
                continue
            if srv.port == port or (
                isinstance(srv.port, str) and port in pod.ports.get(srv.port, ())
            ):
                return srv
        return None

    def _default_policy(self, ns: Namespace, pod: Pod) -> str:
        for where, notes in (("pod", pod.annotations), ("namespace", ns.annotations)):
            value = notes.get(wellknown.DEFAULT_INBOUND_POLICY_ANNOTATION)
            if value in wellknown.DEFAULT_INBOUND_POLICIES:
                return value
            if value is not None:
                log.debug("%s/%s: ignored %s annotation %r", pod.namespace, pod.name, where, value)
        return self.cluster.default_policy

    def _ports_annotation(self, ns: Namespace, pod: Pod, key: str, port: int) -> bool:
        for notes in (pod.annotations, ns.annotations):
            if key in notes:
                try:
                    return port in parse_ports(notes[key])
                except ValueError:
                    return False
        return False

    def _default(self, ns: Namespace, pod: Pod, port: int) -> inbound_pb2.Server:
        policy = self._default_policy(ns, pod)
        if policy.endswith("-unauthenticated") and self._ports_annotation(
            ns, pod, wellknown.REQUIRE_IDENTITY_PORTS_ANNOTATION, port
        ):
            policy = policy.replace("-unauthenticated", "-authenticated")
        if self._ports_annotation(ns, pod, wellknown.OPAQUE_PORTS_ANNOTATION, port):
            protocol = inbound_pb2.ProxyProtocol(opaque=inbound_pb2.ProxyProtocol.Opaque())
        else:
            protocol = inbound_pb2.ProxyProtocol(
                detect=inbound_pb2.ProxyProtocol.Detect(
                    timeout=self._timeout(), http_routes=self._default_http_routes(pod, port)
                )
            )
        return inbound_pb2.Server(
            protocol=protocol,
            authorizations=default_authzs(policy, self.cluster),
            labels=_labels("", "default", policy),
        )

    def _timeout(self) -> duration_pb2.Duration:
        d = duration_pb2.Duration()
        d.FromNanoseconds(int(self.cluster.detect_timeout * 1e9))
        return d

    def _default_http_routes(self, pod: Pod, port: int) -> list[inbound_pb2.HttpRoute]:
        """Linkerd's default route (every request, the Server's own authorizations), and a
        `probe` route admitting the pod's HTTP probes from the probe networks."""
        everything = http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(prefix="/"))
        routes = [
            inbound_pb2.HttpRoute(
                metadata=meta_pb2.Metadata(default="default"),
                rules=[inbound_pb2.HttpRoute.Rule(matches=[everything])],
            )
        ]
        paths = sorted(pod.probes.get(port, ()))
        if paths and self.cluster.probe_networks:
            get = http_types_pb2.HttpMethod(registered=http_types_pb2.HttpMethod.GET)
            matches = [
                http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(exact=p), method=get)
                for p in paths
            ]
            routes.append(
                inbound_pb2.HttpRoute(
                    metadata=meta_pb2.Metadata(default="probe"),
                    rules=[inbound_pb2.HttpRoute.Rule(matches=matches)],
                    authorizations=[
                        _authz(("default", "probe"), _plain(self.cluster.probe_networks), None)
                    ],
                )
            )
        return routes

    def _protocol(
        self, ns: Namespace, pod: Pod, port: int, srv: r.Server
    ) -> inbound_pb2.ProxyProtocol:
        P = inbound_pb2.ProxyProtocol
        name = srv.meta.name
        match srv.protocol:
            case "opaque":
                return P(opaque=P.Opaque())
            case "TLS":
                return P(tls=P.Tls())
            case "gRPC":
                return P(grpc=P.Grpc(routes=self._grpc_routes(ns, pod.namespace, name)))
        http = self._http_routes(ns, pod, port, name)
        limit = self._rate_limit(ns, pod.namespace, name)
        match srv.protocol:
            case "HTTP/1":
                return P(http1=P.Http1(routes=http, local_rate_limit=limit))
            case "HTTP/2":
                return P(http2=P.Http2(routes=http, local_rate_limit=limit))
        return P(
            detect=P.Detect(timeout=self._timeout(), http_routes=http, http_local_rate_limit=limit)
        )

    def _route_authzs(
        self, ns: Namespace, namespace: str, group: str, kind: str, name: str
    ) -> list[inbound_pb2.Authz]:
        def targets(t: r.Ref) -> bool:
            return t.targets(group, kind) and t.name == name

        return self._policy_authzs(ns, namespace, targets)

    def _attached(self, ns: Namespace, kinds: tuple[Kind, Kind], server: str) -> list[Any]:
        routes = [rt for kind in kinds for rt in ns.of(kind).values() if server in rt.servers]
        return sorted(
            routes, key=lambda rt: (rt.meta.created == "", rt.meta.created, rt.group, rt.meta.name)
        )

    def _http_routes(
        self, ns: Namespace, pod: Pod, port: int, server: str
    ) -> list[inbound_pb2.HttpRoute]:
        attached: list[Route] = self._attached(
            ns, (Kind.HTTP_ROUTE, Kind.GATEWAY_HTTP_ROUTE), server
        )
        if not attached:
            return self._default_http_routes(pod, port)
        return [
            inbound_pb2.HttpRoute(
                metadata=meta_pb2.Metadata(
                    resource=meta_pb2.Resource(group=rt.group, kind="HTTPRoute", name=rt.meta.name)
                ),
                hosts=[host_match(h) for h in rt.hostnames],
                authorizations=self._route_authzs(
                    ns, pod.namespace, rt.group, "HTTPRoute", rt.meta.name
                ),
                rules=[
                    inbound_pb2.HttpRoute.Rule(
                        matches=[http_match(m) for m in rule.matches if isinstance(m, HttpMatch)],
                        filters=[
                            inbound_pb2.HttpRoute.Filter(
                                request_header_modifier=request_modifier(f)
                            )
                            for f in rule.request_modifiers
                        ],
                    )
                    for rule in rt.rules
                ],
            )
            for rt in attached
        ]

    def _grpc_routes(
        self, ns: Namespace, namespace: str, server: str
    ) -> list[inbound_pb2.GrpcRoute]:
        attached: list[Route] = self._attached(
            ns, (Kind.GRPC_ROUTE, Kind.GATEWAY_GRPC_ROUTE), server
        )
        if not attached:
            every = grpc_route_pb2.GrpcRouteMatch(rpc=grpc_route_pb2.GrpcRpcMatch())
            return [
                inbound_pb2.GrpcRoute(
                    metadata=meta_pb2.Metadata(default="default"),
                    rules=[inbound_pb2.GrpcRoute.Rule(matches=[every])],
                )
            ]
        return [
            inbound_pb2.GrpcRoute(
                metadata=meta_pb2.Metadata(
                    resource=meta_pb2.Resource(group=rt.group, kind="GRPCRoute", name=rt.meta.name)
                ),
                hosts=[host_match(h) for h in rt.hostnames],
                authorizations=self._route_authzs(
                    ns, namespace, rt.group, "GRPCRoute", rt.meta.name
                ),
                rules=[
                    inbound_pb2.GrpcRoute.Rule(
                        matches=[
                            grpc_route_pb2.GrpcRouteMatch(
                                rpc=grpc_route_pb2.GrpcRpcMatch(
                                    service=m.service or "", method=m.method or ""
                                ),
                                headers=[header_match(h) for h in m.headers],
                            )
                            for m in rule.matches
                            if isinstance(m, GrpcMatch)
                        ],
                        filters=[
                            inbound_pb2.GrpcRoute.Filter(
                                request_header_modifier=request_modifier(f)
                            )
                            for f in rule.request_modifiers
                        ],
                    )
                    for rule in rt.rules
                ],
            )
            for rt in attached
        ]

    def _rate_limit(
        self, ns: Namespace, namespace: str, server: str
    ) -> inbound_pb2.HttpLocalRateLimit | None:
        policies: list[r.HTTPLocalRateLimitPolicy] = sorted(
            (p for p in ns.of(Kind.RATE_LIMIT_POLICY).values() if p.server == server),
            key=lambda p: (p.meta.created, p.meta.name),
        )
        if not policies:
            return None
        p = policies[0]
        L = inbound_pb2.HttpLocalRateLimit
        return L(
            metadata=meta_pb2.Metadata(
                resource=meta_pb2.Resource(
                    group=r.GROUP, kind="HTTPLocalRateLimitPolicy", name=p.meta.name
                )
            ),
            total=L.Limit(requestsPerSecond=p.total) if p.total is not None else None,
            identity=L.Limit(requestsPerSecond=p.identity) if p.identity is not None else None,
            overrides=[
                L.Override(
                    limit=L.Limit(requestsPerSecond=o.requests_per_second),
                    clients=L.Override.ClientIdentities(
                        identities=[
                            inbound_pb2.Identity(
                                name=self.cluster.identity(c.name, c.namespace or namespace)
                            )
                            for c in o.clients
                        ]
                    ),
                )
                for o in p.overrides
            ],
        )

    def _policy_authzs(
        self, ns: Namespace, namespace: str, targets: Callable[[r.Ref], bool]
    ) -> list[inbound_pb2.Authz]:
        out = []
        policies: dict[str, r.AuthorizationPolicy] = ns.of(Kind.AUTHORIZATION_POLICY)
        for name in sorted(policies):
            policy = policies[name]
            if not targets(policy.target):
                continue
            try:
                networks, identities = self._authentication(namespace, policy)
            except LookupError as exc:
                log.info("AuthorizationPolicy %s/%s not applied: %s", namespace, name, exc)
                continue
            out.append(_authz(("authorizationpolicy", name), networks, identities))
        return out

    def _authentication(
        self, namespace: str, policy: r.AuthorizationPolicy
    ) -> tuple[tuple[r.NetworkMatch, ...], tuple[str, ...] | None]:
        networks: tuple[r.NetworkMatch, ...] = _plain(ALL_NETWORKS)
        identities: tuple[str, ...] | None = None
        for ref in policy.authentications:
            where = ref.namespace or namespace
            if ref.targets("", "ServiceAccount"):
                identities = (self.cluster.identity(ref.name, where),)
                continue
            found = (
                (self.namespaces.get(where) or Namespace())
                .of(
                    Kind.MESH_TLS_AUTHENTICATION
                    if ref.kind.lower() == "meshtlsauthentication"
                    else Kind.NETWORK_AUTHENTICATION
                )
                .get(ref.name)
            )
            if found is None:
                raise LookupError(f"{ref.kind} {where}/{ref.name} does not exist")
            if isinstance(found, r.MeshTLSAuthentication):
                identities = found.identities + tuple(
                    self.cluster.identity(i.name, i.namespace or where)
                    if i.targets("", "ServiceAccount")
                    else f"*.{i.name}.serviceaccount.identity.{self.cluster.control_ns}."
                    f"{self.cluster.trust_domain}"
                    for i in found.identity_refs
                )
            elif isinstance(found, r.NetworkAuthentication):
                networks = found.networks
        return networks, identities


# -- the index (state and watches) -----------------------------------------------------------


@dataclass(slots=True)
class _Watch:
    message: bytes
    mailboxes: set[Mailbox] = field(default_factory=set)


class Index:
    """Applies source events; answers `get` and keeps `subscribe`d mailboxes current. The
    policy resources are `catalog`'s (its own, or one shared with the outbound index)."""

    def __init__(self, cluster: ClusterConfig, catalog: Catalog | None = None) -> None:
        self.cluster = cluster
        self.catalog = catalog or Catalog()
        self.namespaces: dict[str, Namespace] = {}
        self.translator = Translator(cluster, self.namespaces)
        self._watches: dict[str, dict[tuple[str, int], _Watch]] = {}  # by namespace
        self.recomputed = 0  # watched ports recomputed (for tests and metrics)

    @property
    def invalid(self) -> int:
        """Objects ignored for their problems (counted once per version)."""
        return self.catalog.invalid

    # -- questions --

    def pod(self, namespace: str, name: str) -> Pod | None:
        ns = self.namespaces.get(namespace)
        return ns.pods.get(name) if ns is not None else None

    def get(self, namespace: str, pod: str, port: int) -> inbound_pb2.Server | None:
        found = self.pod(namespace, pod)
        return self.translator.server(found, port) if found is not None else None

    def subscribe(self, namespace: str, pod: str, port: int, mailbox: Mailbox) -> bool:
        """Puts the port's policy in `mailbox` now and at each change; False: no such pod."""
        found = self.pod(namespace, pod)
        if found is None:
            return False
        watches = self._watches.setdefault(namespace, {})
        watch = watches.get((pod, port))
        if watch is None:
            message = self.translator.server(found, port).SerializeToString(deterministic=True)
            watch = watches[(pod, port)] = _Watch(message)
        watch.mailboxes.add(mailbox)
        mailbox.put(watch.message)
        return True

    def unsubscribe(self, namespace: str, pod: str, port: int, mailbox: Mailbox) -> None:
        watches = self._watches.get(namespace, {})
        watch = watches.get((pod, port))
        if watch is None:
            return
        watch.mailboxes.discard(mailbox)
        if not watch.mailboxes:
            del watches[(pod, port)]
            if not watches:
                del self._watches[namespace]

    @property
    def watched(self) -> int:
        return sum(len(w) for w in self._watches.values())

    # -- changes --

    def apply(self, event: Event) -> int:
        """Applies a source event; the number of watches whose policy changed."""
        touched: set[tuple[str, str | None]] = set()
        if event.kind in KINDS:
            for change in self.catalog.apply(event):
                self._namespace(change.namespace)
                touched |= self._affected(change.kind, change.namespace)
        elif isinstance(event, Snapshot):
            touched = self._replace(event.kind, event.objects)
        elif isinstance(event, Upsert):
            touched = self._upsert(event.kind, event.obj)
        elif isinstance(event, Delete):
            touched = self._delete(event.kind, event.obj)
        return self._refresh(touched)

    def _namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = self.namespaces[name] = Namespace(resources=self.catalog.space(name))
        return ns

    def _replace(self, kind: Kind, objects: tuple[Object, ...]) -> set[tuple[str, str | None]]:
        seen: set[tuple[str, str]] = set()
        touched: set[tuple[str, str | None]] = set()
        for obj in objects:
            touched |= self._upsert(kind, obj)
            key = _key(kind, obj)
            if key is not None:
                seen.add(key)
        for namespace, ns in list(self.namespaces.items()):
            names: Iterable[str]
            if kind is Kind.NAMESPACE:
                names = [namespace] if ns.annotations and (namespace, namespace) not in seen else []
            elif kind is Kind.POD:
                names = [n for n in ns.pods if (namespace, n) not in seen]
            else:
                names = []
            for name in list(names):
                touched |= self._remove(kind, namespace, name)
        return touched

    def _upsert(self, kind: Kind, obj: Object) -> set[tuple[str, str | None]]:
        """A namespace or a pod (the policy kinds are the catalog's; other kinds, Services and
        ServiceProfiles, are outbound's and the status writer's)."""
        key = _key(kind, obj)
        if key is None:
            return set()
        namespace, name = key
        if kind is Kind.NAMESPACE:
            meta = obj.get("metadata") or {}
            annotations = _strings(meta.get("annotations") if isinstance(meta, dict) else None)
            ns = self._namespace(name)
            if ns.annotations == annotations:
                return set()
            ns.annotations = annotations
            return {(name, None)}
        if kind is not Kind.POD:
            return set()
        ns = self._namespace(namespace)
        pod = pod_of(obj)
        if pod is None or ns.pods.get(name) == pod:
            return set()
        ns.pods[name] = pod
        return {(namespace, name)}

    def _delete(self, kind: Kind, obj: Object) -> set[tuple[str, str | None]]:
        key = _key(kind, obj)
        return set() if key is None else self._remove(kind, *key)

    def _remove(self, kind: Kind, namespace: str, name: str) -> set[tuple[str, str | None]]:
        ns = self.namespaces.get(namespace if kind is not Kind.NAMESPACE else name)
        if ns is None:
            return set()
        if kind is Kind.NAMESPACE:
            if not ns.annotations:
                return set()
            ns.annotations = {}
            return {(name, None)}
        if kind is Kind.POD and ns.pods.pop(name, None) is not None:
            self._close_pod(namespace, name)
        return set()

    def _affected(self, kind: Kind, namespace: str) -> set[tuple[str, str | None]]:
        """The namespaces whose ports a resource of `kind` in `namespace` can change: its own,
        and for authentications every namespace with a policy that names them there."""
        touched: set[tuple[str, str | None]] = {(namespace, None)}
        if kind in (Kind.MESH_TLS_AUTHENTICATION, Kind.NETWORK_AUTHENTICATION):
            for other in self._watches:
                policies = self.catalog.of(other, Kind.AUTHORIZATION_POLICY)
                if any(
                    ref.namespace == namespace
                    for p in policies.values()
                    if isinstance(p, r.AuthorizationPolicy)
                    for ref in p.authentications
                ):
                    touched.add((other, None))
        return touched

    def _close_pod(self, namespace: str, name: str) -> None:
        watches = self._watches.get(namespace, {})
        for key in [k for k in watches if k[0] == name]:
            for mailbox in watches.pop(key).mailboxes:
                mailbox.close()

    def _refresh(self, touched: set[tuple[str, str | None]]) -> int:
        changed = 0
        for namespace, pod_name in touched:
            watches = self._watches.get(namespace, {})
            for (name, port), watch in watches.items():
                if pod_name is not None and name != pod_name:
                    continue
                pod = self.pod(namespace, name)
                if pod is None:
                    continue
                self.recomputed += 1
                message = self.translator.server(pod, port).SerializeToString(deterministic=True)
                if message == watch.message:
                    continue
                watch.message = message
                changed += 1
                for mailbox in watch.mailboxes:
                    mailbox.put(message)
        return changed


def _key(kind: Kind, obj: Object) -> Key | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    name = meta["name"]
    if kind is Kind.NAMESPACE:
        return name, name
    namespace = meta.get("namespace")
    return (namespace if isinstance(namespace, str) and namespace else "default"), name


def parse_networks(text: str) -> tuple[r.Network, ...]:
    """`--cluster-networks`: comma-separated CIDRs; ValueError naming each bad one."""
    networks, bad = [], []
    for item in (part.strip() for part in text.split(",")):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            bad.append(repr(item))
    if bad or not networks:
        raise ValueError(
            f"{', '.join(bad) or 'nothing'} is not a CIDR list such as 10.0.0.0/8,fd00::/8"
        )
    return tuple(networks)
