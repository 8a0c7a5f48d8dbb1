"""`io.linkerd.proxy.outbound.OutboundPolicies` from a real `meshlet-controller policy` process
over a manifests folder, with TLS from the test CA, asked by grpcio's generic stubs."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlet.api import net_pb2, outbound_pb2, wellknown
from meshlet.controlplane.k8s.manifests import ManifestsFolder

from .test_server import NAME, channel, free_port

WORKLOAD = '{"ns":"ns","pod":"client-1"}'
METHOD = "/io.linkerd.proxy.outbound.OutboundPolicies/"


def service(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "ns", "annotations": annotations or {}},
        "spec": {"clusterIP": "10.96.0.7", "ports": [{"port": 80}]},
    }


def route(prefix: str) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "web-route", "namespace": "ns"},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "web", "port": 80}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": prefix}}]}],
        },
    }


@pytest.fixture
def process(test_ca: Any, tmp_path: Path) -> Iterator[Any]:
    tmp = tmp_path
    folder = ManifestsFolder(tmp / "manifests")
    folder.root.mkdir()
    folder.put("service", service())
    folder.put("route", route("/api"))
    cert, key = test_ca.serving_cert(NAME, tmp / "tls")
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", "policy",
         "--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
         "--manifests", str(folder.root), "--tls-cert", str(cert), "--tls-key", str(key)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        with channel(port, test_ca.anchors_path.read_bytes()) as ch:
            grpc.channel_ready_future(ch).result(timeout=20)
            yield ch, folder, port, test_ca.anchors_path.read_text()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err


def get(ch: grpc.Channel, spec: outbound_pb2.TrafficSpec) -> outbound_pb2.OutboundPolicy:
    call = ch.unary_unary(
        METHOD + "Get",
        request_serializer=outbound_pb2.TrafficSpec.SerializeToString,
        response_deserializer=outbound_pb2.OutboundPolicy.FromString,
    )
    result: outbound_pb2.OutboundPolicy = call(spec, timeout=5)
    return result


def watch(ch: grpc.Channel, spec: outbound_pb2.TrafficSpec) -> Any:
    call = ch.unary_stream(
        METHOD + "Watch",
        request_serializer=outbound_pb2.TrafficSpec.SerializeToString,
        response_deserializer=outbound_pb2.OutboundPolicy.FromString,
    )
    return call(spec, timeout=20)


def prefixes(policy: outbound_pb2.OutboundPolicy) -> list[str]:
    routes = policy.protocol.detect.http1.routes
    return [m.path.prefix for rt in routes for rule in rt.rules for m in rule.matches]


def authority(text: str) -> outbound_pb2.TrafficSpec:
    return outbound_pb2.TrafficSpec(source_workload=WORKLOAD, authority=text)


def test_watch_sees_a_route_edit_within_a_second(process: Any) -> None:
    ch, folder, _, _ = process
    spec = authority(f"web.ns.svc.{wellknown.CLUSTER_DOMAIN}:80")
    stream = watch(ch, spec)
    first = next(stream)
    assert first.metadata.resource.kind == "Service" and first.metadata.resource.port == 80
    assert prefixes(first) == ["/api"]
    folder.put("route", route("/v2"))
    sent = time.monotonic()
    update = next(stream)
    assert time.monotonic() - sent < 1.0
    assert prefixes(update) == ["/v2"]
    folder.put("service", service({wellknown.FAILURE_ACCRUAL_ANNOTATION: "consecutive"}))
    accrual = next(stream).protocol.detect.http1.failure_accrual.consecutive_failures
    assert accrual.max_failures == 7 and accrual.backoff.max_backoff.seconds == 60
    stream.cancel()


def test_get_by_cluster_ip_and_errors(process: Any) -> None:
    ch, _, _, _ = process
    ip = net_pb2.IPAddress(ipv4=int(ipaddress.IPv4Address("10.96.0.7")))
    by_addr = get(ch, outbound_pb2.TrafficSpec(
        source_workload=WORKLOAD, addr=net_pb2.TcpAddress(ip=ip, port=80)))  # fmt: skip
    assert by_addr == get(ch, authority("web.ns.svc.cluster.local:80"))
    assert by_addr.protocol.detect.http1.routes[0].metadata.resource.name == "web-route"
    for spec, code in [
        (authority("nope.ns.svc.cluster.local:80"), grpc.StatusCode.NOT_FOUND),
        (authority("web.example.com:80"), grpc.StatusCode.NOT_FOUND),
        (authority("web.ns.svc.cluster.local:0"), grpc.StatusCode.INVALID_ARGUMENT),
        (authority("web/ns"), grpc.StatusCode.INVALID_ARGUMENT),
        (outbound_pb2.TrafficSpec(source_workload=WORKLOAD), grpc.StatusCode.INVALID_ARGUMENT),
        (outbound_pb2.TrafficSpec(source_workload="x", authority="web.ns.svc.cluster.local"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (outbound_pb2.TrafficSpec(source_workload=WORKLOAD, addr=net_pb2.TcpAddress(
            ip=net_pb2.IPAddress(ipv4=1), port=80)), grpc.StatusCode.NOT_FOUND),
        (outbound_pb2.TrafficSpec(source_workload=WORKLOAD, addr=net_pb2.TcpAddress(port=80)),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            get(ch, spec)
        assert err.value.code() == code, (spec, err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            next(watch(ch, spec))
        assert err.value.code() == code


async def test_the_proxy_s_client_follows_an_edit(test_ca: Any, tmp_path: Path) -> None:
    """The proxy's own outbound client (grpclib, TLS) against the server in this process (a
    terminated process would wait out its 5 s drain for grpclib's closed TLS connection)."""
    from meshlet.api.hostport import HostPort
    from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS
    from meshlet.controlplane.k8s.manifests import ManifestsSource
    from meshlet.controlplane.policy.index import ClusterConfig, parse_networks
    from meshlet.controlplane.policy.server import PolicyConfig, PolicyServer
    from meshlet.proxy.discovery.outbound_policy import WatchOutbound

    folder = ManifestsFolder(tmp_path / "manifests")
    folder.root.mkdir()
    folder.put("service", service())
    folder.put("route", route("/api"))
    cert, key = test_ca.serving_cert(NAME, tmp_path / "tls")
    source = ManifestsSource(folder.root, kinds=POLICY_SERVER_KINDS, poll_interval=0.1)
    server = PolicyServer(
        PolicyConfig(
            addr=HostPort("127.0.0.1", 0),
            admin_addr=HostPort("127.0.0.1", 0),
            source=source,
            cluster=ClusterConfig(networks=parse_networks("10.0.0.0/8")),
            tls=(cert, key),
        )
    )
    await server.start()
    anchors = test_ca.anchors_path.read_text()
    client = WatchOutbound(HostPort("127.0.0.1", server.grpc_port), NAME, anchors, WORKLOAD)
    try:
        stream = client.watch(HostPort("web.ns.svc.cluster.local", 80))
        first = await asyncio.wait_for(anext(stream), 10)
        assert first.first and first.value.http1[0].meta.name == "web-route"
        folder.put("route", route("/v3"))
        edited = await asyncio.wait_for(anext(stream), 2)
        assert not edited.first and edited.value != first.value
        await stream.aclose()
    finally:
        await client.aclose()
        await server.stop(grace=0)


async def test_a_client_that_goes_away_mid_answer_is_no_error(
    test_ca: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """grpcio clients cancel their Get and Watch calls while the answer is on its way (a window
    of 1 KiB keeps a policy of a few MB in flight): the controller logs at most a debug line,
    never an error with a traceback (gRPC's own logger included), and keeps answering."""
    import logging

    from meshlet.api.hostport import HostPort
    from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS
    from meshlet.controlplane.k8s.manifests import ManifestsSource
    from meshlet.controlplane.policy.index import ClusterConfig, parse_networks
    from meshlet.controlplane.policy.server import PolicyConfig, PolicyServer

    caplog.set_level(logging.DEBUG)
    folder = ManifestsFolder(tmp_path / "manifests")
    folder.root.mkdir()
    folder.put("service", service())
    many = [{**route(f"/p{n}/" + "x" * 200), "metadata": {"name": f"r{n}", "namespace": "ns"}}
            for n in range(1500)]  # fmt: skip
    folder.put("routes", *many)
    cert, key = test_ca.serving_cert(NAME, tmp_path / "tls")
    source = ManifestsSource(folder.root, kinds=POLICY_SERVER_KINDS, poll_interval=0.1)
    server = PolicyServer(PolicyConfig(
        addr=HostPort("127.0.0.1", 0), admin_addr=HostPort("127.0.0.1", 0), source=source,
        cluster=ClusterConfig(networks=parse_networks("10.0.0.0/8")), tls=(cert, key),
    ))  # fmt: skip
    await server.start()
    spec = authority("web.ns.svc.cluster.local:80")

    def client() -> int:
        options = [("grpc.ssl_target_name_override", NAME), ("grpc.http2.bdp_probe", 0),
                   ("grpc.http2.lookahead_bytes", 1024),
                   ("grpc.max_receive_message_length", 64 << 20)]  # fmt: skip
        credentials = grpc.ssl_channel_credentials(test_ca.anchors_path.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", credentials, options) as ch:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(grpc.RpcError):  # NOT_FOUND until the folder is read
                    if len(get(ch, spec).protocol.detect.http1.routes) == len(many):
                        break
                assert time.monotonic() < deadline, "the routes were not loaded in time"
                time.sleep(0.2)
            unary = ch.unary_unary(
                METHOD + "Get", request_serializer=outbound_pb2.TrafficSpec.SerializeToString
            )
            stream = ch.unary_stream(
                METHOD + "Watch", request_serializer=outbound_pb2.TrafficSpec.SerializeToString
            )
            for _ in range(5):
                for call in (unary.future(spec, timeout=30), stream(spec, timeout=30)):
                    call.initial_metadata()  # sent with the first bytes of the answer
                    call.cancel()  # the rest still in flight
            return len(get(ch, spec).protocol.detect.http1.routes)  # still answering

    try:
        assert await asyncio.to_thread(client) == len(many)
        await asyncio.sleep(0.5)
    finally:
        await server.stop(grace=0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]
    gone = [r for r in caplog.records if "the client went away" in r.getMessage()]
    assert gone and all(r.levelno == logging.DEBUG for r in gone)  # it did happen, said quietly
