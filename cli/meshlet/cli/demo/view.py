"""The demo's screen: what the proxies and the load generator report, as `linkerd viz stat` shows
it, rendered with rich from a `Snapshot` (no I/O here).

Beside the traffic, each workload's inbound authorization: how many connections and requests its
proxies' policies allowed and denied, and which identities were denied. Below the api replicas, what
the drills are meant to show, in words: a replica whose proxy stopped answering is marked gone
(its last rate is not carried on), a slow replica's share is put beside the share it would get if
the balancer ignored latency, and the proxies' certificate renewals are counted. Then api's
outbound policy as the callers' proxies apply it: the HTTPRoute's weights beside the share each
backend really got in the window, and each backend's balancer, with the endpoints failure accrual
ejected shown pending."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from meshlet.cli.demo.outbound import Endpoints
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
    recent_success: float | None = None  # over the window shown
    late: int = 0  # not sent: the generator's own process was paused past the call's time


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
    gone: Mapping[str, float] = field(default_factory=dict)  # pod → seconds without metrics
    slow: Mapping[str, float] = field(default_factory=dict)  # pod → ms it adds to each call
    certificates: Text | None = None
    outbound: Outbound | None = None
    certificates_short: Text | None = None  # the same, in fewer words (the compact view)


@dataclass(frozen=True, slots=True)
class Outbound:
    """api's route and balancers, as the callers' proxies apply them."""

    route: str
    parent: str
    weights: Mapping[str, int]  # backend → its weight in the route now
    requests: Mapping[str, float]  # backend → requests sent to it in the window
    seconds: float  # the window's length
    balancers: Mapping[str, Endpoints]  # backend → its balancer's endpoints


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


def replicas_table(
    rows: Sequence[Row], notes: Mapping[str, str], gone: Mapping[str, float] | None = None
) -> Table:
    """One line per replica; a gone one (in `gone`, not in `rows`) keeps its line, emptied and
    marked, so that the shares shown add up to the traffic that is really flowing."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    for name in ("POD", "SHARE", "RPS", "P50", "P99", "NOTE"):
        table.add_column(name, justify="left" if name in ("POD", "NOTE") else "right")
    _replica_rows(table, rows, notes, gone or {})
    return table


def _replica_rows(
    table: Table, rows: Sequence[Row], notes: Mapping[str, str], gone: Mapping[str, float]
) -> None:
    """A line per replica, live or gone (emptied and marked), in name order."""
    live = {row.name: row for row in rows}
    for name in sorted({*live, *gone}):
        row = live.get(name)
        note = notes.get(name, "")
        if row is None:
            why = f"gone: no metrics for {gone[name]:.0f} s" + (f" ({note})" if note else "")
            table.add_row(name, "-", "-", "-", "-", Text(why, style="bold red"))
            continue
        share = "-" if row.share is None else f"{row.share * 100:.1f}%"
        table.add_row(name, share, _rate(row.rps), _ms(row.quantiles[0]),
                      _ms(row.quantiles[-1]), note)  # fmt: skip


def balancer_caption(rows: Sequence[Row], slow: Mapping[str, float]) -> Text:
    """How the api calls are spread, and why a slow replica gets less than an even share."""
    text = Text("api replicas: each call balanced by the caller's proxy (P2C over peak-EWMA)",
                style="italic")  # fmt: skip
    shares = {row.name: row.share for row in rows if row.share is not None}
    if len(shares) < 2:
        return text
    even = 1 / len(shares)
    for pod, ms in sorted(slow.items()):
        share = shares.get(pod)
        if share is None:
            continue
        text.append(f"\n  {pod} answers {ms:.0f} ms slower: ", style="italic")
        if share < even * 0.8:
            text.append(f"it gets {share * 100:.1f}% of the calls, not the even "
                        f"{even * 100:.0f}%: the balancers see its latency and pick the others",
                        style="italic yellow")  # fmt: skip
        else:
            text.append(f"it still gets {share * 100:.1f}% (even: {even * 100:.0f}%): the "
                        "balancers have not seen enough of its latency yet",
                        style="italic")  # fmt: skip
    return text


def certificates_line(
    certificates: Mapping[str, Mapping[str, float]],
    now: float,
    since: float | None = None,
    short: bool = False,
) -> Text | None:
    """The proxies' certificates (from their metrics, `now` in Unix seconds): renewals, the
    soonest expiry, and, after the identity service came back at `since`, who renewed since
    (`short`: in fewer words, for the compact view)."""
    if not certificates:
        return None
    ok = sum(c["refreshes_ok"] for c in certificates.values())
    failed = sum(c["refreshes_failed"] for c in certificates.values())
    text = Text("certificates: ", style="bold")
    text.append(f"{len(certificates)} proxies, {ok:.0f} " + ("issued, " if short else
                                                            "issued or renewed, "))  # fmt: skip
    text.append(f"{failed:.0f} failed", style="red" if failed else "")
    expiries = [c["expires_at"] for c in certificates.values() if c["expires_at"] > 0]
    if expiries:
        left = min(expiries) - now
        soonest = "; expiry in" if short else "; soonest expiry in"
        text.append(f"{soonest} {left:.0f} s" if left > 0 else "; one has expired",
                    style="" if left > 0 else "bold red")  # fmt: skip
    if since is not None:
        renewed = sum(1 for c in certificates.values() if c["refreshed_at"] > since)
        words = "renewed since identity's return" if short else "renewed since identity came back"
        text.append(f"; {words}: {renewed}/{len(certificates)}",
                    style="green" if renewed == len(certificates) else "yellow")  # fmt: skip
    return text


def outbound_lines(o: Outbound) -> Text:
    """`api's HTTPRoute api-split, weights api 90 · api-v2 10: api 89.1% (16.0/s) · …` and the
    balancers (pending in red: an ejected or backing-off endpoint)."""
    text = Text(f"{o.parent}'s HTTPRoute {o.route}, weights ", style="bold")
    text.append(" · ".join(f"{b} {w}" for b, w in o.weights.items()))
    total = sum(o.requests.values())
    if total:
        text.append(": ")
        for i, backend in enumerate(sorted({*o.weights, *o.requests})):
            count = o.requests.get(backend, 0.0)
            rate = f" ({count / o.seconds:.1f}/s)" if o.seconds else ""
            text.append((" · " if i else "") + f"{backend} {count / total * 100:.1f}%{rate}")
    else:
        text.append(": no calls yet", style="dim")
    if o.balancers:
        text.append("\nbalancers (callers' proxies): ", style="bold")
        for i, (backend, e) in enumerate(sorted(o.balancers.items())):
            text.append((" · " if i else "") + f"{backend} {e.ready:.0f} ready")
            if e.pending:
                text.append(f", {e.pending:.0f} pending (ejected by failure accrual, or backing"
                            " off)", style="bold red")  # fmt: skip
    return text


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
    if client.recent_success is not None:
        style = "" if client.recent_success >= 0.99 else "bold red"
        text.append("; last 10 s: success ")
        text.append(_pct(client.recent_success), style=style)
    if client.dropped:
        text.append(f"; {client.dropped} not sent (over capacity)", style="yellow")
    if client.late:
        text.append(f"; {client.late} not sent (the client was paused)", style="yellow")
    return text


FULL_WIDTH: Final = 120  # columns the full view needs (its tables have every column)
FULL_HEIGHT: Final = 40  # lines it may take


def fit(
    snapshot: Snapshot, width: int, height: int | None = None, caption: str = "last 10 s"
) -> Group:
    """The view for a screen of `width` columns (and `height` lines, when it is redrawn in
    place): the full one where it fits, else the compact one, which 80x24 holds whole."""
    if width < FULL_WIDTH or (height is not None and height < FULL_HEIGHT):
        return render_compact(snapshot, caption)
    return render(snapshot, caption)


def _line(text: str | Text, style: str = "") -> Text:
    """One line, cut with an ellipsis rather than wrapped."""
    line = Text(text, style=style) if isinstance(text, str) else text
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


def compact_workloads(rows: Sequence[Row], caption: str) -> Table:
    """The workloads with the columns that fit 80 columns: P95 left out, one space between."""
    table = Table(title=f"workloads (inbound), {caption}", title_justify="left", box=None,
                  show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  header_style="bold")  # fmt: skip
    for name in ("NAME", "MESHED", "SUCCESS", "RPS", "P50", "P99", "CONN/S", "mTLS", "FROM",
                 "ALLOWED", "DENIED"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("NAME", "FROM", "DENIED") else "right",
                         no_wrap=True)  # fmt: skip
    for row in rows:
        table.add_row(
            row.name, row.meshed, _pct(row.success), _rate(row.rps), _ms(row.quantiles[0]),
            _ms(row.quantiles[-1]), _rate(row.connections_per_s), _pct(row.mtls),
            ",".join(_short(p) for p in row.peers) or "-", _count(row.allowed), denied_cell(row),
        )  # fmt: skip
    return table


def compact_replicas(
    rows: Sequence[Row],
    notes: Mapping[str, str],
    gone: Mapping[str, float],
    slow: Mapping[str, float],
) -> list[Any]:
    """The api replicas (no header rule), and a line per slow one: its share beside the even
    share."""
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
                  header_style="bold")  # fmt: skip
    for name in ("API POD", "SHARE", "RPS", "P50", "P99", "NOTE"):
        table.add_column(name, justify="left" if name in ("API POD", "NOTE") else "right",
                         no_wrap=name != "NOTE")  # fmt: skip
    _replica_rows(table, rows, notes, gone)
    out: list[Any] = [table]
    shares = {row.name: row.share for row in rows if row.share is not None}
    if len(shares) >= 2:
        even = 1 / len(shares)
        for pod, ms in sorted(slow.items()):
            share = shares.get(pod)
            if share is None:
                continue
            if share < even * 0.8:
                words = (f"{pod} (+{ms:.0f} ms) gets {share * 100:.1f}% of calls, not the even "
                         f"{even * 100:.0f}%: the balancers see its latency")  # fmt: skip
                out.append(_line(words, "italic yellow"))
            else:
                words = (f"{pod} (+{ms:.0f} ms) still gets {share * 100:.1f}% (even "
                         f"{even * 100:.0f}%): its latency is not seen yet")  # fmt: skip
                out.append(_line(words, "italic"))
    return out


def compact_outbound(o: Outbound) -> list[Text]:
    """The route's weights and shares on one line, its balancers on another."""
    text = Text(f"route {o.route}: ", style="bold")
    text.append(" · ".join(f"{b} {w}" for b, w in o.weights.items()))
    total = sum(o.requests.values())
    if total:
        text.append(" → ")
        text.append(" · ".join(f"{b} {o.requests.get(b, 0.0) / total * 100:.1f}%"
                               for b in sorted({*o.weights, *o.requests})))  # fmt: skip
    else:
        text.append(": no calls yet", style="dim")
    lines = [_line(text)]
    if o.balancers:
        ready = Text("balancers: ", style="bold")
        for i, (backend, e) in enumerate(sorted(o.balancers.items())):
            ready.append((" · " if i else "") + f"{backend} {e.ready:.0f} ready")
            if e.pending:
                ready.append(
                    f", {e.pending:.0f} pending (ejected or backing off)", style="bold red"
                )
        lines.append(_line(ready))
    return lines


def compact_client(client: Client | None) -> Text:
    if client is None:
        return Text("client: starting", style="dim")
    failed = sum(client.failed.values())
    done = client.ok + failed
    text = Text("client: ", style="bold")
    text.append(f"{client.sent} sent, {client.ok} ok, ")
    text.append(f"{failed} failed", style="red" if failed else "")
    if client.failed:
        text.append(" (" + ", ".join(f"{k}: {v}" for k, v in sorted(client.failed.items())) + ")")
    text.append(f", {client.ok / done * 100:.2f}%" if done else "")
    text.append(f"; p50 {_ms(client.quantiles[0])} p99 {_ms(client.quantiles[-1])}; store 1st"
                f" byte {_ms(client.store_first_byte_max_ms)}")  # fmt: skip
    if client.recent_success is not None:
        text.append("; last 10 s ")
        text.append(_pct(client.recent_success),
                    style="" if client.recent_success >= 0.99 else "bold red")  # fmt: skip
    if client.dropped or client.late:
        text.append(f"; {client.dropped + client.late} not sent", style="yellow")
    return text


def render_compact(snapshot: Snapshot, caption: str = "last 10 s") -> Group:
    """The view in 80x24: the same numbers as `render`'s less P95, each part in a line or two
    (a line too long is cut, never wrapped onto the next part's), the last two events."""
    header = _line(f"{_clock(snapshot.elapsed)} · {snapshot.title}", "bold")
    down = [name for name, status in snapshot.control if status != "up"]
    control = Text("control plane: ", style="bold")
    if down:
        control.append(", ".join(f"{name} {status}" for name, status in snapshot.control
                                 if status != "up"), style="red")  # fmt: skip
    else:
        control.append("all up", style="green")
    certificates = snapshot.certificates_short or snapshot.certificates
    if certificates is not None:
        control.append(" · ")
        control.append(certificates)
    parts: list[Any] = [
        header,
        compact_workloads(snapshot.workloads, caption),
        *compact_replicas(snapshot.replicas, snapshot.replica_notes, snapshot.gone,
                          snapshot.slow),
        *(compact_outbound(snapshot.outbound) if snapshot.outbound is not None else []),
        compact_client(snapshot.client),
        control,
    ]  # fmt: skip
    for at, what in snapshot.events[-2:]:
        parts.append(_line(f"{_clock(at)} {what}"))
    if snapshot.footer:
        parts.append(_line(snapshot.footer, "dim"))
    return Group(*parts)


def render(snapshot: Snapshot, caption: str = "last 10 s") -> Group:
    header = Text(f"{snapshot.title} · {_clock(snapshot.elapsed)}", style="bold")
    control = Text("control plane: ")
    for i, (name, status) in enumerate(snapshot.control):
        control.append(("  " if i else "") + f"{name} ")
        control.append(status, style="green" if status == "up" else "red")
    parts: list[Any] = [
        header,
        workloads_table(snapshot.workloads, caption),
        balancer_caption(snapshot.replicas, snapshot.slow),
        replicas_table(snapshot.replicas, snapshot.replica_notes, snapshot.gone),
        *([outbound_lines(snapshot.outbound)] if snapshot.outbound is not None else []),
        client_line(snapshot.client),
        control,
    ]
    if snapshot.certificates is not None:
        parts.append(snapshot.certificates)
    if snapshot.events:
        events = Text("events: ", style="bold")
        events.append("; ".join(f"{_clock(t)} {what}" for t, what in snapshot.events[-4:]))
        parts.append(events)
    if snapshot.footer:
        parts.append(Text(snapshot.footer, style="dim"))
    return Group(*parts)
