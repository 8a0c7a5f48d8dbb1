"""A local mesh of an application's own services (`meshlet.cli.mesh`): built around real
commands nobody here wrote (Python's http.server), called by curl through real proxies over
mTLS, changed by drills as a test runs, and gone without a trace afterwards."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from meshlet.cli.demo import network
from meshlet.cli.demo.supervisor import pid_runs
from meshlet.cli.mesh import spec as mesh_spec
from meshlet.cli.mesh.engine import MODE_ENV, Mesh, MeshError, Response
from meshlet_testing.unprivileged import unprivileged

# Whole meshes: make test's second lane, beside the rest (scripts/test).
pytestmark = pytest.mark.demo

FILES = mesh_spec.service(
    "files", [sys.executable, "-m", "http.server", "{port}", "--bind", "0.0.0.0"], port=8000,
    replicas=2,
)  # fmt: skip


EXAMPLE = Path(__file__).parents[3] / "examples" / "shop"
STORE = mesh_spec.service(
    "store", [sys.executable, "-m", "shop.store", "--port", "{port}"], port=9090,
    protocol="grpc", env={"PYTHONPATH": str(EXAMPLE)},
)  # fmt: skip
GRPC_CALL = str(Path(__file__).parent / "apps" / "grpc_stock.py")  # a call, as a pod's app


def timed(call: Callable[[], Response]) -> float:
    """Seconds a call took (it must succeed)."""
    started = time.monotonic()
    assert call().status == 200
    return time.monotonic() - started


def eventually(check: Callable[[], Response], want: int, within: float = 15.0) -> Response:
    """`check()` until its status is `want`; the last response."""
    deadline = time.monotonic() + within
    while True:
        got = check()
        if got.status == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def leftovers(mesh: Mesh, pids: list[int]) -> list[str]:
    """What of the mesh is still on the machine: namespaces, links, folders, processes."""
    assert mesh.layout is not None and mesh.record is not None
    place = mesh.layout.place
    found = network.existing_netns(place.netns_prefix)
    found += [link for link in (place.bridge,) if network.link_exists(link)]
    found += [p for p in (mesh.record.root, mesh.record.shm) if Path(p).exists()]
    return found + [f"pid {pid}" for pid in pids if pid_runs(pid)]


@pytest.mark.netns
def test_an_applications_services_through_the_mesh_with_drills(
    netns_available: None, tmp_path: Path
) -> None:
    spec = mesh_spec.Spec((FILES, STORE), namespace="shop")
    mesh = Mesh(spec)
    try:
        mesh.up()
        assert mesh.started_in is not None
        answer = mesh.get("files")
        assert answer.status == 200, answer
        assert "Directory listing" in answer.body
        stat = mesh.stat("deploy/files")
        assert stat.requests >= 1 and stat.success_rate == 1.0 and stat.mtls == 1.0, stat
        assert stat.peers == ("client.shop.serviceaccount.identity.meshlet.cluster.local",)
        with mesh.tap("deploy/files", path="/tapped") as tap:
            for n in range(3):
                assert mesh.get("files", f"/tapped-{n}").status == 404
            seen = tap.wait(3)
        assert sorted(r.path for r in seen) == ["/tapped-0", "/tapped-1", "/tapped-2"], seen
        assert {(r.direction, r.method, r.status, r.tls) for r in seen} == {
            ("inbound", "GET", 404, True)
        }
        assert {r.proxy for r in seen} <= {"shop/files-1", "shop/files-2"}

        mesh.fail("files", status=503)  # every replica, without touching the apps
        assert {mesh.get("files").status for _ in range(6)} == {503}
        failing = mesh.get("files")
        assert failing.body == "503 Service Unavailable (a drill)\n", failing
        assert mesh.stat("deploy/files").success_rate < 1.0
        mesh.heal("files")
        assert {mesh.get("files").status for _ in range(6)} == {200}

        mesh.kill("files-1")  # the other replica serves every call
        assert [mesh.get("files").status for _ in range(10)] == [200] * 10
        assert mesh.stat("pod/files-2").requests >= 10

        mesh.slow("files-2", "300ms")
        assert min(timed(lambda: mesh.get("files")) for _ in range(3)) >= 0.3
        mesh.heal("files-2")
        assert min(timed(lambda: mesh.get("files")) for _ in range(3)) < 0.3

        called = mesh.exec("client", sys.executable, GRPC_CALL, "store.shop:9090")
        assert called.stdout.strip() == "OK", called.stderr
        mesh.fail("store", status=503)
        called = mesh.exec("client", sys.executable, GRPC_CALL, "store.shop:9090")
        assert called.stdout.strip() == "UNAVAILABLE 503 Service Unavailable (a drill)", called
        mesh.heal("store")

        mesh.restart("destination")
        assert mesh.get("files").status == 200

        bad = tmp_path / "bad.yaml"
        bad.write_text(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: files}\n---\n"
            "apiVersion: policy.meshlet.io/v1beta3\nkind: Server\n"
            "metadata: {name: s, namespace: other}\nspec: {port: 8000}\n---\n"
            "apiVersion: meshlet.io/v1alpha1\nkind: ServiceProfile\n"
            "metadata: {name: files.shop.svc.cluster.local}\n"
            "spec: {routes: [{name: r, condition: {method: GET}, timeout: soon}]}\n"
        )
        with pytest.raises(MeshError) as refused:
            mesh.apply(bad)
        assert "document 1: apps/v1 Deployment is not a kind the mesh's controllers read" in str(
            refused.value
        )
        assert "document 2: namespace 'other' is not the mesh's (shop)" in str(refused.value)
        assert "document 3 (ServiceProfile files.shop.svc.cluster.local): " in str(refused.value)
        assert "soon" in str(refused.value)
        assert not [f for f in mesh.manifests.root.iterdir() if f.name.startswith("applied-")]

        mesh.deny("client", "files")
        denied = eventually(lambda: mesh.get("files"), 403)
        assert denied.status == 403, denied
        assert mesh.stat("deploy/files").denied >= 1
    finally:
        pids = list(mesh.record.processes.values()) if mesh.record else []
        problems = mesh.down()
    assert problems == []
    assert len(pids) == 4 + 4 + 3 - 2  # controllers, proxies, apps; less files-1, killed
    assert leftovers(mesh, pids) == []


def test_a_bad_spec_names_every_problem() -> None:
    bad = mesh_spec.Spec(
        (
            mesh_spec.service("Web", "app", port=0),
            mesh_spec.service("api", "", port=4143, replicas=0, protocol="soap"),
            mesh_spec.service("api", "app", port=80),
            mesh_spec.service("client", "app", port=80),
            mesh_spec.service("odd", "app", port=80, annotations={"example.com/x": "1"}),
        ),
        namespace="Shop",
    )
    with pytest.raises(MeshError) as caught:
        Mesh(bad)
    message = str(caught.value)
    for problem in (
        "namespace 'Shop': not a DNS label",
        "service 'Web': the name is not a DNS label",
        "service 'Web': port 0 is not 1-65535",
        "service 'api': no command",
        "service 'api': port 4143 is the proxy's own",
        "service 'api': replicas 0 is not 1-50",
        "service 'api': protocol 'soap' is not one of http, grpc, opaque",
        "service 'api': declared twice",
        "service 'client': the name is the mesh's own client pod's",
        "service 'odd': annotation 'example.com/x' is not one of meshlet's",
    ):
        assert problem in message, (problem, message)


@pytest.mark.netns
def test_asgi_and_wsgi_applications_as_services(netns_available: None) -> None:
    """FastAPI (ASGI) and a plain WSGI app, declared by their import paths, served in their
    pods by uvicorn and called through the mesh."""
    api = mesh_spec.asgi("api", "shop.web:app", port=8080, path=EXAMPLE)
    hello = mesh_spec.wsgi("hello", "hello_wsgi:app", port=8000, replicas=2,
                           path=Path(__file__).parent / "apps")  # fmt: skip
    # the Service's annotations as a user writes them: a request timeout for every route
    hello = dataclasses.replace(hello, annotations={"timeout.meshlet.io/request": "300ms"})
    with Mesh(mesh_spec.Spec((api, hello), namespace="apps")) as mesh:
        openapi = mesh.get("api", "/openapi.json")
        assert openapi.status == 200 and openapi.json()["info"]["title"] == "shop web", openapi
        answers = {mesh.get("hello", "/there").body for _ in range(8)}
        assert answers <= {"hello from hello-1 /there\n", "hello from hello-2 /there\n"}, answers
        assert mesh.stat("deploy/hello").mtls == 1.0
        mesh.slow("hello", "1s")
        late = mesh.get("hello", "/there")
        assert late.status == 504, late
        assert "timeout of 0.3s" in late.headers.get("meshlet-proxy-error", ""), late


def test_a_loopback_mesh_needs_no_privilege() -> None:
    """Without a capability, the mesh is built in loopback mode: apps call by short names
    through their proxies (curl's absolute-form requests, grpcio's CONNECT tunnels) over mTLS,
    tap and stat see them, authorization tells callers apart, and nothing is left."""
    script = Path(__file__).parent / "apps" / "unprivileged.py"
    env = {k: v for k, v in os.environ.items() if k != MODE_ENV}  # the mode as found
    run = subprocess.run(unprivileged(sys.executable, str(script), str(EXAMPLE)),
                         capture_output=True, text=True, timeout=240, check=False,
                         env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    client = "client.shop.serviceaccount.identity.meshlet.cluster.local"
    assert seen["mode"] == "loopback"
    assert seen["files"] == [200] * 4
    assert (seen["files_mtls"], seen["files_peers"]) == (1.0, [client])
    assert seen["tapped"] == [["inbound", "/tapped", 404, True]]
    assert (seen["grpc"], seen["grpc_full_name"]) == ("OK\n", "OK\n")
    assert (seen["store_mtls"], seen["store_peers"]) == (1.0, [client])
    assert "fail and slow need netns mode" in seen["fail"]
    # from its own address, the client is not the 127.0.0.1 that policies let in
    assert seen["denied"] == 403
    assert seen["down"] == []
    assert [f for f in seen["folders"] if Path(f).exists()] == []
    assert [pid for pid in seen["pids"] if pid_runs(pid)] == []
