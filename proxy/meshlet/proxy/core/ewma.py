"""Peak-EWMA latency estimate of one endpoint (pure: time is passed in).

As Finagle's and linkerd2-proxy's: a sample above the estimate replaces it at once (peak), a
lower one is blended in with a weight that grows with the time since the last sample, so the
estimate falls back over about `decay` seconds. An endpoint's load is the estimate times its
requests in flight plus one, so both slowness and queueing make it less likely to be chosen.
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

    def observe(self, rtt: float, now: float) -> None:
        """Adds an RTT sample (seconds) taken at `now`."""
        if rtt > self.estimate or self.stamp == -math.inf:
            self.estimate = rtt
        else:
            weight = math.exp(-max(0.0, now - self.stamp) / self.decay)
            self.estimate = self.estimate * weight + rtt * (1.0 - weight)
        self.stamp = now

    def load(self) -> float:
        return self.estimate * (self.pending + 1)
