"""Abuse accounting for an HTTP/2 connection, with a clock the test turns."""

from __future__ import annotations

from meshlet.proxy.http.h2guard import Guard, GuardLimits

LIMITS = GuardLimits(window=10.0, min_resets=100, reset_ratio=0.5, control_base=1000)


def test_rapid_reset_trips_once_resets_dominate() -> None:
    guard = Guard(LIMITS, now=0.0)
    verdicts = []
    for i in range(150):
        guard.stream_opened()
        verdicts.append(guard.stream_reset(now=i * 0.01))
    assert verdicts[:99] == [None] * 99
    assert verdicts[99] is not None and "rapid reset" in verdicts[99]


def test_a_few_cancellations_among_many_requests_are_fine() -> None:
    guard = Guard(LIMITS, now=0.0)
    for i in range(5000):
        guard.stream_opened()
        if i % 5 == 0:  # 20 % of requests cancelled: 1,000 resets
            assert guard.stream_reset(now=i * 0.001) is None


def test_refused_streams_count_as_resets() -> None:
    guard = Guard(LIMITS, now=0.0)
    for _ in range(300):
        guard.stream_opened()  # streams the proxy took
    verdicts = [guard.stream_reset(now=1.0) for _ in range(151)]  # and ones it refused
    assert verdicts[-1] is not None and all(v is None for v in verdicts[:-1])  # > half


def test_resets_age_out_of_the_window() -> None:
    guard = Guard(LIMITS, now=0.0)
    for i in range(99):
        assert guard.stream_reset(now=i * 0.01) is None
    assert guard.stream_reset(now=25.0) is None  # two windows later: forgotten
    for i in range(98):
        assert guard.stream_reset(now=25.0 + i * 0.01) is None
    assert guard.stream_reset(now=25.99) is not None


def test_control_frames_are_allowed_in_proportion_to_useful_work() -> None:
    guard = Guard(LIMITS, now=0.0)
    assert all(guard.control_frame(now=0.0) is None for _ in range(1000))
    assert guard.control_frame(now=0.0) is not None
    busy = Guard(LIMITS, now=0.0)
    busy.data_sent(1000)  # a download: its WINDOW_UPDATEs are earned
    assert all(busy.control_frame(now=0.0) is None for _ in range(4000))


def test_a_steady_trickle_of_pings_is_fine_forever() -> None:
    guard = Guard(LIMITS, now=0.0)
    for second in range(100_000):
        assert guard.control_frame(now=float(second)) is None  # one ping a second


def test_empty_frames_in_a_row_trip_and_data_resets_the_run() -> None:
    guard = Guard(GuardLimits(max_empty_run=3), now=0.0)
    assert [guard.data_frame(empty=True) for _ in range(3)] == [None] * 3
    assert guard.data_frame(empty=False) is None
    assert [guard.data_frame(empty=True) for _ in range(3)] == [None] * 3
    assert guard.data_frame(empty=True) is not None


def test_the_write_buffer_bound() -> None:
    guard = Guard(GuardLimits(max_write_buffer=100), now=0.0)
    assert guard.write_buffer(100) is None
    assert guard.write_buffer(101) is not None
