"""`meshlet authz` against the fake API server: a Deployment whose pods' ports are selected by a
Server with an AuthorizationPolicy, a route, and a port left to the default policy."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES, FakeKubeAPI

G = "policy.meshlet.io"
NS = "shop"
WEB_ID = "web.shop.serviceaccount.identity.meshlet.cluster.local"


def _obj(api_version: str, kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": NS}, "spec": spec}  # fmt: skip


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as server:
        yield server


ANNOTATION = "config.meshlet.io/default-inbound-policy"
MESH_TLS = {"group": G, "kind": "MeshTLSAuthentication", "name": "web-only"}


@pytest.fixture
def shop(api: FakeKubeAPI, tmp_path: Path) -> str:
    namespace = {"name": NS, "annotations": {ANNOTATION: "cluster-authenticated"}}
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": namespace})
    deployment = {"selector": {"matchLabels": {"app": "store"}}, "template": {}}
    api.apply({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "store", "namespace": NS}, "spec": deployment})  # fmt: skip
    ports = [{"name": "http", "containerPort": 8080}, {"name": "metrics", "containerPort": 9100}]
    api.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "store-5d9f-abcde", "namespace": NS, "labels": {"app": "store"}},
        "spec": {"serviceAccountName": "store", "containers": [{"name": "s", "ports": ports}]},
        "status": {"phase": "Running"},
    })  # fmt: skip
    selector = {"matchLabels": {"app": "store"}}
    server = {"podSelector": selector, "port": "http", "proxyProtocol": "HTTP/1"}
    api.apply(_obj(f"{G}/v1beta3", "Server", "store-http", server))
    api.apply(_obj(f"{G}/v1alpha1", "MeshTLSAuthentication", "web-only",
                   {"identityRefs": [{"kind": "ServiceAccount", "name": "web"}]}))  # fmt: skip
    public = {"path": {"type": "PathPrefix", "value": "/public"}}
    api.apply(_obj(f"{G}/v1beta3", "HTTPRoute", "store-public", {
        "parentRefs": [{"group": G, "kind": "Server", "name": "store-http"}],
        "rules": [{"matches": [public]}],
    }))  # fmt: skip
    api.apply(_obj(f"{G}/v1alpha1", "AuthorizationPolicy", "web-reads", {
        "targetRef": {"group": G, "kind": "HTTPRoute", "name": "store-public"},
        "requiredAuthenticationRefs": [MESH_TLS],
    }))  # fmt: skip
    return str(api.write_kubeconfig(tmp_path / "kubeconfig"))


def test_the_policy_of_each_port(meshlet: Callable[..., Any], shop: str) -> None:
    result = meshlet("authz", "-n", NS, "deploy/store", "--kubeconfig", shop)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].split() == ["PORT", "SERVER", "ROUTE", "AUTHORIZATION", "CLIENTS"]
    rows = [line.split(None, 4) for line in lines[1:]]
    assert ["8080", "server/store-http", "HTTPRoute/store-public",
            "authorizationpolicy/web-reads", f"mTLS from {WEB_ID}"] in rows  # fmt: skip
    # the Server has no authorization of its own, and with a route attached there is no
    # default route: that route is all port 8080 allows
    assert [row for row in rows if row[0] == "8080"] == [rows[0]]
    # port 9100 has no Server: the namespace's default policy, over the cluster's networks
    defaults = [row for row in rows if row[0] == "9100"]
    assert defaults and all(row[1] == "default:cluster-authenticated" for row in defaults)
    assert any(row[3] == "default:cluster-authenticated"
               and row[4].startswith("mTLS from * in 10.0.0.0/8") for row in defaults)  # fmt: skip


def test_json_output(meshlet: Callable[..., Any], shop: str) -> None:
    result = meshlet("authz", "-n", NS, "deploy/store", "-o", "json", "--kubeconfig", shop)
    assert result.code == 0, result.err
    rows = json.loads(result.out)
    route = next(r for r in rows if r["route"] == "HTTPRoute/store-public")
    assert route == {"port": 8080, "server": "server/store-http", "route": "HTTPRoute/store-public",
                     "authorization": "authorizationpolicy/web-reads",
                     "clients": f"mTLS from {WEB_ID}"}  # fmt: skip


def test_a_missing_workload_is_one_line(meshlet: Callable[..., Any], shop: str) -> None:
    result = meshlet("authz", "-n", NS, "deploy/nope", "--kubeconfig", shop)
    assert result.code != 0
    assert "deployment shop/nope not found" in result.err
    assert "Traceback" not in result.err
