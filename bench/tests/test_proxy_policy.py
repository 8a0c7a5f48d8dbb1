"""The policy row's set-up: its manifests as the policy controller reads them, its place in the
run, its proof and its table; and the pair itself with the policy in force, in a network
namespace of its own (`python -m bench.proxy_policy`), without running the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import proxy_evidence, proxy_mesh, proxy_policy
from bench.proxy_configs import Ports
from bench.proxy_report import Row, Scenario, policy
from meshlet.controlplane.k8s.events import Kind, Upsert
from meshlet.controlplane.policy.index import ClusterConfig, Index, parse_networks

UPSTREAM = Ports(h1=18001, h2=18002, grpc=18003, tcp=18004)
REPO = Path(__file__).resolve().parents[2]
CHECK_TIMEOUT = 50.0  # the pair and three controllers start in ~6 s on a quiet machine


def test_the_policy_controller_admits_the_client_pod_by_an_authorization_policy() -> None:
    index = Index(ClusterConfig(networks=parse_networks("10.0.0.0/8")))
    for obj in proxy_policy.manifests(UPSTREAM):
        kind = Kind.of(obj["apiVersion"], obj["kind"])
        assert kind is not None, obj["kind"]
        index.apply(Upsert(kind, obj))
    for field in proxy_policy.HTTP_PORTS:
        server = index.get(proxy_mesh.NS, "server", getattr(UPSTREAM, field))
        assert server is not None
        assert dict(server.labels)["name"] == proxy_policy.policy_name(field)
        [authz] = server.authorizations
        assert authz.metadata.resource.kind == "authorizationpolicy"
        assert authz.metadata.resource.name == proxy_policy.policy_name(field)
        identities = authz.authentication.meshTLS.identities
        assert [i.name for i in identities.identities] == [proxy_mesh.CLIENT_ID]
        assert not identities.suffixes
    tcp = index.get(proxy_mesh.NS, "server", UPSTREAM.tcp)
    assert tcp is not None and dict(tcp.labels)["kind"] == "default"


def test_the_server_proxy_is_told_where_the_controller_is_and_which_ports_to_watch() -> None:
    env = proxy_policy.server_env(8090, UPSTREAM)
    assert env == {
        "MESHLET_PROXY_POLICY_SVC_ADDR": "127.0.0.1:8090",
        "MESHLET_PROXY_POLICY_WORKLOAD": '{"ns":"bench","pod":"server"}',
        "MESHLET_PROXY_INBOUND_PORTS": "18001,18002,18003",
    }


def test_the_policy_row_runs_beside_the_pair_without_in_alternating_order() -> None:
    proxies = ["direct", "meshlet", "meshlet-mesh", "envoy-mesh", proxy_policy.PAIR]
    first = proxy_policy.order(proxies, Scenario.H1, 0)
    assert first == ["direct", "meshlet", proxy_policy.PAIR, "meshlet-mesh", "envoy-mesh"]
    second = proxy_policy.order(proxies, Scenario.H2, 1)
    assert second == ["direct", "meshlet", "meshlet-mesh", proxy_policy.PAIR, "envoy-mesh"]
    assert proxy_policy.PAIR not in proxy_policy.order(proxies, Scenario.GRPC, 2)
    assert proxy_policy.PAIR not in proxy_policy.order(proxies, Scenario.TCP, 3)
    assert proxy_policy.order(["meshlet-mesh"], Scenario.H1, 0) == ["meshlet-mesh"]


def _allowed(kind: str, name: str, value: int) -> str:
    labels = (
        'target_addr="127.0.0.3:4143",srv_group="policy.meshlet.io",srv_kind="server",'
        'srv_name="bench-h1",route_group="",route_kind="default",route_name="default",'
        f'authz_group="policy.meshlet.io",authz_kind="{kind}",authz_name="{name}",'
        f'tls="true",no_tls_reason="",client_id="{proxy_mesh.CLIENT_ID}"'
    )
    return f"inbound_http_authz_allow_total{{{labels}}} {value}.0\n"


def test_the_proof_counts_only_requests_the_authorization_policy_allowed() -> None:
    head = "# TYPE inbound_http_authz_allow counter\n"
    by_policy = head + _allowed("authorizationpolicy", "bench-h1", 100)
    client = proxy_mesh.CLIENT_ID
    assert proxy_evidence.meshlet_authorized(by_policy, client, "bench-h1", 100) == ""
    assert "allowed 100 requests" in proxy_evidence.meshlet_authorized(
        by_policy, client, "bench-h1", 101
    )
    assert "not in force" in proxy_evidence.meshlet_authorized(by_policy, client, "bench-h2", 1)
    by_default = head + _allowed("default", "all-unauthenticated", 100)
    assert "not in force" in proxy_evidence.meshlet_authorized(by_default, client, "bench-h1", 1)
    both = by_policy + _allowed("default", "localhost", 1)
    assert "loopback exception" in proxy_evidence.meshlet_authorized(both, client, "bench-h1", 1)


def test_the_table_flags_a_policy_costing_over_three_percent() -> None:
    rows = [
        Row(Scenario.H1, "meshlet-mesh", cpu_us=100.0, fixed_cpu_us=200.0),
        Row(Scenario.H1, proxy_policy.PAIR, cpu_us=103.0, fixed_cpu_us=210.0),
        Row(Scenario.H2, "meshlet-mesh", cpu_us=100.0),
        Row(Scenario.H2, proxy_policy.PAIR, cpu_us=103.5),
    ]
    lines = policy(rows, 1000.0)
    assert (
        "| HTTP/1.1 keep-alive | 100.0 / 103.0 → **1.03x** | 200.0 / 210.0 → **1.05x** | yes |"
        in lines
    )
    assert lines[-1].endswith("| **no: over 1.03x** |")
    assert not any(line.startswith("| gRPC") for line in lines)
    failed = [Row(Scenario.H1, proxy_policy.PAIR, notes=("failed: not in force",))]
    assert "n/a (meshlet-mesh not run; failed: not in force)" in policy(failed, 1000.0)[-1]
    assert policy([Row(Scenario.H1, "meshlet-mesh", cpu_us=1.0)], 1000.0) == []


def test_the_pair_with_the_policy_admits_the_client_pod_and_refuses_another_identity(
    netns_available: None,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.proxy_policy"],
        cwd=REPO, capture_output=True, text=True, timeout=CHECK_TIMEOUT,
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, found
    assert found["pair"] == 200  # through both proxies, from the client pod's identity
    assert found["admitted"] == 200  # the client pod's identity from another address
    assert found["refused"] == 403  # an identity the policy does not name, from that address
    assert found["denied_other"] == 1
    # the probes, the pair's request and the admitted one: all by the AuthorizationPolicy
    assert found["allowed_by_policy"] == found["probes"] + 2
    assert found["allowed_by_loopback"] == 0
    assert found["verdict"] == ""
