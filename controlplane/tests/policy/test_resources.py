"""resources.problems: each kind valid, and each kind of mistake named with its field path."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.controlplane.policy import resources as r
from meshlet.controlplane.policy import routes

G = "policy.meshlet.io"


def obj(api_version: str, kind: str, spec: Any, name: str = "x") -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }


def server(**spec: Any) -> dict[str, Any]:
    return obj(
        f"{G}/v1beta3",
        "Server",
        {"podSelector": {"matchLabels": {"app": "web"}}, "port": 8080, **spec},
    )


def authz(target: dict[str, Any], refs: list[dict[str, Any]]) -> dict[str, Any]:
    return obj(
        f"{G}/v1alpha1",
        "AuthorizationPolicy",
        {"targetRef": target, "requiredAuthenticationRefs": refs},
    )


SRV = {"group": G, "kind": "Server", "name": "web"}
SA = {"kind": "ServiceAccount", "name": "client"}
MTLS = {"group": G, "kind": "MeshTLSAuthentication", "name": "m"}
NET = {"group": G, "kind": "NetworkAuthentication", "name": "n"}

VALID = [
    server(),
    server(port="http", proxyProtocol="gRPC", accessPolicy="audit"),
    server(podSelector={"matchExpressions": [{"key": "app", "operator": "In", "values": ["a"]}]}),
    authz(SRV, [SA, NET]),
    authz({"kind": "Namespace", "name": "ns"}, []),
    authz({"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": "r"}, [MTLS]),
    obj(
        f"{G}/v1alpha1",
        "MeshTLSAuthentication",
        {
            "identities": ["*", "*.ns.serviceaccount.identity.meshlet.cluster.local", "a.b"],
            "identityRefs": [SA, {"kind": "Namespace", "name": "other"}],
        },
    ),
    obj(
        f"{G}/v1alpha1",
        "NetworkAuthentication",
        {"networks": [{"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}, {"cidr": "fd00::/8"}]},
    ),
    obj(
        f"{G}/v1beta3",
        "HTTPRoute",
        {
            "parentRefs": [{"group": G, "kind": "Server", "name": "web"}],
            "hostnames": ["*.example.com"],
            "rules": [
                {
                    "matches": [
                        {"path": {"type": "Exact", "value": "/a"}, "method": "GET"},
                        {
                            "path": {"type": "RegularExpression", "value": "/b/[0-9]+"},
                            "headers": [{"name": "x-a", "value": "1"}],
                            "queryParams": [
                                {"name": "q", "type": "RegularExpression", "value": "v.*"}
                            ],
                        },
                    ],
                    "filters": [
                        {
                            "type": "RequestHeaderModifier",
                            "requestHeaderModifier": {"set": [{"name": "x-b", "value": "2"}]},
                        }
                    ],
                }
            ],
        },
    ),
    obj(
        "gateway.networking.k8s.io/v1",
        "GRPCRoute",
        {
            "parentRefs": [{"group": G, "kind": "Server", "name": "web"}],
            "rules": [{"matches": [{"method": {"service": "pkg.Svc", "method": "Get"}}]}],
        },
    ),
    obj(
        f"{G}/v1alpha1",
        "HTTPLocalRateLimitPolicy",
        {
            "targetRef": SRV,
            "total": {"requestsPerSecond": 100},
            "identity": {"requestsPerSecond": 10},
            "overrides": [{"requestsPerSecond": 50, "clientRefs": [SA]}],
        },
    ),
]


@pytest.mark.parametrize("good", VALID, ids=lambda o: o["kind"])
def test_valid_objects_have_no_problem(good: dict[str, Any]) -> None:
    assert r.problems(good) == []
    assert r.parse(good).meta.name == "x"


MISTAKES = [
    (server(port=0), ["spec.port: 0 is not within 1..65535"]),
    (server(port="Not_A_Name"), ["spec.port: 'Not_A_Name' is not a container port name"]),
    (server(proxyProtocol="http"), ["spec.proxyProtocol: 'http' is not one of"]),
    (server(accessPolicy="allow"), ["spec.accessPolicy: 'allow' is not one of"]),
    (
        server(podSelector={"matchExpressions": [{"key": "a", "operator": "In"}]}),
        ["spec.podSelector.matchExpressions[0].values: must list at least one value for In"],
    ),
    (
        server(podSelector={"matchExpressions": [{"key": "a", "operator": "Near"}]}),
        ["spec.podSelector.matchExpressions[0].operator: 'Near' is not one of"],
    ),
    (obj(f"{G}/v1beta3", "Server", {"port": 80}), ["spec.podSelector: is required"]),
    (authz({"kind": "Pod", "name": "p"}, []), ["spec.targetRef: Pod (core) is not a target"]),
    (
        authz({"kind": "Namespace", "name": "other"}, []),
        ["spec.targetRef.name: 'other' is another namespace"],
    ),
    (authz(SRV, [SA, SA]), ["spec.requiredAuthenticationRefs: lists several ServiceAccounts"]),
    (
        authz(SRV, [SA, MTLS]),
        ["spec.requiredAuthenticationRefs: lists a MeshTLSAuthentication and a ServiceAccount"],
    ),
    (authz(SRV, [NET, NET]), ["spec.requiredAuthenticationRefs: lists several Network"]),
    (
        authz(SRV, [{"kind": "Secret", "name": "s"}]),
        ["spec.requiredAuthenticationRefs[0]: Secret (core) is not an authentication"],
    ),
    (
        obj(f"{G}/v1alpha1", "AuthorizationPolicy", {"targetRef": SRV}),
        ["spec.requiredAuthenticationRefs: is required"],
    ),
    (
        obj(f"{G}/v1alpha1", "MeshTLSAuthentication", {"identities": ["*.", "Bad!"]}),
        ["spec.identities[0]: '*.' is not an identity", "spec.identities[1]: 'Bad!' is not"],
    ),
    (obj(f"{G}/v1alpha1", "MeshTLSAuthentication", {}), ["spec: names no client"]),
    (
        obj(
            f"{G}/v1alpha1",
            "MeshTLSAuthentication",
            {"identityRefs": [{"kind": "Namespace", "name": "a", "namespace": "b"}]},
        ),
        ["spec.identityRefs[0].namespace: must not be set"],
    ),
    (obj(f"{G}/v1alpha1", "NetworkAuthentication", {"networks": []}), ["spec.networks: is empty"]),
    (
        obj(
            f"{G}/v1alpha1",
            "NetworkAuthentication",
            {
                "networks": [
                    {"cidr": "10.0.0.0/33"},
                    {"cidr": "10.0.0.0/8", "except": ["11.0.0.0/8"]},
                    {"cidr": "10.0.0.0/8", "except": ["10.0.0.0/8"]},
                ]
            },
        ),
        [
            "spec.networks[0].cidr: '10.0.0.0/33' is not a CIDR",
            "spec.networks[1].except[0]: 11.0.0.0/8 is not within 10.0.0.0/8",
            "spec.networks[2].except[0]: 10.0.0.0/8 negates all of 10.0.0.0/8",
        ],
    ),
    (
        obj(
            f"{G}/v1beta3",
            "HTTPRoute",
            {
                "rules": [
                    {
                        "matches": [
                            {"path": {"type": "Exact", "value": "a"}},
                            {"path": {"type": "RegularExpression", "value": "(unclosed"}},
                            {"headers": [{"name": "bad header", "value": "v"}], "method": "FETCH"},
                            {"path": {"type": "PathPrefix", "value": "/x/../%61dmin"}},
                            {"path": {"type": "Exact", "value": "/admin#x"}},
                        ]
                    }
                ]
            },
        ),
        [
            "spec.rules[0].matches[0].path.value: 'a' is not an absolute path",
            "spec.rules[0].matches[1].path.value: '(unclosed' is not an RE2 regular expression",
            "spec.rules[0].matches[2].headers[0].name: 'bad header' is not a header name",
            "spec.rules[0].matches[2].method: 'FETCH' is not one of",
            "spec.rules[0].matches[3].path.value: '/x/../%61dmin' is not in the form requests"
            " are routed on; write '/admin'",
            "spec.rules[0].matches[4].path.value: '/admin#x' can match no request: a request"
            " target must not carry a fragment (#)",
        ],
    ),
    (
        obj(
            f"{G}/v1beta3",
            "HTTPRoute",
            {
                "parentRefs": [
                    {"group": G, "kind": "Server", "name": "w", "namespace": "other"},
                    {"group": G, "kind": "Server", "name": "w", "port": 80},
                ],
                "rules": [{"filters": [{"type": "RequestMirror"}]}],
            },
        ),
        [
            "spec.parentRefs[0].namespace: a route may attach only to a Server in its own",
            "spec.parentRefs[1].port: must not be set for a Server parent",
            "spec.rules[0].filters[0].type: 'RequestMirror' is not supported",
        ],
    ),
    (
        obj(
            "gateway.networking.k8s.io/v1",
            "HTTPRoute",
            {
                "parentRefs": [{"group": G, "kind": "Server", "name": "w"}],
                "rules": [
                    {
                        "filters": [
                            {
                                "type": "RequestHeaderModifier",
                                "requestHeaderModifier": {
                                    "set": [
                                        {"name": "meshlet-client-id", "value": "admin"},
                                        {"name": "X-Tenant", "value": "a"},
                                        {"name": "x-tenant", "value": "b"},
                                    ],
                                    "add": [
                                        {"name": "L5D-Client-Id", "value": "admin"},
                                        {"name": ":authority", "value": "evil"},
                                        {"name": "x-ok", "value": "1\r\nx-injected: 1"},
                                    ],
                                    "remove": ["Host", "transfer-encoding", "x ok"],
                                },
                            }
                        ]
                    }
                ],
            },
        ),
        [
            "spec.rules[0].filters[0].requestHeaderModifier.add[0].name: 'L5D-Client-Id' is "
            "reserved for the proxy",
            "spec.rules[0].filters[0].requestHeaderModifier.add[1].name: ':authority' is a "
            "pseudo-header",
            "spec.rules[0].filters[0].requestHeaderModifier.add[2].value: a header value with a "
            "control character",
            "spec.rules[0].filters[0].requestHeaderModifier.remove[0]: 'Host' frames or routes",
            "spec.rules[0].filters[0].requestHeaderModifier.remove[1]: 'transfer-encoding' frames",
            "spec.rules[0].filters[0].requestHeaderModifier.remove[2]: 'x ok' is not a valid "
            "header name",
            "spec.rules[0].filters[0].requestHeaderModifier.set[0].name: 'meshlet-client-id' is "
            "reserved for the proxy",
            "spec.rules[0].filters[0].requestHeaderModifier.set[2].name: 'x-tenant' is listed "
            "twice",
        ],
    ),
    (
        obj(f"{G}/v1beta3", "HTTPRoute", {"rules": [{}] * (routes.MAX_RULES + 1)}),
        [f"spec.rules: has {routes.MAX_RULES + 1} items; at most {routes.MAX_RULES} are allowed"],
    ),
    (
        obj(
            "gateway.networking.k8s.io/v1",
            "GRPCRoute",
            {
                "rules": [
                    {
                        "matches": [
                            {"method": {}},
                            {"method": {"type": "RegularExpression", "service": "a"}},
                        ]
                    }
                ]
            },
        ),
        [
            "spec.rules[0].matches[0].method: names neither a service nor a method",
            "spec.rules[0].matches[1].method.type: RegularExpression is not supported",
        ],
    ),
    (
        obj(
            f"{G}/v1alpha1",
            "HTTPLocalRateLimitPolicy",
            {"targetRef": {"kind": "Service", "name": "s"}, "total": {"requestsPerSecond": 0}},
        ),
        [
            "spec.targetRef: Service (core) is not a target",
            "spec.total.requestsPerSecond: 0 is not within 1..4294967295",
        ],
    ),
    (
        obj(
            f"{G}/v1alpha1",
            "HTTPLocalRateLimitPolicy",
            {
                "targetRef": SRV,
                "total": {"requestsPerSecond": 5},
                "identity": {"requestsPerSecond": 6},
                "overrides": [
                    {"requestsPerSecond": 9, "clientRefs": [{"kind": "Pod", "name": "p"}]}
                ],
            },
        ),
        [
            "spec.identity.requestsPerSecond: 6 exceeds total.requestsPerSecond (5)",
            "spec.overrides[0].requestsPerSecond: 9 exceeds total.requestsPerSecond (5)",
            "spec.overrides[0].clientRefs[0]: Pod (core) is not a client",
        ],
    ),
    (
        {
            "apiVersion": f"{G}/v1beta3",
            "kind": "Server",
            "metadata": {"name": "Bad_Name"},
            "spec": "no",
        },
        [
            "metadata.name: 'Bad_Name' is not a DNS subdomain name",
            "spec: must be an object",
            "spec.podSelector: is required",
            "spec.port: is required",
        ],
    ),
    ({"apiVersion": "v1", "kind": "Pod"}, ["apiVersion/kind: v1 Pod is not one of"]),
]


@pytest.mark.parametrize(("bad", "expected"), MISTAKES)
def test_every_mistake_is_named_with_its_path(bad: dict[str, Any], expected: list[str]) -> None:
    found = r.problems(bad)
    assert len(found) == len(expected), found
    for problem, start in zip(sorted(found), sorted(expected), strict=True):
        assert problem.startswith(start), (problem, start)
    with pytest.raises(r.Invalid):
        r.parse(bad)


@pytest.mark.parametrize(
    "junk",
    [
        None,
        1,
        "x",
        [],
        {"apiVersion": 1, "kind": []},
        {"apiVersion": f"{G}/v1beta3", "kind": "Server", "metadata": [], "spec": {"port": True}},
        {
            "apiVersion": f"{G}/v1beta3",
            "kind": "HTTPRoute",
            "metadata": {"name": "a"},
            "spec": {"rules": [{"matches": [{"path": []}, None, 3]}], "hostnames": "h"},
        },
    ],
)
def test_problems_is_total(junk: Any) -> None:
    found = r.problems(junk)
    assert found and all(isinstance(p, str) for p in found)
