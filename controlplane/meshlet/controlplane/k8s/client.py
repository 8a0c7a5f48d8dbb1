"""Builds a `kubernetes` ApiClient from a kubeconfig file or the in-cluster service account."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def api_client(kubeconfig: Path | None, in_cluster: bool) -> Any | None:
    """None when neither is asked for."""
    if kubeconfig is None and not in_cluster:
        return None
    from kubernetes import client, config

    if in_cluster:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
