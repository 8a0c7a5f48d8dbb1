"""A port's local HTTP rate limit (pure, `now` passed in), as Linkerd's `HttpLocalRateLimit`:
a total for all requests, a limit per client identity (clients without one share a bucket), and
overrides for named identities, which then skip the per-identity limit (one bucket per override,
shared by the identities it names). Each limit is a bucket of `rps` requests refilled at `rps`
a second (governor's GCRA with its default burst: a full second's worth at once).

Per-identity buckets are kept for at most `max_identities` clients: past it, the buckets that
are full again (idle a second or more) are dropped, and if none is, the least recently used
one. A dropped bucket starts full, so the bound can only let a client through early, never deny
one that is within its limit for longer than a second.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, NamedTuple

MAX_IDENTITIES: Final = 10_000


class Bucket:
    __slots__ = ("_at", "_rps", "_tokens")

    def __init__(self, rps: int, now: float) -> None:
        self._rps = rps
        self._tokens = float(rps)
        self._at = now

    def take(self, now: float) -> bool:
        elapsed = now - self._at
        if elapsed > 0:
            self._tokens = min(float(self._rps), self._tokens + elapsed * self._rps)
            self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def full(self, now: float) -> bool:
        return self._tokens + (now - self._at) * self._rps >= self._rps


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """Requests per second (None or 0: no such limit); `overrides` pairs a limit with the
    identities it applies to."""

    total: int | None = None
    identity: int | None = None
    overrides: tuple[tuple[int, frozenset[str]], ...] = ()
    meta: tuple[str, str, str] | None = None  # group, kind, name of the policy resource

    @property
    def empty(self) -> bool:
        return not self.total and not self.identity and not self.overrides


class Limited(NamedTuple):
    """A request over a limit: which (`total` or `identity`, Linkerd's `ratelimit_scope`)."""

    scope: str
    rps: int

    def reason(self) -> str:
        kind = "total" if self.scope == "total" else "per-identity"
        return f"{kind} rate limit exceeded: {self.rps}rps"


class RateLimiter:
    """The live buckets of one RateLimitSpec."""

    def __init__(self, spec: RateLimitSpec, now: float, max_identities: int = MAX_IDENTITIES):
        if max_identities < 1:
            raise ValueError("max_identities must be at least 1")
        self.spec = spec
        self._total = Bucket(spec.total, now) if spec.total else None
        self._overrides: dict[str, tuple[int, Bucket]] = {}
        for rps, ids in spec.overrides:
            if rps:
                shared = (rps, Bucket(rps, now))
                for client in ids:
                    self._overrides[client] = shared
        self._per_identity: OrderedDict[str | None, Bucket] = OrderedDict()
        self._max = max_identities

    def __len__(self) -> int:
        """Per-identity buckets held."""
        return len(self._per_identity)

    def check(self, client_id: str | None, now: float) -> Limited | None:
        """Takes one request from the buckets that apply; the limit it is over, else None."""
        total = self._total
        if total is not None and not total.take(now):
            return Limited("total", self.spec.total or 0)
        if client_id is not None:
            override = self._overrides.get(client_id)
            if override is not None:
                rps, bucket = override
                return None if bucket.take(now) else Limited("identity", rps)
        per_identity = self.spec.identity
        if not per_identity:
            return None
        buckets = self._per_identity
        held = buckets.get(client_id)
        if held is None:
            if len(buckets) >= self._max:
                self._evict(now)
            held = buckets[client_id] = Bucket(per_identity, now)
        else:
            buckets.move_to_end(client_id)
        return None if held.take(now) else Limited("identity", per_identity)

    def _evict(self, now: float) -> None:
        buckets = self._per_identity
        idle = [key for key, bucket in buckets.items() if bucket.full(now)]
        for key in idle:
            del buckets[key]
        if len(buckets) >= self._max:
            buckets.popitem(last=False)
