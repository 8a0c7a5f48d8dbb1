"""One request's attempts without sockets or a running loop: every step, and the clock, come
from the test (the engines' shared table of the same behaviours runs in test_route_policy.py)."""

from __future__ import annotations

import pytest

from meshlet.proxy.core import client_policy as cp
from meshlet.proxy.core.failover import MAX_CONNECTS, Failure
from meshlet.proxy.core.retry_budget import RetryBudget
from meshlet.proxy.core.routes import DEFAULT_ROUTE, RoutePolicy
from meshlet.proxy.http.attempts import ABORT, AGAIN, PASS, REFUSE, Answer, Attempts, Failed
from meshlet.proxy.http.contract import (
    Endpoint,
    RequestTarget,
    RouteError,
    RouteTarget,
    Target,
    Wait,
)
from meshlet.proxy.http.recorder import Recorder
from meshlet.proxy.metrics import ProxyMetrics
from meshlet.proxy.outbound.policy_router import route_policy
from meshlet_testing.lease import RecordingLease

GET = Target("items.ns:80", "GET", "/items/1")
POST = Target("items.ns:80", "POST", "/items")
RETRYABLE = RoutePolicy("GET /items/{id}", timeout=0.5, retryable=True)


class Picker:
    """Endpoints a, b, c in turn, avoiding the one a retry comes from; each pick with a lease
    of its own. `later`: the pick needs waiting."""

    def __init__(self, later: bool = False) -> None:
        self.later = later
        self.leases: list[RecordingLease] = []
        self.avoided: list[Endpoint | None] = []

    def _next(self, after: Endpoint | None) -> Endpoint:
        self.avoided.append(after)
        name = "abc"[len(self.leases) % 3]
        self.leases.append(RecordingLease())
        return Endpoint((f"10.0.0.{ord(name) - 96}", 8080), f"{name}:8080",
                        lease=self.leases[-1])  # fmt: skip

    def pick(self, after: Endpoint | None = None) -> Endpoint | RouteError | Wait:
        return Wait(self._later, after) if self.later else self._next(after)

    async def _later(self, after: Endpoint | None) -> Endpoint | RouteError:
        return self._next(after)


class Router:
    """Routes to `route`; `later`: only after waiting (discovery not yet answered)."""

    def __init__(self, route: RouteTarget | RouteError, later: bool = False) -> None:
        self._route = route
        self.later = later

    def route(self, request: RequestTarget) -> RouteTarget | RouteError | Wait:
        return Wait(self._later, request) if self.later else self._route

    async def _later(self, request: RequestTarget) -> RouteTarget | RouteError:
        return self._route


class Case:
    def __init__(
        self,
        policy: RoutePolicy = RETRYABLE,
        budget: RetryBudget | None = None,
        later: bool = False,
        error: RouteError | None = None,
    ) -> None:
        self.metrics = ProxyMetrics()
        self.recorder = Recorder(self.metrics, self.metrics.conn("outbound", "items:80"))
        self.picker = Picker()
        self.route = RouteTarget("items.ns.svc.cluster.local:80", policy, budget, self.picker)
        self.router = Router(error or self.route, later)

    def request(self, now: float, target: RequestTarget = GET) -> Attempts:
        return Attempts(self.router, self.recorder, target, now)

    def count(self, name: str, **labels: str) -> float:
        return sum(
            sample.value
            for family in self.metrics.registry.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def test_a_routed_request_goes_to_its_pick_and_is_counted_once() -> None:
    case = Case()
    att = case.request(now=100.0)
    step = att.start()
    assert isinstance(step, Endpoint) and step.authority_label == "a:8080"
    assert att.deadline == 100.5  # the route's timeout, from arrival
    att.sent()
    assert case.count("request_total", authority="a:8080") == 1
    assert case.count("route_actual_request_total", rt_route=RETRYABLE.name) == 1


def test_a_route_that_needs_waiting_is_asked_later_and_its_timeout_still_runs_from_arrival() -> (
    None
):
    case = Case(later=True)
    att = case.request(now=100.0)
    step = att.start()
    assert isinstance(step, Wait) and step.arg is GET
    step = att.resume(case.route, now=100.3)  # discovery answered 300 ms later
    assert isinstance(step, Endpoint)
    assert att.deadline == 100.5
    att.responded(now=100.4)
    assert att.latency_ms == pytest.approx(400.0)  # the wait counts


def test_a_pick_that_needs_waiting_is_asked_later() -> None:
    case = Case()
    case.picker.later = True
    att = case.request(now=0.0)
    step = att.start()
    assert isinstance(step, Wait) and step.arg is None
    assert isinstance(att.resume(case.picker._next(None), now=0.1), Endpoint)


def test_a_route_error_is_answered_and_counted_by_the_authority() -> None:
    case = Case(error=RouteError(503, "items has no endpoints"))
    att = case.request(now=0.0)
    assert att.start() == Answer(503, "items has no endpoints")
    att.answered(now=0.002)
    assert att.record(503) == "failure"
    assert case.count("request_total", authority="items.ns:80") == 1
    assert case.count("response_total", authority="items.ns:80", status_code="503") == 1


@pytest.mark.parametrize(
    ("failure", "status"),
    [(Failure.CONNECT, 502), (Failure.CONNECT_TIMEOUT, 504), (Failure.REFUSED, 503)],
)
def test_failed_connections_are_tried_elsewhere_up_to_the_limit(
    failure: Failure, status: int
) -> None:
    case = Case(policy=DEFAULT_ROUTE)
    att = case.request(now=0.0, target=POST)  # nothing was sent: any method
    step = att.start()
    for n in range(1, MAX_CONNECTS):
        step = att.connect_failed(Failed(failure, "refused"))
        assert isinstance(step, Endpoint) and case.picker.avoided[n] is not None
    assert att.connect_failed(Failed(failure, "refused")) == Answer(status, "refused")
    assert [lease.events for lease in case.picker.leases] == [["failed"]] * MAX_CONNECTS


def test_a_fixed_endpoint_whose_connection_fails_is_answered_at_once() -> None:
    route = RouteTarget("10.0.0.9:80", DEFAULT_ROUTE, None, FixedPicker())
    att = Attempts(None, None, GET, 0.0, route)
    assert isinstance(att.start(), Endpoint)
    assert att.connect_failed(Failed(Failure.CONNECT, "refused")) == Answer(502, "refused")


class FixedPicker:
    def pick(self, after: Endpoint | None = None) -> Endpoint:
        return Endpoint(("10.0.0.9", 80), "10.0.0.9:80")


def test_a_reset_retries_a_get_once_on_another_endpoint_and_a_post_never() -> None:
    case = Case(policy=DEFAULT_ROUTE)
    att = case.request(now=0.0)
    first = att.start()
    att.sent()
    second = att.failed(Failure.RESET, replayable=True, responded=False, now=0.1)
    assert isinstance(second, Endpoint) and second != first
    assert case.picker.leases[0].events == ["release"]
    att.sent()
    assert att.failed(Failure.RESET, True, False, 0.2) == Answer(
        502, "the upstream failed before responding"
    )
    post = case.request(now=0.0, target=POST)
    post.start()
    post.sent()
    assert isinstance(post.failed(Failure.RESET, True, False, 0.1), Answer)


def test_a_stale_pooled_connection_is_tried_again_once_on_the_same_endpoint() -> None:
    att = Case(policy=DEFAULT_ROUTE).request(now=0.0, target=POST)
    att.start()
    att.sent()
    assert att.failed(Failure.STALE, True, False, 0.1) is AGAIN
    att.sent()
    assert isinstance(att.failed(Failure.STALE, True, False, 0.2), Answer)  # then as a reset


def test_nothing_is_retried_once_the_response_began() -> None:
    att = Case().request(now=0.0)
    att.start()
    att.sent()
    assert att.failed(Failure.RESET, True, responded=True, now=0.1) is ABORT


def test_a_failure_status_is_retried_on_a_retryable_route_and_passed_on_others() -> None:
    case = Case(budget=RetryBudget(0.2, 10, 10, now=0.0))
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.response(500, None, replayable=True, now=0.1), Endpoint)
    assert att.response(200, None, True, 0.2) is PASS
    plain = Case(policy=DEFAULT_ROUTE).request(now=0.0)
    plain.start()
    plain.sent()
    assert plain.response(500, None, True, 0.1) is PASS
    unreplayable = case.request(now=0.0)
    unreplayable.start()
    unreplayable.sent()
    assert unreplayable.response(500, None, replayable=False, now=0.1) is PASS


@pytest.mark.parametrize(("later", "allowed"), [(9.5, True), (10.5, False)])
def test_the_retry_budget_window_slides_with_the_clock_it_is_given(
    later: float, allowed: bool
) -> None:
    """20 % of requests, no floor, kept 10 s (in 1-s slots): four failing requests at t=0
    deposit 0.8 of a retry; a fifth completes one retry while the first four are in the window
    (t=9.5), not once they slid out of it (t=10.5)."""
    case = Case(budget=RetryBudget(0.2, 0, 10.0, now=0.0))

    def retried(now: float) -> bool:
        att = case.request(now)
        att.start()
        att.sent()
        return isinstance(att.response(503, None, True, now), Endpoint)

    assert [retried(0.0) for _ in range(4)] == [False] * 4
    assert retried(later) is allowed
    assert case.count("retry_skipped_total") == 4 + (not allowed)
    if not allowed:  # deposits start again: the fifth request from then on retries
        assert [retried(later) for _ in range(4)] == [False, False, False, True]


def test_the_route_timeout_answers_504_with_the_route_named() -> None:
    att = Case().request(now=0.0)
    att.start()
    assert att.timed_out() == Answer(504, "the route's timeout of 0.5s passed")


@pytest.mark.parametrize(("replayable", "step"), [(True, Endpoint), (False, None)])
def test_an_unprocessed_request_is_sent_again_whatever_its_method(
    replayable: bool, step: type | None
) -> None:
    att = Case(policy=DEFAULT_ROUTE).request(now=0.0, target=POST)
    att.start()
    att.sent()
    again = att.unprocessed(replayable)
    assert isinstance(again, Endpoint) if step is Endpoint else again is REFUSE


def test_the_outcome_is_recorded_with_the_latency_from_arrival() -> None:
    case = Case()
    att = case.request(now=10.0)
    att.start()
    att.sent()
    att.responded(now=10.25)
    assert case.picker.leases[0].events == ["responded"]
    assert att.record(200) == "success"
    assert case.count("response_latency_ms_sum", authority="a:8080") == pytest.approx(250.0)
    att.release()
    assert case.picker.leases[0].events == ["responded", "release"]


# -- outcomes for failure accrual ------------------------------------------------------------


def test_each_attempt_reports_its_outcome_to_its_own_lease() -> None:
    """A 500 that is retried fails the first endpoint; the retry's 200, recorded as the
    response the client got, succeeds on the second (a balancer's lease counts only its first
    report: outbound/test_balance.py)."""
    case = Case()
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.response(500, None, replayable=True, now=0.1), Endpoint)
    att.sent()
    assert att.response(200, None, True, 0.2) is PASS
    att.record(200)
    assert case.picker.leases[1].outcomes == []  # reported as the attempt is released
    att.release()
    first, second = case.picker.leases
    assert first.outcomes == [False] and second.outcomes == [True]


@pytest.mark.parametrize(
    ("status", "grpc_status", "failed", "outcomes"),
    [
        (200, None, False, [True]),
        (404, None, False, [True]),
        (503, None, False, [False, False]),  # at the head, and as the response recorded
        (200, "14", False, [False]),  # UNAVAILABLE in the trailers: known at the end
        (200, "5", False, [True]),  # NOT_FOUND: the caller's error
        (200, None, True, [False]),  # cut short: the upstream reset mid-response
    ],
)
def test_the_response_the_client_got_is_the_outcome(
    status: int, grpc_status: str | None, failed: bool, outcomes: list[bool]
) -> None:
    case = Case(policy=DEFAULT_ROUTE)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(status, None, False, 0.1) is PASS
    att.record(status, grpc_status, failed)
    att.release()
    [lease] = case.picker.leases
    assert lease.outcomes == outcomes  # the lease counts only the first


def test_a_reset_before_the_response_fails_the_endpoint_a_stale_connection_does_not() -> None:
    case = Case(policy=DEFAULT_ROUTE)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.failed(Failure.STALE, True, False, 0.1) is AGAIN
    assert case.picker.leases[0].outcomes == []
    att.sent()
    assert isinstance(att.failed(Failure.RESET, True, False, 0.2), Answer)  # after a retry
    assert case.picker.leases[0].outcomes == [False]


def test_a_response_cut_short_after_its_head_was_recorded_is_a_failure() -> None:
    """HTTP/1 records the response as its head goes to the client; the upstream then fails
    mid-body: the endpoint's outcome is a failure, reported as the attempt is released."""
    case = Case(policy=DEFAULT_ROUTE)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(200, None, False, 0.1) is PASS
    att.record(200)
    att.cut()
    att.release()
    [lease] = case.picker.leases
    assert lease.outcomes == [False] and lease.events == ["responded", "release"]


def test_an_outbound_policy_s_retry_resends_only_what_it_names() -> None:
    """`retry.meshlet.io/grpc: unavailable` (code 14) with `limit: 1`: a trailers-only
    UNAVAILABLE is resent once to another endpoint; INTERNAL, and an HTTP 500 without a gRPC
    status, pass as they are. `retry.meshlet.io/http: 5xx` never retries on a gRPC code."""
    grpc_only = RoutePolicy("", retryable=True, retry_statuses=(),
                            retry_grpc_codes=frozenset({14}), retry_limit=1)  # fmt: skip

    def first(policy: RoutePolicy, status: int, grpc: str | None) -> object:
        att = Case(policy=policy).request(now=0.0)
        att.start()
        att.sent()
        return att.response(status, grpc, replayable=True, now=0.1)

    assert isinstance(first(grpc_only, 200, "14"), Endpoint)
    assert first(grpc_only, 200, "13") is PASS
    assert first(grpc_only, 500, None) is PASS
    http_only = RoutePolicy("", retryable=True, retry_statuses=((500, 599),), retry_limit=1)
    assert isinstance(first(http_only, 503, None), Endpoint)
    assert first(http_only, 200, "14") is PASS
    assert first(http_only, 404, None) is PASS
    att = Case(policy=grpc_only).request(now=0.0)  # the limit: one retry, then passed on
    att.start()
    att.sent()
    assert isinstance(att.response(200, "14", True, 0.1), Endpoint)
    att.sent()
    assert att.response(200, "14", True, 0.2) is PASS


PER_TRY = RoutePolicy("", timeout=1.0, retryable=True, retry_statuses=((500, 599),),
                      retry_limit=2, attempt_timeout=0.2, retry_timeouts=True,
                      attempt_timeout_name="per-try")  # fmt: skip


def test_an_attempt_s_own_timeout_is_retried_elsewhere_until_the_request_s_timeout() -> None:
    """`retry.meshlet.io/timeout: 200ms` under `timeout.meshlet.io/request: 1s`: each attempt
    gets 200 ms from its pick, one that passes is a failure of its endpoint and is sent to the
    next; the request's timeout ends the retries with 504 once it comes first."""
    case = Case(policy=PER_TRY)
    att = case.request(now=10.0)
    first = att.start()
    assert isinstance(first, Endpoint) and att.due == pytest.approx(10.2)
    att.sent()
    second = att.expired(10.2, replayable=True)
    assert isinstance(second, Endpoint) and second.authority_label == "b:8080"
    assert case.picker.leases[0].outcomes == [False]  # the timed-out attempt failed its endpoint
    assert att.due == pytest.approx(10.4)
    att.sent()
    third = att.expired(10.4, replayable=True)
    assert isinstance(third, Endpoint) and att.due == pytest.approx(10.6)
    att.sent()
    # the limit (2 retries) is used up: the third attempt's timeout answers 504
    assert att.expired(10.6, replayable=True) == Answer(504, "the per-try timeout of 0.2s passed")
    late = Case(policy=PER_TRY).request(now=0.0)
    late.start()
    late.sent()
    late.try_deadline = 1.5  # an attempt picked late: the request's deadline (1.0) comes first
    assert late.due == 1.0
    assert late.expired(1.0, replayable=True) == Answer(504, "the route's timeout of 1s passed")


def _rule(response: float | None, per_try: float | None, limit: int = 0) -> cp.Rule:
    retry = cp.Retry(limit, 65536, timeout=per_try) if per_try or limit else None
    return cp.Rule((), (), cp.EMPTY, cp.Timeouts(request=5.0, response=response), retry)


@pytest.mark.parametrize(
    ("response", "per_try", "limit", "said"),
    [
        (None, 0.1, 0, "the per-try timeout of 0.1s passed"),
        (None, 0.1, 2, "the per-try timeout of 0.1s passed"),  # the last retry's
        (0.3, None, 0, "the response timeout of 0.3s passed"),
        (0.3, 0.1, 0, "the per-try timeout of 0.1s passed"),  # the shorter fires
        (0.1, 0.3, 0, "the response timeout of 0.1s passed"),
    ],
)
def test_an_attempt_s_504_names_the_timeout_that_fired(
    response: float | None, per_try: float | None, limit: int, said: str
) -> None:
    """An outbound policy rule's `timeouts.response` and its retry's per-try timeout
    (`retry.meshlet.io/timeout`) both bound an attempt: the 504 names the one that passed."""
    policy = route_policy(_rule(response, per_try, limit), 5.0)
    att = Case(policy=policy).request(now=0.0)
    att.start()
    step: object = None
    for _ in range(limit + 1):
        att.sent()
        due = att.due
        assert due is not None and due < 5.0
        step = att.expired(due, replayable=True)
    assert step == Answer(504, said)


def test_a_response_timeout_alone_answers_504_without_a_retry() -> None:
    att = Case(policy=RoutePolicy("", attempt_timeout=0.3)).request(now=0.0)
    att.start()
    att.sent()
    assert att.deadline is None and att.due == pytest.approx(0.3)
    assert att.expired(0.3, replayable=True) == Answer(504, "the response timeout of 0.3s passed")
    # nor on a retrying route that does not retry timeouts (no timeout of its own, no 504)
    gateway = RoutePolicy("", retryable=True, retry_statuses=((502, 503),), retry_limit=2,
                          attempt_timeout=0.3)  # fmt: skip
    att = Case(policy=gateway).request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.expired(0.3, replayable=True), Answer)
    # nor a request that cannot be replayed
    att = Case(policy=PER_TRY).request(now=0.0)
    att.start()
    att.sent()
    assert isinstance(att.expired(0.2, replayable=False), Answer)


def test_a_response_head_ends_both_timeouts() -> None:
    att = Case(policy=PER_TRY).request(now=0.0)
    att.start()
    att.sent()
    assert att.response(200, None, True, 0.1) is PASS
    assert att.due is None


def test_a_retry_waits_out_the_route_s_backoff_then_picks() -> None:
    """`retry_backoff` (25 ms doubling to 250 ms, jitter 1): the retry is a Wait of the
    backoff's length, whose result is the next pick (elsewhere)."""
    policy = RoutePolicy("", retryable=True, retry_statuses=((500, 599),), retry_limit=3,
                         retry_backoff=(0.025, 0.25, 1.0))  # fmt: skip
    att = Case(policy=policy).request(now=0.0)
    att.start()
    waits = []
    for n in range(3):
        att.sent()
        step = att.response(500, None, True, float(n))
        assert isinstance(step, Wait)
        delay, pick = step.arg
        waits.append(delay)
        picked = pick()
        assert isinstance(picked, Endpoint)
        assert isinstance(att.resume(picked, float(n) + delay), Endpoint)
    # 25 ms, 50 ms, 100 ms, each stretched by up to itself (jitter 1), never past 250 ms
    for delay, low in zip(waits, (0.025, 0.05, 0.1), strict=True):
        assert low <= delay <= min(2 * low, 0.25)
    att.sent()
    assert att.response(500, None, True, 4.0) is PASS  # the limit: passed on


def test_a_grpc_status_in_trailers_is_retried_when_the_route_names_it() -> None:
    """`retry.meshlet.io/grpc: internal`: a response whose head has no gRPC status is held
    while a retry is possible; INTERNAL (13) in its trailers sends it again elsewhere (a
    failure of the endpoint); OK, or a code the route does not name, passes it on."""
    policy = RoutePolicy("", retryable=True, retry_statuses=(), retry_grpc_codes=frozenset({13}),
                         retry_limit=1)  # fmt: skip
    case = Case(policy=policy)
    att = case.request(now=0.0)
    att.start()
    att.sent()
    assert att.response(200, None, True, 0.1) is PASS
    assert att.holds_for_trailers(replayable=True)
    assert not att.holds_for_trailers(replayable=False)
    assert att.trailers("0", True, 0.1) is PASS
    assert att.trailers("14", True, 0.1) is PASS
    again = att.trailers("13", True, 0.1)
    assert isinstance(again, Endpoint) and again.authority_label == "b:8080"
    assert case.picker.leases[0].outcomes[-1] is False
    att.sent()
    assert not att.holds_for_trailers(replayable=True)  # the limit is reached: nothing held
    assert att.trailers("13", True, 0.2) is PASS
    plain = Case(policy=RETRYABLE).request(now=0.0)  # no gRPC codes: nothing held
    plain.start()
    plain.sent()
    assert not plain.holds_for_trailers(replayable=True)
