"""The proxy benchmark's results: rows, the side-by-side ratios, the issue's aims, as markdown.

Pure: rows and the facts of the run in, text out. A row is one proxy (or meshed pair) in one
scenario; its CPU and RSS under load are summed over the pair. `compare` puts meshlet beside
Envoy, nginx and haproxy for one figure, one hop and meshed pair apart, with the ratios
meshlet/Envoy and meshlet/nginx; `aims` states the figures the proxy-speed issue quotes;
`versus` puts meshlet beside a previous revision of itself (`meshlet@REV`, --baseline), every
figure with its ratio now/then; `policy` the meshlet pair with an AuthorizationPolicy in force
beside the pair without one (bench/proxy_policy.py), flagged over POLICY_LIMIT.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIB = 1024


class Scenario(enum.Enum):
    H1 = "HTTP/1.1 keep-alive"
    H2 = "HTTP/2 (h2c)"
    GRPC = "gRPC unary"
    TCP = "TCP bulk"

    @property
    def port_field(self) -> str:
        return self.name.lower()  # the matching `proxy_configs.Ports` field


HTTP = (Scenario.H1, Scenario.H2, Scenario.GRPC)
OTHERS = ("envoy", "nginx", "haproxy")  # meshlet's company, in the order of the comparisons
POLICY_PAIR = "meshlet-policy-mesh"  # the meshlet pair with an AuthorizationPolicy in force
POLICY_WITHOUT = "meshlet-mesh"  # the same pair without
POLICY_LIMIT = 1.03  # what the policy may cost: with ÷ without, CPU per request


@dataclass(frozen=True, slots=True)
class Row:
    scenario: Scenario
    proxy: str
    saturated: float | None = None  # req/s, or bytes/s for TCP
    busy: float | None = None  # fraction of one core the proxies used at saturation
    cpu_us: float | None = None  # per request, or per MiB for TCP, at saturation
    p50_ms: float | None = None  # at the fixed rate
    p99_ms: float | None = None
    fixed_cpu_us: float | None = None  # per request at the fixed rate
    rss_idle_kib: tuple[int, ...] = ()  # each proxy process (with its children), client first
    rss_load_kib: tuple[int, ...] = ()  # each one's peak under load
    rss_load_sum_kib: int | None = None  # the peak of their sum
    notes: tuple[str, ...] = ()  # why the row is empty, or what to know about its figures

    @property
    def pair(self) -> bool:
        return self.proxy.endswith("-mesh")


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
    commands: Sequence[str]
    quick: bool = False
    baseline: str = ""  # the previous revision's rows' name, meshlet@REV; "" when none ran
    baseline_about: str = ""  # which revision that is and how its proxy ran


def _num(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _mib(kib: int | None) -> str:
    return "—" if kib is None else f"{kib / MIB:.1f}"


def _find(rows: Sequence[Row], scenario: Scenario, proxy: str) -> Row:
    """The row, or an empty one saying it was not run."""
    found = [r for r in rows if r.scenario is scenario and r.proxy == proxy]
    return found[0] if found else Row(scenario, proxy, notes=(f"{proxy} not run",))


def added_ms(rows: Sequence[Row], row: Row, quantile: str) -> float | None:
    """`row`'s p50 (or p99) at the fixed rate minus going direct's, in the same scenario."""
    direct = _find(rows, row.scenario, "direct")
    mine, base = getattr(row, f"{quantile}_ms"), getattr(direct, f"{quantile}_ms")
    return None if mine is None or base is None or row.proxy == "direct" else mine - base


def _table_row(rows: Sequence[Row], row: Row) -> str:
    tcp = row.scenario is Scenario.TCP
    if row.saturated is None:
        saturated = "—"
    else:
        saturated = f"{row.saturated / 2**20:,.0f} MiB/s" if tcp else f"{row.saturated:,.0f}"
    cpu = _num(row.cpu_us, ".1f") + (" /MiB" if tcp and row.cpu_us is not None else "")
    cells = [
        row.scenario.value,
        row.proxy,
        saturated,
        _num(None if row.busy is None else row.busy * 100, ".0f"),
        cpu,
        _num(row.fixed_cpu_us, ".1f"),
        _num(row.p50_ms, ".2f"),
        _num(row.p99_ms, ".2f"),
        _num(added_ms(rows, row, "p50"), "+.2f"),
        _num(added_ms(rows, row, "p99"), "+.2f"),
        " + ".join(map(_mib, row.rss_idle_kib)) or "—",
        _mib(row.rss_load_sum_kib),
        "; ".join(row.notes),
    ]
    return "| " + " | ".join(cells) + " |"


def _ratio(mine: float | None, theirs: float | None, floor: float = 0.0) -> str:
    """mine/theirs in bold; "—" without both, or when `theirs` is `floor` or less (an added
    latency below what the measurement resolves, or below zero: a row faster than going direct,
    which is noise)."""
    if mine is None or theirs is None or not mine or theirs <= floor:
        return "—"
    return f"**{mine / theirs:.2f}x**"


Figure = Callable[[Sequence[Row], Row], float | None]

# name -> title, the figure of a row (None: not measured), the smallest denominator a ratio
# is worth taking over
FIGURES: dict[str, tuple[str, Figure, float]] = {
    "cpu": ("CPU µs per request (per MiB for TCP) at saturation, summed over the pair",
            lambda rows, r: r.cpu_us, 0.0),
    "fixed_cpu": ("CPU µs per request at the fixed rate, summed over the pair",
                  lambda rows, r: r.fixed_cpu_us, 0.0),
    "rate": ("requests/s (MiB/s for TCP) at saturation", lambda rows, r: (
        None if r.saturated is None
        else r.saturated / 2**20 if r.scenario is Scenario.TCP else r.saturated), 0.0),
    "p50": ("added p50 latency at the fixed rate, ms (over going direct; no ratio over an "
            "added 0.05 ms or less)", lambda rows, r: added_ms(rows, r, "p50"), 0.05),
    "rss": ("RSS under load, MiB, summed over the pair", lambda rows, r: (
        None if r.rss_load_sum_kib is None else r.rss_load_sum_kib / MIB), 0.0),
}  # fmt: skip


def compare(rows: Sequence[Row], figure: str) -> list[str]:
    """One figure side by side: a line per scenario and path (one hop, meshed pair), meshlet
    and the others, and meshlet/Envoy, meshlet/nginx."""
    title, value, floor = FIGURES[figure]
    lines = [
        f"**{title}**",
        "",
        "| scenario | path | meshlet | Envoy | nginx | haproxy | meshlet/Envoy | meshlet/nginx |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scenario in Scenario:
        for suffix, path in (("", "one hop"), ("-mesh", "meshed pair (mTLS 1.3)")):
            found = {p: _find(rows, scenario, p + suffix) for p in ("meshlet", *OTHERS)}
            values = {p: value(rows, row) for p, row in found.items()}
            if all(v is None for v in values.values()):
                continue
            cells = [scenario.value, path, *(_num(values[p], ",.2f") for p in values)]
            cells += [_ratio(values["meshlet"], values[p], floor) for p in ("envoy", "nginx")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


# figure -> its column in `versus` ({rate}: the fixed rate) and how its values are written
VERSUS_COLUMNS: dict[str, tuple[str, str]] = {
    "rate": ("req/s saturated (TCP: MiB/s)", ",.0f"),
    "cpu": ("CPU µs/req saturated (TCP: per MiB)", ",.1f"),
    "fixed_cpu": ("CPU µs/req @ {rate}/s", ",.1f"),
    "p50": ("added p50 ms @ {rate}/s", "+.2f"),
    "rss": ("RSS load MiB", ",.1f"),
}


def versus(rows: Sequence[Row], baseline: str, rate: float) -> list[str]:
    """meshlet beside `baseline` (meshlet@REV): a line per scenario and path, each figure as
    `now / then → now÷then`."""
    heads = [head.format(rate=f"{rate:,.0f}") for head, _ in VERSUS_COLUMNS.values()]
    lines = [
        "| scenario | path | " + " | ".join(heads) + " |",
        "| --- | --- |" + " ---: |" * len(heads),
    ]
    for scenario in Scenario:
        for suffix, path in (("", "one hop"), ("-mesh", "meshed pair (mTLS 1.3)")):
            now, then = (_find(rows, scenario, p + suffix) for p in ("meshlet", baseline))
            cells, measured = [scenario.value, path], False
            for figure, (_, spec) in VERSUS_COLUMNS.items():
                _, value, floor = FIGURES[figure]
                a, b = value(rows, now), value(rows, then)
                if a is None and b is None:
                    cells.append("—")
                    continue
                measured = True
                cells.append(f"{_num(a, spec)} / {_num(b, spec)} → {_ratio(a, b, floor)}")
            if measured:
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def aims(rows: Sequence[Row], rate: float) -> list[str]:
    """The figures the proxy-speed issue's aims name, from this run."""

    def cpu_ratio(scenario: Scenario, other: str) -> str:
        mine, theirs = _find(rows, scenario, "meshlet-mesh"), _find(rows, scenario, other)
        parts = []
        for field, where in (("cpu_us", "at saturation"), ("fixed_cpu_us", f"at {rate:,.0f}/s")):
            a, b = getattr(mine, field), getattr(theirs, field)
            if a and b:
                parts.append(f"{_ratio(a, b)} {where} ({a:.0f} / {b:.0f} µs)")
        return ", ".join(parts) or "n/a (" + "; ".join(mine.notes + theirs.notes) + ")"

    added = ", ".join(
        f"{s.value} " + _num(added_ms(rows, _find(rows, s, "meshlet-mesh"), "p50"), "+.2f") + " ms"
        for s in HTTP
    )
    idle = [
        (proxy, kib) for proxy in ("meshlet", "meshlet-mesh") for scenario in Scenario
        for kib in _find(rows, scenario, proxy).rss_idle_kib
    ]  # fmt: skip
    load = [
        kib for proxy in ("meshlet", "meshlet-mesh") for scenario in Scenario
        for kib in _find(rows, scenario, proxy).rss_load_kib
    ]  # fmt: skip
    one_hop_idle = [kib for proxy, kib in idle if proxy == "meshlet"]
    mesh_idle = [kib for proxy, kib in idle if proxy == "meshlet-mesh"]
    return [
        "- HTTP/2 meshed pair, CPU per request, meshlet ÷ Envoy: "
        f"{cpu_ratio(Scenario.H2, 'envoy-mesh')} (aim ≤ 1.5x, stretch ≤ 1x)",
        f"- gRPC meshed pair, meshlet ÷ Envoy: {cpu_ratio(Scenario.GRPC, 'envoy-mesh')} "
        "(aim ≤ 1.5x, stretch ≤ 1x)",
        "- HTTP/1.1 meshed pair, meshlet ÷ Envoy: "
        f"{cpu_ratio(Scenario.H1, 'envoy-mesh')} (aim ≤ 0.75x)",
        "- HTTP/1.1 meshed pair, meshlet ÷ the nginx pair: "
        f"{cpu_ratio(Scenario.H1, 'nginx-mesh')} (stretch ≤ 2.5x)",
        f"- p50 latency the meshlet pair adds over going direct at {rate:,.0f} req/s: {added} "
        "(aim ≤ 1 ms each)",
        "- RSS of one meshlet proxy, idle: "
        f"{_span(one_hop_idle)} MiB alone, {_span(mesh_idle)} MiB in the pair (with identity); "
        f"under load (peak of one proxy): up to {_mib(max(load, default=None))} MiB "
        "(aims ≤ 30 MB = 28.6 MiB idle, ≤ 45 MB = 42.9 MiB under load)",
    ]


def policy(rows: Sequence[Row], rate: float) -> list[str]:
    """The pair with the policy beside the pair without, CPU per request at saturation and at
    the fixed rate, each as `without / with → with÷without`, flagged over POLICY_LIMIT."""
    lines = [
        f"| scenario | CPU µs/req saturated | CPU µs/req @ {rate:,.0f}/s | "
        f"within {POLICY_LIMIT:g}x (saturated) |",
        "| --- | ---: | ---: | --- |",
    ]
    for scenario in HTTP:
        without, with_ = (_find(rows, scenario, p) for p in (POLICY_WITHOUT, POLICY_PAIR))
        if with_.notes == (f"{POLICY_PAIR} not run",):
            continue
        cells = [scenario.value]
        for field in ("cpu_us", "fixed_cpu_us"):
            a, b = getattr(without, field), getattr(with_, field)
            cells.append(f"{_num(a, ',.1f')} / {_num(b, ',.1f')} → {_ratio(b, a)}")
        a, b = without.cpu_us, with_.cpu_us
        if a and b:
            cells.append("yes" if b / a <= POLICY_LIMIT else f"**no: over {POLICY_LIMIT:g}x**")
        else:
            cells.append("n/a (" + "; ".join(without.notes + with_.notes) + ")")
        lines.append("| " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def _policy_section(rows: Sequence[Row], rate: float) -> list[str]:
    table = policy(rows, rate)
    if not table:
        return []
    return [
        "## Authorization policy in the meshed pair",
        "",
        f"`{POLICY_WITHOUT}` / `{POLICY_PAIR}` → the ratio with ÷ without, both from this run, "
        "measured one after the other (in alternating order). With: the policy controller's "
        "Server and an AuthorizationPolicy admitting the client pod's identity by "
        "MeshTLSAuthentication on the server pod's port; the row fails unless the server proxy "
        "counted every request as allowed by that AuthorizationPolicy. Without: the proxy's "
        "built-in default policy (all-unauthenticated). CPU time per request moves by ~30 % "
        "from run to run on a shared machine: judge a few percent by the instruction counts "
        "of the pair's server-side proxy with and without the policy "
        "(`python -m bench.instructions_policy`, run by `make bench`).",
        "",
        *table,
        "",
    ]


def _span(kibs: Sequence[int]) -> str:
    if not kibs:
        return "—"
    low, high = _mib(min(kibs)), _mib(max(kibs))
    return low if low == high else f"{low} to {high}"


def _versus_section(rows: Sequence[Row], f: RunFacts) -> list[str]:
    if not f.baseline:
        return []
    then = f.baseline.removeprefix("meshlet@")
    return [
        f"## meshlet now ÷ {f.baseline}",
        "",
        f"{f.baseline}: {f.baseline_about}. Each cell: this tree's figure / {then}'s → the "
        f"ratio; over 1x means more now (faster for req/s, costlier for CPU, latency and RSS). "
        "Both from this run, each of meshlet's rows measured next to its baseline row, in "
        "alternating order; quote these ratios, not figures from separate runs.",
        "",
        *versus(rows, f.baseline, f.rate),
        "",
    ]


def render(rows: Sequence[Row], facts: RunFacts) -> str:
    f, rate = facts, f"{facts.rate:,.0f}"
    meshlet = f" (`{f.meshlet_command}`)" if f.meshlet_command else ""
    quick = " **Quick run (--quick): too short for figures to quote.**" if f.quick else ""
    header = [
        f"# Proxy benchmark ({f.when:%Y-%m-%d %H:%M} UTC)",
        "",
        f"- machine: {f.machine}",
        f"- {f.placement}",
        f"- every run lasts {f.duration:g} s.{quick} Saturation: wrk -c{f.h1_connections} "
        f"(HTTP/1.1), h2load -c{f.h2_clients} -m{f.h2_streams} (h2, gRPC), one iperf3 stream "
        f"(TCP). Fixed rate: **{rate} req/s** for every HTTP scenario (h2load --rps over "
        f"{f.rate_clients} connections, one request in flight each, the connections started "
        "one by one so that requests arrive evenly spaced, not in bursts; p50/p99 from its "
        "per-request log; *added* = minus going direct's)",
        "- proxy CPU: utime+stime of the proxies' process trees (/proc/<pid>/stat; every "
        "worker and thread) over the run, divided by the requests completed (TCP: by MiB "
        "received); core busy: that CPU time over the run's wall time. RSS: VmRSS of each "
        "proxy's tree, idle 0.5 s after start (each proxy: client side + server side); under "
        "load, the peak of their sum sampled every 0.25 s at saturation",
        "- one hop (`meshlet`, `envoy`, `nginx`, `haproxy`): one proxy on 127.0.0.1 in "
        "plaintext, restarted per row, one core's worth of workers (meshlet one event loop, "
        "Envoy --concurrency 1, nginx worker_processes 1, haproxy nbthread 1), no access log, "
        f"keep-alive to the upstream; meshlet{meshlet} runs unmeshed (no identity, no "
        "destination) and routes by authority",
        "- meshed pair (`*-mesh`): load → client-side proxy (127.0.0.1) → TLS 1.3 with a "
        "client certificate from the bench's CA (the project's own) → server-side proxy on "
        "the server pod's address 127.0.0.3, which requires and verifies it → upstream. Both "
        "proxies on the proxy core; CPU and RSS under load are **summed over both**. meshlet: "
        "the client proxy finds the server through the destination service (authority "
        "`bench.bench.svc.cluster.local:PORT`; the control plane runs on the load CPU). "
        "Envoy: Istio-like sidecars with static clusters (ALPN h2 for h2 and gRPC, http/1.1 "
        "for HTTP/1.1), router and tcp_proxy only. nginx: proxy_pass https:// (HTTP/1.1 "
        "between the proxies, also for h2 clients), grpc_pass grpcs://, stream proxy_ssl. "
        "haproxy: `ssl crt … verify required` both ways",
        "- proof: every row's probe request is checked before its runs (TCP: a 1 MiB iperf3 "
        "transfer); a proxy that used almost no CPU fails its row; a meshed row fails unless "
        "the pair's own counters show the probes and every request that succeeded (TCP: "
        'every byte received) crossed mutual TLS (meshlet metrics tls="true", Envoy '
        "ssl.handshake and TLSv1.3 counts, nginx stub_status and stream log, haproxy stats); "
        "the nginx and haproxy pairs' server sides also answer a probe with the TLS version "
        "and client-certificate verdict",
        "- TCP: the iperf3 client connects to the upstream's address (the server pod's for "
        "pairs); an iptables REDIRECT in the bench's own network namespace sends it to the "
        "(client-side) proxy, as meshlet-init's rules do; Envoy reads the original "
        "destination with its original_dst listener filter, nginx and haproxy have a fixed "
        "backend",
        "- upstreams: one nginx worker (HTTP/1.1, h2c), a one-process Python grpcio server "
        "(gRPC: it caps req/s, so compare the proxies' CPU there), iperf3 (TCP); they share "
        "the load CPU, which also caps the direct and fastest-proxy figures",
        f"- {f.noise}",
        "",
        *_versus_section(rows, f),
        "## The issue's aims",
        "",
        *aims(rows, f.rate),
        "",
        *_policy_section(rows, f.rate),
        "## Side by side",
        "",
    ]
    for figure in FIGURES:
        header += [*compare(rows, figure), ""]
    table = [
        "## Every row",
        "",
        f"| scenario | proxy | saturated req/s | proxy core busy % | CPU µs/req saturated "
        f"| CPU µs/req @ {rate}/s | p50 ms @ {rate}/s | p99 ms | added p50 ms | added p99 ms "
        "| RSS idle MiB (each) | RSS load MiB (sum) | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        *(_table_row(rows, row) for row in rows),
    ]
    footer = [
        "Commands (PORT: the proxy's listener, or the upstream's for direct; AUTHORITY: the "
        "upstream's 127.0.0.1:port, or the service's name for pairs):",
        "",
        *f.commands,
    ]
    return "\n".join([*header, *table, "", *footer, ""])
