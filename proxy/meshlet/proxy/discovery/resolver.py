"""Shares discovery per outbound target: one `GetProfile` stream and, for a service, one `Get`
stream, used by every connection to that target and dropped after `idle_timeout` seconds
without a user.

    destination = await resolver.resolve("10.96.0.10:80")  # or "web.ns.svc.cluster.local:80"
    async with destination.use():  # a lease: a destination in use is never dropped
        if destination.kind == "service":
            async with asyncio.timeout(1.0):
                await destination.wait_endpoints()
            ...  # balance over destination.endpoints (READY), fail fast (EMPTY), or forward
                 # to the original destination (UNKNOWN: no such service)
        elif destination.kind == "endpoint":
            ...  # one pod, no balancing: destination.endpoint
        else:
            ...  # unknown: forward to the original destination as is

`resolve` waits for the first profile (at most `profile_timeout`); without one the destination
is "unknown" for now and becomes what later profiles say. Profiles keep being followed: when
the service named by the profile changes, the `Get` stream follows it. While the control plane
is away the last known profile and endpoints stay; a new stream's first message replaces them.

`Destination.version` grows on every change (profile or endpoints) and `wait_changed(version)`
waits for the next one, so a balancer can rebuild when `endpoints.version` moved. Hold a lease
for as long as you hold the object: an idle destination is closed and forgotten.

The resolver owns its destinations and its reaper task; `aclose()` ends them. The client is the
caller's to close, after the resolver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Literal

from meshlet.api.hostport import parse_hostport
from meshlet.proxy.core.endpoints import (
    Add,
    DiscoveredEndpoint,
    EndpointSet,
    NoEndpoints,
    Remove,
    Status,
)
from meshlet.proxy.discovery.client import DestinationClient, StreamRefused
from meshlet.proxy.discovery.profile import UNKNOWN, Profile

log = logging.getLogger(__name__)

Kind = Literal["service", "endpoint", "unknown"]


class ResolverFull(RuntimeError):
    """`max_destinations` targets are already followed: a new one is refused until some go
    idle (a client naming endless distinct hosts cannot open endless discovery streams)."""


class DestinationClosed(RuntimeError):
    """The destination was dropped (idle, or the resolver closed): resolve it again."""


def target_port(target: str) -> int:
    """The port of `host:port` or `[v6]:port`; ValueError when there is none."""
    return parse_hostport(target)[1]


class Destination:
    """What discovery says about one target, kept current by its own watch task."""

    def __init__(self, target: str, client: DestinationClient, clock: Callable[[], float]) -> None:
        self.target = target
        self.port = target_port(target)
        self.version = 0
        self.closed = False
        self._client = client
        self._clock = clock
        self._profile: Profile | None = None
        self._endpoints = EndpointSet()
        self._changed = asyncio.Event()
        self._users = 0
        self._released_at = clock()
        self._task: asyncio.Task[None] | None = None

    @property
    def profile(self) -> Profile | None:
        """The latest profile; None until the first one."""
        return self._profile

    @property
    def kind(self) -> Kind:
        profile = self._profile
        if profile is None:
            return "unknown"
        if profile.endpoint is not None:
            return "endpoint"
        return "service" if profile.fqn else "unknown"

    @property
    def endpoint(self) -> DiscoveredEndpoint | None:
        """The pod's endpoint when `kind == "endpoint"`."""
        return self._profile.endpoint if self._profile is not None else None

    @property
    def endpoints(self) -> EndpointSet:
        """The service's current endpoints (an immutable snapshot) when `kind == "service"`."""
        return self._endpoints

    @property
    def users(self) -> int:
        return self._users

    def idle_for(self, now: float) -> float:
        return 0.0 if self._users else now - self._released_at

    def use(self) -> _Use:
        """A lease (`async with destination.use():`); DestinationClosed when the destination was
        already dropped. A plain class, not a generator: it is taken once per request."""
        return _Use(self)

    def _acquire(self) -> None:
        if self.closed:
            raise DestinationClosed(f"discovery of {self.target} was closed; resolve it again")
        self._users += 1

    def _release(self) -> None:
        self._users -= 1
        self._released_at = self._clock()

    def _used(self) -> None:
        """A request picked from it without a lease (an outbound policy's backend): it counts
        as used now, so it is not dropped while requests keep coming."""
        if not self._users:
            self._released_at = self._clock()

    async def wait_profile(self) -> None:
        """Until a profile arrived (or the destination closed); bound it with asyncio.timeout."""
        await self._wait(lambda: self._profile is not None)

    async def wait_endpoints(self) -> None:
        """Until there is something to act on: a profile that is not a service, or the
        service's first `Get` answer (at once when already known, even if stale)."""

        def known() -> bool:
            if self._profile is None:
                return False
            return self.kind != "service" or self._endpoints.status is not Status.PENDING

        await self._wait(known)

    async def wait_changed(self, since: int) -> None:
        """Until `version` differs from `since`."""
        await self._wait(lambda: self.version != since)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"discovery {self.target}")

    def cancel(self) -> None:
        self.closed = True
        if self._task is not None:
            self._task.cancel()
        self._bump()  # wakes waiters

    async def aclose(self) -> None:
        self.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _wait(self, ready: Callable[[], bool]) -> None:
        while not ready() and not self.closed:
            await self._changed.wait()

    def _bump(self) -> None:
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                await self._follow_profiles(tasks)
        except Exception:
            log.exception("discovery of %s stopped; it stays as last known", self.target)

    async def _follow_profiles(self, tasks: asyncio.TaskGroup) -> None:
        """Adopts each profile; when the service it names changes, follows the new one."""
        watch: asyncio.Task[None] | None = None
        watched: str | None = None
        profiles = aclosing(self._client.profiles(self.target))
        try:
            async with profiles as stream:
                async for received in stream:
                    profile = received.value
                    if profile.rejected:
                        log.warning("profile of %s: left out %s", self.target,
                                    "; ".join(profile.rejected))  # fmt: skip
                    self._profile = profile
                    path = self._get_path(profile)
                    if path != watched:
                        if watch is not None:
                            watch.cancel()
                        watched, self._endpoints = path, self._endpoints.replaced()
                        watch = tasks.create_task(self._follow(path)) if path else None
                    self._bump()
        except StreamRefused as exc:
            log.info("the destination service does not know %s (%s); it is forwarded as is",
                     self.target, exc)  # fmt: skip
            self._profile = UNKNOWN  # a refused lookup never named a service: no watch runs
            self._bump()

    def _get_path(self, profile: Profile) -> str | None:
        if profile.fqn and profile.endpoint is None:
            return f"{profile.fqn}:{self.port}"
        return None

    async def _follow(self, path: str) -> None:
        try:
            async with aclosing(self._client.updates(path)) as updates:
                async for received in updates:
                    update = received.value
                    if isinstance(update, Add | Remove) and update.rejected:
                        log.warning("%s: left out addresses: %s", path, "; ".join(update.rejected))
                    self._endpoints = self._endpoints.apply(update, first=received.first)
                    self._bump()
        except StreamRefused as exc:
            log.warning(
                "the destination service refused Get %s (%s); treating it as unknown", path, exc
            )
            self._endpoints = self._endpoints.apply(NoEndpoints(exists=False), first=True)
            self._bump()


class _Use:
    __slots__ = ("_destination",)

    def __init__(self, destination: Destination) -> None:
        self._destination = destination

    async def __aenter__(self) -> Destination:
        self._destination._acquire()
        return self._destination

    async def __aexit__(self, *exc_info: object) -> None:
        self._destination._release()


class Resolver:
    """One `Destination` per target string, shared and dropped when idle."""

    def __init__(
        self,
        client: DestinationClient,
        *,
        idle_timeout: float = 60.0,
        profile_timeout: float = 1.0,
        max_destinations: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._max = max_destinations
        self._idle_timeout = idle_timeout
        self._profile_timeout = profile_timeout
        self._clock = clock
        self._destinations: dict[str, Destination] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._destinations)

    def __contains__(self, target: object) -> bool:
        return target in self._destinations

    def known(self, target: str) -> Destination | None:
        """`resolve` without waiting: the destination when discovery has answered for it
        already (the common case), else None."""
        destination = self._destinations.get(target)
        if destination is None or destination.profile is None or self._closed:
            return None
        destination._used()
        return destination

    async def resolve(self, target: str) -> Destination:
        """The shared destination for `ip:port` or `name:port`, after its first profile (or
        `profile_timeout`). ValueError when `target` has no port; ResolverFull when it is new
        and `max_destinations` are followed already."""
        if self._closed:
            raise RuntimeError("the resolver is closed")
        destination = self._destinations.get(target)
        if destination is not None and destination.profile is not None:
            destination._used()
            return destination  # the common case: known, nothing to wait for
        if destination is None:
            if len(self._destinations) >= self._max:
                raise ResolverFull(
                    f"discovery already follows {self._max} destinations; {target} is refused"
                    " until some have been unused for the idle timeout"
                )
            destination = Destination(target, self._client, self._clock)
            self._destinations[target] = destination
            destination.start()
            if self._reaper is None:
                self._reaper = asyncio.create_task(self._reap(), name="discovery reaper")
        async with destination.use():  # not idle while we wait
            try:
                async with asyncio.timeout(self._profile_timeout):
                    await destination.wait_profile()
            except TimeoutError:
                log.warning(
                    "no profile for %s from the destination service within %gs; "
                    "forwarding it as unknown until one arrives",
                    target,
                    self._profile_timeout,
                )
        return destination

    async def drop_idle(self) -> int:
        """Closes the destinations nobody used for `idle_timeout`; returns how many."""
        now = self._clock()
        idle = [d for d in self._destinations.values() if d.idle_for(now) >= self._idle_timeout]
        for destination in idle:
            del self._destinations[destination.target]
            destination.cancel()
        await asyncio.gather(*(d.aclose() for d in idle))
        return len(idle)

    async def aclose(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        destinations = list(self._destinations.values())
        self._destinations.clear()
        await asyncio.gather(*(d.aclose() for d in destinations))

    async def _reap(self) -> None:
        tick = min(max(self._idle_timeout / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(tick)
            await self.drop_idle()
