"""Retries and timeouts of an outbound policy end to end: real `meshlet-controller destination`
and `policy` processes over one manifests folder, a real `meshlet-proxy` process following both,
and clients nobody here wrote (curl over HTTP/1.1 and HTTP/2, grpcio) calling through the
proxy's outbound listener by authority.

Two pods (`slow-1`, `slow-2`) stand behind several Services, each with its own annotations:
`slow-1` hangs on paths under `/hang` (and both on `/allhang`) for HANG seconds, where `slow-2`
takes 50 ms; the rest is answered at once with the pod's name. Two gRPC pods (`rpc-1`,
`rpc-2`) behind Service `rpc` answer `test.Echo/Ping` with a message and then their status in
trailers, in one write: `rpc-1` INTERNAL at once, `rpc-2` OK after 50 ms; `test.Echo/Stream`
sends a first message at once and the rest (and OK) STREAM_GAP seconds later. The pods' app
is this file run as a script, and so is the gRPC client (`grpc_client`). `slow-2` and `rpc-2`
are slower than the balancer's default estimate for a replica it has no latency for, so it
soon tries the other one, as it would under real load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from meshlet.api import wellknown as W
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder

NS: Final = "shop"
SLOW_PODS: Final = {"slow-1": "127.0.1.1", "slow-2": "127.0.1.2"}
RPC_PODS: Final = {"rpc-1": "127.0.1.3", "rpc-2": "127.0.1.4"}
SLOW_PORT, RPC_PORT = 8081, 8082
HANG: Final = 5.0
STREAM_GAP: Final = 1.5
DEADLINE: Final = 20.0

# Services over the slow pods: each one's annotations (all select app=slow).
SERVICES: Final = {
    **{  # a hung attempt is cancelled after 300 ms and sent elsewhere (a Service per test)
        name: {
            W.RETRY_HTTP_ANNOTATION: "5xx",
            W.RETRY_LIMIT_ANNOTATION: "2",
            W.RETRY_TIMEOUT_ANNOTATION: "300ms",
        }
        for name in ("retried", "retried-h2")
    },
    "bounded": {  # six attempts of 600 ms each, but 1 s for the whole request
        W.RETRY_HTTP_ANNOTATION: "5xx",
        W.RETRY_LIMIT_ANNOTATION: "5",
        W.RETRY_TIMEOUT_ANNOTATION: "600ms",
        W.TIMEOUT_REQUEST_ANNOTATION: "1s",
    },
    "answered": {W.TIMEOUT_RESPONSE_ANNOTATION: "300ms"},  # no retries: 504
    "stormy": {W.RETRY_HTTP_ANNOTATION: "5xx", W.RETRY_LIMIT_ANNOTATION: "2"},
    "answered-h2": {W.TIMEOUT_RESPONSE_ANNOTATION: "300ms"},
}
CLUSTER_IPS: Final = {
    "retried": "10.96.9.1", "bounded": "10.96.9.2", "answered": "10.96.9.3", "rpc": "10.96.9.4",
    "retried-h2": "10.96.9.5", "answered-h2": "10.96.9.6", "moved": "10.96.9.7",
    "stormy": "10.96.9.8",
}  # fmt: skip


# -- the apps -------------------------------------------------------------------------------

HITS: Counter[str] = Counter()


def _slow(pod: str, path: str) -> bool:
    return path.startswith("/allhang") or (pod == "slow-1" and path.startswith("/hang"))


async def _serve_http(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive, or HTTP/2 with prior knowledge; `/hits` answers the pods' hits."""
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"PRI * HTTP/2.0"):
            await _serve_h2(pod, head + await reader.readexactly(6), reader, writer)
            return
        while head:
            path = head.split(b" ", 2)[1].decode()
            body = await _body(pod, path)
            status = b"500 Internal Server Error" if path.startswith("/fail") else b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s"
                         % (status, len(body), body))  # fmt: skip
            head = await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def _body(pod: str, path: str) -> bytes:
    if path == "/hits":
        return json.dumps(HITS).encode()
    HITS[pod] += 1
    if _slow(pod, path):
        await asyncio.sleep(HANG)
    elif path.startswith("/hang"):
        # slower than the balancer's default estimate of a replica it has no latency for, so
        # it soon tries the other one (the hung one), as it would under real load
        await asyncio.sleep(0.05)
    return pod.encode()


async def _serve_h2(
    pod: str, preface: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()

    async def answer(stream_id: int, path: str) -> None:
        body = await _body(pod, path)
        with contextlib.suppress(Exception):  # the stream may have been cancelled meanwhile
            conn.send_headers(stream_id, [(":status", "200")])
            conn.send_data(stream_id, body, end_stream=True)
            writer.write(conn.data_to_send())

    tasks = set()
    data = preface
    while data:
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                path = dict((bytes(k), bytes(v)) for k, v in event.headers or ())[b":path"]
                task = asyncio.create_task(answer(event.stream_id, path.decode()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        writer.write(conn.data_to_send())
        data = await reader.read(65536)
    writer.close()


def _message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


async def _serve_grpc(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """gRPC by hand (the `h2` library), to put each frame where the test needs it."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    head = [(":status", "200"), ("content-type", "application/grpc")]

    async def stream(stream_id: int) -> None:
        with contextlib.suppress(Exception):
            conn.send_headers(stream_id, head)
            conn.send_data(stream_id, _message(b"first"))
            writer.write(conn.data_to_send())
            await asyncio.sleep(STREAM_GAP)
            conn.send_data(stream_id, _message(b"second"))
            conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
            writer.write(conn.data_to_send())

    tasks = set()
    with contextlib.suppress(ConnectionError):
        data = await reader.read(65536)
        while data:
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    path = dict((bytes(k), bytes(v)) for k, v in event.headers or ())[b":path"]
                    HITS[pod] += 1
                    if path == b"/test.Echo/Stream":
                        task = asyncio.create_task(stream(event.stream_id))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        continue
                    code = "13" if pod == "rpc-1" else "0"
                    if pod == "rpc-2":  # slower than the balancer's default estimate
                        await asyncio.sleep(0.05)
                    conn.send_headers(event.stream_id, head)
                    conn.send_data(event.stream_id, _message(pod.encode()))
                    conn.send_headers(event.stream_id, [("grpc-status", code),
                                                        ("grpc-message", f"from {pod}")],
                                      end_stream=True)  # fmt: skip
            writer.write(conn.data_to_send())  # head, message and trailers in one write
            data = await reader.read(65536)
    writer.close()


async def serve_apps() -> None:
    """The pods' apps (this file run as a script): serves until its stdin closes."""
    servers = []
    for pod, ip in SLOW_PODS.items():
        serve = lambda r, w, pod=pod: _serve_http(pod, r, w)  # noqa: E731
        servers.append(await asyncio.start_server(serve, ip, SLOW_PORT))
    for pod, ip in RPC_PODS.items():
        serve = lambda r, w, pod=pod: _serve_grpc(pod, r, w)  # noqa: E731
        servers.append(await asyncio.start_server(serve, ip, RPC_PORT))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    os._exit(0)  # with requests still hanging: nothing to wait for


# -- the world --------------------------------------------------------------------------------


def until(condition: Callable[[], bool], within: float = DEADLINE) -> None:
    end = time.monotonic() + within
    while not condition():
        assert time.monotonic() < end, "the condition did not hold in time"
        time.sleep(0.05)


def grpc_route() -> dict[str, Any]:
    """Service rpc's GRPCRoute: every method to rpc, INTERNAL retried twice."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "GRPCRoute",
        "metadata": {"name": "rpc", "namespace": NS, "annotations": {
            W.RETRY_GRPC_ANNOTATION: "internal", W.RETRY_LIMIT_ANNOTATION: "2"}},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "rpc", "port": 80}],
            "rules": [{"backendRefs": [{"name": "rpc", "port": 80}]}],
        },
    }  # fmt: skip


def redirect_route() -> dict[str, Any]:
    """Service moved's HTTPRoute: every request redirected to /elsewhere."""
    redirect = {"path": {"type": "ReplaceFullPath", "replaceFullPath": "/elsewhere"},
                "statusCode": 301}  # fmt: skip
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "moved", "namespace": NS},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "moved", "port": 80}],
            "rules": [{"filters": [{"type": "RequestRedirect", "requestRedirect": redirect}]}],
        },
    }


@dataclass
class World:
    folder: ManifestsFolder
    outbound: int
    admin: int

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the proxy's `name` samples whose labels include `labels`."""
        from meshlet.cli.stats import parse

        url = f"http://127.0.0.1:{self.admin}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            series = parse(response.read().decode())
        want = set(labels.items())
        return sum(v for (n, have), v in series.items() if n == name and want <= have)

    def call(self, service: str, path: str, http2: bool = False) -> tuple[str, str, float]:
        """curl's status, body and seconds for one GET of `path` from `service`."""
        argv = ["curl", "-sS", "--max-time", "10", "--connect-to", f"::127.0.0.1:{self.outbound}",
                "-w", "\n%{http_code}"]  # fmt: skip
        if http2:
            argv.append("--http2-prior-knowledge")
        began = time.monotonic()
        done = subprocess.run([*argv, f"http://{service}.{NS}.svc.cluster.local{path}"],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        body, _, status = done.stdout.rpartition("\n")
        return status, body, time.monotonic() - began

    def parallel(self, service: str, path: str, count: int, http2: bool) -> list[tuple[str, float]]:
        """The status and seconds of `count` GETs of `path`N at once: curl's, 8 at a time over
        HTTP/1.1; the `h2` library's, all on one connection, over HTTP/2 (curl 7.88 fails a
        reused prior-knowledge connection). With requests in flight the balancer tries each
        replica, as under real load."""
        authority = f"{service}.{NS}.svc.cluster.local"
        if http2:
            return h2_parallel(self.outbound, authority, path, count)
        argv = ["curl", "-sS", "--max-time", "10", "--connect-to", f"::127.0.0.1:{self.outbound}",
                "--parallel", "--parallel-max", "8", "-o", "/dev/null",
                "-w", "%{http_code} %{time_total}\n",
                f"http://{authority}{path}/[1-{count}]"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
        lines = done.stdout.splitlines()
        return [(status, float(took)) for status, took in map(str.split, lines)]


def h2_parallel(outbound: int, authority: str, path: str, count: int) -> list[tuple[str, float]]:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    began = time.monotonic()
    statuses: dict[int, str] = {}
    took: dict[int, float] = {}
    with socket.create_connection(("127.0.0.1", outbound), timeout=10) as sock:
        for n in range(count):
            sid = conn.get_next_available_stream_id()
            statuses[sid] = ""
            conn.send_headers(sid, [(":method", "GET"), (":path", f"{path}/{n}"),
                                    (":scheme", "http"), (":authority", authority)],
                              end_stream=True)  # fmt: skip
        sock.sendall(conn.data_to_send())
        while len(took) < count:
            data = sock.recv(65536)
            assert data, "the proxy closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    statuses[event.stream_id] = dict(event.headers or ())[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length or 0,
                                                   event.stream_id)  # fmt: skip
                elif isinstance(event, h2.events.StreamEnded):
                    took[event.stream_id] = time.monotonic() - began
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream {event.stream_id} reset")
            sock.sendall(conn.data_to_send())
    return [(statuses[sid], took[sid]) for sid in statuses]


def hits() -> Counter[str]:
    url = f"http://{SLOW_PODS['slow-2']}:{SLOW_PORT}/hits"
    with urllib.request.urlopen(url, timeout=5) as response:
        return Counter(json.loads(response.read()))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("outbound-retries")
    folder = ManifestsFolder(root / "manifests")
    folder.root.mkdir()
    with contextlib.ExitStack() as stack:
        from meshlet_testing import outboundproc  # here: this file also runs as a script

        assert outboundproc.apps(stack, __file__) == "ready"
        pods = [objects.pod(pod, ip, NS, app="slow", sa="slow", meshed=False)
                for pod, ip in SLOW_PODS.items()]  # fmt: skip
        for name, notes in SERVICES.items():
            service = objects.service(
                name, NS, cluster_ip=CLUSTER_IPS[name], selector={"app": "slow"},
                ports=[("http", 80, SLOW_PORT)], annotations=notes,
            )  # fmt: skip
            folder.put(name, service)
        folder.put("slow-pods", *pods)
        moved = objects.service("moved", NS, cluster_ip=CLUSTER_IPS["moved"],
                                selector={"app": "slow"},
                                ports=[("http", 80, SLOW_PORT)])  # fmt: skip
        folder.put("moved", moved, redirect_route())
        rpc = objects.service("rpc", NS, cluster_ip=CLUSTER_IPS["rpc"],
                              ports=[("grpc", 80, RPC_PORT)])  # fmt: skip
        folder.put("rpc", rpc, grpc_route(), *(
            objects.pod(pod, ip, NS, app="rpc", sa="rpc", meshed=False)
            for pod, ip in RPC_PODS.items()))  # fmt: skip

        proxy = outboundproc.start(stack, root, folder.root, NS)
        yield World(folder, proxy.outbound, proxy.admin)


# -- the tests --------------------------------------------------------------------------------


def test_the_first_request_to_a_service_waits_for_its_policy(world: World) -> None:
    """The proxy has never routed to Service moved: its first request waits for the policy
    controller's answer, so the route's redirect holds from that request on."""
    status, _, took = world.call("moved", "/page")
    assert status == "301"
    assert took < 2.0


def test_retries_stay_within_the_service_s_retry_budget(world: World) -> None:
    """Service stormy retries 5xx twice, and every replica fails /fail: 300 calls would be
    900 attempts; the retry budget (20 % of the calls plus 10 a second, over 10 s) sends at most
    160 retries, and the rest are counted as overflow."""
    before = sum(hits().values())
    answers = world.parallel("stormy", "/fail", 300, False)
    assert {status for status, _ in answers} == {"500"}
    attempts = sum(hits().values()) - before
    assert 300 < attempts <= 300 + 0.2 * 300 + 10 * 10 + 10, attempts
    route = {"parent_name": "stormy"}
    assert world.metric("outbound_http_route_retry_overflow_total", **route) > 0
    assert world.metric("outbound_http_route_retry_requests_total", **route) == attempts - 300


def test_a_redirect_loop_is_the_client_s_to_follow_and_costs_the_proxy_one_answer_each(
    world: World,
) -> None:
    """Service moved redirects every path to /elsewhere, itself included: the proxy answers
    each request with the redirect and never follows it; curl following it gives up after
    its limit, and the proxy goes on serving."""
    argv = ["curl", "-sS", "-L", "--max-redirs", "20", "-o", "/dev/null", "-w", "%{num_redirects}",
            "--connect-to", f"::127.0.0.1:{world.outbound}",
            f"http://moved.{NS}.svc.cluster.local/page"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 47, done  # CURLE_TOO_MANY_REDIRECTS
    assert done.stdout == "20", done
    assert world.call("moved", "/again")[0] == "301"


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_retry_timeout_cancels_a_hung_attempt_and_sends_it_elsewhere(
    world: World, http2: bool
) -> None:
    """`retry.meshlet.io/timeout: 300ms`: every request reaches the replica that answers,
    within a second, although the other (tried too) hangs for 5 s."""
    before = hits()["slow-1"]
    answers: list[tuple[str, float]] = []
    for _ in range(10):  # until the balancer has tried the hung replica (it may wait a while)
        answers += world.parallel("retried-h2" if http2 else "retried", "/hang", 24, http2)
        if hits()["slow-1"] > before:
            break
    assert hits()["slow-1"] > before  # the hung replica was tried, and its attempts cancelled
    assert {status for status, _ in answers} == {"200"}, answers
    assert max(took for _, took in answers) < 2.5, answers  # slow-2's answers: slow-1 hangs 5 s


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_the_request_timeout_covers_every_retry(world: World, http2: bool) -> None:
    """Six attempts of 600 ms each would take 3.6 s; `timeout.meshlet.io/request: 1s` answers
    504 after one second, saying so."""
    status, body, took = world.call("bounded", "/allhang", http2)
    assert status == "504", body
    assert 0.9 <= took < 2.5, took
    url = f"http://bounded.{NS}.svc.cluster.local/allhang"
    argv = ["curl", "-sS", "-o", "/dev/null", "-D", "-", "--connect-to",
            f"::127.0.0.1:{world.outbound}", url]  # fmt: skip
    head = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          check=True).stdout.lower()  # fmt: skip
    assert "meshlet-proxy-error: the route's timeout of 1s passed" in head, head


@pytest.mark.parametrize(
    ("service", "said"),
    [
        ("retried", "the per-try timeout of 0.3s passed"),  # retry.meshlet.io/timeout, 3 tries
        ("answered", "the response timeout of 0.3s passed"),  # timeout.meshlet.io/response
    ],
)
def test_a_timeout_s_504_names_the_timeout_that_passed(
    world: World, service: str, said: str
) -> None:
    """Both replicas hang: the 504 says which of the Service's timeouts ended the request."""
    url = f"http://{service}.{NS}.svc.cluster.local/allhang"
    argv = ["curl", "-sS", "-o", "/dev/null", "-D", "-", "--connect-to",
            f"::127.0.0.1:{world.outbound}", url]  # fmt: skip
    head = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          check=True).stdout.lower()  # fmt: skip
    assert head.startswith("http/1.1 504"), head
    assert f"meshlet-proxy-error: {said}" in head, head


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_a_response_timeout_answers_each_hung_attempt_504(world: World, http2: bool) -> None:
    """`timeout.meshlet.io/response: 300ms` without retries: the hung replica's requests get
    504 after 300 ms, the other's answers pass."""
    service = "answered-h2" if http2 else "answered"
    answers: list[tuple[str, float]] = []
    for _ in range(10):  # until the balancer has tried the hung replica
        answers += world.parallel(service, "/hang", 24, http2)
        if any(status == "504" for status, _ in answers):
            break
    assert {status for status, _ in answers} == {"200", "504"}, answers
    assert all(0.25 <= took < 2.0 for status, took in answers if status == "504"), answers


def test_a_grpc_status_in_trailers_after_a_message_is_retried_on_another_replica(
    world: World,
) -> None:
    """GRPCRoute `rpc` retries INTERNAL: `rpc-1` answers every call with a message and then
    INTERNAL in trailers, yet every call through the proxy gets `rpc-2`'s OK; `rpc-1` was
    asked (its answers went to the proxy, not to the client)."""
    before = hits()["rpc-1"]
    answers = grpc_client(world, "ping")
    assert hits()["rpc-1"] > before
    assert answers == {"rpc-2": 40}, answers


def test_a_retried_grpc_stream_is_not_held_past_its_first_message(world: World) -> None:
    """Holding a response for its trailers ends with its first message: a server stream on the
    same retrying route gets its first message at once, not after the stream's end."""
    got = grpc_client(world, "stream")
    assert (got["first"], got["rest"]) == ("first", ["second"]), got
    assert got["first_at"] < STREAM_GAP * 0.66, got


def grpc_client(world: World, mode: str) -> dict[str, Any]:
    """What grpcio (in a process of its own: gRPC's threads and this process's forks do not
    mix) got calling Service rpc through the proxy: `ping` 40 unary calls, one after the
    other; `stream` one server stream, with when its first message came."""
    done = subprocess.run([sys.executable, __file__, mode, str(world.outbound)],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    got: dict[str, Any] = json.loads(done.stdout)
    return got


def _call_rpc(mode: str, outbound: int) -> dict[str, Any]:
    options = [("grpc.default_authority", f"rpc.{NS}.svc.cluster.local")]
    with grpc.insecure_channel(f"127.0.0.1:{outbound}", options=options) as channel:
        if mode == "ping":
            ping = channel.unary_unary("/test.Echo/Ping")
            return dict(Counter(ping(b"", timeout=10).decode() for _ in range(40)))
        began = time.monotonic()
        replies = channel.unary_stream("/test.Echo/Stream")(b"", timeout=10)
        first = next(replies).decode()
        first_at = time.monotonic() - began
        rest = [reply.decode() for reply in replies]
        return {"first": first, "first_at": first_at, "rest": rest}


if __name__ == "__main__":
    if len(sys.argv) == 3:
        print(json.dumps(_call_rpc(sys.argv[1], int(sys.argv[2]))))
    else:
        asyncio.run(serve_apps())
