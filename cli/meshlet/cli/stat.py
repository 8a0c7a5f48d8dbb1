"""`meshlet stat`: per Deployment or pod, what its proxies saw arrive during a window (success
rate, requests per second, latency quantiles, open connections, the share over mutual TLS), from
two scrapes of every meshed pod's proxy through the API server's pod proxy. There is no
Prometheus: the window is the time between the two scrapes."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import click

from meshlet.cli import options, stats, tables
from meshlet.cli.scrape import Failure, Metrics
from meshlet.cli.workloads import Kind, Pod, Workload, parse_resources

MIN_WINDOW: Final = 1.0
MAX_WINDOW: Final = 3600.0


@dataclass(frozen=True, slots=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


CLOCK = Clock()  # the seam where tests make the window instant and exact


@dataclass(frozen=True, slots=True)
class Stat:
    """One row: a workload, what its readable proxies reported, and which could not be read."""

    workload: Workload
    row: stats.Row | None  # None: no meshed pod of it could be read
    unreachable: Mapping[str, str]  # pod name → why


def measure(
    workloads: Sequence[Workload],
    first: Mapping[str, Metrics | Failure],
    second: Mapping[str, Metrics | Failure],
) -> list[Stat]:
    """Rows from two scrapes, keyed by pod (`namespace/name`)."""
    out = []
    for workload in workloads:
        parts: list[stats.Traffic] = []
        unreachable: dict[str, str] = {}
        for pod in workload.meshed_pods:
            old, new = first.get(pod.key), second.get(pod.key)
            if old is None or new is None:
                continue
            if isinstance(old, Failure):
                unreachable[pod.name] = old.reason
                continue
            if isinstance(new, Failure):
                unreachable[pod.name] = new.reason
                continue
            try:
                before = stats.Scrape(pod.name, old.at, stats.parse(old.text))
                after = stats.Scrape(pod.name, new.at, stats.parse(new.text))
            except ValueError as exc:
                unreachable[pod.name] = f"its admin port did not answer Prometheus text: {exc}"
                continue
            parts.append(stats.traffic(before, after))
        row = stats.row(workload.name, workload.meshed, stats.combine(parts)) if parts else None
        out.append(Stat(workload, row, unreachable))
    return out


# -- rendering (pure) ---------------------------------------------------------------------


def table(rows: Sequence[Stat], *, all_namespaces: bool, wide: bool) -> str:
    kind = rows[0].workload.kind if rows else Kind.DEPLOYMENT
    header = ["NAMESPACE"] if all_namespaces else []
    header += ["NAME", *(["STATUS"] if kind is Kind.POD else []), "MESHED", "SUCCESS", "RPS",
               "LATENCY_P50", "LATENCY_P95", "LATENCY_P99", "TCP_CONN", "MTLS"]  # fmt: skip
    if wide:
        header += ["READ_BYTES/SEC", "WRITE_BYTES/SEC"]
    lines = []
    for stat in rows:
        w, r = stat.workload, stat.row
        cells = [w.namespace] if all_namespaces else []
        cells += [w.name, *([w.status] if kind is Kind.POD else []), w.meshed]
        if r is None:
            cells += ["-"] * (len(header) - len(cells))
        else:
            cells += [tables.pct(r.success), tables.num(r.rps, "rps"),
                      *(tables.ms(q) for q in r.quantiles),
                      f"{r.open_connections:.0f}", tables.pct(r.mtls)]  # fmt: skip
            if wide:
                cells += [tables.num(r.read_bytes_per_s, "B/s"),
                          tables.num(r.write_bytes_per_s, "B/s")]  # fmt: skip
        lines.append(cells)
    return tables.render(header, lines, left={"NAMESPACE", "NAME"})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def as_json(rows: Sequence[Stat]) -> str:
    docs = []
    for stat in rows:
        w, r = stat.workload, stat.row
        doc: dict[str, Any] = {"namespace": w.namespace, "kind": w.kind.value, "name": w.name}
        if w.kind is Kind.POD:
            doc["status"] = w.status
        doc["meshed"] = w.meshed
        p50, p95, p99 = r.quantiles if r is not None else (None, None, None)
        doc.update(
            success=_round(r.success) if r else None,
            rps=_round(r.rps) if r else None,
            latency_ms_p50=_round(p50),
            latency_ms_p95=_round(p95),
            latency_ms_p99=_round(p99),
            tcp_open_connections=_round(r.open_connections) if r else None,
            tcp_read_bytes_rate=_round(r.read_bytes_per_s) if r else None,
            tcp_write_bytes_rate=_round(r.write_bytes_per_s) if r else None,
            mtls=_round(r.mtls) if r else None,
            unreachable=dict(sorted(stat.unreachable.items())),
        )
        docs.append(doc)
    return json.dumps(docs, indent=2) + "\n"


def unreachable_report(rows: Sequence[Stat]) -> str:
    """What to tell on standard error about proxies that could not be read."""
    failed = [(s.workload.namespace, pod, why) for s in rows for pod, why in s.unreachable.items()]
    if not failed:
        return ""
    meshed = sum(len(s.workload.meshed_pods) for s in rows)
    lines = [f"could not read {len(failed)} of {meshed} proxies (their rows count the others):"]
    lines += [f"  {ns}/{pod}: {why}" for ns, pod, why in sorted(set(failed))]
    return "\n".join(lines) + "\n"


# -- the command ----------------------------------------------------------------------------


def _window(text: str) -> float:
    from meshlet.api.durations import parse_duration

    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--window") from None
    if not MIN_WINDOW <= seconds <= MAX_WINDOW:
        raise click.BadParameter(
            f"{text} is outside 1s..1h (the rates are differences over this window)",
            param_hint="--window",
        )
    return seconds


def _workloads(
    api: Any, kind: Kind, namespace: str | None, names: Sequence[str], unmeshed: bool
) -> list[Workload]:
    """The rows asked for; NotFound for a namespace or a name that does not exist."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import Forbidden, NotFound, read_json
    from meshlet.cli.workloads import deployments, pod_of, pod_workloads

    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    if namespace is not None:
        try:
            read_json(f"namespace {namespace}", core.read_namespace, namespace)
        except NotFound:
            raise NotFound(
                f"namespace {namespace!r} not found; list them with kubectl get namespaces"
            ) from None
        except Forbidden:
            pass  # a user confined to namespaces may not read Namespace objects: the lists tell
        pod_list = read_json("pods", core.list_namespaced_pod, namespace)
    else:
        pod_list = read_json("pods", core.list_pod_for_all_namespaces)
    pods = [pod_of(obj) for obj in pod_list.get("items") or []]
    if kind is Kind.DEPLOYMENT:
        if namespace is not None:
            objs = read_json("deployments", apps.list_namespaced_deployment, namespace)
        else:
            objs = read_json("deployments", apps.list_deployment_for_all_namespaces)
        found = deployments(objs.get("items") or [], pods)
    else:
        found = pod_workloads(pods)
    if names:
        found = [w for w in found if w.name in names]
        missing = sorted(set(names) - {w.name for w in found})
        if missing:
            where = f"namespace {namespace!r}" if namespace is not None else "any namespace"
            raise NotFound(f"no {kind.value} {', '.join(missing)} in {where}")
        return found
    return found if unmeshed else [w for w in found if w.meshed_pods]


def _scrape_twice(
    api: Any, pods: Sequence[Pod], window: float
) -> tuple[dict[str, Metrics | Failure], dict[str, Metrics | Failure]]:
    from meshlet.cli.scrape import scrape_all

    started = CLOCK.now()
    first = {r.pod.key: r for r in scrape_all(api, pods, CLOCK.now)}
    CLOCK.sleep(max(0.0, window - (CLOCK.now() - started)))
    second = {r.pod.key: r for r in scrape_all(api, pods, CLOCK.now)}
    return first, second


@click.command()
@click.argument("resources", nargs=-1, required=True, metavar="TYPE [NAME]... | TYPE/NAME...")
@click.option("-n", "--namespace", help="Default: the kubeconfig context's, else default.")
@click.option("-A", "--all-namespaces", is_flag=True, help="Every namespace.")
@click.option("-t", "--window", "--time-window", "window", default="10s", show_default=True,
              help="Time between the two scrapes the rates cover (1s to 1h).")  # fmt: skip
@click.option("-o", "--output", type=click.Choice(["table", "json", "wide"]), default="table",
              show_default=True, help="wide adds read and write bytes per second.")  # fmt: skip
@click.option("--unmeshed", is_flag=True, help="Also list workloads without meshed pods.")
@options.cluster
def stat(
    resources: tuple[str, ...],
    namespace: str | None,
    all_namespaces: bool,
    window: str,
    output: str,
    unmeshed: bool,
    kubeconfig: Path | None,
    context: str | None,
) -> None:
    """Traffic stats of Deployments or pods, from their proxies (like `linkerd viz stat`).

    TYPE is deploy (deployment) or pod (po). Each meshed pod's proxy is read twice through
    the API server's pod proxy (pods/proxy on its meshlet-admin port, 4191), --window apart;
    a row sums what its pods' proxies received: SUCCESS (non-5xx, gRPC OK), RPS, latency
    quantiles, TCP_CONN (open inbound connections), MTLS (the share of requests, or for
    TCP-only workloads of connections, that arrived over mutual TLS). MESHED counts meshed
    pods of all live pods. A proxy that cannot be read is named on standard error and left
    out of its row. Exits 1 when the cluster cannot be read or a namespace or name does not
    exist, 64 on bad usage.

    \b
    meshlet stat deploy -n emojivoto
    meshlet stat deploy/web -n emojivoto -t 30s -o json
    meshlet stat pods -A
    """
    from meshlet.cli.cluster import api_client, default_namespace

    try:
        wanted = parse_resources(resources)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="RESOURCES") from None
    seconds = _window(window)
    api = api_client(kubeconfig, context)
    ns = None if all_namespaces else namespace or default_namespace(kubeconfig, context)
    workloads = _workloads(api, wanted.kind, ns, wanted.names, unmeshed)
    pods = list({p.key: p for w in workloads for p in w.meshed_pods}.values())
    first: dict[str, Metrics | Failure] = {}
    second: dict[str, Metrics | Failure] = {}
    if pods:
        from rich.console import Console

        console = Console(stderr=True)
        if output != "json" and console.is_terminal:
            with console.status(f"reading {len(pods)} proxies twice, {window} apart…"):
                first, second = _scrape_twice(api, pods, seconds)
        else:
            first, second = _scrape_twice(api, pods, seconds)
    rows = measure(workloads, first, second)
    if output == "json":
        sys.stdout.write(as_json(rows))
    elif rows:
        sys.stdout.write(table(rows, all_namespaces=all_namespaces, wide=output == "wide"))
    else:
        where = f"in namespace {ns}" if ns is not None else "in any namespace"
        click.echo(f"No meshed {wanted.kind.value}s {where}.", err=True)
    sys.stderr.write(unreachable_report(rows))
    if pods and not any(isinstance(got, Metrics) for got in second.values()):
        # Not one proxy could be read: the rows are empty, not a result to act on.
        raise SystemExit(1)
