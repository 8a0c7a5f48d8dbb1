"""Linkerd's outbound route families as one request's driver (http/attempts.py) and the
connection's recorder feed them, without sockets: each step and the clock come from the test
(the same counts through a real proxy and controller: mesh/test_outbound_policy_component.py)."""

from __future__ import annotations

import pytest

from meshlet.proxy.core.client_policy import PolicyRef
from meshlet.proxy.core.failover import Failure
from meshlet.proxy.core.routes import RoutePolicy
from meshlet.proxy.http import route_series
from meshlet.proxy.http.attempts import AGAIN, PASS, Answer, Attempts
from meshlet.proxy.http.contract import Endpoint, RouteError, RouteTarget, Target, Wait
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.http.route_series import grpc_code_name
from meshlet.proxy.metrics import ProxyMetrics
from meshlet_testing.lease import RecordingLease

GET = Target("web.ns:80", "GET", "/items/1")
PARENT = PolicyRef("Service", "web", "core", "ns", port=80)
ROUTE = PolicyRef("HTTPRoute", "web-split", "gateway.networking.k8s.io", "ns")
BACKEND = PolicyRef("Service", "web-v2", "core", "ns", port=80)
RETRY_5XX = RoutePolicy(retryable=True, retry_statuses=((500, 599),), retry_limit=2, timeout=1.0)
LABELS = {"parent_name": "web", "route_name": "web-split"}


class Picker:
    """Endpoints a, b, c in turn (or `error`, for every pick)."""

    def __init__(self, error: RouteError | None = None) -> None:
        self.picks = 0
        self.error = error

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError:
        if self.error is not None:
            return self.error
        name = "abc"[self.picks % 3]
        self.picks += 1
        return Endpoint((f"10.0.0.{self.picks}", 8080), f"{name}:8080", lease=RecordingLease())


class Case:
    def __init__(
        self, policy: RoutePolicy = RETRY_5XX, grpc: bool = False, routed: bool = True,
        error: RouteError | None = None,
    ) -> None:  # fmt: skip
        self.metrics = ProxyMetrics()
        self.recorder = Recorder(self.metrics, self.metrics.conn("outbound", "web:80"))
        families = self.metrics.outbound_grpc_route if grpc else self.metrics.outbound_http_route
        routed_by = route_series.route(families, PARENT, ROUTE) if routed else None
        series = route_series.backend(routed_by, BACKEND) if routed_by is not None else None
        self.route = RouteTarget("web.ns.svc.cluster.local:80", policy, None, Picker(error),
                                 series=series)  # fmt: skip
        self.protocol = "grpc" if grpc else "http"

    def request(self, now: float) -> Attempts:
        return Attempts(None, self.recorder, GET, now, route=self.route)

    def count(self, name: str, **labels: str) -> float:
        name = f"outbound_{self.protocol}_route_{name}"
        return sum(
            sample.value
            for family in self.metrics.registry.collect()
            for sample in family.samples
            if sample.name == name and {**LABELS, **labels}.items() <= sample.labels.items()
        )

    def labels(self, name: str) -> list[dict[str, str]]:
        name = f"outbound_{self.protocol}_route_{name}"
        return [dict(sample.labels) for family in self.metrics.registry.collect()
                for sample in family.samples if sample.name == name]  # fmt: skip


def test_a_retried_failure_then_a_success_is_one_retry_one_success_and_two_backend_answers() -> (
    None
):
    case = Case()
    att = case.request(now=10.0)
    assert isinstance(att.start(), Endpoint)
    att.sent()
    assert isinstance(att.response(503, None, replayable=True, now=10.1), Endpoint)  # retried
    att.sent()
    assert att.response(200, None, replayable=True, now=10.14) is PASS
    att.record(200)
    assert case.count("request_statuses_total") == 1
    assert case.count("request_statuses_total", http_status="200") == 1
    assert case.count("request_duration_seconds_sum") == pytest.approx(0.14)
    assert case.count("request_duration_seconds_bucket", le="0.5") == 1
    assert case.count("request_duration_seconds_bucket", le="0.05") == 0
    assert case.count("retry_requests_total") == 1
    assert case.count("retry_successes_total") == 1
    assert case.count("retry_limit_exceeded_total") == 0
    assert case.count("backend_requests_total", backend_name="web-v2") == 1  # the retry's
    assert case.count("backend_response_statuses_total", http_status="503") == 1
    assert case.count("backend_response_statuses_total", http_status="200") == 1
    # each attempt's own time: 100 ms, then 40 ms from the retry's start
    assert case.count("backend_response_duration_seconds_sum") == pytest.approx(0.14)
    assert case.count("backend_response_duration_seconds_bucket", le="0.05") == 1
    assert case.count("backend_response_duration_seconds_bucket", le="0.1") == 2


def test_a_failure_left_when_the_retries_are_used_up_exceeds_the_limit_once() -> None:
    case = Case()
    att = case.request(now=0.0)
    att.start()
    for now in (0.1, 0.2):
        att.sent()
        assert isinstance(att.response(500, None, True, now), Endpoint)
    att.sent()
    assert att.response(502, None, True, 0.3) is PASS  # the 3rd send: a limit of 2 retries
    att.record(502)
    assert case.count("retry_requests_total") == 2
    assert case.count("retry_limit_exceeded_total") == 1
    assert case.count("retry_successes_total") == 0
    assert case.count("request_statuses_total", http_status="502") == 1
    assert case.count("backend_response_statuses_total") == 3


def test_a_status_the_route_does_not_retry_is_passed_with_no_retry_counted() -> None:
    case = Case(RoutePolicy(retryable=True, retry_statuses=((502, 504),), retry_limit=2))
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(500, None, True, 0.1) is PASS
    att.record(500)
    for name in ("retry_requests", "retry_limit_exceeded", "retry_successes", "retry_overflow"):
        assert case.count(f"{name}_total") == 0
    assert case.count("request_statuses_total", http_status="500") == 1


def test_a_stale_connection_sent_again_is_no_retry() -> None:
    case = Case()
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.failed(Failure.STALE, True, False, 0.1) is AGAIN  # on a fresh connection
    att.sent()
    assert att.response(200, None, True, 0.2) is PASS
    assert case.count("retry_requests_total") == 0
    assert case.count("retry_successes_total") == 0


def test_the_route_timeout_is_a_request_timeout_error_with_no_status() -> None:
    case = Case()
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.timed_out() == Answer(504, "the route's timeout of 1s passed")
    att.answered(now=1.0)
    att.record(504)
    assert case.labels("request_statuses_total") == [
        {**_refs(), "error": "REQUEST_TIMEOUT"}
    ]  # no http_status: no response came
    assert case.count("request_duration_seconds_bucket", le="1") == 1


def test_an_attempt_s_own_timeout_is_a_response_headers_timeout_retried_then_answered() -> None:
    """`retry.meshlet.io/timeout`: each attempt that outlives it is a backend's
    RESPONSE_HEADERS_TIMEOUT, and the last one (the limit used up) the request's."""
    policy = RoutePolicy(timeout=1.0, retryable=True, retry_statuses=((500, 599),),
                         retry_limit=1, attempt_timeout=0.2, retry_timeouts=True)  # fmt: skip
    case = Case(policy)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.expired(0.2, replayable=True), Endpoint)
    att.sent()
    assert att.expired(0.4, replayable=True) == Answer(504, "the response timeout of 0.2s passed")
    att.answered(now=0.4)
    att.record(504)
    assert case.count("backend_response_statuses_total", error="RESPONSE_HEADERS_TIMEOUT") == 2
    assert case.count("request_statuses_total", error="RESPONSE_HEADERS_TIMEOUT") == 1
    assert case.count("retry_requests_total") == 1
    assert case.count("retry_limit_exceeded_total") == 1


def test_a_retry_s_backend_time_starts_after_its_backoff() -> None:
    policy = RoutePolicy(retryable=True, retry_statuses=((500, 599),), retry_limit=1,
                         retry_backoff=(0.025, 0.025, 0.0))  # fmt: skip
    case = Case(policy)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    wait = att.response(500, None, True, now=0.02)
    assert isinstance(wait, Wait)
    delay, pick = wait.arg
    assert isinstance(att.resume(pick(), 0.02 + delay), Endpoint)  # picked after 25 ms
    att.sent()
    assert att.response(200, None, True, now=0.095) is PASS
    assert case.count("backend_response_duration_seconds_sum") == pytest.approx(0.02 + 0.05)
    assert case.count("retry_successes_total") == 1


def test_a_grpc_code_in_held_trailers_retried_is_that_attempt_s_status() -> None:
    policy = RoutePolicy(retryable=True, retry_statuses=(), retry_grpc_codes=frozenset({13}),
                         retry_limit=1)  # fmt: skip
    case = Case(policy, grpc=True)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(200, None, True, 0.1) is PASS  # held by the engine for its trailers
    assert isinstance(att.trailers("13", True, 0.1), Endpoint)
    att.sent()
    assert att.response(200, None, True, 0.2) is PASS
    att.record(200, "0")
    assert case.count("backend_response_statuses_total", grpc_status="INTERNAL") == 1
    assert case.count("backend_response_statuses_total", grpc_status="OK") == 1
    assert case.count("request_statuses_total", grpc_status="OK") == 1
    assert case.count("request_statuses_total") == 1
    assert case.count("retry_requests_total") == 1


def test_no_endpoint_to_send_to_fails_fast() -> None:
    case = Case(error=RouteError(503, "no endpoints"))
    att = case.request(now=0.0)
    assert att.start() == Answer(503, "no endpoints")
    att.answered(now=0.0)
    att.record(503)
    assert case.count("request_statuses_total", error="FAIL_FAST") == 1
    assert case.count("backend_response_statuses_total", error="FAIL_FAST") == 1


def test_a_reset_retried_and_a_reset_answered_are_each_an_attempt_s_reset() -> None:
    case = Case()
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.failed(Failure.RESET, True, False, 0.1), Endpoint)
    att.sent()
    assert isinstance(att.failed(Failure.RESET, True, False, 0.2), Endpoint)
    att.sent()
    assert att.failed(Failure.RESET, True, False, 0.3) == Answer(
        502, "the upstream failed before responding"
    )
    att.answered(now=0.3)
    att.record(502)
    assert case.count("backend_response_statuses_total", error="RESET") == 3
    assert case.count("request_statuses_total", error="RESET") == 1
    assert case.count("request_statuses_total", http_status="502") == 0
    assert case.count("retry_requests_total") == 2
    assert case.count("retry_limit_exceeded_total") == 1


def test_a_grpc_status_in_trailers_is_counted_by_its_name_when_they_come() -> None:
    case = Case(RoutePolicy(), grpc=True)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(200, None, True, 0.01) is PASS
    assert case.count("backend_response_statuses_total") == 0  # not known yet
    att.record(200, "14")
    assert case.count("request_statuses_total", grpc_status="UNAVAILABLE") == 1
    assert case.count("backend_response_statuses_total", grpc_status="UNAVAILABLE") == 1
    trailers_only = case.request(now=1.0)
    trailers_only.start()
    trailers_only.sent()
    assert trailers_only.response(200, "5", True, 1.01) is PASS
    trailers_only.record(200, "5")
    assert case.count("backend_response_statuses_total", grpc_status="NOT_FOUND") == 1
    assert case.count("request_statuses_total", grpc_status="NOT_FOUND") == 1


def test_a_request_on_no_policy_route_adds_no_series() -> None:
    case = Case(routed=False)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.response(500, None, True, 0.1), Endpoint)
    att.sent()
    att.response(200, None, True, 0.2)
    att.record(200)
    samples = [sample for family in case.metrics.registry.collect() for sample in family.samples]
    sent = [value for name, _, value in samples if name == "route_actual_request_total"]
    assert sent == [2]  # the route's own families count it
    assert not [name for name, _, _ in samples if name.startswith("outbound_")]


@pytest.mark.parametrize(
    ("code", "name"),
    [("0", "OK"), ("2", "UNKNOWN"), ("4", "DEADLINE_EXCEEDED"), ("16", "UNAUTHENTICATED"),
     ("17", "UNKNOWN"), ("x", "UNKNOWN"), (None, "UNKNOWN")],
)  # fmt: skip
def test_grpc_codes_are_labelled_by_their_names_as_linkerd_s(code: str | None, name: str) -> None:
    assert grpc_code_name(code) == name


def _refs() -> dict[str, str]:
    return {
        "parent_group": "core", "parent_kind": "Service", "parent_namespace": "ns",
        "parent_name": "web", "parent_port": "80", "route_group": "gateway.networking.k8s.io",
        "route_kind": "HTTPRoute", "route_namespace": "ns", "route_name": "web-split",
    }  # fmt: skip
