"""Commands against a local mesh kept running (`meshlet demo --keep`), as a user runs them with no
cluster named: the state file and manifests folder the demo writes (here written by the test,
with the demo's own manifests), and its Prometheus and tap controller stood in for by one HTTP
server on a real socket that records what each command asked."""

from __future__ import annotations

import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli.demo import topology
from meshlet.cli.demo.supervisor import Record
from meshlet.controlplane.k8s.manifests import ManifestsFolder


@dataclass
class StandIn:
    """The kept mesh's Prometheus (`/api/v1/query`: one sample per query, labelled as the
    query's rows would be) and tap controller (`/api/v1/tap`: 404, as for no pods)."""

    url: str = ""
    queries: list[str] = field(default_factory=list)
    taps: list[dict[str, str]] = field(default_factory=list)


def _stand_in() -> tuple[ThreadingHTTPServer, StandIn]:
    seen = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            if url.path == "/api/v1/query":
                seen.queries.append(query["query"])
                labels = {"namespace": "demo", "deployment": "web", "dst_namespace": "demo",
                          "dst_deployment": "api", "tls": "true"}  # fmt: skip
                sample = {"metric": labels, "value": [0, "6"]}
                body = {"status": "success", "data": {"resultType": "vector", "result": [sample]}}
                self._answer(200, body)
            else:
                seen.taps.append(query)
                self._answer(404, {"type": "error", "message": "no meshed pods"})

        def _answer(self, status: int, doc: dict[str, Any]) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    seen.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    """A kept netns-mode local mesh with the demo's manifests, and no cluster named."""
    from meshlet.cli.demo import supervisor

    server, seen = _stand_in()
    root = tmp_path / "meshlet-demo"
    folder = ManifestsFolder(root / "manifests")
    folder.root.mkdir(parents=True)
    for name, objs in topology.manifests_static().items():
        folder.put(name, *objs)
    for pod in topology.layout(topology.Mode.NETNS).pods:
        folder.put(f"pod-{pod.name}", topology.pod_manifest(pod))
    urls = {"prometheus": seen.url, "tap": seen.url}
    Record("netns", str(root), str(tmp_path / "shm"), processes={"tap": os.getpid()},
           urls=urls).save()  # fmt: skip
    monkeypatch.setattr(supervisor, "state_root", lambda: root)  # this test's mesh only
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config: no cluster named
    yield seen
    server.shutdown()
    server.server_close()


def _namespaces(promql: str) -> set[str]:
    """The namespaces a query's selectors name (`namespace="X"`, `dst_namespace=~"X|"`)."""
    import re

    return set(re.findall(r'(?<![a-z_])namespace=~?"([a-z0-9-]*)', promql))


@pytest.mark.parametrize(
    "argv",
    [
        ("viz", "stat", "deploy"),
        ("viz", "stat", "deploy/web", "--to", "deploy/api"),
        ("viz", "routes", "deploy/web"),
    ],
)
def test_every_query_verb_reads_the_kept_mesh_s_namespace_without_n(
    meshlet: Callable[..., Any], kept: StandIn, argv: tuple[str, ...]
) -> None:
    """As `viz tap` and `top` do: the local mesh's namespace, not `default`."""
    run = meshlet(*argv)
    assert run.code == 0, run.err
    asked = set().union(*(_namespaces(q) for q in kept.queries))
    assert asked == {"demo"}, kept.queries
    with_n = meshlet(*argv, "-n", "shop")
    assert with_n.code == 0, with_n.err
    assert "shop" in _namespaces(kept.queries[-1]), kept.queries[-1]


def test_edges_keep_to_the_kept_mesh_s_namespace(
    meshlet: Callable[..., Any], kept: StandIn
) -> None:
    """edges keeps the rows touching the namespace: the kept mesh's edge web → api."""
    run = meshlet("viz", "edges", "deploy", "-o", "json")
    assert run.code == 0, run.err
    assert [(e["src"], e["dst"]) for e in json.loads(run.out)] == [("web", "api")]
    other = meshlet("viz", "edges", "deploy", "-n", "shop", "-o", "json")
    assert other.code == 0 and json.loads(other.out) == []


@pytest.mark.parametrize("verb", ["tap", "top"])
def test_tap_and_top_ask_for_the_same_namespace(
    meshlet: Callable[..., Any], kept: StandIn, verb: str
) -> None:
    run = meshlet("viz", verb, "deploy/web")
    assert run.code == 1 and "no meshed pods" in run.err
    assert kept.taps[-1]["namespace"] == "demo"


def test_without_a_kept_mesh_the_kubeconfig_context_s_namespace_is_the_default(
    meshlet: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for every verb: tap with --tap-addr and stat with --prometheus-url both read
    the namespace of the kubeconfig's context (as kubectl and `linkerd viz` do)."""
    from meshlet.cli.demo import supervisor

    server, seen = _stand_in()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
            "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
            "contexts: [{name: x, context: {cluster: c, user: u, namespace: shop}}]\n"
        )
        monkeypatch.setattr(supervisor, "state_root", lambda: tmp_path / "none")
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        stat = meshlet("viz", "stat", "deploy", "--prometheus-url", seen.url)
        assert stat.code == 0, stat.err
        assert _namespaces(seen.queries[-1]) == {"shop"}, seen.queries[-1]
        tap = meshlet("viz", "tap", "deploy/web", "--tap-addr", seen.url.removeprefix("http://"))
        assert tap.code == 1
        assert seen.taps[-1]["namespace"] == "shop"
    finally:
        server.shutdown()
        server.server_close()


def test_authz_reads_a_kept_local_mesh(meshlet: Callable[..., Any], kept: StandIn) -> None:
    """`meshlet authz deploy/store` on `meshlet demo --keep`: the store's Server, its
    AuthorizationPolicy and the one identity admitted, from the manifests the local mesh's
    policy controller reads; web's port has the default policy."""
    store = meshlet("authz", "deploy/store")
    assert store.code == 0, store.err
    header, *lines = store.out.splitlines()
    assert header.split() == ["PORT", "SERVER", "ROUTE", "AUTHORIZATION", "CLIENTS"]
    web = wellknown.identity_name("web", topology.NAMESPACE)
    assert [line.split(None, 4) for line in lines] == [
        [str(topology.STORE_PORT), "server/store", "-", "authorizationpolicy/store",
         f"mTLS from {web}"],
    ]  # fmt: skip
    web_pod = meshlet("authz", "pod/web-1", "-o", "json")
    assert web_pod.code == 0, web_pod.err
    assert {r["server"] for r in json.loads(web_pod.out)} == {f"default:{topology.DEFAULT_POLICY}"}
    missing = meshlet("authz", "deploy/nothing")
    assert missing.code == 1 and missing.err.count("\n") == 1
    assert "deployment demo/nothing not found in the local mesh" in missing.err


def test_with_several_kept_meshes_a_command_reads_the_one_named(
    meshlet: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two local meshes of other names kept running, none the default: a command that reads a
    local mesh does not guess (a usage error, 64, naming both and $MESHLET_DEMO); named, it reads
    that mesh's Prometheus and no other."""
    from meshlet.cli.demo import supervisor

    stand_ins = {name: _stand_in() for name in ("alpha", "beta")}
    monkeypatch.setattr(supervisor, "state_root", lambda: tmp_path / "meshlet-demo")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config: no cluster named
    try:
        for slot, (name, (_, seen)) in enumerate(stand_ins.items(), 1):
            root = tmp_path / f"meshlet-demo-{name}"
            root.mkdir()
            Record("netns", str(root), str(tmp_path / "shm"), processes={"tap": os.getpid()},
                   urls={"prometheus": seen.url, "tap": seen.url}, name=name,
                   slot=slot).save()  # fmt: skip
        run = meshlet("viz", "stat", "deploy")
        assert run.code == 64, run.err
        assert "local meshes alpha, beta run" in run.err and "MESHLET_DEMO=<name>" in run.err
        monkeypatch.setenv("MESHLET_DEMO", "beta")
        run = meshlet("viz", "stat", "deploy")
        assert run.code == 0, run.err
        assert stand_ins["beta"][1].queries and not stand_ins["alpha"][1].queries
    finally:
        for server, _ in stand_ins.values():
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("name", ["Alpha", "a_b", "-a", "a" * 21, "a/b"])
def test_a_mesh_name_that_cannot_name_a_folder_is_a_usage_error(
    meshlet: Callable[..., Any], name: str
) -> None:
    for argv in (("demo", "--name", name), ("demo", "down", "--name", name)):
        run = meshlet(*argv)
        assert run.code == 64, run
        assert "a local mesh's name is up to 20 lower-case letters" in run.err
