"""The metrics API behind `meshlet viz stat|edges|routes|top` and the web dashboard
(`meshlet-controller web`): Linkerd's viz queries, as PromQL over the proxies' Linkerd metric
names, run against a Prometheus' HTTP API (`/api/v1/query`).

Prometheus knows which pod a proxy's series came from only by the labels its scrape config
attaches (`namespace`, `pod`, `deployment`, `serviceaccount`, as Linkerd's config relabels them
from the pod); the proxy itself labels the other side of each request (`dst_*`, `server_id`,
`client_id`). The query builders are pure; `Prometheus.query` is the one place that does I/O.
It lives in the control plane, stdlib only, so that both the CLI and the dashboard's
controller import it (the control plane never imports the CLI); reading the proxies directly,
without a Prometheus, stays in `meshlet.cli.vizmetrics`.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

TIMEOUT: Final = 10.0  # seconds for one query
MAX_BODY: Final = 32 * 1024 * 1024  # bytes of one answer
QUANTILES: Final = (0.5, 0.95, 0.99)  # the latency percentiles every view shows
KINDS: Final = {  # what the user types → the label Prometheus' series carry
    "deploy": "deployment", "deployment": "deployment", "deployments": "deployment",
    "po": "pod", "pod": "pod", "pods": "pod",
    "ns": "namespace", "namespace": "namespace", "namespaces": "namespace",
    "svc": "service", "service": "service", "services": "service",
    "au": "authority", "authority": "authority", "authorities": "authority",
}  # fmt: skip
_WINDOW: Final = re.compile(r"^[1-9][0-9]*[smh]$")


class MetricsError(Exception):
    """A query could not be answered; the message says why (and which query)."""


@dataclass(frozen=True, slots=True)
class Sample:
    labels: Mapping[str, str]
    value: float


class Prometheus:
    """A Prometheus' instant-query API."""

    def __init__(self, url: str, timeout: float = TIMEOUT, deadline: float | None = None) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise MetricsError(f"{url!r} is not an http(s) URL of a Prometheus")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.deadline = deadline  # time.monotonic() past which no query is asked (None: none)

    def within(self, seconds: float) -> Prometheus:
        """The same Prometheus, its queries from now on all done within `seconds`."""
        return Prometheus(self.url, self.timeout, time.monotonic() + seconds)

    def query(self, promql: str) -> list[Sample]:
        """The instant vector `promql` evaluates to now."""
        target = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        timeout = self.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise MetricsError(f"Prometheus at {self.url} did not answer in time")
        try:
            with urllib.request.urlopen(target, timeout=timeout) as response:
                body = response.read(MAX_BODY + 1)
        except urllib.error.HTTPError as exc:
            body = exc.read(MAX_BODY + 1)
            if not body.lstrip().startswith(b"{"):
                raise MetricsError(f"Prometheus answered {exc.code} to {promql}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise MetricsError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        if len(body) > MAX_BODY:
            raise MetricsError(f"Prometheus' answer to {promql} is over {MAX_BODY} bytes")
        return _vector(promql, body)


def _vector(promql: str, body: bytes) -> list[Sample]:
    try:
        doc = json.loads(body)
    except ValueError:
        raise MetricsError(f"Prometheus' answer to {promql} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise MetricsError(f"Prometheus refused {promql}: {error or 'no reason given'}")
    data = doc.get("data") or {}
    if data.get("resultType") != "vector":
        raise MetricsError(f"{promql} gave a {data.get('resultType')}, not an instant vector")
    samples = []
    for item in data.get("result") or []:
        value = float(item["value"][1])
        samples.append(Sample(dict(item.get("metric") or {}), value))
    return samples


# -- the queries (pure) -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A resource: its label (`deployment`, `pod`, `namespace`, `service`, `authority`), its
    name (None: every one) and namespace (None: every one)."""

    kind: str
    name: str | None = None
    namespace: str | None = None


def target(text: str, namespace: str | None) -> Target:
    """`deploy`, `deploy/web`, `po/web-1`, `ns/demo`, `svc/web`, `authority/web.demo:8080`."""
    kind, _, name = text.partition("/")
    label = KINDS.get(kind.lower())
    if label is None:
        raise ValueError(f"unknown resource type {kind!r}; one of {', '.join(sorted(KINDS))}")
    if label == "namespace":
        return Target(label, name or None, None)
    return Target(label, name or None, namespace)


def window(text: str) -> str:
    if not _WINDOW.match(text):
        raise ValueError(f"{text!r} is not a window like 30s, 1m or 1h")
    return text


def seconds(window_text: str) -> float:
    return int(window_text[:-1]) * {"s": 1, "m": 60, "h": 3600}[window_text[-1]]


def selector(labels: Mapping[str, str]) -> str:
    """`{a="b", c=~"d|"}` with PromQL's string escapes: a label written `NAME=~` matches the
    regular expression given."""
    pairs = []
    for key, value in sorted(labels.items()):
        name, op = (key[:-2], "=~") if key.endswith("=~") else (key, "=")
        pairs.append(f"{name}{op}{json.dumps(value)}")
    return "{" + ", ".join(pairs) + "}"


@dataclass(frozen=True, slots=True)
class StatQuery:
    """The series a stat row is summed from, and the labels that name its rows."""

    labels: dict[str, str]
    key: str  # the label naming a row
    ns_key: str | None  # the label naming its namespace

    @property
    def by(self) -> str:
        return ", ".join(k for k in (self.ns_key, self.key) if k)


def _own(t: Target, prefix: str = "") -> dict[str, str]:
    """The labels naming `t`'s series; with prefix `dst_`, those naming it as a destination,
    whose namespace may be absent (an endpoint the destination service labelled without one)."""
    labels = {}
    if t.namespace is not None and t.kind != "namespace":
        if prefix:
            labels[f"{prefix}namespace=~"] = f"{re.escape(t.namespace)}|"
        else:
            labels["namespace"] = t.namespace
    if t.name is not None:
        labels[f"{prefix}{t.kind}"] = t.name
    return labels


def stat_query(t: Target, *, to: Target | None = None, src: Target | None = None) -> StatQuery:
    """Which series: inbound of the resource (Linkerd's default); with `to`, its outbound
    requests to `to`; with `src`, the outbound requests of `src` to it. A service's requests
    are its clients' outbound ones (a service has no proxy)."""
    ns_key = None if t.kind == "namespace" else "namespace"
    if to is not None:
        labels = {"direction": "outbound", **_own(t), **_own(to, "dst_")}
        return StatQuery(labels, t.kind, ns_key)
    if src is not None or t.kind == "service":
        labels = {"direction": "outbound", **_own(t, "dst_"), **(_own(src) if src else {})}
        return StatQuery(labels, f"dst_{t.kind}", ns_key and "dst_namespace")
    return StatQuery({"direction": "inbound", **_own(t)}, t.kind, ns_key)


def stat_queries(q: StatQuery, window_text: str) -> dict[str, str]:
    """Linkerd's stat-summary queries (viz/metrics-api/stat_summary.go), by name."""
    sel = selector(q.labels)
    peer = "src" if q.labels["direction"] == "inbound" else "dst"
    tcp = selector({**q.labels, "peer": peer})
    w, by = window_text, q.by
    queries = {
        "requests": f"sum(increase(response_total{sel}[{w}])) by ({by}, classification, tls)",
    }
    if q.key != "authority":  # connections carry no authority: Linkerd shows none for one
        queries.update({
            "tcp_connections": f"sum(tcp_open_connections{tcp}) by ({by})",
            "tcp_read_bytes": f"sum(increase(tcp_read_bytes_total{tcp}[{w}])) by ({by})",
            "tcp_write_bytes": f"sum(increase(tcp_write_bytes_total{tcp}[{w}])) by ({by})",
        })  # fmt: skip
    for quantile in QUANTILES:
        queries[f"latency_p{quantile * 100:g}"] = (
            f"histogram_quantile({quantile}, "
            f"sum(rate(response_latency_ms_bucket{sel}[{w}])) by (le, {by}))"
        )
    return queries


def edge_queries(kind: str, window_text: str) -> dict[str, str]:
    """Who calls whom. Linkerd's edges come from open TCP connections; here from what each
    proxy sent and opened: its outbound requests (so that short-lived clients show) and its
    outbound TCP connections, opened in the window or open now (so that opaque TCP, which
    has no requests, shows too), by the destination's `dst_KIND` and the identity it proved
    (`server_id`); and each proxy's inbound requests and connections by the identity its client
    proved (`client_id`)."""
    w = window_text
    side = (
        f"namespace, {kind}, serviceaccount, dst_namespace, dst_{kind}, server_id, tls, "
        "no_tls_reason"
    )
    dst = 'direction="outbound", peer="dst"'
    src = 'direction="inbound", peer="src"'
    return {
        "outbound": f'sum(increase(request_total{{direction="outbound"}}[{w}])) by ({side})',
        "outbound_tcp": f"sum(increase(tcp_open_total{{{dst}}}[{w}])) by ({side})",
        "outbound_open": f"sum(tcp_open_connections{{{dst}}}) by ({side})",
        "inbound": (
            f'sum(increase(response_total{{direction="inbound"}}[{w}])) by (namespace, {kind}, '
            "client_id, tls)"
        ),
        "inbound_tcp": (
            f"sum(increase(tcp_open_total{{{src}}}[{w}]) + tcp_open_connections{{{src}}}) "
            f"by (namespace, {kind}, client_id, tls)"
        ),
    }


def route_queries(t: Target, window_text: str, *, to: Target | None = None) -> dict[str, str]:
    """Linkerd's top-routes queries (viz/metrics-api/top_routes.go): per route (`rt_route`) of
    the resource's inbound side, or of its outbound requests to `to`'s service."""
    labels = {"direction": "inbound" if to is None else "outbound", **_own(t)}
    sel, w = selector(labels), window_text
    if to is not None and to.name is not None:
        if to.kind == "service":
            ns = re.escape(to.namespace or "default")
            dst = f"dst=~{json.dumps(re.escape(to.name) + '[.]' + ns + '[.]svc[.].+')}"
        else:
            dst = f"dst={json.dumps(to.name)}"
        sel = sel[:-1] + (", " if labels else "") + dst + "}"
    queries = {
        "requests": (
            f"sum(increase(route_response_total{sel}[{w}])) by (rt_route, dst, classification)"
        ),
    }
    if to is not None:  # attempts (retries included) are counted on the sending side only
        queries["actual_requests"] = (
            f"sum(increase(route_actual_response_total{sel}[{w}])) by (rt_route, dst, "
            "classification)"
        )
    for quantile in QUANTILES:
        queries[f"latency_p{quantile * 100:g}"] = (
            f"histogram_quantile({quantile}, "
            f"sum(rate(route_response_latency_ms_bucket{sel}[{w}])) by (le, dst, rt_route))"
        )
    return queries


# -- the answers --------------------------------------------------------------------------


@dataclass(slots=True)
class StatRow:
    namespace: str | None
    name: str
    requests: float = 0.0
    successes: float = 0.0
    mtls_requests: float = 0.0
    window: float = 0.0
    latency: dict[str, float | None] = field(default_factory=dict)  # p50.. → ms
    tcp_connections: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0

    @property
    def success(self) -> float | None:
        return self.successes / self.requests if self.requests else None

    @property
    def rps(self) -> float | None:
        return self.requests / self.window if self.window else None

    @property
    def mtls(self) -> float | None:
        return self.mtls_requests / self.requests if self.requests else None

    def as_dict(self) -> dict[str, object]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {
            "namespace": self.namespace, "name": self.name, "requests": r(self.requests),
            "success": r(self.success), "rps": r(self.rps), "mtls": r(self.mtls),
            **{f"latency_ms_{k}": r(v) for k, v in self.latency.items()},
            "tcp_open_connections": r(self.tcp_connections),
            "tcp_read_bytes_rate": r(self.read_bytes / self.window if self.window else None),
            "tcp_write_bytes_rate": r(self.write_bytes / self.window if self.window else None),
        }  # fmt: skip


def _finite(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


def stat(
    prom: Prometheus,
    q: StatQuery,
    window_text: str,
    *,
    run: Callable[[str], list[Sample]] | None = None,
) -> list[StatRow]:
    """One row per resource the series name, from Prometheus."""
    query = run or prom.query
    rows: dict[tuple[str | None, str], StatRow] = {}

    def row(labels: Mapping[str, str]) -> StatRow:
        key = (labels.get(q.ns_key) if q.ns_key else None, labels.get(q.key, ""))
        if key not in rows:
            rows[key] = StatRow(key[0], key[1], window=seconds(window_text))
        return rows[key]

    for name, promql in stat_queries(q, window_text).items():
        for sample in query(promql):
            r = row(sample.labels)
            if name == "requests":
                r.requests += sample.value
                if sample.labels.get("classification") == "success":
                    r.successes += sample.value
                if sample.labels.get("tls") == "true":
                    r.mtls_requests += sample.value
            elif name.startswith("latency_"):
                r.latency[name.removeprefix("latency_")] = _finite(sample.value)
            elif name == "tcp_connections":
                r.tcp_connections += sample.value
            elif name == "tcp_read_bytes":
                r.read_bytes += sample.value
            elif name == "tcp_write_bytes":
                r.write_bytes += sample.value
    for r in rows.values():
        for quantile in QUANTILES:
            r.latency.setdefault(f"p{quantile * 100:g}", None)
    return sorted(rows.values(), key=lambda r: (r.namespace or "", r.name))


@dataclass(frozen=True, slots=True)
class Edge:
    src_namespace: str
    src: str
    dst_namespace: str
    dst: str
    client_id: str  # the identity the destination's proxy saw the source prove ("" unknown)
    server_id: str  # the identity the destination proved to the source's proxy
    mtls: bool
    no_tls_reason: str
    requests: float  # HTTP requests sent in the window
    connections: float = 0.0  # TCP connections opened in the window (HTTP's and opaque ones)

    def as_dict(self) -> dict[str, object]:
        return {
            "src_namespace": self.src_namespace, "src": self.src,
            "dst_namespace": self.dst_namespace, "dst": self.dst, "client_id": self.client_id,
            "server_id": self.server_id, "mtls": self.mtls, "no_tls_reason": self.no_tls_reason,
            "requests": round(self.requests, 4), "connections": round(self.connections, 4),
        }  # fmt: skip


def _namespace_of(identity: str) -> str:
    """`SA.NS.serviceaccount.identity.…` → NS."""
    parts = identity.split(".")
    return parts[1] if len(parts) > 2 and parts[2] == "serviceaccount" else ""


def _client_id(
    seen: Mapping[tuple[str, str], set[str]], dst_ns: str, dst: str, sa: str, src_ns: str
) -> str:
    """Of the identities `dst` saw its clients prove, the one of the source's ServiceAccount
    (identities are `SA.NS.serviceaccount.identity...`)."""
    for identity in sorted(seen.get((dst_ns, dst), ())):
        if sa and identity.startswith(f"{sa}.{src_ns}."):
            return identity
    return ""


def edges(
    prom: Prometheus, kind: str, window_text: str, namespace: str | None, *,
    run: Callable[[str], list[Sample]] | None = None,
) -> list[Edge]:  # fmt: skip
    """Edges between resources of `kind` with requests or TCP connections in the window (or
    connections open now), touching `namespace`. A destination's namespace is its
    `dst_namespace`, else the one its identity names."""
    query = run or prom.query
    queries = edge_queries(kind, window_text)
    seen: dict[tuple[str, str], set[str]] = {}
    for name in ("inbound", "inbound_tcp"):
        for s in query(queries[name]):
            if s.value > 0 and s.labels.get("tls") == "true" and s.labels.get("client_id"):
                key = (s.labels.get("namespace", ""), s.labels.get(kind, ""))
                seen.setdefault(key, set()).add(s.labels["client_id"])
    # (src_ns, src, dst_ns, dst, server_id, mtls) → requests, connections, open; labels
    counts: dict[tuple[str, str, str, str, str, bool], list[float]] = {}
    labels: dict[tuple[str, str, str, str, str, bool], Mapping[str, str]] = {}
    for column, name in enumerate(("outbound", "outbound_tcp", "outbound_open")):
        for s in query(queries[name]):
            lb = s.labels
            if s.value <= 0 or math.isnan(s.value) or not lb.get(f"dst_{kind}"):
                continue
            src_ns = lb.get("namespace", "")
            dst_ns = lb.get("dst_namespace") or _namespace_of(lb.get("server_id", ""))
            if namespace is not None and namespace not in (src_ns, dst_ns):
                continue
            mtls = lb.get("tls") == "true"
            edge = (src_ns, lb.get(kind, ""), dst_ns, lb[f"dst_{kind}"], lb.get("server_id", ""),
                    mtls)  # fmt: skip
            counts.setdefault(edge, [0.0, 0.0, 0.0])[column] += s.value
            labels.setdefault(edge, lb)
    out = []
    for edge, (requests, connections, _) in counts.items():
        src_ns, src, dst_ns, dst, server_id, mtls = edge
        lb = labels[edge]
        sa = lb.get("serviceaccount", "")
        client = _client_id(seen, dst_ns, dst, sa, src_ns) if mtls else ""
        out.append(Edge(src_ns, src, dst_ns, dst, client, server_id, mtls,
                        lb.get("no_tls_reason", ""), requests, connections))  # fmt: skip
    return sorted(out, key=lambda e: (e.src_namespace, e.src, e.dst_namespace, e.dst))


@dataclass(slots=True)
class RouteRow:
    route: str  # "[DEFAULT]" for the default route
    dst: str
    requests: float = 0.0
    successes: float = 0.0
    actual_requests: float = 0.0
    actual_successes: float = 0.0
    window: float = 0.0
    latency: dict[str, float | None] = field(default_factory=dict)

    @property
    def success(self) -> float | None:
        return self.successes / self.requests if self.requests else None

    @property
    def rps(self) -> float | None:
        return self.requests / self.window if self.window else None

    def as_dict(self) -> dict[str, object]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 4)

        return {
            "route": self.route, "dst": self.dst, "requests": r(self.requests),
            "success": r(self.success), "rps": r(self.rps),
            "actual_requests": r(self.actual_requests),
            **{f"latency_ms_{k}": r(v) for k, v in self.latency.items()},
        }  # fmt: skip


DEFAULT_ROUTE: Final = "[DEFAULT]"


def routes(
    prom: Prometheus, t: Target, window_text: str, *, to: Target | None = None,
    run: Callable[[str], list[Sample]] | None = None,
) -> list[RouteRow]:  # fmt: skip
    query = run or prom.query
    rows: dict[tuple[str, str], RouteRow] = {}
    for name, promql in route_queries(t, window_text, to=to).items():
        for s in query(promql):
            key = (s.labels.get("rt_route") or DEFAULT_ROUTE, s.labels.get("dst", ""))
            r = rows.setdefault(key, RouteRow(*key, window=seconds(window_text)))
            success = s.labels.get("classification") == "success"
            if name == "requests":
                r.requests += s.value
                r.successes += s.value if success else 0.0
            elif name == "actual_requests":
                r.actual_requests += s.value
                r.actual_successes += s.value if success else 0.0
            else:
                r.latency[name.removeprefix("latency_")] = _finite(s.value)
    for r in rows.values():
        for quantile in QUANTILES:
            r.latency.setdefault(f"p{quantile * 100:g}", None)
    return sorted(rows.values(), key=lambda r: (r.dst, r.route))


PROXY_JOB: Final = "meshlet-proxy"  # the scrape job of the proxies' admin ports


def meshed_query(kind: str) -> str:
    """How many proxies Prometheus scrapes now (`up == 1`) per resource of `kind`: Linkerd's
    meshed pod count, as Prometheus sees the pods."""
    by = "namespace" if kind == "namespace" else f"namespace, {kind}"
    return f"count(up{selector({'job': PROXY_JOB})} == 1) by ({by})"


def meshed_pods(
    prom: Prometheus, kind: str, namespace: str | None, *,
    run: Callable[[str], list[Sample]] | None = None,
) -> dict[tuple[str | None, str], int]:  # fmt: skip
    """(namespace, name) → meshed pods, keyed as `stat`'s rows are (a namespace's row has no
    namespace)."""
    query = run or prom.query
    out: dict[tuple[str | None, str], int] = {}
    for s in query(meshed_query(kind)):
        ns = s.labels.get("namespace", "")
        if namespace is not None and kind != "namespace" and ns != namespace:
            continue
        key = (None, ns) if kind == "namespace" else (ns, s.labels.get(kind, ""))
        out[key] = int(s.value)
    return out
