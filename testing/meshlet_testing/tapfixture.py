"""A test fixture, not a proxy: a real gRPC server of `io.linkerd.proxy.tap.Tap/Observe` over
mutual TLS that answers only a client proving `allowed` (as a proxy's tap server does) with
canned events, the ones `canned` builds. It stands in for the proxy's tap server where a test
needs many proxies or exact events; the proxy's own is tested against the controller too."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from meshlet.api import http_types_pb2, net_pb2, tap_pb2, wellknown
from meshlet.controlplane.k8s.manifests import ManifestsFolder
from meshlet.controlplane.k8s.objects import pod
from meshlet_testing.sockets import free_port

SERVICE = "io.linkerd.proxy.tap.Tap"
WEB = wellknown.identity_name("web", "emojivoto")  # the fixture pods' identity


def tcp(address: str, port: int) -> net_pb2.TcpAddress:
    return net_pb2.TcpAddress(
        ip=net_pb2.IPAddress(ipv4=int(ipaddress.IPv4Address(address))), port=port
    )


def canned(
    stream: int,
    path: str = "/api/list",
    method: int = 0,
    pod: str = "web-1",
    status: int = 200,
    to: str = "",
) -> list[tap_pb2.TapEvent]:
    """req, rsp and end of one inbound request `stream` to `pod` from the `vote-bot` pod, or,
    with `to`, of an outbound request from `pod` to deployment `to`'s pod `<to>-1`."""
    Http = tap_pb2.TapEvent.Http
    sid = Http.StreamId(base=7, stream=stream)
    common: dict[str, Any] = {
        "source": tcp("10.1.0.9", 41000 + stream),
        "destination": tcp("10.1.0.5", 8080),
        "source_meta": tap_pb2.TapEvent.EndpointMeta(
            labels={
                "tls": "true",
                "namespace": "emojivoto",
                "pod": "vote-bot-1",
                "deployment": "vote-bot",
            }
        ),
        "destination_meta": tap_pb2.TapEvent.EndpointMeta(
            labels={"namespace": "emojivoto", "pod": pod, "deployment": "web"}
        ),
        "proxy_direction": tap_pb2.TapEvent.INBOUND,
    }
    if to:
        common["destination_meta"] = tap_pb2.TapEvent.EndpointMeta(
            labels={"namespace": "emojivoto", "pod": f"{to}-1", "deployment": to, "tls": "true"}
        )
        common["proxy_direction"] = tap_pb2.TapEvent.OUTBOUND
    method_pb = http_types_pb2.HttpMethod(registered=method)  # type: ignore[arg-type]
    return [
        tap_pb2.TapEvent(
            **common,
            http=Http(
                request_init=Http.RequestInit(
                    id=sid,
                    method=method_pb,
                    authority="web.emojivoto.svc.cluster.local",
                    path=path,
                )
            ),
        ),
        tap_pb2.TapEvent(
            **common,
            http=Http(
                response_init=Http.ResponseInit(
                    id=sid,
                    since_request_init=Duration(nanos=1_500_000),
                    http_status=status,
                )
            ),
        ),
        tap_pb2.TapEvent(
            **common,
            http=Http(
                response_end=Http.ResponseEnd(
                    id=sid,
                    since_request_init=Duration(nanos=2_000_000),
                    response_bytes=42,
                )
            ),
        ),
    ]


class FixtureTapServer:
    """Serves `events` on each Observe, then keeps the stream open while `hold` (else ends it,
    as a proxy does after `limit` requests); records each request it was asked."""

    def __init__(
        self,
        events: list[tap_pb2.TapEvent],
        cert: Path,
        key: Path,
        anchors: Path,
        allowed: str = wellknown.TAP_SERVICE_NAME,
    ) -> None:
        self.events, self.allowed = events, allowed
        self.cert, self.key, self.anchors = cert, key, anchors
        self.asked: list[tap_pb2.ObserveRequest] = []
        self.refused: list[str] = []
        self.open = 0
        self.hold = True
        self._server: grpc.aio.Server | None = None

    async def Observe(self, request: tap_pb2.ObserveRequest, context: Any) -> Any:
        auth = context.auth_context()
        names = [n.decode() for n in auth.get("x509_subject_alternative_name", [])]
        if self.allowed not in names:
            self.refused.append(",".join(names))
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"not {self.allowed}")
        self.asked.append(request)
        self.open += 1
        try:
            for event in self.events:
                yield event
            if self.hold:
                await asyncio.Event().wait()
        finally:
            self.open -= 1

    async def start(self, host: str, port: int = 0) -> int:
        self._server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Observe": grpc.unary_stream_rpc_method_handler(
                    self.Observe,
                    request_deserializer=tap_pb2.ObserveRequest.FromString,
                    response_serializer=tap_pb2.TapEvent.SerializeToString,
                )
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        credentials = grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.anchors.read_bytes(),
            require_client_auth=True,
        )
        bound = self._server.add_secure_port(f"{host}:{port}", credentials)
        await self._server.start()
        return bound

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)


@dataclass
class Controller:
    port: int
    admin: int
    proxy_port: int
    proc: subprocess.Popen[str]

    def url(self, **query: str) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1/tap?" + "&".join(
            f"{k}={v}" for k, v in query.items()
        )


def start_controller(test_ca: Any, tmp: Path, name: str, *extra: str) -> Controller:
    folder = ManifestsFolder(tmp / "manifests")
    folder.root.mkdir(exist_ok=True)
    owner = ("ReplicaSet", "web-5d8f7")
    folder.put(
        "pods",
        pod("web-5d8f7-a", "127.0.0.1", owner=owner),
        pod("web-5d8f7-b", "127.0.0.2", owner=owner),
    )
    cert, key = test_ca.serving_cert(name, tmp / "tap-tls")
    port, admin, proxy_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshlet.controlplane.main",
            "tap",
            "--addr",
            f"127.0.0.1:{port}",
            "--admin-addr",
            f"127.0.0.1:{admin}",
            "--manifests",
            str(folder.root),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--trust-anchors",
            str(test_ca.anchors_path),
            "--proxy-control-port",
            str(proxy_port),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", admin), timeout=1) as s:
                s.sendall(b"GET /ready HTTP/1.0\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return Controller(port, admin, proxy_port, proc)
        except OSError:
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the tap controller never became ready")


async def fixture_proxies(
    test_ca: Any,
    tmp: Path,
    port: int,
    identity: str = WEB,
    second: list[tap_pb2.TapEvent] | None = None,
) -> list[FixtureTapServer]:
    """Fixture Tap servers for pods web-5d8f7-a (127.0.0.1) and web-5d8f7-b (127.0.0.2, its
    events `second` if given)."""
    cert, key = test_ca.serving_cert(identity, tmp / "proxy-tls")
    servers = [
        FixtureTapServer(
            canned(1, pod="web-5d8f7-a") + canned(2, path="/health", pod="web-5d8f7-a"),
            cert,
            key,
            test_ca.anchors_path,
        ),
        FixtureTapServer(
            canned(3, pod="web-5d8f7-b") if second is None else second,
            cert,
            key,
            test_ca.anchors_path,
        ),
    ]
    for server, host in zip(servers, ("127.0.0.1", "127.0.0.2"), strict=True):
        await server.start(host, port)
    return servers
