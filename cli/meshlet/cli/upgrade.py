"""`meshlet upgrade`: the control plane rendered again from what the cluster keeps (the values
given before, the trust anchors, the issuer, the webhook's and tap's certificates), with any new
values over the old ones."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from meshlet.cli import charts, options
from meshlet.cli.charts import ChartError
from meshlet.cli.manifests import stream


@click.command()
@click.option("--crds", is_flag=True, help="Only the CustomResourceDefinitions.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A chart value over those given before (repeatable).")  # fmt: skip
@click.option("--values", "-f", "values_files", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A YAML file of chart values over those given before (repeatable).")  # fmt: skip
@options.control_plane_namespace(was_namespace=True)
@options.cluster
@click.option("--ha", is_flag=True,
              help="Turn high availability on (the chart's values-ha.yaml over the values given"
              " before, under --values and --set); it stays on in later upgrades.")  # fmt: skip
def upgrade(
    crds: bool,
    sets: tuple[str, ...],
    values_files: tuple[Path, ...],
    control_plane_namespace: str,
    kubeconfig: Path | None,
    context: str | None,
    ha: bool,
) -> None:
    """Print the manifests of an installed control plane at this version, for `kubectl apply`.

    \b
    meshlet upgrade --crds | kubectl apply -f -
    meshlet upgrade | kubectl apply -f -
    meshlet upgrade --set proxy.logLevel=debug | kubectl apply -f -

    The trust anchors, the issuer and the webhook's and tap controller's certificates are read
    from the cluster and kept byte for byte, so meshed pods keep trusting each other through
    the roll; the values given to `meshlet install` (or the last upgrade) are applied again,
    with --values files and --set over them.
    """
    from meshlet.cli.install import _install_gateway_api, control_plane, merge, user_values
    from meshlet.cli.installed import require

    why = "meshlet upgrade reads the installed control plane from the cluster"
    _, found = require(kubeconfig, context, control_plane_namespace, why)
    try:
        given = merge(found.user_values, user_values(values_files, sets, ha))
        if crds:
            values = merge(given, {"installGatewayAPI": _install_gateway_api(given, kubeconfig)})
            manifests = charts.render(charts.CRDS, values, control_plane_namespace)
        else:
            manifests = control_plane(
                merge(given, found.kept), given, control_plane_namespace, quiet=True
            )
    except ChartError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"meshlet upgrade: {found.version} in namespace {control_plane_namespace}; its"
               " trust anchors, issuer and webhook certificate kept", err=True)  # fmt: skip
    sys.stdout.write(stream((m.source, m.doc) for m in manifests))
