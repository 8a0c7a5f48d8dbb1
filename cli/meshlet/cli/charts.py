"""The Helm charts meshlet ships, rendered offline by a real Helm engine (helm-python-sdk).

The charts are the only source of meshlet's manifests; this module renders them and orders
the documents as Helm installs them, so that `kubectl apply -f -` creates a Namespace before
what lives in it.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

CRDS: Final = "meshlet-crds"
CONTROL_PLANE: Final = "meshlet-control-plane"
CNI: Final = "meshlet-cni"
RELEASE: Final = "meshlet"
KUBE_VERSION: Final = "v1.33.0"

# Helm's install order by kind; other kinds go last.
INSTALL_ORDER: Final = (
    "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodDisruptionBudget",
    "ServiceAccount", "Secret", "ConfigMap", "StorageClass", "PersistentVolume",
    "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
    "Role", "RoleBinding", "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet",
    "Deployment", "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass",
    "Ingress", "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
)  # fmt: skip


class ChartError(Exception):
    """The chart could not be rendered; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Manifest:
    source: str  # the template it came from, e.g. meshlet-control-plane/templates/identity.yaml
    doc: dict[str, Any]


def chart_dir(name: str) -> Path:
    """Installed: shipped inside the package; from a checkout: the repository's charts/."""
    shipped = Path(str(importlib.resources.files("meshlet.cli"))) / "chart_files" / name
    if shipped.is_dir():
        return shipped
    checkout = Path(__file__).resolve().parents[3] / "charts" / name
    if checkout.is_dir():
        return checkout
    raise ChartError(f"chart {name} not found (looked in {shipped} and {checkout})")


def ha_values() -> dict[str, Any]:
    """The control-plane chart's values-ha.yaml: what `--ha` sets."""
    path = chart_dir(CONTROL_PLANE) / "values-ha.yaml"
    try:
        values = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ChartError(f"{path}: {exc}") from None
    if not isinstance(values, dict):
        raise ChartError(f"{path}: expected a mapping of values")
    return values


def _helm() -> Any:
    try:
        import helm_python
    except ImportError:
        raise ChartError(
            "rendering the charts needs the Helm engine of the cli extra:"
            " pip install 'meshlet[cli]'"
        ) from None
    return helm_python


def _order(manifest: Manifest) -> tuple[int, str, str]:
    kind = str(manifest.doc.get("kind"))
    rank = INSTALL_ORDER.index(kind) if kind in INSTALL_ORDER else len(INSTALL_ORDER)
    return rank, manifest.source, str((manifest.doc.get("metadata") or {}).get("name"))


def render(name: str, values: Mapping[str, Any], namespace: str) -> list[Manifest]:
    """Every document the chart renders with `values`, in Helm's install order."""
    helm = _helm()
    try:
        with helm.Chart.load(str(chart_dir(name))) as chart:
            rendered: dict[str, str] = chart.render(
                values=dict(values), name=RELEASE, namespace=namespace, is_install=True
            )
    except helm.HelmError as exc:
        raise ChartError(str(exc).strip()) from None
    manifests = [
        Manifest(source, doc)
        for source, text in sorted(rendered.items())
        if source.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return sorted(manifests, key=_order)


def lint(name: str, values: Mapping[str, Any], namespace: str) -> list[str]:
    """`helm lint --strict` findings of warning or error severity."""
    helm = _helm()
    report = helm.lint(
        str(chart_dir(name)), dict(values), strict=True, namespace=namespace,
        kube_version=KUBE_VERSION,
    )  # fmt: skip
    found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return found + [str(e) for e in report.get("errors") or ()]


def parse_set(expression: str) -> dict[str, Any]:
    """A Helm `--set` expression (`a.b=1,c={x,y}`), parsed by Helm itself."""
    helm = _helm()
    try:
        parsed: dict[str, Any] = helm.parse_set_string(expression)
    except helm.HelmError as exc:
        raise ChartError(f"--set {expression!r}: {exc}") from None
    return parsed
