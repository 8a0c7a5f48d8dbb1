"""Routers for connections whose requests all go to one address: the inbound side (the pod's
own port) and outbound traffic that discovery does not know. Requests are labelled by their
authority (the address when they name none), as Linkerd labels them; no route policy applies."""

from __future__ import annotations

from dataclasses import dataclass

from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.http.contract import Addr, Endpoint, RequestTarget, RouteTarget
from meshlet.proxy.metrics import ProxyMetrics


@dataclass(frozen=True, slots=True)
class FixedPicker:
    """Every attempt goes to the same endpoint."""

    endpoint: Endpoint

    def pick(self, after: Endpoint | None = None) -> Endpoint:
        return self.endpoint


class FixedRouter:
    """Routes every request of a connection to `target`."""

    def __init__(self, target: Addr, metrics: ProxyMetrics) -> None:
        self._target = target
        self._metrics = metrics
        default = metrics.authority_label(str(target))
        self._default = RouteTarget(default, DEFAULT_ROUTE, None,
                                    FixedPicker(Endpoint(target, default)))  # fmt: skip
        self._by_label: dict[str, RouteTarget] = {default: self._default}  # few labels

    def route(self, request: RequestTarget) -> RouteTarget:
        if not request.authority:
            return self._default
        label = self._metrics.authority_label(request.authority)
        route = self._by_label.get(label)
        if route is None:
            endpoint = Endpoint(self._target, label)
            route = self._by_label[label] = RouteTarget(
                label, DEFAULT_ROUTE, None, FixedPicker(endpoint)
            )
        return route
