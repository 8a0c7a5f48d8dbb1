"""`meshlet diagnostics policy` asking a real gRPC server of `InboundServerPolicies`: through a
port-forward to the policy controller's pod of the fake API server (where the pod asked about
is looked up too), or directly, over TLS, as in the local mesh."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from meshlet.api import (
    inbound_pb2,
    inbound_pb2_grpc,
    meta_pb2,
    net_pb2,
    outbound_pb2,
    outbound_pb2_grpc,
)
from meshlet.api import wellknown as wk
from meshlet.cli.policy import render, workload
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.meshed import closed_port
from meshlet_testing.workloads import pod, ready_pod

POD = "web-5d4f8c9b7-x2x7q"
POLICY_POD = "meshlet-policy-6d5c7b8f9-p4q5r"
POLICY_IP = "10.42.0.7"


def all_unauthenticated() -> inbound_pb2.Server:
    """What a controller sends for a port no Server selects, under all-unauthenticated."""
    everyone = [
        inbound_pb2.Network(net=net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv4=0), prefix_len=0)),
        inbound_pb2.Network(
            net=net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv6=net_pb2.IPv6()), prefix_len=0)
        ),
    ]
    authz = inbound_pb2.Authz(
        networks=everyone,
        authentication=inbound_pb2.Authn(unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()),
        metadata=meta_pb2.Metadata(default="all-unauthenticated"),
    )
    detect = inbound_pb2.ProxyProtocol.Detect()
    detect.timeout.FromSeconds(10)
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(detect=detect),
        authorizations=[authz],
        labels={"group": "", "kind": "default", "name": "all-unauthenticated"},
    )


class PolicyControllerFixture(inbound_pb2_grpc.InboundServerPoliciesServicer):
    """A test fixture standing in for `meshlet-controller policy`: GetPort answers from a table
    of (workload, port) → Server, with the contract's codes for anything else; every request
    is kept."""

    def __init__(self) -> None:
        self.policies: dict[tuple[str, int], inbound_pb2.Server] = {}
        self.requests: list[inbound_pb2.PortSpec] = []
        self.refuse: tuple[grpc.StatusCode, str] | None = None  # the answer to every request

    def GetPort(self, request: inbound_pb2.PortSpec, context: Any) -> inbound_pb2.Server:
        self.requests.append(request)
        if self.refuse is not None:
            context.abort(*self.refuse)
        try:
            who = json.loads(request.workload)
            key = (f"{who['ns']}/{who['pod']}", request.port)
        except (ValueError, KeyError, TypeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad workload {request.workload!r}")
        if not 1 <= request.port <= 65535:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"port {request.port} out of range")
        if key not in self.policies:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no pod {key[0]}")
        return self.policies[key]


class OutboundFixture(outbound_pb2_grpc.OutboundPoliciesServicer):
    """Stands in for the controller's OutboundPolicies: Get answers from a table of authority
    → OutboundPolicy, NOT_FOUND for anything else; every request is kept."""

    def __init__(self) -> None:
        self.policies: dict[str, outbound_pb2.OutboundPolicy] = {}
        self.requests: list[outbound_pb2.TrafficSpec] = []

    def Get(self, request: outbound_pb2.TrafficSpec, context: Any) -> outbound_pb2.OutboundPolicy:
        self.requests.append(request)
        if request.authority not in self.policies:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.authority}")
        return self.policies[request.authority]


def serve(fixture: PolicyControllerFixture, credentials: Any = None,
          outbound: OutboundFixture | None = None) -> tuple[Any, int]:  # fmt: skip
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inbound_pb2_grpc.add_InboundServerPoliciesServicer_to_server(fixture, server)
    if outbound is not None:
        outbound_pb2_grpc.add_OutboundPoliciesServicer_to_server(outbound, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


@pytest.fixture
def controller() -> Iterator[tuple[PolicyControllerFixture, int]]:
    fixture = PolicyControllerFixture()
    fixture.policies[(f"emojivoto/{POD}", 8080)] = all_unauthenticated()
    server, port = serve(fixture)
    try:
        yield fixture, port
    finally:
        server.stop(grace=None)


class Cluster:
    """Namespace emojivoto with pod `web-…`, and a ready policy controller pod in namespace
    meshlet whose port 8090 leads to the fixture."""

    def __init__(self, api: FakeKubeAPI, meshlet: Callable[..., Any], tmp_path: Path) -> None:
        self.api, self.meshlet = api, meshlet
        self.kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
        for ns in ("emojivoto", "meshlet"):
            api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        api.apply(ready_pod(pod(), POD, "emojivoto", ip="10.42.1.11"))

    def controller_pod(self, grpc_port: int) -> None:
        labels = {wk.CONTROL_PLANE_COMPONENT_LABEL: "policy"}
        template = {"metadata": {"labels": labels}, "spec": {"containers": [
            {"name": "policy", "image": "ghcr.io/meshlet/controller:0.1.0",
             "ports": [{"name": "grpc", "containerPort": wk.POLICY_PORT}]}]}}  # fmt: skip
        self.api.apply(ready_pod(template, POLICY_POD, "meshlet", ip=POLICY_IP))
        self.api.expose(POLICY_IP, wk.POLICY_PORT, ("127.0.0.1", grpc_port))

    def policy(self, *args: str) -> Any:
        return self.meshlet("diagnostics", "policy", "--kubeconfig", self.kubeconfig, *args)


@pytest.fixture
def cluster(api: FakeKubeAPI, meshlet: Callable[..., Any], tmp_path: Path) -> Cluster:
    return Cluster(api, meshlet, tmp_path)


def test_the_policy_through_a_port_forward(
    cluster: Cluster, controller: tuple[PolicyControllerFixture, int]
) -> None:
    fixture, port = controller
    cluster.controller_pod(port)
    run = cluster.policy("-n", "emojivoto", POD, "8080")
    assert run.code == 0, run.err
    assert run.err == ""
    doc = json.loads(run.out)
    assert doc["labels"] == {"group": "", "kind": "default", "name": "all-unauthenticated"}
    assert doc["protocol"] == {"detect": {"timeout": "10s", "httpRoutes": []}}
    (authz,) = doc["authorizations"]
    assert authz["authentication"] == {"unauthenticated": {}}
    assert authz["metadata"] == {"default": "all-unauthenticated"}
    # asked as the pod's proxy asks
    (request,) = fixture.requests
    assert json.loads(request.workload) == {"ns": "emojivoto", "pod": POD}
    assert request.port == 8080
    forwarded = [p for _, p in cluster.api.requests if "/portforward" in p]
    assert forwarded == [f"/api/v1/namespaces/meshlet/pods/{POLICY_POD}/portforward?ports=8090"]


def test_the_policy_as_yaml_is_the_same_document(
    cluster: Cluster, controller: tuple[PolicyControllerFixture, int]
) -> None:
    cluster.controller_pod(controller[1])
    as_json = json.loads(cluster.policy("-n", "emojivoto", POD, "8080").out)
    run = cluster.policy("-n", "emojivoto", POD, "8080", "-o", "yaml")
    assert run.code == 0, run.err
    assert yaml.safe_load(run.out) == as_json
    assert run.out.startswith("protocol:\n")  # field order kept, not sorted


def test_a_pod_that_does_not_exist_is_named_before_the_controller_is_asked(
    cluster: Cluster, controller: tuple[PolicyControllerFixture, int]
) -> None:
    fixture, port = controller
    cluster.controller_pod(port)
    run = cluster.policy("-n", "emojivoto", "web-gone", "8080")
    assert (run.code, run.out) == (1, "")
    assert run.err == "Error: pod emojivoto/web-gone not found\n"
    assert fixture.requests == []


def test_the_controllers_refusals_are_one_line(
    cluster: Cluster, controller: tuple[PolicyControllerFixture, int]
) -> None:
    """A pod the controller does not know (NOT_FOUND), a question it refuses
    (INVALID_ARGUMENT): one line each, with where it was asked, exit 1."""
    fixture, port = controller
    cluster.controller_pod(port)
    run = cluster.policy("-n", "emojivoto", POD, "9090")
    assert run.code == 1
    assert run.err == (
        f"Error: the policy controller does not know pod emojivoto/{POD} port 9090:"
        f" no pod emojivoto/{POD} [meshlet/{POLICY_POD}:8090 (port-forward)]\n"
    )
    fixture.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "workload must be JSON")
    run = cluster.policy("-n", "emojivoto", POD, "8080")
    assert run.code == 1
    assert run.err.startswith(
        f"Error: the policy controller refused pod emojivoto/{POD} port 8080: INVALID_ARGUMENT:"
        " workload must be JSON ["
    )
    assert run.err.count("\n") == 1 and "Traceback" not in run.err


def test_an_unreachable_controller(cluster: Cluster) -> None:
    run = cluster.policy("-n", "emojivoto", POD, "8080")
    assert run.code == 1
    assert run.err.startswith(
        "Error: no running, ready policy pod in namespace 'meshlet'"
        " (meshlet.io/control-plane-component=policy); is meshlet installed?"
    )
    # the pod is there, nothing listens on its port: the kubelet's words reach the user
    cluster.controller_pod(closed_port())
    run = cluster.policy("-n", "emojivoto", POD, "8080", "--timeout", "2s")
    assert run.code == 1
    assert run.err.startswith("Error: cannot reach the policy controller: ")
    assert f"error forwarding port 8090 to pod {POLICY_POD}" in run.err
    assert run.err.count("\n") == 1 and "Traceback" not in run.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((POD, "0"), "Invalid value for 'PORT': 0 is not in the range 1<=x<=65535"),
        ((POD, "http"), "Invalid value for 'PORT': 'http' is not a valid integer"),
        ((POD, "8080", "-o", "table"), "Invalid value for '-o' / '--output'"),
        ((POD, "8080", "--timeout", "soon"), "expected a duration"),
        ((" ", "8080"), "the pod name is empty"),
        (("svc/", "80"), "the service name is empty"),
        (("deploy/web", "80"), "'deploy' is not po or svc"),
        ((POD,), "give POD PORT, svc/NAME PORT or --outbound SVC:PORT"),
        (("--outbound", "web"), "'web' is not SVC:PORT"),
        (("--outbound", "web:0"), "'web:0' is not SVC:PORT"),
        ((POD, "80", "--outbound", "web:80"), "give either --outbound SVC:PORT or POD PORT"),
        ((POD, "8080", "--policy-ca", __file__), "--policy-ca goes with --policy-addr"),
    ],
)
def test_mistakes_are_usage_errors(
    meshlet: Callable[..., Any], args: tuple[str, ...], message: str
) -> None:
    run = meshlet("diagnostics", "policy", *args)
    assert run.code == 64
    assert message in run.err and "Traceback" not in run.err


# -- directly, over TLS, as in the local mesh ------------------------------------------------


def test_the_policy_from_a_controller_address_over_tls(
    meshlet: Callable[..., Any], test_ca: Any, tmp_path: Path
) -> None:
    """No Kubernetes API: the workload is built from -n and POD alone; the controller's
    certificate must be for its identity, from the mesh's anchors."""
    chain, key = test_ca.serving_cert(wk.POLICY_SERVICE_NAME, tmp_path / "tls")
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), chain.read_bytes())])
    fixture = PolicyControllerFixture()
    fixture.policies[("demo/api-1", 9090)] = all_unauthenticated()
    server, port = serve(fixture, credentials)
    addr, anchors = f"127.0.0.1:{port}", str(test_ca.anchors_path)
    try:
        run = meshlet("diagnostics", "policy", "-n", "demo", "api-1", "9090",
                      "--policy-addr", addr, "--policy-ca", anchors)  # fmt: skip
        assert run.code == 0, run.err
        assert json.loads(run.out)["labels"]["name"] == "all-unauthenticated"
        run = meshlet("diagnostics", "policy", "-n", "demo", "api-1", "9090", "--timeout", "2s",
                      "--policy-addr", addr, "--policy-ca", anchors,
                      "--policy-name", wk.DESTINATION_SERVICE_NAME)  # fmt: skip
        assert run.code == 1  # a certificate for another identity is refused
        assert run.err.startswith("Error: cannot reach the policy controller: ")
        run = meshlet("diagnostics", "policy", "-n", "demo", "api-1", "9090", "--timeout", "2s",
                      "--policy-addr", addr)  # fmt: skip
        assert run.code == 1  # plaintext to a TLS server
        assert run.err.rstrip().endswith("; if it serves TLS, give --policy-ca")
        assert f"[{addr}]" in run.err and "Traceback" not in run.err
    finally:
        server.stop(grace=None)


def test_rendering_keeps_every_field() -> None:
    server = all_unauthenticated()
    assert json.loads(render(server, "json"))["authorizations"][0]["networks"][0] == {
        "net": {"ip": {"ipv4": 0}, "prefixLen": 0},
        "except": [],
    }
    empty = {"serverIps": [], "authorizations": [], "labels": {}}  # nothing is allowed
    assert json.loads(render(inbound_pb2.Server(), "json")) == empty
    assert yaml.safe_load(render(inbound_pb2.Server(), "yaml")) == empty
    assert workload("emojivoto", POD) == '{"ns":"emojivoto","pod":"web-5d4f8c9b7-x2x7q"}'


def test_the_outbound_policy_of_a_service(meshlet: Callable[..., Any]) -> None:
    """`svc/NAME PORT` (Linkerd's form) and `--outbound NAME:PORT` ask `OutboundPolicies.Get`
    by the Service's name as authority, as a client in its namespace; NOT_FOUND is one line."""
    outbound = OutboundFixture()
    authority = "web-svc.emojivoto.svc.cluster.local:80"
    policy = outbound_pb2.OutboundPolicy()
    policy.metadata.resource.kind = "Service"
    policy.metadata.resource.name = "web-svc"
    policy.metadata.resource.namespace = "emojivoto"
    policy.protocol.detect.timeout.seconds = 10
    outbound.policies[authority] = policy
    server, port = serve(PolicyControllerFixture(), outbound=outbound)
    addr = f"127.0.0.1:{port}"
    try:
        by_kind = meshlet("diagnostics", "policy", "-n", "emojivoto", "svc/web-svc", "80",
                          "--policy-addr", addr)  # fmt: skip
        assert by_kind.code == 0, by_kind.err
        doc = json.loads(by_kind.out)
        assert doc["metadata"]["resource"]["name"] == "web-svc"
        assert doc["protocol"]["detect"]["timeout"] == "10s"
        by_option = meshlet("diagnostics", "policy", "-n", "emojivoto", "--outbound", "web-svc:80",
                            "--policy-addr", addr, "-o", "yaml")  # fmt: skip
        assert by_option.code == 0, by_option.err
        assert yaml.safe_load(by_option.out) == doc
        assert [r.authority for r in outbound.requests] == [authority, authority]
        assert json.loads(outbound.requests[0].source_workload)["ns"] == "emojivoto"
        missing = meshlet("diagnostics", "policy", "-n", "emojivoto", "svc/nothing", "80",
                          "--policy-addr", addr)  # fmt: skip
        assert missing.code == 1 and missing.err.count("\n") == 1
        assert missing.err.startswith(
            "Error: the policy controller does not know service "
            "nothing.emojivoto.svc.cluster.local:80: "
        )
    finally:
        server.stop(grace=None)


def test_a_services_outbound_policy_through_a_port_forward(cluster: Cluster) -> None:
    outbound = OutboundFixture()
    authority = "web-svc.emojivoto.svc.cluster.local:80"
    outbound.policies[authority] = outbound_pb2.OutboundPolicy()
    server, port = serve(PolicyControllerFixture(), outbound=outbound)
    try:
        cluster.controller_pod(port)
        gone = cluster.policy("-n", "emojivoto", "svc/web-svc", "80")
        assert (gone.code, gone.err) == (1, "Error: service emojivoto/web-svc not found\n")
        assert outbound.requests == []
        cluster.api.apply({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web-svc", "namespace": "emojivoto"},
            "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}},
        })  # fmt: skip
        run = cluster.policy("-n", "emojivoto", "svc/web-svc", "80")
        assert run.code == 0, run.err
        assert [r.authority for r in outbound.requests] == [authority]
        assert run.err == ""
        profile = {
            "apiVersion": "meshlet.io/v1alpha1", "kind": "ServiceProfile",
            "metadata": {"name": "web-svc.emojivoto.svc.cluster.local", "namespace": "emojivoto"},
            "spec": {"routes": []},
        }  # fmt: skip
        cluster.api.apply(profile)
        empty = cluster.policy("-n", "emojivoto", "svc/web-svc", "80")
        assert (empty.code, empty.err) == (0, "")  # it has no routes: the policy is in force
        profile["spec"] = {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]}
        cluster.api.apply(profile)
        shadowed = cluster.policy("-n", "emojivoto", "svc/web-svc", "80")
        assert shadowed.code == 0 and json.loads(shadowed.out) == json.loads(run.out)
        assert shadowed.err.startswith(
            "note: ServiceProfile emojivoto/web-svc.emojivoto.svc.cluster.local has routes or"
            " dstOverrides: proxies use it for service emojivoto/web-svc and ignore the routes"
        )
    finally:
        server.stop(grace=None)
