"""A meshed namespace in the fake API server, for the commands that read proxies: Deployments as
`meshlet inject --manual` meshes them, their running pods, and behind each meshed pod's IP and
admin port the metrics registry of a proxy served by the proxy's own admin server."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from meshlet.api import wellknown as wk
from meshlet.api.admin import AdminServer
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing import pki
from meshlet_testing.background import BackgroundLoop
from meshlet_testing.fakeapi import FakeKubeAPI
from meshlet_testing.workloads import ready_pod


class Proxies:
    """Meshed pods' admin endpoints: a `ProxyMetrics` registry per pod, served by `AdminServer`
    (what `meshlet-proxy` serves on :4191) on 127.0.0.1, behind the pod's IP in the fake API."""

    def __init__(self, api: FakeKubeAPI, background: BackgroundLoop) -> None:
        self.api, self.background = api, background
        self.metrics: dict[str, ProxyMetrics] = {}
        self._servers: list[AdminServer] = []

    def serve(self, pod: str, ip: str) -> ProxyMetrics:
        metrics = ProxyMetrics()
        server = AdminServer(metrics.registry.render, ready=lambda: True)
        _, port = self.background.run(server.start("127.0.0.1", 0))
        self._servers.append(server)
        self.api.expose(ip, wk.PROXY_ADMIN_PORT, ("127.0.0.1", port))
        self.metrics[pod] = metrics
        return metrics

    def close(self) -> None:
        for server in self._servers:
            self.background.run(server.close())


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NS = "emojivoto"
APP = Path(__file__).parent / "data" / "emojivoto.yaml"
PODS = {  # pod → (Deployment, IP)
    "web-6c8f9d7b5-k2x7q": ("web", "10.42.1.11"),
    "web-6c8f9d7b5-m4p8z": ("web", "10.42.1.12"),
    "api-5b7d9c4f8-a1b2c": ("api", "10.42.2.21"),
    "api-5b7d9c4f8-d3e4f": ("api", "10.42.2.22"),
    "api-5b7d9c4f8-g5h6j": ("api", "10.42.2.23"),  # its proxy does not answer
    "store-7f6d8b9c4-q7r8s": ("store", "10.42.3.31"),
    "legacy-8d9f7c6b5-t9u1v": ("legacy", "10.42.4.41"),  # not meshed
}
SILENT = "api-5b7d9c4f8-g5h6j"


def _owned(pod: dict[str, Any], deployment: str) -> dict[str, Any]:
    """As the Deployment's ReplicaSet makes it: `<deployment>-<hash>-<suffix>`."""
    template_hash = pod["metadata"]["name"].split("-")[-2]
    pod["metadata"]["labels"]["pod-template-hash"] = template_hash
    pod["metadata"]["ownerReferences"] = [{
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{deployment}-{template_hash}",
        "uid": f"00000000-0000-4000-8000-{template_hash:0>12}", "controller": True,
    }]  # fmt: skip
    return pod


@dataclass
class Emojivoto:
    """Namespace emojivoto in the fake API: the Deployments of data/emojivoto.yaml as `meshlet
    inject --manual` meshes them (legacy is left out), their running pods, a finished one, and
    a proxy behind every meshed pod's admin port but one (SILENT: connection refused)."""

    api: FakeKubeAPI
    meshlet: Callable[..., Any]
    kubeconfig: str
    proxies: Proxies

    def build(self) -> None:
        self.api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        anchors = str(pki.TRUST_ANCHORS)
        injected = self.meshlet("inject", "--manual", "--ignore-cluster",
                                "--identity-trust-anchors-file", anchors, str(APP))  # fmt: skip
        assert injected.code == 0, injected.err
        templates = {}
        for doc in yaml.safe_load_all(injected.out):
            if doc:
                self.api.apply(doc)
                templates[doc["metadata"]["name"]] = doc["spec"]["template"]
        for pod, (deploy, ip) in PODS.items():
            self.api.apply(_owned(ready_pod(templates[deploy], pod, NS, ip), deploy))
            if deploy == "legacy":
                continue
            if pod == SILENT:
                self.api.expose(ip, wk.PROXY_ADMIN_PORT, ("127.0.0.1", closed_port()))
            else:
                self.proxies.serve(pod, ip)
        finished = _owned(
            ready_pod(templates["web"], "web-6c8f9d7b5-old01", NS, "10.42.1.9"), "web"
        )
        finished["status"]["phase"] = "Succeeded"  # neither counted nor read
        self.api.apply(finished)

    def run(self, *args: str) -> Any:
        """`meshlet ARGS… --kubeconfig FILE`."""
        return self.meshlet(*args, "--kubeconfig", self.kubeconfig)
