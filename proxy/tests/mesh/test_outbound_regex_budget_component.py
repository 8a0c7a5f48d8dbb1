"""What an outbound policy's regexes may cost a client proxy, end to end: real `meshlet-controller
destination` and `policy` processes over one manifests folder, a real `meshlet-proxy` following
both, and Python's http.client calling through its outbound listener by authority.

Service `api`'s HTTPRoute is at the regex budget's edge (meshlet.api.pathregex: MAX_REGEXES
distinct patterns, each one of RE2's slowest, `/[ab]*a[ab]{40}`-like), with a last rule sending
everything else to `api`. A path those patterns can meet and cannot afford is refused at once
with 414; a path they cannot match is routed without paying for them; and while such requests
arrive, requests for Service `other` through the same proxy go on being answered at once. A
second route that brings the policy past the budget is refused by the proxy's decoder: it keeps
routing by the policy it had, and says why in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from meshlet.api.pathregex import MAX_PROGRAM, MAX_REGEXES, Budget
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder

NS: Final = "budget"
GW: Final = "gateway.networking.k8s.io"
PODS: Final = {"api": "127.0.42.1", "other": "127.0.42.2"}
CLUSTER_IPS: Final = {"api": "10.96.42.1", "other": "10.96.42.2"}
DEADLINE: Final = 20.0
HOSTILE: Final = "/[ab]*a[ab]{40}(?:z%03d)?"  # RE2's slowest kind: its DFA cannot hold it
MATCHED: Final = "/a" + "b" * 40  # what the hostile patterns match


def hostile_path(rng: random.Random) -> str:
    """A path of random a's and b's (a periodic one would let RE2's DFA settle), as long as an
    HTTP/1 request target may be."""
    return "/" + "".join(rng.choice("ab") for _ in range(7800))


def until(condition: Callable[[], bool], within: float = DEADLINE) -> None:
    deadline = time.monotonic() + within
    last: object = None
    while True:
        try:
            if condition():
                return
        except Exception as exc:  # not yet
            last = exc
        assert time.monotonic() < deadline, f"not within {within}s (last: {last!r})"
        time.sleep(0.05)


# -- the apps (this file run as a script) -----------------------------------------------------


async def _serve(pod: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while head := await reader.readuntil(b"\r\n\r\n"):
            path = head.split(b" ", 2)[1].decode()
            body = json.dumps({"pod": pod, "path": path[:64]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    writer.close()


async def serve_apps() -> None:
    ports = {}
    for service, ip in PODS.items():
        server = await asyncio.start_server(functools.partial(_serve, f"{service}-1"), ip, 0)
        ports[service] = server.sockets[0].getsockname()[1]
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(serve_apps())


# -- the manifests ----------------------------------------------------------------------------


def route(name: str, patterns: list[str], to: str, *, rest: bool) -> dict[str, Any]:
    """An HTTPRoute of `api` whose rules match `patterns` (up to 64 a rule), each to `to`; with
    `rest`, a last rule sending every other request to `api`."""
    rules: list[dict[str, Any]] = [
        {"matches": [{"path": {"type": "RegularExpression", "value": p}}
                     for p in patterns[i : i + 64]],
         "backendRefs": [{"name": to, "port": 80}]}
        for i in range(0, len(patterns), 64)
    ]  # fmt: skip
    if rest:
        rules.append({"backendRefs": [{"name": "api", "port": 80}]})
    return {
        "apiVersion": f"{GW}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"parentRefs": [{"group": "core", "kind": "Service", "name": "api", "port": 80}],
                 "rules": rules},
    }  # fmt: skip


def edge_patterns() -> list[str]:
    """MAX_REGEXES distinct hostile patterns, within MAX_PROGRAM instructions together."""
    patterns = [HOSTILE % n for n in range(MAX_REGEXES)]
    budget = Budget()
    for p in patterns:
        budget.compile(p)
    assert budget.program <= MAX_PROGRAM
    return patterns


# -- the world --------------------------------------------------------------------------------


@dataclass
class World:
    folder: ManifestsFolder
    outbound: int
    proxy_log: Path

    def get(self, service: str, path: str, timeout: float = 30.0) -> tuple[int, str, float]:
        """Status, body and seconds of a GET of `path` for `service` through the proxy."""
        conn = http.client.HTTPConnection("127.0.0.1", self.outbound, timeout=timeout)
        started = time.monotonic()
        try:
            conn.request("GET", path, headers={"host": f"{service}.{NS}.svc.cluster.local"})
            response = conn.getresponse()
            body = response.read().decode(errors="replace")
            return response.status, body, time.monotonic() - started
        finally:
            conn.close()

    def pod(self, service: str, path: str) -> str:
        status, body, _ = self.get(service, path)
        assert status == 200, (status, body)
        return str(json.loads(body)["pod"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("regex-budget")
    folder = ManifestsFolder(root / "manifests")
    folder.root.mkdir()
    with contextlib.ExitStack() as stack:
        from meshlet_testing import outboundproc  # here: this file also runs as a script

        app_ports = json.loads(outboundproc.apps(stack, __file__))
        for name, ip in PODS.items():
            service = objects.service(name, NS, cluster_ip=CLUSTER_IPS[name],
                                      ports=[("http", 80, app_ports[name])])  # fmt: skip
            service["spec"]["ports"][0]["appProtocol"] = "http"
            folder.put(name, service, objects.pod(f"{name}-1", ip, NS, app=name, sa=name,
                                                  meshed=False))  # fmt: skip
        folder.put("edge", route("edge", edge_patterns(), "other", rest=True))
        proxy = outboundproc.start(stack, root, folder.root, NS)
        world = World(folder, proxy.outbound, proxy.log)
        until(lambda: world.pod("api", MATCHED) == "other-1")  # the edge route holds
        yield world


# -- the tests --------------------------------------------------------------------------------


def test_a_long_path_at_the_budget_s_edge_is_answered_at_once(world: World) -> None:
    """Before the budget, each of these requests held the proxy's event loop for seconds."""
    rng = random.Random(1)
    for _ in range(5):
        status, body, took = world.get("api", hostile_path(rng))
        assert status == 414, (status, body)
        assert took < 0.5, took
    # a path outside what the patterns can match pays nothing for them and is routed
    assert world.pod("api", "/x" + "y" * 7000) == "api-1"
    assert world.pod("api", "/ab/x") == "api-1"  # a short one they can meet and do not match


def test_other_services_are_not_stalled_while_long_paths_arrive(world: World) -> None:
    latencies: list[float] = []
    stop = threading.Event()

    def other_traffic() -> None:
        while not stop.is_set():
            status, _, took = world.get("other", "/ping")
            assert status == 200
            latencies.append(took)

    def hostile_traffic(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(6):
            world.get("api", hostile_path(rng), timeout=120)

    background = threading.Thread(target=other_traffic)
    background.start()
    try:
        time.sleep(0.3)
        attackers = [threading.Thread(target=hostile_traffic, args=(n,)) for n in range(4)]
        for t in attackers:
            t.start()
        for t in attackers:
            t.join(120)
    finally:
        stop.set()
        background.join(30)
    assert len(latencies) > 10
    assert max(latencies) < 1.0, (max(latencies), statistics.median(latencies))


def test_a_policy_past_the_budget_is_refused_and_the_last_one_kept(world: World) -> None:
    """Each route is within the budget alone (the controller and the webhook judge one
    route); together they are past it, which only the proxy sees."""
    more = route("more", [HOSTILE % n for n in range(MAX_REGEXES, MAX_REGEXES + 8)] + ["/more/.*"],
                 "other", rest=False)  # fmt: skip
    world.folder.put("more", more)
    try:
        until(lambda: f"more than {MAX_REGEXES} distinct regexes" in world.proxy_log.read_text())
        assert world.pod("api", "/more/x") == "api-1"  # the policy it had: no /more rule
        assert world.pod("api", MATCHED) == "other-1"  # the edge route still in force
    finally:
        world.folder.remove("more")
