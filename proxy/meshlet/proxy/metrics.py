"""The proxy's Prometheus metrics, named and labelled as Linkerd's, on a registry it owns.

Label values a client can choose (authority, target address) are bounded: past `MAX_VALUES`
distinct values of one label, new ones are reported as `overflow`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MAX_VALUES: Final = 500
OVERFLOW: Final = "overflow"
LATENCY_BUCKETS_MS: Final = (
    1, 2, 3, 4, 5, 10, 20, 30, 40, 50, 100, 200, 300, 400, 500,
    1000, 2000, 3000, 4000, 5000, 10000, 20000, 30000, 40000, 50000,
)  # fmt: skip


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


@dataclass(frozen=True, slots=True)
class ConnLabels:
    """Labels of a connection: direction, peer, TLS (Linkerd's tcp_* and request_* labels)."""

    direction: str  # "inbound" | "outbound"
    target_addr: str
    tls: str = "no_identity"  # "true" | "no_identity"
    no_tls_reason: str = "not_provided_by_remote"
    client_id: str = ""  # inbound over mTLS: the client's identity
    server_id: str = ""  # outbound over mTLS: the server's identity

    def values(self) -> Values:
        return (self.direction, self.target_addr, self.tls, self.no_tls_reason, self.client_id,
                self.server_id)  # fmt: skip


Values = tuple[str, str, str, str, str, str]  # ConnLabels.values(), in _CONN's order
_CONN: Final = ["direction", "target_addr", "tls", "no_tls_reason", "client_id", "server_id"]
_REQUEST: Final = [*_CONN, "authority"]
_RESPONSE: Final = [*_REQUEST, "status_code", "grpc_status", "classification"]
# Per ServiceProfile route (`rt_route` is the route's name; "" for the default route).
_ROUTE: Final = ["direction", "dst", "rt_route"]
_ROUTE_RESPONSE: Final = [*_ROUTE, "status_code", "classification"]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.authority = BoundedValues()
        self.target = BoundedValues()
        self.request_total = Counter("request", "HTTP requests.", _REQUEST, registry=r)
        self.response_total = Counter("response", "HTTP responses.", _RESPONSE, registry=r)
        self.response_latency_ms = Histogram(
            "response_latency_ms", "Time to the response headers, in milliseconds.",
            _RESPONSE, buckets=LATENCY_BUCKETS_MS, registry=r,
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
            _ROUTE_RESPONSE, buckets=LATENCY_BUCKETS_MS, registry=r,
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
        self.tcp_open_total = Counter("tcp_open", "TCP connections opened.", _CONN, registry=r)
        self.tcp_open_connections = Gauge(
            "tcp_open_connections", "TCP connections open now.", _CONN, registry=r
        )
        self.tcp_read_bytes_total = Counter(
            "tcp_read_bytes", "Bytes read from peers.", _CONN, registry=r
        )
        self.tcp_write_bytes_total = Counter(
            "tcp_write_bytes", "Bytes written to peers.", _CONN, registry=r
        )
        self.tcp_close_total = Counter(
            "tcp_close", "TCP connections closed.", [*_CONN, "errno"], registry=r
        )
        self.detect_timeout_total = Counter(
            "protocol_detect_timeout",
            "Connections whose protocol detection timed out (then handled as opaque TCP).",
            ["direction", "port"],
            registry=r,
        )
        self.fail_fast_total = Counter(
            "fail_fast", "Requests or connections refused at once (no endpoints, loops).",
            ["direction", "reason"], registry=r,
        )  # fmt: skip
        self.http_errors_total = Counter(
            "http_client_errors",
            "Requests refused for malformed or oversized input, by the status sent.",
            ["direction", "status_code"],
            registry=r,
        )
        self.identity_cert_expiration_timestamp_seconds = Gauge(
            "identity_cert_expiration_timestamp_seconds",
            "When the proxy's current certificate expires (Unix time).",
            registry=r,
        )
        self.identity_cert_refresh_timestamp_seconds = Gauge(
            "identity_cert_refresh_timestamp_seconds",
            "When the proxy last obtained a certificate (Unix time).",
            registry=r,
        )
        self.identity_cert_refresh_total = Counter(
            "identity_cert_refresh", "Certificate requests to the identity service, by result.",
            ["result"], registry=r,
        )  # fmt: skip

    def conn(self, direction: str, target_addr: str, **tls: str) -> ConnLabels:
        return ConnLabels(direction, self.target(target_addr), **tls)

    def authority_label(self, authority: str) -> str:
        return self.authority(authority)
