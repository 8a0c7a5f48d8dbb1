"""Outbound policy end to end: real `meshlet-controller destination` and `policy` processes over
one manifests folder, a real `meshlet-proxy` process following both, and curl (HTTP/1.1, and
HTTP/2 with prior knowledge) sending requests for Service `api` through the proxy's outbound
listener (curl's --connect-to: the connection is not redirected, so each request is routed by
its authority, as iptables-less clients are).

Service `api`'s HTTPRoute sends `/v2` to Service `api-v2` (adding `x-route: v2` to the request
and `x-served: v2` to the response), requests
carrying `x-canary: yes` to `api-canary`, redirects `/old`, and splits the rest 90/10 between
`api` and `api-canary`. Each service has one unmeshed pod whose app (in this process) answers
with its pod name, the path and the header fields that reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from meshlet.api import wellknown
from meshlet.cli.stats import Series, parse
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder

NS: Final = "shop"
API: Final = f"api.{NS}.svc.cluster.local"
GW: Final = "gateway.networking.k8s.io"
PODS: Final = {"api": "127.0.0.1", "api-v2": "127.0.0.2", "api-canary": "127.0.0.3"}
DEADLINE: Final = 10.0  # what holds in milliseconds on an idle machine, on a busy one
GRPC_PODS: Final = {"rpc": "127.0.0.4", "rpc-v2": "127.0.0.5"}  # gRPC apps
# Service `flaky`: three pods, the third answers 500 to everything (all three: to /fail...)
FLAKY_PODS: Final = {"flaky-1": "127.0.0.6", "flaky-2": "127.0.0.7", "flaky-3": "127.0.0.8"}
FAILING: Final = "flaky-3"
FLAKY_PORT: Final = 8080
CLUSTER_IPS: Final = {"api": "10.96.7.1", "api-v2": "10.96.7.2", "api-canary": "10.96.7.3",
                      "rpc": "10.96.7.4", "rpc-v2": "10.96.7.5", "flaky": "10.96.7.6"}  # fmt: skip


def until(condition: Callable[[], bool], within: float = DEADLINE) -> None:
    """Returns once `condition()` holds (an exception counts as not yet); AssertionError after
    `within` seconds."""
    deadline = time.monotonic() + within
    last: object = None
    while True:
        try:
            if condition():
                return
        except Exception as exc:  # not yet; said if it lasts
            last = exc
        assert time.monotonic() < deadline, f"not within {within}s (last: {last!r})"
        time.sleep(0.02)


# -- the apps -------------------------------------------------------------------------------


def _answer(pod: str, path: str, fields: list[tuple[str, str]]) -> bytes:
    headers = {k.lower(): v for k, v in fields if not k.startswith(":")}
    return json.dumps({"pod": pod, "path": path, "headers": headers}).encode() + b"\n"


async def _serve(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive, or HTTP/2 with prior knowledge."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"PRI * HTTP/2.0"):
            await _serve_h2(pod, head + await reader.readexactly(6), reader, writer)
            return
        while head:
            lines = head.decode().split("\r\n")
            fields = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:] if line]
            pairs: list[tuple[str, str]] = [(f[0], f[1]) for f in fields if len(f) == 2]
            await reader.readexactly(int(dict(pairs).get("content-length", "0")))
            body = _answer(pod, lines[0].split()[1], pairs)
            failing = pod == FAILING or lines[0].split()[1].startswith("/fail")
            status = b"500 Internal Server Error" if failing else b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (status, len(body), body))  # fmt: skip
            head = await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def _serve_h2(
    pod: str, preface: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    data = preface
    while data:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                pairs = [(bytes(k).decode(), bytes(v).decode()) for k, v in event.headers or ()]
                body = _answer(pod, dict(pairs)[":path"], pairs)
                conn.send_headers(event.stream_id, [(":status", "200")])
                conn.send_data(event.stream_id, body, end_stream=True)
        writer.write(conn.data_to_send())
        data = await reader.read(65536)
    writer.close()


async def serve_apps() -> None:
    """The apps' process (this file run as a script): one app per service on its pod's
    address; prints `{service: port}`, serves until its stdin closes."""
    servers = {}
    for service, ip in PODS.items():
        pod = f"{service}-1"
        servers[service] = await asyncio.start_server(
            lambda r, w, pod=pod: _serve(pod, r, w), ip, 0
        )
    for pod, ip in FLAKY_PODS.items():  # one port for all three: the Service's targetPort
        servers[pod] = await asyncio.start_server(
            lambda r, w, pod=pod: _serve(pod, r, w), ip, FLAKY_PORT
        )
    ports = {name: server.sockets[0].getsockname()[1] for name, server in servers.items()}
    rpcs = []
    for service, ip in GRPC_PODS.items():
        rpc = grpc.aio.server()
        pod = f"{service}-1".encode()
        handler = grpc.unary_unary_rpc_method_handler(_answers(pod))
        rpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Echo", {"Ping": handler, "Other": handler, "Broken": handler}),))  # fmt: skip
        ports[service] = rpc.add_insecure_port(f"{ip}:0")
        await rpc.start()
        rpcs.append(rpc)
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for rpc in rpcs:
        await rpc.stop(None)


def _answers(pod: bytes) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def answer(request: bytes, context: Any) -> bytes:
        return pod

    return answer


# -- the manifests ----------------------------------------------------------------------------


def backend(name: str, weight: int | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": name, "port": 80}
    if weight is not None:
        ref["weight"] = weight
    return ref


def api_route(api: int = 90, canary: int = 10) -> dict[str, Any]:
    prefix = {"type": "PathPrefix"}
    rules = [
        {"matches": [{"path": {**prefix, "value": "/v2"}}],
         "filters": [{"type": "RequestHeaderModifier",
                      "requestHeaderModifier": {"add": [{"name": "x-route", "value": "v2"}]}},
                     {"type": "ResponseHeaderModifier",
                      "responseHeaderModifier": {"set": [{"name": "x-served", "value": "v2"}]}}],
         "backendRefs": [backend("api-v2")]},
        {"matches": [{"headers": [{"name": "x-canary", "value": "yes"}]}],
         "backendRefs": [backend("api-canary")]},
        {"matches": [{"path": {**prefix, "value": "/old"}}],
         "filters": [{"type": "RequestRedirect", "requestRedirect": {
             "path": {"type": "ReplaceFullPath", "replaceFullPath": "/new"},
             "statusCode": 301}}]},
        {"backendRefs": [backend("api", api), backend("api-canary", canary)]},
    ]  # fmt: skip
    return {
        "apiVersion": f"{GW}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "api-split", "namespace": NS},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "api", "port": 80}],
            "rules": rules,
        },
    }


def rpc_route() -> dict[str, Any]:
    """Service rpc's GRPCRoute: test.Echo/Ping to rpc-v2, Broken to a Service that does not
    exist, the rest to rpc."""

    def method(name: str) -> list[dict[str, Any]]:
        return [{"method": {"type": "Exact", "service": "test.Echo", "method": name}}]

    rules = [
        {"matches": method("Ping"), "backendRefs": [backend("rpc-v2")]},
        {"matches": method("Broken"), "backendRefs": [backend("nowhere")]},
        {"backendRefs": [backend("rpc")]},
    ]
    return {
        "apiVersion": f"{GW}/v1",
        "kind": "GRPCRoute",
        "metadata": {"name": "rpc-split", "namespace": NS},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "rpc", "port": 80}],
            "rules": rules,
        },
    }


# -- the processes ----------------------------------------------------------------------------


def flaky_service(accrual: bool = False, retries: str = "") -> dict[str, Any]:
    """Service `flaky`, with Linkerd's consecutive-failures breaker by annotation (or not), and
    `retries` (`5xx`…) retried twice by annotation."""
    service = objects.service("flaky", NS, cluster_ip=CLUSTER_IPS["flaky"],
                              ports=[("http", 80, FLAKY_PORT)])  # fmt: skip
    service["metadata"]["annotations"] = {}
    if retries:
        service["metadata"]["annotations"] = {
            wellknown.RETRY_HTTP_ANNOTATION: retries,
            wellknown.RETRY_LIMIT_ANNOTATION: "2",
        }
    if accrual:
        service["metadata"]["annotations"] |= {
            wellknown.FAILURE_ACCRUAL_ANNOTATION: "consecutive",
            wellknown.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION: "3",
            wellknown.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION: "1s",
            wellknown.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION: "30s",
        }
    return service


@dataclass
class World:
    folder: ManifestsFolder
    outbound: int
    admin: int
    proxy_log: Path

    def scrape(self) -> Series:
        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return parse(response.read().decode())

    def metric(self, name: str, series: Series | None = None, **labels: str) -> float:
        """The sum of the proxy's `name` samples (of `series`, else a scrape now) whose labels
        include `labels`."""
        series = self.scrape() if series is None else series
        want = set(labels.items())
        return sum(v for (n, have), v in series.items() if n == name and want <= have)

    def curl(
        self, path: str, *options: str, http2: bool = False
    ) -> subprocess.CompletedProcess[str]:
        argv = ["curl", "-sS", "--max-time", "10", "--connect-to", f"::127.0.0.1:{self.outbound}"]
        if http2:
            argv.append("--http2-prior-knowledge")
        return subprocess.run([*argv, *options, f"http://{API}{path}"], capture_output=True,
                              text=True, timeout=30, check=True)  # fmt: skip

    def get(self, path: str, *options: str, http2: bool = False) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self.curl(path, *options, http2=http2).stdout)
        return answer

    def pods(self, path: str, count: int, *headers: str, http2: bool = False) -> Counter[str]:
        """Which pods answered `count` requests on one connection: curl's (HTTP/1.1), or the
        `h2` library's (curl 7.88 fails a reused prior-knowledge connection)."""
        if http2:
            fields = [tuple(h.split(": ", 1)) for h in headers]
            bodies = h2_requests(self.outbound, path, count, fields)  # type: ignore[arg-type]
        else:
            options = [o for h in headers for o in ("-H", h)]
            bodies = self.curl(f"{path}[1-{count}]", *options).stdout.splitlines()
        return Counter(json.loads(body)["pod"] for body in bodies)


def h2_requests(
    outbound: int, path: str, count: int, headers: list[tuple[str, str]], batch: int = 50
) -> list[str]:
    """The bodies of `count` GETs of `path`N on one HTTP/2 connection, `batch` at a time."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    bodies: list[str] = []
    with socket.create_connection(("127.0.0.1", outbound), timeout=10) as sock:
        for first in range(1, count + 1, batch):
            streams: dict[int, bytes] = {}
            for n in range(first, min(first + batch, count + 1)):
                sid = conn.get_next_available_stream_id()
                streams[sid] = b""
                conn.send_headers(sid, [(":method", "GET"), (":path", f"{path}{n}"),
                                        (":scheme", "http"), (":authority", API), *headers],
                                  end_stream=True)  # fmt: skip
            sock.sendall(conn.data_to_send())
            done = 0
            while done < len(streams):
                data = sock.recv(65536)
                assert data, "the proxy closed the connection"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived) and event.stream_id in streams:
                        streams[event.stream_id] += event.data or b""
                        conn.acknowledge_received_data(event.flow_controlled_length or 0,
                                                       event.stream_id)  # fmt: skip
                    elif isinstance(event, h2.events.StreamEnded):
                        done += 1
                    elif isinstance(event, h2.events.StreamReset):
                        raise AssertionError(f"stream {event.stream_id} reset")
                sock.sendall(conn.data_to_send())
            bodies += [body.decode() for body in streams.values()]
    return bodies


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("outbound-policy")
    folder = ManifestsFolder(root / "manifests")
    folder.root.mkdir()
    with contextlib.ExitStack() as stack:
        from meshlet_testing import outboundproc  # here: this file also runs as a script

        app_ports = json.loads(outboundproc.apps(stack, __file__))
        for name, ip in {**PODS, **GRPC_PODS}.items():
            service = objects.service(name, NS, cluster_ip=CLUSTER_IPS[name],
                                      ports=[("http", 80, app_ports[name])])  # fmt: skip
            pod = objects.pod(f"{name}-1", ip, NS, app=name, sa=name, meshed=False)
            folder.put(name, service, pod)
        folder.put("flaky", flaky_service(accrual=False),
                   *(objects.pod(pod, ip, NS, app="flaky", sa="flaky", meshed=False)
                     for pod, ip in FLAKY_PODS.items()))  # fmt: skip
        folder.put("route", api_route())
        folder.put("grpc-route", rpc_route())
        proxy = outboundproc.start(stack, root, folder.root, NS)
        yield World(folder, proxy.outbound, proxy.admin, proxy.log)


@pytest.fixture
def api_policy(world: World) -> World:
    """The proxy routes `api` by the route of the module docstring (as each test leaves it)."""
    world.folder.put("route", api_route())
    until(lambda: world.get("/v2/ready")["pod"] == "api-v2-1")
    return world


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_the_path_match_goes_to_v2_with_the_rule_s_header(api_policy: World, http2: bool) -> None:
    seen = api_policy.get("/v2/items?x=1", http2=http2)
    assert (seen["pod"], seen["path"]) == ("api-v2-1", "/v2/items?x=1")
    assert seen["headers"]["x-route"] == "v2"  # the rule's RequestHeaderModifier
    head = api_policy.curl("/v2/items", "-o", "/dev/null", "-D", "-", http2=http2).stdout
    assert "\nx-served: v2\n" in head.lower()  # its ResponseHeaderModifier
    assert "x-route" not in api_policy.get("/v1", "-H", "x-canary: yes", http2=http2)["headers"]
    head = api_policy.curl("/v1", "-o", "/dev/null", "-D", "-", http2=http2).stdout
    assert "x-served" not in head.lower()


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_header_match_goes_to_the_canary(api_policy: World, http2: bool) -> None:
    assert api_policy.pods("/any/", 20, "x-canary: yes", http2=http2) == {"api-canary-1": 20}


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_redirect_is_answered_by_the_proxy(api_policy: World, http2: bool) -> None:
    out = api_policy.curl("/old/page?q=1", "-o", "/dev/null", "-w",
                          "%{http_code} %{redirect_url}", http2=http2)  # fmt: skip
    assert out.stdout == f"301 http://{API}/new?q=1"


if __name__ == "__main__":
    asyncio.run(serve_apps())


def share(pods: Counter[str], pod: str) -> float:
    return pods[pod] / sum(pods.values())


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_two_thousand_requests_split_90_10(api_policy: World, http2: bool) -> None:
    def counted() -> dict[str, float]:
        return {
            backend: api_policy.metric(
                "outbound_http_route_backend_requests_total", parent_kind="Service",
                parent_name="api", parent_port="80", route_kind="HTTPRoute",
                route_name="api-split", backend_name=backend, backend_namespace=NS,
            )
            for backend in ("api", "api-canary")
        }  # fmt: skip

    before = counted()
    pods = api_policy.pods("/split/", 2000, http2=http2)
    assert set(pods) == {"api-1", "api-canary-1"}
    assert abs(share(pods, "api-canary-1") - 0.10) <= 0.03, pods  # binomial sd: 0.7 %
    after = counted()
    assert after["api"] - before["api"] == pods["api-1"]
    assert after["api-canary"] - before["api-canary"] == pods["api-canary-1"]
    # the canary's balancer, under the Service whose route sends to it (Linkerd's labels)
    canary = {"parent_name": "api", "parent_port": "80", "backend_name": "api-canary",
              "backend_namespace": NS, "backend_port": "80"}  # fmt: skip
    assert api_policy.metric("outbound_http_balancer_endpoints", endpoint_state="ready",
                             **canary) == 1  # fmt: skip


def test_editing_the_weights_moves_the_split_within_a_second(api_policy: World) -> None:
    api_policy.folder.put("route", api_route(api=0, canary=1))
    edited = time.monotonic()
    answers: list[tuple[float, str]] = []
    while len(answers) < 20 or any(pod != "api-canary-1" for _, pod in answers[-20:]):
        assert time.monotonic() - edited < 5, answers[-20:]
        answers.append((time.monotonic(), api_policy.get("/moved")["pod"]))
    moved = answers[-20][0]  # the first of 20 in a row to the canary (0.1**20 by chance)
    assert moved - edited < 1.0


def test_a_service_profile_takes_precedence_until_it_is_removed(api_policy: World) -> None:
    world = api_policy
    # A ServiceProfile with a route: the profile routes api, by api's own endpoints.
    world.folder.put("profile", objects.profile("api", {"routes": [
        {"name": "all", "condition": {"method": "GET", "pathRegex": "/.*"}}]}, NS))  # fmt: skip
    try:
        until(lambda: world.get("/v2/p")["pod"] == "api-1")
        assert world.pods("/v2/p", 50) == {"api-1": 50}
        assert "x-route" not in world.get("/v2/p")["headers"]
    finally:
        world.folder.remove("profile")
    until(lambda: world.get("/v2/p")["pod"] == "api-v2-1")


def test_no_route_is_404_and_an_unknown_backend_500_with_the_reason(api_policy: World) -> None:
    world = api_policy
    route = api_route()
    route["spec"]["rules"] = [
        {"matches": [{"path": {"type": "PathPrefix", "value": "/gone"}}],
         "backendRefs": [backend("nowhere")]},
        route["spec"]["rules"][0],
    ]  # fmt: skip
    world.folder.put("route", route)
    until(lambda: world.curl("/other", "-o", "/dev/null", "-w", "%{http_code}").stdout == "404")
    for http2 in (False, True):
        out = world.curl("/other", "-i", http2=http2).stdout.lower()
        assert out.split()[1] == "404" and "meshlet-proxy-error: no route found" in out
        out = world.curl("/gone", "-i", http2=http2).stdout.lower()
        # The controller turns a backendRef it cannot resolve into a failure injector
        assert out.split()[1] == "500" and "meshlet-proxy-error: service not found" in out, out
        assert world.get("/v2", http2=http2)["pod"] == "api-v2-1"


def test_grpc_methods_are_routed_by_the_grpc_route(world: World) -> None:
    authority = f"rpc.{NS}.svc.cluster.local"
    options = [("grpc.default_authority", authority)]
    with grpc.insecure_channel(f"127.0.0.1:{world.outbound}", options=options) as channel:

        def call(method: str) -> bytes:
            answer: bytes = channel.unary_unary(f"/test.Echo/{method}")(b"", timeout=5)
            return answer

        until(lambda: call("Ping") == b"rpc-v2-1")
        name, route = "outbound_grpc_route_backend_requests_total", {"route_kind": "GRPCRoute"}
        before = world.scrape()
        assert {call("Ping") for _ in range(20)} == {b"rpc-v2-1"}
        assert world.metric(name, backend_name="rpc-v2", **route) - world.metric(
            name, before, backend_name="rpc-v2", **route) == 20  # fmt: skip
        assert {call("Other") for _ in range(20)} == {b"rpc-1"}
        with pytest.raises(grpc.RpcError) as failed:
            call("Broken")
        assert failed.value.code() is grpc.StatusCode.UNKNOWN  # the route's code, not 14
        assert failed.value.details() == "Service not found nowhere"
        after = world.scrape()

    def added(name: str, **labels: str) -> float:
        name, labels = f"outbound_grpc_route_{name}", {"route_name": "rpc-split", **labels}
        return world.metric(name, after, **labels) - world.metric(name, before, **labels)

    # Linkerd's gRPC route families: the status by its code's name, the injected one included
    assert added("request_statuses_total", grpc_status="OK") == 40
    assert added("request_statuses_total", grpc_status="UNKNOWN") == 1
    assert added("request_duration_seconds_count") == 41
    assert added("backend_response_statuses_total", grpc_status="OK", backend_name="rpc-v2") == 20


def flaky_statuses(world: World, count: int, path: str = "/") -> Counter[str]:
    """The statuses of `count` GETs to Service `flaky`, 8 at a time (curl --parallel): with
    requests in flight a replica whose last answer looked slow is still chosen (P2C weighs
    latency times requests in flight), as under real load."""
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "30", "--connect-to", f"::127.0.0.1:{world.outbound}",
         "--parallel", "--parallel-max", "8",
         "-o", "/dev/null", "-w", "%{http_code}\n",
         f"http://flaky.{NS}.svc.cluster.local{path}[1-{count}]"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return Counter(done.stdout.split())


def test_the_service_s_failure_accrual_ejects_the_replica_that_fails_everything(
    world: World,
) -> None:
    """Without `balancer.meshlet.io/failure-accrual` the replica that answers 500 to everything
    gets its share of the calls and fails them (once the balancer has tried it: an endpoint it
    has no latency for waits out the default estimate); with `consecutive` on the Service
    (through the policy controller, the proxy's policy and its balancer) it is ejected after 3
    failures in a row and only probed now and then."""
    pods = [objects.pod(pod, ip, NS, app="flaky", sa="flaky", meshed=False)
            for pod, ip in FLAKY_PODS.items()]  # fmt: skip
    world.folder.put("flaky", flaky_service(accrual=False), *pods)
    until(lambda: flaky_statuses(world, 300)["500"] >= 300 * 0.2, within=30)
    world.folder.put("flaky", flaky_service(accrual=True), *pods)
    flaky = {"backend_name": "flaky", "backend_namespace": NS}

    def ejected() -> bool:
        """The policy's change has arrived and the breaker has ejected the failing replica (a
        few calls without a 500 prove neither: the balancer may just not have tried it)."""
        flaky_statuses(world, 60)
        pending = world.metric("outbound_http_balancer_endpoints", endpoint_state="pending",
                               **flaky)  # fmt: skip
        return pending == 1

    until(ejected, within=30)
    with_breaker = flaky_statuses(world, 2000)
    # ejected: then one probe after 1 s, 2 s, 4 s (+ jitter), ...
    assert with_breaker["200"] >= 2000 * 0.995, with_breaker
    # One scrape: while a probe is under way the replica counts as ready for that moment, so
    # two scrapes could see it pending, then ready (a busy run read 1 pending and 3 ready).
    series = world.scrape()
    states = {state: world.metric("outbound_http_balancer_endpoints", series,
                                  endpoint_state=state, **flaky)
              for state in ("ready", "pending")}  # fmt: skip
    assert states in ({"ready": 2, "pending": 1}, {"ready": 3, "pending": 0}), states


def test_retries_by_annotation_resend_failures_to_another_replica(world: World) -> None:
    """`retry.meshlet.io/http: 5xx` and `retry.meshlet.io/limit: 2` on the Service: each 500 of
    the failing replica is retried on another, so the client sees none; `gateway-error`
    (502-504) leaves the 500s as they are."""
    pods = [objects.pod(pod, ip, NS, app="flaky", sa="flaky", meshed=False)
            for pod, ip in FLAKY_PODS.items()]  # fmt: skip
    world.folder.put("flaky", flaky_service(retries="gateway-error"), *pods)
    until(lambda: flaky_statuses(world, 300)["500"] >= 300 * 0.2, within=30)
    failed_before = world.metric("route_actual_response_total", status_code="500")
    world.folder.put("flaky", flaky_service(retries="5xx"), *pods)
    until(lambda: flaky_statuses(world, 60)["500"] == 0)
    retried = flaky_statuses(world, 600)
    assert retried == Counter({"200": 600}), retried
    # the failing replica was still asked (its 500s went to the proxy, not to the client)
    assert world.metric("route_actual_response_total", status_code="500") > failed_before + 20


FLAKY_ROUTE: Final = {"parent_kind": "Service", "parent_name": "flaky", "parent_port": "80",
                      "route_kind": "default", "route_name": "http"}  # fmt: skip


def test_linkerd_s_route_metrics_count_each_request_retry_and_status(world: World) -> None:
    """With `retry.meshlet.io/http: 5xx` and a limit of 2 on Service `flaky`: 200 GETs of which
    those sent to the failing replica are retried once on another (a retry request and a retry
    success each), and 20 GETs of /fail, which every replica fails: sent 3 times, a 500 to the
    client, the limit exceeded once each. Linkerd's families count exactly that."""
    pods = [objects.pod(pod, ip, NS, app="flaky", sa="flaky", meshed=False)
            for pod, ip in FLAKY_PODS.items()]  # fmt: skip
    world.folder.put("flaky", flaky_service(retries="5xx"), *pods)
    until(lambda: flaky_statuses(world, 60)["500"] == 0)
    before = world.scrape()
    assert flaky_statuses(world, 200) == Counter({"200": 200})
    assert flaky_statuses(world, 20, "/fail/") == Counter({"500": 20})
    after = world.scrape()

    def added(name: str, **labels: str) -> float:
        name = f"outbound_http_route_{name}"
        return world.metric(name, after, **FLAKY_ROUTE, **labels) - world.metric(
            name, before, **FLAKY_ROUTE, **labels
        )

    assert added("request_statuses_total", http_status="200") == 200
    assert added("request_statuses_total", http_status="500") == 20
    assert added("request_statuses_total") == 220  # no request ended in an error
    assert added("request_duration_seconds_count") == 220
    assert added("request_duration_seconds_bucket", le="10") == 220
    assert added("retry_limit_exceeded_total") == 20
    assert added("retry_overflow_total") == 0
    rescued = added("retry_successes_total")  # the GETs the failing replica answered first
    assert rescued >= 1
    assert added("retry_requests_total") == 2 * 20 + rescued
    # each attempt, per backend: its status, and its dispatch (the first and each retry's)
    flaky = {"backend_kind": "Service", "backend_name": "flaky", "backend_port": "80"}
    assert added("backend_response_statuses_total", http_status="500", **flaky) == 3 * 20 + rescued
    assert added("backend_response_statuses_total", http_status="200", **flaky) == 200
    assert added("backend_response_duration_seconds_count", **flaky) == 200 + 3 * 20 + rescued
    assert added("backend_requests_total", **flaky) == 220 + 2 * 20 + rescued
    # the label sets, as Linkerd's (the empty ones, as the proxy's others, left out)
    parent = {"parent_group", "parent_kind", "parent_namespace", "parent_name", "parent_port"}
    route = {"route_kind", "route_name"}
    backend = {"backend_group", "backend_kind", "backend_namespace", "backend_name",
               "backend_port"}  # fmt: skip
    expected = {
        "outbound_http_route_request_statuses_total": parent | route | {"http_status"},
        "outbound_http_route_request_duration_seconds_count": parent | route,
        "outbound_http_route_retry_requests_total": parent | route,
        "outbound_http_route_backend_response_duration_seconds_count": parent | route | backend,
        "outbound_http_route_backend_response_statuses_total":
            parent | route | backend | {"http_status"},
    }  # fmt: skip
    for name, labels in expected.items():
        seen = {frozenset(dict(have)) for (n, have), _ in after.items()
                if n == name and ("parent_name", "flaky") in have}  # fmt: skip
        assert seen == {frozenset(labels)}, (name, seen)
