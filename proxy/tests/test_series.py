"""Request-path counters and histograms: plain attributes, collected as Prometheus families."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from meshlet.proxy.series import Counter, Gauge, Histogram, ProcessMetrics, Registry


def test_a_counter_child_is_found_again_and_empty_labels_are_left_out() -> None:
    registry = Registry()
    requests = Counter("request", "Requests.", ["direction", "client_id"], registry)
    child = requests.labels("inbound", "")
    assert requests.labels("inbound", "") is child
    child.inc()
    child.inc(2)
    assert registry.get_sample_value("request_total", {"direction": "inbound"}) == 3
    text = registry.render().decode()
    assert 'request_total{direction="inbound"} 3.0' in text
    assert "client_id" not in text and "_created" not in text


def test_the_wrong_number_of_label_values_is_refused() -> None:
    requests = Counter("request", "Requests.", ["direction"], Registry())
    with pytest.raises(ValueError, match="2 label values"):
        requests.labels("inbound", "extra")


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=50))
def test_histogram_buckets_count_what_prometheus_would(values: list[float]) -> None:
    bounds = (1, 5, 10, 100)
    registry = Registry()
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


def test_the_text_format_is_read_back_by_prometheus_clients_parser() -> None:
    """The rendering, escapes included, read by an independent parser."""
    registry = Registry()
    requests = Counter("request", "Requests, \\ and\nnewline.", ["path", "direction"], registry)
    requests.labels('a "quoted" \\ path\nwith a newline', "inbound").inc(2)
    latency = Histogram("latency_ms", "Latency.", ["direction"], registry, (1, 10))
    latency.labels("outbound").observe(5)
    build = Gauge("build_info", "Build.", registry, ["version"])
    build.labels("1.2.3").set(1)
    expires = Gauge("expires_seconds", "Expiry.", registry)
    expires.set(1.5e9)
    ProcessMetrics(registry)
    families = {f.name: f for f in text_string_to_metric_families(registry.render().decode())}
    (sample,) = families["request"].samples
    assert families["request"].type == "counter"
    assert families["request"].documentation == "Requests, \\ and\nnewline."
    assert sample.labels == {"path": 'a "quoted" \\ path\nwith a newline', "direction": "inbound"}
    assert sample.value == 2
    buckets = {s.labels["le"]: s.value for s in families["latency_ms"].samples
               if s.name == "latency_ms_bucket"}  # fmt: skip
    assert buckets == {"1": 0, "10": 1, "+Inf": 1}
    assert families["build_info"].samples[0].labels == {"version": "1.2.3"}
    assert families["expires_seconds"].samples[0].value == 1.5e9
    process = {name: families[name].samples[0].value for name in families
               if name.startswith("process_")}  # fmt: skip
    assert set(process) == {"process_cpu_seconds", "process_virtual_memory_bytes",
                            "process_resident_memory_bytes", "process_start_time_seconds",
                            "process_open_fds", "process_max_fds"}  # fmt: skip
    assert 1e6 < process["process_resident_memory_bytes"] < 1e10
    assert abs(process["process_start_time_seconds"] - time.time()) < 3600 * 24 * 365
    assert process["process_open_fds"] >= 3


def test_a_large_registry_renders_in_pieces_of_bounded_size() -> None:
    registry = Registry()
    latency = Histogram("latency_ms", "Latency.", ["authority"], registry, (1, 5, 10, 100))
    for n in range(600):
        latency.labels(f"svc-{n}:80").observe(3.0)
    pieces = list(registry.render_chunks(samples=1000))
    assert b"".join(pieces) == registry.render()
    assert len(pieces) == 5  # 600 x 7 samples (and two lines of HELP and TYPE), 1,000 a piece
    assert all(piece.count(b"\n") <= 1000 for piece in pieces)
    families = list(text_string_to_metric_families(b"".join(pieces).decode()))
    assert [f.name for f in families] == ["latency_ms"] and len(families[0].samples) == 4200
