"""Reaching the cluster from the CLI: a `kubernetes` client from a kubeconfig, and errors a
user can act on instead of tracebacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


class ClusterError(click.ClickException):
    """The cluster could not be reached or answered with an error (exit 1)."""


def api_client(kubeconfig: Path | None, context: str | None = None) -> Any:
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig) if kubeconfig else None, context=context
        )
    except (ConfigException, OSError) as exc:
        raise ClusterError(
            f"no usable kubeconfig ({exc}); give --kubeconfig or set KUBECONFIG"
        ) from None


def read_config_map(client: Any, namespace: str, name: str) -> dict[str, str]:
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        cm = k8s.CoreV1Api(client).read_namespaced_config_map(name, namespace, _request_timeout=10)
    except ApiException as exc:
        raise ClusterError(
            f"cannot read ConfigMap {namespace}/{name}: {exc.status} {exc.reason};"
            " is meshlet installed (meshlet check)?"
        ) from None
    except (HTTPError, OSError) as exc:
        raise ClusterError(f"cannot reach the Kubernetes API: {exc}") from None
    return dict(cm.data or {})
