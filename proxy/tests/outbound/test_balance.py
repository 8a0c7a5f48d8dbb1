"""The balancer with a simulated clock: slow and busy endpoints lose traffic."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.accrual import FailureAccrual, State
from meshlet.proxy.outbound.balance import (
    FAILURE_BACKOFF,
    MAX_FAILURE_BACKOFF,
    AllEjected,
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
    balancer.set_accrual(ACCRUAL)
    balancer.update(["a", "b", "c"])
    assert all(balancer.breaker(ep) is not None for ep in "abc")
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


# -- failure accrual ---------------------------------------------------------------------------

ACCRUAL = FailureAccrual(max_failures=3, min_penalty=1.0, max_penalty=8.0, jitter=0.0)


def serve(balancer: Balancer[str], clock: Clock, sick: set[str], n: int) -> Counter[str]:
    """`n` requests one after another; those on a `sick` endpoint fail. Where each went."""
    went: Counter[str] = Counter()
    for _ in range(n):
        lease = balancer.pick()
        went[lease.endpoint] += 1
        clock.now += 0.001
        lease.responded()
        lease.outcome(lease.endpoint not in sick)
        lease.release()
    return went


def test_without_accrual_outcomes_change_nothing() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1))
    balancer.update(["a", "b", "sick"])
    went = serve(balancer, clock, {"sick"}, 300)
    assert went["sick"] > 60 and balancer.breaker("sick") is None


def test_an_endpoint_failing_in_a_row_is_ejected_then_probed_once_per_penalty() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1), accrual=ACCRUAL)
    balancer.update(["a", "b", "sick"])
    went = serve(balancer, clock, {"sick"}, 300)  # 0.3s: no probe yet
    assert went["sick"] == 3
    clock.now = 1.5  # past the first penalty (1s): one probe, which fails; then 2s
    went = serve(balancer, clock, {"sick"}, 500)
    assert went["sick"] == 1
    clock.now = 10.0
    went = serve(balancer, clock, set(), 600)  # healed: the probe succeeds, traffic returns
    assert went["sick"] > 100


def test_a_probe_in_flight_keeps_other_requests_off_the_endpoint() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(2), accrual=ACCRUAL)
    balancer.update(["a", "sick"])
    for _ in range(3):
        lease = balancer.pick(avoid="a")
        lease.outcome(False)
        lease.release()
    clock.now = 2.0
    probe = next(lease for lease in iter(balancer.pick, None) if lease.endpoint == "sick")
    others = [balancer.pick() for _ in range(50)]
    assert {lease.endpoint for lease in others} == {"a"}
    probe.release()  # its client left: no outcome, the next request may probe
    assert any(balancer.pick().endpoint == "sick" for _ in range(50))


def test_every_endpoint_ejected_fails_fast_and_says_why() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1), accrual=ACCRUAL)
    balancer.update(["a", "b"])
    serve(balancer, clock, {"a", "b"}, 6)
    with pytest.raises(AllEjected) as caught:
        balancer.pick()
    assert isinstance(caught.value, NoEndpoints)
    assert "all 2 endpoints failed too often in a row" in str(caught.value)
    clock.now += 1.0
    assert balancer.pick().endpoint in {"a", "b"}  # a probe is due


def test_a_connection_that_failed_counts_as_a_failure_and_keeps_its_backoff() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1), accrual=ACCRUAL)
    balancer.update(["a"])
    for _ in range(3):
        lease = balancer.pick()
        lease.failed()
        lease.outcome(True)  # ignored: the failure was its outcome
        lease.release()
    breaker = balancer.breaker("a")
    assert breaker is not None and breaker.state is State.EJECTED
    assert balancer.backing_off("a")


def test_turning_accrual_on_and_off_keeps_the_endpoints() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1))
    balancer.update(["a", "b"])
    balancer.set_accrual(ACCRUAL)
    serve(balancer, clock, {"a", "b"}, 6)
    with pytest.raises(AllEjected):
        balancer.pick()
    balancer.set_accrual(ACCRUAL)  # the same settings: nothing changes
    with pytest.raises(AllEjected):
        balancer.pick()
    balancer.set_accrual(None)
    assert balancer.pick().endpoint in {"a", "b"} and balancer.breaker("a") is None
    balancer.set_accrual(ACCRUAL)
    balancer.update(["a", "b", "c"])
    assert all(balancer.breaker(ep) is not None for ep in "abc")


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(0, 3), st.sampled_from(["ok", "fail", "gone"])),
        max_size=150,
    ),
    st.integers(0, 2**32 - 1),
)
def test_never_two_probes_and_back_only_after_a_success(
    ops: list[tuple[int, float, str]], seed: int
) -> None:
    """Requests overlap: each op picks (when anything is admitted), lets time pass, and ends
    one request in flight. No ejected endpoint ever has two probes in flight, none is picked
    outside its probe, and one comes back only on its probe's success."""
    clock = Clock()
    policy = FailureAccrual(max_failures=2, min_penalty=0.5, max_penalty=4.0, jitter=0.5)
    balancer: Balancer[int] = Balancer(clock=clock, rng=random.Random(seed), accrual=policy)
    balancer.update(range(3))
    flying: list[Lease[int]] = []
    for which, dt, how in ops:
        clock.now += dt
        states = {ep: balancer.breaker(ep).state for ep in range(3)}  # type: ignore[union-attr]
        try:
            lease = balancer.pick()
        except AllEjected:
            assert all(s is not State.READY for s in states.values())
        else:
            assert states[lease.endpoint] is not State.PROBING
            flying.append(lease)
        if flying:
            done = flying.pop(which % len(flying))
            before = balancer.breaker(done.endpoint).state  # type: ignore[union-attr]
            if how != "gone":
                done.outcome(how == "ok")
            done.release()
            after = balancer.breaker(done.endpoint).state  # type: ignore[union-attr]
            if before is not State.READY and after is State.READY:
                assert how == "ok" and done._probe
        for ep in range(3):
            probes = [lease for lease in flying if lease.endpoint == ep and lease._probe]
            assert len(probes) <= 1
            assert bool(probes) == (balancer.breaker(ep).state is State.PROBING)  # type: ignore[union-attr]
    for lease in flying:
        lease.release()
    assert all(balancer._stats[ep].ewma.pending == 0 for ep in range(3))


def test_requests_in_flight_when_accrual_is_turned_on_or_off_end_cleanly() -> None:
    clock = Clock()
    balancer: Balancer[str] = Balancer(clock=clock, rng=random.Random(1))
    balancer.update(["a"])
    before = balancer.pick()
    balancer.set_accrual(ACCRUAL)
    before.outcome(False)  # picked before: not counted
    before.release()
    breaker = balancer.breaker("a")
    assert breaker is not None and breaker.failures == 0
    serve(balancer, clock, {"a"}, 3)
    clock.now += 1.0
    probe = balancer.pick()
    balancer.set_accrual(None)
    probe.release()  # its breaker is gone: nothing to give way to
    assert balancer.pick().endpoint == "a"
