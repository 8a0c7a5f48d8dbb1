"""Access logs and trace context end to end: the mesh of test_authz_component.py (identity,
destination, web's replicas and the vote-bot client, each with a real proxy over mTLS). Clients
nobody here wrote (curl for HTTP/1.1, the `h2` library for HTTP/2, grpcio) call web through
vote-bot's proxy; web's apps report the header fields that reached them.

With tracing on, the collector is a real OTLP/HTTP receiver: an aiohttp server decoding each
`ExportTraceServiceRequest` with the opentelemetry-proto package the exporter comes with.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import json
import re
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from meshlet.api import wellknown
from meshlet.proxy.http import observe
from meshlet_testing.polling import eventually

_spec = importlib.util.spec_from_file_location(
    "mesh_route_filters_component", Path(__file__).with_name("test_route_filters_component.py")
)
assert _spec is not None and _spec.loader is not None
_filters = sys.modules["mesh_route_filters_component"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_filters)
BOT_ID = _filters.BOT_ID
ECHO = _filters.ECHO
FQN = _filters.FQN
GRPC_PORT = _filters.GRPC_PORT
HTTP_PORT = _filters.HTTP_PORT
PolicedMesh = _filters.PolicedMesh
PolicyFixture = _filters.PolicyFixture
start_mesh = _filters.start_mesh
curl = _filters.curl
h2_request = _filters.h2_request
seen = _filters.seen
WEB_ID = _filters._authz.WEB_ID

E = wellknown.ProxyEnv
APACHE = re.compile(
    r'(?P<addr>\S+) (?P<id>\S+) - \[(?P<ts>[0-9T:.-]+Z)\] "(?P<method>\S+) (?P<uri>\S+) '
    r'(?P<version>HTTP/[0-9.]+)" (?P<status>\d{3})'
)


class Collector:
    """An OTLP/HTTP traces receiver: every span it was sent, by span id."""

    def __init__(self) -> None:
        self.spans: dict[str, Any] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        exported = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for resource in exported.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans[span.span_id.hex()] = (resource.resource, span)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    def of_trace(self, trace_id: str) -> list[Any]:
        return [span for _, span in self.spans.values() if span.trace_id.hex() == trace_id]


class ObservedMesh(PolicedMesh):  # type: ignore[misc,valid-type]
    """vote-bot's proxy logs as json, web's as apache; every proxy exports spans."""

    collector: Collector

    def env(self, pod: Any) -> dict[str, str]:
        env: dict[str, str] = super().env(pod)
        env[E.ACCESS_LOG] = "json" if pod.name == "vote-bot" else "apache"
        env[E.TRACE_COLLECTOR_SVC_ADDR] = self.collector.url
        return env


@pytest.fixture
async def observed(capfd: Any, test_ca: Any, tmp_path: Path) -> AsyncIterator[ObservedMesh]:
    mesh = ObservedMesh(tmp_path, test_ca)
    mesh.policy = PolicyFixture()
    mesh.collector = Collector()
    await mesh.policy.start()
    await mesh.collector.start()
    try:
        await start_mesh(mesh)
        yield mesh
    finally:
        await mesh.policy.stop()
        await mesh.close()
        await mesh.collector.stop()


@pytest.fixture
async def plain(capfd: Any, test_ca: Any, tmp_path: Path) -> AsyncIterator[Any]:
    mesh = PolicedMesh(tmp_path, test_ca)
    mesh.policy = PolicyFixture()
    await mesh.policy.start()
    try:
        await start_mesh(mesh)
        yield mesh
    finally:
        await mesh.policy.stop()
        await mesh.close()


def _trace() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


async def _grpc(mesh: Any, *metadata: tuple[str, str]) -> None:
    host, port = mesh.pods["vote-bot"].outbound
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        call: Any = channel.unary_unary(ECHO)
        await call(b"hi", metadata=metadata, timeout=5)


def _access_lines(capfd: Any) -> tuple[list[dict[str, Any]], list[re.Match[str]]]:
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith('{"client.addr"')]
    return [json.loads(line) for line in lines], [
        m for line in err.splitlines() if (m := APACHE.fullmatch(line))
    ]


# -- trace context passes unchanged ----------------------------------------------------------


async def test_trace_headers_pass_unchanged_on_every_protocol_without_a_collector(
    plain: Any, capfd: Any
) -> None:
    """W3C and B3 headers, sampled, reach the app as the client sent them over HTTP/1.1,
    HTTP/2 and gRPC through both proxies; and no access log line is written."""
    trace, span = _trace()
    sent = (
        ("traceparent", f"00-{trace}-{span}-01"),
        ("tracestate", "vendor=opaque,other=1"),
        ("x-b3-traceid", trace),
        ("x-b3-spanid", span),
        ("x-b3-sampled", "1"),
        ("b3", f"{trace}-{span}-1"),
    )
    expected = {name: [value] for name, value in sent}
    assert await curl(plain, "/h1", *sent, ("X-Request", "h1")) == 200
    assert {k: v for k, v in seen(plain, "h1").items() if k in expected} == expected
    assert await h2_request(plain, "/h2", *sent, ("x-request", "h2")) == 200
    assert {k: v for k, v in seen(plain, "h2").items() if k in expected} == expected
    await _grpc(plain, *sent, ("x-request", "grpc"))
    got = seen(plain, "grpc")
    assert {k: v for k, v in got.items() if k in expected} == expected
    records, apache = _access_lines(capfd)
    assert records == [] and apache == []


async def test_no_access_log_work_when_off(plain: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, no request builds an entry or formats a line (the only cost: one check)."""
    calls: list[str] = []

    def counting(name: str, inner: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            calls.append(name)
            return inner(*args)

        return wrapped

    monkeypatch.setattr(observe.Entry, "__init__", counting("entry", observe.Entry.__init__))
    for name, formatter in list(observe.FORMATS.items()):
        monkeypatch.setitem(observe.FORMATS, name, counting(name, formatter))
    monkeypatch.setattr(observe, "apache", counting("apache", observe.apache))
    monkeypatch.setattr(observe, "json_line", counting("json", observe.json_line))
    for i in range(5):
        assert await curl(plain, f"/off/{i}") == 200
    assert calls == []
    assert all(p.proxy is not None and p.proxy.connections.observe is None
               for p in plain.pods.values())  # fmt: skip


# -- access logs and spans -------------------------------------------------------------------


async def test_sampled_requests_get_a_span_per_hop_and_every_request_a_log_line(
    observed: ObservedMesh, capfd: Any
) -> None:
    """A sampled request over HTTP/1.1, HTTP/2 and gRPC: vote-bot's proxy exports a client
    span whose parent is the caller's span, web's proxy a server span whose parent is vote-bot's,
    and the app gets web's span as its parent. vote-bot logs json, web apache (with vote-bot's
    identity, over mTLS)."""
    calls = {}
    trace, span = _trace()
    assert await curl(observed, "/h1", ("traceparent", f"00-{trace}-{span}-01"),
                      ("tracestate", "k=v"), ("X-Request", "h1"),
                      ("User-Agent", "meshlet-test/1")) == 200  # fmt: skip
    calls["h1"] = (trace, span, seen(observed, "h1"))
    trace, span = _trace()
    assert await h2_request(observed, "/h2", ("traceparent", f"00-{trace}-{span}-01"),
                            ("x-request", "h2")) == 200  # fmt: skip
    calls["h2"] = (trace, span, seen(observed, "h2"))
    trace, span = _trace()
    await _grpc(observed, ("x-b3-traceid", trace), ("x-b3-spanid", span), ("x-b3-sampled", "1"),
                ("x-request", "grpc"))  # fmt: skip
    calls["grpc"] = (trace, span, seen(observed, "grpc"))
    collector = observed.collector
    await eventually(lambda: all(len(collector.of_trace(t)) == 2 for t, _, _ in calls.values()),
                     within=5)  # fmt: skip
    for kind, (trace, span, fields) in calls.items():
        spans = {s.kind: s for s in collector.of_trace(trace)}
        client, server = spans[3], spans[2]  # SPAN_KIND_CLIENT, SPAN_KIND_SERVER
        assert client.parent_span_id.hex() == span, kind
        assert server.parent_span_id.hex() == client.span_id.hex(), kind
        assert client.name == "outbound" and server.name == "inbound"
        assert client.start_time_unix_nano <= server.start_time_unix_nano
        assert server.end_time_unix_nano <= client.end_time_unix_nano
        if kind == "grpc":
            assert fields["x-b3-spanid"] == [server.span_id.hex()]
            assert fields["x-b3-parentspanid"] == [client.span_id.hex()]
        else:
            assert fields["traceparent"] == [f"00-{trace}-{server.span_id.hex()}-01"], kind
    assert calls["h1"][2]["tracestate"] == ["k=v"]
    resource = next(iter(collector.spans.values()))[0]
    assert any(a.key == "service.name" and a.value.string_value == "meshlet-proxy"
               for a in resource.attributes)  # fmt: skip

    # An unsampled request: headers unchanged, no span.
    trace, span = _trace()
    parent = f"00-{trace}-{span}-00"
    assert await curl(observed, "/quiet", ("traceparent", parent), ("X-Request", "quiet")) == 200
    assert seen(observed, "quiet")["traceparent"] == [parent]

    async def lines() -> tuple[list[dict[str, Any]], list[re.Match[str]]]:
        records: list[dict[str, Any]] = []
        apache: list[re.Match[str]] = []
        for _ in range(50):
            got = _access_lines(capfd)
            records += got[0]
            apache += got[1]
            if len(records) >= 4 and len(apache) >= 4:
                break
            await asyncio.sleep(0.05)
        return records, apache

    records, apache = await lines()
    assert len(records) == 4 and len(apache) == 4, (records, apache)
    h1 = next(r for r in records if r["uri"].endswith("/h1"))
    assert h1["status"] == 200 and h1["method"] == "GET" and h1["version"] == "HTTP/1.1"
    assert h1["client.id"] == "-" and h1["user_agent"] == "meshlet-test/1"
    assert h1["trace_id"] == calls["h1"][0] and h1["host"] == f"{FQN}:{HTTP_PORT}"
    assert h1["response_bytes"] == str(len(b"ok")) or h1["response_bytes"].isdigit()
    assert h1["total_ns"] >= h1["processing_ns"] > 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", h1["timestamp"])
    h2 = next(r for r in records if r["uri"].endswith("/h2"))
    assert h2["version"] == "HTTP/2.0" and h2["status"] == 200
    grpc_line = next(r for r in records if "meshlet.test.Echo" in r["uri"])
    assert grpc_line["trace_id"] == calls["grpc"][0]
    assert {m["id"] for m in apache} == {BOT_ID}
    assert {m["status"] for m in apache} == {"200"}
    assert {m["uri"].rsplit("/", 1)[-1] for m in apache} >= {"h1", "h2", "quiet"}
    assert all(p.metric("access_log_dropped_total") == 0 for p in observed.pods.values())
