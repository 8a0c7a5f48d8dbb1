"""The balancer with a simulated clock: slow and busy endpoints lose traffic."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshlet.proxy.outbound.balance import Balancer, NoEndpoints


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_empty_set_fails_fast() -> None:
    with pytest.raises(NoEndpoints):
        Balancer[str]().pick()


def test_a_slow_endpoint_is_avoided_after_warm_up() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(3))
    balancer.update(["a", "b", "slow"])
    rtt = {"a": 0.002, "b": 0.002, "slow": 0.052}
    picks: Counter[str] = Counter()
    for i in range(2000):
        lease = balancer.pick()
        clock.now += rtt[lease.endpoint]
        lease.responded()
        lease.release()
        clock.now += 0.001
        if i >= 200:  # after warm-up
            picks[lease.endpoint] += 1
    assert picks["slow"] / sum(picks.values()) < 0.10


def test_pending_requests_spread_load() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(5))
    balancer.update(["a", "b"])
    held = [balancer.pick() for _ in range(10)]  # none completes
    assert Counter(lease.endpoint for lease in held) == {"a": 5, "b": 5}


def test_statistics_survive_updates_for_remaining_endpoints() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1))
    balancer.update(["a", "b"])
    lease = balancer.pick()
    clock.now += 1.0
    lease.release()
    slow = lease.endpoint
    balancer.update(["a", "b", "c"])
    assert balancer.load(slow) == pytest.approx(1.0)
    balancer.update(["c"])
    assert balancer.endpoints == ["c"]


def test_release_is_idempotent_and_counts_a_failure_as_a_sample() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1))
    balancer.update(["a"])
    lease = balancer.pick()
    clock.now += 0.5
    lease.release()
    lease.release()
    assert balancer.load("a") == pytest.approx(0.5)  # pending back to 0, sample 0.5 s
