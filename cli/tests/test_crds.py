"""The CRDs of meshlet-crds: each is structural, valid as a Kubernetes object, shaped as
Linkerd's (names, short names, printer columns), and its schema accepts Linkerd's documented
examples (group renamed) and refuses what Linkerd's refuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli import charts
from meshlet_testing import schema

G = wk.POLICY_API_GROUP
CRDS = {m.doc["spec"]["names"]["kind"]: m.doc for m in charts.render(charts.CRDS, {}, "meshlet")}

# One example per kind, from Linkerd's documentation, policy.linkerd.io renamed.
EXAMPLES: dict[str, str] = {
    "ServiceProfile": """
apiVersion: meshlet.io/v1alpha1
kind: ServiceProfile
metadata: {name: web-svc.emojivoto.svc.cluster.local, namespace: emojivoto}
spec:
  routes:
  - name: GET /api/list
    condition: {method: GET, pathRegex: /api/list}
    responseClasses:
    - condition: {status: {min: 500, max: 599}}
      isFailure: true
    isRetryable: true
    timeout: 300ms
  retryBudget: {retryRatio: 0.2, minRetriesPerSecond: 10, ttl: 10s}
""",
    "Server": """
apiVersion: policy.meshlet.io/v1beta3
kind: Server
metadata: {namespace: emojivoto, name: voting-grpc}
spec:
  podSelector:
    matchLabels: {app: voting-svc}
  port: voting-grpc
  proxyProtocol: gRPC
  accessPolicy: deny
""",
    "AuthorizationPolicy": """
apiVersion: policy.meshlet.io/v1alpha1
kind: AuthorizationPolicy
metadata: {namespace: emojivoto, name: voting-grpc}
spec:
  targetRef: {group: policy.meshlet.io, kind: Server, name: voting-grpc}
  requiredAuthenticationRefs:
  - {name: voting-clients, kind: MeshTLSAuthentication, group: policy.meshlet.io}
""",
    "MeshTLSAuthentication": """
apiVersion: policy.meshlet.io/v1alpha1
kind: MeshTLSAuthentication
metadata: {namespace: emojivoto, name: voting-clients}
spec:
  identities:
  - web.emojivoto.serviceaccount.identity.meshlet.cluster.local
""",
    "NetworkAuthentication": """
apiVersion: policy.meshlet.io/v1alpha1
kind: NetworkAuthentication
metadata: {namespace: emojivoto, name: cluster-network}
spec:
  networks:
  - cidr: 10.0.0.0/8
  - cidr: 0.0.0.0/0
    except: [10.0.0.0/8, 192.168.0.0/16]
""",
    "HTTPRoute": """
apiVersion: policy.meshlet.io/v1beta3
kind: HTTPRoute
metadata: {namespace: booksapp, name: authors-get-route}
spec:
  parentRefs:
  - {name: authors-server, kind: Server, group: policy.meshlet.io}
  rules:
  - matches:
    - path: {value: /authors.json, type: Exact}
      method: GET
    - path: {value: /authors/, type: PathPrefix}
      method: GET
    timeouts: {request: 10s}
""",
    "GRPCRoute": """
apiVersion: policy.meshlet.io/v1
kind: GRPCRoute
metadata: {namespace: emojivoto, name: voting-route}
spec:
  parentRefs:
  - {name: voting-svc, kind: Service, group: core, port: 8080}
  rules:
  - matches:
    - method: {service: emojivoto.v1.VotingService, method: VoteDoughnut, type: Exact}
    backendRefs:
    - {name: voting-svc, port: 8080}
""",
    "HTTPLocalRateLimitPolicy": """
apiVersion: policy.meshlet.io/v1alpha1
kind: HTTPLocalRateLimitPolicy
metadata: {namespace: emojivoto, name: web-rl}
spec:
  targetRef: {group: policy.meshlet.io, kind: Server, name: web-http}
  total: {requestsPerSecond: 100}
  identity: {requestsPerSecond: 20}
  overrides:
  - requestsPerSecond: 25
    clientRefs:
    - {kind: ServiceAccount, namespace: emojivoto, name: special-client}
""",
}


def example(kind: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLES[kind])
    return doc


def test_every_kind_has_its_crd_and_an_example() -> None:
    assert set(CRDS) == set(EXAMPLES)


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_the_crd_is_structural_and_a_valid_object(kind: str) -> None:
    crd = CRDS[kind]
    schema.validate(crd)
    for version in crd["spec"]["versions"]:
        assert schema.structural_problems(version["schema"]["openAPIV3Schema"]) == []


def test_the_structural_check_can_fail() -> None:
    assert schema.structural_problems(
        {
            "type": "object",
            "properties": {"a": {}, "b": {"type": "array"}, "c": {"type": "string"}},
            "anyOf": [{"properties": {"c": {"type": "string"}, "d": {}}}],
        }
    ) == [
        ".a: no type",
        ".b: an array without items",
        "<root>.anyOf[0].c: sets type",
        "<root>.anyOf[0]: d is not declared outside the junctor",
    ]


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_linkerds_examples_are_valid(kind: str) -> None:
    assert schema.crd_errors(CRDS[kind], example(kind)) == []


def test_names_and_columns_are_linkerds() -> None:
    names = {kind: crd["spec"]["names"] for kind, crd in CRDS.items()}
    assert {kind: n.get("shortNames") for kind, n in names.items()} == {
        "ServiceProfile": ["sp"],
        "Server": ["srv"],
        "AuthorizationPolicy": ["authzpolicy"],
        "MeshTLSAuthentication": ["meshtlsauthn"],
        "NetworkAuthentication": ["netauthn", "networkauthn"],
        "HTTPRoute": None,
        "GRPCRoute": None,
        "HTTPLocalRateLimitPolicy": None,
    }
    columns = {
        kind: [c["name"] for c in crd["spec"]["versions"][0].get("additionalPrinterColumns", [])]
        for kind, crd in CRDS.items()
    }
    assert columns["Server"] == ["Port", "Protocol", "Access Policy"]
    assert columns["HTTPRoute"] == columns["GRPCRoute"] == ["Hostnames", "Age"]
    assert columns["HTTPLocalRateLimitPolicy"] == [
        "Target_kind", "Target_name", "Total_RPS", "Identity_RPS"]  # fmt: skip
    for kind, crd in CRDS.items():
        if kind != "ServiceProfile":
            assert crd["spec"]["group"] == G and crd["spec"]["scope"] == "Namespaced"


def broken(kind: str, path: str, value: Any) -> dict[str, Any]:
    """The example with the field at `path` (dots; list indexes as numbers) set, or removed
    when `value` is `DELETE`."""
    doc = copy.deepcopy(example(kind))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = doc
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()


@pytest.mark.parametrize(
    ("kind", "path", "value", "error"),
    [
        ("Server", "spec.port", DELETE, "spec: 'port' is a required property"),
        ("Server", "spec.port", 0, "spec.port: 0 is less than the minimum of 1"),
        ("Server", "spec.port", 65536, "spec.port: 65536 is greater than the maximum of 65535"),
        ("Server", "spec.port", "Voting_GRPC", "spec.port: 'Voting_GRPC' does not match"),
        ("Server", "spec.port", "a-very-long-port-name", "'a-very-long-port-name' is too long"),
        ("Server", "spec.port", 1.5, "spec.port: 1.5 is not valid under any of the given schemas"),
        ("Server", "spec.proxyProtocol", "HTTP/3", "spec.proxyProtocol: 'HTTP/3' is not one of"),
        ("Server", "spec.accessPolicy", "allow", "spec.accessPolicy: 'allow' is not one of"),
        ("Server", "spec.podSelector", DELETE, "is not valid under any of the given schemas"),
        ("Server", "spec.externalWorkloadSelector", {}, "is valid under each of"),
        ("Server", "spec.podSelector.matchExpressions", [{"key": "app", "operator": "Like"}],
         "matchExpressions.0.operator: 'Like' is not one of"),
        ("AuthorizationPolicy", "spec.requiredAuthenticationRefs", DELETE,
         "spec: 'requiredAuthenticationRefs' is a required property"),
        ("AuthorizationPolicy", "spec.targetRef.kind", "", "kind: '' should be non-empty"),
        ("AuthorizationPolicy", "spec.targetRef.group", "Policy.Meshlet", "does not match"),
        ("MeshTLSAuthentication", "spec.identities", [], "identities: [] should be non-empty"),
        ("MeshTLSAuthentication", "spec.identities", DELETE, "spec: {} is not valid under any"),
        ("NetworkAuthentication", "spec.networks", DELETE, "'networks' is a required property"),
        ("NetworkAuthentication", "spec.networks.0", {"except": ["10.0.0.0/8"]},
         "spec.networks.0: 'cidr' is a required property"),
        ("HTTPRoute", "spec.rules.0.matches.0.path.type", "Glob", "'Glob' is not one of"),
        ("HTTPRoute", "spec.rules.0.matches.0.method", "FETCH", "'FETCH' is not one of"),
        ("HTTPRoute", "spec.parentRefs.0.port", 0, "port: 0 is less than the minimum of 1"),
        ("GRPCRoute", "spec.rules.0.matches.0.method.type", "Prefix", "'Prefix' is not one of"),
        ("GRPCRoute", "spec.rules.0.backendRefs.0.port", 70000, "than the maximum of 65535"),
        ("HTTPLocalRateLimitPolicy", "spec.targetRef", DELETE, "'targetRef' is a required"),
        ("HTTPLocalRateLimitPolicy", "spec.total.requestsPerSecond", "many",
         "'many' is not of type 'integer'"),
        ("HTTPLocalRateLimitPolicy", "spec.overrides.0.clientRefs", DELETE,
         "spec.overrides.0: 'clientRefs' is a required property"),
        ("ServiceProfile", "spec.routes.0.name", DELETE, "'name' is a required property"),
    ],
)  # fmt: skip
def test_broken_objects_are_refused(kind: str, path: str, value: Any, error: str) -> None:
    errors = schema.crd_errors(CRDS[kind], broken(kind, path, value))
    assert any(error in e for e in errors), errors


GATEWAY = {
    m.doc["spec"]["names"]["kind"]: m.doc
    for m in charts.render(charts.CRDS, {"installGatewayAPI": True}, "meshlet")
    if m.doc["spec"]["group"] == "gateway.networking.k8s.io"
}
# The Gateway API's own kinds: a canary on a Service (what meshlet reads), a route of a
# Gateway controller with the filters meshlet does not serve, and a GRPCRoute.
GATEWAY_EXAMPLES = [
    """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: web-canary, namespace: emojivoto}
spec:
  parentRefs: [{group: core, kind: Service, name: web-svc, port: 80}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /api}, headers: [{name: x-canary, value: "1"}]}]
    filters:
    - type: ResponseHeaderModifier
      responseHeaderModifier: {set: [{name: x-served-by, value: canary}]}
    backendRefs: [{name: web-svc, port: 80, weight: 90}, {name: web-svc-v2, port: 80, weight: 10}]
    timeouts: {request: 10s}
""",
    """
apiVersion: gateway.networking.k8s.io/v1beta1
kind: HTTPRoute
metadata: {name: edge, namespace: web}
spec:
  parentRefs: [{name: public-gateway, sectionName: https}]
  hostnames: [shop.example.com]
  rules:
  - filters:
    - {type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /}}}
    - {type: RequestMirror, requestMirror: {backendRef: {name: shadow, port: 8080}}}
    - {type: ExtensionRef, extensionRef: {group: example.net, kind: Auth, name: sso}}
    backendRefs: [{name: shop, port: 8080}]
""",
    """
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {name: voting, namespace: emojivoto}
spec:
  parentRefs: [{group: core, kind: Service, name: voting-svc, port: 8080}]
  rules:
  - matches: [{method: {service: emojivoto.v1.VotingService, method: VoteDoughnut}}]
    backendRefs: [{name: voting-svc, port: 8080}]
""",
]


@pytest.mark.parametrize("text", GATEWAY_EXAMPLES)
def test_the_gateway_api_kinds_accept_their_examples(text: str) -> None:
    doc = yaml.safe_load(text)
    assert schema.crd_errors(GATEWAY[doc["kind"]], doc) == []


def test_the_gateway_api_kinds_refuse_what_the_standard_refuses() -> None:
    doc = yaml.safe_load(GATEWAY_EXAMPLES[1])
    doc["spec"]["rules"][0]["filters"][0]["type"] = "Rewrite"
    doc["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    errors = schema.crd_errors(GATEWAY["HTTPRoute"], doc)
    assert any("'Rewrite' is not one of" in e for e in errors), errors
    assert any("-1 is less than the minimum of 0" in e for e in errors), errors
    # meshlet's own kind still has only the filters meshlet serves
    mine = {**yaml.safe_load(GATEWAY_EXAMPLES[1]), "apiVersion": f"{G}/v1beta3"}
    assert any(
        "'URLRewrite' is not one of" in e for e in schema.crd_errors(CRDS["HTTPRoute"], mine)
    )


def test_a_rule_may_modify_response_headers_in_meshlets_httproute_too() -> None:
    doc = {**yaml.safe_load(GATEWAY_EXAMPLES[0]), "apiVersion": f"{G}/v1beta3"}
    assert schema.crd_errors(CRDS["HTTPRoute"], doc) == []  # outbound serves it per rule
