"""`meshlet version`: the client's version and the control plane's (from meshlet-config)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import click
import yaml

from meshlet.api import wellknown as wk
from meshlet.cli import options


@click.command()
@click.option("--client", "client_only", is_flag=True, help="Only the client's version.")
@options.cluster
@options.control_plane_namespace(was_namespace=True)
def version(
    client_only: bool, kubeconfig: Path | None, context: str | None, control_plane_namespace: str
) -> None:
    """Print the client's and the control plane's versions."""
    click.echo(f"Client version: {importlib.metadata.version('meshlet')}")
    if client_only:
        return
    from meshlet.cli.cluster import ClusterError, api_client, read_config_map

    try:
        api = api_client(kubeconfig, context)
        values = read_config_map(api, control_plane_namespace, wk.CONFIG_CONFIGMAP)
        doc = yaml.safe_load(values.get(wk.CONFIG_KEY, "")) or {}
        server = str(doc.get("version", "unknown")) if isinstance(doc, dict) else "unknown"
    except ClusterError as exc:
        server = f"unavailable ({exc.message})"
    click.echo(f"Server version: {server}")
