"""Reaching the cluster from the CLI: a `kubernetes` client from a kubeconfig, and errors a
user can act on instead of tracebacks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import click

TIMEOUT = 10  # seconds for one API request


class ClusterError(click.ClickException):
    """The cluster could not be reached or answered with an error (exit 1)."""


def api_client(kubeconfig: Path | None, context: str | None = None) -> Any:
    """A client of the kubeconfig's cluster; a missing kubeconfig, a context it lacks or one
    that does not load is a ClusterError that says which and what to do."""
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    if kubeconfig is not None and not kubeconfig.is_file():
        raise ClusterError(f"kubeconfig {kubeconfig} not found: give --kubeconfig FILE or set"
                           " KUBECONFIG to a cluster's kubeconfig")  # fmt: skip
    env = os.environ.get("KUBECONFIG", "")
    if kubeconfig is None and not env and not Path("~/.kube/config").expanduser().exists():
        raise ClusterError("no kubeconfig: give --kubeconfig FILE or set KUBECONFIG (there is"
                           " no ~/.kube/config)")  # fmt: skip
    file = str(kubeconfig) if kubeconfig else None  # None: $KUBECONFIG's files merged, as kubectl
    where = file or env or "~/.kube/config"
    try:
        contexts, current = config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=file
        )
    except (ConfigException, OSError, ValueError) as exc:
        names = _context_names(file)
        if not context and names is not None:  # the library's words for "no current context"
            raise ClusterError(f"{where} has no current context: give --context (one of:"
                               f" {', '.join(names) or 'none'})") from None  # fmt: skip
        raise ClusterError(f"kubeconfig {where} cannot be read: {exc}") from None
    names = [str(c.get("name")) for c in contexts or []]
    if context and context not in names:
        raise ClusterError(f"context {context!r} is not in {where}; its contexts:"
                           f" {', '.join(names) or 'none'}")  # fmt: skip
    if not context and not current:
        raise ClusterError(f"{where} has no current context: give --context (one of:"
                           f" {', '.join(names) or 'none'})")  # fmt: skip
    try:
        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=file, context=context
        )
    except (ConfigException, OSError, ValueError) as exc:
        chosen = context or (current or {}).get("name")
        raise ClusterError(f"context {chosen!r} of {where} does not load: {exc}") from None


def _context_names(file: str | None) -> list[str] | None:
    """The context names of a kubeconfig that parses as YAML but names no current context;
    None otherwise (or when several files are merged: the library's error is kept)."""
    import yaml

    if file is None:
        return None
    try:
        doc = yaml.safe_load(Path(file).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict) or doc.get("current-context"):
        return None
    return [str(c.get("name")) for c in doc.get("contexts") or [] if isinstance(c, dict)]


UNREACHABLE_HINT: Final = (
    "is the cluster running, and the kubeconfig's server right? (kubectl cluster-info)"
)


def unreachable(exc: BaseException) -> str:
    """The API server did not answer: why, in a few words (urllib3's retry error says what
    failed last, after a long preamble), and what to try."""
    reason = getattr(exc, "reason", None)
    text = re.sub(r"<[^>]*>: ", "", str(reason if reason is not None else exc))
    return f"cannot reach the Kubernetes API ({text}); {UNREACHABLE_HINT}"


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
        raise ClusterError(unreachable(exc)) from None


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
        raise ClusterError(unreachable(exc)) from None
    return dict(cm.data or {})
