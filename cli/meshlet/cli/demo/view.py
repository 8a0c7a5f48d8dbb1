"""The demo's screen: what the proxies and the load generator report, as `linkerd viz stat` shows
it, rendered with rich from a `Snapshot` (no I/O here).

Beside the traffic, each workload's inbound authorization: how many connections and requests its
proxies' policies allowed and denied, and which identities were denied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from meshlet.cli.stats import QUANTILES, Row


@dataclass(frozen=True, slots=True)
class Client:
    """The load generator's own account (the client's truth)."""

    sent: int
    ok: int
    failed: dict[str, int]
    dropped: int
    quantiles: tuple[float | None, ...]
    store_first_byte_max_ms: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    title: str
    elapsed: float
    workloads: Sequence[Row]
    replicas: Sequence[Row]
    replica_notes: dict[str, str]  # pod → "+50 ms", "killed", "removed"
    client: Client | None
    control: Sequence[tuple[str, str]]  # (component, status)
    events: Sequence[tuple[float, str]]
    footer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    return "100%" if value == 1 else f"{value * 100:.2f}%"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value >= 10 else f"{value:.1f}ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"


def _short(identity: str) -> str:
    """`web.demo.serviceaccount.identity.meshlet.cluster.local` → `web` (the service account;
    every demo workload is in namespace demo)."""
    return identity.split(".")[0]


def _count(value: float) -> str:
    return f"{value:.0f}"


def denied_cell(row: Row) -> Text:
    """`0`, or the denials in red with the identities denied: `47 (api)`."""
    if not row.denied:
        return Text("0")
    who = ",".join(_short(p) for p in row.denied_peers)
    return Text(_count(row.denied) + (f" ({who})" if who else ""), style="bold red")


def workloads_table(rows: Sequence[Row], caption: str) -> Table:
    table = Table(title="workloads (inbound, as their proxies see them)", caption=caption,
                  title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 1))  # fmt: skip
    names = ["NAME", "MESHED", "SUCCESS", "RPS", *(f"P{int(q * 100)}" for q in QUANTILES),
             "CONN/S", "mTLS", "FROM", "ALLOWED", "DENIED"]  # fmt: skip
    for name in names:
        table.add_column(name, justify="left" if name in ("NAME", "FROM", "DENIED") else "right")
    for row in rows:
        table.add_row(
            row.name, row.meshed, _pct(row.success), _rate(row.rps),
            *(_ms(q) for q in row.quantiles), _rate(row.connections_per_s), _pct(row.mtls),
            ",".join(_short(p) for p in row.peers) or "-", _count(row.allowed), denied_cell(row),
        )  # fmt: skip
    return table


def replicas_table(rows: Sequence[Row], notes: dict[str, str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    for name in ("POD", "SHARE", "RPS", "P50", "P99", "NOTE"):
        table.add_column(name, justify="left" if name in ("POD", "NOTE") else "right")
    for row in rows:
        share = "-" if row.share is None else f"{row.share * 100:.1f}%"
        table.add_row(row.name, share, _rate(row.rps), _ms(row.quantiles[0]),
                      _ms(row.quantiles[-1]), notes.get(row.name, ""))  # fmt: skip
    return table


def client_line(client: Client | None) -> Text:
    if client is None:
        return Text("load generator: starting", style="dim")
    failed = sum(client.failed.values())
    done = client.ok + failed
    rate = f"{client.ok / done * 100:.2f}%" if done else "-"
    text = Text("load generator (the client's view): ", style="bold")
    text.append(f"{client.sent} sent, {client.ok} ok, ")
    text.append(f"{failed} failed", style="red" if failed else "")
    if client.failed:
        text.append(" (" + ", ".join(f"{k}: {v}" for k, v in sorted(client.failed.items())) + ")")
    text.append(f", success {rate}, p50 {_ms(client.quantiles[0])}, p99 "
                f"{_ms(client.quantiles[-1])}; store first byte max "
                f"{_ms(client.store_first_byte_max_ms)}")  # fmt: skip
    if client.dropped:
        text.append(f"; {client.dropped} not sent (over capacity)", style="yellow")
    return text


def render(snapshot: Snapshot, caption: str = "last 10 s") -> Group:
    header = Text(f"{snapshot.title} · {_clock(snapshot.elapsed)}", style="bold")
    control = Text("control plane: ")
    for i, (name, status) in enumerate(snapshot.control):
        control.append(("  " if i else "") + f"{name} ")
        control.append(status, style="green" if status == "up" else "red")
    parts: list[Any] = [
        header,
        workloads_table(snapshot.workloads, caption),
        Text(
            "api replicas: each call balanced by the caller's proxy (P2C over peak-EWMA)",
            style="italic",
        ),
        replicas_table(snapshot.replicas, snapshot.replica_notes),
        client_line(snapshot.client),
        control,
    ]
    if snapshot.events:
        events = Text("events: ", style="bold")
        events.append("; ".join(f"{_clock(t)} {what}" for t, what in snapshot.events[-4:]))
        parts.append(events)
    if snapshot.footer:
        parts.append(Text(snapshot.footer, style="dim"))
    return Group(*parts)
