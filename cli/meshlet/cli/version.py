"""`meshlet version`: the client's version and the control plane's (from meshlet-config)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import click
import yaml

from meshlet.api import wellknown as wk


@click.command()
@click.option("--client", "client_only", is_flag=True, help="Only the client's version.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--namespace", default=wk.CONTROL_PLANE_NAMESPACE, show_default=True)
def version(client_only: bool, kubeconfig: Path | None, namespace: str) -> None:
    """Print the client's and the control plane's versions."""
    click.echo(f"Client version: {importlib.metadata.version('meshlet')}")
    if client_only:
        return
    from meshlet.cli.cluster import ClusterError, api_client, read_config_map

    try:
        values = read_config_map(api_client(kubeconfig), namespace, wk.CONFIG_CONFIGMAP)
        doc = yaml.safe_load(values.get(wk.CONFIG_KEY, "")) or {}
        server = str(doc.get("version", "unknown")) if isinstance(doc, dict) else "unknown"
    except ClusterError as exc:
        server = f"unavailable ({exc.message})"
    click.echo(f"Server version: {server}")
