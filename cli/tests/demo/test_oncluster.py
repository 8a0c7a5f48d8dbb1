"""`meshlet demo --cluster` without a cluster to run it on: its refusals (no control plane, an
unreachable cluster, options of the local mesh), `demo down --cluster`, and how it names the
cluster's pods for the view and the drills. The run itself is an end-to-end step (make e2e)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from meshlet.cli.demo import oncluster, topology
from meshlet.cli.demo.oncluster import ClusterDemo
from meshlet.cli.demo.run import Options
from meshlet_testing.fakeapi import FakeKubeAPI


def test_without_meshlet_installed_it_says_how_to_install(
    meshlet: Callable[..., Any], api: FakeKubeAPI, tmp_path: Path
) -> None:
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
    run = meshlet("demo", "--cluster", "--kubeconfig", kubeconfig, "--duration", "1")
    assert run.code == 1, run
    assert "not in namespace meshlet of this cluster" in run.err
    assert "meshlet install --crds | kubectl apply -f -" in run.err
    assert "Traceback" not in run.err + run.out
    assert not api.list_objects("v1", "Namespace"), "nothing applied"


def test_an_unreachable_cluster_is_one_clear_error(
    meshlet: Callable[..., Any], unreachable_kubeconfig: Path
) -> None:
    run = meshlet("demo", "--cluster", "--kubeconfig", str(unreachable_kubeconfig))
    assert run.code == 1, run
    assert "Traceback" not in run.err + run.out
    assert "127.0.0.1:9" in run.err or "cannot" in run.err.lower(), run.err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cluster", "--mode", "netns"], "--mode is for the local mesh"),
        (["--cluster", "--issuance-lifetime", "20s"], "--issuance-lifetime is for the local mesh"),
        (["--image", "x"], "--image goes with --cluster"),
        (["--kubeconfig", "/nonexistent"], "--kubeconfig goes with --cluster"),
    ],
)
def test_options_that_do_not_go_together_are_usage_errors(
    meshlet: Callable[..., Any], args: list[str], says: str
) -> None:
    run = meshlet("demo", *args)
    assert run.code == 64, run  # the CLI's usage errors exit 64 (EX_USAGE)
    assert says in run.err


def test_down_deletes_the_demo_namespace(
    meshlet: Callable[..., Any], api: FakeKubeAPI, tmp_path: Path
) -> None:
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
    run = meshlet("demo", "down", "--cluster", "--kubeconfig", kubeconfig)
    assert run.code == 0, run
    names = [ns["metadata"]["name"] for ns in api.list_objects("v1", "Namespace")]
    assert names == ["other"]
    again = meshlet("demo", "down", "--cluster", "--kubeconfig", kubeconfig)
    assert again.code == 0 and "there was none" in again.out


def _pod(name: str, deployment: str, app: str, created: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": created,
                     "labels": {"app": app, "deployment": deployment}},
        "spec": {"containers": [{"name": "api" if app.startswith("api") else app}]},
        "status": {"podIP": "10.42.0.9", "phase": "Running"},
    }  # fmt: skip


def _demo() -> ClusterDemo:
    options = Options(mode=topology.Mode.CLUSTER, duration=0, rate=1, drill=None, keep=False,
                      issuance_lifetime="", summary_json=None)  # fmt: skip
    return ClusterDemo(options, Console(file=io.StringIO()), api=None)


def test_pods_get_the_local_meshs_names_and_a_replacement_the_next_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    demo = _demo()
    pods = [
        _pod("api-slow-7c9-zz", "api-slow", "api", "2026-12-02T10:00:00Z"),  # created first
        _pod("api-5f6-bb", "api", "api", "2026-12-02T10:00:02Z"),
        _pod("api-5f6-aa", "api", "api", "2026-12-02T10:00:01Z"),
        _pod("api-v2-88-cc", "api-v2", "api-v2", "2026-12-02T10:00:01Z"),
        _pod("web-1a-dd", "web", "web", "2026-12-02T10:00:01Z"),
    ]
    demo._relist(pods)
    assert not demo.events, "the pods it started with are no news"
    assert demo.alias == {"api-5f6-aa": "api-1", "api-5f6-bb": "api-2",
                          "api-slow-7c9-zz": "api-3", "api-v2-88-cc": "api-v2-1",
                          "web-1a-dd": "web-1"}  # fmt: skip
    assert demo.slow == {topology.SLOW_REPLICA: topology.SLOW_DELAY * 1000} == {"api-3": 50.0}
    assert [p.name for p in demo.layout.of("api")] == ["api-1", "api-2", "api-3"]
    assert demo.layout.pod("api-v2-1").identity.startswith("api-v2.demo.serviceaccount.")

    demo.load_started = 1.0  # pods from now on are news
    clock = [1000.0]
    monkeypatch.setattr(oncluster.time, "monotonic", lambda: clock[0])
    replaced = [p for p in pods if p["metadata"]["name"] != "api-5f6-bb"]
    replaced.append(_pod("api-5f6-ee", "api", "api", "2026-12-02T10:01:00Z"))
    demo._relist(replaced)
    assert demo.alias["api-5f6-ee"] == "api-4"
    assert any("new pod api-4 (api-5f6-ee)" in what for _, what in demo.events)
    # the deleted pod stays in the view (shown gone) for GONE_KEPT seconds, then leaves it
    assert "api-2" in [p.name for p in demo.layout.of("api")]
    clock[0] += oncluster.GONE_KEPT + 1
    demo._relist(replaced)
    assert [p.name for p in demo.layout.of("api")] == ["api-1", "api-3", "api-4"]


def test_the_load_generators_count_speaks_of_the_pods_by_their_view_names() -> None:
    demo = _demo()
    demo._relist([_pod("api-5f6-aa", "api", "api", "2026-12-02T10:00:01Z")])
    demo.stats = {"sent": 3, "by_api": {"api-5f6-aa": 2, "api-gone-xx": 1},
                  "recent": [[1.0, "ok", "api-5f6-aa"], [2.0, "ok", "api-gone-xx"]]}  # fmt: skip
    stats = demo._load_stats()
    assert stats is not None
    assert stats["by_api"] == {"api-1": 2, "api-gone-xx": 1}
    assert stats["recent"] == [[1.0, "ok", "api-1"], [2.0, "ok", "api-gone-xx"]]
    assert stats["sent"] == 3


def test_a_pod_not_ready_is_explained_by_its_containers_waiting_reasons() -> None:
    pod = {
        "metadata": {"name": "web-1a-dd"},
        "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}],
                   "containerStatuses": [{"name": "web", "state": {"waiting": {
                       "reason": "ErrImageNeverPull",
                       "message": 'image "ghcr.io/meshlet/demo:0.1.0" is not present'}}}]},
    }  # fmt: skip
    assert oncluster._not_ready(pod) == (
        'web-1a-dd: web ErrImageNeverPull: image "ghcr.io/meshlet/demo:0.1.0" is not present'
    )
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert oncluster._not_ready(pod) == ""
