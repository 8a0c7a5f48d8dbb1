"""A real `meshlet-controller policy` process over a manifests folder, with TLS from the test CA,
asked by grpcio clients; and the Kubernetes source through the fake API server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlet.api import inbound_pb2, inbound_pb2_grpc, wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS
from meshlet.controlplane.k8s.manifests import ManifestsFolder
from meshlet.controlplane.policy.index import ClusterConfig, parse_networks
from meshlet.controlplane.policy.server import PolicyConfig, PolicyServer
from meshlet_testing.sockets import free_port

G = "policy.meshlet.io"
NAME = wellknown.POLICY_SERVICE_NAME


def pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-1", "namespace": "ns", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]},
    }


def server(protocol: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{G}/v1beta3",
        "kind": "Server",
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "port": "http",
            "proxyProtocol": protocol,
        },
    }


@pytest.fixture
def process(test_ca: Any, tmp_path: Path) -> Iterator[tuple[int, ManifestsFolder, bytes]]:
    folder = ManifestsFolder(tmp_path / "manifests")
    folder.root.mkdir()
    folder.put("pods", pod())
    cert, key = test_ca.serving_cert(NAME, tmp_path / "tls")
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshlet.controlplane.main",
            "policy",
            "--addr",
            f"127.0.0.1:{port}",
            "--admin-addr",
            f"127.0.0.1:{admin}",
            "--manifests",
            str(folder.root),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", admin), timeout=1) as s:
                    s.sendall(b"GET /ready HTTP/1.0\r\n\r\n")
                    if b" 200 " in s.recv(100):
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        else:
            pytest.fail("the policy controller never became ready")
        yield port, folder, test_ca.anchors_path.read_bytes()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err


def channel(port: int, anchors: bytes) -> grpc.Channel:
    return grpc.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(anchors),
        options=[("grpc.ssl_target_name_override", NAME)],
    )


def test_get_and_watch_over_tls_and_an_update_arrives_within_a_second(
    process: tuple[int, ManifestsFolder, bytes],
) -> None:
    port, folder, anchors = process
    with channel(port, anchors) as ch:
        stub = inbound_pb2_grpc.InboundServerPoliciesStub(ch)
        spec = inbound_pb2.PortSpec(workload='{"ns":"ns","pod":"web-1"}', port=8080)
        got = stub.GetPort(spec, timeout=5)
        assert dict(got.labels) == {"group": "", "kind": "default", "name": "all-unauthenticated"}
        old = stub.GetPort(inbound_pb2.PortSpec(workload="ns:web-1", port=8080), timeout=5)
        assert old == got
        watch = stub.WatchPort(spec, timeout=20)
        first = next(watch)
        assert first == got
        folder.put("server", server("opaque"))
        sent = time.monotonic()
        update = next(watch)
        assert time.monotonic() - sent < 1.0
        assert update.labels["kind"] == "server" and update.protocol.HasField("opaque")
        watch.cancel()
        for workload, port_number, what in [
            ("web-1", 8080, "invalid workload"),
            ('{"ns":"ns"}', 8080, "invalid workload"),
            ("ns:web-1", 0, "invalid port"),
            ("ns:web-1", 70000, "invalid port"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.GetPort(inbound_pb2.PortSpec(workload=workload, port=port_number), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert what in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            next(stub.WatchPort(inbound_pb2.PortSpec(workload="ns:nope", port=80), timeout=5))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_raw_client_without_meshlet_code(process: tuple[int, ManifestsFolder, bytes]) -> None:
    port, _, anchors = process
    workload = b'{"ns":"ns","pod":"web-1"}'
    # PortSpec: field 1 (workload, length-delimited), field 2 (port 8080 as a varint).
    request = b"\x0a" + bytes([len(workload)]) + workload + b"\x10\x90\x3f"
    with channel(port, anchors) as ch:
        call = ch.unary_unary("/io.linkerd.proxy.inbound.InboundServerPolicies/GetPort")
        raw = call(request, timeout=5)
    assert isinstance(raw, bytes)
    decoded = inbound_pb2.Server.FromString(raw)
    assert decoded.labels["name"] == "all-unauthenticated"
    assert decoded.protocol.detect.timeout.seconds == 10
    # The label map's entries are on the wire as field 4: b"\x22" + length + entry.
    assert b"all-unauthenticated" in raw and raw.count(b"\x22") >= 3


async def test_the_kubernetes_source_through_the_fake_api(tmp_path: Path) -> None:
    from kubernetes import client as k8s_client

    from meshlet.controlplane.k8s.informer import KubernetesSource
    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES, FakeKubeAPI

    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as api:
        api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}})
        api.apply(pod())
        source = KubernetesSource(
            k8s_client.ApiClient(api.client_configuration()),
            kinds=POLICY_SERVER_KINDS,
            watch_timeout=5,
        )
        config = PolicyConfig(
            addr=HostPort("127.0.0.1", 0),
            admin_addr=HostPort("127.0.0.1", 0),
            source=source,
            cluster=ClusterConfig(networks=parse_networks("10.0.0.0/8")),
        )
        synced: list[int] = []  # the process freezes what its first sync loaded (gc.freeze)
        srv = PolicyServer(config, on_synced=lambda: synced.append(len(srv.index.namespaces)))
        await srv.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as ch:
                stub = inbound_pb2_grpc.InboundServerPoliciesStub(ch)
                for _ in range(100):
                    if srv.ready():
                        break
                    await asyncio.sleep(0.05)
                spec = inbound_pb2.PortSpec(workload="ns:web-1", port=8080)
                watch = stub.WatchPort(spec, timeout=20)
                first = await watch.read()
                assert first.labels["kind"] == "default"
                await asyncio.to_thread(api.apply, server("HTTP/2"))
                update = await asyncio.wait_for(watch.read(), 5)
                assert update.labels["name"] == "web" and update.protocol.HasField("http2")
                watch.cancel()
                assert synced == [1]  # once, when every kind had been listed (ns's pod in)
        finally:
            await srv.stop(grace=0)


def test_a_bad_configuration_names_every_problem_and_exits_64(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshlet.controlplane.main",
            "policy",
            "--cluster-networks",
            "10.0.0.0/8,nope",
            "--default-policy",
            "allow",
            "--tls-key",
            __file__,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 64
    for expected in (
        "exactly one of --kubeconfig",
        "--tls-cert and --tls-key go together",
        "--cluster-networks: 'nope'",
        "--default-policy: 'allow'",
    ):
        assert expected in done.stderr
    assert "Traceback" not in done.stderr
