"""ManifestsSource over real files in a temporary directory, and its parsing decisions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import yaml

from meshlet.controlplane.k8s import manifests
from meshlet.controlplane.k8s.events import DESTINATION_KINDS, Event, Kind, Snapshot
from meshlet.controlplane.k8s.manifests import ManifestsSource

SERVICES = """\
apiVersion: v1
kind: Service
metadata:
  name: web
spec:
  clusterIP: 10.96.0.10
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: data}
spec: {clusterIP: 10.96.0.20}
---
"""

PODS = """\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Pod
  metadata: {name: web-1, creationTimestamp: 2024-05-01T10:00:00Z}
  status: {podIP: 10.0.0.1}
- apiVersion: v1
  kind: Pod
  metadata: {name: web-2}
  status: {podIP: 10.0.0.2}
"""

SLICE = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {"name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
    "addressType": "IPv4",
    "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}],
    "ports": [{"port": 8080}],
}


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def snapshots(self) -> list[Snapshot]:
        return [e for e in self.events if isinstance(e, Snapshot)]

    def latest(self, kind: Kind) -> list[str]:
        [*_, last] = [s for s in self.snapshots() if s.kind == kind]
        return [o["metadata"]["name"] for o in last.objects]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while not predicate():
            assert time.monotonic() < deadline, f"timed out; events so far: {self.events}"
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(source: ManifestsSource, sink: Recorder) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_for(lambda: source.synced)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def settle() -> None:
    """Long enough for several polls to have noticed whatever changed."""
    await asyncio.sleep(0.25)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path / "services.yaml", SERVICES)
    write(tmp_path / "web" / "pods.yml", PODS)
    write(tmp_path / "web" / "slice.json", json.dumps(SLICE))
    write(tmp_path / "README.md", "not a manifest")
    write(tmp_path / "..data" / "services.yaml", SERVICES.replace("web", "hidden"))
    return tmp_path


async def test_start_emits_a_snapshot_of_every_kind(tree: Path) -> None:
    source = ManifestsSource(tree, poll_interval=0.05)
    rec = Recorder()
    assert not source.synced
    async with running(source, rec):
        assert [s.kind for s in rec.snapshots()] == list(DESTINATION_KINDS)
    assert rec.latest(Kind.SERVICE) == ["web", "db"]  # the Deployment and hidden files ignored
    assert rec.latest(Kind.POD) == ["web-1", "web-2"]
    assert rec.latest(Kind.ENDPOINT_SLICE) == ["web-abc"]
    assert rec.latest(Kind.SERVICE_PROFILE) == []
    services, pods, slices = (
        next(s.objects for s in rec.snapshots() if s.kind == kind)
        for kind in (Kind.SERVICE, Kind.POD, Kind.ENDPOINT_SLICE)
    )
    assert [s["metadata"]["namespace"] for s in services] == ["default", "data"]
    assert services[0]["spec"] == {
        "clusterIP": "10.96.0.10",
        "ports": [{"port": 80, "targetPort": 8080}],
    }
    assert pods[0]["status"]["podIP"] == "10.0.0.1"
    assert pods[0]["metadata"]["creationTimestamp"] == "2024-05-01T10:00:00Z"  # still JSON
    assert slices[0] == {**SLICE, "metadata": {**SLICE["metadata"], "namespace": "default"}}


async def test_an_edit_emits_a_snapshot_of_the_changed_kinds_only(tree: Path) -> None:
    source = ManifestsSource(tree, poll_interval=0.05)
    rec = Recorder()
    async with running(source, rec):
        write(tree / "web" / "pods.yml", PODS.replace("10.0.0.2", "10.0.0.22"))
        await rec.wait_for(lambda: len(rec.events) == 5)
        await settle()
        write(tree / "services.yaml", SERVICES)  # rewritten as it was: nothing to tell
        write(tree / "profiles.yaml", "# nothing yet\n")
        await settle()
    [*_, last] = rec.snapshots()
    assert len(rec.events) == 5
    assert last.kind == Kind.POD
    assert [p["status"]["podIP"] for p in last.objects] == ["10.0.0.1", "10.0.0.22"]


async def test_new_and_deleted_files_add_and_remove_their_objects(tree: Path) -> None:
    source = ManifestsSource(tree, poll_interval=0.05)
    rec = Recorder()
    async with running(source, rec):
        profile = {
            "apiVersion": "meshlet.io/v1alpha1",
            "kind": "ServiceProfile",
            "metadata": {"name": "web.default.svc.cluster.local", "namespace": "default"},
            "spec": {"routes": [{"name": "GET /", "condition": {"method": "GET"}}]},
        }
        write(tree / "deep" / "er" / "profile.yaml", yaml.safe_dump(profile))
        await rec.wait_for(lambda: rec.latest(Kind.SERVICE_PROFILE) != [])
        (tree / "web" / "pods.yml").unlink()
        await rec.wait_for(lambda: rec.latest(Kind.POD) == [])
        await settle()
    assert [(s.kind, len(s.objects)) for s in rec.snapshots()[4:]] == [
        (Kind.SERVICE_PROFILE, 1),
        (Kind.POD, 0),
    ]
    assert rec.snapshots()[4].objects[0] == profile


async def test_a_broken_file_keeps_its_objects_and_the_rest_still_updates(
    tree: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = ManifestsSource(tree, poll_interval=0.05)
    rec = Recorder()
    async with running(source, rec):
        with caplog.at_level(logging.ERROR, logger=manifests.__name__):
            write(tree / "services.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: [\n")
            write(tree / "web" / "pods.yml", PODS.replace("web-2", "web-3"))
            await rec.wait_for(lambda: rec.latest(Kind.POD) == ["web-1", "web-3"])
            await settle()
        [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert str(tree / "services.yaml") in error.getMessage()
        assert "keeping its previous 3 objects" in error.getMessage()
        assert "line 4, column 1: while parsing a flow node, expected the node content" in (
            error.getMessage()
        )
        assert len(rec.events) == 5  # no Snapshot of services: they did not change

        write(tree / "services.yaml", SERVICES.split("---")[0])  # fixed, with one service fewer
        await rec.wait_for(lambda: rec.latest(Kind.SERVICE) == ["web"])


async def test_a_missing_directory_is_empty_until_it_appears(tmp_path: Path) -> None:
    source = ManifestsSource(tmp_path / "later", poll_interval=0.05)
    rec = Recorder()
    async with running(source, rec):
        assert all(s.objects == () for s in rec.snapshots())
        write(tmp_path / "later" / "services.yaml", SERVICES)
        await rec.wait_for(lambda: rec.latest(Kind.SERVICE) == ["web", "db"])


# -- the decisions -----------------------------------------------------------------------------


def test_parse_manifest_flattens_lists_and_skips_empty_documents() -> None:
    objects = manifests.parse_manifest(PODS + "---\n---\n" + SERVICES)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Pod", "web-1"),
        ("Pod", "web-2"),
        ("Service", "web"),
        ("Deployment", "web"),
        ("Service", "db"),
    ]
    as_json = manifests.parse_manifest(json.dumps({"kind": "List", "items": [SLICE]}), is_json=True)
    assert as_json == [SLICE]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [1,\n", "line 2, column 1: while parsing a flow node, expected the node content"),
        ("a: b\n  c: d\n", "line 2, column 4: mapping values are not allowed here"),
        ("- just\n- a list\n", "document 1 is a list, not an object"),
        ("kind: List\nitems: [1]\n", "a List with an item that is not an object"),
    ],
)
def test_read_manifest_names_the_file_and_the_fault(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(manifests.ManifestError, match=r"bad\.yaml: ") as failed:
        manifests.read_manifest(path)
    assert message in str(failed.value)


def test_group_by_kind_keeps_the_watched_kinds_and_defaults_the_namespace() -> None:
    grouped = manifests.group_by_kind(manifests.parse_manifest(SERVICES + PODS))
    assert set(grouped) == set(DESTINATION_KINDS)
    assert [o["metadata"]["namespace"] for o in grouped[Kind.SERVICE]] == ["default", "data"]
    assert len(grouped[Kind.POD]) == 2 and grouped[Kind.SERVICE_PROFILE] == ()


def test_changed_kinds_ignores_order_and_sees_any_field() -> None:
    before = manifests.group_by_kind(manifests.parse_manifest(SERVICES + PODS))
    reordered = manifests.group_by_kind(manifests.parse_manifest(PODS + "---\n" + SERVICES))
    reordered[Kind.POD] = tuple(reversed(reordered[Kind.POD]))
    assert manifests.changed_kinds(before, reordered) == []
    edited = manifests.group_by_kind(manifests.parse_manifest(SERVICES.replace("8080", "8081")))
    assert manifests.changed_kinds(before, edited) == [Kind.SERVICE, Kind.POD]
    assert manifests.changed_kinds({}, before) == [Kind.SERVICE, Kind.POD]


async def test_synced_turns_true_with_the_last_kinds_first_snapshot(tree: Path) -> None:
    source = ManifestsSource(tree, poll_interval=0.05)
    seen: list[bool] = []
    rec = Recorder()

    def sink(event: Event) -> None:
        seen.append(source.synced)
        rec(event)

    task = asyncio.create_task(source.run(sink))
    await rec.wait_for(lambda: len(seen) == len(DESTINATION_KINDS))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert seen == [False] * (len(DESTINATION_KINDS) - 1) + [True]
