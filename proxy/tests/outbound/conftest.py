"""Shared by the outbound tests: a destination service as a script (each target's profile,
each service's endpoints), read through the real resolver, and the mesh router over it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from meshlet.api.hostport import HostPort
from meshlet.proxy.core.endpoints import Add, NoEndpoints, TlsIdentity, Update
from meshlet.proxy.core.endpoints import DiscoveredEndpoint as DiscoveredEndpoint
from meshlet.proxy.discovery.client import DestinationClient, Received
from meshlet.proxy.discovery.profile import UNKNOWN, Profile
from meshlet.proxy.discovery.resolver import Resolver
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.outbound.destinations import Destinations

NS = "emojivoto"
T = TypeVar("T")


def fqn(service: str) -> str:
    return f"{service}.{NS}.svc.cluster.local"


class ScriptedClient(DestinationClient):
    """Answers each `GetProfile` with `profiles[target]` (a target it does not know: a profile
    that names nothing) and each `Get` with `endpoints[path]` (absent: no answer yet); streams
    then stay open. It never connects anywhere."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), None, None, "")
        self.profiles_of: dict[str, Profile] = {}
        self.endpoints_of: dict[str, Update] = {}
        self.asked: list[str] = []  # GetProfile targets, in order

    def profiles(self, path: str) -> AsyncGenerator[Received[Profile], None]:
        self.asked.append(path)
        return _stream(self.profiles_of.get(path, UNKNOWN))

    def updates(self, path: str) -> AsyncGenerator[Received[Update], None]:
        return _stream(self.endpoints_of.get(path))

    def service(
        self, name: str, port: int, *endpoints: DiscoveredEndpoint, cluster_ip: str | None = None,
        **profile: Any,
    ) -> str:  # fmt: skip
        """A service known by its cluster name and `cluster_ip` (when given), with endpoints
        (none: it exists without endpoints) and `profile`'s fields. Returns `name:port`."""
        known = Profile(fqn=fqn(name), **profile)
        authority = f"{fqn(name)}:{port}"
        self.profiles_of[authority] = known
        if cluster_ip is not None:
            self.profiles_of[f"{cluster_ip}:{port}"] = known
        update: Update = Add(endpoints) if endpoints else NoEndpoints(exists=True)
        self.endpoints_of[authority] = update
        return authority

    async def aclose(self) -> None:
        pass


async def _stream(value: T | None) -> AsyncGenerator[Received[T], None]:
    if value is not None:
        yield Received(value, True)
    await asyncio.Event().wait()  # the stream stays open until discovery drops it


@dataclass
class Discovery:
    client: ScriptedClient = field(default_factory=ScriptedClient)
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    now: float = 1000.0
    resolvers: list[Resolver] = field(default_factory=list)

    @staticmethod
    def endpoint(
        ip: str, port: int = 8080, meshed: bool = False, pod: str = ""
    ) -> DiscoveredEndpoint:
        """An endpoint as discovery reports it; a meshed one has an identity and a proxy port."""
        identity = TlsIdentity(f"web.{NS}.serviceaccount.identity", "web") if meshed else None
        labels = (("namespace", NS), ("pod", pod or f"web-{ip.rsplit('.', 1)[1]}"))
        return DiscoveredEndpoint(HostPort(ip, port), 10_000, labels, identity, None,
                                  4143 if meshed else None)  # fmt: skip

    def mesh(
        self, *, max_destinations: int = 100, seed: int = 1, namespace: str | None = None
    ) -> Destinations:
        """A mesh router (without an identity) over a resolver of the scripted service, for a
        pod of `namespace`."""
        resolver = Resolver(self.client, profile_timeout=0.5, max_destinations=max_destinations)
        self.resolvers.append(resolver)
        return Destinations(self.client, resolver, None, self.metrics, connect_timeout=1.0,
                          clock=lambda: self.now, rng=random.Random(seed),
                          namespace=namespace)  # fmt: skip

    def fail_fast(self, reason: str) -> float:
        return (
            self.metrics.registry.get_sample_value(
                "fail_fast_total", {"direction": "outbound", "reason": reason}
            )
            or 0.0
        )


@pytest.fixture
async def discovery() -> AsyncIterator[Discovery]:
    found = Discovery()
    yield found
    for resolver in found.resolvers:
        await resolver.aclose()
