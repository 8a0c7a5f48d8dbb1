"""Runs the destination service: a cluster-state source, publishers, gRPC and admin servers."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from meshlet.api import wellknown
from meshlet.api.admin import AdminServer
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import serve_until_signalled
from meshlet.controlplane.destination import scrape
from meshlet.controlplane.destination.model import Pod
from meshlet.controlplane.destination.publisher import Publishers
from meshlet.controlplane.destination.service import (
    DestinationMetrics,
    DestinationService,
    rpc_handler,
)
from meshlet.controlplane.destination.state import ClusterState
from meshlet.controlplane.k8s.events import Event, Source
from meshlet.controlplane.streaming import StreamingController, StreamLimits
from meshlet.controlplane.supervise import Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DestinationConfig:
    addr: HostPort
    admin_addr: HostPort
    source: Source
    # The manifests source has no endpoints controller: derive endpoints from selectors.
    derive_from_pods: bool
    tls: tuple[Path, Path] | None = None  # (certificate chain, key) PEM files
    cluster_domain: str = wellknown.CLUSTER_DOMAIN
    max_streams: int = 20_000
    max_streams_per_peer: int = 4_096
    stream_queue: int = 100


def informer_lag(registry: CollectorRegistry) -> Histogram:
    """`destination_informer_lag_seconds{kind}`: how long a watch event waited between the
    informer's thread and the event loop (the informer's `on_event` hook feeds it)."""
    return Histogram(
        "destination_informer_lag_seconds",
        "Time a watch event waited between the informer thread and the event loop.",
        ["kind"],
        buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
        registry=registry,
    )


class _SourceCounters(Collector):
    """Exports a KubernetesSource's `relists` and `reconnects` counts, per kind."""

    def __init__(self, source: Source) -> None:
        self._source = source

    def collect(self) -> list[Metric]:
        families: list[Metric] = []
        for name, help_text in (
            ("relists", "Full relists after a 410, a resync or a failed list."),
            ("reconnects", "Watches or lists that failed and were retried."),
        ):
            family = CounterMetricFamily(f"destination_informer_{name}", help_text, labels=["kind"])
            for kind, count in (getattr(self._source, name, None) or {}).items():
                family.add_metric([kind.kind], count)
            families.append(family)
        return families


class DestinationServer(StreamingController):
    def __init__(
        self, config: DestinationConfig, registry: CollectorRegistry | None = None
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.metrics = DestinationMetrics(self.registry)
        self.state = ClusterState(cluster_domain=config.cluster_domain)
        self.publishers = Publishers(
            self.state, derive_from_pods=config.derive_from_pods, capacity=config.stream_queue
        )
        self.limits = StreamLimits(config.max_streams, config.max_streams_per_peer)
        self._events = Counter(
            "destination_source_events_total", "Cluster events applied, by kind.", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self._last_event = Gauge(
            "destination_source_last_event_timestamp_seconds",
            "When the last event of each kind was applied (Unix time).",
            ["kind"],
            registry=self.registry,
        )
        self._processing = Histogram(
            "destination_event_processing_seconds",
            "From an event reaching the service to its updates queued on every stream.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self.registry.register(_SourceCounters(config.source))
        self._admin = AdminServer(
            partial(generate_latest, self.registry),
            ready=self.ready,
            documents={
                scrape.PROXIES_PATH: lambda: scrape.render(scrape.proxies(self._pods())),
                scrape.CONTROLLERS_PATH: lambda: scrape.render(scrape.controllers(self._pods())),
            },
        )
        self.supervisor = Supervisor("destination")
        self.supervisor.add("the cluster-state source", partial(config.source.run, self.apply))

    def _pods(self) -> list[Pod]:
        return list(self.state.pods.values())

    def ready(self) -> bool:
        """Serving gRPC from a source that runs and has listed every kind: answers from a
        dead source would be stale."""
        return self.grpc_port != 0 and self.supervisor.healthy and self.config.source.synced

    def apply(self, event: Event) -> None:
        """The source's sink: update state, then every publisher the event may change."""
        started = time.perf_counter()
        affected = self.state.apply(event)
        self.publishers.refresh(affected)
        self._processing.observe(time.perf_counter() - started)
        self._events.labels(event.kind.kind).inc()
        self._last_event.labels(event.kind.kind).set_to_current_time()

    async def start(self) -> None:
        cfg = self.config
        service = DestinationService(self.publishers, self.metrics, self.limits, cfg.cluster_domain)
        handler = rpc_handler(service)
        await self._serve((handler,), cfg.addr, cfg.admin_addr, cfg.tls)
        log.info("destination serving on :%d (admin :%d)", self.grpc_port, self.admin_port)


async def serve(config: DestinationConfig, registry: CollectorRegistry | None = None) -> int:
    """Serves until SIGTERM or SIGINT (0), or until its source fails for good (1)."""
    return await serve_until_signalled(DestinationServer(config, registry), "destination")
