"""The outbound policy watch against a real grpcio OutboundPolicies server on 127.0.0.1 (as the
policy controller serves it), over TLS from the test CA: the first answer, an update, a broken
message skipped, the server gone (the last policy kept) and back (the watch resumes by itself)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlet.api import meta_pb2, net_pb2, outbound_pb2, outbound_pb2_grpc
from meshlet.api.hostport import HostPort
from meshlet.proxy.discovery.outbound_policy import Followed, WatchOutbound, traffic_spec

POLICY_ID = "meshlet-policy.meshlet.serviceaccount.identity.meshlet.cluster.local"
WORKLOAD = '{"ns":"shop","pod":"web-1"}'
TARGET = HostPort("cart.shop.svc.cluster.local", 80)


def policy(name: str) -> outbound_pb2.OutboundPolicy:
    return outbound_pb2.OutboundPolicy(
        metadata=meta_pb2.Metadata(resource=meta_pb2.Resource(
            group="core", kind="Service", name=name, namespace="shop")),
        protocol=outbound_pb2.ProxyProtocol(opaque=outbound_pb2.ProxyProtocol.Opaque()),
    )  # fmt: skip


class Controller(outbound_pb2_grpc.OutboundPoliciesServicer):
    """Answers every Watch with the current policy, then with each one `push`ed."""

    def __init__(self, first: outbound_pb2.OutboundPolicy) -> None:
        self.first = first
        self.requests: list[outbound_pb2.TrafficSpec] = []
        self.streams: list[asyncio.Queue[outbound_pb2.OutboundPolicy]] = []

    async def Watch(  # type: ignore[override]
        self, request: outbound_pb2.TrafficSpec, context: Any
    ) -> AsyncIterator[outbound_pb2.OutboundPolicy]:
        self.requests.append(request)
        queue: asyncio.Queue[outbound_pb2.OutboundPolicy] = asyncio.Queue()
        self.streams.append(queue)
        yield self.first
        while True:
            yield await queue.get()

    def push(self, message: outbound_pb2.OutboundPolicy) -> None:
        for queue in self.streams:
            queue.put_nowait(message)


async def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


def credentials(test_ca: Any, tmp_path: Path, name: str = POLICY_ID) -> grpc.ServerCredentials:
    chain, key = test_ca.serving_cert(name, tmp_path)
    return grpc.ssl_server_credentials([(key.read_bytes(), chain.read_bytes())])


@pytest.fixture
def tls(test_ca: Any, tmp_path: Path) -> grpc.ServerCredentials:
    return credentials(test_ca, tmp_path)


class Serving:
    """A grpcio server; `stop()` ends its streams and closes its connections, as a controller
    that goes away does."""

    def __init__(self, controller: Controller, tls: grpc.ServerCredentials, port: int) -> None:
        self.server = grpc.aio.server()
        outbound_pb2_grpc.add_OutboundPoliciesServicer_to_server(controller, self.server)
        self.port = self.server.add_secure_port(f"127.0.0.1:{port}", tls)

    async def stop(self) -> None:
        await self.server.stop(grace=0)


@contextlib.asynccontextmanager
async def serving(controller: Controller, tls: grpc.ServerCredentials, port: int = 0
                  ) -> AsyncIterator[Serving]:  # fmt: skip
    serving = Serving(controller, tls, port)
    await serving.server.start()
    try:
        yield serving
    finally:
        await serving.stop()


async def test_the_watch_follows_updates_keeps_the_last_policy_and_resumes(
    tls: grpc.ServerCredentials, test_ca: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="meshlet.proxy.discovery.outbound_policy")
    controller = Controller(policy("cart-v1"))
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(serving(controller, tls))
        port = first.port
        client = WatchOutbound(HostPort("127.0.0.1", port), POLICY_ID, test_ca.anchors_pem,
                               WORKLOAD, backoff=(0.02, 0.05))  # fmt: skip
        stack.push_async_callback(client.aclose)
        followed = Followed(client, TARGET)
        task = asyncio.create_task(followed.run())
        stack.callback(task.cancel)

        await eventually(lambda: followed.version == 1)
        assert followed.policy is not None and followed.policy.meta.name == "cart-v1"
        (spec,) = controller.requests
        assert (spec.authority, spec.source_workload) == (str(TARGET), WORKLOAD)

        controller.push(policy("cart-v2"))
        await eventually(lambda: followed.version == 2)
        assert followed.policy.meta.name == "cart-v2"

        controller.push(outbound_pb2.OutboundPolicy(metadata=meta_pb2.Metadata(default="x")))
        await eventually(lambda: "no protocol" in caplog.text)
        assert (followed.version, followed.policy.meta.name) == (2, "cart-v2")

        await first.stop()  # the controller goes away: the stream breaks, the policy stands
        await eventually(lambda: client.stats.failures >= 2)
        assert (followed.version, followed.policy.meta.name) == (2, "cart-v2")
        assert client.stats.active == 0

        back = Controller(policy("cart-v3"))  # back on the same address
        async with serving(back, tls, port):
            await eventually(lambda: followed.version == 3)
            assert followed.policy.meta.name == "cart-v3"
            assert client.stats.active == 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # closed while the controller still serves, and given the loop's turns to finish
            # the TLS close, so that no transport is left half-closed when the loop ends
            await client.aclose()
            await asyncio.sleep(0.1)


async def test_a_controller_with_another_identity_is_never_believed(
    test_ca: Any, tmp_path: Path
) -> None:
    context = credentials(
        test_ca, tmp_path, "impostor.shop.serviceaccount.identity.meshlet.cluster.local"
    )
    controller = Controller(policy("forged"))
    async with serving(controller, context) as impostor:
        client = WatchOutbound(HostPort("127.0.0.1", impostor.port), POLICY_ID, test_ca.anchors_pem,
                               WORKLOAD, backoff=(0.02, 0.05))  # fmt: skip
        followed = Followed(client, TARGET)
        task = asyncio.create_task(followed.run())
        try:
            await eventually(lambda: client.stats.failures >= 2)
            assert followed.policy is None and not controller.requests
            assert "CERTIFICATE_VERIFY_FAILED" in (client.stats.last_error or "")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.aclose()


def test_an_ip_target_is_asked_by_address_a_name_by_authority() -> None:
    by_addr = traffic_spec(WORKLOAD, HostPort("10.0.0.7", 8080))
    assert by_addr.WhichOneof("target") == "addr"
    assert by_addr.addr == net_pb2.TcpAddress(ip=net_pb2.IPAddress(ipv4=0x0A000007), port=8080)
    v6 = traffic_spec(WORKLOAD, HostPort("fd00::7", 80))
    assert v6.WhichOneof("target") == "addr" and v6.addr.port == 80
    by_name = traffic_spec(WORKLOAD, TARGET)
    assert (by_name.WhichOneof("target"), by_name.authority) == ("authority", str(TARGET))


def test_a_name_to_verify_needs_trust_anchors() -> None:
    with pytest.raises(ValueError, match="MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"):
        WatchOutbound(HostPort("127.0.0.1", 8090), POLICY_ID, None, WORKLOAD)
