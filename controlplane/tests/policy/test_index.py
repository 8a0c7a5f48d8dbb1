"""The index's translation, as Linkerd's policy controller translates, and its watches."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from meshlet.api import inbound_pb2, wellknown
from meshlet.controlplane.k8s.events import Delete, Kind, Snapshot, Upsert
from meshlet.controlplane.policy.index import (
    LINKERD_CLUSTER_NETWORKS,
    ClusterConfig,
    Index,
    parse_networks,
)
from meshlet.controlplane.policy.mailbox import Mailbox

G = "policy.meshlet.io"
ANN = wellknown.DEFAULT_INBOUND_POLICY_ANNOTATION
CLUSTER = ClusterConfig(networks=parse_networks(LINKERD_CLUSTER_NETWORKS))


def pod(
    name: str = "web-1",
    ns: str = "ns",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels or {"app": "web"},
            "annotations": annotations or {},
        },
        "spec": {
            "serviceAccountName": "web",
            "containers": [
                {
                    "name": "c",
                    "ports": [
                        {"name": "http", "containerPort": 8080},
                        {"name": "admin", "containerPort": 9000},
                    ],
                    "livenessProbe": {"httpGet": {"port": "admin", "path": "/live"}},
                }
            ],
        },
    }


def res(
    kind: str,
    name: str,
    spec: dict[str, Any],
    version: str = "v1alpha1",
    ns: str = "ns",
    created: str = "",
) -> dict[str, Any]:
    api = version if "/" in version else f"{G}/{version}"
    meta = {"name": name, "namespace": ns}
    if created:
        meta["creationTimestamp"] = created
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec}


def server(name: str = "web", port: Any = "http", created: str = "", **spec: Any) -> dict[str, Any]:
    return res(
        "Server",
        name,
        {"podSelector": {"matchLabels": {"app": "web"}}, "port": port, **spec},
        "v1beta3",
        created=created,
    )


def policy(name: str, target: dict[str, Any], refs: list[dict[str, Any]]) -> dict[str, Any]:
    return res(
        "AuthorizationPolicy", name, {"targetRef": target, "requiredAuthenticationRefs": refs}
    )


SRV = {"group": G, "kind": "Server", "name": "web"}


def index(
    *objs: dict[str, Any],
    namespace_annotations: dict[str, str] | None = None,
    cluster: ClusterConfig = CLUSTER,
) -> Index:
    idx = Index(cluster)
    idx.apply(
        Upsert(
            Kind.NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": "ns", "annotations": namespace_annotations or {}},
            },
        )
    )
    for o in objs:
        kind = Kind.of(o["apiVersion"], o["kind"])
        assert kind is not None
        idx.apply(Upsert(kind, o))
    return idx


def nets(authz: inbound_pb2.Authz) -> list[str]:
    out = []
    for n in authz.networks:
        ip = n.net.ip
        addr: Any = (
            ipaddress.IPv4Address(ip.ipv4)
            if ip.HasField("ipv4")
            else ipaddress.IPv6Address((ip.ipv6.first << 64) | ip.ipv6.last)
        )
        out.append(
            f"{addr}/{n.net.prefix_len}"
            + "".join(
                f" -{ipaddress.ip_address(e.ip.ipv4)}/{e.prefix_len}" for e in getattr(n, "except")
            )
        )
    return out


def authn(authz: inbound_pb2.Authz) -> Any:
    a = authz.authentication
    if a.HasField("unauthenticated"):
        return "unauthenticated"
    ids = a.meshTLS.identities
    return sorted(
        [i.name for i in ids.identities]
        + ["*" + "".join("." + p for p in s.parts) for s in ids.suffixes]
    )


def get(idx: Index, port: int = 8080, name: str = "web-1") -> inbound_pb2.Server:
    found = idx.get("ns", name, port)
    assert found is not None
    return found


ALL = ["0.0.0.0/0", "::/0"]
CLUSTER_NETS = ["10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "fd00::/8"]


@pytest.mark.parametrize(
    ("default", "networks", "authentication"),
    [
        ("all-unauthenticated", ALL, "unauthenticated"),
        ("all-authenticated", ALL, ["*"]),
        ("cluster-unauthenticated", CLUSTER_NETS, "unauthenticated"),
        ("cluster-authenticated", CLUSTER_NETS, ["*"]),
        ("audit", ALL, "unauthenticated"),
        ("deny", None, None),
    ],
)
def test_every_default_policy(default: str, networks: Any, authentication: Any) -> None:
    cluster = ClusterConfig(networks=CLUSTER.networks, default_policy=default)
    srv = get(index(pod(), cluster=cluster))
    assert dict(srv.labels) == {"group": "", "kind": "default", "name": default}
    assert srv.protocol.detect.timeout.seconds == 10
    if networks is None:
        assert list(srv.authorizations) == []
        return
    [authz] = srv.authorizations
    assert authz.metadata.default == default
    assert nets(authz) == networks and authn(authz) == authentication


def test_annotation_precedence_pod_over_namespace_over_cluster() -> None:
    assert get(index(pod())).labels["name"] == "all-unauthenticated"
    ns_only = index(pod(), namespace_annotations={ANN: "deny"})
    assert get(ns_only).labels["name"] == "deny"
    both = index(pod(annotations={ANN: "audit"}), namespace_annotations={ANN: "deny"})
    assert get(both).labels["name"] == "audit"
    bad_pod = index(pod(annotations={ANN: "nonsense"}), namespace_annotations={ANN: "deny"})
    assert get(bad_pod).labels["name"] == "deny"


def test_the_default_route_and_the_probe_route() -> None:
    routes = get(index(pod()), 9000).protocol.detect.http_routes
    assert [r.metadata.default for r in routes] == ["default", "probe"]
    assert routes[0].rules[0].matches[0].path.prefix == "/"
    assert routes[1].rules[0].matches[0].path.exact == "/live"
    assert nets(routes[1].authorizations[0]) == ALL
    assert [r.metadata.default for r in get(index(pod())).protocol.detect.http_routes] == [
        "default"
    ]


def test_server_by_port_name_and_by_number_with_its_protocol_and_access_policy() -> None:
    idx = index(pod(), server(proxyProtocol="HTTP/2"), server("num", 9000, proxyProtocol="opaque"))
    srv = get(idx)
    assert dict(srv.labels) == {"group": G, "kind": "server", "name": "web"}
    assert srv.protocol.HasField("http2")
    assert list(srv.authorizations) == []  # accessPolicy defaults to deny
    assert get(idx, 9000).protocol.HasField("opaque")
    assert get(idx, 9000).labels["name"] == "num"
    audit = get(index(pod(), server(accessPolicy="audit")))
    [authz] = audit.authorizations
    assert authz.metadata.default == "audit" and authn(authz) == "unauthenticated"


def test_a_server_selects_by_labels() -> None:
    other = index(pod(labels={"app": "other"}), server())
    assert get(other).labels["kind"] == "default"
    exprs = server(
        podSelector={"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["other"]}]}
    )
    assert get(index(pod(), exprs)).labels["kind"] == "server"


def test_the_oldest_server_wins_a_port() -> None:
    idx = index(
        pod(),
        server("b", created="2024-01-01T00:00:00Z"),
        server("a", created="2024-02-01T00:00:00Z"),
    )
    assert get(idx).labels["name"] == "b"


def test_meshtls_identities_suffixes_and_service_accounts() -> None:
    idx = index(
        pod(),
        server(),
        policy("p", SRV, [{"group": G, "kind": "MeshTLSAuthentication", "name": "m"}]),
        res(
            "MeshTLSAuthentication",
            "m",
            {
                "identities": [
                    "*",
                    "a.b.c",
                    "*.other.serviceaccount.identity.meshlet.cluster.local",
                ],
                "identityRefs": [
                    {"kind": "ServiceAccount", "name": "sa"},
                    {"kind": "Namespace", "name": "team"},
                ],
            },
        ),
    )
    [authz] = get(idx).authorizations
    assert authz.metadata.resource.kind == "authorizationpolicy"
    assert authz.metadata.resource.name == "p"
    assert nets(authz) == ALL
    assert authn(authz) == sorted(
        [
            "*",
            "a.b.c",
            "*.other.serviceaccount.identity.meshlet.cluster.local",
            "sa.ns.serviceaccount.identity.meshlet.cluster.local",
            "*.team.serviceaccount.identity.meshlet.cluster.local",
        ]
    )
    sa = index(
        pod(),
        server(),
        policy("p", SRV, [{"kind": "ServiceAccount", "name": "c", "namespace": "x"}]),
    )
    assert authn(get(sa).authorizations[0]) == ["c.x.serviceaccount.identity.meshlet.cluster.local"]


def test_network_authentication_with_except_and_a_missing_one() -> None:
    ref = {"group": G, "kind": "NetworkAuthentication", "name": "n"}
    spec = {"networks": [{"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}]}
    idx = index(pod(), server(), policy("p", SRV, [ref]), res("NetworkAuthentication", "n", spec))
    [authz] = get(idx).authorizations
    assert nets(authz) == ["10.0.0.0/8 -10.1.0.0/16"] and authn(authz) == "unauthenticated"
    missing = index(pod(), server(), policy("p", SRV, [ref]))
    assert list(get(missing).authorizations) == []  # fails closed, as Linkerd's index


def test_a_namespace_targeted_policy_applies_to_every_server() -> None:
    idx = index(pod(), server(), policy("all", {"kind": "Namespace", "name": "ns"}, []))
    [authz] = get(idx).authorizations
    assert authz.metadata.resource.name == "all" and nets(authz) == ALL


def test_route_level_authorizations() -> None:
    route = res(
        "HTTPRoute",
        "r",
        {
            "parentRefs": [{"group": G, "kind": "Server", "name": "web"}],
            "rules": [
                {"matches": [{"path": {"type": "PathPrefix", "value": "/api"}, "method": "POST"}]}
            ],
        },
        "v1beta3",
    )
    target = {"group": G, "kind": "HTTPRoute", "name": "r"}
    idx = index(
        pod(),
        server(proxyProtocol="HTTP/1"),
        route,
        policy("rp", target, [{"kind": "ServiceAccount", "name": "c"}]),
    )
    srv = get(idx)
    assert list(srv.authorizations) == []
    [http] = srv.protocol.http1.routes
    assert (http.metadata.resource.group, http.metadata.resource.kind) == (G, "HTTPRoute")
    assert http.rules[0].matches[0].path.prefix == "/api"
    [authz] = http.authorizations
    assert authz.metadata.resource.name == "rp"
    grpc_route = res(
        "GRPCRoute",
        "g",
        {
            "parentRefs": [{"group": G, "kind": "Server", "name": "web"}],
            "rules": [{"matches": [{"method": {"service": "a.B"}}]}],
        },
        "gateway.networking.k8s.io/v1",
    )
    grpc = get(index(pod(), server(proxyProtocol="gRPC"), grpc_route)).protocol.grpc
    assert grpc.routes[0].rules[0].matches[0].rpc.service == "a.B"
    plain = get(index(pod(), server(proxyProtocol="gRPC"))).protocol.grpc
    assert plain.routes[0].metadata.default == "default"


def test_rate_limit_total_identity_overrides() -> None:
    limit = res(
        "HTTPLocalRateLimitPolicy",
        "rl",
        {
            "targetRef": SRV,
            "total": {"requestsPerSecond": 100},
            "identity": {"requestsPerSecond": 10},
            "overrides": [
                {"requestsPerSecond": 50, "clientRefs": [{"kind": "ServiceAccount", "name": "vip"}]}
            ],
        },
    )
    rl = get(index(pod(), server(), limit)).protocol.detect.http_local_rate_limit
    assert rl.metadata.resource.kind == "HTTPLocalRateLimitPolicy"
    assert (rl.total.requestsPerSecond, rl.identity.requestsPerSecond) == (100, 10)
    [o] = rl.overrides
    assert o.limit.requestsPerSecond == 50
    assert [i.name for i in o.clients.identities] == [
        "vip.ns.serviceaccount.identity.meshlet.cluster.local"
    ]


def test_an_invalid_object_is_ignored_and_the_valid_version_stays() -> None:
    idx = index(pod(), server(proxyProtocol="opaque"))
    idx.apply(Upsert(Kind.SERVER, server(proxyProtocol="bogus")))
    assert get(idx).protocol.HasField("opaque")
    assert idx.invalid == 1
    idx.apply(Upsert(Kind.SERVER, server(proxyProtocol="bogus")))
    assert idx.invalid == 1  # logged once


def test_unknown_pod_is_none() -> None:
    assert index().get("ns", "nope", 80) is None


def test_a_change_notifies_only_affected_watchers() -> None:
    other = pod("other-1", "other")
    idx = index(pod(), pod("web-2"), other, server())
    boxes = {
        key: Mailbox()
        for key in (("ns", "web-1", 8080), ("ns", "web-2", 9000), ("other", "other-1", 8080))
    }
    for (ns, name, port), box in boxes.items():
        assert idx.subscribe(ns, name, port, box)
        assert box.take() is not None
    idx.apply(Upsert(Kind.AUTHORIZATION_POLICY, policy("p", SRV, [])))
    assert boxes[("ns", "web-1", 8080)].take() is not None
    assert boxes[("ns", "web-2", 9000)].take() is None  # recomputed, unchanged
    assert boxes[("other", "other-1", 8080)].take() is None
    before = idx.recomputed
    idx.apply(Upsert(Kind.POD, pod("web-2", annotations={ANN: "deny"})))
    assert idx.recomputed == before + 1  # only web-2's watch was looked at
    assert boxes[("ns", "web-2", 9000)].take() is not None
    idx.apply(Delete(Kind.POD, pod("web-2")))
    assert boxes[("ns", "web-2", 9000)].closed
    idx.apply(Snapshot(Kind.SERVER, ()))
    assert boxes[("ns", "web-1", 8080)].take() is not None  # back to the default
