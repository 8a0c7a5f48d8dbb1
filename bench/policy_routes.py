"""What a cluster's HTTPRoutes cost the policy controller to load: a real `meshlet-controller
policy` process over a manifests folder of N HTTPRoutes, from its start until it is ready (every
object read and indexed), and its memory then.

    python -m bench.policy_routes [--routes N] [--tree PATH]

The folder (JSON `List` files, which parse at C speed, so the figures are the controller's own):
100 namespaces, each with 10 Services, a Server, a pod the Server selects and N/100 HTTPRoutes,
each naming one of the namespace's Services as its parent (every tenth also its Server), with
two rules of path, header and method matches, a RequestHeaderModifier and weighted backends.
The controller is ready when `/ready` answers 200: its source has delivered every kind, and each
delivery is applied before the admin server can answer; the load's wall time, and its CPU time
(which a shared machine disturbs less). Then one `Get` of a Service's
outbound policy and one `GetPort` of the pod's inbound policy (their time and size), and the
process's resident memory (VmRSS) and its peak (VmHWM).

`--tree PATH` runs the controller from another source tree (say `git archive REV | tar -x -C
PATH`), for a before-and-after. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Final

import grpc

from meshlet.api import inbound_pb2, outbound_pb2
from meshlet.controlplane.k8s import objects
from meshlet_testing.sockets import free_port as _free_port

NAMESPACES: Final = 100
SERVICES: Final = 10  # per namespace
GW: Final = "gateway.networking.k8s.io"
POLICY: Final = "policy.meshlet.io"
SOURCES: Final = ("proto", "controlplane", "proxy", "init", "cli", "testing")


def route(ns: str, n: int) -> dict[str, Any]:
    service = f"svc-{n % SERVICES}"
    parents: list[dict[str, Any]] = [{"group": "core", "kind": "Service", "name": service,
                                      "port": 80}]  # fmt: skip
    if n % 10 == 0:
        parents.append({"group": POLICY, "kind": "Server", "name": "web"})
    rules = [
        {
            "matches": [
                {"path": {"type": "PathPrefix", "value": f"/r{n}/api"}, "method": "GET",
                 "headers": [{"name": "x-tenant", "value": f"t{n % 7}"}]},
                {"path": {"type": "Exact", "value": f"/r{n}/health"}},
            ],
            "filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
                "set": [{"name": "x-route", "value": f"r{n}"}]}}],
            "backendRefs": [{"name": service, "port": 80, "weight": 90},
                            {"name": f"svc-{(n + 1) % SERVICES}", "port": 80, "weight": 10}],
        },
        {"matches": [{"path": {"type": "PathPrefix", "value": f"/r{n}"}}],
         "backendRefs": [{"name": service, "port": 80}]},
    ]  # fmt: skip
    return {
        "apiVersion": f"{GW}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": f"route-{n}", "namespace": ns,
                     "creationTimestamp": f"2026-01-01T00:{n // 3600 % 60:02d}:{n % 60:02d}Z"},
        "spec": {"parentRefs": parents, "rules": rules},
    }  # fmt: skip


def write_folder(root: Path, routes: int) -> None:
    per = routes // NAMESPACES
    for i in range(NAMESPACES):
        ns = f"ns-{i}"
        items: list[dict[str, Any]] = [
            objects.service(f"svc-{s}", ns, cluster_ip=f"10.96.{i}.{s + 1}")
            for s in range(SERVICES)
        ]
        items.append(objects.pod("web-1", f"10.1.{i}.1", ns, app="web", sa="web",
                                 container_ports=[("http", 8080)]))  # fmt: skip
        items.append({
            "apiVersion": f"{POLICY}/v1beta3", "kind": "Server",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "port": 8080,
                     "proxyProtocol": "HTTP/1"},
        })  # fmt: skip
        items += [route(ns, n) for n in range(per)]
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        (root / f"{ns}.json").write_text(text)


def _cpu(pid: int) -> float:
    """The process's CPU time so far (user and system), in seconds: what its load cost it,
    whatever else the machine runs meanwhile."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB → MiB
    return {"rss_mib": fields["VmRSS"], "peak_mib": fields["VmHWM"]}


def _ready(admin: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=5) as response:
            return int(response.status) == 200
    except OSError:
        return False


def _ask(port: int) -> dict[str, Any]:
    options = [("grpc.max_receive_message_length", 256 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        get = ch.unary_unary(
            "/io.linkerd.proxy.outbound.OutboundPolicies/Get",
            request_serializer=outbound_pb2.TrafficSpec.SerializeToString,
            response_deserializer=outbound_pb2.OutboundPolicy.FromString,
        )
        started = time.monotonic()
        policy = get(outbound_pb2.TrafficSpec(source_workload='{"ns":"ns-0","pod":"web-1"}',
                                              authority="svc-0.ns-0.svc.cluster.local:80"),
                     timeout=300)  # fmt: skip
        outbound = time.monotonic() - started
        get_port = ch.unary_unary(
            "/io.linkerd.proxy.inbound.InboundServerPolicies/GetPort",
            request_serializer=inbound_pb2.PortSpec.SerializeToString,
            response_deserializer=inbound_pb2.Server.FromString,
        )
        started = time.monotonic()
        server = get_port(inbound_pb2.PortSpec(workload='{"ns":"ns-0","pod":"web-1"}', port=8080),
                          timeout=300)  # fmt: skip
        inbound = time.monotonic() - started
    return {
        "get_seconds": outbound,
        "get_routes": len(policy.protocol.detect.http1.routes),
        "get_bytes": policy.ByteSize(),
        "getport_seconds": inbound,
        "getport_routes": len(server.protocol.http1.routes),
    }


def measure(routes: int, tree: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshlet-policy-routes-") as tmp:
        root = Path(tmp) / "manifests"
        root.mkdir()
        write_folder(root, routes)
        port, admin = _free_port(), _free_port()
        env = dict(os.environ)
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join(str(tree / s) for s in SOURCES)
        argv = [sys.executable, "-m", "meshlet.controlplane.main", "policy",
                "--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
                "--manifests", str(root)]  # fmt: skip
        log = Path(tmp) / "policy.log"
        with log.open("wb") as out:
            started = time.monotonic()
            proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env)
            try:
                while not _ready(admin):
                    if proc.poll() is not None:
                        raise RuntimeError(f"the controller exited: {log.read_text()[-2000:]}")
                    time.sleep(0.1)
                loaded = time.monotonic() - started
                cpu = _cpu(proc.pid)
                memory = _memory(proc.pid)
                answers = _ask(port)
            finally:
                proc.terminate()
                proc.wait(30)
        return {"routes": routes, "load_seconds": loaded, "load_cpu_seconds": cpu, **memory,
                **answers}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", type=int, default=100_000)
    parser.add_argument("--tree", type=Path, help="run the controller from this source tree")
    args = parser.parse_args()
    print(json.dumps(measure(args.routes, args.tree), indent=1))


if __name__ == "__main__":
    main()
