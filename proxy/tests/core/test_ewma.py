"""Peak-EWMA: peaks are taken at once, lower samples decay in, pending requests add load."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.ewma import DEFAULT_RTT, PeakEwma


def test_starts_at_the_default_rtt() -> None:
    assert PeakEwma().load(now=5.0) == DEFAULT_RTT


def test_a_peak_replaces_the_estimate_at_once() -> None:
    ewma = PeakEwma()
    ewma.observe(0.010, now=0.0)  # first sample is taken as is
    ewma.observe(0.500, now=0.001)
    assert ewma.estimate == 0.500


def test_lower_samples_decay_in_with_time() -> None:
    ewma = PeakEwma(decay=10.0)
    ewma.observe(1.0, now=0.0)
    ewma.observe(0.0, now=10.0)  # one decay period: weight e^-1 on the old value
    assert math.isclose(ewma.estimate, math.exp(-1))
    soon = PeakEwma(decay=10.0)
    soon.observe(1.0, now=0.0)
    soon.observe(0.0, now=0.1)  # barely any time: the old value dominates
    assert soon.estimate > 0.99


def test_pending_requests_multiply_the_load() -> None:
    ewma = PeakEwma()
    ewma.observe(0.020, now=0.0)
    ewma.pending = 3
    assert math.isclose(ewma.load(now=0.0), 0.080)


def test_without_samples_the_load_decays_toward_zero() -> None:
    """A slow endpoint that stopped getting requests looks faster as time passes (Linkerd's
    RttEstimate::decay), so it is tried again."""
    ewma = PeakEwma(decay=10.0)
    ewma.observe(0.050, now=0.0)
    assert math.isclose(ewma.load(now=0.0), 0.050)
    assert math.isclose(ewma.load(now=10.0), 0.050 * math.exp(-1))
    assert math.isclose(ewma.load(now=20.0), 0.050 * math.exp(-2))  # read twice: same curve
    ewma.observe(0.040, now=20.0)  # a peak above the decayed estimate is taken at once
    assert ewma.estimate == 0.040


def test_the_default_estimate_decays_from_the_first_look() -> None:
    ewma = PeakEwma(decay=10.0)
    assert ewma.load(now=100.0) == DEFAULT_RTT
    assert math.isclose(ewma.load(now=110.0), DEFAULT_RTT * math.exp(-1))


@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 100.0)), min_size=1, max_size=50))
def test_estimate_stays_within_the_samples_seen(samples: list[tuple[float, float]]) -> None:
    ewma = PeakEwma()
    now = 0.0
    for rtt, gap in samples:
        now += gap
        ewma.observe(rtt, now)
    rtts = [rtt for rtt, _ in samples]
    assert min(rtts) - 1e-9 <= ewma.estimate <= max(rtts) + 1e-9
