"""The dashboard's pages as HTML strings, from the metrics API's rows: pure functions, no I/O.

Every value that came from a metric label (a pod, a namespace, an identity, a path) is chosen by
whoever deploys a workload, so every one goes through `esc` before it reaches the page; the only
unescaped text is this module's own markup. The pages carry no inline script or style (the
server's Content-Security-Policy forbids both): behaviour and looks come from the one static
file of each (`static/dashboard.js`, `static/dashboard.css`).
"""

from __future__ import annotations

import html
import math
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from meshlet.controlplane.vizmetrics import QUANTILES, Edge, RouteRow, StatRow

WINDOWS: Final = ("10s", "1m", "10m", "1h")  # the time windows a page may ask for
DEFAULT_WINDOW: Final = "1m"
MAX_ROWS: Final = 500  # rows of one table; the rest are counted, not drawn
MAX_NODES: Final = 60  # resources in the topology graph
NAV: Final = (("/", "Namespaces"), ("/topology", "Topology"), ("/routes", "Routes"),
              ("/tap", "Tap"))  # fmt: skip
TAP_METHODS: Final = ("", "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def href(path: str, **query: str | None) -> str:
    """A link to `path` with the query's non-empty values, escaped for an attribute."""
    kept = {k: v for k, v in query.items() if v}
    return esc(path + ("?" + urllib.parse.urlencode(kept) if kept else ""))


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def rps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ms(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def layout(title: str, active: str, body: str, window: str = DEFAULT_WINDOW) -> str:
    links = "".join(
        f'<a href="{path}"{" class=active" if path == active else ""}>{name}</a>'
        for path, name in NAV
    )
    options = "".join(
        f'<option value="{w}"{" selected" if w == window else ""}>{w}</option>' for w in WINDOWS
    )
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · meshlet</title>"
        '<link rel=stylesheet href="/static/dashboard.css">'
        '<script src="/static/dashboard.js" defer></script></head>'
        f"<body><header><span class=brand>meshlet</span><nav>{links}</nav>"
        f"<form class=window method=get><label>window <select name=window id=window>{options}"
        "</select></label><noscript><button>show</button></noscript></form></header>"
        f"<main><h1 id=title>{esc(title)}</h1>{body}</main></body></html>\n"
    )


def notice(text: str, kind: str = "info") -> str:
    return f'<p class="notice {kind}" id=notice>{esc(text)}</p>'


def _table(table_id: str, header: Sequence[str], rows: Sequence[Sequence[str]], empty: str) -> str:
    """`rows` are cells of HTML already escaped."""
    if not rows:
        return notice(empty)
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
                   for row in rows[:MAX_ROWS])  # fmt: skip
    more = len(rows) - MAX_ROWS
    tail = notice(f"{more} more rows not shown") if more > 0 else ""
    return (
        f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{tail}'
    )


def _latencies(latency: Mapping[str, float | None]) -> list[str]:
    return [esc(ms(latency.get(f"p{q * 100:g}"))) for q in QUANTILES]


STAT_HEADER: Final = ("Name", "Meshed", "Success", "RPS", "P50", "P95", "P99")


@dataclass(frozen=True, slots=True)
class Named:
    """How a stat row's name links: to a page (`link` with `{name}` and `{namespace}`)."""

    link: str | None = None


def stat_rows(
    rows: Sequence[StatRow], meshed: Mapping[tuple[str | None, str], int], links: Named
) -> list[list[str]]:
    out = []
    for r in rows:
        name = esc(r.name or "-")
        if links.link and r.name:
            quoted = urllib.parse.quote(r.name, safe="")
            ns = urllib.parse.quote(r.namespace or "", safe="")
            target = links.link.format(name=quoted, namespace=ns)
            name = f'<a href="{esc(target)}">{name}</a>'
        count = meshed.get((r.namespace, r.name))
        out.append([name, esc("-" if count is None else count), esc(pct(r.success)),
                    esc(rps(r.rps)), *_latencies(r.latency)])  # fmt: skip
    return out


def with_idle(
    rows: Sequence[StatRow], meshed: Mapping[tuple[str | None, str], int], window_s: float
) -> list[StatRow]:
    """The rows with traffic, and a row with none for each meshed resource that had none."""
    have = {(r.namespace, r.name) for r in rows}
    idle = [StatRow(ns, name, window=window_s) for (ns, name) in meshed if (ns, name) not in have]
    for r in idle:
        r.latency = {f"p{q * 100:g}": None for q in QUANTILES}
    return sorted([*rows, *idle], key=lambda r: (r.namespace or "", r.name))


def namespaces_page(
    rows: Sequence[StatRow], meshed: Mapping[tuple[str | None, str], int], window: str
) -> str:
    table = _table("namespaces", STAT_HEADER,
                   stat_rows(rows, meshed, Named("/namespaces/{name}?window=" + window)),
                   "No meshed namespaces: Prometheus scrapes no proxy.")  # fmt: skip
    return layout("Namespaces", "/", table, window)


def namespace_page(
    namespace: str,
    deployments: Sequence[StatRow],
    pods: Sequence[StatRow],
    meshed: Mapping[str, Mapping[tuple[str | None, str], int]],
    window: str,
) -> str:
    tap = "/tap?resource=deploy/{name}&namespace={namespace}"
    body = (
        "<h2>Deployments</h2>"
        + _table("deployments", STAT_HEADER,
                 stat_rows(deployments, meshed["deployment"], Named(tap)),
                 f"No meshed deployments in {namespace}.")
        + "<h2>Pods</h2>"
        + _table("pods", STAT_HEADER,
                 stat_rows(pods, meshed["pod"], Named(tap.replace("deploy/", "po/"))),
                 f"No meshed pods in {namespace}.")
    )  # fmt: skip
    return layout(f"Namespace {namespace}", "/", body, window)


ROUTE_HEADER: Final = ("Route", "Destination", "Success", "RPS", "P50", "P95", "P99")


def routes_page(rows: Sequence[RouteRow], resource: str, namespace: str, window: str) -> str:
    form = (
        '<form class=filters method=get action="/routes">'
        f'<label>resource <input name=resource value="{esc(resource)}" maxlength=300></label>'
        f'<label>namespace <input name=namespace value="{esc(namespace)}" maxlength=63></label>'
        f'<input type=hidden name=window value="{esc(window)}"><button>show</button></form>'
    )
    cells = [[esc(r.route), esc(r.dst or "-"), esc(pct(r.success)), esc(rps(r.rps)),
              *_latencies(r.latency)] for r in rows]  # fmt: skip
    table = _table("routes", ROUTE_HEADER, cells, "No route traffic in the window.")
    return layout("Routes", "/routes", form + table, window)


@dataclass(frozen=True, slots=True)
class Node:
    namespace: str
    name: str
    x: float
    y: float


NODE_W: Final = 180
NODE_H: Final = 36
COL_GAP: Final = 440  # between columns: the lanes of the edges that cross, and their labels
GAP_PAD: Final = 40  # each side of a gap: where an edge turns from its node to its lane
ROW_GAP: Final = 24  # between the nodes of a column
LANE_H: Final = 56  # one edge's lane: its label (three lines) above its line
LINE_H: Final = 13  # one line of a label
LABEL_CHARS: Final = 72  # characters of one label line (the rest in the tooltip)
LABEL_W: Final = 440  # room right of the graph for the labels of edges drawn below it
MARGIN: Final = 40


def _layers(edges: Sequence[Edge]) -> dict[tuple[str, str], int]:
    """Each resource's column: 0 for one nobody calls, else one more than its deepest caller
    (a cycle stops growing once every resource has been placed deeper than it could be)."""
    nodes = {(e.src_namespace, e.src) for e in edges} | {(e.dst_namespace, e.dst) for e in edges}
    depth = dict.fromkeys(nodes, 0)
    for _ in range(len(nodes)):
        changed = False
        for e in edges:
            src, dst = (e.src_namespace, e.src), (e.dst_namespace, e.dst)
            if src != dst and depth[dst] < depth[src] + 1 < len(nodes):
                depth[dst] = depth[src] + 1
                changed = True
        if not changed:
            break
    return depth


def _label(e: Edge) -> list[str]:
    if e.requests > 0:
        count = f"{e.requests:.0f} req"
    elif e.connections > 0:
        count = f"{e.connections:.0f} TCP conn"
    else:
        count = "TCP open"
    if not e.mtls:
        return [f"no mTLS ({e.no_tls_reason or 'plaintext'}) · {count}"]
    return [f"mTLS · {count}", f"client {e.client_id or '?'}", f"server {e.server_id or '?'}"]


def _text(lines: list[str], x: float, baseline: float, anchor: str) -> str:
    """A label whose last line sits on `baseline`; lines over LABEL_CHARS are cut (whole in the
    tooltip)."""
    top = baseline - LINE_H * (len(lines) - 1)
    spans = "".join(
        f'<tspan x="{x:.0f}" y="{top + i * LINE_H:.0f}">'
        f"{esc(line if len(line) <= LABEL_CHARS else line[: LABEL_CHARS - 1] + '…')}</tspan>"
        for i, line in enumerate(lines)
    )
    return f'<text text-anchor="{anchor}"><title>{esc(" / ".join(lines))}</title>{spans}</text>'


def _points(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{x:.0f},{y:.0f}" for x, y in points)


def topology_svg(edges: Sequence[Edge]) -> str:
    """The meshed edges as an SVG graph: a box per resource in columns (callers left of whom
    they call), an arrow per edge labelled with the identities both sides proved (or why the
    traffic was not mTLS). No label lies on a line: an edge between neighbouring columns runs
    along a lane of its own across the gap, its label above that lane, where only lanes run;
    any other (a call back, to itself, or across a column) runs along a lane below the graph,
    its label right of everything drawn."""
    depth = _layers(edges)
    columns: dict[int, list[tuple[str, str]]] = {}
    for key in sorted(depth)[:MAX_NODES]:
        columns.setdefault(depth[key], []).append(key)
    nodes: dict[tuple[str, str], Node] = {}
    rows: dict[tuple[str, str], int] = {}
    for col, keys in columns.items():
        for row, (ns, name) in enumerate(keys):
            rows[(ns, name)] = row
            nodes[(ns, name)] = Node(ns, name, MARGIN + col * (NODE_W + COL_GAP),
                                     MARGIN + row * (NODE_H + ROW_GAP))  # fmt: skip
    drawn = [
        e for e in edges
        if (e.src_namespace, e.src) in nodes and (e.dst_namespace, e.dst) in nodes
    ]  # fmt: skip
    gaps: dict[int, list[Edge]] = {}  # column → the edges to the next one
    below: list[Edge] = []
    for e in drawn:
        caller, callee = (e.src_namespace, e.src), (e.dst_namespace, e.dst)
        if depth[callee] == depth[caller] + 1:
            gaps.setdefault(depth[caller], []).append(e)
        else:
            below.append(e)
    for lanes in gaps.values():
        lanes.sort(key=lambda e: (rows[(e.src_namespace, e.src)], rows[(e.dst_namespace, e.dst)]))
    stack = max((len(k) for k in columns.values()), default=1) * (NODE_H + ROW_GAP)
    top_h = max([stack, *(len(lanes) * LANE_H + LINE_H for lanes in gaps.values())])
    right = MARGIN + (max(columns, default=0) + 1) * (NODE_W + COL_GAP) - COL_GAP
    width = right + MARGIN + (LABEL_W if below else 0)
    height = MARGIN * 2 + top_h + len(below) * LANE_H
    parts = [
        f'<svg id="topology" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img">'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" '
        'markerHeight="8" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z"/>'
        "</marker></defs>"
    ]

    def edge(e: Edge, points: list[tuple[float, float]], label: str) -> None:
        parts.append(
            f'<g class="edge {"mtls" if e.mtls else "plain"}" data-src="{esc(e.src)}" '
            f'data-dst="{esc(e.dst)}" data-mtls="{str(e.mtls).lower()}" '
            f'data-client-id="{esc(e.client_id)}" data-server-id="{esc(e.server_id)}">'
            f'<polyline points="{_points(points)}" marker-end="url(#arrow)"/>{label}</g>'
        )

    for lanes in gaps.values():
        for i, e in enumerate(lanes):
            a, b = nodes[(e.src_namespace, e.src)], nodes[(e.dst_namespace, e.dst)]
            lane = MARGIN + (i + 1) * LANE_H
            xa, xb = a.x + NODE_W + GAP_PAD, b.x - GAP_PAD
            points = [(a.x + NODE_W, a.y + NODE_H / 2), (xa, lane), (xb, lane),
                      (b.x, b.y + NODE_H / 2)]  # fmt: skip
            edge(e, points, _text(_label(e), (xa + xb) / 2, lane - 7, "middle"))
    turns: dict[tuple[str, str], int] = {}  # below-graph edges leaving or reaching each node
    for i, e in enumerate(below):
        a, b = nodes[(e.src_namespace, e.src)], nodes[(e.dst_namespace, e.dst)]
        lane = MARGIN + top_h + (i + 1) * LANE_H - LINE_H
        out_n = turns[(a.namespace, a.name)] = turns.get((a.namespace, a.name), 0) + 1
        in_n = turns[(b.namespace, b.name)] = turns.get((b.namespace, b.name), 0) + 1
        x_out, x_in = a.x - 6 * out_n, b.x - 6 * in_n  # in the pad left of each node
        y_in = b.y + NODE_H - 4
        points = [(a.x, a.y + NODE_H / 2), (x_out, a.y + NODE_H / 2), (x_out, lane),
                  (right + 10, lane), (x_in, lane), (x_in, y_in), (b.x, y_in)]  # fmt: skip
        # the lane runs to the right edge, under its label, and back to the callee
        edge(e, points, _text(_label(e), right + 20, lane - 7, "start"))
    for n in nodes.values():
        parts.append(
            f'<g class="node" data-name="{esc(n.name)}" data-namespace="{esc(n.namespace)}">'
            f'<rect x="{n.x:.0f}" y="{n.y:.0f}" width="{NODE_W}" height="{NODE_H}" rx="6"/>'
            f'<text x="{n.x + NODE_W / 2:.0f}" y="{n.y + 15:.0f}" text-anchor="middle">'
            f"{esc(n.name)}</text>"
            f'<text class="ns" x="{n.x + NODE_W / 2:.0f}" y="{n.y + 29:.0f}" '
            f'text-anchor="middle">{esc(n.namespace or "-")}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def topology_page(edges: Sequence[Edge], kind: str, namespace: str, window: str) -> str:
    kinds = "".join(
        f'<option value="{k}"{" selected" if k == kind else ""}>{k}</option>'
        for k in ("deploy", "po")
    )
    form = (
        '<form class=filters method=get action="/topology">'
        f"<label>kind <select name=kind>{kinds}</select></label>"
        f'<label>namespace <input name=namespace value="{esc(namespace)}" maxlength=63></label>'
        f'<input type=hidden name=window value="{esc(window)}"><button>show</button></form>'
    )
    drawn = len(
        {(e.src_namespace, e.src) for e in edges} | {(e.dst_namespace, e.dst) for e in edges}
    )
    body = notice("No meshed edges in the window.") if not edges else topology_svg(edges)
    if drawn > MAX_NODES:
        body += notice(f"{drawn - MAX_NODES} resources not drawn (over {MAX_NODES})")
    return layout("Topology", "/topology", form + body, window)


def tap_page(resource: str, namespace: str, path: str, method: str) -> str:
    methods = "".join(
        f'<option value="{m}"{" selected" if m == method else ""}>{m or "any"}</option>'
        for m in TAP_METHODS
    )
    form = (
        "<form id=tap-form class=filters>"
        f'<label>resource <input name=resource id=tap-resource value="{esc(resource)}" '
        'placeholder="deploy/web" maxlength=300 required></label>'
        f'<label>namespace <input name=namespace id=tap-namespace value="{esc(namespace)}" '
        "maxlength=63></label>"
        f'<label>path prefix <input name=path id=tap-path value="{esc(path)}" maxlength=1024>'
        "</label>"
        f"<label>method <select name=method id=tap-method>{methods}</select></label>"
        "<button id=tap-start type=submit>Start</button>"
        "<button id=tap-stop type=button disabled>Stop</button></form>"
        '<p id=tap-status class="notice info">Not tapping.</p>'
        "<table id=tap-events><thead><tr><th>Direction</th><th>Proxy</th><th>Method</th>"
        "<th>Authority</th><th>Path</th><th>Status</th><th>Latency</th><th>TLS</th>"
        "<th>Source</th><th>Destination</th></tr></thead><tbody></tbody></table>"
    )
    return layout("Tap", "/tap", form)


def error_page(title: str, message: str, active: str = "/") -> str:
    return layout(title, active, notice(message, "error"))
