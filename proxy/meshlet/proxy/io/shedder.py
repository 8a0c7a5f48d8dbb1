"""The load-shedding shell: one per proxy, over `core.pressure`.

Every served client connection (HTTP/1, HTTP/2, opaque relays, both directions) is added while
it lives. Once a second the shedder checks the totals (and measures each connection's progress
afresh); at each new connection while there are more than the mark it checks at once. Shed
connections are ended by their engine and counted in `load_shed_total{direction,resource}`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final, Protocol

from meshlet.proxy.core.pressure import Peer, Pressure, PressureLimits
from meshlet.proxy.io.counters import CounterFamily

log = logging.getLogger(__name__)

PERIOD: Final = 1.0  # seconds between periodic checks


class ShedMetrics(Protocol):
    """What the shedder records (`metrics.ProxyMetrics` provides it)."""

    @property
    def load_shed_total(self) -> CounterFamily: ...


class LoadShedder:
    def __init__(self, limits: PressureLimits, metrics: ShedMetrics) -> None:
        self.pressure = Pressure(limits)
        self._metrics = metrics
        self._directions: dict[Peer, str] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, peer: Peer, direction: str) -> None:
        loop = asyncio.get_running_loop()
        self.pressure.add(peer, loop.time())
        self._directions[peer] = direction
        if self._timer is None:
            self._timer = loop.call_later(PERIOD, self._tick)
        if self.pressure.crowded():
            self._shed(loop.time())

    def remove(self, peer: Peer) -> None:
        self.pressure.remove(peer)
        self._directions.pop(peer, None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        if not len(self.pressure):
            return  # re-armed by the next connection
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._shed(now)
        self.pressure.snapshot(now)
        self._timer = loop.call_later(PERIOD, self._tick)

    def _shed(self, now: float) -> None:
        for shed in self.pressure.check(now):
            direction = self._directions.get(shed.peer, "")
            self._metrics.load_shed_total.labels(direction, shed.resource.value).inc()
            log.warning("%s connection shed: %s, and it made the least progress",
                        direction, shed.why)  # fmt: skip
            self.remove(shed.peer)
            try:
                shed.peer.shed(shed.why)
            except Exception:  # one connection's failure to end must not stop the others
                log.exception("shedding a connection failed")
