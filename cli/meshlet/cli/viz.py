"""`meshlet viz`: the mesh's traffic as Linkerd's viz extension shows it: stat, edges and routes
from a Prometheus that scrapes the proxies (`--prometheus-url`, else the one a kept local mesh
runs), or, for `stat` in a local mesh without one, from the proxies themselves; tap and top
(viztap, viztop) from the tap controller; and the address of the web dashboard (dashboard)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

import click

from meshlet.api import wellknown as wk
from meshlet.cli import localmesh, options, tables, vizmetrics
from meshlet.cli.vizmetrics import MetricsError, Prometheus, StatRow, Target

EX_UNAVAILABLE: Final = 1
_OUTPUT = click.Choice(["table", "json"])


def _latencies(latency: dict[str, float | None]) -> list[str]:
    return [tables.ms(latency.get(f"p{q * 100:g}")) for q in vizmetrics.QUANTILES]


def stat_table(rows: Sequence[StatRow]) -> str:
    header = ["NAMESPACE", "NAME", "SUCCESS", "RPS", "LATENCY_P50", "LATENCY_P95",
              "LATENCY_P99", "TCP_CONN", "MTLS"]  # fmt: skip
    lines = [
        [r.namespace or "-", r.name or "-", tables.pct(r.success), tables.num(r.rps, "rps"),
         *_latencies(r.latency), f"{r.tcp_connections:.0f}", tables.pct(r.mtls)]
        for r in rows
    ]  # fmt: skip
    return tables.render(header, lines, left={"NAMESPACE", "NAME"})


def edges_table(rows: Sequence[vizmetrics.Edge]) -> str:
    header = ["SRC", "DST", "SRC_NS", "DST_NS", "CLIENT_ID", "SERVER_ID", "SECURED", "REQUESTS",
              "CONNECTIONS"]  # fmt: skip
    lines = [
        [e.src, e.dst, e.src_namespace or "-", e.dst_namespace or "-", e.client_id or "-",
         e.server_id or "-", "√" if e.mtls else f"no ({e.no_tls_reason or 'plaintext'})",
         f"{e.requests:.0f}", f"{e.connections:.0f}"]
        for e in rows
    ]  # fmt: skip
    return tables.render(header, lines, left=set(header) - {"REQUESTS", "CONNECTIONS"})


def routes_table(rows: Sequence[vizmetrics.RouteRow]) -> str:
    header = ["ROUTE", "DST", "SUCCESS", "RPS", "LATENCY_P50", "LATENCY_P95", "LATENCY_P99"]
    lines = [[r.route, r.dst or "-", tables.pct(r.success), tables.num(r.rps, "rps"),
              *_latencies(r.latency)] for r in rows]  # fmt: skip
    return tables.render(header, lines, left={"ROUTE", "DST"})


def _emit(output: str, rows: Sequence[object], render: str, empty: str) -> None:
    if output == "json":
        docs = [r.as_dict() for r in rows]  # type: ignore[attr-defined]
        sys.stdout.write(json.dumps(docs, indent=2) + "\n")
    elif rows:
        sys.stdout.write(render)
    else:
        click.echo(empty, err=True)


def _kept_proxies(kept: localmesh.Kept | None) -> list[vizmetrics.Proxy]:
    """A kept local mesh's proxies ([]: no mesh)."""

    if kept is None:
        return []
    layout = kept.layout
    return [vizmetrics.Proxy(p.name, p.workload, kept.namespace, layout.admin(p))
            for p in layout.pods]  # fmt: skip


def _source(url: str | None, cluster: Cluster) -> tuple[str | None, localmesh.Kept | None]:
    """The Prometheus a query verb reads: --prometheus-url, else a kept local mesh's (then
    the mesh is returned too: its namespace is the default) when no cluster is named, else the
    cluster's (the chart's meshlet-prometheus, through a port-forward held while the command
    runs)."""
    if url is not None:
        return url, None
    named = localmesh.cluster_named(cluster.kubeconfig, cluster.context)
    kept = None if cluster.kubeconfig or cluster.context else localmesh.kept()
    if kept is not None and "prometheus" in kept.urls:
        return kept.urls["prometheus"], kept
    if named:
        return _cluster_prometheus(cluster), None
    return None, None


def _cluster_prometheus(cluster: Cluster) -> str:
    from meshlet.cli.cluster import api_client
    from meshlet.cli.diagnostics import _component_pod
    from meshlet.cli.portforward import PortForward

    api = api_client(cluster.kubeconfig, cluster.context)
    ns = cluster.control_plane_namespace
    pod = _component_pod(api, ns, "prometheus", None)
    host, port = click.get_current_context().with_resource(
        PortForward(api, ns, pod, wk.PROMETHEUS_PORT)
    )
    return f"http://{host}:{port}"


def _prometheus(url: str | None) -> Prometheus:
    if url is None:
        raise click.UsageError(
            "no Prometheus: give --prometheus-url (a kept `meshlet demo --keep` with the "
            "prometheus package installed runs one; in a cluster, the chart's runs with "
            "prometheus.enabled=true)"
        )
    try:
        return Prometheus(url)
    except MetricsError as exc:
        raise click.BadParameter(str(exc), param_hint="--prometheus-url") from None


def _target(text: str | None, namespace: str | None, hint: str) -> Target | None:
    if text is None:
        return None
    try:
        return vizmetrics.target(text, namespace)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def _window(text: str) -> str:
    try:
        return vizmetrics.window(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--time-window") from None


def _fail(exc: MetricsError) -> None:
    click.echo(f"Error: {exc}", err=True)
    raise SystemExit(EX_UNAVAILABLE)


_ns = click.option("-n", "--namespace", help=localmesh.NAMESPACE_HELP)
_all = click.option("-A", "--all-namespaces", is_flag=True, help="Every namespace.")
_url = click.option(
    "--prometheus-url",
    metavar="URL",
    help="A Prometheus scraping the proxies (default: a kept demo's, else the cluster's "
    "meshlet-prometheus through a port-forward).",
)
_out = click.option("-o", "--output", type=_OUTPUT, default="table", show_default=True,
                    help="table, or json (one object per row).")  # fmt: skip


def _cluster(command: Any) -> Any:
    """Where the cluster's Prometheus is: --kubeconfig, --context, -L."""
    return options.control_plane_namespace()(options.cluster(command))


class Cluster(NamedTuple):
    kubeconfig: Path | None
    context: str | None
    control_plane_namespace: str


_win = click.option("-t", "--time-window", "window", default="1m", show_default=True,
                    help="The range the rates cover: 30s, 1m, 1h.")  # fmt: skip


@click.group()
def viz() -> None:
    """Traffic as Linkerd's viz shows it: metrics from Prometheus (stat, edges, routes),
    live requests from the tap controller (tap, top)."""


@viz.command()
@click.argument("resource", metavar="TYPE[/NAME]")
@click.option("--to", "to", metavar="TYPE/NAME", help="Only its outbound requests to this.")
@click.option("--from", "src", metavar="TYPE/NAME", help="Only requests from this.")
@click.option("--to-namespace", help="The --to resource's namespace (default: -n's).")
@click.option("--from-namespace", help="The --from resource's namespace (default: -n's).")
@click.option(
    "--direct", is_flag=True, help="Read a kept local mesh's proxies twice, a window apart."
)
@_ns
@_all
@_win
@_url
@_out
@_cluster
def stat(resource: str, to: str | None, src: str | None, to_namespace: str | None,
         from_namespace: str | None, direct: bool, namespace: str | None, all_namespaces: bool,
         window: str, prometheus_url: str | None, output: str, **cluster: Any) -> None:  # fmt: skip
    """Success rate, RPS, latency, TCP connections and mTLS of deploy, po, ns, svc or authority.

    Rows are what the resources' proxies received (inbound); with --to, what they sent to it;
    with --from, what it sent them. A service's rows are its clients' requests to it.

    \b
    meshlet viz stat deploy -n demo --prometheus-url http://localhost:9090
    meshlet viz stat deploy/web --to deploy/api -n demo -o json
    """
    where = Cluster(**cluster)
    kept = localmesh.kept() if direct else None
    url, local = (None, kept) if direct else _source(prometheus_url, where)
    ns = None if all_namespaces else localmesh.namespace(namespace, local, where.kubeconfig,
                                                          where.context)  # fmt: skip
    t = _target(resource, ns, "TYPE[/NAME]")
    assert t is not None
    to_t = _target(to, to_namespace or ns, "--to")
    src_t = _target(src, from_namespace or ns, "--from")
    if to_t is not None and src_t is not None:
        raise click.UsageError("--to and --from together: give one")
    seconds = _window(window)
    if direct:
        rows = _direct(t, seconds, kept)
    else:
        prom = _prometheus(url)
        try:
            rows = vizmetrics.stat(prom, vizmetrics.stat_query(t, to=to_t, src=src_t), seconds)
        except MetricsError as exc:
            _fail(exc)
    _emit(output, rows, stat_table(rows) if rows else "", "No traffic in the window.")


def _direct(t: Target, window_text: str, kept: localmesh.Kept | None) -> list[StatRow]:
    if t.kind not in ("deployment", "pod"):
        raise click.UsageError("--direct reads deploy and po only")
    proxies = _kept_proxies(kept)
    if not proxies:
        raise click.UsageError("--direct reads a kept local mesh (meshlet demo --keep): none runs")
    wanted = [p for p in proxies if t.name is None or t.name in (p.workload, p.pod)]
    try:
        first = {p.pod: vizmetrics.read_proxy(p, time.monotonic) for p in wanted}
        time.sleep(vizmetrics.seconds(window_text))
        second = {p.pod: vizmetrics.read_proxy(p, time.monotonic) for p in wanted}
    except MetricsError as exc:
        _fail(exc)
    return vizmetrics.direct_stat(wanted, t.kind, first, second)


@viz.command()
@click.argument("kind", metavar="TYPE", default="deploy")
@_ns
@_all
@_win
@_url
@_out
@_cluster
def edges(kind: str, namespace: str | None, all_namespaces: bool, window: str,
          prometheus_url: str | None, output: str, **cluster: Any) -> None:  # fmt: skip
    """Who calls whom (deploy or po), with the identities each side proved and whether the
    traffic went over mutual TLS: HTTP requests and TCP connections (opaque ones included)."""
    t = _target(kind, None, "TYPE")
    assert t is not None
    if t.kind not in ("deployment", "pod"):
        raise click.BadParameter("edges are between deploy or po", param_hint="TYPE")
    seconds = _window(window)
    where = Cluster(**cluster)
    url, local = _source(prometheus_url, where)
    ns = None if all_namespaces else localmesh.namespace(namespace, local, where.kubeconfig,
                                                          where.context)  # fmt: skip
    prom = _prometheus(url)
    try:
        rows = vizmetrics.edges(prom, t.kind, seconds, ns)
    except MetricsError as exc:
        _fail(exc)
    _emit(output, rows, edges_table(rows) if rows else "", "No edges in the window.")


def _routes(resource: str, to: str | None, namespace: str | None, window: str,
            prometheus_url: str | None, output: str, where: Cluster) -> None:  # fmt: skip
    url, local = _source(prometheus_url, where)
    ns = localmesh.namespace(namespace, local, where.kubeconfig, where.context)
    t = _target(resource, ns, "TYPE[/NAME]")
    assert t is not None
    to_t = _target(to, ns, "--to")
    if to_t is not None and to_t.kind not in ("service", "authority"):
        raise click.BadParameter("routes --to takes svc/NAME or authority/HOST:PORT",
                                 param_hint="--to")  # fmt: skip
    seconds = _window(window)
    prom = _prometheus(url)
    try:
        rows = vizmetrics.routes(prom, t, seconds, to=to_t)
    except MetricsError as exc:
        _fail(exc)
    _emit(output, rows, routes_table(rows) if rows else "", "No route traffic in the window.")


@viz.command()
@click.argument("resource", metavar="TYPE[/NAME]")
@click.option("--to", "to", metavar="svc/NAME|authority/HOST:PORT",
              help="Its outbound routes to this.")  # fmt: skip
@_ns
@_win
@_url
@_out
@_cluster
def routes(resource: str, to: str | None, namespace: str | None, window: str,
           prometheus_url: str | None, output: str, **cluster: Any) -> None:  # fmt: skip
    """Per-route success, RPS and latency (the route_* metrics): of the resource's inbound
    routes, or with --to of its outbound ones."""
    _routes(resource, to, namespace, window, prometheus_url, output, Cluster(**cluster))


DASHBOARD_PORT: Final = 50750  # Linkerd's `viz dashboard` local port


@viz.command()
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    default=DASHBOARD_PORT,
    show_default=True,
    help="Local port of the port-forward (0: any free one).",
)
@click.option(
    "--show",
    type=click.Choice(["url", "browser"]),
    default="url",
    show_default=True,
    help="url: print the address; browser: also open it in the default browser.",
)
@click.option("--web-pod", help="Which tap pod (its web container) to port-forward to.")
@options.control_plane_namespace()
@options.cluster
def dashboard(port: int, show: str, web_pod: str | None, control_plane_namespace: str,
              kubeconfig: Path | None, context: str | None) -> None:  # fmt: skip
    """The web dashboard: a port-forward to its container in the tap pod, held until Ctrl-C,
    and its address. When no kubeconfig or context is given ($KUBECONFIG, ~/.kube/config
    included) and a kept local mesh runs one (`meshlet demo --keep`), that mesh's dashboard's
    address instead.

    \b
    meshlet viz dashboard
    meshlet viz dashboard --port 0 --show browser
    """
    kept = None if localmesh.cluster_named(kubeconfig, context) else localmesh.kept()
    local = kept.urls.get("dashboard") if kept is not None else None
    if local is not None:
        _announce(local, show, "the local mesh's dashboard")
        return
    from meshlet.cli.cluster import api_client
    from meshlet.cli.diagnostics import _component_pod
    from meshlet.cli.portforward import PortForward

    api = api_client(kubeconfig, context)
    pod = _component_pod(api, control_plane_namespace, "tap", web_pod)
    with PortForward(api, control_plane_namespace, pod, wk.WEB_PORT, port) as (host, bound):
        where = f"{control_plane_namespace}/{pod}:{wk.WEB_PORT} (port-forward; Ctrl-C ends it)"
        _announce(f"http://{host}:{bound}", show, where)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return


def _announce(url: str, show: str, what: str) -> None:
    click.echo(f"meshlet dashboard at {url}/ ({what})")
    if show == "browser":
        import webbrowser

        if not webbrowser.open(f"{url}/"):
            click.echo("no browser could be opened: visit the address above", err=True)
