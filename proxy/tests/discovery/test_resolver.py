"""Resolution of outbound targets against the real destination service on 127.0.0.1, fed by a
manifests folder that the tests rewrite: profiles, endpoint streams, sharing, idle drop, and a
control plane that goes away and comes back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from meshlet.api.hostport import HostPort
from meshlet.controlplane.destination.server import DestinationConfig, DestinationServer
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder, ManifestsSource
from meshlet.proxy.core.endpoints import Hint, Status
from meshlet.proxy.discovery.client import DestinationClient
from meshlet.proxy.discovery.profile import DstOverride
from meshlet.proxy.discovery.resolver import Destination, DestinationClosed, Resolver, ResolverFull

FQN = "web.emojivoto.svc.cluster.local"
CLUSTER_IP = "10.96.0.10"
WEB_ID = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"


Cluster = ManifestsFolder  # the cluster, as its manifests folder says


async def eventually(condition: Callable[[], bool], within: float = 3.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


async def settled(destination: Destination, condition: Callable[[], bool]) -> None:
    """Waits, change by change, until `condition` holds (3 s at most)."""
    async with asyncio.timeout(3.0):
        while not condition():
            await destination.wait_changed(destination.version)


async def start_server(cluster: Cluster, port: int = 0) -> DestinationServer:
    server = DestinationServer(
        DestinationConfig(
            addr=HostPort("127.0.0.1", port),
            admin_addr=HostPort("127.0.0.1", 0),
            source=ManifestsSource(cluster.root, poll_interval=0.02),
            derive_from_pods=True,
        )
    )
    await server.start()
    await eventually(server.ready)
    return server


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    root = tmp_path / "manifests"
    root.mkdir()
    cluster = Cluster(root)
    cluster.put("svc", objects.service("web", cluster_ip=CLUSTER_IP))
    cluster.put("web-1", objects.pod("web-1", "10.0.0.1"))
    return cluster


class Plane:
    """The destination service (restartable on its port) and a proxy's client and resolver."""

    def __init__(self, cluster: Cluster, server: DestinationServer, **resolver: Any) -> None:
        self.cluster = cluster
        self.server = server
        self.port = server.grpc_port
        self.client = DestinationClient(
            ("127.0.0.1", self.port), None, None, '{"ns":"emojivoto"}',
            backoff=(0.02, 0.1), rng=random.Random(1),
        )  # fmt: skip
        self.resolver = Resolver(self.client, **resolver)

    async def close(self) -> None:
        await self.resolver.aclose()
        await self.client.aclose()
        await self.server.stop(grace=0)


@pytest.fixture
async def plane(cluster: Cluster) -> AsyncIterator[Plane]:
    plane = Plane(cluster, await start_server(cluster))
    yield plane
    await plane.close()


async def ready_service(plane: Plane, target: str) -> Destination:
    destination = await plane.resolver.resolve(target)
    assert destination.kind == "service"
    async with asyncio.timeout(3.0):
        await destination.wait_endpoints()
    return destination


def addrs(destination: Destination) -> set[tuple[str, int]]:
    return set(destination.endpoints.endpoints)


# --- resolution ----------------------------------------------------------------------------------


async def test_a_cluster_ip_resolves_to_its_service_and_endpoints(
    plane: Plane, cluster: Cluster
) -> None:
    cluster.put("web-2", objects.pod("web-2", "10.0.0.2", meshed=False))
    await asyncio.sleep(0.1)
    destination = await ready_service(plane, f"{CLUSTER_IP}:80")
    assert destination.profile is not None
    assert destination.profile.fqn == FQN
    assert destination.endpoints.status is Status.READY
    await settled(destination, lambda: len(destination.endpoints) == 2)
    meshed = destination.endpoints.endpoints[("10.0.0.1", 8080)]
    assert meshed.identity is not None and meshed.identity.name == WEB_ID
    assert meshed.hint is Hint.H2
    assert meshed.opaque_transport_port == 4143
    assert ("service", "web") in meshed.labels and ("pod", "web-1") in meshed.labels
    plain = destination.endpoints.endpoints[("10.0.0.2", 8080)]
    assert plain.identity is None and plain.opaque_transport_port is None


async def test_a_service_name_resolves_like_its_cluster_ip(plane: Plane) -> None:
    destination = await ready_service(plane, f"{FQN}:80")
    assert addrs(destination) == {("10.0.0.1", 8080)}


async def test_a_pod_ip_resolves_to_that_endpoint_without_a_get_stream(plane: Plane) -> None:
    destination = await plane.resolver.resolve("10.0.0.1:8080")
    assert destination.kind == "endpoint"
    endpoint = destination.endpoint
    assert endpoint is not None
    assert endpoint.addr == ("10.0.0.1", 8080)
    assert endpoint.identity is not None and endpoint.identity.name == WEB_ID
    assert endpoint.opaque_transport_port == 4143
    async with asyncio.timeout(0.1):
        await destination.wait_endpoints()  # nothing to wait for
    assert plane.server.limits.active == 1  # GetProfile only


@pytest.mark.parametrize("target", ["192.0.2.1:80", "example.com:80"])
async def test_what_the_control_plane_does_not_know_is_unknown(plane: Plane, target: str) -> None:
    destination = await plane.resolver.resolve(target)
    assert destination.kind == "unknown"
    assert destination.profile is not None  # an answer, not a timeout
    assert destination.profile.fqn is None and destination.endpoint is None
    assert plane.client.failures == 0


async def test_without_a_control_plane_resolve_gives_up_after_the_profile_timeout(
    cluster: Cluster,
) -> None:
    server = await start_server(cluster)
    plane = Plane(cluster, server, profile_timeout=0.2)
    await server.stop(grace=0)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        destination = await plane.resolver.resolve(f"{CLUSTER_IP}:80")
        assert 0.19 <= loop.time() - started < 1.0  # uvloop keeps time in milliseconds
        assert destination.kind == "unknown" and destination.profile is None
        plane.server = await start_server(cluster, plane.port)  # it comes back: so does the answer
        await settled(destination, lambda: destination.kind == "service")
        async with asyncio.timeout(3.0):
            await destination.wait_endpoints()
        assert addrs(destination) == {("10.0.0.1", 8080)}
    finally:
        await plane.close()


async def test_malformed_targets_are_a_caller_error(plane: Plane) -> None:
    for target in ["10.0.0.1", "fd00::1", "web:http", "[fd00::1]"]:
        with pytest.raises(ValueError, match=r"port"):
            await plane.resolver.resolve(target)
    assert len(plane.resolver) == 0


# --- updates -------------------------------------------------------------------------------------


async def test_endpoint_and_service_changes_flow_to_the_destination(
    plane: Plane, cluster: Cluster
) -> None:
    destination = await ready_service(plane, f"{CLUSTER_IP}:80")
    version = destination.endpoints.version

    cluster.put("web-2", objects.pod("web-2", "10.0.0.2"))
    await settled(destination, lambda: ("10.0.0.2", 8080) in addrs(destination))
    assert destination.endpoints.version > version

    cluster.remove("web-1")
    await settled(destination, lambda: addrs(destination) == {("10.0.0.2", 8080)})

    cluster.remove("web-2")
    await settled(destination, lambda: destination.endpoints.status is Status.EMPTY)  # fail fast

    cluster.put("web-3", objects.pod("web-3", "10.0.0.3"))
    await settled(destination, lambda: addrs(destination) == {("10.0.0.3", 8080)})


async def test_profile_changes_are_followed(plane: Plane, cluster: Cluster) -> None:
    destination = await ready_service(plane, f"{CLUSTER_IP}:80")
    assert destination.profile is not None and destination.profile.dst_overrides == ()
    split = [
        {"authority": "web-v2.emojivoto.svc.cluster.local:80", "weight": "250m"},
        {"authority": "web.emojivoto.svc.cluster.local:80", "weight": "750m"},
    ]
    cluster.put("profile", objects.profile("web", {"dstOverrides": split}))
    await settled(
        destination, lambda: bool(destination.profile and destination.profile.dst_overrides)
    )
    assert destination.profile is not None
    assert destination.profile.dst_overrides == (
        DstOverride("web-v2.emojivoto.svc.cluster.local:80", 2500),
        DstOverride("web.emojivoto.svc.cluster.local:80", 7500),
    )
    assert addrs(destination) == {("10.0.0.1", 8080)}  # the same service: the same Get stream
    assert plane.server.limits.active == 2


async def test_an_address_that_becomes_a_service_starts_following_it(
    plane: Plane, cluster: Cluster
) -> None:
    destination = await plane.resolver.resolve("10.96.0.99:80")
    assert destination.kind == "unknown"
    cluster.put("api", objects.service("api", cluster_ip="10.96.0.99", selector={"app": "web"}))
    await settled(destination, lambda: destination.kind == "service")
    async with asyncio.timeout(3.0):
        await destination.wait_endpoints()
    assert destination.profile is not None
    assert destination.profile.fqn == "api.emojivoto.svc.cluster.local"
    assert addrs(destination) == {("10.0.0.1", 8080)}

    cluster.remove("api")  # and stops being one: the Get stream is dropped
    await settled(destination, lambda: destination.kind == "unknown")
    assert destination.endpoints.status is Status.PENDING
    await eventually(lambda: plane.server.limits.active == 1)


# --- sharing and idleness ------------------------------------------------------------------------


async def test_one_pair_of_streams_serves_every_user_of_a_target(plane: Plane) -> None:
    first, second = await asyncio.gather(
        plane.resolver.resolve(f"{CLUSTER_IP}:80"), plane.resolver.resolve(f"{CLUSTER_IP}:80")
    )
    third = await plane.resolver.resolve(f"{CLUSTER_IP}:80")
    assert first is second is third
    async with asyncio.timeout(3.0):
        await first.wait_endpoints()
    assert plane.server.limits.active == 2  # one GetProfile, one Get
    assert plane.client.active == 2
    await plane.resolver.resolve(f"{FQN}:80")  # another target: its own streams
    await eventually(lambda: plane.server.limits.active == 4)


async def test_idle_destinations_are_dropped_and_leased_ones_kept(cluster: Cluster) -> None:
    plane = Plane(cluster, await start_server(cluster), idle_timeout=0.2)
    try:
        leased = await ready_service(plane, f"{CLUSTER_IP}:80")
        idle = await ready_service(plane, f"{FQN}:80")
        assert plane.server.limits.active == 4
        async with leased.use():
            await eventually(lambda: idle.closed)
            await asyncio.sleep(0.3)  # longer than the idle timeout, under a lease
            assert not leased.closed
            assert f"{CLUSTER_IP}:80" in plane.resolver and f"{FQN}:80" not in plane.resolver
            await eventually(lambda: plane.server.limits.active == 2)  # its streams were closed
        await eventually(lambda: leased.closed)
        await eventually(lambda: plane.server.limits.active == 0 and plane.client.active == 0)
        with pytest.raises(DestinationClosed):
            async with leased.use():
                pass
        again = await ready_service(plane, f"{CLUSTER_IP}:80")  # resolved afresh
        assert again is not leased
    finally:
        await plane.close()


async def test_idleness_is_measured_on_the_injected_clock(plane: Plane, cluster: Cluster) -> None:
    now = [100.0]
    resolver = Resolver(plane.client, idle_timeout=60.0, clock=lambda: now[0])
    try:
        destination = await resolver.resolve(f"{CLUSTER_IP}:80")
        async with destination.use():
            now[0] += 3600
            assert await resolver.drop_idle() == 0  # in use
        now[0] += 59
        assert await resolver.drop_idle() == 0
        now[0] += 1
        assert await resolver.drop_idle() == 1
        assert destination.closed and len(resolver) == 0
    finally:
        await resolver.aclose()


async def test_a_destination_picked_from_by_requests_is_not_idle(
    plane: Plane, cluster: Cluster
) -> None:
    """An outbound policy's backend is looked up per request (`known`, no lease): a minute of
    requests keeps it; it was dropped and followed anew every idle timeout, each time waiting for
    a first profile on the request path (up to 1 s when the destination service was restarting,
    as the soak found)."""
    now = [100.0]
    resolver = Resolver(plane.client, idle_timeout=60.0, clock=lambda: now[0])
    try:
        backend = await resolver.resolve(f"{FQN}:80")
        for _ in range(10):
            now[0] += 30
            assert resolver.known(f"{FQN}:80") is backend
            assert await resolver.drop_idle() == 0
        now[0] += 60
        assert await resolver.drop_idle() == 1 and backend.closed
    finally:
        await resolver.aclose()


# --- the control plane goes away -----------------------------------------------------------------


async def test_endpoints_survive_the_control_plane_and_are_replaced_when_it_returns(
    plane: Plane, cluster: Cluster
) -> None:
    destination = await ready_service(plane, f"{CLUSTER_IP}:80")
    cluster.put("web-2", objects.pod("web-2", "10.0.0.2"))
    await settled(destination, lambda: len(destination.endpoints) == 2)
    before = destination.endpoints

    await plane.server.stop(grace=0)
    await eventually(lambda: plane.client.failures >= 4)  # retrying, with backoff
    assert destination.endpoints == before  # nothing forgotten while it is away
    assert destination.endpoints.status is Status.READY
    assert destination.kind == "service"

    cluster.remove("web-1")  # changes made while it was away
    cluster.put("web-2", objects.pod("web-2", "10.0.0.3"))
    plane.server = await start_server(cluster, plane.port)
    await settled(destination, lambda: addrs(destination) == {("10.0.0.3", 8080)})  # not merged

    cluster.put("web-4", objects.pod("web-4", "10.0.0.4"))  # and updates resume
    await settled(destination, lambda: ("10.0.0.4", 8080) in addrs(destination))
    await eventually(lambda: plane.server.limits.active == 2)  # both streams back


async def test_a_restarted_stream_saying_no_endpoints_empties_the_cache(
    plane: Plane, cluster: Cluster
) -> None:
    destination = await ready_service(plane, f"{CLUSTER_IP}:80")
    await plane.server.stop(grace=0)
    cluster.remove("web-1")
    await eventually(lambda: plane.client.failures >= 2)
    assert addrs(destination) == {("10.0.0.1", 8080)}
    plane.server = await start_server(cluster, plane.port)
    await settled(destination, lambda: destination.endpoints.status is Status.EMPTY)
    assert destination.endpoints.endpoints == {}


async def test_new_targets_are_refused_past_max_destinations(cluster: Cluster) -> None:
    plane = Plane(cluster, await start_server(cluster), max_destinations=2, idle_timeout=0.05)
    try:
        first = await plane.resolver.resolve(f"{FQN}:80")
        second = await plane.resolver.resolve("10.0.0.1:8080")
        async with first.use(), second.use():  # in use: not idle, however slow the machine
            with pytest.raises(ResolverFull, match="already follows 2 destinations"):
                await plane.resolver.resolve("10.0.0.2:8080")
            assert await plane.resolver.resolve(f"{FQN}:80") is first  # known ones resolve
        await eventually(lambda: len(plane.resolver) == 0)  # unused: dropped when idle
        await plane.resolver.resolve("10.0.0.2:8080")
    finally:
        await plane.close()
