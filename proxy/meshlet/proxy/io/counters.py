"""What a connection counts, and the labels it is counted under: the values the engines fill in
and `metrics.py` sums at each scrape.

A `TcpConn` is one connection's counts (bytes read and written, open and closed), kept in plain
attributes so that a read or a write costs no lookup; `ConnLabels` are the connection's labels
(Linkerd's `tcp_*` and `request_*` labels), with the destination service's metric labels of an
outbound endpoint as `dst_<name>`. The families a recorder writes to are typed here too, as the
small protocols the engines see (`CounterFamily`, `HistogramFamily`), not the app's registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol

# The destination service's metric labels the proxy reports (as dst_<name>); others are
# dropped, so that what a controller sends cannot grow the label set.
DST_LABELS: Final = (
    "namespace", "service", "pod", "serviceaccount", "zone",
    "deployment", "statefulset", "daemonset", "replicaset", "job",
)  # fmt: skip
_DST_INDEX: Final = {name: i for i, name in enumerate(DST_LABELS)}
NO_DST: Final = ("",) * len(DST_LABELS)
Values = tuple[str, ...]  # ConnLabels.values(), in its fields' order
TcpKey = tuple[str, ...]  # (peer, *Values)


def dst_values(labels: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """The destination's metric labels of an endpoint, in DST_LABELS order ("" when absent)."""
    values = list(NO_DST)
    for name, value in labels:
        index = _DST_INDEX.get(name)
        if index is not None:
            values[index] = value
    return tuple(values)


@dataclass(frozen=True, slots=True)
class ConnLabels:
    """Labels of a connection: direction, peer, TLS (Linkerd's tcp_* and request_* labels)."""

    direction: str  # "inbound" | "outbound"
    target_addr: str
    tls: str = "no_identity"  # "true" | "no_identity"
    no_tls_reason: str = "not_provided_by_remote"
    client_id: str = ""  # inbound over mTLS: the client's identity
    server_id: str = ""  # outbound over mTLS: the server's identity
    dst: tuple[str, ...] = NO_DST  # outbound to a discovered endpoint: `dst_values`
    peer: str = ""  # the client's address (host:port), for tap events; never a metric label

    def values(self) -> Values:
        return (self.direction, self.target_addr, self.tls, self.no_tls_reason, self.client_id,
                self.server_id, *self.dst)  # fmt: skip


class Counted(Protocol):
    """One labelled counter."""

    def inc(self, amount: float = 1.0) -> None: ...


class Observed(Protocol):
    """One labelled histogram."""

    def observe(self, value: float) -> None: ...


class CounterFamily(Protocol):
    def labels(self, *values: str) -> Counted: ...


class HistogramFamily(Protocol):
    def labels(self, *values: str) -> Observed: ...


class TcpTotals(Protocol):
    """Where connections' counts are summed (`metrics.TcpMetrics`)."""

    def opened(self, conn: TcpConn) -> None: ...

    def closed(self, conn: TcpConn, exc: BaseException | None) -> None: ...


class TcpConn:
    """One TCP connection's counts. Whoever reads or writes adds to `read` / `written`; the
    connection counts as open from `open()` (once established) until `close()`."""

    __slots__ = ("_tcp", "key", "opened_at", "read", "written")

    def __init__(self, tcp: TcpTotals | None, key: TcpKey) -> None:
        self.read = 0
        self.written = 0
        self.key = key
        self.opened_at = 0.0  # 0: not open yet; -1: closed
        self._tcp = tcp

    @classmethod
    def uncounted(cls) -> TcpConn:
        """For a connection no metric is kept of."""
        return cls(None, ())

    def open(self) -> None:
        if self._tcp is not None and self.opened_at == 0.0:
            self._tcp.opened(self)

    def close(self, exc: BaseException | None = None) -> None:
        """Counted once; a close before `open` counts nothing."""
        if self._tcp is not None and self.opened_at > 0:
            self._tcp.closed(self, exc)
