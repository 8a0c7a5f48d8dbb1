"""Per-request balancing over an endpoint set: power of two choices on peak-EWMA load.

Each request takes a `Lease` on the endpoint it is sent to: the endpoint's pending count rises
until the lease is released, and the time from `pick` to the first response byte is the RTT
sample. Time and randomness are injected; endpoint statistics survive set updates for the
endpoints that remain.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from meshlet.proxy.core import p2c
from meshlet.proxy.core.ewma import DEFAULT_DECAY, DEFAULT_RTT, PeakEwma

E = TypeVar("E", bound=Hashable)


class NoEndpoints(Exception):
    """The set is empty: fail fast."""


@dataclass(slots=True)
class _Stats:
    ewma: PeakEwma


@dataclass(slots=True)
class Lease(Generic[E]):
    endpoint: E
    _stats: _Stats
    _started: float
    _clock: Callable[[], float]
    _sampled: bool = field(default=False)
    _released: bool = field(default=False)

    def responded(self) -> None:
        """The first response byte arrived: records the RTT sample (once)."""
        if not self._sampled:
            self._sampled = True
            now = self._clock()
            self._stats.ewma.observe(now - self._started, now)

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
        return self._stats[endpoint].ewma.load()

    def pick(self) -> Lease[E]:
        if not self._endpoints:
            raise NoEndpoints
        endpoint = p2c.choose(self._endpoints, self.load, self._rng)
        stats = self._stats[endpoint]
        stats.ewma.pending += 1
        return Lease(endpoint, stats, self._clock(), self._clock)
