"""The proxy's metrics as Prometheus scrapes them: TCP counts summed from live connections,
labels without a value left out, `dst_*` labels from discovery, no `_created` series."""

from __future__ import annotations

import errno
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshlet.proxy.io.counters import DST_LABELS, TcpConn, dst_values
from meshlet.proxy.metrics import ProxyMetrics


def scrape(metrics: ProxyMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What a scrape reads, parsed back from the text exposition: samples by name."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.registry.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_tcp_counts_include_live_connections_and_move_to_totals_on_close() -> None:
    metrics = ProxyMetrics()
    client_id = "web.ns.serviceaccount.identity.meshlet.cluster.local"
    labels = metrics.conn("inbound", "10.0.0.1:8080", tls="true", no_tls_reason="",
                          client_id=client_id)  # fmt: skip
    first, second = (metrics.tcp.conn("src", labels.values()) for _ in range(2))
    first.open()
    second.open()
    first.read, first.written = 100, 7
    second.read = 1
    second.close(ConnectionResetError(errno.ECONNRESET, "reset"))
    second.read += 50  # after the close: not counted
    first.read += 20  # live: counted at the next scrape
    got = scrape(metrics)
    want = {"peer": "src", "direction": "inbound", "target_addr": "10.0.0.1:8080", "tls": "true",
            "client_id": client_id}  # fmt: skip
    assert got["tcp_open_total"] == [(want, 2.0)]
    assert got["tcp_open_connections"] == [(want, 1.0)]
    assert got["tcp_read_bytes_total"] == [(want, 121.0)]
    assert got["tcp_write_bytes_total"] == [(want, 7.0)]
    assert got["tcp_close_total"] == [({**want, "errno": "ECONNRESET"}, 1.0)]
    assert got["tcp_connection_duration_ms_count"] == [(want, 1.0)]
    first.close()
    first.close()  # counted once
    got = scrape(metrics)
    assert got["tcp_open_connections"] == [(want, 0.0)]
    assert sorted(value for _, value in got["tcp_close_total"]) == [1.0, 1.0]  # "" and reset


def test_a_connection_closed_before_it_opened_counts_nothing() -> None:
    metrics = ProxyMetrics()
    failed = metrics.dst_conn("outbound", ("10.0.0.9", 80), None)  # the connect failed
    failed.written = 10
    failed.close(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert "tcp_open_total" not in scrape(metrics)
    uncounted = TcpConn.uncounted()
    uncounted.open()
    uncounted.close()
    assert "tcp_open_total" not in scrape(metrics)


def test_connection_durations_fall_in_their_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = ProxyMetrics()
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    for seconds in (0.0005, 0.05, 5.0, 50_000.0):
        conn = metrics.dst_conn("inbound", ("10.0.0.1", 8080), None)
        conn.open()
        now[0] += seconds
        conn.close()
    buckets = {labels["le"]: value for labels, value in
               scrape(metrics)["tcp_connection_duration_ms_bucket"]}  # fmt: skip
    assert buckets["1"] == 1  # 0.5 ms
    assert buckets["100"] == 2  # + 50 ms
    assert buckets["10000"] == 3  # + 5 s
    assert buckets["10000000"] == 3 and buckets["+Inf"] == 4  # 50,000 s is past every bound


def test_plain_connections_the_proxy_opens_say_why_they_have_no_tls() -> None:
    metrics = ProxyMetrics()
    for direction in ("inbound", "outbound"):
        conn = metrics.dst_conn(direction, ("10.0.0.1", 8080), None)
        conn.open()
    reasons = {labels["direction"]: labels["no_tls_reason"]
               for labels, _ in scrape(metrics)["tcp_open_total"]}  # fmt: skip
    assert reasons == {"inbound": "loopback", "outbound": "not_provided_by_service_discovery"}


def test_destination_labels_become_dst_labels_and_unknown_ones_are_dropped() -> None:
    endpoint = [("namespace", "emojivoto"), ("service", "web"), ("pod", "web-1"),
                ("deployment", "web"), ("serviceaccount", "web"), ("cluster", "east"),
                ("zone", "")]  # fmt: skip
    values = dst_values(endpoint)
    assert len(values) == len(DST_LABELS)
    metrics = ProxyMetrics()
    labels = metrics.conn("outbound", "10.0.0.1:8080", values, tls="true", no_tls_reason="",
                          server_id="web.emojivoto.serviceaccount.identity")  # fmt: skip
    metrics.request_total.labels(*labels.values(), "web.emojivoto.svc.cluster.local:80").inc()
    ((got, value),) = scrape(metrics)["request_total"]
    assert value == 1
    assert {k: v for k, v in got.items() if k.startswith("dst_")} == {
        "dst_namespace": "emojivoto", "dst_service": "web", "dst_pod": "web-1",
        "dst_deployment": "web", "dst_serviceaccount": "web",
    }  # fmt: skip
    assert "client_id" not in got  # no value: left out, as Linkerd leaves it out


def test_process_and_build_series_and_no_created_twins() -> None:
    metrics = ProxyMetrics()
    metrics.request_total.labels(*metrics.conn("inbound", "10.0.0.1:80").values(), "a").inc()
    metrics.response_latency_ms.labels(
        *metrics.conn("inbound", "10.0.0.1:80").values(), "a", "200", "", "success"
    ).observe(3)
    metrics.tcp.conn("src", metrics.conn("inbound", "10.0.0.1:80").values()).open()
    got = scrape(metrics)
    assert not [name for name in got if name.endswith("_created")]
    assert got["process_resident_memory_bytes"][0][1] > 1_000_000
    assert got["process_start_time_seconds"][0][1] > 0
    assert "process_cpu_seconds_total" in got
    ((build, value),) = got["proxy_build_info"]
    assert value == 1 and build["vendor"] == "meshlet" and build["version"]
