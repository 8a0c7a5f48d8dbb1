"""Waits between attempts: exponential from `base`, capped, with "equal jitter" (pure apart from
the injected rng). The one backoff of every retry loop: discovery streams, certificate requests,
the Kubernetes informers, and (without jitter) endpoints the balancer skips.

After the n-th failure in a row the ceiling is min(cap, base * 2**(n-1)); the wait is uniform in
[ceiling/2, ceiling], so retries spread out and never exceed the cap.
"""

from __future__ import annotations

import random
from typing import Final

_MAX_DOUBLINGS: Final = 64  # far past any cap; keeps 2**n a small float


def ceiling(failures: int, base: float, cap: float) -> float:
    """The longest wait after `failures` (>= 1) consecutive failures."""
    doublings = min(max(failures - 1, 0), _MAX_DOUBLINGS)
    return min(cap, base * 2.0**doublings)


def jittered(failures: int, base: float, cap: float, rng: random.Random) -> float:
    """A wait in [ceiling/2, ceiling] after `failures` (>= 1) consecutive failures."""
    top = ceiling(failures, base, cap)
    return rng.uniform(top / 2, top)


class Backoff:
    """Counts consecutive failures: `next()` is the wait after one more; `reset()` after a
    success."""

    def __init__(self, base: float, cap: float, rng: random.Random) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"backoff needs 0 < base <= cap, got {base}, {cap}")
        self.base, self.cap, self._rng = base, cap, rng
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        return jittered(self.failures, self.base, self.cap, self._rng)

    def reset(self) -> None:
        self.failures = 0
