"""Per-request balancing over an endpoint set: power of two choices on peak-EWMA load.

Each request takes a `Lease` on the endpoint it is sent to: the endpoint's pending count rises
until the lease is released, and the time from `pick` to the first response byte is the RTT
sample. Time and randomness are injected; endpoint statistics survive set updates for the
endpoints that remain.

An endpoint that could not be reached (`Lease.failed`: the connection was refused, timed out or
its TLS failed, so nothing was sent) is left out of the choice for a backoff that doubles with
each consecutive failure (`FAILURE_BACKOFF` up to `MAX_FAILURE_BACKOFF`) and is reset by its next
response; while every endpoint is backing off, all of them are candidates again.

With a `FailureAccrual` (None: off, the default) each endpoint also has a breaker
(core/accrual.py) fed by its requests' outcomes (`Lease.outcome`, reported by the request
driver; a connection that failed counts as a failure): an ejected endpoint is left out of the
choice whatever else is left, and while every endpoint is ejected `pick` raises `AllEjected`,
so requests fail fast instead of going where they would fail.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from meshlet.api import backoff
from meshlet.proxy.core import p2c
from meshlet.proxy.core.accrual import Breaker, FailureAccrual
from meshlet.proxy.core.ewma import DEFAULT_DECAY, DEFAULT_RTT, PeakEwma

E = TypeVar("E", bound=Hashable)

FAILURE_BACKOFF: Final = 0.5  # seconds an unreachable endpoint is skipped after one failure
MAX_FAILURE_BACKOFF: Final = 10.0


class NoEndpoints(Exception):
    """The set is empty: fail fast."""


class AllEjected(NoEndpoints):
    """Every endpoint is ejected by failure accrual (none due for a probe): fail fast."""

    def __init__(self, count: int) -> None:
        super().__init__(
            f"all {count} endpoint{'s' if count != 1 else ''} failed too often in a row and"
            " are ejected by failure accrual until a probe succeeds"
        )
        self.count = count


@dataclass(slots=True)
class _Stats:
    ewma: PeakEwma
    failures: int = 0  # consecutive connection failures
    down_until: float = 0.0  # skipped by `pick` until then
    breaker: Breaker | None = None  # with failure accrual


@dataclass(slots=True)
class Lease(Generic[E]):
    endpoint: E
    _stats: _Stats
    _started: float
    _clock: Callable[[], float]
    _on_failure: Callable[[float], None]
    _sampled: bool = field(default=False)
    _released: bool = field(default=False)
    _rng: random.Random | None = None  # with failure accrual
    _probe: bool = False  # this request is its ejected endpoint's probe
    _reported: bool = False  # its outcome went to the breaker (once)

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
        self.outcome(False)

    def outcome(self, success: bool) -> None:
        """The request's outcome as failure accrual counts it (core/accrual.py), once: later
        reports are ignored; a no-op without failure accrual (or for a request picked before
        it was turned on)."""
        breaker = self._stats.breaker
        rng = self._rng
        if breaker is None or rng is None or self._reported:
            return
        self._reported = True
        if success:
            breaker.success(self._probe)
        else:
            breaker.failure(self._probe, self._clock(), rng)

    def release(self) -> None:
        """The request is over (also after a failure, which then counts as a slow sample). A
        probe released with no outcome reported gives way to the next one."""
        if self._released:
            return
        self._released = True
        if not self._sampled:
            self.responded()
        self._stats.ewma.pending -= 1
        if self._probe and not self._reported:
            self._reported = True
            breaker = self._stats.breaker
            if breaker is not None:  # else accrual was turned off meanwhile
                breaker.abandoned(True)


class Balancer(Generic[E]):
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        decay: float = DEFAULT_DECAY,
        default_rtt: float = DEFAULT_RTT,
        accrual: FailureAccrual | None = None,
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()
        self._decay = decay
        self._default_rtt = default_rtt
        self._stats: dict[E, _Stats] = {}
        self._endpoints: list[E] = []
        self._down_until = 0.0  # the latest backoff's end: before it, `pick` filters
        self._accrual = accrual

    @property
    def accrual(self) -> FailureAccrual | None:
        return self._accrual

    def set_accrual(self, accrual: FailureAccrual | None) -> None:
        """Turns failure accrual on, off, or to new settings (each endpoint's breaker starts
        afresh; the same settings again change nothing)."""
        if accrual == self._accrual:
            return
        self._accrual = accrual
        for stats in self._stats.values():
            stats.breaker = Breaker(accrual) if accrual is not None else None

    def update(self, endpoints: Iterable[E]) -> None:
        """Replaces the set; statistics (and breakers) are kept for endpoints still in it."""
        self._endpoints = list(dict.fromkeys(endpoints))
        self._stats = {ep: self._stats.get(ep) or self._new_stats() for ep in self._endpoints}

    def _new_stats(self) -> _Stats:
        accrual = self._accrual
        breaker = Breaker(accrual) if accrual is not None else None
        return _Stats(PeakEwma(decay=self._decay, estimate=self._default_rtt), breaker=breaker)

    @property
    def endpoints(self) -> list[E]:
        return list(self._endpoints)

    def load(self, endpoint: E) -> float:
        return self._stats[endpoint].ewma.load(self._clock())

    def backing_off(self, endpoint: E) -> bool:
        return self._stats[endpoint].down_until > self._clock()

    def ready(self) -> int:
        """Endpoints a request may go to now (not ejected by failure accrual, nor probing, nor
        backing off after a failed connection); the others are pending."""
        now = self._clock()
        return sum(
            1
            for stats in self._stats.values()
            if stats.down_until <= now and (stats.breaker is None or stats.breaker.admits(now))
        )

    def breaker(self, endpoint: E) -> Breaker | None:
        """The endpoint's breaker (None: no failure accrual)."""
        return self._stats[endpoint].breaker

    def pick(self, avoid: object = None) -> Lease[E]:
        """A lease on the less loaded of two endpoints drawn among those not backing off, and
        not `avoid` (where a retried request failed) while any other is left; with failure
        accrual, never an ejected endpoint (AllEjected when nothing else is left)."""
        if not self._endpoints:
            raise NoEndpoints
        candidates = self._endpoints
        now = self._clock()
        if self._accrual is not None:
            return self._pick_admitted(avoid, now)
        if self._down_until > now:
            up = [ep for ep in candidates if self._stats[ep].down_until <= now]
            candidates = up or candidates
        if avoid is not None and len(candidates) > 1:
            candidates = [ep for ep in candidates if ep != avoid] or candidates
        endpoint = p2c.choose(candidates, self.load, self._rng)
        stats = self._stats[endpoint]
        stats.ewma.pending += 1
        return Lease(endpoint, stats, now, self._clock, self._failed)

    def _pick_admitted(self, avoid: object, now: float) -> Lease[E]:
        stats = self._stats
        candidates = [ep for ep in self._endpoints if stats[ep].breaker.admits(now)]  # type: ignore[union-attr]
        if not candidates:
            raise AllEjected(len(self._endpoints))
        if self._down_until > now:
            up = [ep for ep in candidates if stats[ep].down_until <= now]
            candidates = up or candidates
        if avoid is not None and len(candidates) > 1:
            candidates = [ep for ep in candidates if ep != avoid] or candidates
        endpoint = p2c.choose(candidates, self.load, self._rng)
        chosen = stats[endpoint]
        chosen.ewma.pending += 1
        breaker = chosen.breaker
        assert breaker is not None
        probe = breaker.admit(now)
        return Lease(endpoint, chosen, now, self._clock, self._failed, _rng=self._rng,
                     _probe=probe)  # fmt: skip

    def _failed(self, down_until: float) -> None:
        self._down_until = max(self._down_until, down_until)
