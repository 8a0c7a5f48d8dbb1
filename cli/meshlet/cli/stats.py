"""What the proxies' metrics say, per workload and per replica (pure): success rate, requests per
second, latency quantiles, how much of the traffic came over mutual TLS, and from whom, and what
the inbound authorization policies allowed and denied (connections and requests together).

Everything is read from the *inbound* side of each pod's proxy, as `linkerd viz stat` does: a
workload's requests are those its proxies received. Rates and quantiles are differences between
two scrapes (a window, or the whole run); quantiles interpolate within histogram buckets as
Prometheus' `histogram_quantile` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Series = dict[tuple[str, Labels], float]  # (sample name, labels) → value

QUANTILES: Final = (0.5, 0.95, 0.99)
ALLOWED: Final = ("inbound_tcp_authz_allow_total", "inbound_http_authz_allow_total")
DENIED: Final = ("inbound_tcp_authz_deny_total", "inbound_http_authz_deny_total")


def parse(text: str) -> Series:
    """Prometheus text exposition → every sample, by name and labels."""
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return series


@dataclass(frozen=True, slots=True)
class Scrape:
    pod: str
    at: float  # seconds (monotonic)
    series: Series


def _sum(series: Series, name: str, **match: str) -> float:
    want = set(match.items())
    return sum(v for (n, labels), v in series.items() if n == name and want <= labels)


def _by(series: Series, name: str, label: str, **match: str) -> dict[str, float]:
    want = set(match.items())
    out: dict[str, float] = {}
    for (n, labels), value in series.items():
        if n == name and want <= labels:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _delta(new: Mapping[str, float], old: Mapping[str, float]) -> dict[str, float]:
    return {k: v - old.get(k, 0.0) for k, v in new.items() if v - old.get(k, 0.0) > 0}


def _add(into: dict[str, float], more: Mapping[str, float]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a histogram given as cumulative counts by upper bound (+Inf included);
    None without observations. Past the last finite bound: that bound."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total = buckets[bounds[-1]]
    rank = q * total
    lower: float = 0.0
    below: float = 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def _latency(series: Series, **match: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for le, value in _by(series, "response_latency_ms_bucket", "le", **match).items():
        buckets[float(le)] = buckets.get(float(le), 0.0) + value
    return buckets


@dataclass(frozen=True, slots=True)
class Traffic:
    """One pod's inbound traffic between two scrapes."""

    seconds: float
    requests: float  # HTTP responses sent (requests served)
    successes: float
    latency: dict[float, float]  # cumulative bucket counts by upper bound, in ms
    mtls_requests: float
    connections: float  # inbound TCP connections opened
    mtls_connections: float
    peers: dict[str, float]  # client identities over mTLS: requests + connections
    open_connections: float = 0.0  # inbound TCP connections open at the second scrape
    read_bytes: float = 0.0  # inbound bytes read from clients
    write_bytes: float = 0.0  # inbound bytes written to clients
    allowed: float = 0.0  # connections (opaque) and requests (HTTP) authorization allowed
    denied: float = 0.0  # and denied
    allowed_peers: dict[str, float] = field(default_factory=dict)  # by client identity
    denied_peers: dict[str, float] = field(default_factory=dict)


def traffic(old: Scrape | None, new: Scrape) -> Traffic:
    """The inbound traffic of `new.pod` since `old` (since the proxy started without one)."""
    before: Series = old.series if old is not None else {}
    after = new.series
    seconds = new.at - old.at if old is not None else 0.0

    def diff(name: str, **match: str) -> float:
        return max(0.0, _sum(after, name, **match) - _sum(before, name, **match))

    inbound = {"direction": "inbound"}
    accepted = {"direction": "inbound", "peer": "src"}  # not the proxy's connections to the app
    latency_new, latency_old = _latency(after, **inbound), _latency(before, **inbound)
    latency = {le: v - latency_old.get(le, 0.0) for le, v in latency_new.items()}
    peers: dict[str, float] = {}
    for name, match in (("response_total", inbound), ("tcp_open_total", accepted)):
        _add(peers, _delta(_by(after, name, "client_id", tls="true", **match),
                           _by(before, name, "client_id", tls="true", **match)))  # fmt: skip
    allowed_peers: dict[str, float] = {}
    denied_peers: dict[str, float] = {}
    for names, into in ((ALLOWED, allowed_peers), (DENIED, denied_peers)):
        for name in names:
            _add(into, _delta(_by(after, name, "client_id"), _by(before, name, "client_id")))
    return Traffic(
        seconds=seconds,
        requests=diff("response_total", **inbound),
        successes=diff("response_total", classification="success", **inbound),
        latency=latency,
        mtls_requests=diff("response_total", tls="true", **inbound),
        connections=diff("tcp_open_total", **accepted),
        mtls_connections=diff("tcp_open_total", tls="true", **accepted),
        peers=peers,
        open_connections=_sum(after, "tcp_open_connections", **accepted),
        read_bytes=diff("tcp_read_bytes_total", **accepted),
        write_bytes=diff("tcp_write_bytes_total", **accepted),
        allowed=sum(diff(name) for name in ALLOWED),
        denied=sum(diff(name) for name in DENIED),
        allowed_peers=allowed_peers,
        denied_peers=denied_peers,
    )


def combine(parts: Iterable[Traffic]) -> Traffic:
    parts = list(parts)
    latency: dict[float, float] = {}
    peers: dict[str, float] = {}
    allowed_peers: dict[str, float] = {}
    denied_peers: dict[str, float] = {}
    for part in parts:
        for le, v in part.latency.items():
            latency[le] = latency.get(le, 0.0) + v
        _add(peers, part.peers)
        _add(allowed_peers, part.allowed_peers)
        _add(denied_peers, part.denied_peers)
    return Traffic(
        seconds=max((p.seconds for p in parts), default=0.0),
        requests=sum(p.requests for p in parts),
        successes=sum(p.successes for p in parts),
        latency=latency,
        mtls_requests=sum(p.mtls_requests for p in parts),
        connections=sum(p.connections for p in parts),
        mtls_connections=sum(p.mtls_connections for p in parts),
        peers=peers,
        open_connections=sum(p.open_connections for p in parts),
        read_bytes=sum(p.read_bytes for p in parts),
        write_bytes=sum(p.write_bytes for p in parts),
        allowed=sum(p.allowed for p in parts),
        denied=sum(p.denied for p in parts),
        allowed_peers=allowed_peers,
        denied_peers=denied_peers,
    )


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the view: a workload or a replica."""

    name: str
    meshed: str  # "ready/pods"
    requests: float
    rps: float | None
    success: float | None  # fraction
    quantiles: tuple[float | None, ...]  # ms, for QUANTILES
    mtls: float | None  # fraction of requests (or, for TCP, connections) over mutual TLS
    connections_per_s: float | None
    peers: tuple[str, ...]
    share: float | None = None  # of its workload's requests (replicas)
    open_connections: float = 0.0
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    allowed: float = 0.0  # connections and requests authorization allowed
    denied: float = 0.0  # and denied
    denied_peers: tuple[str, ...] = ()  # the client identities denied


def row(name: str, meshed: str, t: Traffic, share: float | None = None) -> Row:
    rate = (lambda n: n / t.seconds) if t.seconds > 0 else (lambda n: None)
    if t.requests:
        mtls: float | None = t.mtls_requests / t.requests
    elif t.connections:
        mtls = t.mtls_connections / t.connections
    else:
        mtls = None
    return Row(
        name=name,
        meshed=meshed,
        requests=t.requests,
        rps=rate(t.requests),
        success=t.successes / t.requests if t.requests else None,
        quantiles=tuple(quantile(q, t.latency) for q in QUANTILES),
        mtls=mtls,
        connections_per_s=rate(t.connections),
        peers=tuple(sorted(peer for peer, n in t.peers.items() if n > 0)),
        share=share,
        open_connections=t.open_connections,
        read_bytes_per_s=rate(t.read_bytes),
        write_bytes_per_s=rate(t.write_bytes),
        allowed=t.allowed,
        denied=t.denied,
        denied_peers=tuple(sorted(peer for peer, n in t.denied_peers.items() if n > 0 and peer)),
    )


def replica_rows(traffic_by_pod: Mapping[str, Traffic], pods: Sequence[str]) -> list[Row]:
    """One row per replica of a workload, with its share of the workload's requests."""
    total = sum(traffic_by_pod[p].requests for p in pods if p in traffic_by_pod)
    rows = []
    for pod in pods:
        t = traffic_by_pod.get(pod)
        if t is None:
            continue
        rows.append(row(pod, "", t, t.requests / total if total else None))
    return rows
