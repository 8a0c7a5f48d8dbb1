"""`grpc_server_handled_total`, named and labelled as go-grpc-prometheus does."""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter


class HandledCounter:
    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self._service = service
        self._counter = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, by method and status code.",
            ["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        )

    def observe(self, grpc_type: str, method: str, code: grpc.StatusCode) -> None:
        self._counter.labels(grpc_type, self._service, method, code.name).inc()

    def for_service(self, service: str) -> HandledCounter:
        """A counter of another service on the same server, sharing this one's metric."""
        view = object.__new__(HandledCounter)
        view._service, view._counter = service, self._counter
        return view
