"""The dashboard's server on real sockets, read with aiohttp's client: what it refuses (a forged
Host header, unknown or unbounded parameters), a Prometheus that is down, the relay's bounds,
and the escaping of names that came from metric labels. With a real Prometheus, real proxies
and a real browser: cli/tests/test_viz.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

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


async def test_the_host_rule_on_raw_requests(server: WebServer) -> None:
    """What a browser never sends, as a raw client may: no Host at all (HTTP/1.0), two Hosts
    (the second one allowed), a name with a trailing dot."""

    async def first_line(request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request)
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return answer.split(b"\r\n", 1)[0]

    assert b" 403 " in await first_line(b"GET /tap HTTP/1.0\r\n\r\n")
    two = b"GET /tap HTTP/1.1\r\nHost: evil.example\r\nHost: 127.0.0.1\r\n\r\n"
    assert b" 400 " in await first_line(two)
    dot = b"GET /tap HTTP/1.1\r\nHost: localhost.\r\nConnection: close\r\n\r\n"
    assert b" 403 " in await first_line(dot)
    ok = b"GET /tap HTTP/1.1\r\nHost: 127.0.0.1:8084\r\nConnection: close\r\n\r\n"
    assert b" 200 " in await first_line(ok)


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


class StandInTap:
    """A test stand-in for the tap controller's API (the real one, against real proxies, is in
    cli/tests/test_viz.py): answers `GET /api/v1/tap` with `lines` then holds the stream open,
    or with `status` and a JSON error; records each query."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.status = 200
        self.hold = True  # False: the stream ends after `lines`, as when every proxy failed
        self.queries: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/tap", self.tap)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def tap(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(dict(request.query))
        if self.status != 200:
            return web.json_response({"type": "error", "message": "no pods"}, status=self.status)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for line in self.lines:
            await response.write(line)
        if self.hold:
            await asyncio.sleep(30)
        return response


@pytest.fixture
async def relay() -> AsyncIterator[tuple[WebServer, StandInTap]]:
    tap = StandInTap()
    await tap.start()
    config = WebConfig(LOOPBACK, LOOPBACK, "http://127.0.0.1:1", HostPort("127.0.0.1", tap.port),
                       max_relays=1, max_relay_events=3, max_relay_seconds=1.0)  # fmt: skip
    server = WebServer(config)
    await server.start()
    yield server, tap
    await server.stop()
    assert tap.runner is not None
    await tap.runner.cleanup()


async def relayed(server: WebServer, query: str) -> tuple[int, list[dict[str, object]]]:
    url = f"http://127.0.0.1:{server.port}/api/tap?{query}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        body = await asyncio.wait_for(response.read(), 10)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        return response.status, lines


async def test_the_relay_passes_lines_on_and_ends_after_its_event_limit(
    relay: tuple[WebServer, StandInTap],
) -> None:
    server, tap = relay
    tap.lines = [b'{"type": "req", "n": %d}\n' % n for n in range(5)]
    status, lines = await relayed(server, "resource=po/web-1&namespace=demo&path=/a&method=get")
    assert status == 200
    assert [line.get("n") for line in lines[:3]] == [0, 1, 2]
    assert lines[3] == {"type": "end_of_tap", "message": "3 events: tap again"} and len(lines) == 4
    assert tap.queries == [{"resource": "po/web-1", "namespace": "demo", "path": "/a",
                            "method": "GET", "max_rps": "20"}]  # fmt: skip


async def test_the_relay_ends_after_its_time_and_at_a_line_too_long(
    relay: tuple[WebServer, StandInTap],
) -> None:
    server, tap = relay
    tap.lines = [b'{"type": "req"}\n']
    status, lines = await relayed(server, "resource=po/web-1")
    assert status == 200
    assert lines == [{"type": "req"}, {"type": "end_of_tap", "message": "1s passed: tap again"}]
    tap.lines = [b"x" * (MAX_LINE + 10) + b"\n"]
    status, lines = await relayed(server, "resource=po/web-1")
    assert lines == [{"type": "end_of_tap", "message": f"a tap event of over {MAX_LINE} bytes"}]


async def test_one_relay_too_many_is_refused_and_refusals_pass_through(
    relay: tuple[WebServer, StandInTap],
) -> None:
    server, tap = relay
    tap.lines = []
    url = f"http://127.0.0.1:{server.port}/api/tap?resource=po/web-1"
    async with aiohttp.ClientSession() as session, session.get(url) as first:
        assert first.status == 200
        status, lines = await relayed(server, "resource=po/web-2")
        assert status == 429 and lines == [
            {"type": "error", "message": "1 taps are open: close one"}
        ]
    tap.status = 404
    status, lines = await relayed(server, "resource=po/web-3")
    assert status == 404 and lines == [{"type": "error", "message": "no pods"}]


DENIED = (b'{"type": "error", "proxy": "demo/web-1", "message": "PERMISSION_DENIED: '
          b'client meshlet-tap.meshlet is not authorized to tap"}\n')  # fmt: skip


async def test_a_tap_that_ends_after_errors_says_them_in_its_last_line(
    relay: tuple[WebServer, StandInTap],
) -> None:
    """The tap controller's words reach the page: the error lines, and the last line, which the
    page shows when the tap ends (it would otherwise replace the error)."""
    server, tap = relay
    tap.lines, tap.hold = [DENIED], False
    status, lines = await relayed(server, "resource=po/web-1")
    assert status == 200
    assert lines[0]["type"] == "error" and len(lines) == 2
    assert lines[1] == {
        "type": "end_of_tap",
        "message": "the tap controller ended the tap after errors: demo/web-1: PERMISSION_DENIED:"
        " client meshlet-tap.meshlet is not authorized to tap",
    }
    tap.lines = [b'{"type": "req"}\n']  # no error: the plain words
    status, lines = await relayed(server, "resource=po/web-1")
    assert lines[-1] == {"type": "end_of_tap", "message": "the tap controller ended the tap"}
