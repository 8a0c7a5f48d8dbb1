"""The local rate limit with an injected clock: total, per identity, overrides, and the bound
on per-identity buckets."""

from __future__ import annotations

import pytest

from meshlet.proxy.core.ratelimit import Limited, RateLimiter, RateLimitSpec

A, B, C = "a.ns.serviceaccount.identity.meshlet.cluster.local", "b.ns…", "c.ns…"


def allowed(limiter: RateLimiter, client: str | None, n: int, now: float) -> int:
    return sum(limiter.check(client, now) is None for _ in range(n))


def test_total_limits_everyone_together_and_refills_per_second() -> None:
    limiter = RateLimiter(RateLimitSpec(total=10), now=0.0)
    assert allowed(limiter, A, 6, 0.0) + allowed(limiter, None, 6, 0.0) == 10
    assert limiter.check(B, 0.0) == Limited("total", 10)
    assert allowed(limiter, B, 10, 0.5) == 5  # half a second: half the bucket back
    assert allowed(limiter, B, 20, 10.0) == 10  # never more than a second's worth


def test_each_identity_has_its_own_bucket_and_the_unauthenticated_share_one() -> None:
    limiter = RateLimiter(RateLimitSpec(identity=3), now=0.0)
    assert allowed(limiter, A, 5, 0.0) == 3
    assert allowed(limiter, B, 5, 0.0) == 3  # A's flood leaves B its share
    assert allowed(limiter, None, 2, 0.0) + allowed(limiter, None, 2, 0.0) == 3
    assert limiter.check(A, 0.0) == Limited("identity", 3)
    assert Limited("identity", 3).reason() == "per-identity rate limit exceeded: 3rps"


def test_overrides_replace_the_per_identity_limit_and_share_one_bucket() -> None:
    spec = RateLimitSpec(identity=2, overrides=((5, frozenset({A, B})),))
    limiter = RateLimiter(spec, now=0.0)
    assert allowed(limiter, A, 3, 0.0) == 3
    assert allowed(limiter, B, 5, 0.0) == 2  # A and B share their override's 5
    assert allowed(limiter, C, 5, 0.0) == 2
    assert limiter.check(A, 0.0) == Limited("identity", 5)


def test_total_is_checked_before_overrides() -> None:
    limiter = RateLimiter(RateLimitSpec(total=1, overrides=((100, frozenset({A})),)), now=0.0)
    assert limiter.check(A, 0.0) is None
    assert limiter.check(A, 0.0) == Limited("total", 1)


def test_per_identity_buckets_are_bounded() -> None:
    limiter = RateLimiter(RateLimitSpec(identity=1), now=0.0, max_identities=100)
    for i in range(1000):
        limiter.check(f"id-{i}", 0.0)
        assert len(limiter) <= 100
    # A client seen last keeps its (empty) bucket while the bound evicts older ones.
    assert limiter.check("id-999", 0.0) == Limited("identity", 1)
    # Full buckets (idle a second) go first; then the least recently used.
    assert allowed(limiter, "new", 1, 5.0) == 1
    assert len(limiter) == 1
    with pytest.raises(ValueError, match="at least 1"):
        RateLimiter(RateLimitSpec(identity=1), now=0.0, max_identities=0)


def test_no_limits_and_zero_limits_allow_everything() -> None:
    assert RateLimitSpec(total=0, identity=0).empty
    limiter = RateLimiter(RateLimitSpec(total=0, identity=0), now=0.0)
    assert allowed(limiter, A, 1000, 0.0) == 1000
