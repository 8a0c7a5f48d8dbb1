"""The dashboard's server on real sockets, read with aiohttp's client: what it refuses (a forged
Host header, unknown or unbounded parameters), a Prometheus that is down, the relay's bounds,
and the escaping of names that came from metric labels. With a real Prometheus, real proxies
and a real browser: cli/tests/test_viz.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from meshlet.api.hostport import HostPort
from meshlet.controlplane import vizmetrics
from meshlet.controlplane.vizmetrics import Edge, StatRow
from meshlet.controlplane.web import pages
from meshlet.controlplane.web.server import MAX_LINE, MAX_QUERY_VALUE, Relay, WebConfig, WebServer

LOOPBACK = HostPort("127.0.0.1", 0)
EVIL = '<script>alert("x")</script>'


@pytest.fixture
async def server() -> AsyncIterator[WebServer]:
    # port 1 on loopback: nothing listens, so Prometheus and the tap controller are both down
    config = WebConfig(LOOPBACK, LOOPBACK, "http://127.0.0.1:1", HostPort("127.0.0.1", 1))
    web = WebServer(config)
    await web.start()
    yield web
    await web.stop()


async def get(
    web: WebServer, path: str, host: str | None = None
) -> tuple[int, str, dict[str, str]]:
    headers = {"Host": host} if host is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{web.port}{path}", headers=headers) as response,
    ):
        return response.status, await response.text(), dict(response.headers)


async def test_a_forged_host_is_refused_and_the_own_names_are_not(server: WebServer) -> None:
    for host in ("evil.example", "evil.example:8084", "localhost.evil.example", "127.0.0.1.nip.io"):
        status, body, _ = await get(server, "/tap", host)
        assert status == 403 and "Host header" in body, host
    for host in ("localhost:8084", "127.0.0.1", "[::1]:50750", "meshlet-web.meshlet.svc:8084"):
        status, _, headers = await get(server, "/tap", host)
        assert status == 200, host
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]


async def test_prometheus_down_is_a_page_that_says_so(server: WebServer) -> None:
    for path in ("/", "/namespaces/demo", "/topology", "/routes?resource=deploy/web"):
        status, body, _ = await get(server, path)
        assert status == 503, path
        assert "cannot reach Prometheus at http://127.0.0.1:1" in body
        assert "Traceback" not in body


async def test_parameters_are_known_and_bounded(server: WebServer) -> None:
    cases = {
        "/?window=forever": "window must be one of",
        "/?debug=1": "unknown parameter",
        "/?window=1m&window=1h": "given twice",
        "/namespaces/Not_A_Label": "DNS label",
        "/routes?resource=widgets/x": "unknown resource type",
        "/topology?kind=svc": "kind must be deploy or po",
        "/tap?path=no-slash": "path must start with",
        "/tap?method=BREW": "method must be one of",
        f"/tap?path=/{'a' * MAX_QUERY_VALUE}": f"over {MAX_QUERY_VALUE} characters",
        "/api/tap?namespace=demo": "resource is required",
    }
    for path, message in cases.items():
        status, body, _ = await get(server, path)
        assert status == 400 and message in body, (path, body)


async def test_the_tap_relay_says_when_the_tap_controller_is_down(server: WebServer) -> None:
    status, body, _ = await get(server, "/api/tap?resource=deploy/web&namespace=demo")
    assert status == 502 and "cannot reach the tap controller at 127.0.0.1:1" in body


async def test_static_files_are_the_two_and_no_other(server: WebServer) -> None:
    status, body, headers = await get(server, "/static/dashboard.js")
    assert (
        status == 200
        and "getReader" in body
        and headers["Content-Type"].startswith("text/javascript")
    )
    assert (await get(server, "/static/../server.py"))[0] == 404
    assert (await get(server, "/static/pages.py"))[0] == 404


def test_relay_lines_are_bounded() -> None:
    relay = Relay()
    assert relay.feed(b'{"a": 1}\n{"b"') == [b'{"a": 1}']
    assert relay.feed(b": 2}\n\n") == [b'{"b": 2}']
    with pytest.raises(ValueError, match="over"):
        relay.feed(b"x" * (MAX_LINE + 1))


def test_names_from_labels_are_escaped() -> None:
    row = StatRow("demo", EVIL, requests=3, successes=3, window=60)
    row.latency = {"p50": 1.0, "p95": 2.0, "p99": None}
    page = pages.namespace_page("demo", [row], [row], {"deployment": {}, "pod": {}}, "1m")
    edge = Edge("demo", EVIL, "demo", "server", EVIL, EVIL, True, "", 3)
    plain = Edge("demo", "a", "demo", "b", "", "", False, EVIL, 3)
    topology = pages.topology_page([edge, plain], "deploy", "demo", "1m")
    tap = pages.tap_page(EVIL, "demo", "/" + EVIL, "GET")
    for html in (page, topology, tap):
        assert "<script>alert" not in html and "&lt;script&gt;" in html
    assert topology.count('class="edge') == 2 and topology.count('class="node"') == 4


def test_idle_meshed_resources_get_a_row_and_a_count() -> None:
    rows = pages.with_idle([StatRow(None, "demo", requests=6, window=60)],
                           {(None, "demo"): 3, (None, "quiet"): 1}, 60)  # fmt: skip
    page = pages.namespaces_page(rows, {(None, "demo"): 3, (None, "quiet"): 1}, "1m")
    assert [r.name for r in rows] == ["demo", "quiet"]
    assert 'href="/namespaces/quiet?window=1m"' in page
    assert vizmetrics.meshed_query("deployment") == (
        'count(up{job="meshlet-proxy"} == 1) by (namespace, deployment)'
    )


def test_bad_flags_exit_64_with_a_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshlet.controlplane.main", "web", "--prometheus-url", "ftp://x",
         "--enforced-host", "("],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 64
    assert "--prometheus-url" in done.stderr and "--enforced-host" in done.stderr
    assert "Traceback" not in done.stderr
