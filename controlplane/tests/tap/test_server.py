"""The tap controller as a process, against test fixture Tap servers (real gRPC over mutual
TLS, canned events) standing for two pods' proxies, read with aiohttp's client and by
`meshlet viz tap`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from meshlet.api import wellknown
from meshlet_testing.tapfixture import (
    WEB,
    Controller,
    FixtureTapServer,
    canned,
    fixture_proxies,
    start_controller,
)


@pytest.fixture
def controller(test_ca: Any, tmp_path: Path) -> Iterator[Controller]:
    ctl = start_controller(test_ca, tmp_path, wellknown.TAP_SERVICE_NAME, "--max-taps", "2")
    yield ctl
    ctl.proc.terminate()
    _, err = ctl.proc.communicate(timeout=10)
    assert ctl.proc.returncode == 0, err


@pytest.fixture
async def proxies(
    test_ca: Any, tmp_path: Path, controller: Controller
) -> AsyncIterator[list[FixtureTapServer]]:
    servers = await fixture_proxies(test_ca, tmp_path, controller.proxy_port)
    yield servers
    for server in servers:
        await server.stop()


async def read_lines(url: str, count: int) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"] == "application/x-ndjson"
        lines = []
        while len(lines) < count:
            line = await asyncio.wait_for(response.content.readline(), 5)
            lines.append(json.loads(line))
        return lines


async def test_a_deployments_proxies_merge_into_one_stream_of_json_lines(
    controller: Controller, proxies: list[FixtureTapServer]
) -> None:
    lines = await read_lines(controller.url(resource="deploy/web", namespace="emojivoto"), 9)
    assert {line["proxy"] for line in lines} == {"emojivoto/web-5d8f7-a", "emojivoto/web-5d8f7-b"}
    assert sorted(line["type"] for line in lines) == ["end"] * 3 + ["req"] * 3 + ["rsp"] * 3
    req = next(line for line in lines if line["type"] == "req" and line["id"] == "7:3")
    assert req | {"src_labels": None, "dst_labels": None} == {
        "type": "req",
        "proxy": "emojivoto/web-5d8f7-b",
        "id": "7:3",
        "direction": "inbound",
        "src": "10.1.0.9:41003",
        "dst": "10.1.0.5:8080",
        "tls": "true",
        "method": "GET",
        "authority": "web.emojivoto.svc.cluster.local",
        "path": "/api/list",
        "src_labels": None,
        "dst_labels": None,
    }
    end = next(line for line in lines if line["type"] == "end" and line["id"] == "7:1")
    assert (end["duration"], end["bytes"]) == (0.002, 42)


async def test_filters_reach_the_proxies_and_are_checked_again(
    controller: Controller, proxies: list[FixtureTapServer]
) -> None:
    url = controller.url(
        resource="pod/web-5d8f7-a", namespace="emojivoto", path="/health", method="GET"
    )
    lines = await read_lines(url, 3)
    assert [(line["type"], line["id"]) for line in lines] == [
        ("req", "7:2"),
        ("rsp", "7:2"),
        ("end", "7:2"),
    ]
    asked = proxies[0].asked[-1].match.all.matches
    assert asked[0].http.method.registered == 0
    assert asked[1].http.path.prefix == "/health"
    assert proxies[1].asked == []  # pod/web-5d8f7-a only


async def test_max_rps_passes_whole_requests_and_counts_the_rest(
    controller: Controller, proxies: list[FixtureTapServer]
) -> None:
    url = controller.url(resource="pod/web-5d8f7-a", namespace="emojivoto", max_rps="1")
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        lines = [
            json.loads(await asyncio.wait_for(response.content.readline(), 5)) for _ in range(3)
        ]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.content.readline(), 0.5)
    assert [(line["type"], line["id"]) for line in lines] == [
        ("req", "7:1"),
        ("rsp", "7:1"),
        ("end", "7:1"),
    ]
    metrics = await admin_metrics(controller)
    assert 'tap_events_total{result="dropped"} 3.0' in metrics  # 7:2's req, rsp and end


async def admin_metrics(controller: Controller) -> str:
    url = f"http://127.0.0.1:{controller.admin}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def test_concurrent_taps_past_the_maximum_are_refused_and_a_closed_tap_frees_its_slot(
    controller: Controller, proxies: list[FixtureTapServer]
) -> None:
    url = controller.url(resource="deploy/web", namespace="emojivoto")
    async with aiohttp.ClientSession() as session:
        first, second = await session.get(url), await session.get(url)
        assert (first.status, second.status) == (200, 200)
        async with session.get(url) as third:
            assert third.status == 429
            assert (await third.json())["message"] == (
                "the tap controller runs its maximum of 2 concurrent taps"
            )
        first.close()
        for _ in range(50):
            async with session.get(url) as again:
                if again.status == 200:
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("a closed tap never freed its slot")
        second.close()


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        ({"resource": "svc/web"}, 400, "'svc' is not one of deploy, pod, ns"),
        ({"resource": "deploy/web", "max_rps": "0"}, 400, "max_rps '0' must be a number"),
        ({"resource": "deploy/web", "path": "api"}, 400, "path 'api' must start with /"),
        (
            {"resource": "deploy/nothing", "namespace": "emojivoto"},
            404,
            "no running meshed pods of deployment/nothing in emojivoto",
        ),
    ],
)
async def test_bad_taps_get_one_line_of_why(
    controller: Controller, query: dict[str, str], status: int, message: str
) -> None:
    async with aiohttp.ClientSession() as session, session.get(controller.url(**query)) as r:
        assert r.status == status
        assert message in (await r.json())["message"]


async def test_a_proxy_refuses_a_tap_from_an_identity_that_is_not_the_tap_controllers(
    test_ca: Any, tmp_path: Path
) -> None:
    ctl = start_controller(test_ca, tmp_path, wellknown.identity_name("web", "emojivoto"))
    servers = await fixture_proxies(test_ca, tmp_path, ctl.proxy_port)
    try:
        lines = await read_lines(ctl.url(resource="deploy/web", namespace="emojivoto"), 2)
        assert {line["type"] for line in lines} == {"error"}
        assert all(line["message"].startswith("PERMISSION_DENIED") for line in lines)
        assert servers[0].refused[0].split(",")[0] == WEB
        assert servers[0].asked == []
    finally:
        for server in servers:
            await server.stop()
        ctl.proc.terminate()
        ctl.proc.communicate(timeout=10)


async def test_a_proxy_with_another_pods_identity_is_not_read(
    test_ca: Any, tmp_path: Path, controller: Controller
) -> None:
    impostors = await fixture_proxies(
        test_ca, tmp_path, controller.proxy_port, wellknown.identity_name("db", "emojivoto")
    )
    try:
        lines = await read_lines(controller.url(resource="deploy/web", namespace="emojivoto"), 2)
        assert {line["type"] for line in lines} == {"error"}
        assert all(
            line["message"].startswith("UNAVAILABLE") and WEB in line["message"] for line in lines
        ), lines
        assert impostors[0].asked == []
    finally:
        for server in impostors:
            await server.stop()


async def test_to_keeps_the_outbound_requests_to_that_resource(
    test_ca: Any, tmp_path: Path, controller: Controller
) -> None:
    second = canned(3, pod="web-5d8f7-b") + canned(4, pod="web-5d8f7-b", to="voting")
    second += canned(5, pod="web-5d8f7-b", to="emoji")
    servers = await fixture_proxies(test_ca, tmp_path, controller.proxy_port, second=second)
    try:
        url = controller.url(resource="deploy/web", namespace="emojivoto", to="deploy/voting")
        lines = await read_lines(url, 3)
        assert [(line["type"], line["id"], line["direction"]) for line in lines] == [
            ("req", "7:4", "outbound"),
            ("rsp", "7:4", "outbound"),
            ("end", "7:4", "outbound"),
        ]
        assert lines[0]["dst_labels"]["deployment"] == "voting"
    finally:
        for server in servers:
            await server.stop()


async def test_a_proxys_stream_that_ends_is_opened_again(
    controller: Controller, proxies: list[FixtureTapServer]
) -> None:
    proxies[1].hold = False
    lines = await read_lines(controller.url(resource="pod/web-5d8f7-b", namespace="emojivoto"), 6)
    assert [line["id"] for line in lines] == ["7:3"] * 6
    # Opened twice for the six lines, and maybe a third time already: a stream that delivered
    # events is opened again at once.
    assert len(proxies[1].asked) >= 2
    assert len({str(ask) for ask in proxies[1].asked}) == 1  # the same request each time


async def test_pods_from_the_kubernetes_api(test_ca: Any, tmp_path: Path) -> None:
    from kubernetes import client as k8s_client

    from meshlet.api.hostport import HostPort
    from meshlet.controlplane.k8s.informer import KubernetesSource
    from meshlet.controlplane.k8s.objects import pod
    from meshlet.controlplane.tap.server import TAP_KINDS, TapConfig, TapServer
    from meshlet_testing.fakeapi import RESOURCES, FakeKubeAPI
    from meshlet_testing.tapfixture import free_port

    cert, key = test_ca.serving_cert(wellknown.TAP_SERVICE_NAME, tmp_path / "tap")
    proxy_port = free_port()
    servers = await fixture_proxies(test_ca, tmp_path, proxy_port)
    with FakeKubeAPI(resources=RESOURCES) as api:
        api.apply(pod("web-5d8f7-b", "127.0.0.2", owner=("ReplicaSet", "web-5d8f7")))
        source = KubernetesSource(
            k8s_client.ApiClient(api.client_configuration()), kinds=TAP_KINDS, watch_timeout=5
        )
        config = TapConfig(
            addr=HostPort("127.0.0.1", 0), admin_addr=HostPort("127.0.0.1", 0), source=source,
            tls=(cert, key), trust_anchors=test_ca.anchors_path, proxy_port=proxy_port,
        )  # fmt: skip
        srv = TapServer(config)
        await srv.start()
        try:
            for _ in range(100):
                if srv.ready():
                    break
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{srv.port}/api/v1/tap?resource=deploy/web&namespace=emojivoto"
            lines = await read_lines(url, 3)
            assert {line["proxy"] for line in lines} == {"emojivoto/web-5d8f7-b"}
        finally:
            await srv.stop()
            for server in servers:
                await server.stop()


def test_a_bad_configuration_names_every_problem_and_exits_64(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    proc = subprocess.run(
        [sys.executable, "-m", "meshlet.controlplane.main", "tap", "--manifests", str(tmp_path),
         "--tls-cert", str(bad), "--tls-key", str(bad), "--max-taps", "0"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 64
    assert "--max-taps" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "meshlet.controlplane.main", "tap", "--manifests", str(tmp_path),
         "--tls-cert", str(bad), "--tls-key", str(bad)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 64
    assert "--trust-anchors is required" in proc.stderr
    assert "--tls-cert/--tls-key: not a usable certificate and key" in proc.stderr
