"""Tap end to end: the mesh of test_component.py (identity from a real identity service, web's
replicas and the vote-bot client, each with a real proxy over mTLS). A grpcio client holding a
certificate for the tap controller's identity (issued by the mesh's test CA) calls
`io.linkerd.proxy.tap.Tap/Observe` on vote-bot's control port while curl (HTTP/1.1), the `h2`
library (HTTP/2) and grpcio (gRPC) call web through that proxy."""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlet.api import tap_pb2, wellknown
from meshlet_testing.polling import eventually

_spec = importlib.util.spec_from_file_location(
    "mesh_component", Path(__file__).with_name("test_component.py")
)
assert _spec is not None and _spec.loader is not None
_mesh = sys.modules["mesh_component"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mesh)
mesh = _mesh.mesh  # the fixture
BOT_ID, WEB_ID, FQN = _mesh.BOT_ID, _mesh.WEB_ID, _mesh.FQN
HTTP_PORT, GRPC_PORT, ECHO = _mesh.HTTP_PORT, _mesh.GRPC_PORT, _mesh.ECHO
TAP_ID = wellknown.identity_name(wellknown.TAP_NAME, wellknown.CONTROL_PLANE_NAMESPACE)
OBSERVE = "/io.linkerd.proxy.tap.Tap/Observe"

Match = tap_pb2.ObserveRequest.Match
Extract = tap_pb2.ObserveRequest.Extract


def observe(channel: grpc.aio.Channel, request: tap_pb2.ObserveRequest) -> Any:
    call = channel.unary_stream(
        OBSERVE, request_serializer=tap_pb2.ObserveRequest.SerializeToString,
        response_deserializer=tap_pb2.TapEvent.FromString,
    )  # fmt: skip
    return call(request)


def tap_channel(m: Any, pod: str, identity: str) -> grpc.aio.Channel:
    """mTLS to `pod`'s control port, as `identity`, verifying the proxy's own identity."""
    chain, key = m.test_ca.serving_cert(identity, m.root / "tap" / identity)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=m.test_ca.anchors_pem.encode(),
        private_key=key.read_bytes(), certificate_chain=chain.read_bytes(),
    )  # fmt: skip
    target = m.pods[pod].ip, wellknown.PROXY_CONTROL_PORT
    server_id = wellknown.identity_name(_mesh.TOKENS[m.pods[pod].token], _mesh.NS)
    options = [("grpc.ssl_target_name_override", server_id)]
    return grpc.aio.secure_channel(f"{target[0]}:{target[1]}", credentials, options=options)


async def taps_open(m: Any, pod: str, count: int) -> None:
    await eventually(lambda: m.pods[pod].metric("tap_open") == count)


async def curl(*args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", "10", *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    return out


async def collect(call: Any, into: list[Any]) -> None:
    async for event in call:
        into.append(event)


@pytest.fixture
async def tapper(mesh: Any) -> AsyncIterator[grpc.aio.Channel]:
    async with tap_channel(mesh, "vote-bot", TAP_ID) as channel:
        yield channel


async def test_tap_sees_http1_http2_and_grpc_with_both_identities(
    mesh: Any, tapper: grpc.aio.Channel
) -> None:
    bot = mesh.pods["vote-bot"]
    with_headers = tap_pb2.ObserveRequest(
        limit=3, extract=Extract(http=Extract.Http(headers=Extract.Http.Headers()))
    )
    headed: list[Any] = []
    plain: list[Any] = []
    tasks = [
        asyncio.create_task(collect(observe(tapper, with_headers), headed)),
        asyncio.create_task(collect(observe(tapper, tap_pb2.ObserveRequest(limit=3)), plain)),
    ]
    await taps_open(mesh, "vote-bot", 2)
    host, port = bot.outbound
    curled = await curl("-H", f"Host: {FQN}:{HTTP_PORT}", f"http://{host}:{port}/curl")
    status, h2_body = await _mesh.h2_get(bot.outbound, f"{FQN}:{HTTP_PORT}")
    assert status == 200
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        echoed = await channel.unary_unary(ECHO)(b"x", timeout=5)
    async with asyncio.timeout(10):  # the limit (3 requests) ends both streams
        await asyncio.gather(*tasks)
    await taps_open(mesh, "vote-bot", 0)

    kinds = [e.http.WhichOneof("event") for e in plain]
    assert kinds.count("request_init") == 3 and kinds.count("response_end") == 3
    inits = [e.http.request_init for e in plain if e.http.HasField("request_init")]
    assert [i.path for i in inits] == ["/curl", "/", ECHO]
    assert {i.authority for i in inits} == {f"{FQN}:{HTTP_PORT}", f"{FQN}:{GRPC_PORT}"}
    assert all(not i.HasField("headers") for i in inits)
    assert len({i.id.stream for i in inits}) == 3 and len({i.id.base for i in inits}) == 1
    for event in plain:
        assert event.proxy_direction == tap_pb2.TapEvent.OUTBOUND
        assert event.source_meta.labels["client_id"] == BOT_ID
        assert event.destination_meta.labels["server_id"] == WEB_ID
        assert event.destination_meta.labels["tls"] == "true"
        assert str(ipaddress.IPv4Address(event.destination.ip.ipv4)) in _mesh.REPLICAS.values()
        assert str(ipaddress.IPv4Address(event.source.ip.ipv4)) == "127.0.0.1"
    # where each request went: the app's port on the replica, not its proxy's inbound port
    ports = [e.destination.port for e in plain if e.http.HasField("request_init")]
    assert ports == [8080, 8080, 8081]
    assert event.destination_meta.labels["pod"] in _mesh.REPLICAS
    ends = [e.http.response_end for e in plain if e.http.HasField("response_end")]
    # the response bodies' bytes (gRPC's: its one message, framed in 5 bytes)
    assert [end.response_bytes for end in ends] == [len(curled), len(h2_body), 5 + len(echoed)]
    assert ends[2].eos.grpc_status_code == 0 and ends[2].eos.WhichOneof("end") == "grpc_status_code"
    heads = [e.http.response_init for e in plain if e.http.HasField("response_init")]
    assert [h.http_status for h in heads] == [200, 200, 200]

    asked = [e.http.request_init for e in headed if e.http.HasField("request_init")]
    names = {h.name.lower() for h in asked[0].headers.headers}
    assert "user-agent" in names  # curl's
    assert b"curl" in dict((h.name.lower(), h.value) for h in asked[0].headers.headers)[
        "user-agent"]  # fmt: skip


async def test_another_identity_is_refused(mesh: Any) -> None:
    bot = mesh.pods["vote-bot"]
    async with tap_channel(mesh, "vote-bot", BOT_ID) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in observe(channel, tap_pb2.ObserveRequest(limit=1)):
                pass
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == f"{BOT_ID} may not tap this proxy"
    assert bot.metric("tap_refused_total", reason="identity") == 1
    credentials = grpc.ssl_channel_credentials(root_certificates=mesh.test_ca.anchors_pem.encode())
    ip = mesh.pods["vote-bot"].ip
    options = [("grpc.ssl_target_name_override", BOT_ID)]
    async with grpc.aio.secure_channel(
        f"{ip}:{wellknown.PROXY_CONTROL_PORT}", credentials, options=options
    ) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            async for _ in observe(channel, tap_pb2.ObserveRequest(limit=1)):
                pass
    # no client certificate: the TLS handshake fails (the proxy requires one), so grpcio
    # never gets a connection to send its call on
    assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
    await eventually(lambda: bot.metric("tap_refused_total", reason="handshake") >= 1)
    assert bot.metric("tap_open") == 0


async def test_a_busy_proxy_bounds_its_tap_and_answers_every_request(
    mesh: Any, tapper: grpc.aio.Channel
) -> None:
    bot = mesh.pods["vote-bot"]
    events: list[Any] = []
    call = observe(tapper, tap_pb2.ObserveRequest(limit=10_000))
    task = asyncio.create_task(collect(call, events))
    await taps_open(mesh, "vote-bot", 1)
    statuses: list[int] = []

    async def client(n: int) -> None:
        c = await _mesh.H1Client.connect(bot.outbound)
        try:
            for _ in range(n):
                statuses.append((await c.get(f"{FQN}:{HTTP_PORT}"))[0])
        finally:
            await c.close()

    await asyncio.gather(*(client(500) for _ in range(4)))
    assert statuses == [200] * 2000
    dropped = bot.metric("tap_events_dropped_total")
    assert dropped > 0
    await eventually(lambda: len(events) >= 3)
    call.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await taps_open(mesh, "vote-bot", 0)
    taken = sum(1 for e in events if e.http.HasField("request_init"))
    assert 0 < taken < 2000
    assert taken * 3 + dropped >= 2000 * 3 - 3 * 4  # what was not sent was counted


async def test_past_the_most_taps_a_call_is_refused(mesh: Any, tapper: grpc.aio.Channel) -> None:
    from meshlet.proxy.tap.taps import DEFAULT_MAX_TAPS

    calls = [observe(tapper, tap_pb2.ObserveRequest(limit=1)) for _ in range(DEFAULT_MAX_TAPS)]
    tasks = [asyncio.create_task(collect(call, [])) for call in calls]
    await taps_open(mesh, "vote-bot", DEFAULT_MAX_TAPS)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in observe(tapper, tap_pb2.ObserveRequest(limit=1)):
            pass
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await taps_open(mesh, "vote-bot", 0)
