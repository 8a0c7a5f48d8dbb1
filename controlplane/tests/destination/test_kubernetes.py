"""Destination fed by the Kubernetes API: the real kubernetes client against the fake API
server, through the informer, to a real gRPC stream on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from kubernetes import client

from meshlet.api import addr, destination_pb2, destination_pb2_grpc
from meshlet.api.hostport import HostPort
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.events import DESTINATION_KINDS
from meshlet.controlplane.k8s.informer import KubernetesSource
from meshlet_testing.fakeapi import FakeKubeAPI

WEB = "web.emojivoto.svc.cluster.local:80"


@pytest.fixture
def kube() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as api:
        yield api


@pytest.fixture
async def stub(kube: FakeKubeAPI) -> AsyncIterator[Any]:
    with client.ApiClient(kube.client_configuration()) as api_client:
        source = KubernetesSource(api_client, watch_timeout=2.0, backoff=(0.05, 0.2))
        server = DestinationServer(
            DestinationConfig(
                addr=HostPort("127.0.0.1", 0),
                admin_addr=HostPort("127.0.0.1", 0),
                source=source,
                derive_from_pods=False,
            )
        )
        await server.start()
        for _ in range(200):
            if server.ready():
                break
            await asyncio.sleep(0.02)
        assert server.ready()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            yield destination_pb2_grpc.DestinationStub(channel)
        await server.stop(grace=0)


def describe(update: destination_pb2.Update) -> tuple[str, Any]:
    kind = update.WhichOneof("update")
    if kind == "no_endpoints":
        return kind, update.no_endpoints.exists
    entries = update.add.addrs if kind == "add" else update.remove.addrs
    tcps = [e.addr for e in entries] if kind == "add" else list(entries)
    return kind, sorted(f"{ip}:{port}" for ip, port in map(addr.tcp_from_proto, tcps))


async def next_update(stream: Any) -> tuple[str, Any]:
    async with asyncio.timeout(5.0):
        return describe(await stream.read())


def web_slice(*endpoints: tuple[str, bool, str | None]) -> dict[str, Any]:
    return objects.endpoint_slice("web-abc", "web", list(endpoints))


async def test_stream_follows_the_api_server(kube: FakeKubeAPI, stub: Any) -> None:
    kube.apply(objects.service("web"))
    kube.apply(objects.pod("web-1", "10.0.0.1"))
    kube.apply(web_slice(("10.0.0.1", True, "web-1")))
    await asyncio.sleep(0.2)
    stream = stub.Get(destination_pb2.GetDestination(path=WEB))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080"])

    kube.apply(web_slice(("10.0.0.1", True, "web-1"), ("10.0.0.2", True, None)))
    assert await next_update(stream) == ("add", ["10.0.0.2:8080"])

    kube.apply(web_slice(("10.0.0.1", False, "web-1"), ("10.0.0.2", True, None)))  # not ready
    assert await next_update(stream) == ("remove", ["10.0.0.1:8080"])

    # The pod becomes meshed: its endpoint is re-added with an identity.
    kube.apply(web_slice(("10.0.0.1", True, "web-1"), ("10.0.0.2", True, None)))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080"])
    kube.apply(objects.pod("web-1", "10.0.0.1", meshed=False))
    message = await asyncio.wait_for(stream.read(), 5)
    assert not message.add.addrs[0].HasField("tls_identity")

    kube.delete("v1", "Service", "web", "emojivoto")
    assert await next_update(stream) == ("remove", ["10.0.0.1:8080", "10.0.0.2:8080"])
    assert await next_update(stream) == ("no_endpoints", False)
    kube.apply(objects.service("web"))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080", "10.0.0.2:8080"])
    stream.cancel()


async def test_broken_watch_and_410_relist(kube: FakeKubeAPI, stub: Any) -> None:
    kube.apply(objects.service("web"))
    kube.apply(web_slice(("10.0.0.1", True, None)))
    await asyncio.sleep(0.2)
    stream = stub.Get(destination_pb2.GetDestination(path=WEB))
    assert await next_update(stream) == ("add", ["10.0.0.1:8080"])

    kube.break_watches()  # the API server restarts: the informer re-watches
    kube.apply(web_slice(("10.0.0.1", True, None), ("10.0.0.2", True, None)))
    assert await next_update(stream) == ("add", ["10.0.0.2:8080"])

    # Changes while no watch is open, then history compacted: the re-watch gets 410 and the
    # informer relists; the stream gets exactly the difference.
    kube.break_watches()
    kube.apply(web_slice(("10.0.0.2", True, None), ("10.0.0.3", True, None)))
    kube.compact()
    kube.break_watches()
    assert await next_update(stream) == ("add", ["10.0.0.3:8080"])
    assert await next_update(stream) == ("remove", ["10.0.0.1:8080"])
    lists = [
        path
        for method, path in kube.requests
        if method == "GET"
        and path.startswith("/apis/discovery.k8s.io/v1/endpointslices")
        and "watch=" not in path
    ]
    assert len(lists) >= 2, "the informer never relisted after the 410"
    stream.cancel()


async def test_informer_counters_are_exported(kube: FakeKubeAPI) -> None:
    with client.ApiClient(kube.client_configuration()) as api_client:
        source = KubernetesSource(api_client, watch_timeout=2.0, backoff=(0.05, 0.2))
        server = DestinationServer(
            DestinationConfig(
                addr=HostPort("127.0.0.1", 0), admin_addr=HostPort("127.0.0.1", 0), source=source,
                derive_from_pods=False,
            )
        )  # fmt: skip
        await server.start()
        try:
            for _ in range(200):
                if server.ready():
                    break
                await asyncio.sleep(0.02)
            # Ready means every kind is listed; its watch may open a moment later.
            assert await asyncio.to_thread(kube.wait_for_watches, len(DESTINATION_KINDS))
            kube.break_watches()
            for _ in range(200):
                count = server.registry.get_sample_value(
                    "destination_informer_reconnects_total", {"kind": "Pod"}
                )
                if count:
                    break
                await asyncio.sleep(0.02)
            assert count == 1.0
        finally:
            await server.stop(grace=0)
