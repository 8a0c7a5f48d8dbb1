"""The destination's Prometheus HTTP service discovery: the targets and labels it serves are
those the chart's Kubernetes-discovery jobs relabel to, and its admin port answers them as
application/json (what Prometheus' http_sd requires)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from meshlet.api.admin import AdminServer
from meshlet.controlplane.destination import scrape
from meshlet.controlplane.destination.model import parse_pod
from meshlet.controlplane.k8s import objects


def pod(name: str, ip: str | None, **kw: Any) -> Any:
    obj = objects.pod(name, ip, **kw)
    return obj


def test_meshed_running_pods_are_the_proxy_targets_with_the_relabelled_labels() -> None:
    web = pod("web-1", "10.42.0.7")
    web["metadata"]["labels"]["meshlet.io/proxy-deployment"] = "web"
    web["metadata"]["labels"]["meshlet.io/proxy-replicaset"] = "web-5d8f7"
    plain = pod("plain-1", "10.42.0.8", meshed=False)
    pending = pod("web-2", None)
    done = pod("web-3", "10.42.0.9")
    done["status"]["phase"] = "Succeeded"
    groups = scrape.proxies([parse_pod(o) for o in (web, plain, pending, done)])
    assert groups == [{
        "targets": ["10.42.0.7:4191"],
        "labels": {"namespace": "emojivoto", "pod": "web-1", "deployment": "web",
                   "replicaset": "web-5d8f7"},
    }]  # fmt: skip


def test_control_plane_pods_are_the_controller_targets_by_component() -> None:
    destination = pod("meshlet-destination-1", "10.42.0.3", ns="meshlet",
                      container_ports=[("grpc", 8086), ("admin-http", 9996)])  # fmt: skip
    destination["metadata"]["labels"]["meshlet.io/control-plane-component"] = "destination"
    app = pod("web-1", "10.42.0.7", container_ports=[("admin-http", 9000)])  # not a controller
    groups = scrape.controllers([parse_pod(destination), parse_pod(app)])
    assert groups == [{"targets": ["10.42.0.3:9996"], "labels": {"component": "destination"}}]
    v6 = pod("meshlet-policy-1", "fd00::5", ns="meshlet", container_ports=[("admin-http", 9990)])
    v6["metadata"]["labels"]["meshlet.io/control-plane-component"] = "policy"
    assert scrape.controllers([parse_pod(v6)])[0]["targets"] == ["[fd00::5]:9990"]


async def test_the_admin_port_answers_the_documents_as_json() -> None:
    admin = AdminServer(lambda: b"# metrics\n", ready=lambda: True,
                        documents={scrape.PROXIES_PATH: lambda: scrape.render([])})  # fmt: skip
    host, port = await admin.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /prometheus/proxies HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
    finally:
        await admin.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Type: application/json" in head
    assert json.loads(body) == []
