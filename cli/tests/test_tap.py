"""`meshlet viz tap` against the tap controller (a process) and test fixture Tap servers."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli.tap import render
from meshlet_testing.tapfixture import Controller, fixture_proxies, start_controller


@pytest.fixture
def controller(test_ca: Any, tmp_path: Path) -> Iterator[Controller]:
    ctl = start_controller(test_ca, tmp_path, wellknown.TAP_SERVICE_NAME)
    yield ctl
    ctl.proc.terminate()
    ctl.proc.communicate(timeout=10)


@pytest.fixture
async def proxies(test_ca: Any, tmp_path: Path, controller: Controller) -> AsyncIterator[None]:
    servers = await fixture_proxies(test_ca, tmp_path, controller.proxy_port)
    yield
    for server in servers:
        await server.stop()


async def tap_lines(controller: Controller, count: int, *args: str) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshlet.cli.main", "viz", "tap", *args,
        "--tap-addr", f"127.0.0.1:{controller.port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        return [
            (await asyncio.wait_for(proc.stdout.readline(), 10)).decode().rstrip("\n")
            for _ in range(count)
        ]
    finally:
        proc.terminate()
        await proc.wait()


async def test_the_requests_of_a_pod_as_linkerd_prints_them(
    controller: Controller, proxies: None
) -> None:
    lines = await tap_lines(controller, 3, "pod/web-5d8f7-b", "-n", "emojivoto")
    assert lines == [
        "req id=7:3 proxy=in  src=10.1.0.9:41003 dst=10.1.0.5:8080 tls=true :method=GET"
        " :authority=web.emojivoto.svc.cluster.local :path=/api/list",
        "rsp id=7:3 proxy=in  src=10.1.0.9:41003 dst=10.1.0.5:8080 tls=true :status=200"
        " latency=1500µs",
        "end id=7:3 proxy=in  src=10.1.0.9:41003 dst=10.1.0.5:8080 tls=true duration=2000µs"
        " response-length=42B",
    ]


async def test_json_wide_and_filters(controller: Controller, proxies: None) -> None:
    lines = await tap_lines(
        controller, 3, "deploy/web", "-n", "emojivoto", "--path", "/health", "-o", "json"
    )
    events = [json.loads(line) for line in lines]
    assert [(e["type"], e["id"], e["proxy"]) for e in events] == [
        ("req", "7:2", "emojivoto/web-5d8f7-a"),
        ("rsp", "7:2", "emojivoto/web-5d8f7-a"),
        ("end", "7:2", "emojivoto/web-5d8f7-a"),
    ]
    assert events[1]["status"] == 200
    (wide,) = await tap_lines(controller, 1, "pod/web-5d8f7-b", "-n", "emojivoto", "-o", "wide")
    assert wide.endswith(
        " src_res=deploy/vote-bot src_ns=emojivoto dst_res=deploy/web dst_ns=emojivoto"
    )


async def test_errors_are_one_line_and_exit_1(controller: Controller, meshlet: Any) -> None:
    addr = f"127.0.0.1:{controller.port}"
    run = await asyncio.to_thread(meshlet, "viz", "tap", "svc/web", "--tap-addr", addr)
    assert run.code == 1
    assert run.err == (
        "Error: the tap controller refused the tap (400): invalid resource 'svc/web':"
        f" 'svc' is not one of deploy, pod, ns [{addr}]\n"
    )
    run = await asyncio.to_thread(meshlet, "viz", "tap", "deploy/web", "--tap-addr", "127.0.0.1:1")
    assert run.code == 1 and run.err.count("\n") == 1
    assert run.err.startswith("Error: cannot reach the tap controller at 127.0.0.1:1:")


def test_render_says_how_a_grpc_stream_ended_and_what_was_dropped() -> None:
    event = {"type": "end", "id": "1:2", "direction": "outbound", "src": "a:1", "dst": "b:2",
             "tls": "", "duration": 0.25, "bytes": 7, "grpc_status_code": 14,
             "dropped_before": 3}  # fmt: skip
    assert render(event) == (
        "(3 requests dropped past --max-rps)\n"
        "end id=1:2 proxy=out src=a:1 dst=b:2 tls=no duration=250000µs response-length=7B"
        " grpc-status=14"
    )
    assert render({"type": "error", "proxy": "ns/p", "message": "UNAVAILABLE: x"}) == (
        "error proxy=ns/p UNAVAILABLE: x"
    )


TAP_POD, TAP_IP = "meshlet-tap-6b7c8d9f5-q1w2e", "10.42.0.88"


def tap_pod(api: Any, controller: Controller) -> None:
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "meshlet"}})
    api.apply({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": TAP_POD, "namespace": "meshlet",
                     "labels": {wellknown.CONTROL_PLANE_COMPONENT_LABEL: "tap"}},
        "spec": {"containers": [{"name": "tap", "image": "meshlet/controller"}]},
        "status": {"phase": "Running", "podIP": TAP_IP,
                   "conditions": [{"type": "Ready", "status": "True"}]},
    })  # fmt: skip
    api.expose(TAP_IP, wellknown.TAP_PORT, ("127.0.0.1", controller.port))


def test_through_a_port_forward_to_the_tap_pod(emojivoto: Any, controller: Controller) -> None:
    tap_pod(emojivoto.api, controller)
    refused = emojivoto.run("viz", "tap", "deploy/nothing", "-n", "emojivoto")
    assert refused.code == 1
    assert refused.err == (
        "Error: the tap controller refused the tap (404): no running meshed pods of"
        f" deployment/nothing in emojivoto [meshlet/{TAP_POD}:8088 (port-forward)]\n"
    )
    # No proxy listens for pod web-5d8f7-a: its stream fails, the tap ends with it.
    run = emojivoto.run("viz", "tap", "pod/web-5d8f7-a", "-n", "emojivoto")
    assert run.code == 0, run.err
    assert run.out.startswith("error proxy=emojivoto/web-5d8f7-a UNAVAILABLE: ")
    forwarded = [p for _, p in emojivoto.api.requests if "/portforward" in p]
    assert forwarded[-1] == f"/api/v1/namespaces/meshlet/pods/{TAP_POD}/portforward?ports=8088"


async def test_top_counts_the_tapped_requests_by_path(
    controller: Controller, proxies: None
) -> None:
    """`meshlet viz top` over the controller's real stream (a process, no terminal: the table
    once at the end of --duration)."""
    addr = f"127.0.0.1:{controller.port}"
    argv = [sys.executable, "-m", "meshlet.cli.main", "viz", "top", "deploy/web", "-n",
            "emojivoto", "--tap-addr", addr, "--duration", "2"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*argv, "-o", "json", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err
    rows = {(r["destination"], r["path"]): r for r in json.loads(out)}
    assert set(rows) == {("web-5d8f7-a", "/api/list"), ("web-5d8f7-a", "/health"),
                         ("web-5d8f7-b", "/api/list")}  # fmt: skip
    for row in rows.values():
        assert row["source"] == "vote-bot-1" and row["method"] == "GET"
        assert row["count"] == 1 and row["success"] == 1.0 and row["last"] == 0.0015
    proc = await asyncio.create_subprocess_exec(*argv, "--hide-sources",
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err
    header, *lines = out.decode().splitlines()
    assert header.split() == ["DESTINATION", "METHOD", "PATH", "COUNT", "BEST", "WORST", "LAST",
                              "SUCCESS"]  # fmt: skip
    assert sorted(line.split()[:5] for line in lines) == [
        ["web-5d8f7-a", "GET", "/api/list", "1", "1.5ms"],
        ["web-5d8f7-a", "GET", "/health", "1", "1.5ms"],
        ["web-5d8f7-b", "GET", "/api/list", "1", "1.5ms"],
    ]


async def test_top_says_why_it_could_not_tap(controller: Controller, meshlet: Any) -> None:
    addr = f"127.0.0.1:{controller.port}"
    run = await asyncio.to_thread(meshlet, "viz", "top", "svc/web", "--tap-addr", addr)
    assert run.code == 1 and "Traceback" not in run.err
    assert run.err.startswith("Error: the tap controller refused the tap (400): invalid resource")
