"""The outbound policies the proxy follows: one `Followed` (a `Watch` stream to the policy
controller) per service its outbound traffic targets, by the service's authority and port.

A target is followed from the first request routed to the service, shared by every connection
to it, and closed once no request has asked for it for `idle_timeout` seconds (a sweep on the
next lookup, so no task runs for it). At most `max_followed` targets are followed: past that,
a new target is not followed and its requests are routed as without a policy controller (the
ServiceProfile path), and that is logged at most once a minute. A target's policy is None
until the controller has answered: the caller routes as it would without one, never waits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from meshlet.api.hostport import HostPort
from meshlet.proxy.discovery.outbound_policy import Followed, WatchOutbound

log = logging.getLogger(__name__)

MAX_FOLLOWED: Final = 1_000  # targets followed at once
IDLE_TIMEOUT: Final = 60.0  # seconds without a request before a target's stream is closed
FULL_LOG_INTERVAL: Final = 60.0


class _Entry:
    __slots__ = ("followed", "task", "used_at")

    def __init__(self, followed: Followed, task: asyncio.Task[None], now: float) -> None:
        self.followed = followed
        self.task = task
        self.used_at = now


class OutboundPolicies:
    """The followed targets of one proxy (its outbound stack's one instance)."""

    def __init__(
        self,
        client: WatchOutbound,
        clock: Callable[[], float],
        *,
        max_followed: int = MAX_FOLLOWED,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        if max_followed < 1:
            raise ValueError("max_followed must be at least 1")
        self.client = client
        self._clock = clock
        self._max = max_followed
        self._idle = idle_timeout
        self._entries: dict[HostPort, _Entry] = {}
        self._swept_at = clock()
        self._full_logged_at: float | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, target: object) -> bool:
        return target in self._entries

    def follow(self, target: HostPort) -> Followed | None:
        """The target's followed policy, its stream opened on first use; None when the limit
        is reached (or the proxy is closing)."""
        now = self._clock()
        if now - self._swept_at >= self._idle / 2:
            self._sweep(now)
        entry = self._entries.get(target)
        if entry is not None:
            entry.used_at = now
            return entry.followed
        if self._closed:
            return None
        if len(self._entries) >= self._max:
            self._sweep(now)
            if len(self._entries) >= self._max:
                self._full(target, now)
                return None
        followed = Followed(self.client, target)
        task = asyncio.create_task(followed.run(), name=f"outbound policy {target}")
        task.add_done_callback(_ended)
        self._entries[target] = _Entry(followed, task, now)
        return followed

    def _sweep(self, now: float) -> None:
        self._swept_at = now
        idle = [t for t, e in self._entries.items() if now - e.used_at >= self._idle]
        for target in idle:
            self._entries.pop(target).task.cancel()
        if idle:
            log.debug("outbound policy: closed %d idle streams", len(idle))

    def _full(self, target: HostPort, now: float) -> None:
        last = self._full_logged_at
        if last is None or now - last >= FULL_LOG_INTERVAL:
            self._full_logged_at = now
            log.warning(
                "outbound policy: already following %d services; %s is routed without its"
                " policy until some are unused for %gs", self._max, target, self._idle,
            )  # fmt: skip

    async def aclose(self) -> None:
        """Cancels every stream, then closes the channel to the controller."""
        self._closed = True
        tasks = [e.task for e in self._entries.values()]
        self._entries.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()


def _ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("outbound policy stream %s failed: %r", task.get_name(), task.exception())
