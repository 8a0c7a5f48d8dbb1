"""`meshlet uninstall`: the control plane's objects, for `kubectl delete -f -`."""

from __future__ import annotations

import datetime as dt
import sys

import click

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
def uninstall(control_plane_namespace: str, crds: bool) -> None:
    """Print references to every object `meshlet install` creates, with any of its options
    (the chart's Prometheus and dashboards included: absent ones are not found).

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
    sys.stdout.write(stream(refs))
