"""What the callers' proxies say of api's outbound policy (pure): how the HTTPRoute split its
calls between the backends, and what each balancer holds.

Read from the *outbound* side, where the route is applied: web's proxy counts each call it sends
to a route backend (`outbound_http_route_backend_requests_total`, by parent and backend, as
Linkerd 2.16 names it) and exports each backend's balancer: its endpoints ready, and those
pending (ejected by failure accrual, being probed, or backing off after a failed connection)
(`outbound_http_balancer_endpoints`). Both are summed over every proxy scraped, so the split is
the whole mesh's whoever calls api.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from meshlet.cli.stats import Scrape, Series

BACKEND_REQUESTS: Final = "outbound_http_route_backend_requests_total"
BALANCER_ENDPOINTS: Final = "outbound_http_balancer_endpoints"


def backend_requests(series: Series, parent: str) -> dict[str, float]:
    """Requests each backend of `parent`'s routes was sent, by the backend's name."""
    out: dict[str, float] = {}
    for (name, labels), value in series.items():
        if name != BACKEND_REQUESTS:
            continue
        tags = dict(labels)
        if tags.get("parent_name") == parent:
            backend = tags.get("backend_name", "")
            out[backend] = out.get(backend, 0.0) + value
    return out


def split_between(
    old: Mapping[str, Scrape | None], new: Mapping[str, Scrape], parent: str
) -> dict[str, float]:
    """Requests per backend of `parent` between two scrapes of each pod (from the proxy's
    start when a pod has no old scrape), summed over the pods."""
    out: dict[str, float] = {}
    for pod, scrape in new.items():
        before = old.get(pod)
        was = backend_requests(before.series, parent) if before is not None else {}
        for backend, count in backend_requests(scrape.series, parent).items():
            out[backend] = out.get(backend, 0.0) + max(0.0, count - was.get(backend, 0.0))
    return out


@dataclass(frozen=True, slots=True)
class Endpoints:
    ready: float
    pending: float


def balancers(scrapes: Iterable[Scrape]) -> dict[str, Endpoints]:
    """Each backend's balancer endpoints, ready and pending, summed over the proxies."""
    ready: dict[str, float] = {}
    pending: dict[str, float] = {}
    for scrape in scrapes:
        for (name, labels), value in scrape.series.items():
            if name != BALANCER_ENDPOINTS:
                continue
            tags = dict(labels)
            backend = tags.get("backend_name", "")
            into = pending if tags.get("endpoint_state") == "pending" else ready
            into[backend] = into.get(backend, 0.0) + value
    return {b: Endpoints(ready.get(b, 0.0), pending.get(b, 0.0)) for b in {*ready, *pending}}


def shares(counts: Mapping[str, float]) -> dict[str, float]:
    """Each backend's share of the requests counted (empty when there were none)."""
    total = sum(counts.values())
    return {b: n / total for b, n in counts.items()} if total else {}


def success(calls: Sequence[tuple[float, str, str]], start: float, end: float) -> float | None:
    """The share of the load's calls that ended in [start, end) and succeeded; None for none.
    `calls` are the load generator's (time, outcome, api pod)."""
    outcomes = [outcome for at, outcome, _ in calls if start <= at < end]
    return sum(1 for o in outcomes if o == "ok") / len(outcomes) if outcomes else None
