"""Reaching the cluster from the CLI: a `kubernetes` client from a kubeconfig, and errors a
user can act on instead of tracebacks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

TIMEOUT = 10  # seconds for one API request


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


class NotFound(ClusterError):
    """The object asked for does not exist (exit 1)."""


class Forbidden(ClusterError):
    """The kubeconfig's user may not read it (exit 1)."""


def default_namespace(kubeconfig: Path | None, context: str | None = None) -> str:
    """The namespace of the kubeconfig's context, as kubectl uses it; `default` without one."""
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        contexts, current = config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig) if kubeconfig else None
        )
    except (ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else current
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


def read_json(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A `kubernetes` client read or list as raw JSON. A missing object is `NotFound` naming
    `what`; any other failure a `ClusterError` saying what to do."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        response = call(*args, _preload_content=False, _request_timeout=TIMEOUT, **kwargs)
        return json.loads(response.data)
    except ApiException as exc:
        if exc.status == 404:
            raise NotFound(f"{what} not found") from None
        if exc.status in (401, 403):
            raise Forbidden(
                f"the Kubernetes API refused to read {what} ({exc.status} {exc.reason});"
                " check the kubeconfig's user and its RBAC permissions"
            ) from None
        raise ClusterError(f"cannot read {what}: {exc.status} {exc.reason}") from None
    except (HTTPError, OSError, ValueError) as exc:
        raise ClusterError(f"cannot reach the Kubernetes API: {exc}") from None


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
