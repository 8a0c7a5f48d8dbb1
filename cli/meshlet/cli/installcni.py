"""`meshlet install-cni`: the meshlet-cni chart rendered for `kubectl apply -f -` (Linkerd's
`linkerd install-cni`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

import click

from meshlet.cli import charts, options
from meshlet.cli.charts import ChartError
from meshlet.cli.install import user_values
from meshlet.cli.manifests import stream

CNI_NAMESPACE: Final = "meshlet-cni"


@click.command("install-cni")
@options.chart_values("destCNINetDir=/etc/cni/net.d")
@click.option(
    "--cni-namespace",
    default=CNI_NAMESPACE,
    show_default=True,
    help="The namespace of the meshlet-cni DaemonSet.",
)
def install_cni(sets: tuple[str, ...], values_files: tuple[Path, ...], cni_namespace: str) -> None:
    """Print the manifests of meshlet-cni, for `kubectl apply -f -`: a DaemonSet that puts the
    plugin on every node and chains it after the node's CNI, so that meshed pods need no
    privileged init container (and Pod Security's `restricted` admits them).

    \b
    meshlet install-cni | kubectl apply -f -
    kubectl -n meshlet-cni rollout status daemonset/meshlet-cni
    meshlet install --set cniEnabled=true | kubectl apply -f -

    Its values (--set, --values) are the chart's: the node's CNI folders (destCNINetDir,
    destCNIBinDir), the ports and UID of the rules, ports and subnets to ignore, iptablesMode
    (docs/cni.md). Deleting the DaemonSet takes meshlet-cni out of every node's configuration.
    """
    try:
        manifests = charts.render(charts.CNI, user_values(values_files, sets), cni_namespace)
    except ChartError as exc:
        raise click.UsageError(str(exc)) from None
    sys.stdout.write(stream((m.source, m.doc) for m in manifests))
