"""What one connection's recorder counts: per request, per response given to the client, per
attempt sent upstream, with the connection's labels or the endpoint's, and each response
classified by its route."""

from __future__ import annotations

import pytest

from meshlet.api.hostport import HostPort
from meshlet.proxy.core.routes import DEFAULT_ROUTE, ResponseClass, RoutePolicy, StatusRange
from meshlet.proxy.fixed_router import FixedPicker
from meshlet.proxy.http.contract import Endpoint, RouteTarget
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.metrics import ProxyMetrics

POD = HostPort("10.0.0.7", 8080)
WEB = "web.ns.svc.cluster.local:80"


def value(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        sample.value
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def label_sets(metrics: ProxyMetrics, name: str) -> list[dict[str, str]]:
    return [
        sample.labels
        for metric in metrics.registry.collect()
        for sample in metric.samples
        if sample.name == name
    ]


def route(policy: RoutePolicy = DEFAULT_ROUTE, dst: str = WEB) -> RouteTarget:
    return RouteTarget(dst, policy, None, FixedPicker(Endpoint(POD, dst)))


def inbound() -> tuple[ProxyMetrics, Recorder]:
    metrics = ProxyMetrics()
    return metrics, Recorder(metrics, metrics.conn("inbound", "10.0.0.7:8080"))


ITEMS = RoutePolicy(
    "GET /items/{id}",
    classes=(ResponseClass(StatusRange(404, 404), is_failure=True),
             ResponseClass(StatusRange(500, 599), is_failure=False)),
)  # fmt: skip


def test_a_request_is_counted_with_the_connections_labels_and_its_authority() -> None:
    metrics, recorder = inbound()
    recorder.request("web:80", None, None)
    recorder.request("web:80", None, None)
    [labels] = label_sets(metrics, "request_total")
    assert labels["direction"] == "inbound" and labels["target_addr"] == "10.0.0.7:8080"
    assert labels["authority"] == "web:80" and labels["tls"] == "no_identity"
    assert value(metrics, "request_total") == 2
    assert value(metrics, "route_request_total") == 0  # no route: no route metrics


def test_a_request_to_a_discovered_endpoint_carries_the_endpoints_labels() -> None:
    metrics = ProxyMetrics()
    recorder = Recorder(metrics, metrics.conn("outbound", "10.96.0.10:80"))
    labels = metrics.conn("outbound", "10.1.1.1:8080", tls="true", no_tls_reason="",
                          server_id="web.ns.serviceaccount.identity").values()  # fmt: skip
    endpoint = Endpoint(("10.1.1.1", 4143), "web:80", labels=labels)
    recorder.request("web:80", endpoint, None)
    recorder.response("web:80", endpoint, None, 200, None, 1.5)
    for name in ("request_total", "response_total"):
        [seen] = label_sets(metrics, name)
        assert seen["target_addr"] == "10.1.1.1:8080"  # the endpoint's, not the connection's
        assert seen["tls"] == "true" and seen["server_id"] == "web.ns.serviceaccount.identity"


def test_a_routed_request_is_counted_by_its_route_too() -> None:
    metrics, recorder = inbound()
    recorder.request("web:80", None, route(ITEMS))
    assert value(metrics, "route_request_total", direction="inbound",
                 dst="web.ns.svc.cluster.local:80", rt_route="GET /items/{id}") == 1  # fmt: skip


def test_the_default_route_is_counted_without_a_route_name() -> None:
    metrics, recorder = inbound()
    recorder.request("web:80", None, route())
    [labels] = label_sets(metrics, "route_request_total")
    assert labels == {"direction": "inbound", "dst": WEB}  # an empty label is left out


@pytest.mark.parametrize(
    ("policy", "status", "grpc", "classification"),
    [
        (DEFAULT_ROUTE, 200, None, "success"),
        (DEFAULT_ROUTE, 404, None, "success"),
        (DEFAULT_ROUTE, 503, None, "failure"),
        (DEFAULT_ROUTE, 200, "0", "success"),
        (DEFAULT_ROUTE, 200, "14", "failure"),  # a gRPC error in a 200
        (ITEMS, 404, None, "failure"),  # the route's classes come first
        (ITEMS, 503, None, "success"),
        (ITEMS, 200, None, "success"),  # no class matches: the default
    ],
)
def test_a_response_is_classified_by_its_route(
    policy: RoutePolicy, status: int, grpc: str | None, classification: str
) -> None:
    metrics, recorder = inbound()
    assert recorder.response("web:80", None, route(policy), status, grpc, 3.0) == classification
    [labels] = label_sets(metrics, "response_total")
    assert labels["status_code"] == str(status) and labels.get("grpc_status") == grpc
    assert labels["classification"] == classification
    [route_labels] = label_sets(metrics, "route_response_total")
    assert route_labels["classification"] == classification


def test_a_response_cut_short_is_a_failure_whatever_its_status() -> None:
    metrics, recorder = inbound()
    assert recorder.response("web:80", None, None, 200, None, 2.0, failed=True) == "failure"
    assert value(metrics, "response_total", status_code="200", classification="failure") == 1


def test_latency_is_observed_for_the_client_and_for_the_route() -> None:
    metrics, recorder = inbound()
    recorder.response("web:80", None, route(ITEMS), 200, None, 12.5)
    recorder.response("web:80", None, route(ITEMS), 200, None, 7.5)
    assert value(metrics, "response_latency_ms_count") == 2
    assert value(metrics, "response_latency_ms_sum") == 20.0
    assert value(metrics, "route_response_latency_ms_count", rt_route="GET /items/{id}") == 2
    assert value(metrics, "route_response_latency_ms_sum") == 20.0


def test_a_response_without_a_latency_is_counted_but_not_observed() -> None:
    metrics, recorder = inbound()
    recorder.response("web:80", None, route(), 504, None, None)
    assert value(metrics, "response_total", status_code="504") == 1
    assert value(metrics, "route_response_total", status_code="504") == 1
    assert value(metrics, "response_latency_ms_count") == 0
    assert value(metrics, "route_response_latency_ms_count") == 0


def test_a_response_without_a_route_has_no_route_metrics() -> None:
    metrics, recorder = inbound()
    recorder.response("web:80", None, None, 200, None, 1.0)
    assert value(metrics, "response_total") == 1
    assert value(metrics, "route_response_total") == 0


def test_attempts_and_their_responses_are_counted_apart_from_what_the_client_got() -> None:
    metrics, recorder = inbound()
    items = route(ITEMS)
    recorder.request("web:80", None, items)
    for status in (502, 502, 200):  # two attempts that failed, then one that did not
        recorder.attempt(items)
        recorder.attempt_response(items, status, None)
    recorder.response("web:80", None, items, 200, None, 30.0)
    assert value(metrics, "route_request_total") == 1
    assert value(metrics, "route_actual_request_total", rt_route="GET /items/{id}") == 3
    assert value(metrics, "route_actual_response_total", status_code="502") == 2
    assert value(metrics, "route_actual_response_total", status_code="200") == 1
    assert value(metrics, "route_response_total") == 1


def test_an_attempts_response_is_classified_by_its_route() -> None:
    metrics, recorder = inbound()
    assert recorder.attempt_response(route(ITEMS), 404, None) == "failure"
    assert recorder.attempt_response(route(), 404, None) == "success"
    assert recorder.attempt_response(route(), 200, "2") == "failure"
    assert value(metrics, "route_actual_response_total", classification="failure") == 2


def test_skipped_retries_and_refused_input_are_counted_by_route_and_by_status() -> None:
    metrics, recorder = inbound()
    recorder.retry_skipped(route(ITEMS))
    recorder.error("408")
    recorder.error("408")
    recorder.error("PROTOCOL_ERROR")
    assert value(metrics, "retry_skipped_total", direction="inbound",
                 rt_route="GET /items/{id}") == 1  # fmt: skip
    assert value(metrics, "http_client_errors_total", direction="inbound",
                 status_code="408") == 2  # fmt: skip
    assert value(metrics, "http_client_errors_total", status_code="PROTOCOL_ERROR") == 1


def test_recorders_of_two_connections_add_up_in_the_same_series() -> None:
    metrics = ProxyMetrics()
    labels = metrics.conn("inbound", "10.0.0.7:8080")
    first, second = Recorder(metrics, labels), Recorder(metrics, labels)
    first.request("web:80", None, route())
    second.request("web:80", None, route())
    assert len(label_sets(metrics, "request_total")) == 1
    assert value(metrics, "request_total") == 2
    assert value(metrics, "route_request_total") == 2
