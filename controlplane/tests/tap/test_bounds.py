"""The tap controller's bounds with a clock of our own."""

from __future__ import annotations

from meshlet.controlplane.tap.bounds import RequestRate, TapSlots


def test_concurrent_taps_stop_at_the_limit_and_free_on_release() -> None:
    slots = TapSlots(2)
    assert slots.acquire() is None
    assert slots.acquire() is None
    assert slots.acquire() == "the tap controller runs its maximum of 2 concurrent taps"
    slots.release()
    assert slots.acquire() is None
    assert slots.active == 2


def test_requests_per_second_refill_with_time_and_the_rest_are_counted() -> None:
    rate = RequestRate(2.0)
    passed = [rate.request(("p", 1, n), now=10.0) for n in range(5)]
    assert passed == [True, True, False, False, False]
    assert rate.take_dropped() == 3
    assert rate.take_dropped() == 0
    assert rate.request(("p", 1, 5), now=10.25) is False  # half a token
    assert rate.request(("p", 1, 6), now=10.5) is True  # a full one after 0.5 s at 2/s
    assert rate.request(("p", 1, 7), now=100.0) is True
    assert rate.request(("p", 1, 8), now=100.0) is True  # a burst of at most one second's
    assert rate.request(("p", 1, 9), now=100.0) is False


def test_a_dropped_request_takes_its_response_and_end_along() -> None:
    rate = RequestRate(1.0)
    assert rate.request(("p", 1, 1), now=0.0)
    assert not rate.request(("p", 1, 2), now=0.0)
    assert rate.follows(("p", 1, 1), end=False)
    assert not rate.follows(("p", 1, 2), end=False)
    assert rate.follows(("p", 1, 1), end=True)
    assert not rate.follows(("p", 1, 1), end=True)  # ended: forgotten
    assert not rate.follows(("q", 1, 1), end=False)  # another proxy's stream 1
