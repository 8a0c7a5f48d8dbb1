"""Per-request balancing over an endpoint set: power of two choices on peak-EWMA load.

Each request takes a `Lease` on the endpoint it is sent to: the endpoint's pending count rises
until the lease is released, and the time from `pick` to the first response byte is the RTT
sample. Time and randomness are injected; endpoint statistics survive set updates for the
endpoints that remain.

An endpoint that could not be reached (`Lease.failed`: the connection was refused, timed out or
its TLS failed, so nothing was sent) is left out of the choice for a backoff that doubles with
each consecutive failure (`FAILURE_BACKOFF` up to `MAX_FAILURE_BACKOFF`) and is reset by its next
response; while every endpoint is backing off, all of them are candidates again.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from meshlet.api import backoff
from meshlet.proxy.core import p2c
from meshlet.proxy.core.ewma import DEFAULT_DECAY, DEFAULT_RTT, PeakEwma

E = TypeVar("E", bound=Hashable)

FAILURE_BACKOFF: Final = 0.5  # seconds an unreachable endpoint is skipped after one failure
MAX_FAILURE_BACKOFF: Final = 10.0


class NoEndpoints(Exception):
    """The set is empty: fail fast."""


@dataclass(slots=True)
class _Stats:
    ewma: PeakEwma
    failures: int = 0  # consecutive connection failures
    down_until: float = 0.0  # skipped by `pick` until then


@dataclass(slots=True)
class Lease(Generic[E]):
    endpoint: E
    _stats: _Stats
    _started: float
    _clock: Callable[[], float]
    _on_failure: Callable[[float], None]
    _sampled: bool = field(default=False)
    _released: bool = field(default=False)

    def responded(self) -> None:
        """The first response byte arrived: records the RTT sample (once)."""
        if not self._sampled:
            self._sampled = True
            now = self._clock()
            self._stats.ewma.observe(now - self._started, now)
            self._stats.failures = 0

    def failed(self) -> None:
        """The endpoint could not be reached (nothing was sent): the request is over here and the
        endpoint backs off. Does nothing after `release` or `responded`."""
        if self._released or self._sampled:
            return
        self._released = self._sampled = True
        stats = self._stats
        stats.ewma.pending -= 1
        stats.failures += 1
        wait = backoff.ceiling(stats.failures, FAILURE_BACKOFF, MAX_FAILURE_BACKOFF)
        stats.down_until = self._clock() + wait
        self._on_failure(stats.down_until)

    def release(self) -> None:
        """The request is over (also after a failure, which then counts as a slow sample)."""
        if self._released:
            return
        self._released = True
        if not self._sampled:
            self.responded()
        self._stats.ewma.pending -= 1


class Balancer(Generic[E]):
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        decay: float = DEFAULT_DECAY,
        default_rtt: float = DEFAULT_RTT,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._decay = decay
        self._default_rtt = default_rtt
        self._stats: dict[E, _Stats] = {}
        self._endpoints: list[E] = []
        self._down_until = 0.0  # the latest backoff's end: before it, `pick` filters

    def update(self, endpoints: Iterable[E]) -> None:
        """Replaces the set; statistics are kept for endpoints still in it."""
        self._endpoints = list(dict.fromkeys(endpoints))
        self._stats = {
            ep: self._stats.get(ep)
            or _Stats(PeakEwma(decay=self._decay, estimate=self._default_rtt))
            for ep in self._endpoints
        }

    @property
    def endpoints(self) -> list[E]:
        return list(self._endpoints)

    def load(self, endpoint: E) -> float:
        return self._stats[endpoint].ewma.load(self._clock())

    def backing_off(self, endpoint: E) -> bool:
        return self._stats[endpoint].down_until > self._clock()

    def pick(self, avoid: object = None) -> Lease[E]:
        """A lease on the less loaded of two endpoints drawn among those not backing off, and
        not `avoid` (where a retried request failed) while any other is left."""
        if not self._endpoints:
            raise NoEndpoints
        candidates = self._endpoints
        now = self._clock()
        if self._down_until > now:
            up = [ep for ep in candidates if self._stats[ep].down_until <= now]
            candidates = up or candidates
        if avoid is not None and len(candidates) > 1:
            candidates = [ep for ep in candidates if ep != avoid] or candidates
        endpoint = p2c.choose(candidates, self.load, self._rng)
        stats = self._stats[endpoint]
        stats.ewma.pending += 1
        return Lease(endpoint, stats, now, self._clock, self._failed)

    def _failed(self, down_until: float) -> None:
        self._down_until = max(self._down_until, down_until)
