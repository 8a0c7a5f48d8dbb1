"""The metrics API's pure parts: which series each question selects, the selector's escapes,
the limits on input, and reading Prometheus' answers (a real Prometheus runs the queries in
test_viz.py)."""

from __future__ import annotations

import json

import pytest

from meshlet.cli import stats, vizmetrics
from meshlet.cli.vizmetrics import MetricsError, Target, stat_query
from meshlet.controlplane import vizmetrics as cpmetrics


def test_inbound_by_default_outbound_with_to_and_from() -> None:
    web = vizmetrics.target("deploy/web", "demo")
    assert stat_query(web).labels == {
        "direction": "inbound", "namespace": "demo", "deployment": "web"
    }  # fmt: skip
    to = stat_query(web, to=vizmetrics.target("deploy/api", "demo"))
    assert to.labels == {"direction": "outbound", "namespace": "demo", "deployment": "web",
                         "dst_namespace=~": "demo|", "dst_deployment": "api"}  # fmt: skip
    assert to.key == "deployment"
    src = stat_query(vizmetrics.target("deploy/api", "demo"), src=web)
    assert (src.key, src.ns_key) == ("dst_deployment", "dst_namespace")
    assert src.labels["deployment"] == "web" and src.labels["dst_deployment"] == "api"
    svc = stat_query(vizmetrics.target("svc", "demo"))
    assert svc.labels["direction"] == "outbound" and svc.key == "dst_service"


def test_selector_escapes_and_matches() -> None:
    got = vizmetrics.selector({"a": 'x"y', "dst_namespace=~": "demo|"})
    assert got == '{a="x\\"y", dst_namespace=~"demo|"}'


def test_authority_has_no_tcp_queries() -> None:
    q = stat_query(Target("authority", None, "demo"))
    assert not any("tcp_" in promql for promql in vizmetrics.stat_queries(q, "1m").values())
    assert len(vizmetrics.stat_queries(stat_query(Target("pod")), "1m")) == 7


def test_routes_count_attempts_only_when_sending() -> None:
    web = Target("deployment", "web", "demo")
    assert "actual_requests" not in vizmetrics.route_queries(web, "1m")
    out = vizmetrics.route_queries(web, "1m", to=Target("service", "api", "demo"))
    assert 'dst=~"api[.]demo[.]svc[.].+"' in out["actual_requests"]


@pytest.mark.parametrize("text", ["widgets", "deploy/", ""])
def test_bad_resources(text: str) -> None:
    if text == "deploy/":
        assert vizmetrics.target(text, "demo") == Target("deployment", None, "demo")
        return
    with pytest.raises(ValueError, match="unknown resource type"):
        vizmetrics.target(text, "demo")


@pytest.mark.parametrize("text", ["0s", "1d", "10", "-1m", "1m30s", ""])
def test_bad_windows(text: str) -> None:
    with pytest.raises(ValueError, match="not a window"):
        vizmetrics.window(text)
    assert vizmetrics.seconds(vizmetrics.window("90s")) == 90


def test_answers_that_are_not_vectors_are_errors() -> None:
    with pytest.raises(MetricsError, match="not JSON"):
        cpmetrics._vector("up", b"<html>")
    with pytest.raises(MetricsError, match="refused up: bad"):
        cpmetrics._vector("up", json.dumps({"status": "error", "error": "bad"}).encode())
    matrix = {"status": "success", "data": {"resultType": "matrix", "result": []}}
    with pytest.raises(MetricsError, match="not an instant vector"):
        cpmetrics._vector("up", json.dumps(matrix).encode())
    with pytest.raises(MetricsError, match="not an http"):
        vizmetrics.Prometheus("localhost:9090")


def test_direct_stat_is_what_meshlet_stat_computes() -> None:
    text = (
        "# TYPE response_total counter\n"
        'response_total{direction="inbound",classification="success",tls="true"} 10\n'
        'response_total{direction="inbound",classification="failure",tls="true"} 0\n'
    )
    later = text.replace("} 10", "} 30").replace("} 0", "} 10")
    proxy = vizmetrics.Proxy("web-1", "web", "demo", "http://127.0.0.1:1")
    first = {"web-1": stats.Scrape("web-1", 0.0, stats.parse(text))}
    second = {"web-1": stats.Scrape("web-1", 10.0, stats.parse(later))}
    [row] = vizmetrics.direct_stat([proxy], "deployment", first, second)
    assert (row.name, row.requests, row.success, row.rps, row.mtls) == ("web", 30, 2 / 3, 3, 1)
