"""Counters and histograms for the request path: one child per label set, counted in a plain
attribute (no lock, no per-call checks: the proxy is one thread), and exposed by collecting
them into prometheus_client's metric families when the registry is scraped.

Labels whose value is empty are left out of a series (as Linkerd's proxy leaves out labels it
has no value for), so one family can hold inbound series without `dst_*` labels and outbound
ones with them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


class _Family:
    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labels)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # label sets are only known when collected

    def _labels(self, values: tuple[str, ...]) -> dict[str, str]:
        return labels_of(self.labelnames, values)


def labels_of(names: Sequence[str], values: Sequence[str]) -> dict[str, str]:
    """A series' labels: those with a value."""
    return {name: value for name, value in zip(names, values, strict=True) if value}


class Counter(_Family):
    """`name` without `_total` (added when exposed), as prometheus_client's Counter."""

    def __init__(
        self, name: str, doc: str, labels: Sequence[str], registry: CollectorRegistry
    ) -> None:
        super().__init__(name, doc, labels)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(values)} label values for {self.labelnames}")
            child = self._children[values] = CounterChild()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc)
        total = f"{self.name}_total"
        for values, child in list(self._children.items()):
            family.add_sample(total, self._labels(values), child.value)
        yield family


class Histogram(_Family):
    def __init__(
        self,
        name: str,
        doc: str,
        labels: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float],
    ) -> None:
        super().__init__(name, doc, labels)
        self._bounds = tuple(float(bound) for bound in buckets)
        self._les = [*(f"{bound:g}" for bound in buckets), "+Inf"]
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(values)} label values for {self.labelnames}")
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc)
        bucket, count, total = f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum"
        for values, child in list(self._children.items()):
            labels = self._labels(values)
            cumulative = 0
            for le, n in zip(self._les, child.counts, strict=True):
                cumulative += n
                family.add_sample(bucket, {**labels, "le": le}, cumulative)
            family.add_sample(count, labels, cumulative)
            family.add_sample(total, labels, child.sum)
        yield family
