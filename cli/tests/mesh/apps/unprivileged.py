"""A loopback mesh as a process without privileges builds and uses it (run by
test_engine.py under `setpriv`, every capability dropped): what it saw, as JSON on stdout."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from meshlet.cli.mesh import spec as mesh_spec
from meshlet.cli.mesh.engine import Mesh, MeshError

EXAMPLE = Path(sys.argv[1])
FILES = mesh_spec.service(
    "files", [sys.executable, "-m", "http.server", "{port}", "--bind", "{ip}"], port=8000,
    replicas=2,
)  # fmt: skip
STORE = mesh_spec.service(
    "store", [sys.executable, "-m", "shop.store", "--host", "{ip}", "--port", "{port}"],
    port=9090, protocol="grpc", env={"PYTHONPATH": str(EXAMPLE)},
)  # fmt: skip
# grpcio, as an app calls a service by its short name: with grpc_proxy from the pod's settings
GRPC_CALL = str(Path(__file__).parent / "grpc_stock.py")


def main() -> None:
    seen: dict[str, object] = {}
    mesh = Mesh(mesh_spec.Spec((FILES, STORE), namespace="shop"))
    try:
        mesh.up()
        seen["mode"] = mesh.mode.value
        seen["started_in"] = mesh.started_in
        seen["files"] = [mesh.get("files").status for _ in range(4)]
        stat = mesh.stat("deploy/files")
        seen["files_mtls"], seen["files_peers"] = stat.mtls, list(stat.peers)
        with mesh.tap("deploy/files", path="/tapped") as tap:
            mesh.get("files", "/tapped")
            seen["tapped"] = [(r.direction, r.path, r.status, r.tls) for r in tap.wait(1)]
        seen["grpc"] = mesh.exec("client", sys.executable, GRPC_CALL, "store:9090").stdout
        seen["grpc_full_name"] = mesh.exec(
            "client", sys.executable, GRPC_CALL, "store.shop.svc.cluster.local:9090"
        ).stdout
        store = mesh.stat("deploy/store")
        seen["store_mtls"], seen["store_peers"] = store.mtls, list(store.peers)
        try:
            mesh.fail("files")
        except MeshError as exc:
            seen["fail"] = str(exc)
        mesh.deny("client", "files")
        deadline = time.monotonic() + 10  # the proxies follow the controller a moment later
        while (denied := mesh.get("files").status) != 403 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["denied"] = denied
        mesh.kill("files-1")
        seen["after_kill"] = len(mesh.pods)
    finally:
        seen["pids"] = list(mesh.record.processes.values()) if mesh.record else []
        seen["folders"] = [mesh.record.root, mesh.record.shm] if mesh.record else []
        seen["down"] = mesh.down()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
