"""`meshlet check`: read the cluster once, judge it with `checks`, print check lines or JSON."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from meshlet.api import wellknown as wk
from meshlet.cli import options
from meshlet.cli.checks import (
    CONTROLLERS,
    POLICY_CRDS,
    ROUTE_APIS,
    Obj,
    Result,
    Snapshot,
    Status,
    evaluate,
)
from meshlet.cli.cluster import unreachable

SYMBOLS = {
    Status.SUCCESS: ("✓", "green"),
    Status.WARNING: ("‼", "yellow"),
    Status.ERROR: ("\u00d7", "red"),  # the multiplication sign, as linkerd check prints
}
TIMEOUT = 10


def _reader(errors: dict[str, str]) -> Callable[..., Any]:
    """Calls a kubernetes client method for raw JSON; 404 is None, other failures are recorded."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    def read(key: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            response = call(*args, _preload_content=False, _request_timeout=TIMEOUT, **kwargs)
            return json.loads(response.data)
        except ApiException as exc:
            if exc.status != 404:
                errors[key] = f"{exc.status} {exc.reason}"
        except (HTTPError, OSError, ValueError) as exc:
            errors[key] = unreachable(exc)
        return None

    return read


def _calling(namespace: str, listing: Obj | None) -> Obj | None:
    """The webhook configuration whose webhooks call a Service in `namespace`."""
    return next(
        (w for w in (listing or {}).get("items", [])
         if any(((h.get("clientConfig") or {}).get("service") or {}).get("namespace") == namespace
                for h in w.get("webhooks") or [])),
        None,
    )  # fmt: skip


MAX_POLICY_PODS = 5  # whose admin /ready is asked


def _admin_ready(api: Any, pods: list[Obj], port: int) -> dict[str, str]:
    """Each running pod's admin `/ready` through the API server's pod proxy: "" for 200, else
    what the API server or the pod said."""
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from meshlet.cli.scrape import status_reason

    out: dict[str, str] = {}
    for pod in pods[:MAX_POLICY_PODS]:
        name = str(pod["metadata"]["name"])
        if (pod.get("status") or {}).get("phase") != "Running":
            out[name] = f"pod is {(pod.get('status') or {}).get('phase') or 'Pending'}"
            continue
        try:
            k8s.CoreV1Api(api).connect_get_namespaced_pod_proxy_with_path(
                f"{name}:{port}", pod["metadata"]["namespace"], "ready",
                _preload_content=False, _request_timeout=TIMEOUT,
            )  # fmt: skip
            out[name] = ""
        except ApiException as exc:
            out[name] = f"/ready: {status_reason(exc)}"
        except (HTTPError, OSError) as exc:
            out[name] = unreachable(exc)
    return out


def snapshot(kubeconfig: Path | None, context: str | None, namespace: str) -> Snapshot:
    """Everything the checks look at, read from the cluster."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import ClusterError, api_client

    try:
        api = api_client(kubeconfig, context)
    except ClusterError as exc:
        return Snapshot(namespace, client_error=exc.message)
    errors: dict[str, str] = {}
    read = _reader(errors)
    version = read("version", k8s.VersionApi(api).get_code)
    if version is None:
        return Snapshot(namespace, errors=errors)
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    deployments = {
        name: d
        for name in CONTROLLERS
        if (d := read(f"deployment {name}", apps.read_namespaced_deployment, name, namespace))
    }
    pods = read("pods", core.list_namespaced_pod, namespace) or {}
    meshed = read(
        "data plane",
        core.list_pod_for_all_namespaces,
        label_selector=f"{wk.CONTROL_PLANE_NS_LABEL}={namespace}",
    ) or {}  # fmt: skip
    data_plane = tuple(
        p for p in meshed.get("items", []) if p["metadata"].get("namespace") != namespace
    )
    admission = k8s.AdmissionregistrationV1Api(api)
    webhook = _calling(namespace, read("webhook", admission.list_mutating_webhook_configuration))
    validator = _calling(
        namespace, read("validator", admission.list_validating_webhook_configuration)
    )
    extensions = k8s.ApiextensionsV1Api(api)
    policy_crds = frozenset(
        name for name in POLICY_CRDS
        if read(name, extensions.read_custom_resource_definition, name) is not None
    )  # fmt: skip
    custom = k8s.CustomObjectsApi(api)
    routes = tuple(
        {"apiVersion": f"{group}/{version}", **item}
        for group, version, plural in ROUTE_APIS
        for item in (read("routes", custom.list_cluster_custom_object, group, version, plural)
                     or {}).get("items", [])
    )  # fmt: skip
    profiles = read("profiles", custom.list_cluster_custom_object, "meshlet.io", "v1alpha1",
                    "serviceprofiles") or {}  # fmt: skip
    policy_pods = sorted(
        (p for p in pods.get("items", [])
         if ((p.get("metadata") or {}).get("labels") or {}).get(wk.CONTROL_PLANE_COMPONENT_LABEL)
         == "policy"),
        key=lambda p: str(p["metadata"]["name"]),
    )  # fmt: skip
    config = read("config", core.read_namespaced_config_map, wk.CONFIG_CONFIGMAP, namespace)
    cni_enabled = _cni_enabled(config)
    daemonsets = (read("cni daemonsets", apps.list_daemon_set_for_all_namespaces,
                       label_selector="app.kubernetes.io/name=meshlet-cni")
                  if cni_enabled else None) or {}  # fmt: skip
    return Snapshot(
        namespace=namespace,
        version=version,
        cni_enabled=cni_enabled,
        cni_daemonsets=tuple(daemonsets.get("items", [])),
        control_namespace=read("namespace", core.read_namespace, namespace),
        crd=read("crd", k8s.ApiextensionsV1Api(api).read_custom_resource_definition,
                 wk.SERVICEPROFILE_CRD),
        deployments=deployments,
        pods=tuple(pods.get("items", [])),
        issuer_secret=read("issuer", core.read_namespaced_secret, wk.ISSUER_SECRET, namespace),
        trust_roots=read("trust roots", core.read_namespaced_config_map,
                         wk.TRUST_ROOTS_CONFIGMAP, namespace),
        webhook=webhook,
        validator=validator,
        webhook_secret=read("webhook secret", core.read_namespaced_secret,
                            wk.INJECTOR_TLS_SECRET, namespace),
        data_plane=data_plane,
        trust_root_copies={
            item["metadata"]["namespace"]: (item.get("data") or {}).get(wk.TRUST_ROOTS_KEY, "")
            for item in (read("trust root copies", core.list_config_map_for_all_namespaces,
                              label_selector=f"{wk.TRUST_ROOTS_COPY_LABEL}=copy")
                         or {}).get("items", [])
        },
        policy_crds=policy_crds,
        policy_deployment=deployments.get(wk.POLICY_NAME),
        disruption_budgets=tuple(
            (read("disruption budgets", k8s.PolicyV1Api(api).list_namespaced_pod_disruption_budget,
                  namespace) or {}).get("items", [])
        ),
        policy_ready=_admin_ready(api, policy_pods, wk.POLICY_ADMIN_PORT),
        routes=routes,
        profiles=tuple(profiles.get("items", [])),
        errors=errors,
    )  # fmt: skip


def _cni_enabled(config: Obj | None) -> bool:
    """meshlet-config's cniEnabled (False when it cannot be read: the checks that read the
    config say why)."""
    import yaml

    text = ((config or {}).get("data") or {}).get(wk.CONFIG_KEY) or ""
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(values, dict) and values.get("cniEnabled") is True


def as_json(results: list[Result]) -> str:
    categories: dict[str, list[Obj]] = {}
    for r in results:
        entry: Obj = {"description": r.description, "result": r.status.value}
        if r.status is not Status.SUCCESS:
            entry.update(error=r.error, hint=r.hint)
        categories.setdefault(r.category, []).append(entry)
    doc = {
        "success": all(r.status is not Status.ERROR for r in results),
        "categories": [{"categoryName": k, "checks": v} for k, v in categories.items()],
    }
    return json.dumps(doc, indent=2) + "\n"


def print_text(results: list[Result], console: Any) -> None:
    category = ""
    for r in results:
        if r.category != category:
            if category:
                console.print()
            category = r.category
            console.print(category, style="bold")
            console.print("-" * len(category))
        symbol, colour = SYMBOLS[r.status]
        console.print(f"[{colour}]{symbol}[/{colour}] {r.description}", highlight=False)
        if r.status is not Status.SUCCESS:
            console.print(f"    {r.error}", markup=False, highlight=False)
            console.print(f"    hint: {r.hint}", markup=False, highlight=False)
    ok = all(r.status is not Status.ERROR for r in results)
    symbol, colour = SYMBOLS[Status.SUCCESS if ok else Status.ERROR]
    console.print(f"\nStatus check results are [{colour}]{symbol}[/{colour}]")


@click.command()
@click.option("--pre", is_flag=True, help="Check that the cluster is ready for meshlet install.")
@click.option("-o", "--output", type=click.Choice(["basic", "json"]), default="basic",
              show_default=True, help="basic: lines; json: linkerd check's JSON.")  # fmt: skip
@click.option("--fail-on-warning", is_flag=True, help="Exit non-zero on warnings too.")
@options.cluster
@options.control_plane_namespace(was_namespace=True)
def check(
    pre: bool,
    output: str,
    fail_on_warning: bool,
    kubeconfig: Path | None,
    context: str | None,
    control_plane_namespace: str,
) -> None:
    """Check that meshlet is installed and healthy (like `linkerd check`).

    Exits 1 when a check fails, or, with --fail-on-warning, when one warns.
    """
    from rich.console import Console

    console = Console(file=sys.stdout, width=100, soft_wrap=True)
    if output == "basic" and console.is_terminal:
        with console.status("reading the cluster…"):
            state = snapshot(kubeconfig, context, control_plane_namespace)
    else:
        state = snapshot(kubeconfig, context, control_plane_namespace)
    results = list(evaluate(state, dt.datetime.now(dt.UTC), pre=pre))
    if output == "json":
        sys.stdout.write(as_json(results))
    else:
        print_text(results, console)
    statuses = {r.status for r in results}
    if Status.ERROR in statuses or (fail_on_warning and Status.WARNING in statuses):
        sys.exit(1)
