"""The meshed meshlet pair with an AuthorizationPolicy in force: what authorization costs it.

`meshlet-policy-mesh` is `meshlet-mesh` (bench/proxy_mesh.py) plus `meshlet-controller policy`,
in plaintext as the bench's destination service is, over a manifests folder of its own: the two
pods, a Server per HTTP upstream port of the server pod (protocol detected, Linkerd's default;
`accessPolicy` deny), an AuthorizationPolicy per Server requiring MeshTLSAuthentication
`bench-client`, which names the client pod's identity. The server pod's proxy watches those
ports (`INBOUND_PORTS`, `POLICY_WORKLOAD`); nothing else differs, so the two rows differ by the
policy alone: without it the server proxy applies its built-in default (`all-unauthenticated`,
one route that needs no match), with it the controller's Server (its default route matched on
the path of each request, the client's decision computed once per connection and policy).

The pair's client proxy connects from 127.0.0.1, which every controller-sent policy also admits
unauthenticated, as linkerd2-proxy's do. The policy's own authorization comes first and wins for
the client's identity, and a row stands only if the server proxy counted its requests as
allowed by the AuthorizationPolicy and none by that loopback exception
(`proxy_evidence.meshlet_authorized`).

`python -m bench.proxy_policy` starts the pair with its policy in a fresh network namespace (it
needs root; the pods' ports are the mesh's fixed ones), makes one request through the pair and
two with a TLS client of its own from another address, one as the client pod's identity and one
as an identity the policy does not name, and prints what each got and what the server proxy
counted, as JSON. bench/tests/ runs it.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import shutil
import socket
import ssl
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from bench import proxy_evidence, proxy_mesh, proxy_netns
from bench.proxy_configs import Ports
from bench.proxy_pki import Leaf, make_pki
from bench.proxy_procs import Processes
from bench.proxy_report import POLICY_PAIR, POLICY_WITHOUT, Scenario
from meshlet.api import transport_header, wellknown
from meshlet.api.transport_header import Header, SessionProtocol
from meshlet.controlplane.k8s import objects
from meshlet_testing.sockets import free_port

PAIR: Final = POLICY_PAIR  # the row's proxy name
WITHOUT: Final = POLICY_WITHOUT  # the row it is compared with
SCENARIOS: Final = (Scenario.H1, Scenario.H2)  # where it is measured
NAME: Final = "meshlet-policy"  # the part before "-mesh": the launcher's key for it
AUTHN: Final = "bench-client"  # the MeshTLSAuthentication naming the client pod's identity
HTTP_PORTS: Final = ("h1", "h2", "grpc")  # `Ports` fields with a Server (and a policy) each
G: Final = wellknown.POLICY_API_GROUP
OTHER_ID: Final = wellknown.identity_name("other", proxy_mesh.NS)  # a client the policy refuses
OTHER_IP: Final = "127.0.0.4"  # where the check's own TLS client connects from (not loopback's)
IN_FORCE_TIMEOUT: Final = 10.0


def order(proxies: Sequence[str], scenario: Scenario, turn: int) -> list[str]:
    """`proxies` with PAIR measured only in SCENARIOS, right beside WITHOUT when that is
    measured: before it on even turns (the scenario's index), after it on odd ones, so that a
    machine growing busier or quieter during the run favours neither."""
    ordered = [p for p in proxies if p != PAIR]
    if PAIR not in proxies or scenario not in SCENARIOS:
        return ordered
    if WITHOUT not in ordered:
        return list(proxies)
    at = ordered.index(WITHOUT) + turn % 2
    return [*ordered[:at], PAIR, *ordered[at:]]


def policy_name(field: str) -> str:
    """The Server and the AuthorizationPolicy of the upstream port `field` (h1, h2, grpc)."""
    return f"bench-{field}"


def manifests(upstream: Ports) -> list[objects.Obj]:
    """The pods, then per HTTP port a Server and its AuthorizationPolicy, and the
    MeshTLSAuthentication they require."""
    found: list[objects.Obj] = [*proxy_mesh.pods(upstream)]
    for field in HTTP_PORTS:
        name = policy_name(field)
        found.append(_resource("v1beta3", "Server", name, {
            "podSelector": {"matchLabels": {"app": proxy_mesh.SERVICE}},
            "port": getattr(upstream, field),
        }))  # fmt: skip
        found.append(_resource("v1alpha1", "AuthorizationPolicy", name, {
            "targetRef": {"group": G, "kind": "Server", "name": name},
            "requiredAuthenticationRefs": [
                {"group": G, "kind": "MeshTLSAuthentication", "name": AUTHN}
            ],
        }))  # fmt: skip
    admitted = {"identities": [proxy_mesh.CLIENT_ID]}
    found.append(_resource("v1alpha1", "MeshTLSAuthentication", AUTHN, admitted))
    return found


def _resource(version: str, kind: str, name: str, spec: dict[str, Any]) -> objects.Obj:
    return {
        "apiVersion": f"{G}/{version}",
        "kind": kind,
        "metadata": {"name": name, "namespace": proxy_mesh.NS},
        "spec": spec,
    }


def start_controller(
    procs: Processes, root: Path, upstream: Ports, cpu: int | None, timeout: float
) -> int:
    """`meshlet-controller policy` over `manifests(upstream)` written under `root`, on `cpu`,
    once ready; its port on 127.0.0.1."""
    folder = root / "policy-manifests"
    folder.mkdir(parents=True)
    (folder / "policy.yaml").write_text(yaml.safe_dump_all(manifests(upstream)))
    port = free_port()
    proxy_mesh.start_controller(procs, "policy", port, ["--manifests", str(folder)], cpu, timeout)
    return port


def server_env(policy_port: int, upstream: Ports) -> dict[str, str]:
    """What the server pod's proxy is told besides `ControlPlane.proxy_env`: where the policy
    controller is, which pod it is, which ports to watch."""
    e = wellknown.ProxyEnv
    workload = {"ns": proxy_mesh.NS, "pod": "server"}
    ports = ",".join(str(getattr(upstream, field)) for field in HTTP_PORTS)
    return {
        str(e.POLICY_SVC_ADDR): f"127.0.0.1:{policy_port}",
        str(e.POLICY_WORKLOAD): json.dumps(workload, separators=(",", ":")),
        str(e.INBOUND_PORTS): ports,
    }


def allowed_by_policy(server_metrics: str, field: str) -> float:
    """Requests of the client pod that the server proxy allowed by `field`'s
    AuthorizationPolicy."""
    labels = {"authz_kind": "authorizationpolicy", "authz_name": policy_name(field),
              "client_id": proxy_mesh.CLIENT_ID}  # fmt: skip
    return proxy_evidence.metric_sum(server_metrics, "inbound_http_authz_allow_total", labels)


def wait_in_force(field: str, probe: Callable[[], None], timeout: float = IN_FORCE_TIMEOUT) -> int:
    """Probe through the pair until the server proxy counts a request as allowed by `field`'s
    AuthorizationPolicy (until then its default policy answers: the controller's first answer
    reaches the proxy after it is ready); the probes it took. RuntimeError after `timeout`."""
    deadline = time.monotonic() + timeout
    probes = 0
    while True:
        probe()
        probes += 1
        if allowed_by_policy(proxy_mesh.metrics("server"), field) > 0:
            return probes
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"after {timeout:g} s the server proxy still allowed no request by "
                f"AuthorizationPolicy {policy_name(field)}: the policy is not in force"
            )
        time.sleep(0.1)


def judge(scenario: str, at_least: int) -> proxy_evidence.Verdict:
    """The pair's proof (mutual TLS, as `meshlet-mesh`'s) and the policy's: `at_least` requests
    allowed by the scenario's AuthorizationPolicy, none by the loopback exception."""
    server, client = proxy_mesh.metrics("server"), proxy_mesh.metrics("client")
    verdict = proxy_evidence.meshlet_requests(client, server, proxy_mesh.SERVER_ID, at_least)
    if verdict.why:
        return verdict
    why = proxy_evidence.meshlet_authorized(
        server, proxy_mesh.CLIENT_ID, policy_name(scenario), at_least
    )
    return proxy_evidence.Verdict(why, verdict.tls_connections)


# -- the set-up check (`python -m bench.proxy_policy`) ---------------------------------------


def mesh_socket(
    leaf: Leaf, anchors: Path, port: int, protocol: SessionProtocol, source: str
) -> ssl.SSLSocket:
    """A connection to the server pod's `port` through its proxy's inbound listener, as a meshed
    client with `leaf`'s identity connecting from `source` would open it: mutual TLS 1.3, then
    the transport header asking for `port` with `protocol`."""
    context = ssl.create_default_context(cafile=str(anchors))
    context.load_cert_chain(leaf.chain, leaf.key)
    context.set_alpn_protocols([wellknown.TRANSPORT_ALPN])
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    raw = socket.create_connection(
        (proxy_mesh.SERVER_IP, wellknown.PROXY_INBOUND_PORT), timeout=5, source_address=(source, 0)
    )
    tls = context.wrap_socket(raw, server_hostname=proxy_mesh.SERVER_ID)
    tls.sendall(transport_header.encode(Header(port, "", protocol)))
    return tls


def mesh_get(leaf: Leaf, anchors: Path, port: int, source: str) -> int:
    """One HTTP/1.1 GET through `mesh_socket`: the status."""
    with mesh_socket(leaf, anchors, port, SessionProtocol.HTTP1, source) as tls:
        host = f"{proxy_mesh.SERVER_IP}:{port}"
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        response = http.client.HTTPResponse(tls)  # type: ignore[arg-type,unused-ignore]
        response.begin()
        response.read()
        return response.status


def pair_get(port: int) -> int:
    """One HTTP/1.1 GET for the service's `port` through the pair: the status."""
    conn = http.client.HTTPConnection(*proxy_mesh.OUTBOUND, timeout=5)
    try:
        conn.request("GET", "/", headers={"Host": proxy_mesh.authority(port)})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def check(scratch: Path, timeout: float = 20.0) -> dict[str, Any]:
    """Start the pair with its policy (an HTTP/1.1 upstream of its own on the server pod), make
    the requests the module's docstring names; what each got and what was counted."""
    from bench.proxy_launch import Launcher

    upstream = Ports(free_port(), free_port(), free_port(), free_port())
    pki = make_pki(scratch / "pki", proxy_mesh.CLIENT_ID, proxy_mesh.SERVER_ID,
                   dt.datetime.now(dt.UTC), others=(OTHER_ID,))  # fmt: skip
    with Processes(scratch) as procs:
        argv = [sys.executable, "-m", "http.server", "--bind", proxy_mesh.SERVER_IP,
                str(upstream.h1)]  # fmt: skip
        procs.start("upstream", argv, cpu=None)
        launcher = Launcher(procs, scratch, upstream, pki, None, None,
                            {"meshlet": f"{sys.executable} -m meshlet.proxy.main"}, None,
                            nginx_stream=False, timeout=timeout)  # fmt: skip
        launched = launcher.start(PAIR)
        probes = wait_in_force("h1", lambda: _expect_200(pair_get(upstream.h1)))
        found: dict[str, Any] = {"probes": probes, "pair": pair_get(upstream.h1)}
        found["admitted"] = mesh_get(pki.client, pki.anchors, upstream.h1, OTHER_IP)
        found["refused"] = mesh_get(pki.others[0], pki.anchors, upstream.h1, OTHER_IP)
        server = proxy_mesh.metrics("server")
        found["allowed_by_policy"] = allowed_by_policy(server, "h1")
        found["allowed_by_loopback"] = proxy_evidence.metric_sum(
            server, "inbound_http_authz_allow_total", proxy_evidence.LOOPBACK_AUTHZ
        )
        found["denied_other"] = proxy_evidence.metric_sum(
            server, "inbound_http_authz_deny_total", {"client_id": OTHER_ID}
        )
        found["verdict"] = launched.judge("h1", probes + 1) if launched.judge else None
        if isinstance(found["verdict"], proxy_evidence.Verdict):
            found["verdict"] = found["verdict"].why
    return found


def _expect_200(status: int) -> None:
    if status != 200:
        raise RuntimeError(f"a request through the pair answered {status}")


def main() -> int:
    if os.geteuid() != 0:
        print(json.dumps({"error": "needs root: the pair runs in a network namespace of its own"}))
        return 2
    if not proxy_netns.inside():
        proxy_netns.enter("bench.proxy_policy", sys.argv[1:])  # returns only without unshare
        print(json.dumps({"error": "unshare is not installed"}))
        return 2
    proxy_netns.loopback_up()
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-bench-policy-"))
    try:
        print(json.dumps(check(scratch)))
    except (RuntimeError, OSError) as exc:
        logs = {p.name: p.read_text(errors="replace")[-400:] for p in sorted(scratch.glob("*.log"))}
        print(json.dumps({"error": str(exc), "logs": logs}))
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
