"""A test fixture, not a proxy: a real gRPC server of `io.linkerd.proxy.tap.Tap/Observe` over
mutual TLS that answers only a client proving `allowed` (as a proxy's tap server does) with
canned events, the ones `canned` builds. It stands in for the proxy's tap server where a test
needs many proxies or exact events; the proxy's own is tested against the controller too."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from meshlet.api import http_types_pb2, net_pb2, tap_pb2, wellknown

SERVICE = "io.linkerd.proxy.tap.Tap"


def tcp(address: str, port: int) -> net_pb2.TcpAddress:
    return net_pb2.TcpAddress(
        ip=net_pb2.IPAddress(ipv4=int(ipaddress.IPv4Address(address))), port=port
    )


def canned(
    stream: int, path: str = "/api/list", method: int = 0, pod: str = "web-1", status: int = 200
) -> list[tap_pb2.TapEvent]:
    """req, rsp and end of one inbound request `stream` to `pod` from the `vote-bot` pod."""
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
    """Serves `events` on each Observe, then keeps the stream open until `hold` ends (None:
    for good); records each request it was asked."""

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
