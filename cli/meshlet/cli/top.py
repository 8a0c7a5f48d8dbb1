"""`meshlet viz top`'s table (pure): the requests a tap shows, grouped by source, destination,
method and path, as `linkerd viz top` shows them: how many, the best, worst and last latency, and
the share that succeeded.

A request counts when its `end` event comes; its latency is the time to the response's headers
(`rsp`), or to its end when it had none. It failed when its status is 5xx, its gRPC status is
not OK, or the stream was reset. Requests whose `end` never comes (a stream cut mid-way) are kept
at most MAX_PENDING at a time, the oldest forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Final

MAX_PENDING: Final = 10_000  # requests seen begun and not yet ended
MAX_ROWS: Final = 10_000  # distinct (source, destination, method, path); more are counted apart
MAX_ERRORS: Final = 8  # proxy stream errors kept to show


@dataclass
class Entry:
    source: str
    destination: str
    method: str
    path: str
    count: int = 0
    best: float | None = None  # seconds
    worst: float | None = None
    last: float | None = None
    ok: int = 0

    @property
    def success(self) -> float | None:
        return self.ok / self.count if self.count else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "success": self.success}


def _name(labels: dict[str, str], address: str) -> str:
    """The pod a side's labels name, else its IP (the port is the connection's, not the pod's).
    The tapped proxy's own side is named by its pod (the destination of an inbound request, the
    source of an outbound one)."""
    pod = labels.get("pod")
    if pod:
        return pod
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or address


class Top:
    def __init__(self, hide_sources: bool = False) -> None:
        self.hide_sources = hide_sources
        self.entries: dict[tuple[str, str, str, str], Entry] = {}
        self.pending: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self.overflow = 0  # requests of groups past MAX_ROWS
        self.errors: list[str] = []
        self.dropped = 0  # requests the controller left out past --max-rps

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "error":
            if len(self.errors) < MAX_ERRORS:
                self.errors.append(f"{event.get('proxy', '')}: {event.get('message', '')}")
            return
        self.dropped += int(event.get("dropped_before") or 0)
        key = (str(event.get("proxy", "")), str(event.get("id", "")))
        if kind == "req":
            source = _name(event.get("src_labels") or {}, str(event.get("src", "")))
            destination = _name(event.get("dst_labels") or {}, str(event.get("dst", "")))
            own = str(event.get("proxy", "")).rpartition("/")[2]  # the tapped proxy's pod
            if own and event.get("direction") == "inbound":
                destination = own
            elif own and event.get("direction") == "outbound":
                source = own
            self.pending[key] = {
                "group": ("" if self.hide_sources else source, destination,
                          str(event.get("method", "")), str(event.get("path", ""))),
            }  # fmt: skip
            while len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
        elif kind == "rsp" and key in self.pending:
            self.pending[key]["latency"] = float(event.get("latency") or 0.0)
            self.pending[key]["status"] = int(event.get("status") or 0)
        elif kind == "end" and key in self.pending:
            request = self.pending.pop(key)
            latency = request.get("latency", float(event.get("duration") or 0.0))
            failed = (
                request.get("status", 0) >= 500
                or int(event.get("grpc_status_code") or 0) != 0
                or "reset_error_code" in event
            )
            self._count(request["group"], latency, not failed)

    def _count(self, group: tuple[str, str, str, str], latency: float, ok: bool) -> None:
        entry = self.entries.get(group)
        if entry is None:
            if len(self.entries) >= MAX_ROWS:
                self.overflow += 1
                return
            entry = self.entries[group] = Entry(*group)
        entry.count += 1
        entry.ok += ok
        entry.last = latency
        entry.best = latency if entry.best is None else min(entry.best, latency)
        entry.worst = latency if entry.worst is None else max(entry.worst, latency)

    def rows(self, limit: int | None = None) -> list[Entry]:
        """The busiest first (then by path, for a stable order)."""
        ordered = sorted(
            self.entries.values(), key=lambda e: (-e.count, e.path, e.source, e.destination)
        )
        return ordered[:limit] if limit else ordered
