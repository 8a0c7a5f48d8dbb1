"""Peak-EWMA latency estimate of one endpoint (pure: time is passed in).

As Finagle's and linkerd2-proxy's: a sample above the estimate replaces it at once (peak), a
lower one is blended in with a weight that grows with the time since the last sample, so the
estimate falls back over about `decay` seconds. Reading the load decays the estimate toward zero
the same way (time without samples counts as fast answers), so an endpoint that was slow, and
therefore stopped getting requests, is tried again after a while instead of never. An
endpoint's load is the estimate times its requests in flight plus one, so both slowness and
queueing make it less likely to be chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

DEFAULT_RTT: Final = 0.030  # seconds, before any sample
DEFAULT_DECAY: Final = 10.0  # seconds


@dataclass(slots=True)
class PeakEwma:
    decay: float = DEFAULT_DECAY
    estimate: float = DEFAULT_RTT
    stamp: float = field(default=-math.inf)  # time of the last update
    pending: int = 0
    sampled: bool = False  # the first sample replaces the default estimate

    def observe(self, rtt: float, now: float) -> None:
        """Adds an RTT sample (seconds) taken at `now`."""
        if rtt > self.estimate or not self.sampled:
            self.estimate = rtt
        else:
            self._blend(rtt, now)
        self.sampled = True
        self.stamp = now

    def load(self, now: float) -> float:
        """The load at `now`: the estimate, decayed by the time since the last update, times the
        requests in flight plus one."""
        if self.stamp == -math.inf:
            self.stamp = now  # the default estimate decays from the first look
        elif now > self.stamp:
            self._blend(0.0, now)
            self.stamp = now
        return self.estimate * (self.pending + 1)

    def _blend(self, rtt: float, now: float) -> None:
        weight = math.exp(-max(0.0, now - self.stamp) / self.decay)
        self.estimate = self.estimate * weight + rtt * (1.0 - weight)
