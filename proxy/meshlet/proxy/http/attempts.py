"""One request's way upstream, the same for HTTP/1, HTTP/2 and opaque TCP (sans-IO): route it,
pick an endpoint for each attempt, decide what follows a failure (`core.failover`, with the
route's retry budget), keep its timeout, and record it.

Every method is synchronous and takes `now` (the loop clock) from its caller; each returns the
next `Step`:

    Endpoint   send the request there (its head and, on a retry, the replayed body)
    AGAIN      send it again to the same endpoint, on a new connection (a stale pooled one)
    Answer     answer the client locally with this status (and `meshlet-proxy-error`)
    Wait       the answer needs waiting (discovery, a name lookup): await `call(arg)`, give the
               result to `resume`
    Sending    the send waits for a connection (its Wait's result: None, sent; or Failed)
    PASS       give the client the upstream's failure response as it is
    ABORT      cut the client's connection or stream (the response had started)
    REFUSE     refuse the stream as never processed (HTTP/2 REFUSED_STREAM), so the client may
               retry it

An engine implements `Upstream` for one request (send, answer), calls `begin` when the
request arrives: when discovery has answered, the pick is immediate and a connection is at
hand, the request is sent with no task at all. Only what needs waiting goes to `advance`, in a
task the engine owns. Every question (route, pick, send) is one synchronous call that answers
at once or returns a `Wait`.

One meaning on every protocol: a request *arrives* when the proxy takes it (its head is read,
and on HTTP/1 the requests before it on the connection were answered). Its route's timeout and
its `response_latency_ms` run from then, on the loop's clock: a discovery wait, a connect and
every retry count against the timeout; the latency ends when the response head (the upstream's,
or the proxy's own answer) goes to the client.

Each attempt's outcome goes to its endpoint's lease once, for failure accrual
(core/accrual.py): a failure when the upstream resets the request or its response head fails,
else the response the client got, with its gRPC status from headers or trailers (`record`),
or a failure when it was `cut` short; reported when the attempt is released. A connection
that failed is reported by the lease itself (`Lease.failed`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from meshlet.proxy.core import accrual
from meshlet.proxy.core.accrual import GRPC_FAILURES
from meshlet.proxy.core.classify import FAILURE
from meshlet.proxy.core.failover import Action, Attempt, Decision, Failure, decide
from meshlet.proxy.core.routes import RoutePolicy
from meshlet.proxy.http import route_series
from meshlet.proxy.http.contract import (
    QUEUED,
    Endpoint,
    Later,
    Recording,
    RequestTarget,
    RouteError,
    Router,
    RouteTarget,
    Tapped,
    Wait,
    settle,
)

log = logging.getLogger(__name__)
Header = tuple[bytes, bytes]


class Verdict(enum.Enum):
    AGAIN = "again"
    PASS = "pass"
    ABORT = "abort"
    REFUSE = "refuse"


AGAIN = Verdict.AGAIN
PASS = Verdict.PASS
ABORT = Verdict.ABORT
REFUSE = Verdict.REFUSE


class Answer(NamedTuple):
    status: int
    reason: str


class Sending(NamedTuple):
    """The current endpoint's send waits for a connection."""

    wait: Wait


Step = Endpoint | Answer | Wait | Sending | Verdict


class Failed(NamedTuple):
    """Why a connection to an endpoint failed before anything was sent."""

    failure: Failure  # CONNECT, CONNECT_TIMEOUT or REFUSED
    reason: str


class Upstream(Protocol):
    """What an engine does for one request (HTTP/1's shell, an HTTP/2 stream, the relay)."""

    def gone(self) -> bool:
        """The request is over (its client went away, or it was answered meanwhile)."""

    def routed(self, route: RouteTarget) -> None:
        """The request's route is known (once): its timers and replay buffer start."""

    def send(self, endpoint: Endpoint, fresh: bool) -> Wait | Later | None:
        """Sends the request on a connection to `endpoint` that is ready (pooled, or with a
        free stream; `fresh`: a new one); else a Wait for connecting, whose result is None
        (sent) or why the connection failed (nothing was sent); or QUEUED: the request waits
        for a stream without a task, and the engine calls `Attempts.sent`, or `connect_failed`,
        when it is told."""

    def answer(self, status: int, reason: str) -> None:
        """Answers the request from the proxy."""


_PROXY_ERROR = RouteError(502, "routing failed in the proxy")


class Attempts:
    """One request's route, attempts and outcome (see the module docstring)."""

    __slots__ = (
        "arrived",
        "classified",
        "connects",
        "counted",
        "deadline",
        "endpoint",
        "error",
        "label",
        "latency_ms",
        "observation",
        "ok",
        "previous",
        "recorder",
        "resp_bytes",
        "route",
        "router",
        "sends",
        "stale_retried",
        "tap",
        "tap_end",
        "target",
        "tried",
        "try_deadline",
    )

    def __init__(
        self,
        router: Router | None,
        recorder: Recording | None,
        target: RequestTarget,
        now: float,
        route: RouteTarget | None = None,
    ) -> None:
        self.router = router  # None: `route` is given
        self.recorder = recorder  # None: not recorded (opaque TCP)
        self.target = target
        self.arrived = now
        self.route = route
        self.endpoint: Endpoint | None = None  # the current attempt's
        self.previous: Endpoint | None = None  # where the last failed attempt went
        self.sends = 0  # times the request was (at least partly) sent
        self.connects = 0  # connections that failed before anything was sent
        self.stale_retried = False
        self.counted = False  # request_total counted
        self.label = ""  # the `authority` label of its metrics
        self.deadline: float | None = None  # loop time of the route's timeout
        self.try_deadline: float | None = None  # loop time of the current attempt's timeout
        self.latency_ms: float | None = None  # arrival to the response head
        self.classified = ""  # the response head's class, as the route classified it
        self.ok: bool | None = None  # the recorded response's outcome, for failure accrual
        self.error = ""  # why the proxy answered, as Linkerd's route metrics say (route_series)
        self.tried = now  # loop time the current attempt began (route_series)
        self.tap: Tapped | None = None  # the taps that took the request (tap/taps.py)
        self.tap_end: tuple[str | None, bool] = (None, True)  # the recorded end, for the tap
        self.resp_bytes = 0  # response body bytes given to the client (the engines count)
        # The access log entry and span (observe.py): None unless the workload has either.
        observer = recorder.observer if recorder is not None else None
        self.observation = observer.started(target) if observer is not None else None

    # -- routing and picking ----------------------------------------------------------

    def start(self) -> Step:
        """The request arrived: where it goes first. The common case (routed and picked at
        once) is written out here: it runs for every request."""
        route = self.route
        if route is None:
            router = self.router
            assert router is not None
            routed = router.route(self.target)
            if not isinstance(routed, RouteTarget):
                return routed if isinstance(routed, Wait) else self._routed(routed, self.arrived)
            route = self.route = routed
            if self.observation is not None:
                route = self.route = self.observation.routed(route)
        if route.budget is not None:
            route.budget.deposit(self.arrived)
        timeout = route.policy.timeout
        if timeout is not None:
            self.deadline = self.arrived + timeout
        picked = route.endpoints.pick(None)
        if not isinstance(picked, Endpoint):
            return picked if isinstance(picked, Wait) else self._picked(picked, None)
        self.endpoint = picked
        attempt = route.policy.attempt_timeout
        if attempt is not None:
            self.try_deadline = self.arrived + attempt
        self.counted = True
        recorder = self.recorder
        if recorder is not None:
            self.label = picked.authority_label
            recorder.request(self.label, picked, route)
            if recorder.taps.open:
                self.tap = recorder.tap(self.target, picked, route)
        return picked

    def resume(self, result: object, now: float) -> Step:
        """What a `Wait` waited for arrived: the route, or then a pick."""
        if self.route is None:
            return self._routed(result, now)  # type: ignore[arg-type]
        return self._picked(result, now)  # type: ignore[arg-type]

    def _routed(self, routed: RouteTarget | RouteError, now: float) -> Step:
        if isinstance(routed, RouteError):
            self._count(None)
            return Answer(routed.status, routed.reason)
        if self.observation is not None:
            routed = self.observation.routed(routed)
        self.route = routed
        if routed.budget is not None:
            routed.budget.deposit(now)
        timeout = routed.policy.timeout
        if timeout is not None:
            self.deadline = self.arrived + timeout
        return self._pick(now)

    def _pick(self, now: float | None) -> Step:
        route = self.route
        assert route is not None
        picked = route.endpoints.pick(self.previous)
        if isinstance(picked, Wait):
            return picked
        return self._picked(picked, now)

    def _pick_after_backoff(self) -> Endpoint | RouteError | Wait:
        route = self.route
        assert route is not None
        return route.endpoints.pick(self.previous)

    def _picked(self, picked: Endpoint | RouteError, now: float | None) -> Step:
        """An attempt's endpoint (its timeout runs from `now`; None: the attempt goes on, on
        another endpoint after a connection failed), or the route's error."""
        if isinstance(picked, RouteError):
            self._count(None)
            self.error = route_series.FAIL_FAST
            return Answer(picked.status, picked.reason)
        self._count(picked)
        self.endpoint = picked
        if now is not None:
            self.tried = now
            route = self.route
            attempt = route.policy.attempt_timeout if route is not None else None
            if attempt is not None:
                self.try_deadline = now + attempt
        return picked

    def _count(self, endpoint: Endpoint | None) -> None:
        """request_total, once: by the endpoint's label, else the route's, else the
        authority's."""
        if self.counted:
            return
        self.counted = True
        recorder = self.recorder
        if recorder is None:
            return
        route = self.route
        if endpoint is not None:
            self.label = endpoint.authority_label
        elif route is not None:
            self.label = route.dst
        elif self.target.authority:
            self.label = recorder.authority_label(self.target.authority)
        recorder.request(self.label, endpoint, route)
        if recorder.taps.open:
            self.tap = recorder.tap(self.target, endpoint, route)

    # -- attempts -------------------------------------------------------------------------

    def sent(self) -> None:
        """The request went (at least its head) to the current endpoint."""
        self.sends += 1
        if self.observation is not None:
            self.observation.sent()
        route = self.route
        if route is not None and self.recorder is not None:
            self.recorder.attempt(route)

    def connect_failed(self, failed: Failed) -> Step:
        """A connection to the current endpoint failed; nothing was sent. The balancer skips
        the endpoint for a while; another is tried while the failover policy allows."""
        self.connects += 1
        decision = decide(failed.failure, self._attempt(True, False))
        endpoint = self.endpoint
        if endpoint is not None and endpoint.lease is not None:
            endpoint.lease.failed()
            if decision.action is Action.RETRY:
                self.previous, self.endpoint = endpoint, None
                return self._pick(None)
        decision = decision.otherwise or decision  # a fixed endpoint: nowhere else to try
        return Answer(decision.status, failed.reason)

    def unprocessed(self, replayable: bool) -> Step:
        """The upstream says it never acted on the request (HTTP/2 REFUSED_STREAM, or a GOAWAY
        that excludes it): as a connection that failed, it is sent again, elsewhere when
        another endpoint is left; else REFUSE."""
        self.connects += 1
        decision = decide(Failure.CONNECT, self._attempt(replayable, False))
        if replayable and decision.action is Action.RETRY:
            return self._again_elsewhere(None)
        return REFUSE

    def failed(self, failure: Failure, replayable: bool, responded: bool, now: float) -> Step:
        """The request was sent and then failed (STALE, RESET), or `response` found its answer
        a failure (STATUS): what follows, with the budget asked for a retry."""
        if failure is Failure.RESET:
            self._outcome(False)
        decision = self._decision(failure, self._attempt(replayable, responded), now)
        action = decision.action
        if action is Action.RETRY:
            return self._again_elsewhere(now)
        if action is Action.RETRY_SAME:
            self.stale_retried = True
            return AGAIN
        if action is Action.ANSWER:
            self.error = route_series.RESET
            return Answer(decision.status, decision.reason)
        return PASS if action is Action.PASS else ABORT

    def response(
        self,
        status: int,
        grpc_status: str | None,
        replayable: bool,
        now: float,
        headers: Sequence[Header] = (),
    ) -> Step:
        """A response head came back: PASS it to the client (it is then `responded`), or
        retry (the route classifies it a failure, and the policy and budget allow)."""
        if self.observation is not None:
            self.observation.response_headers = headers
        endpoint = self.endpoint  # accrual.succeeded, inlined: it runs for every response
        lease = endpoint.lease if endpoint is not None else None
        if lease is not None and (status >= 500 or grpc_status in GRPC_FAILURES):
            lease.outcome(False)
        route = self.route
        recorder = self.recorder
        if route is not None and recorder is not None:
            classified = recorder.attempt_response(route, status, grpc_status, now - self.tried)
            if classified == FAILURE and _retried(route.policy, status, grpc_status):
                step = self.failed(Failure.STATUS, replayable, False, now)
                if step is not PASS:
                    return step
            elif route.series is not None and self.sends > 1 + self.stale_retried:
                route_series.retry_answered(route.series, route.policy)
            if grpc_status is None:  # else a gRPC status in trailers may still change it
                self.classified = classified
        self.responded(now)
        return PASS

    @property
    def due(self) -> float | None:
        """When the wait for the response head ends (the request's timeout or its attempt's,
        the earlier); None: no limit."""
        deadline, attempt = self.deadline, self.try_deadline
        if attempt is None:
            return deadline
        return attempt if deadline is None or attempt < deadline else deadline

    def expired(self, now: float, replayable: bool) -> Step:
        """`due` passed before the response head. The request's timeout: 504 (`timed_out`).
        The attempt's own: the attempt is a failure (the engine cancels it), sent again while
        the route retries timeouts and the retries and budget allow, else 504."""
        deadline, attempt = self.deadline, self.try_deadline
        if attempt is None or (deadline is not None and deadline <= attempt):
            return self.timed_out()
        self.try_deadline = None
        self._outcome(False)
        route = self.route
        assert route is not None
        policy = route.policy
        retries = policy.retryable and policy.retry_timeouts
        decision = self._decision(
            Failure.ATTEMPT_TIMEOUT, self._attempt(replayable, False, retries), now
        )
        if decision.action is Action.RETRY:
            return self._again_elsewhere(now)
        timeout = policy.attempt_timeout or 0.0
        self.error = route_series.RESPONSE_HEADERS_TIMEOUT
        name = policy.attempt_timeout_name
        return Answer(decision.status, f"the {name} timeout of {timeout:g}s passed")

    def holds_for_trailers(self, replayable: bool) -> bool:
        """Whether a gRPC response whose head carries no status is held until its trailers (or
        its first body bytes): its route retries gRPC codes and a retry is still possible."""
        route = self.route
        if route is None or not route.policy.retry_grpc_codes or not replayable:
            return False
        decision = decide(Failure.STATUS, self._attempt(replayable, False))
        return decision.action is Action.RETRY

    def trailers(self, grpc_status: str | None, replayable: bool, now: float) -> Step:
        """A held gRPC response ended with `grpc_status` in its trailers, nothing of it given
        to the client: retried when the route retries that code (PASS: give it as it is)."""
        route = self.route
        if route is None or grpc_status is None or grpc_status not in GRPC_FAILURES:
            return PASS
        if not _retried(route.policy, 200, grpc_status):
            return PASS
        self._outcome(False)
        step = self.failed(Failure.STATUS, replayable, False, now)
        if step is not PASS and route.series is not None:  # else `record` counts it
            route.series.statuses.whole[grpc_status].value += 1
        return step

    def timed_out(self) -> Answer:
        """The route's timeout passed before the response head."""
        route = self.route
        timeout = route.policy.timeout if route is not None else None
        decision = decide(Failure.TIMEOUT, self._attempt(False, False))
        self.error = route_series.REQUEST_TIMEOUT
        why = f"the route's timeout of {timeout:g}s passed" if timeout else "the timeout passed"
        return Answer(decision.status, why)

    def _again_elsewhere(self, now: float | None) -> Step:
        """The request goes again, to another endpoint when one is left: after the route's
        retry backoff when it has one (`now`: a retry of a sent attempt; None: one never
        processed, sent again at once)."""
        self.release()  # routed again: a new lease, on another endpoint when one is left
        self.previous, self.endpoint = self.endpoint, None
        route = self.route
        backoff = route.policy.retry_backoff if route is not None else None
        if backoff is None or now is None:
            return self._pick(now)
        low, high, jitter = backoff
        delay = accrual.backoff(low, high, jitter, max(self.sends - 1, 0), random.random())
        return Wait(_after, (delay, self._pick_after_backoff))

    def _attempt(self, replayable: bool, responded: bool, retryable: bool | None = None) -> Attempt:
        route = self.route
        if retryable is None:
            retryable = route is not None and route.policy.retryable
        return Attempt(
            sends=self.sends, connects_failed=self.connects, stale_retried=self.stale_retried,
            replayable=replayable, retryable_route=retryable,
            method=self.target.method, responded=responded,
            retry_limit=route.policy.retry_limit if route is not None else None,
        )  # fmt: skip

    def _decision(self, failure: Failure, attempt: Attempt, now: float) -> Decision:
        decision = decide(failure, attempt)
        route = self.route
        budget = route.budget if route is not None else None
        if decision.budgeted and budget is not None and not budget.withdraw(now):
            assert route is not None and decision.otherwise is not None
            if self.recorder is not None:
                self.recorder.retry_skipped(route)
            decision = decision.otherwise
        if route is not None and route.series is not None:
            route_series.failover(route.series, failure, decision, attempt)
        return decision

    # -- outcome ---------------------------------------------------------------------------

    def responded(self, now: float) -> None:
        """The response head (the upstream's, or the proxy's answer) goes to the client."""
        self.deadline = self.try_deadline = None
        self.latency_ms = (now - self.arrived) * 1000.0
        endpoint = self.endpoint
        if endpoint is not None and endpoint.lease is not None:
            endpoint.lease.responded()

    def answered(self, now: float) -> None:
        """The proxy answers the request itself (counted, even when it was never routed)."""
        self._count(None)
        self.deadline = self.try_deadline = None
        self.latency_ms = (now - self.arrived) * 1000.0
        self.error = self.error or route_series.UNKNOWN

    def record(self, status: int, grpc_status: str | None = None, failed: bool = False) -> str:
        """The response the client got (`failed`: cut short); its classification."""
        if self.ok is None:  # accrual.succeeded, inlined; reported on release
            self.ok = not failed and status < 500 and grpc_status not in GRPC_FAILURES
        recorder = self.recorder
        if recorder is None:
            return ""
        if self.observation is not None:
            self.observation.finished(self.target, status, grpc_status, failed)
            self.observation = None
        known = self.classified if grpc_status is None else ""
        tap = self.tap
        if tap is not None:
            tap.responded(status, self.latency_ms)
            self.tap_end = (grpc_status, failed)
        return recorder.response(self.label, self.endpoint, self.route, status, grpc_status,
                                 self.latency_ms, failed, known, self.error,
                                 self.classified != "")  # fmt: skip

    def finish(self, complete: bool) -> None:
        """The exchange is over (`complete`: the client got the whole response): the taps that
        took it are told its end, with `resp_bytes` (once; later calls do nothing)."""
        tap = self.tap
        if tap is not None:
            self.tap = None
            grpc_status, failed = self.tap_end
            tap.ended(grpc_status, failed or not complete, self.resp_bytes)

    def _outcome(self, success: bool) -> None:
        """The current attempt's outcome, to its endpoint's balancer (the first report counts)."""
        endpoint = self.endpoint
        if endpoint is not None and endpoint.lease is not None:
            endpoint.lease.outcome(success)

    def cut(self) -> None:
        """The upstream's response was cut short after its head went to the client (recorded
        then as it began): its outcome is a failure."""
        self.ok = False

    def release(self) -> None:
        """The current attempt's endpoint is done with, its outcome (the response recorded)
        reported first (a no-op without a lease, or repeated)."""
        endpoint = self.endpoint
        if endpoint is not None and endpoint.lease is not None:
            if self.ok is not None:
                endpoint.lease.outcome(self.ok)
            endpoint.lease.release()


# -- carrying it out -------------------------------------------------------------------------


def begin(attempts: Attempts, upstream: Upstream) -> Step | None:
    """The request arrived: `start`, then `advance_now`. Returns what is left for `advance`
    (None: the request was sent or answered without waiting)."""
    step = attempts.start()
    route = attempts.route
    if route is not None:
        upstream.routed(route)
    return advance_now(attempts, upstream, step)


def advance_now(attempts: Attempts, upstream: Upstream, step: Step) -> Step | None:
    """Does `step` when that needs no waiting: a send on a connection at hand, an answer.
    Returns what is left for `advance` (None: nothing)."""
    if isinstance(step, Endpoint) or step is AGAIN:
        endpoint = attempts.endpoint
        assert endpoint is not None
        sending = upstream.send(endpoint, step is AGAIN)
        if sending is None:
            attempts.sent()
            return None
        if sending is QUEUED:
            return None  # the engine is told when it is sent
        return Sending(sending)
    if isinstance(step, Answer):
        upstream.answer(step.status, step.reason)
        return None
    return step


async def advance(
    attempts: Attempts, upstream: Upstream, step: Step, clock: Callable[[], float]
) -> None:
    """Carries `step` out to the end, waiting where needed: routes and picks that need
    discovery, connections to open, connections that fail (tried elsewhere as the failover
    policy says)."""
    while True:
        if isinstance(step, Wait):
            unrouted = attempts.route is None
            try:
                result: object = await settle(step)
            except Exception:
                log.exception("routing a request for %r failed", attempts.target.authority)
                result = _PROXY_ERROR
            if upstream.gone():
                if isinstance(result, Endpoint) and result.lease is not None:
                    result.lease.release()
                return
            step = attempts.resume(result, clock())
            if unrouted and attempts.route is not None:
                upstream.routed(attempts.route)
        elif isinstance(step, Sending):
            failed: Failed | None = await settle(step.wait)
            if upstream.gone():
                return
            if failed is None:
                attempts.sent()
                return
            step = attempts.connect_failed(failed)
        elif isinstance(step, Endpoint) or step is AGAIN:
            left = advance_now(attempts, upstream, step)
            if left is None:
                return
            step = left
        elif isinstance(step, Answer):
            upstream.answer(step.status, step.reason)
            return
        else:
            return


async def _after(wait: tuple[float, Callable[[], Endpoint | RouteError | Wait]]) -> object:
    """A retry's backoff, then its pick."""
    delay, pick = wait
    await asyncio.sleep(delay)
    return pick()


def _retried(policy: RoutePolicy, status: int, grpc_status: str | None) -> bool:
    """Whether a failure response may be retried by its route: any (a ServiceProfile's route),
    or one whose gRPC code (in its head: a trailers-only response), else HTTP status, the
    outbound policy's retry names (`trailers` asks it of a status in trailers)."""
    statuses, codes = policy.retry_statuses, policy.retry_grpc_codes
    if statuses is None and codes is None:
        return True
    if grpc_status is not None and grpc_status.isdigit():
        return codes is not None and int(grpc_status) in codes
    return statuses is not None and any(low <= status <= high for low, high in statuses)
