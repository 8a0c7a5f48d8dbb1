"""The tap controller against real proxies: the mesh of test_component.py (identity from a real
identity service, web's replicas and the vote-bot client, each with a real proxy serving
`Tap/Observe` on its control port over mTLS), the controller reading the same manifests folder
as the destination service, and `meshlet viz tap` (a process) reading the controller while curl
calls web through vote-bot's proxy."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.k8s.manifests import ManifestsSource
from meshlet.controlplane.tap.server import TAP_KINDS, TapConfig, TapServer
from meshlet_testing.polling import eventually

_spec = importlib.util.spec_from_file_location(
    "mesh_component", Path(__file__).with_name("test_component.py")
)
assert _spec is not None and _spec.loader is not None
_mesh = sys.modules["mesh_component"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mesh)
mesh = _mesh.mesh  # the fixture
FQN, HTTP_PORT, NS = _mesh.FQN, _mesh.HTTP_PORT, _mesh.NS


async def start_controller(m: Any, identity: str) -> TapServer:
    cert, key = m.test_ca.serving_cert(identity, m.root / "tap" / identity)
    config = TapConfig(
        addr=HostPort("127.0.0.1", 0), admin_addr=HostPort("127.0.0.1", 0),
        source=ManifestsSource(m.manifests, kinds=TAP_KINDS, poll_interval=0.2),
        tls=(cert, key), trust_anchors=m.test_ca.anchors_path,
    )  # fmt: skip
    server = TapServer(config)
    await server.start()
    await eventually(server.ready)
    return server


async def viz_tap(server: TapServer, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshlet.cli.main", "viz", "tap", *args, "-n", NS,
        "--tap-addr", f"127.0.0.1:{server.port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def curl(host: str, port: int, path: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "5", "-o", "/dev/null", "-H", f"Host: {FQN}:{HTTP_PORT}",
        f"http://{host}:{port}{path}",
    )  # fmt: skip
    assert await proc.wait() == 0


async def test_viz_tap_shows_the_requests_of_a_real_proxy(mesh: Any) -> None:
    server = await start_controller(mesh, wellknown.TAP_SERVICE_NAME)
    tap = await viz_tap(server, "pod/vote-bot", "--path", "/tapped", "-o", "json")
    assert tap.stdout is not None
    try:
        await eventually(lambda: mesh.pods["vote-bot"].metric("tap_open") == 1)
        host, port = mesh.pods["vote-bot"].outbound
        await curl(host, port, "/untapped")
        await curl(host, port, "/tapped")
        lines = [json.loads(await asyncio.wait_for(tap.stdout.readline(), 10)) for _ in range(3)]
    finally:
        tap.terminate()
        await tap.wait()
        await server.stop()
    assert [line["type"] for line in lines] == ["req", "rsp", "end"]
    req, rsp, end = lines
    assert (req["proxy"], req["direction"], req["method"], req["path"]) == (
        f"{NS}/vote-bot", "outbound", "GET", "/tapped",
    )  # fmt: skip
    assert req["authority"] == f"{FQN}:{HTTP_PORT}" and req["tls"] == "true"
    assert req["dst_labels"]["server_id"] == _mesh.WEB_ID
    assert rsp["status"] == 200 and rsp["latency"] > 0
    assert isinstance(end["bytes"], int) and len({req["id"], rsp["id"], end["id"]}) == 1


async def test_a_controller_without_the_tap_identity_is_refused_by_real_proxies(
    mesh: Any,
) -> None:
    server = await start_controller(mesh, _mesh.BOT_ID)
    tap = await viz_tap(server, "pod/vote-bot")
    assert tap.stdout is not None
    try:
        line = (await asyncio.wait_for(tap.stdout.readline(), 10)).decode()
    finally:
        tap.terminate()
        await tap.wait()
        await server.stop()
    assert line.startswith(f"error proxy={NS}/vote-bot PERMISSION_DENIED")
