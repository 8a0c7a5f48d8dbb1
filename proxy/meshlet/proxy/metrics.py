"""The proxy's Prometheus metrics, named and labelled as Linkerd's, on a registry it owns.

HTTP metrics are `series` children, looked up once per label set by their recorder. TCP
metrics (`tcp_*`) are counted in plain attributes of one `TcpConn` per connection
(`io/counters.py`), with no lookup per read or write, and summed when the registry is scraped:
`peer="src"` for connections the proxy accepted, `peer="dst"` for those it opened (to an
endpoint or to the app). On the outbound side, endpoints carry the destination service's metric
labels as `dst_<name>` (`dst_namespace`, `dst_service`, `dst_pod`, `dst_deployment`, ...).

Label values a client can choose (authority, target address) are bounded: past `MAX_VALUES`
distinct values of one label, new ones are reported as `overflow`. No series has a `_created`
twin: the proxy's counters start with the process (`process_start_time_seconds`), and labels
with no value are left out.
"""

from __future__ import annotations

import errno
import platform
import sys
import time
from collections import Counter as Tally
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from meshlet.api.hostport import HostPort
from meshlet.proxy.io.counters import DST_LABELS, NO_DST, ConnLabels, TcpConn, TcpKey, Values
from meshlet.proxy.series import (
    Counter,
    Family,
    Gauge,
    Histogram,
    ProcessMetrics,
    Registry,
    labels_of,
)


class NoTaps:
    """The taps of a proxy that serves none (tap is off without identity): never open."""

    open = False

    def request(self, *_: object) -> None:
        return None


MAX_VALUES: Final = 500
OVERFLOW: Final = "overflow"
LATENCY_BUCKETS_MS: Final = (
    1, 2, 3, 4, 5, 10, 20, 30, 40, 50, 100, 200, 300, 400, 500,
    1000, 2000, 3000, 4000, 5000, 10000, 20000, 30000, 40000, 50000,
)  # fmt: skip
DURATION_BUCKETS_MS: Final = (1, 10, 100, 1000, 10_000, 100_000, 1_000_000, 10_000_000)


class BoundedValues:
    """Passes through the first `limit` distinct values, then maps new ones to `overflow`."""

    def __init__(self, limit: int = MAX_VALUES) -> None:
        self._seen: set[str] = set()
        self._limit = limit

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return OVERFLOW
        self._seen.add(value)
        return value


_CONN: Final = [  # the names of ConnLabels.values()
    "direction", "target_addr", "tls", "no_tls_reason", "client_id", "server_id",
    *(f"dst_{name}" for name in DST_LABELS),
]  # fmt: skip
_REQUEST: Final = [*_CONN, "authority"]
_RESPONSE: Final = [*_REQUEST, "status_code", "grpc_status", "classification"]
# Per ServiceProfile route (`rt_route` is the route's name; "" for the default route).
_ROUTE: Final = ["direction", "dst", "rt_route"]
_ROUTE_RESPONSE: Final = [*_ROUTE, "status_code", "classification"]
_TCP: Final = ["peer", *_CONN]
# Inbound policy (Linkerd's names and labels): the server, the route, the authorization that
# allowed, the rate limit that refused; the client's TLS as on connections.
_SRV: Final = ["target_addr", "srv_group", "srv_kind", "srv_name"]
_ROUTE_AUTHZ: Final = [*_SRV, "route_group", "route_kind", "route_name"]
_CLIENT_TLS: Final = ["tls", "no_tls_reason", "client_id"]
_AUTHZ: Final = ["authz_group", "authz_kind", "authz_name"]
# Linkerd 2.16's outbound route metrics: the Service, the route and the backend, each as its
# outbound policy names it (the values: http/route_series.py).
_PARENT: Final = ["parent_group", "parent_kind", "parent_namespace", "parent_name", "parent_port",
                  "parent_section_name"]  # fmt: skip
_ROUTE_REF: Final = ["route_group", "route_kind", "route_namespace", "route_name"]
_BACKEND_REF: Final = ["backend_group", "backend_kind", "backend_namespace", "backend_name",
                       "backend_port", "backend_section_name"]  # fmt: skip
ROUTE_REQUEST_BUCKETS: Final = (0.05, 0.5, 1.0, 10.0)  # Linkerd's RouteMetrics::REQUEST_BUCKETS
ROUTE_RESPONSE_BUCKETS: Final = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 10.0)  # ::RESPONSE_BUCKETS
_RATELIMIT: Final = ["ratelimit_group", "ratelimit_kind", "ratelimit_name", "ratelimit_scope"]
_TCP_CLOSE: Final = [*_TCP, "errno"]
_DURATION_LES: Final = [*(str(bound) for bound in DURATION_BUCKETS_MS), "+Inf"]


class TcpMetrics:
    """tcp_open_total, tcp_open_connections, tcp_read_bytes_total, tcp_write_bytes_total,
    tcp_close_total and tcp_connection_duration_ms, as a collector: live connections' counts
    are added at each scrape."""

    def __init__(self) -> None:
        self._live: set[TcpConn] = set()
        self._opened: Tally[TcpKey] = Tally()
        self._closed: Tally[tuple[TcpKey, str]] = Tally()
        self._read: Tally[TcpKey] = Tally()  # of closed connections
        self._written: Tally[TcpKey] = Tally()
        self._durations: dict[TcpKey, list[float]] = {}  # per bucket, then +Inf, then the sum

    def conn(self, peer: str, values: Values) -> TcpConn:
        return TcpConn(self, (peer, *values))

    def opened(self, conn: TcpConn) -> None:
        conn.opened_at = time.monotonic()
        self._live.add(conn)
        self._opened[conn.key] += 1

    def closed(self, conn: TcpConn, exc: BaseException | None) -> None:
        key = conn.key
        self._live.discard(conn)
        self._read[key] += conn.read
        self._written[key] += conn.written
        code = exc.errno if isinstance(exc, OSError) else None
        self._closed[key, errno.errorcode.get(code, str(code)) if code else ""] += 1
        ms = (time.monotonic() - conn.opened_at) * 1000
        conn.opened_at = -1.0
        counts = self._durations.get(key)
        if counts is None:
            counts = self._durations[key] = [0.0] * (len(DURATION_BUCKETS_MS) + 2)
        for i, bound in enumerate(DURATION_BUCKETS_MS):
            if ms <= bound:
                counts[i] += 1
                break
        else:
            counts[-2] += 1
        counts[-1] += ms

    def collect(self) -> Iterator[Family]:
        live: Tally[TcpKey] = Tally()
        read, written = self._read.copy(), self._written.copy()
        for conn in self._live:
            live[conn.key] += 1
            read[conn.key] += conn.read
            written[conn.key] += conn.written
        opened = Family("tcp_open", "counter", "TCP connections opened.")
        now = Family("tcp_open_connections", "gauge", "TCP connections open now.")
        reads = Family("tcp_read_bytes", "counter", "Bytes read from peers.")
        writes = Family("tcp_write_bytes", "counter", "Bytes written to peers.")
        for key, count in self._opened.items():
            labels = labels_of(_TCP, key)
            opened.add_sample("tcp_open_total", labels, count)
            now.add_sample("tcp_open_connections", labels, live[key])
            reads.add_sample("tcp_read_bytes_total", labels, read[key])
            writes.add_sample("tcp_write_bytes_total", labels, written[key])
        closes = Family("tcp_close", "counter", "TCP connections closed, by error.")
        for (key, code), count in self._closed.items():
            closes.add_sample("tcp_close_total", labels_of(_TCP_CLOSE, (*key, code)), count)
        durations = Family(
            "tcp_connection_duration_ms", "histogram",
            "How long connections were open, in milliseconds.",
        )  # fmt: skip
        for key, counts in self._durations.items():
            labels = labels_of(_TCP, key)
            cumulative = 0.0
            for le, n in zip(_DURATION_LES, counts, strict=False):
                cumulative += n
                durations.add_sample("tcp_connection_duration_ms_bucket", {**labels, "le": le},
                                     cumulative)  # fmt: skip
            durations.add_sample("tcp_connection_duration_ms_count", labels, cumulative)
            durations.add_sample("tcp_connection_duration_ms_sum", labels, counts[-1])
        yield from (opened, now, reads, writes, closes, durations)


class RouteFamilies:
    """Linkerd 2.16's outbound route families of one protocol (`http` or `grpc`): the series
    of a route target are made of them by `http/route_series.py`, which says what each counts."""

    def __init__(self, protocol: str, registry: Registry) -> None:
        p = f"outbound_{protocol}_route"
        self.grpc = protocol == "grpc"
        self.request_buckets = ROUTE_REQUEST_BUCKETS
        self.response_buckets = ROUTE_RESPONSE_BUCKETS
        status = "grpc_status" if self.grpc else "http_status"
        route, backend = [*_PARENT, *_ROUTE_REF], [*_PARENT, *_ROUTE_REF, *_BACKEND_REF]
        r = registry
        self.request_duration = Histogram(
            f"{p}_request_duration_seconds",
            "The time between request initialization and response completion.",
            route, r, ROUTE_REQUEST_BUCKETS,
        )  # fmt: skip
        self.request_statuses = Counter(f"{p}_request_statuses",
                                        "Completed request-response streams.",
                                        [*route, status, "error"], r)  # fmt: skip
        self.retry_requests = Counter(f"{p}_retry_requests", "Retry requests emitted.", route, r)
        self.retry_successes = Counter(
            f"{p}_retry_successes", "Successful responses to retry requests.", route, r
        )
        self.retry_limit_exceeded = Counter(
            f"{p}_retry_limit_exceeded", "Retryable requests not sent due to retry limits.",
            route, r,
        )  # fmt: skip
        self.retry_overflow = Counter(
            f"{p}_retry_overflow",
            "Retryable requests not sent due to circuit breakers (the retry budget).", route, r,
        )  # fmt: skip
        self.backend_requests = Counter(
            f"{p}_backend_requests",
            f"Outbound requests dispatched to a{'' if self.grpc else 'n'} "
            f"{'gRPC' if self.grpc else 'HTTP'} route backend.",
            backend, r,
        )  # fmt: skip
        self.backend_response_duration = Histogram(
            f"{p}_backend_response_duration_seconds",
            "The time between request completion and response completion.",
            backend, r, ROUTE_RESPONSE_BUCKETS,
        )  # fmt: skip
        self.backend_response_statuses = Counter(f"{p}_backend_response_statuses",
                                                 "Completed responses.",
                                                 [*backend, status, "error"], r)  # fmt: skip


class ProxyMetrics:
    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()
        r = self.registry
        self.authority = BoundedValues()
        self.target = BoundedValues()
        self.request_total = Counter("request", "HTTP requests.", _REQUEST, registry=r)
        self.response_total = Counter("response", "HTTP responses.", _RESPONSE, registry=r)
        self.response_latency_ms = Histogram(
            "response_latency_ms", "Time to the response headers, in milliseconds.",
            _RESPONSE, registry=r, buckets=LATENCY_BUCKETS_MS,
        )  # fmt: skip
        self.route_request_total = Counter(
            "route_request", "HTTP requests, by route.", _ROUTE, registry=r
        )
        self.route_response_total = Counter(
            "route_response", "HTTP responses given to clients, by route.", _ROUTE_RESPONSE,
            registry=r,
        )  # fmt: skip
        self.route_response_latency_ms = Histogram(
            "route_response_latency_ms",
            "Time to the response headers given to the client, retries included, by route.",
            _ROUTE_RESPONSE, registry=r, buckets=LATENCY_BUCKETS_MS,
        )  # fmt: skip
        self.route_actual_request_total = Counter(
            "route_actual_request", "HTTP requests sent upstream (retries included), by route.",
            _ROUTE, registry=r,
        )  # fmt: skip
        self.route_actual_response_total = Counter(
            "route_actual_response", "HTTP responses from upstream (retried ones included).",
            _ROUTE_RESPONSE, registry=r,
        )  # fmt: skip
        self.retry_skipped_total = Counter(
            "retry_skipped", "Retries a route wanted and its retry budget refused.", _ROUTE,
            registry=r,
        )  # fmt: skip
        self.tcp = TcpMetrics()
        r.register(self.tcp)
        ProcessMetrics(r)  # process_cpu_seconds_total, process_resident_memory_bytes…
        build = Gauge("proxy_build_info", "The proxy's build.", r,
                      ["version", "vendor", "python"])  # fmt: skip
        build.labels(_version(), "meshlet", platform.python_version()).set(1)
        self.detect_timeout_total = Counter(
            "protocol_detect_timeout",
            "Connections whose protocol detection timed out (then handled as opaque TCP).",
            ["direction", "port"],
            registry=r,
        )
        self.load_shed_total = Counter(
            "load_shed",
            "Client connections shed under pressure, by the resource that was over its mark.",
            ["direction", "resource"], registry=r,
        )  # fmt: skip
        self.fail_fast_total = Counter(
            "fail_fast", "Requests or connections refused at once (no endpoints, loops).",
            ["direction", "reason"], registry=r,
        )  # fmt: skip
        self.route_regex_budget_exceeded_total = Counter(
            "route_regex_budget_exceeded",
            "Requests refused (414, 431) because matching them against their routes' regular"
            " expressions would cost more than a request may spend.",
            ["direction"], registry=r,
        )  # fmt: skip
        self.http_errors_total = Counter(
            "http_client_errors",
            "Requests refused for malformed or oversized input, by the status sent.",
            ["direction", "status_code"],
            registry=r,
        )
        self.tap_events_dropped_total = Counter(
            "tap_events_dropped",
            "Tap events not sent: past a tap's rate bound, or its client's buffer.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.tap_open = Gauge("tap_open", "Taps this proxy is serving.", r)
        self.tap_refused_total = Counter(
            "tap_refused",
            "Connections to the tap port refused or closed: a failed TLS handshake, another "
            "identity than the tap controller's, past the most connections, abuse, broken HTTP/2.",
            ["reason"], registry=r,
        )  # fmt: skip
        # The proxy's taps (tap/taps.py, set by the app when it serves tap).
        self.taps: Any = NoTaps()
        self.inbound_http_authz_allow_total = Counter(
            "inbound_http_authz_allow", "Inbound HTTP requests allowed, by authorization.",
            [*_ROUTE_AUTHZ, *_AUTHZ, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        self.inbound_http_authz_deny_total = Counter(
            "inbound_http_authz_deny", "Inbound HTTP requests denied by their route's policy.",
            [*_ROUTE_AUTHZ, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        self.inbound_http_route_not_found_total = Counter(
            "inbound_http_route_not_found", "Inbound HTTP requests no route of the server matched.",
            [*_SRV, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        self.inbound_http_local_ratelimit_total = Counter(
            "inbound_http_local_ratelimit", "Inbound HTTP requests refused by the rate limit.",
            [*_SRV, *_RATELIMIT, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        # Linkerd 2.16's outbound_http_route_* and outbound_grpc_route_* (http/route_series.py)
        self.outbound_http_route = RouteFamilies("http", r)
        self.outbound_grpc_route = RouteFamilies("grpc", r)
        self.inbound_tcp_authz_allow_total = Counter(
            "inbound_tcp_authz_allow", "Inbound TCP connections allowed, by authorization.",
            [*_SRV, *_AUTHZ, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        self.inbound_tcp_authz_deny_total = Counter(
            "inbound_tcp_authz_deny", "Inbound TCP connections denied by the server's policy.",
            [*_SRV, *_CLIENT_TLS], registry=r,
        )  # fmt: skip
        self.identity_cert_expiration_timestamp_seconds = Gauge(
            "identity_cert_expiration_timestamp_seconds",
            "When the proxy's current certificate expires (Unix time).",
            r,
        )
        self.identity_cert_refresh_timestamp_seconds = Gauge(
            "identity_cert_refresh_timestamp_seconds",
            "When the proxy last obtained a certificate (Unix time).",
            r,
        )
        self.access_log_dropped_total = Counter(
            "access_log_dropped",
            "Access log lines dropped because stderr was slower than the requests.",
            [], registry=r,
        )  # fmt: skip
        self.trace_spans_exported_total = Counter(
            "trace_spans_exported", "Spans the trace collector accepted.", [], registry=r
        )
        self.trace_spans_dropped_total = Counter(
            "trace_spans_dropped",
            "Spans dropped: the export queue was full, or the collector failed them.",
            [], registry=r,
        )  # fmt: skip
        self.identity_cert_refresh_total = Counter(
            "identity_cert_refresh", "Certificate requests to the identity service, by result.",
            ["result"], registry=r,
        )  # fmt: skip
        self.identity_trust_anchors = Gauge(
            "identity_trust_anchors", "The trust anchors in force (certificates in the bundle).", r
        )
        self.identity_trust_anchors_reload_total = Counter(
            "identity_trust_anchors_reload",
            "Changes of the trust-anchor file seen, by result (ok: now in force; invalid: kept"
            " the anchors in force).",
            ["result"], registry=r,
        )  # fmt: skip

    def conn(
        self, direction: str, target_addr: str, dst: tuple[str, ...] = NO_DST, **tls: str
    ) -> ConnLabels:
        return ConnLabels(direction, self.target(target_addr), dst=dst, **tls)

    def dst_conn(self, direction: str, addr: HostPort, labels: Values | None) -> TcpConn:
        """A connection the proxy opens (`peer="dst"`): to an endpoint with its `labels`, or,
        without, a plain one (inbound: to the app on the pod's own address)."""
        if labels is None:
            reason = "loopback" if direction == "inbound" else "not_provided_by_service_discovery"
            labels = self.conn(direction, str(addr), no_tls_reason=reason).values()
        return self.tcp.conn("dst", labels)

    def authority_label(self, authority: str) -> str:
        return self.authority(authority)


def _version() -> str:
    """meshlet's installed version, read from its METADATA (`importlib.metadata` would cost the
    proxy ~3 MiB of resident memory for this one string)."""
    for entry in sys.path:
        for dist in Path(entry or ".").glob("meshlet-*.dist-info"):
            try:
                with (dist / "METADATA").open(encoding="utf-8") as metadata:
                    for line in metadata:
                        if line.startswith("Version:"):
                            return line.split(":", 1)[1].strip()
                        if not line.strip():
                            break  # the headers end at the first blank line
            except OSError:
                continue
    return "unknown"


class TapCounts:
    """Where the proxy's taps count what they drop and how many are open, and its tap server
    the connections it refuses."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def dropped(self, reason: str, events: int) -> None:
        self._metrics.tap_events_dropped_total.labels(reason).inc(events)

    def opened(self, count: int) -> None:
        self._metrics.tap_open.set(count)

    def refused(self, reason: str) -> None:
        self._metrics.tap_refused_total.labels(reason).inc()
