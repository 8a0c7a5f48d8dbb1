"""Request-path counters and histograms: plain attributes, collected as Prometheus families."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from meshlet.proxy.series import Counter, Histogram


def test_a_counter_child_is_found_again_and_empty_labels_are_left_out() -> None:
    registry = CollectorRegistry()
    requests = Counter("request", "Requests.", ["direction", "client_id"], registry)
    child = requests.labels("inbound", "")
    assert requests.labels("inbound", "") is child
    child.inc()
    child.inc(2)
    assert registry.get_sample_value("request_total", {"direction": "inbound"}) == 3
    text = generate_latest(registry).decode()
    assert 'request_total{direction="inbound"} 3.0' in text
    assert "client_id" not in text and "_created" not in text


def test_the_wrong_number_of_label_values_is_refused() -> None:
    requests = Counter("request", "Requests.", ["direction"], CollectorRegistry())
    with pytest.raises(ValueError, match="2 label values"):
        requests.labels("inbound", "extra")


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=50))
def test_histogram_buckets_count_what_prometheus_would(values: list[float]) -> None:
    bounds = (1, 5, 10, 100)
    registry = CollectorRegistry()
    latency = Histogram("latency_ms", "Latency.", ["direction"], registry, bounds)
    child = latency.labels("outbound")
    for value in values:
        child.observe(value)
    for le in (*bounds, float("inf")):
        label = "+Inf" if le == float("inf") else f"{le:g}"
        got = registry.get_sample_value("latency_ms_bucket", {"direction": "outbound", "le": label})
        assert got == sum(value <= le for value in values)  # a value on a bound is in it
    assert registry.get_sample_value("latency_ms_count", {"direction": "outbound"}) == len(values)
    assert registry.get_sample_value("latency_ms_sum", {"direction": "outbound"}) == pytest.approx(
        sum(values)
    )
