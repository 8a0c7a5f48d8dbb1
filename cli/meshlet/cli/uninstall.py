"""`meshlet uninstall`: the control plane's objects, for `kubectl delete -f -`."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Any

import click

from meshlet.api import wellknown as wk
from meshlet.cli import charts, options
from meshlet.cli.manifests import stream
from meshlet.cli.prune import reference

# The chart's optional parts, all on: their objects are named whether or not installed.
EVERY_OPTION = {
    "prometheus": {"enabled": True, "scrapeConfig": True},
    "grafana": {"dashboards": True},
    "enablePodDisruptionBudget": True,  # --ha's
}


@click.command()
@options.control_plane_namespace(was_namespace=True)
@click.option("--crds", is_flag=True, help="Also the CustomResourceDefinitions (and so every "
              "ServiceProfile).")  # fmt: skip
@options.cluster
def uninstall(
    control_plane_namespace: str, crds: bool, kubeconfig: Path | None, context: str | None
) -> None:
    """Print references to every object `meshlet install` creates, with any of its options
    (the chart's Prometheus and dashboards included: absent ones are not found), and, read
    from the cluster when a kubeconfig names one, the copies of the trust roots the injector
    made in meshed namespaces.

    \b
    meshlet uninstall | kubectl delete --ignore-not-found -f -

    Meshed pods keep their proxies until they are restarted.
    """
    from meshlet.cli.install import generated

    values = generated({}, control_plane_namespace, dt.datetime.now(dt.UTC), quiet=True)
    values.update(EVERY_OPTION)
    try:
        manifests = charts.render(charts.CONTROL_PLANE, values, control_plane_namespace)
        if crds:
            manifests += charts.render(charts.CRDS, {}, control_plane_namespace)
    except charts.ChartError as exc:
        raise click.UsageError(str(exc)) from None
    refs = [(m.source, reference(m.doc["apiVersion"], m.doc["kind"], m.doc["metadata"]))
            for m in reversed(manifests)]  # dependents first, the namespace last  # fmt: skip
    found = _trust_root_copies(kubeconfig, context, control_plane_namespace)
    copies = [("the injector's copy of the trust roots", copy) for copy in found]
    sys.stdout.write(stream([*copies, *refs]))


def _trust_root_copies(
    kubeconfig: Path | None, context: str | None, control_plane_namespace: str
) -> list[dict[str, Any]]:
    """References to the namespaces' copies of the trust roots (the control plane's own is the
    chart's); none without a cluster, with a note when the cluster cannot be read."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import ClusterError, read_json
    from meshlet.cli.installed import configured_client

    selector = f"{wk.TRUST_ROOTS_COPY_LABEL}=copy"
    try:
        api = configured_client(kubeconfig, context)
        if api is None:
            return []
        found = read_json("the copies of the trust roots",
                          k8s.CoreV1Api(api).list_config_map_for_all_namespaces,
                          label_selector=selector)  # fmt: skip
    except ClusterError as exc:
        click.echo(f"meshlet uninstall: the namespaces' copies of the trust roots were not"
                   f" listed ({exc.message}); delete them with: kubectl delete configmap -A"
                   f" -l {selector}", err=True)  # fmt: skip
        return []
    return [reference("v1", "ConfigMap", item["metadata"])
            for item in found.get("items", [])
            if item["metadata"].get("namespace") != control_plane_namespace]  # fmt: skip
