"""The metrics of HTTP requests, as both engines record them (one recorder per connection).

Per request: `request_total` once it is routed, `response_total` and `response_latency_ms` for
the response the client gets (with the endpoint's labels on the outbound side), and the route's
`route_request_total` / `route_response_total` / `route_response_latency_ms`; per attempt sent
upstream, `route_actual_request_total` and, for each response that came back (a retried one
included), `route_actual_response_total`. Responses are classified by the route's response
classes. Label children are looked up once per label set, not per request. A route of an
outbound policy also carries Linkerd's route series (route_series.py): its request's end and
each attempt's response go there too.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from meshlet.proxy.core.routes import DEFAULT_ROUTE, classify_response
from meshlet.proxy.http.contract import (
    Endpoint,
    RequestMetrics,
    RequestTarget,
    RouteTarget,
    Tapped,
)
from meshlet.proxy.http.route_series import UNKNOWN
from meshlet.proxy.io.counters import ConnLabels

if TYPE_CHECKING:
    from meshlet.proxy.http.observe import ConnObserver
    from meshlet.proxy.http.route_series import BackendSeries

Children = dict[tuple[Any, ...], Any]


class Recorder:
    def __init__(
        self, metrics: RequestMetrics, labels: ConnLabels, observer: ConnObserver | None = None
    ) -> None:
        self.metrics = metrics
        self.observer = observer
        self.direction = labels.direction
        self.conn_labels = labels
        self.taps = metrics.taps
        self._labels = labels.values()
        self._requests: Children = {}
        self._responses: Children = {}
        self._route_requests: Children = {}
        self._route_responses: Children = {}
        self._actual_requests: Children = {}
        self._actual_responses: Children = {}
        self._errors: dict[str, Any] = {}

    def authority_label(self, authority: str) -> str:
        return self.metrics.authority_label(authority)

    def tap(
        self, target: RequestTarget, endpoint: Endpoint | None, route: RouteTarget | None
    ) -> Tapped | None:
        return self.taps.request(target, self.direction, self.conn_labels, endpoint, route)

    def request(self, authority: str, endpoint: Endpoint | None, route: RouteTarget | None) -> None:
        """A request was routed (or refused by its route)."""
        values = endpoint.labels if endpoint is not None and endpoint.labels else None
        key = (values, authority)
        counter = self._requests.get(key)
        if counter is None:
            counter = self._requests[key] = self.metrics.request_total.labels(
                *(values or self._labels), authority
            )
        counter.inc()
        if route is not None:
            route_key = (route.dst, route.policy.name)
            counter = self._route_requests.get(route_key)
            if counter is None:
                counter = self._route_requests[route_key] = self.metrics.route_request_total.labels(
                    self.direction, *route_key
                )
            counter.inc()

    def response(
        self,
        authority: str,
        endpoint: Endpoint | None,
        route: RouteTarget | None,
        status: int,
        grpc_status: str | None,
        latency_ms: float | None,
        failed: bool = False,
        classified: str = "",
        error: str = "",
        trailers: bool = False,
    ) -> str:
        """The response the client got (or the exchange's end when `failed`: cut short; the
        proxy's own answer, for `error`; `trailers`: the upstream's head had no gRPC status);
        returns its classification (`classified`: already known)."""
        policy = route.policy if route is not None else DEFAULT_ROUTE
        grpc = grpc_status or ""
        classification = (
            "failure" if failed else classified or classify_response(policy, status, grpc)
        )
        values = endpoint.labels if endpoint is not None and endpoint.labels else None
        key = (values, authority, status, grpc, classification)
        children = self._responses.get(key)
        if children is None:
            labels = (*(values or self._labels), authority, str(status), grpc, classification)
            children = self._responses[key] = (
                self.metrics.response_total.labels(*labels),
                self.metrics.response_latency_ms.labels(*labels),
            )
        children[0].inc()
        if latency_ms is not None:
            children[1].observe(latency_ms)
        if route is not None:
            self._route_response(route, policy.name, status, classification, latency_ms)
            series = route.series
            if series is None:
                pass
            elif error or failed or (trailers and series.grpc) or latency_ms is None:
                _finished(series, status, grpc_status, latency_ms, failed, error, trailers)
            else:  # the common case, inlined: it runs for every request a policy routes
                served = series.route
                served.statuses.whole[grpc_status if series.grpc else status].value += 1
                seconds = latency_ms / 1000.0
                duration = served.duration
                duration.counts[bisect_left(served.bounds, seconds)] += 1
                duration.sum += seconds
        return classification

    def _route_response(
        self, route: RouteTarget, name: str, status: int, classification: str, ms: float | None
    ) -> None:
        key = (route.dst, name, status, classification)
        children = self._route_responses.get(key)
        if children is None:
            labels = (self.direction, route.dst, name, str(status), classification)
            children = self._route_responses[key] = (
                self.metrics.route_response_total.labels(*labels),
                self.metrics.route_response_latency_ms.labels(*labels),
            )
        children[0].inc()
        if ms is not None:
            children[1].observe(ms)

    def attempt(self, route: RouteTarget) -> None:
        """The request was (at least partly) sent upstream."""
        key = (route.dst, route.policy.name)
        counter = self._actual_requests.get(key)
        if counter is None:
            counter = self._actual_requests[key] = self.metrics.route_actual_request_total.labels(
                self.direction, *key
            )
        counter.inc()

    def attempt_response(
        self, route: RouteTarget, status: int, grpc_status: str | None, seconds: float = 0.0
    ) -> str:
        """A response came back from upstream (given to the client or retried), `seconds`
        after its attempt began; its class."""
        classification = classify_response(route.policy, status, grpc_status)
        series = route.series
        if series is not None:  # Linkerd's route families, inlined as in `response`
            duration = series.duration
            duration.counts[bisect_left(series.bounds, seconds)] += 1
            duration.sum += seconds
            if not series.grpc:
                series.statuses.whole[status].value += 1
            elif grpc_status is not None:  # else its trailers will tell
                series.statuses.whole[grpc_status].value += 1
        key = (route.dst, route.policy.name, status, classification)
        counter = self._actual_responses.get(key)
        if counter is None:
            counter = self._actual_responses[key] = self.metrics.route_actual_response_total.labels(
                self.direction, route.dst, route.policy.name, str(status), classification
            )
        counter.inc()
        return classification

    def retry_skipped(self, route: RouteTarget) -> None:
        self.metrics.retry_skipped_total.labels(self.direction, route.dst, route.policy.name).inc()
        if route.series is not None:
            route.series.route.overflow.value += 1

    def error(self, label: str) -> None:
        """A request or connection refused for its input, by what was sent (a status, or an
        HTTP/2 error name)."""
        counter = self._errors.get(label)
        if counter is None:
            counter = self._errors[label] = self.metrics.http_errors_total.labels(
                self.direction, label
            )
        counter.inc()


def _finished(
    series: BackendSeries,
    status: int,
    grpc_status: str | None,
    latency_ms: float | None,
    failed: bool,
    error: str,
    trailers: bool,
) -> None:
    """A request's end in Linkerd's route families: the route's status and duration; the
    backend's status when it comes only now (the proxy's answer, a gRPC status in trailers)."""
    seconds = latency_ms / 1000.0 if latency_ms is not None else None
    if error:
        series.route.finished(0, None, error, seconds)
        series.statuses.inc(0, None, error)
        return
    cut = UNKNOWN if failed else ""
    series.route.finished(status, grpc_status, cut, seconds)
    if trailers and series.grpc:
        series.statuses.inc(status, grpc_status, cut)
