"""The proxy benchmark's results: one row per scenario and proxy, rendered as markdown.

Pure: rows and the facts of the run in, text out. The two figures the issue aims at are
computed here: meshlet's CPU per HTTP/1.1 request over nginx's, and the p50 latency meshlet
adds over going direct at the fixed rate; so is the p50 the full meshed hop (meshlet-mesh: two
proxies and mutual TLS) adds, for reference.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Scenario(enum.Enum):
    H1 = "HTTP/1.1 keep-alive"
    H2 = "HTTP/2 (h2c)"
    GRPC = "gRPC unary"
    TCP = "TCP bulk"

    @property
    def port_field(self) -> str:
        return self.name.lower()  # the matching `proxy_configs.Ports` field


@dataclass(frozen=True, slots=True)
class Row:
    scenario: Scenario
    proxy: str
    saturated: float | None = None  # req/s, or bytes/s for TCP
    busy: float | None = None  # fraction of one core the proxy used at saturation
    cpu_us: float | None = None  # per request, or per MiB for TCP, at saturation
    p50_ms: float | None = None  # at the fixed rate
    p99_ms: float | None = None
    fixed_cpu_us: float | None = None  # per request at the fixed rate
    rss_idle_kib: int | None = None
    rss_load_kib: int | None = None  # peak at saturation
    notes: tuple[str, ...] = ()  # why the row is empty, or what to know about its figures


@dataclass(frozen=True, slots=True)
class RunFacts:
    """How the run was made, for the report's header and footer."""

    when: dt.datetime
    machine: str  # CPUs, kernel, Python, tool versions
    placement: str  # CPU pinning and network namespace
    duration: float
    rate: float
    rate_clients: int
    h1_connections: int
    h2_clients: int
    h2_streams: int
    meshlet_command: str  # "" when it is the default entry point
    noise: str  # what else the machine was doing meanwhile
    meshlet_idle_kib: int | None
    commands: Sequence[str]


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _mib(kib: int | None) -> str:
    return "—" if kib is None else f"{kib / 1024:.1f}"


def _table_row(row: Row) -> str:
    tcp = row.scenario is Scenario.TCP
    if row.saturated is None:
        saturated = "—"
    else:
        saturated = f"{row.saturated * 8 / 1e9:.1f} Gbit/s" if tcp else f"{row.saturated:,.0f}"
    cpu = _num(row.cpu_us, ".1f") + (" /MiB" if tcp and row.cpu_us is not None else "")
    cells = [
        row.scenario.value,
        row.proxy,
        saturated,
        _num(None if row.busy is None else row.busy * 100, ".0f"),
        cpu,
        _num(row.p50_ms, ".2f"),
        _num(row.p99_ms, ".2f"),
        _num(row.fixed_cpu_us, ".1f"),
        _mib(row.rss_idle_kib),
        _mib(row.rss_load_kib),
        "; ".join(row.notes),
    ]
    return "| " + " | ".join(cells) + " |"


def _find(rows: Sequence[Row], scenario: Scenario, proxy: str) -> Row:
    """The row, or an empty one saying it was not run."""
    found = [r for r in rows if r.scenario is scenario and r.proxy == proxy]
    return found[0] if found else Row(scenario, proxy, notes=(f"{proxy} not run",))


def aims(rows: Sequence[Row], rate: float) -> list[str]:
    """The issue's two targets (CPU per HTTP/1.1 request vs nginx, added p50 vs direct), and
    the p50 the meshed hop adds over direct, for reference."""
    meshlet, nginx = _find(rows, Scenario.H1, "meshlet"), _find(rows, Scenario.H1, "nginx")
    if meshlet.cpu_us and nginx.cpu_us:
        ratio = (
            f"**{meshlet.cpu_us / nginx.cpu_us:.2f}x** at saturation "
            f"({meshlet.cpu_us:.1f} / {nginx.cpu_us:.1f} µs)"
        )
        if meshlet.fixed_cpu_us and nginx.fixed_cpu_us:
            ratio += (
                f", {meshlet.fixed_cpu_us / nginx.fixed_cpu_us:.2f}x at {rate:,.0f} req/s "
                f"({meshlet.fixed_cpu_us:.1f} / {nginx.fixed_cpu_us:.1f} µs)"
            )
    else:
        ratio = "n/a (" + ("; ".join(meshlet.notes + nginx.notes) or "no CPU figure") + ")"
    return [
        f"- meshlet CPU per request ÷ nginx CPU per request, HTTP/1.1: {ratio} (aim ≤ 1.5x)",
        f"- p50 latency meshlet adds over direct at {rate:,.0f} req/s: "
        f"{_added_p50(rows, 'meshlet')} (aim < 1 ms)",
        f"- p50 latency the meshed hop (meshlet-mesh) adds over direct at {rate:,.0f} req/s: "
        f"{_added_p50(rows, 'meshlet-mesh')}",
    ]


def _added_p50(rows: Sequence[Row], proxy: str) -> str:
    """`proxy`'s p50 at the fixed rate minus direct's, per HTTP scenario."""
    added = []
    for scenario in (Scenario.H1, Scenario.H2, Scenario.GRPC):
        direct, through = _find(rows, scenario, "direct"), _find(rows, scenario, proxy)
        if direct.p50_ms is not None and through.p50_ms is not None:
            added.append(f"{scenario.value} **{through.p50_ms - direct.p50_ms:+.2f} ms**")
        else:
            added.append(f"{scenario.value} n/a")
    return ", ".join(added)


def render(rows: Sequence[Row], facts: RunFacts) -> str:
    f, rate = facts, f"{facts.rate:,.0f}"
    meshlet = f" (`{f.meshlet_command}`)" if f.meshlet_command else ""
    header = [
        f"# Proxy benchmark ({f.when:%Y-%m-%d %H:%M} UTC)",
        "",
        f"- machine: {f.machine}",
        f"- {f.placement}",
        f"- every run lasts {f.duration:g} s. Saturation: wrk -c{f.h1_connections} (HTTP/1.1), "
        f"h2load -c{f.h2_clients} -m{f.h2_streams} (h2, gRPC), one iperf3 stream (TCP). Fixed "
        f"rate: **{rate} req/s** for every HTTP scenario (h2load --rps over {f.rate_clients} "
        "connections, one request in flight each; p50/p99 from its per-request log)",
        "- proxy CPU: utime+stime of the proxy's process tree (/proc/<pid>/stat; every worker "
        "and thread) over the run, divided by the requests completed (TCP: by MiB received); "
        "core busy: that CPU time over the run's wall time. RSS: VmRSS summed over the tree, "
        "idle 0.5 s after start; under load, the peak sampled every 0.25 s at saturation",
        "- each proxy gets one core (nginx worker_processes 1, haproxy nbthread 1, meshlet one "
        "event loop), no access log, keep-alive to the upstream, and is restarted per row; "
        f"meshlet{meshlet} runs unmeshed (no identity, no destination) and routes by authority; "
        "TCP reaches it through an iptables REDIRECT",
        "- meshlet-mesh is the full meshed hop: load → client-side meshlet (outbound listener, "
        "routes by authority `bench.bench.svc.cluster.local:PORT` through the destination "
        "service) → mutual TLS 1.3 → server-side meshlet (inbound listener, 4143) → upstream. "
        "Two proxy processes, both on the proxy core: its CPU (µs/req, core busy) and RSS are "
        "the **sum over both**. A row fails unless the client proxy counts the probe and every "
        "request that succeeded as sent over mTLS to the server's identity (request_total, "
        "tls=true, server_id). The control plane (identity, destination) runs on the load "
        "CPU; opaque TCP is not measured (it needs the original destination, iptables, on the "
        "client side)",
        "- upstreams: one nginx worker (HTTP/1.1, h2c), a one-process Python grpcio server "
        "(gRPC: it caps req/s, so compare the proxies' CPU there), iperf3 (TCP); they share "
        "the load CPU, which also caps the direct and fastest-proxy figures",
        f"- {f.noise}",
        f"- meshlet idle RSS: {_mib(f.meshlet_idle_kib)} MiB",
        *aims(rows, f.rate),
    ]
    table = [
        f"| scenario | proxy | saturated req/s | proxy core busy % | proxy CPU µs/req "
        f"saturated | p50 ms @ {rate}/s | p99 ms @ {rate}/s | proxy CPU µs/req @ {rate}/s "
        "| RSS idle MiB | RSS load MiB | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        *map(_table_row, rows),
    ]
    footer = [
        "Commands (PORT: the proxy's listener, or the upstream's for direct; AUTHORITY: the "
        "upstream's 127.0.0.1:port):",
        "",
        *f.commands,
    ]
    return "\n".join([*header, "", *table, "", *footer, ""])
