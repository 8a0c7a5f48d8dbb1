"""Route filters end to end: the mesh of test_authz_component.py (identity, destination, web's
replicas and the vote-bot client, each with a real proxy over mTLS), whose web proxies get, from
the policy fixture, routes whose rules carry a RequestHeaderModifier. Clients nobody here wrote
(curl for HTTP/1.1, the `h2` library for HTTP/2, grpcio) call web through vote-bot's proxy; web's
apps report the header fields that reached them."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
)
from meshlet_testing.polling import eventually

_spec = importlib.util.spec_from_file_location(
    "mesh_authz_component", Path(__file__).with_name("test_authz_component.py")
)
assert _spec is not None and _spec.loader is not None
_authz = sys.modules["mesh_authz_component"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_authz)
BOT_ID = _authz.BOT_ID
ECHO = _authz.ECHO
FQN = _authz.FQN
GRPC_PORT = _authz.GRPC_PORT
GROUP = _authz.GROUP
HTTP_PORT = _authz.HTTP_PORT
PolicedMesh = _authz.PolicedMesh
PolicyFixture = _authz.PolicyFixture
start_mesh = _authz.start_mesh


def _headers(name: str, value: bytes) -> http_types_pb2.Headers:
    return http_types_pb2.Headers(headers=[http_types_pb2.Headers.Header(name=name, value=value)])


# The tenant route's filter: what the app must see instead of what the client sent.
TENANT = http_route_pb2.RequestHeaderModifier(
    add=_headers("X-Region", b"eu"), set=_headers("X-Tenant", b"red"), remove=["x-debug"]
)
SENT = (("X-Tenant", "blue"), ("X-Debug", "1"))


def _meta(kind: str, name: str, group: str = GROUP) -> meta_pb2.Metadata:
    return meta_pb2.Metadata(resource=meta_pb2.Resource(group=group, kind=kind, name=name))


def http_server(modifier: http_route_pb2.RequestHeaderModifier, name: str) -> inbound_pb2.Server:
    """Port 8080: under /tenant/ the filtered route; anything else, a route without filters."""
    match = http_route_pb2.HttpRouteMatch
    tenant = inbound_pb2.HttpRoute(metadata=_meta("httproute", "tenant"), rules=[
        inbound_pb2.HttpRoute.Rule(
            matches=[match(path=http_route_pb2.PathMatch(prefix="/tenant"))],
            filters=[inbound_pb2.HttpRoute.Filter(request_header_modifier=modifier)])])  # fmt: skip
    everything = match(path=http_route_pb2.PathMatch(prefix="/"))
    rest = inbound_pb2.HttpRoute(
        metadata=_meta("httproute", "rest"),
        rules=[inbound_pb2.HttpRoute.Rule(matches=[everything])],
    )
    policy = _authz.server(name=name)
    policy.protocol.detect.http_routes.extend([tenant, rest])
    return policy


def grpc_server(modifier: http_route_pb2.RequestHeaderModifier) -> inbound_pb2.Server:
    """Port 8081 (gRPC): the Echo service's route carries the filter."""
    route = inbound_pb2.GrpcRoute(
        metadata=_meta("grpcroute", "echo", "gateway.networking.k8s.io"),
        rules=[inbound_pb2.GrpcRoute.Rule(
            matches=[grpc_route_pb2.GrpcRouteMatch(
                rpc=grpc_route_pb2.GrpcRpcMatch(service="meshlet.test.Echo"))],
            filters=[inbound_pb2.GrpcRoute.Filter(request_header_modifier=modifier)])],
    )  # fmt: skip
    return inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(grpc=inbound_pb2.ProxyProtocol.Grpc(routes=[route])),
        labels={"group": GROUP, "kind": "server", "name": "web-grpc"},
    )


@pytest.fixture
async def filtered(test_ca: Any, tmp_path: Path) -> AsyncIterator[PolicedMesh]:
    mesh = PolicedMesh(tmp_path, test_ca)
    mesh.policy = PolicyFixture()
    await mesh.policy.start()
    try:
        await start_mesh(mesh)
        await mesh.policy.set(8080, http_server(TENANT, "web"))
        await mesh.policy.set(8081, grpc_server(TENANT))
        await eventually(lambda: all(
            p.proxy is not None and p.proxy.policy.policies(8080).meta.name == "web"
            and p.proxy.policy.policies(8081).meta.name == "web-grpc"
            for n, p in mesh.pods.items() if n != "vote-bot"), within=3)  # fmt: skip
        yield mesh
    finally:
        await mesh.policy.stop()
        await mesh.close()


def seen(mesh: PolicedMesh, marker: str) -> dict[str, list[str]]:
    """The fields (every value of each lower-case name) of the one request that carried
    `x-request: marker`, on whichever replica it reached."""
    found = []
    for pod in mesh.pods.values():
        for head in pod.app.heads if pod.app is not None else ():
            fields: dict[str, list[str]] = {}
            for name, value in head:
                fields.setdefault(name.lower(), []).append(value)
            if fields.get("x-request") == [marker]:
                found.append(fields)
    assert len(found) == 1, (marker, found)
    return found[0]


async def curl(mesh: PolicedMesh, path: str, *headers: tuple[str, str]) -> int:
    host, port = mesh.pods["vote-bot"].outbound
    args = ["curl", "-sS", "--http1.1", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5",
            "-H", f"Host: {FQN}:{HTTP_PORT}"]  # fmt: skip
    for name, value in headers:
        args += ["-H", f"{name}: {value}"]
    proc = await asyncio.create_subprocess_exec(
        *args, f"http://{host}:{port}{path}", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    return int(out)


async def h2_request(mesh: PolicedMesh, path: str, *headers: tuple[str, str]) -> int:
    """One HTTP/2 request (prior knowledge) with `headers`; its status."""
    reader, writer = await asyncio.open_connection(*mesh.pods["vote-bot"].outbound)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":scheme", "http"),
                          (":authority", f"{FQN}:{HTTP_PORT}"), (":path", path),
                          *((n.lower(), v) for n, v in headers)], end_stream=True)  # fmt: skip
    writer.write(conn.data_to_send())
    status = 0
    try:
        while True:
            data = await reader.read(65536)
            assert data, "the proxy closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers or ())[b":status"])
                elif isinstance(event, h2.events.StreamEnded):
                    return status
            writer.write(conn.data_to_send())
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def assert_filtered(fields: dict[str, list[str]]) -> None:
    assert fields["x-tenant"] == ["red"], fields  # set: the client's value replaced
    assert fields["x-region"] == ["eu"], fields  # add
    assert "x-debug" not in fields, fields  # remove
    assert fields["meshlet-client-id"] == [BOT_ID], fields  # the proxy's, alone


def assert_untouched(fields: dict[str, list[str]]) -> None:
    assert fields["x-tenant"] == ["blue"] and fields["x-debug"] == ["1"], fields
    assert "x-region" not in fields, fields


async def test_http1_requests_on_the_filtered_route_reach_the_app_modified(
    filtered: PolicedMesh,
) -> None:
    forged = ("Meshlet-Client-Id", "admin.evil.serviceaccount.identity.meshlet.cluster.local")
    assert await curl(filtered, "/tenant/1", *SENT, forged, ("X-Request", "h1-tenant")) == 200
    assert_filtered(seen(filtered, "h1-tenant"))
    assert await curl(filtered, "/other", *SENT, ("X-Request", "h1-other")) == 200
    assert_untouched(seen(filtered, "h1-other"))


async def test_http2_requests_on_the_filtered_route_reach_the_app_modified(
    filtered: PolicedMesh,
) -> None:
    assert await h2_request(filtered, "/tenant/2", *SENT, ("x-request", "h2-tenant")) == 200
    assert_filtered(seen(filtered, "h2-tenant"))
    assert await h2_request(filtered, "/other", *SENT, ("x-request", "h2-other")) == 200
    assert_untouched(seen(filtered, "h2-other"))


async def test_grpc_metadata_is_modified_on_the_grpc_route(filtered: PolicedMesh) -> None:
    host, port = filtered.pods["vote-bot"].outbound
    options = [("grpc.default_authority", f"{FQN}:{GRPC_PORT}")]
    metadata = (("x-tenant", "blue"), ("x-debug", "1"), ("x-request", "grpc"))
    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        await channel.unary_unary(ECHO)(b"hi", metadata=metadata, timeout=5)
    assert_filtered(seen(filtered, "grpc"))


async def test_a_filter_naming_the_client_identity_is_refused_and_the_last_policy_stands(
    filtered: PolicedMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """A controller that let such a route through still cannot make a proxy apply it."""
    caplog.set_level(logging.WARNING, logger="meshlet.proxy.discovery.inbound_policy")
    forge = http_route_pb2.RequestHeaderModifier(set=_headers("meshlet-client-id", b"admin"))
    await filtered.policy.set(8080, http_server(forge, "forger"))
    await eventually(lambda: sum("'meshlet-client-id' is reserved for the proxy" in r.getMessage()
                                 for r in caplog.records) >= 3, within=3)  # fmt: skip
    assert all(p.proxy is not None and p.proxy.policy.policies(8080).meta.name == "web"
               for n, p in filtered.pods.items() if n != "vote-bot")  # fmt: skip
    assert await curl(filtered, "/tenant/3", *SENT, ("X-Request", "after")) == 200
    assert_filtered(seen(filtered, "after"))
