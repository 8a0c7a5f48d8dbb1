"""The balancer with a simulated clock: slow and busy endpoints lose traffic."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.outbound.balance import (
    FAILURE_BACKOFF,
    MAX_FAILURE_BACKOFF,
    Balancer,
    Lease,
    NoEndpoints,
)


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


@given(st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_a_retry_avoids_the_endpoint_its_request_failed_on(count: int, seed: int) -> None:
    balancer: Balancer[int] = Balancer(clock=Clock(), rng=random.Random(seed))
    balancer.update(range(count))
    for _ in range(20):
        failed_on = balancer.pick()
        failed_on.release()
        retry = balancer.pick(avoid=failed_on.endpoint)
        retry.release()
        # the same endpoint only when it is the only one
        assert (retry.endpoint == failed_on.endpoint) == (count == 1)


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


def _pick(balancer: Balancer[str], clock: Clock, wanted: str) -> Lease[str]:
    """A lease on `wanted`: the others stay busy until it comes up, then answer slowly."""
    held = []
    while (lease := balancer.pick()).endpoint != wanted:
        held.append(lease)
    clock.now += 0.1
    for other in held:
        other.release()
    return lease


def test_an_unreachable_endpoint_backs_off_then_returns() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(2))
    balancer.update(["a", "b", "dead"])
    lease = _pick(balancer, clock, "dead")
    lease.failed()
    lease.release()  # after failed: nothing more
    assert balancer.backing_off("dead")
    assert all(balancer.pick().endpoint != "dead" for _ in range(200))
    clock.now += FAILURE_BACKOFF + 0.001
    assert not balancer.backing_off("dead")
    # Failing again doubles the backoff; a response resets the count.
    lease = _pick(balancer, clock, "dead")
    lease.failed()
    clock.now += FAILURE_BACKOFF + 0.001
    assert balancer.backing_off("dead")
    clock.now += FAILURE_BACKOFF
    lease = _pick(balancer, clock, "dead")
    lease.responded()
    lease.failed()  # too late: it answered
    lease.release()
    assert not balancer.backing_off("dead")


def test_every_endpoint_backing_off_leaves_them_all_candidates() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(4))
    balancer.update(["a", "b"])
    for _ in range(2):
        balancer.pick().failed()
    assert balancer.backing_off("a") or balancer.backing_off("b")
    picks = {balancer.pick().endpoint for _ in range(50)}
    assert picks <= {"a", "b"} and picks


@given(
    failures=st.integers(min_value=1, max_value=40),
    endpoints=st.integers(min_value=2, max_value=6),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_is_bounded_and_pending_counts_return_to_zero(
    failures: int, endpoints: int, seed: int
) -> None:
    clock = Clock()
    balancer: Balancer[int] = Balancer(clock=clock, rng=random.Random(seed))
    balancer.update(range(endpoints))
    for _ in range(failures):
        lease = balancer.pick()
        lease.failed()
        assert balancer._stats[lease.endpoint].down_until <= clock.now + MAX_FAILURE_BACKOFF
    clock.now += MAX_FAILURE_BACKOFF + 0.001
    assert not any(balancer.backing_off(ep) for ep in range(endpoints))
    assert all(balancer._stats[ep].ewma.pending == 0 for ep in range(endpoints))


def test_a_slow_endpoint_is_probed_again_as_its_estimate_decays() -> None:
    """Under steady traffic the avoided endpoint's estimate decays until it is tried again:
    a replica that recovers gets traffic back (at most every ~decay * ln(slow/fast) seconds
    while it stays slow)."""
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(7))
    balancer.update(["a", "b", "slow"])
    rtt = {"a": 0.002, "b": 0.002, "slow": 0.052}
    probes = []
    while clock.now < 120.0:
        lease = balancer.pick()
        clock.now += rtt[lease.endpoint]
        lease.release()
        clock.now += 0.010
        if lease.endpoint == "slow" and clock.now > 5.0:
            probes.append(clock.now)
    assert 2 <= len(probes) <= 20, probes
    rtt["slow"] = 0.002  # it recovered: after its next probe it shares the traffic again
    picks: Counter[str] = Counter()
    start = clock.now
    while clock.now < start + 60.0:
        lease = balancer.pick()
        clock.now += rtt[lease.endpoint]
        lease.release()
        clock.now += 0.010
        if clock.now > start + 40.0:
            picks[lease.endpoint] += 1
    assert picks["slow"] / sum(picks.values()) > 0.2, picks
