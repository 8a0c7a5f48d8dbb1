"""The bench's meshed meshlet pair: a local control plane and two proxies on loopback pods.

Pods are loopback addresses (all of 127/8 is local): the client pod 127.0.0.2 and the server pod
127.0.0.3, each with a meshlet proxy on the mesh's usual ports, except that the client proxy's
outbound listener is on 127.0.0.1:4140, as in a pod (an iptables REDIRECT made in the OUTPUT
chain always lands on 127.0.0.1). The control plane runs as in the local mesh:
`meshlet-controller identity` with the bench's CA and a tokens file (it signs each proxy's
certificate) and `meshlet-controller destination` reading a manifests folder, in plaintext (the
bench measures the data path, not discovery's transport). The manifests hold Service `bench`,
one port per HTTP scenario (port = targetPort = the upstream's port), and the two pods, labelled
meshed, the server pod with the TCP scenario's port opaque (`config.meshlet.io/opaque-ports`),
so discovery gives the server pod's identity and opaque-transport port with its address.

So a request for `bench.bench.svc.cluster.local:PORT` sent to the client proxy's outbound
listener is looked up in discovery, balanced to the server pod and sent over mutual TLS 1.3 to
that pod's proxy's inbound listener (4143, the opaque-transport port), which forwards it to
127.0.0.3:PORT; the upstreams listen there too. A TCP connection to 127.0.0.3:TCP_PORT is
redirected by iptables to the client proxy, which looks the original destination up (the
server pod, opaque) and relays it over mutual TLS the same way. This is what
proxy/tests/mesh/test_component.py does in-process, here with real processes.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import yaml

from bench.proxy_configs import Ports
from bench.proxy_pki import Pki
from bench.proxy_procs import Processes, StartError, wait_for_ready
from meshlet.api import wellknown
from meshlet.controlplane.k8s import objects
from meshlet_testing.sockets import free_port

NS: Final = "bench"
SERVICE: Final = "bench"
CLUSTER_IP: Final = "10.96.0.100"
CLIENT_IP: Final = "127.0.0.2"
SERVER_IP: Final = "127.0.0.3"
PODS: Final = {"client": CLIENT_IP, "server": SERVER_IP}  # pod name = its service account
SERVER_ID: Final = wellknown.identity_name("server", NS)
CLIENT_ID: Final = wellknown.identity_name("client", NS)
OUTBOUND: Final = ("127.0.0.1", wellknown.PROXY_OUTBOUND_PORT)  # the client proxy's: load goes here


def authority(port: int | str) -> str:
    """The name the load addresses for the upstream port `port`: the service's, in discovery."""
    return f"{SERVICE}.{NS}.svc.cluster.local:{port}"


@dataclass(frozen=True, slots=True)
class ControlPlane:
    """The running identity and destination services, as the proxies are told of them."""

    root: Path  # holds the tokens and manifests, and one token file per pod
    identity_port: int
    destination_port: int
    anchors_pem: str
    opaque_port: int  # the TCP scenario's upstream port

    def proxy_env(self, pod: str) -> dict[str, str]:
        """Every MESHLET_PROXY_* setting of `pod`'s proxy, on the pod's address."""
        ip, e = PODS[pod], wellknown.ProxyEnv
        outbound = OUTBOUND if pod == "client" else (ip, wellknown.PROXY_OUTBOUND_PORT)
        settings = {
            e.INBOUND_LISTEN_ADDR: f"{ip}:{wellknown.PROXY_INBOUND_PORT}",
            e.OUTBOUND_LISTEN_ADDR: f"{outbound[0]}:{outbound[1]}",
            # as the injector sets it from the pod's opaque-ports annotation
            e.INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION: str(self.opaque_port),
            e.ADMIN_LISTEN_ADDR: f"{ip}:{wellknown.PROXY_ADMIN_PORT}",
            e.CONTROL_LISTEN_ADDR: f"{ip}:{wellknown.PROXY_CONTROL_PORT}",
            e.DESTINATION_SVC_ADDR: f"127.0.0.1:{self.destination_port}",
            e.DESTINATION_CONTEXT: json.dumps({"ns": NS, "nodeName": "node-1"}),
            e.IDENTITY_SVC_ADDR: f"127.0.0.1:{self.identity_port}",
            e.IDENTITY_SVC_NAME: wellknown.IDENTITY_SERVICE_NAME,
            e.IDENTITY_LOCAL_NAME: wellknown.identity_name(pod, NS),
            e.IDENTITY_TOKEN_FILE: str(self.root / f"{pod}.token"),
            e.IDENTITY_TRUST_ANCHORS: self.anchors_pem,
        }
        return {str(name): value for name, value in settings.items()}


def admin_url(pod: str, path: str) -> str:
    """`path` on the admin listener of `pod`'s proxy."""
    return f"http://{PODS[pod]}:{wellknown.PROXY_ADMIN_PORT}{path}"


def start_control_plane(
    procs: Processes, root: Path, pki: Pki, upstream: Ports, cpu: int | None, timeout: float
) -> ControlPlane:
    """Write the control plane's inputs under `root`, then start the identity (signing with
    `pki`'s issuer) and destination services on `cpu` and wait until both are ready."""
    tokens, manifests = _write_inputs(root, upstream)
    ports = {"identity": free_port(), "destination": free_port()}
    flags = {
        "identity": ["--trust-anchors", str(pki.anchors), "--issuer-dir", str(pki.issuer_dir),
                     "--tokens-file", str(tokens)],
        "destination": ["--manifests", str(manifests)],
    }  # fmt: skip
    for kind, port in ports.items():
        start_controller(procs, kind, port, flags[kind], cpu, timeout)
    anchors = pki.anchors.read_text()
    return ControlPlane(root, ports["identity"], ports["destination"], anchors, upstream.tcp)


def _write_inputs(root: Path, upstream: Ports) -> tuple[Path, Path]:
    """The tokens file (with each pod's token file beside it) and the manifests folder, under
    `root`."""
    root.mkdir()
    tokens = root / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump({f"tok-{sa}": {"namespace": NS, "serviceaccount": sa} for sa in PODS})
    )
    for sa in PODS:
        (root / f"{sa}.token").write_text(f"tok-{sa}")
    manifests = root / "manifests"
    manifests.mkdir()
    (manifests / "bench.yaml").write_text(yaml.safe_dump_all(_manifests(upstream)))
    return tokens, manifests


def _manifests(upstream: Ports) -> list[objects.Obj]:
    """Service `bench` (a port per HTTP scenario), its meshed server pod (the TCP port opaque)
    and the client pod."""
    ports: list[tuple[str, int, int | str]] = [
        (name, getattr(upstream, name), getattr(upstream, name)) for name in ("h1", "h2", "grpc")
    ]
    return [objects.service(SERVICE, NS, ports=ports, cluster_ip=CLUSTER_IP), *pods(upstream)]


def pods(upstream: Ports) -> list[objects.Obj]:
    """The meshed server pod (the TCP port opaque) and the client pod."""
    return [
        objects.pod(
            "server",
            SERVER_IP,
            NS,
            app=SERVICE,
            sa="server",
            owner=None,
            annotations={wellknown.OPAQUE_PORTS_ANNOTATION: str(upstream.tcp)},
        ),
        objects.pod("client", CLIENT_IP, NS, app="client", sa="client", owner=None),
    ]


def start_controller(
    procs: Processes, kind: str, port: int, flags: list[str], cpu: int | None, timeout: float
) -> None:
    """`meshlet-controller KIND` serving on 127.0.0.1:`port`, once its admin /ready says 200."""
    admin = free_port()
    argv = [sys.executable, "-m", "meshlet.controlplane.main", kind, "--log-level", "warning"]
    argv += ["--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}", *flags]
    proc, log = procs.start(kind, argv, cpu=cpu)
    try:
        wait_for_ready(f"http://127.0.0.1:{admin}/ready", proc, log, timeout)
    except StartError as exc:
        raise StartError(f"the {kind} service: {exc}") from None


def metrics(pod: str) -> str:
    """The Prometheus text of `pod`'s proxy."""
    with urllib.request.urlopen(admin_url(pod, "/metrics"), timeout=5) as response:
        return str(response.read().decode())
