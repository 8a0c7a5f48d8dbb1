"""Route status, as the policy controller writes it back: the conditions of each parent (a
table), the merge with what the route already says, the pacing of patches, and the writer
against the fake API server through the unmodified `kubernetes` client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from meshlet.api import wellknown as W
from meshlet.api.hostport import HostPort
from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS, Kind, Snapshot, Upsert
from meshlet.controlplane.policy.index import ClusterConfig, Index, parse_networks
from meshlet.controlplane.policy.outbound_index import OutboundIndex
from meshlet.controlplane.policy.server import PolicyConfig, PolicyServer
from meshlet.controlplane.policy.status import (
    CONTROLLER_NAME,
    Indexes,
    Pacer,
    PatchConflict,
    kubernetes_patch,
    merged,
    parent_statuses,
)

GW = "gateway.networking.k8s.io"
KINDS = {(k.api_version, k.kind): k for k in Kind}
NOW = "2026-11-27T03:00:00Z"
LATER = "2026-11-27T03:05:00Z"


def service(name: str = "web", ip: str = "10.96.0.1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIP": ip, "ports": [{"port": 80}]},
    }


Refs = list[dict[str, Any]]


def route(name: str = "r", *, kind: str = "HTTPRoute", parents: Refs | None = None,
          backends: Refs | None = None, group: str = GW) -> dict[str, Any]:  # fmt: skip
    version = "v1" if group == GW or kind == "GRPCRoute" else "v1beta3"
    rule: dict[str, Any] = {}
    if backends is not None:
        rule["backendRefs"] = backends
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": {"name": name, "namespace": "ns", "generation": 3, "resourceVersion": "7"},
        "spec": {
            "parentRefs": parents if parents is not None else [{"kind": "Service", "name": "web",
                                                                 "group": "core"}],
            "rules": [rule],
        },
    }  # fmt: skip


def server_obj() -> dict[str, Any]:
    return {
        "apiVersion": f"{W.POLICY_API_GROUP}/v1beta3",
        "kind": "Server",
        "metadata": {"name": "web-http", "namespace": "ns"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "port": 8080},
    }


def profile(routes: bool = True) -> dict[str, Any]:
    route = {"name": "GET /", "condition": {"method": "GET", "pathRegex": "/"}}
    return {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": "web.ns.svc.cluster.local", "namespace": "ns"},
        "spec": {"routes": [route] if routes else []},
    }


def cluster(*objects: dict[str, Any]) -> Indexes:
    ix = Indexes(OutboundIndex(), Index(ClusterConfig(networks=parse_networks("10.0.0.0/8"))))
    for obj in objects:
        event = Upsert(KINDS[(obj["apiVersion"], obj["kind"])], obj)
        ix.outbound.apply(event)
        ix.inbound.apply(event)
        ix.apply(event)
    return ix


def conditions(obj: dict[str, Any], *others: dict[str, Any]) -> list[list[tuple[str, str, str]]]:
    return [
        [(c.type, c.status, c.reason) for c in found]
        for _, found in parent_statuses(obj, cluster(obj, *others))
    ]


OK = [("Accepted", "True", "Accepted"), ("ResolvedRefs", "True", "ResolvedRefs")]
NO_PARENT = [("Accepted", "False", "NoMatchingParent"), ("ResolvedRefs", "True", "ResolvedRefs")]
SERVER_PARENT = [{"group": W.POLICY_API_GROUP, "kind": "Server", "name": "web-http"}]
CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], Any]] = [
    ("a route on an existing Service", route(), [service()], [OK]),
    ("a policy.meshlet.io HTTPRoute", route(group=W.POLICY_API_GROUP), [service()], [OK]),
    ("a GRPCRoute", route(kind="GRPCRoute"), [service()], [OK]),
    ("the parent Service does not exist", route(), [], [NO_PARENT]),
    ("a headless parent", route(), [service(ip="None")], [NO_PARENT]),
    ("a backend Service that does not exist", route(backends=[{"name": "gone", "port": 80}]),
     [service()], [[OK[0], ("ResolvedRefs", "False", "BackendNotFound")]]),
    ("a backend of another kind",
     route(backends=[{"group": "apps", "kind": "Deployment", "name": "x", "port": 80}]),
     [service()], [[OK[0], ("ResolvedRefs", "False", "InvalidKind")]]),
    ("a backend that exists", route(backends=[{"name": "canary", "port": 80}]),
     [service(), service("canary", "10.96.0.2")], [OK]),
    ("an HTTPRoute beside a GRPCRoute on the same parent", route(),
     [service(), route("g", kind="GRPCRoute")],
     [[("Accepted", "False", "RouteReasonConflicted"), OK[1]]]),
    ("a route the index refuses", route(backends=[{"name": "web", "port": 99999}]),
     [service()], [[("Accepted", "False", "UnsupportedValue"), OK[1]]]),
    ("a Server parent", route(parents=SERVER_PARENT, group=W.POLICY_API_GROUP),
     [server_obj()], [[OK[0]]]),
    ("a Server parent that does not exist", route(parents=SERVER_PARENT, group=W.POLICY_API_GROUP),
     [], [[("Accepted", "False", "NoMatchingParent")]]),
    ("a Gateway parent is another controller's",
     route(parents=[{"group": GW, "kind": "Gateway", "name": "edge"}]), [], []),
    ("a ServiceProfile shadows the route: Accepted stays True", route(), [service(), profile()],
     [[*OK, ("meshlet.io/ServiceProfile", "True", "ServiceProfileExists")]]),
    ("a ServiceProfile without routes or dstOverrides does not", route(),
     [service(), profile(routes=False)], [OK]),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "others", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_conditions(obj: dict[str, Any], others: list[dict[str, Any]], expected: Any) -> None:
    assert conditions(obj, *others) == expected


def test_the_messages_say_what_is_missing() -> None:
    obj = route(backends=[{"name": "gone", "port": 80}])
    [(_, found)] = parent_statuses(obj, cluster(obj))
    assert [c.message for c in found] == ["Service ns/web not found", "Service ns/gone not found"]
    [(_, found)] = parent_statuses(obj, cluster(obj, service(), profile()))
    assert "ServiceProfile web.ns.svc.cluster.local has routes or dstOverrides" in found[2].message


def test_merged_keeps_other_controllers_and_unchanged_transition_times() -> None:
    other = {
        "parentRef": {"group": GW, "kind": "Gateway", "name": "edge"},
        "controllerName": "example.net/gateway",
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}],
    }
    obj = route(parents=[{"kind": "Service", "name": "web", "group": "core", "port": 80},
                         {"group": GW, "kind": "Gateway", "name": "edge"}],
                backends=[{"name": "canary", "port": 80}])  # fmt: skip
    obj["status"] = {"parents": [other]}
    world = cluster(obj, service())
    first = merged(obj, world, NOW)
    assert first is not None and first[0] == other
    ours = first[1]
    assert ours["controllerName"] == CONTROLLER_NAME == "meshlet.io/policy-controller"
    assert ours["parentRef"] == {"group": "core", "kind": "Service", "namespace": "ns",
                                 "name": "web", "port": 80}  # fmt: skip
    assert [(c["type"], c["status"], c["lastTransitionTime"], c["observedGeneration"])
            for c in ours["conditions"]] == [("Accepted", "True", NOW, 3),
                                             ("ResolvedRefs", "False", NOW, 3)]  # fmt: skip
    obj["status"] = {"parents": first}
    assert merged(obj, world, LATER) is None  # nothing changed: no patch
    world = cluster(obj, service(), service("canary", "10.96.0.2"))
    fixed = merged(obj, world, LATER)
    assert fixed is not None
    assert [(c["status"], c["lastTransitionTime"]) for c in fixed[1]["conditions"]] == [
        ("True", NOW),  # Accepted did not change: its time is kept
        ("True", LATER),  # ResolvedRefs turned True now
    ]


def test_merged_drops_our_entry_for_a_parent_the_route_no_longer_names() -> None:
    obj = route()
    world = cluster(obj, service())
    obj["status"] = {"parents": merged(obj, world, NOW)}
    obj["spec"]["parentRefs"] = [{"group": GW, "kind": "Gateway", "name": "edge"}]
    assert merged(obj, world, LATER) == []


def test_a_malformed_status_is_rewritten_not_a_crash() -> None:
    obj = route()
    obj["status"] = {"parents": ["junk", {"controllerName": CONTROLLER_NAME, "conditions": 5}]}
    out = merged(obj, cluster(obj, service()), NOW)
    assert out is not None and [e["controllerName"] for e in out] == [CONTROLLER_NAME]


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([0.0, 0.0, 0.0], [0.0, 0.0, 0.5]),  # a burst of 2, then 2 a second
        ([0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.5]),  # refilled after a second
        ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 1.0]),  # each waits its own turn
    ],
)
def test_the_pacer_is_a_token_bucket(steps: list[float], expected: list[float]) -> None:
    pacer = Pacer(rate=2.0, burst=2.0)
    assert [pacer.delay(now) for now in steps] == expected


# -- the writer against the fake API server --------------------------------------------------


async def eventually(check: Callable[[], Any], within: float = 5.0) -> Any:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        found = await asyncio.to_thread(check)
        if found or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.05)


def ours(api: Any, name: str = "r") -> list[tuple[str, str, str]] | None:
    obj = api.get(f"{GW}/v1", "HTTPRoute", name, "ns")
    for entry in ((obj or {}).get("status") or {}).get("parents") or []:
        if entry.get("controllerName") == CONTROLLER_NAME:
            return [(c["type"], c["status"], c["reason"]) for c in entry["conditions"]]
    return None


def patches(api: Any) -> int:
    return sum(1 for method, path in api.requests if method == "PATCH" and "/status" in path)


async def test_the_policy_controller_writes_route_status_through_the_api() -> None:
    from kubernetes import client as k8s_client

    from meshlet.controlplane.k8s.informer import KubernetesSource
    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES, FakeKubeAPI

    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as api:
        api.apply(service())
        api.apply(route("r", backends=[{"name": "canary", "port": 80}]))
        api.apply(route("orphan", parents=[{"kind": "Service", "name": "nope", "group": "core"}]))
        with k8s_client.ApiClient(api.client_configuration()) as api_client:
            config = PolicyConfig(
                addr=HostPort("127.0.0.1", 0),
                admin_addr=HostPort("127.0.0.1", 0),
                source=KubernetesSource(api_client, kinds=POLICY_SERVER_KINDS, watch_timeout=5),
                cluster=ClusterConfig(networks=parse_networks("10.0.0.0/8")),
                status_patch=kubernetes_patch(api_client),
            )
            srv = PolicyServer(config)
            await srv.start()
            try:
                missing = [OK[0], ("ResolvedRefs", "False", "BackendNotFound")]
                assert await eventually(lambda: ours(api) == missing), ours(api)
                assert await eventually(lambda: ours(api, "orphan") == NO_PARENT)
                written = await asyncio.to_thread(patches, api)
                assert written == 2
                counted = srv.registry.get_sample_value(
                    "policy_route_status_patches_total", {"result": "written"}
                )
                assert counted == 2
                await asyncio.sleep(0.6)  # its own writes came back as events: nothing to write
                assert await asyncio.to_thread(patches, api) == written

                await asyncio.to_thread(api.apply, service("canary", "10.96.0.2"))
                assert await eventually(lambda: ours(api) == OK), ours(api)
                obj = await asyncio.to_thread(api.get, f"{GW}/v1", "HTTPRoute", "r", "ns")
                entry = obj["status"]["parents"][0]
                assert [c["observedGeneration"] for c in entry["conditions"]] == [1, 1]

                before = await asyncio.to_thread(patches, api)

                def burst() -> None:  # 1,000 edits of one route, as fast as the API takes them
                    for i in range(1000):
                        edited = route("r", backends=[{"name": "canary", "port": 80,
                                                       "weight": i + 1}])  # fmt: skip
                        api.apply(edited)

                await asyncio.to_thread(burst)
                assert await eventually(lambda: ours_generation(api) == 1001)
                assert await asyncio.to_thread(patches, api) - before <= 20
            finally:
                await srv.stop(grace=0)


def ours_generation(api: Any) -> int | None:
    obj = api.get(f"{GW}/v1", "HTTPRoute", "r", "ns")
    for entry in ((obj or {}).get("status") or {}).get("parents") or []:
        if entry.get("controllerName") == CONTROLLER_NAME:
            return int(entry["conditions"][0]["observedGeneration"])
    return None


async def test_a_patch_from_an_older_version_is_a_conflict_not_an_overwrite() -> None:
    from kubernetes import client as k8s_client

    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES, FakeKubeAPI

    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as api:
        created = api.apply(route())
        api.apply(route(backends=[{"name": "web", "port": 80}]))
        with k8s_client.ApiClient(api.client_configuration()) as api_client:
            patch = kubernetes_patch(api_client)
            stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
                     "status": {"parents": []}}  # fmt: skip
            with pytest.raises(PatchConflict):
                await patch(Kind.GATEWAY_HTTP_ROUTE, "ns", "r", stale)
            current = api.get(f"{GW}/v1", "HTTPRoute", "r", "ns")
            assert current is not None and "status" not in current
            body = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                    "status": {"parents": [{"controllerName": CONTROLLER_NAME}]}}  # fmt: skip
            await patch(Kind.GATEWAY_HTTP_ROUTE, "ns", "r", body)
            after = api.get(f"{GW}/v1", "HTTPRoute", "r", "ns")
            assert after is not None and after["status"] == body["status"]
            assert after["spec"] == current["spec"]  # the status subresource writes status only


def test_a_snapshot_forgets_routes_that_are_gone() -> None:
    from meshlet.controlplane.policy.status import StatusWriter

    async def never(*_: Any) -> None:
        raise AssertionError

    writer = StatusWriter(cluster(), never)
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (route("a"), route("b"))))
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (route("b"),)))
    assert sorted(k[2] for k in writer.routes) == ["b"]


def test_a_change_marks_only_the_routes_that_name_it() -> None:
    from meshlet.controlplane.policy.status import StatusWriter

    async def never(*_: Any) -> None:
        raise AssertionError

    writer = StatusWriter(cluster(), never)
    on_api = route("on-api", parents=[{"kind": "Service", "name": "api", "group": "core"}])
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (
        route("r"), route("to-canary", backends=[{"name": "canary", "port": 80}]), on_api,
    )))  # fmt: skip
    writer.dirty.clear()

    def marked() -> list[str]:
        names = sorted(k[2] for k in writer.dirty)
        writer.dirty.clear()
        return names

    writer.apply(Upsert(Kind.SERVICE, service("canary")))
    assert marked() == ["to-canary"]
    writer.apply(Upsert(Kind.SERVICE_PROFILE, profile()))
    assert marked() == ["r", "to-canary"]
    writer.apply(Upsert(Kind.GATEWAY_GRPC_ROUTE, route("g", kind="GRPCRoute")))
    assert marked() == ["g", "r", "to-canary"]  # the HTTPRoutes it may conflict with
    writer.apply(Upsert(Kind.SERVICE, service("unrelated")))
    assert marked() == []


async def test_a_failed_patch_is_retried_and_a_conflict_waits_for_the_newer_route() -> None:
    """The writer's shell over a recording `Patch` (the port it calls): an API error is retried
    after `retry_delay`; a 409 is not, since the newer route arrives as an event anyway."""
    from meshlet.controlplane.policy.status import StatusWriter

    calls: list[tuple[str, str]] = []
    outcomes = [RuntimeError("503 Service Unavailable"), None, PatchConflict("409")]

    async def patch(kind: Kind, namespace: str, name: str, body: dict[str, Any]) -> None:
        calls.append((name, body["metadata"]["resourceVersion"]))
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    results: list[str] = []
    writer = StatusWriter(cluster(service()), patch, interval=0.01, retry_delay=0.05,
                          on_result=results.append)  # fmt: skip
    task = asyncio.create_task(writer.run())
    try:
        writer.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, route("a")))
        assert await eventually(lambda: results == ["failed", "written"], 2.0), results
        newer = route("a")
        newer["metadata"]["resourceVersion"] = "8"
        writer.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, newer))
        assert await eventually(lambda: len(results) == 3, 2.0)
        await asyncio.sleep(0.1)
        assert results == ["failed", "written", "conflict"]  # not retried
        assert calls == [("a", "7"), ("a", "7"), ("a", "8")]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_merged_keeps_the_order_another_controller_wrote() -> None:
    theirs = {
        "parentRef": {"group": GW, "kind": "Gateway", "name": "edge"},
        "controllerName": "example.net/gateway",
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}],
    }
    obj = route()
    world = cluster(obj, service())
    first = merged(obj, world, NOW)
    assert first is not None
    obj["status"] = {"parents": [*first, theirs]}  # ours first, as the other one left it
    assert merged(obj, world, LATER) is None


def test_a_policy_controller_process_with_a_kubeconfig_writes_status(tmp_path: Any) -> None:
    """`meshlet-controller policy --kubeconfig` as a user runs it: the status writer is on."""
    import os
    import subprocess
    import sys
    import time

    from meshlet_testing.fakeapi import POLICY_RESOURCES, RESOURCES, FakeKubeAPI

    with FakeKubeAPI(resources=RESOURCES + POLICY_RESOURCES) as api:
        api.apply(service())
        api.apply(route())
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshlet.controlplane.main", "policy", "--kubeconfig",
             str(kubeconfig), "--addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while ours(api) != OK and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            assert ours(api) == OK
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "wrote the status of HTTPRoute ns/r" in err


def test_a_relist_marks_only_what_changed() -> None:
    """Every 5 minutes the source relists each kind: with 10,000 routes, recomputing them all
    each time would cost seconds of CPU for nothing."""
    from meshlet.controlplane.policy.status import StatusWriter

    async def never(*_: Any) -> None:
        raise AssertionError

    def versioned(obj: dict[str, Any], version: str) -> dict[str, Any]:
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": version}}

    writer = StatusWriter(cluster(), never)
    web, api = versioned(service(), "1"), versioned(service("api"), "2")
    on_api = versioned(route("b", parents=[{"kind": "Service", "name": "api"}]), "4")
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (versioned(route("a"), "3"), on_api)))
    writer.apply(Snapshot(Kind.SERVICE, (web, api)))
    writer.dirty.clear()
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (versioned(route("a"), "3"), on_api)))
    writer.apply(Snapshot(Kind.SERVICE, (web, api)))
    assert writer.dirty == set()
    writer.apply(Snapshot(Kind.SERVICE, (versioned(service(), "9"),)))  # web changed, api gone
    assert sorted(k[2] for k in writer.dirty) == ["a", "b"]
    writer.dirty.clear()
    writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, (versioned(route("a"), "10"), on_api)))
    assert sorted(k[2] for k in writer.dirty) == ["a"]


async def test_the_writer_paces_its_patches() -> None:
    """A burst of changes to many routes is written at the bucket's rate, not at once."""
    from meshlet.controlplane.policy.status import StatusWriter

    loop = asyncio.get_running_loop()
    sent: list[float] = []

    async def patch(kind: Kind, namespace: str, name: str, body: dict[str, Any]) -> None:
        sent.append(loop.time())

    writer = StatusWriter(cluster(service()), patch, interval=0.01,
                          pacer=Pacer(rate=50.0, burst=2.0), clock=loop.time)  # fmt: skip
    task = asyncio.create_task(writer.run())
    try:
        writer.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, tuple(route(f"r{i}") for i in range(7))))
        assert await eventually(lambda: len(sent) == 7, 2.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert sent[1] - sent[0] < 0.015  # the burst of 2
    assert sent[6] - sent[1] >= 5 / 50.0 - 0.005  # then 50 a second
