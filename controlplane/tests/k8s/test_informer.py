"""KubernetesSource against the fake API server, through the real `kubernetes` client."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes import client

from meshlet.controlplane.k8s import informer
from meshlet.controlplane.k8s.events import DESTINATION_KINDS, Delete, Event, Kind, Snapshot, Upsert
from meshlet.controlplane.k8s.informer import KubernetesSource
from meshlet_testing.fakeapi import RESOURCES, FakeKubeAPI

NS = "default"
Obj = dict[str, Any]


def source_for(api_client: client.ApiClient, **overrides: Any) -> KubernetesSource:
    settings: dict[str, Any] = {
        "watch_timeout": 1.0,
        "backoff": (0.02, 0.1),
        "request_timeout": 5.0,
        "rng": random.Random(7),
    }
    return KubernetesSource(api_client, **(settings | overrides))


def service(name: str, cluster_ip: str = "10.96.0.10") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"clusterIP": cluster_ip, "ports": [{"port": 80, "targetPort": 8080}]},
    }


def pod(name: str, ip: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "app", "image": "web:1"}]},
        "status": {"phase": "Running", "podIP": ip},
    }


def endpoint_slice(name: str, ip: str, ready: bool = True) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def profile(name: str) -> Obj:
    return {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "routes": [{"name": "GET /", "condition": {"method": "GET", "pathRegex": "/"}}],
            "retryBudget": {"retryRatio": 0.2, "minRetriesPerSecond": 10, "ttl": "10s"},
        },
    }


class Recorder:
    """A sink that keeps every event, and can wait for a condition on the event loop."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def snapshots(self, kind: Kind) -> list[Snapshot]:
        return [e for e in self.events if isinstance(e, Snapshot) and e.kind == kind]

    def changes(self) -> list[tuple[str, Kind, str]]:
        return [
            (type(e).__name__, e.kind, e.obj["metadata"]["name"])
            for e in self.events
            if isinstance(e, Upsert | Delete)
        ]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; events so far: {self.events}"
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: KubernetesSource, sink: Callable[[Event], None]) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(sink))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def informer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("informer-")]


async def test_first_snapshots_hold_the_objects_as_the_api_serves_them(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    api.apply(service("web", "10.96.0.42"))
    api.apply(pod("web-1", "10.0.0.1"))
    api.apply(endpoint_slice("web-abc", "10.0.0.1"))
    api.apply(profile("web.default.svc.cluster.local"))
    lags: list[tuple[Kind, float]] = []
    source = source_for(api_client, on_event=lambda kind, lag: lags.append((kind, lag)))
    rec = Recorder()
    async with running(source, rec):
        await rec.wait_for(lambda: source.synced)

    assert sorted(e.kind.name for e in rec.events) == sorted(k.name for k in DESTINATION_KINDS)
    assert all(isinstance(e, Snapshot) for e in rec.events)
    [svc] = rec.snapshots(Kind.SERVICE)[0].objects
    [web] = rec.snapshots(Kind.POD)[0].objects
    [eps] = rec.snapshots(Kind.ENDPOINT_SLICE)[0].objects
    [sp] = rec.snapshots(Kind.SERVICE_PROFILE)[0].objects
    assert svc["spec"]["clusterIP"] == "10.96.0.42"
    assert web["status"]["podIP"] == "10.0.0.1"
    assert eps["endpoints"][0]["conditions"]["ready"] is True
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
    assert sp["spec"] == profile("x")["spec"]
    # Exactly the API's JSON, camelCase and all, not client model objects.
    assert web == api.get("v1", "Pod", "web-1", NS)
    assert (
        web["metadata"]["resourceVersion"]
        == api.get("v1", "Pod", "web-1")["metadata"]["resourceVersion"]
    )
    assert sorted(k.name for k, _ in lags) == sorted(k.name for k in DESTINATION_KINDS)
    assert all(0 <= lag < 5 for _, lag in lags)

    # Every kind is listed and watched across all namespaces, with bookmarks.
    paths = [path for method, path in api.requests if method == "GET"]
    for prefix in (
        "/api/v1/services",
        "/api/v1/pods",
        "/apis/discovery.k8s.io/v1/endpointslices",
        "/apis/meshlet.io/v1alpha1/serviceprofiles",
    ):
        ours = [p for p in paths if p.split("?")[0] == prefix]
        assert ours and "watch" not in ours[0], f"{prefix} was not listed first: {paths}"
        watches = [p for p in ours if "watch=true" in p]
        assert watches and all("allowWatchBookmarks=true" in p for p in watches)


async def test_synced_turns_true_with_the_last_kinds_first_snapshot(
    api_client: client.ApiClient,
) -> None:
    seen: list[tuple[str, bool]] = []
    source = source_for(api_client)
    rec = Recorder()

    def sink(event: Event) -> None:
        seen.append((type(event).__name__, source.synced))
        rec(event)

    assert not source.synced
    async with running(source, sink):
        await rec.wait_for(lambda: len(seen) == 4)
    assert seen == [("Snapshot", False)] * 3 + [("Snapshot", True)]
    assert source.synced


async def test_a_kind_that_cannot_be_listed_keeps_synced_false_and_is_retried() -> None:
    without_profiles = tuple(r for r in RESOURCES if r.kind != "ServiceProfile")
    with (
        FakeKubeAPI(resources=without_profiles) as api,
        client.ApiClient(api.client_configuration()) as api_client,
    ):
        source = source_for(api_client)
        rec = Recorder()
        async with running(source, rec):
            await rec.wait_for(lambda: source.reconnects[Kind.SERVICE_PROFILE] >= 3)
            await rec.wait_for(lambda: len(rec.events) == 3)
            assert not source.synced
        assert {e.kind for e in rec.events} == set(DESTINATION_KINDS) - {Kind.SERVICE_PROFILE}
        lists = [p for _, p in api.requests if p.startswith("/apis/meshlet.io/")]
        assert len(lists) >= 3 and not any("watch=true" in p for p in lists)
        assert source.relists[Kind.SERVICE_PROFILE] == 0


async def test_changes_arrive_as_upserts_and_deletes(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    source = source_for(api_client)
    rec = Recorder()
    async with running(source, rec):
        await rec.wait_for(lambda: source.synced)
        assert all(s.objects == () for k in DESTINATION_KINDS for s in rec.snapshots(k))
        api.apply(pod("web-1", "10.0.0.1"))
        api.apply(pod("web-1", "10.0.0.2"))
        api.apply(endpoint_slice("web-abc", "10.0.0.2", ready=False))
        api.apply(profile("web.default.svc.cluster.local"))
        api.delete("v1", "Pod", "web-1", NS)
        await rec.wait_for(lambda: len(rec.changes()) == 5)

    assert sorted(rec.changes(), key=str) == sorted(
        [
            ("Upsert", Kind.POD, "web-1"),
            ("Upsert", Kind.POD, "web-1"),
            ("Upsert", Kind.ENDPOINT_SLICE, "web-abc"),
            ("Upsert", Kind.SERVICE_PROFILE, "web.default.svc.cluster.local"),
            ("Delete", Kind.POD, "web-1"),
        ],
        key=str,
    )
    pod_events = [e for e in rec.events if not isinstance(e, Snapshot) and e.kind == Kind.POD]
    assert [type(e).__name__ for e in pod_events] == ["Upsert", "Upsert", "Delete"]
    assert [e.obj["status"]["podIP"] for e in pod_events] == ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    [eps] = [e for e in rec.events if isinstance(e, Upsert) and e.kind == Kind.ENDPOINT_SLICE]
    assert eps.obj["endpoints"][0]["conditions"]["ready"] is False
    [sp] = [e for e in rec.events if isinstance(e, Upsert) and e.kind == Kind.SERVICE_PROFILE]
    assert sp.obj["spec"]["retryBudget"]["retryRatio"] == 0.2
    assert source.relists == dict.fromkeys(DESTINATION_KINDS, 0)


async def test_a_broken_watch_resumes_from_the_last_version_without_relisting(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    api.apply(pod("web-1", "10.0.0.1"))
    source = source_for(api_client, backoff=(0.3, 0.3))
    rec = Recorder()
    async with running(source, rec):
        await rec.wait_for(lambda: source.synced)
        assert await asyncio.to_thread(api.wait_for_watches, 4)
        assert source.reconnects == dict.fromkeys(DESTINATION_KINDS, 0)
        api.break_watches()
        api.apply(pod("web-2", "10.0.0.2"))  # while every watch is down (backoff >= 0.15 s)
        await rec.wait_for(lambda: all(n == 1 for n in source.reconnects.values()))
        await rec.wait_for(lambda: rec.changes() == [("Upsert", Kind.POD, "web-2")])
        api.apply(pod("web-3", "10.0.0.3"))
        await rec.wait_for(lambda: len(rec.changes()) == 2)

    assert rec.changes()[1] == ("Upsert", Kind.POD, "web-3")
    assert len(rec.snapshots(Kind.POD)) == 1
    assert source.relists == dict.fromkeys(DESTINATION_KINDS, 0)
    pod_requests = [p for _, p in api.requests if p.startswith("/api/v1/pods")]
    assert sum("watch=true" not in p for p in pod_requests) == 1  # listed once only
    assert sum("watch=true" in p for p in pod_requests) >= 2


async def test_a_watch_ended_cleanly_is_resumed_and_a_silent_short_one_backs_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(informer, "SHORT_WATCH_SECONDS", 30.0)
    with (
        FakeKubeAPI(bookmark_interval=3600) as api,
        client.ApiClient(api.client_configuration()) as api_client,
    ):
        source = source_for(api_client, watch_timeout=30.0)
        rec = Recorder()
        async with running(source, rec):
            await rec.wait_for(lambda: source.synced)
            assert await asyncio.to_thread(api.wait_for_watches, 4)
            api.apply(pod("web-1", "10.0.0.1"))
            await rec.wait_for(lambda: len(rec.changes()) == 1)
            api.break_watches(graceful=True)
            await rec.wait_for(lambda: sum(source.reconnects.values()) == 3)
            assert await asyncio.to_thread(api.wait_for_watches, 4)
            api.apply(pod("web-2", "10.0.0.2"))
            await rec.wait_for(lambda: len(rec.changes()) == 2)
        # The pods watch had an event: a clean end is resumed at once. The silent ones back off.
        assert source.reconnects == {k: int(k != Kind.POD) for k in DESTINATION_KINDS}
        assert source.relists == dict.fromkeys(DESTINATION_KINDS, 0)
        assert rec.changes() == [("Upsert", Kind.POD, "web-1"), ("Upsert", Kind.POD, "web-2")]


async def test_an_expired_watch_relists_and_the_snapshot_shows_what_was_missed(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    api.apply(pod("a", "10.0.0.1"))
    api.apply(pod("b", "10.0.0.2"))
    source = source_for(api_client, backoff=(0.4, 0.4))
    rec = Recorder()
    async with running(source, rec):
        await rec.wait_for(lambda: source.synced)
        assert await asyncio.to_thread(api.wait_for_watches, 4)
        api.break_watches()
        api.delete("v1", "Pod", "a", NS)  # while disconnected (backoff >= 0.2 s) ...
        api.compact()  # ... and then too old to replay: the next watch answers 410
        await rec.wait_for(lambda: len(rec.snapshots(Kind.POD)) == 2)
        await rec.wait_for(lambda: all(n == 1 for n in source.relists.values()))
        api.apply(pod("c", "10.0.0.3"))
        await rec.wait_for(lambda: rec.changes() == [("Upsert", Kind.POD, "c")])

    first, second = rec.snapshots(Kind.POD)
    assert [o["metadata"]["name"] for o in first.objects] == ["a", "b"]
    assert [o["metadata"]["name"] for o in second.objects] == ["b"]
    assert second.objects[0] == api.get("v1", "Pod", "b")
    assert not any(isinstance(e, Delete) for e in rec.events)  # the Snapshot replaced state
    assert source.reconnects == dict.fromkeys(DESTINATION_KINDS, 1)


async def test_resync_relists_every_interval(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    api.apply(service("web"))
    source = source_for(api_client, resync_interval=0.3)
    rec = Recorder()
    async with running(source, rec):
        await rec.wait_for(lambda: all(len(rec.snapshots(k)) >= 3 for k in DESTINATION_KINDS))
    assert all(source.relists[k] >= 2 for k in DESTINATION_KINDS)
    assert source.reconnects == dict.fromkeys(DESTINATION_KINDS, 0)
    assert all(
        s.objects[0]["spec"]["clusterIP"] == "10.96.0.10" for s in rec.snapshots(Kind.SERVICE)
    )


async def test_cancelling_run_stops_every_thread_and_watch_promptly() -> None:
    # No bookmarks and a long server-side timeout: the watches stay silent, so only the
    # source's own stopping can end them quickly.
    with (
        FakeKubeAPI(bookmark_interval=3600) as api,
        client.ApiClient(api.client_configuration()) as api_client,
    ):
        source = source_for(api_client, watch_timeout=30.0)
        rec = Recorder()
        task = asyncio.create_task(source.run(rec))
        await rec.wait_for(lambda: source.synced)
        assert await asyncio.to_thread(api.wait_for_watches, 4)
        assert len(informer_threads()) == 4
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 2
        assert informer_threads() == []
        assert await asyncio.to_thread(api.wait_for_watches, 0, 2.0)
        api.apply(pod("late", "10.0.0.9"))
        await asyncio.sleep(0.1)
        assert len(rec.events) == 4  # nothing is delivered after run ended


async def test_a_failing_sink_ends_run_with_its_error(
    api: FakeKubeAPI, api_client: client.ApiClient
) -> None:
    source = source_for(api_client)

    def sink(event: Event) -> None:
        if isinstance(event, Upsert):
            raise ValueError(f"cannot take {event.obj['metadata']['name']}")

    task = asyncio.create_task(source.run(sink))
    await asyncio.to_thread(api.wait_for_watches, 4)
    api.apply(pod("web-1", "10.0.0.1"))
    with pytest.raises(ValueError, match="cannot take web-1"):
        await asyncio.wait_for(task, 5)
    assert informer_threads() == []
    assert await asyncio.to_thread(api.wait_for_watches, 0, 2.0)


# -- the decisions -----------------------------------------------------------------------------


def test_snapshot_of_fills_in_the_type_the_api_server_leaves_out_of_list_items() -> None:
    body = {
        "kind": "PodList",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": "41"},
        "items": [{"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.1"}}],
    }
    snapshot, version = informer.snapshot_of(Kind.POD, body)
    assert version == "41"
    assert snapshot == Snapshot(
        Kind.POD,
        (
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "status": {"podIP": "10.0.0.1"},
            },
        ),
    )
    empty, _ = informer.snapshot_of(
        Kind.SERVICE, {"metadata": {"resourceVersion": "1"}, "items": None}
    )
    assert empty.objects == ()


def test_change_of_maps_watch_events() -> None:
    obj = {"metadata": {"name": "p", "resourceVersion": "7"}}
    assert informer.change_of(Kind.POD, {"type": "ADDED", "raw_object": obj}) == (
        Upsert(Kind.POD, obj),
        "7",
    )
    assert informer.change_of(Kind.POD, {"type": "MODIFIED", "raw_object": obj})[0] == Upsert(
        Kind.POD, obj
    )
    assert informer.change_of(Kind.POD, {"type": "DELETED", "raw_object": obj}) == (
        Delete(Kind.POD, obj),
        "7",
    )
    bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "9"}}
    assert informer.change_of(Kind.POD, {"type": "BOOKMARK", "raw_object": bookmark}) == (None, "9")


def test_backoff_grows_exponentially_with_jitter_up_to_the_cap() -> None:
    rng = random.Random(3)
    delays = [[informer.backoff_delay(n, (0.1, 5.0), rng) for _ in range(50)] for n in range(10)]
    for attempt, seen in enumerate(delays):
        ceiling = min(5.0, 0.1 * 2**attempt)
        assert all(ceiling / 2 <= d <= ceiling for d in seen)
        assert len(set(seen)) > 1  # jittered
    assert max(delays[9]) <= 5.0 and min(delays[9]) >= 2.5
    assert informer.backoff_delay(10_000, (0.1, 5.0), rng) <= 5.0


def test_watch_seconds_never_outlasts_the_next_resync() -> None:
    assert informer.watch_seconds(30.0, 300.0) == 30
    assert informer.watch_seconds(30.0, 4.2) == 5
    assert informer.watch_seconds(30.0, -1.0) == 1
    assert informer.watch_seconds(0.5, 300.0) == 1
