"""When to ask for the next certificate: renewal at 70 % of what is left, backoff on failure.

Pure timing over values (`now`, `valid_until`, a failure count and an rng); the identity manager
sleeps for what these return.

- After a certificate is obtained, renew at 70 % of its remaining lifetime, clamped to
  [`MIN_REFRESH`, `MAX_REFRESH`] = [10 s, 24 h] (DESIGN §5, as linkerd2-proxy does).
- After a failed attempt (service down, request refused, certificate rejected), retry with
  jittered exponential backoff from `FIRST_RETRY`, capped at `MAX_RETRY` = 10 s: at start this
  is how a proxy waits for identity to come up, and during renewal it keeps the promise of
  HARDENING ("retry at 70 %, then at least every 10 s") while the current certificate serves.
"""

from __future__ import annotations

import random
from typing import Final

from meshlet.api import backoff

RENEW_FRACTION: Final = 0.7
MIN_REFRESH: Final = 10.0
MAX_REFRESH: Final = 24 * 3600.0
FIRST_RETRY: Final = 0.5
MAX_RETRY: Final = 10.0


def renew_in(valid_until: float, now: float) -> float:
    """Seconds until the renewal of a certificate valid until `valid_until` (Unix time):
    70 % of the remaining lifetime, at least 10 s, at most 24 h. Arguments must be finite."""
    remaining = valid_until - now
    return min(MAX_REFRESH, max(MIN_REFRESH, RENEW_FRACTION * remaining))


def retry_ceiling(failures: int) -> float:
    """The longest wait after `failures` consecutive failures (1 → `FIRST_RETRY`, doubling,
    at most `MAX_RETRY`)."""
    return backoff.ceiling(failures, FIRST_RETRY, MAX_RETRY)


def retry_in(failures: int, rng: random.Random) -> float:
    """Seconds until the next attempt after `failures` (≥ 1) consecutive failures: a jittered
    value in [ceiling/2, ceiling] (`meshlet.api.backoff`), so never more than 10 s."""
    return backoff.jittered(failures, FIRST_RETRY, MAX_RETRY, rng)
