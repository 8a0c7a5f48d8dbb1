"""What a Service's HTTPRoutes cost the client-side proxy: instructions per request (callgrind)
with no HTTPRoute, with 100 and with 10,000, and for 10,000 the proxy's memory and how long a
route edit takes to be in force.

    python -m bench.instructions_routes [--requests N] [--many N] [--smoke]

A real `meshlet-controller destination` and `meshlet-controller policy` serve one manifests
folder: Service `api` (port 80, appProtocol `http`, to an upstream answering `200 ok` over
HTTP/1.1; port 81, `kubernetes.io/h2c`, to one answering over h2c) and its unmeshed pod, and the
HTTPRoutes of the row. A `meshlet-proxy`
follows both; a client of this module's own sends requests one after the other on one
connection to the proxy's outbound listener, for `api.shop.svc.cluster.local` (the connection is
not redirected, so each request is routed by its authority, discovery and the Service's outbound
policy). The rows:

- *no HTTPRoute*: the policy's default route (the proxy matches nothing);
- *100 HTTPRoutes*, and *10,000*: routes of the usual kinds (path prefixes, exact paths with a
  method, header matches for a canary, a regex in fifty up to the regex budget), each with one
  rule and no backendRefs (the parent Service), the request hitting the one in the middle
  (`route_for`).

Once a row's routes are written, a proxy outside valgrind asks until the policy controller
routes by them (`Mesh.settle`: it polls the folder, and may read it half written). The proxy
starts watching the Service's policy at its first request for it: each count sends
that one request on a connection of its own, waits until the proxy logs the policy, then sends
the rest on another; a count stands
only if the proxy's `outbound_http_route_backend_requests_total` gives every request but the
first to the expected route. As `bench.instructions` does, each count is taken twice, with
WARMUP and with WARMUP + N requests, and the difference divided by N (start-up, the policy's
decoding and indexing, the first requests cancel out). The issue's ask: 100 routes within
LIMIT of none.

For 10,000 routes, outside valgrind: the proxy's resident memory once the policy is in force
(beside the same with no HTTPRoute), and the update latency: the middle route's file (a hundred
routes a file) rewritten with a response header added, then requests every POLL seconds until
one comes back with it; the time from the rename to that answer, which includes the policy
controller's polling of the folder (every 0.5 s), its answer, the proxy's decoding and the
route index's rebuild. Without valgrind it says so and exits 0. `--smoke` runs the checks
without valgrind, for a few requests, and prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench import budget, instructions, proxy_mesh
from bench.proxy_procs import Processes, local_proxy_env, wait_for_ready
from meshlet.api.pathregex import MAX_REGEXES
from meshlet.api.wellknown import ProxyEnv
from meshlet.cli.stats import parse
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder
from meshlet_testing.sockets import free_port

NS: Final = "shop"
HOST: Final = f"api.{NS}.svc.cluster.local"
GW: Final = "gateway.networking.k8s.io"
POD_IP: Final = "127.0.0.1"
ROUTES: Final = 100
MANY: Final = 10_000
PER_FILE: Final = 100  # routes per manifest file
LIMIT: Final = 1.05  # the issue: 100 routes cost at most 5 % more per request than none
WARMUP: Final = instructions.WARMUP
REQUESTS: Final = instructions.REQUESTS
START_TIMEOUT: Final = instructions.START_TIMEOUT
# Routes among which one in fifty has a regex: the proxy refuses a policy with more than
# MAX_REGEXES distinct ones (its regex budget), so 10,000 routes hold 128, not 200.
REGEX_ROUTES: Final = 50 * MAX_REGEXES
POLICY_TIMEOUT: Final = 600.0  # seconds for a proxy under valgrind to decode 10,000 routes
POLL: Final = 0.01  # seconds between requests while waiting for an edit
EDITS: Final = 3
# Each port declares its protocol, so its policy holds that protocol's routes only: on a port
# left to detection the policy carries every route twice (HTTP/1 and HTTP/2), and the proxy
# refuses a policy of more than MAX_ROUTES in all (discovery.outbound_decode).
APP_PROTOCOLS: Final = ("http", "kubernetes.io/h2c")
# name: (requests on a socket, the Service port, which upstream port)
CLIENTS: Final = {
    "HTTP/1.1": (instructions.h1_exchange, 80, 0),
    "HTTP/2": (instructions.h2_exchange, 81, 1),
}


def route_name(i: int) -> str:
    return f"route-{i:05d}"


def http_route(i: int, edit: int = 0) -> objects.Obj:
    """HTTPRoute `i` of a table: a regex in fifty (among the first REGEX_ROUTES: a policy holds at
    most MAX_REGEXES), a canary header match in ten, an exact path with a method in four, else a
    path prefix. `edit` > 0 adds a response header saying so."""
    seg = f"/svc{i:05d}"
    match: dict[str, Any]
    if _is_regex(i):
        match = {"path": {"type": "RegularExpression", "value": f"{seg}/items/[0-9]+"}}
    elif i % 10 == 3:
        match = {"path": {"type": "PathPrefix", "value": seg},
                 "headers": [{"name": "x-canary", "value": "1"}]}  # fmt: skip
    elif i % 4 == 1:
        match = {"path": {"type": "Exact", "value": f"{seg}/login"}, "method": "POST"}
    else:
        match = {"path": {"type": "PathPrefix", "value": f"{seg}/api"}}
    rule: dict[str, Any] = {"matches": [match]}
    if edit:
        rule["filters"] = [{"type": "ResponseHeaderModifier", "responseHeaderModifier": {
            "set": [{"name": "x-edit", "value": str(edit)}]}}]  # fmt: skip
    return {
        "apiVersion": f"{GW}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": route_name(i), "namespace": NS},
        "spec": {"parentRefs": [{"group": "core", "kind": "Service", "name": "api"}],
                 "rules": [rule]},
    }  # fmt: skip


def target(routes: int) -> tuple[int, str]:
    """The route the counted requests hit (the middle one, a path prefix) and their path."""
    i = max(routes, ROUTES) // 2
    assert is_prefix(i) and is_prefix(max(routes, ROUTES) - 1), "the middle and last: prefixes"
    return i, f"/svc{i:05d}/api/orders/17?page=2"


def _is_regex(i: int) -> bool:
    return i % 50 == 17 and i < REGEX_ROUTES


def is_prefix(i: int) -> bool:
    return not _is_regex(i) and i % 10 != 3 and i % 4 != 1


class Mesh:
    """The upstream, the manifests folder and the two controllers every proxy here follows."""

    def __init__(self, stack: ExitStack, scratch: Path) -> None:
        self.upstream = stack.enter_context(instructions.upstream(POD_IP))
        self.scratch = scratch
        self.folder = ManifestsFolder(scratch / "manifests")
        self.folder.root.mkdir()
        ports: list[tuple[str, int, int | str]] = [
            ("http", 80, self.upstream[0]), ("h2c", 81, self.upstream[1])
        ]  # fmt: skip
        service = objects.service("api", NS, ports=ports, cluster_ip="10.96.25.1")
        for port, app in zip(service["spec"]["ports"], APP_PROTOCOLS, strict=True):
            port["appProtocol"] = app
        pod = objects.pod("api-1", POD_IP, NS, app="api", sa="api", meshed=False)
        self.folder.put("api", service, pod)
        self.procs = stack.enter_context(Processes(scratch))
        self.ports = {kind: free_port() for kind in ("destination", "policy")}
        for kind, port in self.ports.items():
            flags = ["--manifests", str(self.folder.root)]
            proxy_mesh.start_controller(self.procs, kind, port, flags, None, 60.0)
        self.routes = 0
        self._runs = 0

    def set_routes(self, n: int) -> None:
        """The folder holds HTTPRoutes 0..n-1, PER_FILE a file."""
        for old in range(0, self.routes, PER_FILE):
            self.folder.remove(f"routes-{old // PER_FILE:03d}")
        for first in range(0, n, PER_FILE):
            batch = (http_route(i) for i in range(first, min(first + PER_FILE, n)))
            self.folder.put(f"routes-{first // PER_FILE:03d}", *batch)
        self.routes = n

    def settle(self) -> None:
        """Until the policy controller serves all the folder's routes: a proxy outside valgrind
        asked until it routes a request by the middle route and one by the last (the folder is
        written file by file, in order, and the controller may read it half written)."""
        i, path = target(self.routes)
        asks = [(route_name(i) if self.routes else "", path)]
        if self.routes:
            asks.append((route_name(self.routes - 1), f"/svc{self.routes - 1:05d}/api/x"))
        deadline = time.monotonic() + POLICY_TIMEOUT
        with self.proxy() as proxy:
            for route, path in asks:
                while proxy.routed(route) == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the policy controller never served {route!r}")
                    conn = http.client.HTTPConnection("127.0.0.1", proxy.outbound, timeout=60)
                    with contextlib.closing(conn):
                        conn.request("GET", path, headers={"Host": f"{HOST}:80"})
                        conn.getresponse().read()
                    time.sleep(0.1)

    def edit(self, i: int, edit: int) -> float:
        """Rewrites route `i`'s file with the route's `edit`; when the new file took its place."""
        first = i - i % PER_FILE
        routes = [http_route(j, edit if j == i else 0)
                  for j in range(first, min(first + PER_FILE, self.routes))]  # fmt: skip
        self.folder.put(f"routes-{first // PER_FILE:03d}", *routes)
        return time.monotonic()

    @contextlib.contextmanager
    def proxy(self, argv_prefix: list[str] | None = None) -> Iterator[Proxy]:
        """A proxy following the controllers (run by `argv_prefix`, e.g. valgrind), once ready."""
        self._runs += 1
        ports = {name: free_port() for name in ("outbound", "inbound", "admin", "control")}
        env = local_proxy_env(ports)
        env.update({
            ProxyEnv.LOG: "info",  # the line saying the policy arrived (none per request)
            ProxyEnv.DESTINATION_SVC_ADDR: f"127.0.0.1:{self.ports['destination']}",
            ProxyEnv.DESTINATION_CONTEXT: json.dumps({"ns": NS, "nodeName": "node-1"}),
            ProxyEnv.POLICY_SVC_ADDR: f"127.0.0.1:{self.ports['policy']}",
            ProxyEnv.POLICY_WORKLOAD: json.dumps({"ns": NS, "pod": "client-1"}),
        })  # fmt: skip
        argv = [*(argv_prefix or []), sys.executable, "-m", "meshlet.proxy.main"]
        proc, log = self.procs.start(f"proxy-{self._runs}", argv, env=env)
        try:
            wait_for_ready(f"http://127.0.0.1:{ports['admin']}/ready", proc, log, START_TIMEOUT)
            yield Proxy(proc, log, ports["outbound"], ports["admin"])
        finally:
            self.procs.stop(proc, grace=120.0)


@dataclass(frozen=True, slots=True)
class Proxy:
    proc: subprocess.Popen[bytes]
    log: Path
    outbound: int
    admin: int

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.outbound), timeout=120)
        sock.settimeout(120)
        return sock

    def in_force(self, port: int, versions: int = 1) -> None:
        """Until the proxy logged `versions` policies of the Service's `port`."""
        line = f"outbound {HOST}:{port}: policy "
        deadline = time.monotonic() + POLICY_TIMEOUT
        while self.log.read_text(errors="replace").count(line) < versions:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"no outbound policy for {HOST}:{port} in {self.log}")
            time.sleep(0.05)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        with contextlib.closing(http.client.HTTPConnection("127.0.0.1", self.admin, timeout=30)
                                ) as conn:  # fmt: skip
            conn.request("GET", "/metrics")
            return parse(conn.getresponse().read().decode())

    def answered(self, port: int) -> float:
        """Requests for the Service's `port` the proxy relayed a 200 for."""
        want = {("dst", f"{HOST}:{port}"), ("status_code", "200")}
        return sum(v for (n, labels), v in self.metrics().items()
                   if n == "route_response_total" and want <= labels)  # fmt: skip

    def routed(self, route: str) -> float:
        """Requests the proxy dispatched by HTTPRoute `route` ("": by the default route)."""
        series = self.metrics()
        name = "outbound_http_route_backend_requests_total"
        return sum(v for (n, labels), v in series.items()
                   if (n == name and {("route_kind", "HTTPRoute"), ("route_name", route)} <= labels)
                   or (not route and ("route_kind", "default") in labels))  # fmt: skip

    def rss(self) -> int:
        """The proxy's resident memory, bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def send(proxy: Proxy, client: str, routes: int, n: int, versions: int = 1) -> None:
    """`n` requests of `client`: one on a connection of its own, then, once the policy is in
    force (the proxy's `versions`th for the port), the rest one after the other on one
    connection; the proxy must have routed all but the first by the expected route."""
    exchange, port, _ = CLIENTS[client]
    i, path = target(routes)
    route = route_name(i) if routes else ""
    before, answered = proxy.routed(route), proxy.answered(port)
    with proxy.connect() as sock:
        exchange(sock, f"{HOST}:{port}", 1, (), path)
    proxy.in_force(port, versions)
    with proxy.connect() as sock:
        exchange(sock, f"{HOST}:{port}", n - 1, (), path)
    routed = proxy.routed(route) - before
    if routed < n - 1:
        where = route or "the default route"
        raise RuntimeError(f"only {routed:.0f} of {n - 1} requests went by {where}")
    if (ok := proxy.answered(port) - answered) < n:
        raise RuntimeError(f"only {ok:.0f} of {n} requests answered 200")


def count(mesh: Mesh, client: str, routes: int, n: int) -> int:
    """Instructions of one proxy's whole life, serving `n` requests of `client`."""
    out = mesh.scratch / f"callgrind.{routes}.{n}.{client.replace('/', '')}.out"
    valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
    with mesh.proxy(valgrind) as proxy:
        send(proxy, client, routes, n)
    return instructions.total(out)


def per_request(mesh: Mesh, client: str, routes: int, requests: int) -> float:
    low = count(mesh, client, routes, WARMUP)
    high = count(mesh, client, routes, WARMUP + requests)
    return (high - low) / requests


@dataclass(frozen=True, slots=True)
class Many:
    routes: int
    rss: int  # bytes, with `routes` routes in force
    rss_none: int  # bytes, with no HTTPRoute
    updates: list[float]  # seconds from an edit to its first use


def memory_and_updates(mesh: Mesh, routes: int, requests: int) -> Many:
    """Outside valgrind: the proxy's memory with no HTTPRoute and with `routes`; then EDITS
    edits of the hit route, each timed to the first answer carrying it."""
    rss = {}
    for n in (0, routes):
        mesh.set_routes(n)
        mesh.settle()
        with mesh.proxy() as proxy:
            send(proxy, "HTTP/1.1", n, requests)
            rss[n] = proxy.rss()
            if n:
                updates = [_update(mesh, proxy, n, edit) for edit in range(1, EDITS + 1)]
    return Many(routes, rss[routes], rss[0], updates)


def _update(mesh: Mesh, proxy: Proxy, routes: int, edit: int) -> float:
    i, path = target(routes)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.outbound, timeout=30)
    with contextlib.closing(conn):
        written = mesh.edit(i, edit)
        deadline = written + POLICY_TIMEOUT
        while time.monotonic() < deadline:
            conn.request("GET", path, headers={"Host": f"{HOST}:80"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"{path}: {response.status} while waiting for edit {edit}")
            if response.getheader("x-edit") == str(edit):
                return time.monotonic() - written
            time.sleep(POLL)
    raise RuntimeError(f"edit {edit} of {route_name(i)} not in force within {POLICY_TIMEOUT:g}s")


def table(rows: dict[str, dict[int, float]]) -> list[str]:
    lines = [
        f"| protocol | HTTPRoutes | instructions/request | vs none | within {LIMIT:g}x |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for client, by_routes in rows.items():
        none = by_routes[0]
        for routes, value in by_routes.items():
            ratio = value / none
            verdict = "" if routes != ROUTES else (
                "yes" if ratio <= LIMIT else f"**no: over {LIMIT:g}x**")  # fmt: skip
            lines.append(f"| {client} | {routes:,} | {value:,.0f} | **{ratio:.3f}x** | {verdict} |")
    return lines


def smoke(scratch: Path) -> dict[str, Any]:
    """Every row's checks without valgrind, a few requests each, on one proxy: with no
    HTTPRoute, then with ROUTES, then an edit timed."""
    with ExitStack() as stack:
        mesh = Mesh(stack, scratch)
        out: dict[str, Any] = {}
        mesh.set_routes(0)
        with mesh.proxy() as proxy:
            for versions, routes in enumerate((0, ROUTES), start=1):
                mesh.set_routes(routes)
                for client in CLIENTS:
                    send(proxy, client, routes, 5, versions)
                    out[f"{client} {routes}"] = "ok"
            out["update seconds"] = _update(mesh, proxy, ROUTES, 1)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted")
    parser.add_argument("--many", type=int, default=MANY, help="routes of the hostile row")
    parser.add_argument("--smoke", action="store_true", help="checks only, no valgrind (JSON)")
    parser.add_argument(
        "--record",
        metavar="REV",
        help="lower the budget of each row now below it, naming revision REV",
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-instructions-routes-"))
    try:
        if args.smoke:
            print(json.dumps(smoke(scratch)))
            return 0
        title = "## Instructions per request by the number of HTTPRoutes, client-side proxy"
        if shutil.which("valgrind") is None:
            print(f"{title}: valgrind is not installed here; nothing measured")
            return 0
        return _measure(scratch, title, args.requests, args.many, args.record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(scratch: Path, title: str, requests: int, many: int, record: str | None) -> int:
    rows: dict[str, dict[int, float]] = {}
    with ExitStack() as stack:
        mesh = Mesh(stack, scratch)
        for routes in (0, ROUTES, many):
            mesh.set_routes(routes)
            mesh.settle()
            for client in CLIENTS if routes <= ROUTES else ("HTTP/1.1",):
                print(f"{client}, {routes} HTTPRoutes ...", file=sys.stderr)
                rows.setdefault(client, {})[routes] = per_request(mesh, client, routes, requests)
        print(f"{many} HTTPRoutes: memory and update latency ...", file=sys.stderr)
        big = memory_and_updates(mesh, many, 20)
    print(f"\n{title} (callgrind)\n")
    print(f"Outbound, one connection, requests one after the other for {HOST}, routed by its "
          "outbound policy from the policy controller; the request hits the middle route. "
          "User space only.\n")  # fmt: skip
    print("\n".join(table(rows)))
    mib = 1024 * 1024
    updates = ", ".join(f"{s * 1000:.0f} ms" for s in big.updates)
    print(f"\n{big.routes:,} HTTPRoutes, outside valgrind: the proxy's resident memory "
          f"{big.rss / mib:.1f} MiB (with no HTTPRoute {big.rss_none / mib:.1f} MiB, "
          f"+{(big.rss - big.rss_none) / mib:.1f} MiB); a route edit first used after "
          f"{updates} (the controller polls the folder every 0.5 s).")  # fmt: skip
    counts = {
        f"client side, {client}, {routes:,} HTTPRoutes": count
        for client, by_routes in rows.items()
        for routes, count in by_routes.items()
    }
    print("\nHeld to the instruction budget (bench/instructions-budget.json, docs/bench.md):\n")
    print("\n".join(budget.section(counts)))
    if record:
        changed = budget.record(counts, record)
        print(f"\nbudget lowered: {', '.join(changed) or 'no row'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
