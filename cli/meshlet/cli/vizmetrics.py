"""The metrics API behind `meshlet viz stat|edges|routes`: the Prometheus queries come from
`meshlet.controlplane.vizmetrics` (which the web dashboard's controller shares); this module
adds the answer without a Prometheus, `direct_stat`, from two reads of the proxies themselves
with `meshlet.cli.stats` (what `meshlet stat` uses).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from meshlet.cli import stats
from meshlet.controlplane.vizmetrics import (
    DEFAULT_ROUTE,
    KINDS,
    MAX_BODY,
    QUANTILES,
    TIMEOUT,
    Edge,
    MetricsError,
    Prometheus,
    RouteRow,
    Sample,
    StatQuery,
    StatRow,
    Target,
    edge_queries,
    edges,
    route_queries,
    routes,
    seconds,
    selector,
    stat,
    stat_queries,
    stat_query,
    target,
    window,
)

__all__ = [  # the queries, re-exported for the CLI's commands
    "DEFAULT_ROUTE",
    "KINDS",
    "MAX_BODY",
    "QUANTILES",
    "TIMEOUT",
    "Edge",
    "MetricsError",
    "Prometheus",
    "Proxy",
    "RouteRow",
    "Sample",
    "StatQuery",
    "StatRow",
    "Target",
    "direct_stat",
    "edge_queries",
    "edges",
    "read_proxy",
    "route_queries",
    "routes",
    "seconds",
    "selector",
    "stat",
    "stat_queries",
    "stat_query",
    "target",
    "window",
]


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy to read directly: its pod, the pod's workload and namespace, its admin URL."""

    pod: str
    workload: str
    namespace: str
    admin: str


def read_proxy(proxy: Proxy, now: Callable[[], float], timeout: float = TIMEOUT) -> stats.Scrape:
    try:
        with urllib.request.urlopen(f"{proxy.admin}/metrics", timeout=timeout) as response:
            text = response.read(MAX_BODY).decode()
    except (urllib.error.URLError, OSError) as exc:
        raise MetricsError(f"cannot read {proxy.pod}'s proxy at {proxy.admin}: {exc}") from None
    return stats.Scrape(proxy.pod, now(), stats.parse(text))


def direct_stat(
    proxies: Sequence[Proxy], kind: str, first: Mapping[str, stats.Scrape],
    second: Mapping[str, stats.Scrape],
) -> list[StatRow]:  # fmt: skip
    """Inbound stat rows per workload (`deployment`) or pod from two reads of each proxy,
    computed by `meshlet.cli.stats` as `meshlet stat` does."""
    groups: dict[tuple[str, str], list[stats.Traffic]] = {}
    for p in proxies:
        if p.pod in first and p.pod in second:
            key = (p.namespace, p.workload if kind == "deployment" else p.pod)
            groups.setdefault(key, []).append(stats.traffic(first[p.pod], second[p.pod]))
    rows = []
    for (ns, name), parts in sorted(groups.items()):
        t = stats.combine(parts)
        rows.append(StatRow(
            ns, name, requests=t.requests, successes=t.successes, mtls_requests=t.mtls_requests,
            window=t.seconds, tcp_connections=t.open_connections, read_bytes=t.read_bytes,
            write_bytes=t.write_bytes,
            latency={f"p{q * 100:g}": stats.quantile(q, t.latency) for q in QUANTILES},
        ))  # fmt: skip
    return rows
