"""Reading the proxies' metrics: rates, success, quantiles and mTLS from real proxy metrics."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.cli.stats import Scrape, combine, parse, quantile, replica_rows, row, traffic
from meshlet.proxy.metrics import ProxyMetrics

CLIENT = "web.demo.serviceaccount.identity.meshlet.cluster.local"


def serve(metrics: ProxyMetrics, status: int, ms: float, *, tls: bool = True) -> None:
    """One inbound response, recorded as the proxy's HTTP engines record it."""
    labels = metrics.conn("inbound", "10.77.1.21:9090", tls="true" if tls else "no_identity",
                          client_id=CLIENT if tls else "")  # fmt: skip
    values = (*labels.values(), "api", str(status), "", "success" if status < 500 else "failure")
    metrics.response_total.labels(*values).inc()
    metrics.response_latency_ms.labels(*values).observe(ms)


def scrape(metrics: ProxyMetrics, at: float) -> Scrape:
    return Scrape("api-1", at, parse(metrics.registry.render().decode()))


def test_a_window_counts_only_what_happened_in_it() -> None:
    metrics = ProxyMetrics()
    for _ in range(10):
        serve(metrics, 200, 3)
    before = scrape(metrics, 100.0)
    for ms in (1, 2, 3, 4, 40):
        serve(metrics, 200, ms)
    serve(metrics, 503, 1)
    serve(metrics, 200, 2, tls=False)
    after = scrape(metrics, 102.0)
    t = traffic(before, after)
    assert t.requests == 7 and t.successes == 6
    assert t.mtls_requests == 6
    assert t.peers == {CLIENT: 6}
    r = row("api", "3/3", t)
    assert r.rps == pytest.approx(3.5)
    assert r.success == pytest.approx(6 / 7)
    assert r.mtls == pytest.approx(6 / 7)
    assert r.peers == (CLIENT,)
    p50, _, p99 = r.quantiles
    assert p50 is not None and 1 < p50 <= 3
    assert p99 is not None and 30 < p99 <= 50


def test_tcp_only_workloads_report_connections_and_their_mtls() -> None:
    metrics = ProxyMetrics()
    labels = metrics.conn("inbound", "10.77.1.30:7000", tls="true", client_id=CLIENT)
    for _ in range(4):
        metrics.tcp.conn("src", labels.values()).open()
        metrics.dst_conn("inbound", ("10.77.1.30", 7000), None).open()  # to the app: not counted
    t = traffic(None, scrape(metrics, 1.0))
    assert t.connections == 4
    r = row("store", "1/1", t)
    assert r.requests == 0 and r.success is None
    assert r.mtls == 1.0 and r.peers == (CLIENT,)


def test_open_connections_are_a_level_and_bytes_a_rate() -> None:
    metrics = ProxyMetrics()
    inbound = metrics.conn("inbound", "10.77.1.30:7000", tls="true", client_id=CLIENT).values()
    outbound = metrics.conn("outbound", "10.77.1.21:9090").values()
    conns = [metrics.tcp.conn("src", inbound) for _ in range(3)]
    for conn in conns:
        conn.open()
    conns[0].read = 100
    calls = [metrics.tcp.conn("src", outbound) for _ in range(7)]  # the pod's own: not counted
    for call in calls:
        call.open()
        call.read = 10_000
    app = metrics.dst_conn("inbound", ("10.77.1.30", 7000), None)  # the proxy's, to the app
    app.open()
    app.read = 5_000
    before = scrape(metrics, 10.0)
    conns[0].close()
    conns[1].read, conns[1].written = 400, 2_000
    t = traffic(before, scrape(metrics, 12.0))
    assert (t.open_connections, t.read_bytes, t.write_bytes) == (2, 400, 2_000)
    r = row("store", "1/1", t)
    assert (r.open_connections, r.read_bytes_per_s, r.write_bytes_per_s) == (2, 200, 1_000)
    both = combine([t, t])
    assert (both.open_connections, both.read_bytes, both.write_bytes) == (4, 800, 4_000)


def test_replica_shares_add_up() -> None:
    a, b = ProxyMetrics(), ProxyMetrics()
    for _ in range(3):
        serve(a, 200, 1)
    serve(b, 200, 60)
    by_pod = {"api-1": traffic(None, scrape(a, 1)), "api-3": traffic(None, scrape(b, 1))}
    rows = replica_rows(by_pod, ["api-1", "api-2", "api-3"])
    assert [(r.name, r.share) for r in rows] == [("api-1", 0.75), ("api-3", 0.25)]
    assert combine(by_pod.values()).requests == 4


def test_quantile_interpolates_within_buckets_as_prometheus_does() -> None:
    buckets = {1.0: 0.0, 2.0: 10.0, 4.0: 20.0, math.inf: 20.0}
    assert quantile(0.5, buckets) == pytest.approx(2.0)
    assert quantile(0.25, buckets) == pytest.approx(1.5)
    assert quantile(0.75, buckets) == pytest.approx(3.0)
    assert quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {1.0: 1.0, math.inf: 10.0}) == 1.0  # past the last finite bound


@given(st.lists(st.sampled_from([1, 2, 3, 5, 10, 50, 100]), min_size=1, max_size=50),
       st.floats(min_value=0.01, max_value=0.99))  # fmt: skip
def test_quantiles_stay_within_the_observed_buckets(values: list[int], q: float) -> None:
    metrics = ProxyMetrics()
    for ms in values:
        serve(metrics, 200, ms)
    t = traffic(None, scrape(metrics, 1.0))
    result = row("api", "", t).quantiles
    assert all(v is not None and 0 <= v <= max(values) for v in result)
    assert result == tuple(sorted(result, key=lambda v: v or 0))  # p50 <= p95 <= p99
    assert quantile(q, t.latency) is not None


def test_authorization_allowed_and_denied_count_connections_and_requests() -> None:
    """The authz counters as the proxy's inbound records them: opaque connections and HTTP
    requests add up, and each denial is kept with the identity it refused."""
    metrics = ProxyMetrics()
    other = "api.demo.serviceaccount.identity.meshlet.cluster.local"
    srv = ("10.77.1.30:7000", "policy.meshlet.io", "server", "store")
    authz = ("policy.meshlet.io", "authorizationpolicy", "store")
    allow = metrics.inbound_tcp_authz_allow_total.labels(*srv, *authz, "true", "", CLIENT)
    deny = metrics.inbound_tcp_authz_deny_total.labels(*srv, "true", "", other)
    route = (*srv, "", "default", "default")
    allow.inc(5)
    before = scrape(metrics, 10.0)
    allow.inc(20)
    deny.inc(3)
    metrics.inbound_http_authz_allow_total.labels(*route, *authz, "true", "", CLIENT).inc(2)
    metrics.inbound_http_authz_deny_total.labels(*route, "no_identity", "plain", "").inc()
    t = traffic(before, scrape(metrics, 12.0))
    assert (t.allowed, t.denied) == (22, 4)
    assert t.denied_peers == {other: 3, "": 1}
    assert t.allowed_peers == {CLIENT: 22}
    r = row("store", "1/1", combine([t, t]))
    assert (r.allowed, r.denied) == (44, 8)
    assert r.denied_peers == (other,)  # the unauthenticated client has no identity to show
