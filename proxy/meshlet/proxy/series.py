"""The proxy's metrics without a metrics library: counters, gauges and histograms with one
child per label set, counted in a plain attribute (no lock, no per-call checks: the proxy is
one thread), collected into `Family`s when scraped, and rendered in Prometheus' text format
(version 0.0.4) by the `Registry`.

The proxy does its own rendering to stay within its memory budget: `prometheus_client` costs a
running proxy ~5 MiB of resident memory for what is a few dozen lines here (tests parse the
output with prometheus_client's parser, so the format is checked by an independent reader).

Labels whose value is empty are left out of a series (as Linkerd's proxy leaves out labels it
has no value for), so one family can hold inbound series without `dst_*` labels and outbound
ones with them.
"""

from __future__ import annotations

import bisect
import math
import os
import resource
import time
from collections.abc import Iterator, Sequence
from typing import Final, Literal, NamedTuple, Protocol

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
CHUNK_SAMPLES: Final = 1000  # samples rendered between two chances for other work (a few ms)
Labels = dict[str, str]
Kind = Literal["counter", "gauge", "histogram"]


class Sample(NamedTuple):
    name: str
    labels: Labels
    value: float


class Family:
    """One metric's samples, as collected for a scrape."""

    __slots__ = ("doc", "kind", "name", "samples")

    def __init__(self, name: str, kind: Kind, doc: str) -> None:
        self.name = name  # counters: without `_total` (their samples and HELP/TYPE have it)
        self.kind = kind
        self.doc = doc
        self.samples: list[Sample] = []

    def add_sample(self, name: str, labels: Labels, value: float) -> None:
        self.samples.append(Sample(name, labels, value))


class Collector(Protocol):
    def collect(self) -> Iterator[Family]: ...


class Registry:
    """The collectors of one process, rendered together."""

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        self._collectors.append(collector)

    def collect(self) -> Iterator[Family]:
        for collector in self._collectors:
            yield from collector.collect()

    def render(self) -> bytes:
        return b"".join(self.render_chunks())

    def render_chunks(self, samples: int = CHUNK_SAMPLES) -> Iterator[bytes]:
        """The text format in pieces of about `samples` samples, so that a caller on the event
        loop can let other work run between them (the admin server does). Each family is
        collected whole at once: its samples are from one instant."""
        out: list[str] = []
        for family in self.collect():
            exposed = f"{family.name}_total" if family.kind == "counter" else family.name
            out.append(f"# HELP {exposed} {_escape_doc(family.doc)}\n")
            out.append(f"# TYPE {exposed} {family.kind}\n")
            for name, labels, value in family.samples:
                if labels:
                    pairs = ",".join(f'{k}="{_escape_value(labels[k])}"' for k in sorted(labels))
                    out.append(f"{name}{{{pairs}}} {_number(value)}\n")
                else:
                    out.append(f"{name} {_number(value)}\n")
                if len(out) >= samples:
                    yield "".join(out).encode()
                    out = []
        if out:
            yield "".join(out).encode()

    def get_sample_value(self, name: str, labels: Labels | None = None) -> float | None:
        """The value of the sample `name` with exactly `labels` (None: not there)."""
        wanted = labels or {}
        for family in self.collect():
            for sample, got, value in family.samples:
                if sample == name and got == wanted:
                    return value
        return None


def _escape_doc(doc: str) -> str:
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if value != value:
        return "NaN"
    return repr(float(value))


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


class GaugeChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)


class _Family:
    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labels)

    def _labels(self, values: tuple[str, ...]) -> dict[str, str]:
        return labels_of(self.labelnames, values)


def labels_of(names: Sequence[str], values: Sequence[str]) -> dict[str, str]:
    """A series' labels: those with a value."""
    return {name: value for name, value in zip(names, values, strict=True) if value}


class Counter(_Family):
    """`name` without `_total` (added when exposed)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str], registry: Registry) -> None:
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

    def collect(self) -> Iterator[Family]:
        total = f"{self.name}_total"
        family = Family(self.name, "counter", self.doc)
        for values, child in list(self._children.items()):
            family.add_sample(total, self._labels(values), child.value)
        yield family


class Histogram(_Family):
    def __init__(
        self,
        name: str,
        doc: str,
        labels: Sequence[str],
        registry: Registry,
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

    def collect(self) -> Iterator[Family]:
        family = Family(self.name, "histogram", self.doc)
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


class Gauge(_Family):
    """A gauge with labels (`labels(...).set(v)`), or without (`set(v)`)."""

    def __init__(self, name: str, doc: str, registry: Registry, labels: Sequence[str] = ()) -> None:
        super().__init__(name, doc, labels)
        self._children: dict[tuple[str, ...], GaugeChild] = {}
        if not labels:
            self._children[()] = GaugeChild()
        registry.register(self)

    def labels(self, *values: str) -> GaugeChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(values)} label values for {self.labelnames}")
            child = self._children[values] = GaugeChild()
        return child

    def set(self, value: float) -> None:
        self.labels().set(value)

    def collect(self) -> Iterator[Family]:
        family = Family(self.name, "gauge", self.doc)
        for values, child in list(self._children.items()):
            family.add_sample(self.name, self._labels(values), child.value)
        yield family


class ProcessMetrics:
    """process_* as Prometheus' client libraries export them, read from /proc at each scrape."""

    def __init__(self, registry: Registry) -> None:
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._boot = _boot_time()
        registry.register(self)

    def collect(self) -> Iterator[Family]:
        try:
            with open("/proc/self/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            return
        # fields[0] is the state (field 3 of proc(5)): field n is fields[n - 3]
        utime, stime = int(fields[11]), int(fields[12])
        start, vsize, rss = int(fields[19]), int(fields[20]), int(fields[21])
        values: list[tuple[str, Kind, str, float]] = [
            ("process_cpu_seconds", "counter", "Total user and system CPU time spent in "
             "seconds.", (utime + stime) / self._ticks),
            ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", vsize),
            ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
             rss * self._page),
            ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch "
             "in seconds.", self._boot + start / self._ticks),
            ("process_open_fds", "gauge", "Number of open file descriptors.",
             len(os.listdir("/proc/self/fd"))),
            ("process_max_fds", "gauge", "Maximum number of open file descriptors.",
             resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
        ]  # fmt: skip
        for name, kind, doc, value in values:
            family = Family(name, kind, doc)
            family.add_sample(f"{name}_total" if kind == "counter" else name, {}, value)
            yield family


def _boot_time() -> float:
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return time.time() - time.monotonic()
