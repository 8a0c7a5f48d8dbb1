"""`meshlet prune`: the objects of an installed control plane that its current manifests no
longer have (what an upgrade left behind: a component renamed or removed, --ha turned off), as
references for `kubectl delete -f -`, as Linkerd's `linkerd prune`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Final

import click

from meshlet.cli import options
from meshlet.cli.manifests import stream

PART_OF: Final = "app.kubernetes.io/part-of=meshlet"

# (apiVersion, kind, the kubernetes client's API class, its list method, namespaced): every kind
# the control-plane chart renders but its Namespace (CRDs are the other chart's, and kept).
KINDS: Final = (
    ("v1", "ConfigMap", "CoreV1Api", "list_namespaced_config_map", True),
    ("v1", "Secret", "CoreV1Api", "list_namespaced_secret", True),
    ("v1", "Service", "CoreV1Api", "list_namespaced_service", True),
    ("v1", "ServiceAccount", "CoreV1Api", "list_namespaced_service_account", True),
    ("apps/v1", "Deployment", "AppsV1Api", "list_namespaced_deployment", True),
    ("apps/v1", "DaemonSet", "AppsV1Api", "list_namespaced_daemon_set", True),
    ("policy/v1", "PodDisruptionBudget", "PolicyV1Api", "list_namespaced_pod_disruption_budget",
     True),
    ("rbac.authorization.k8s.io/v1", "Role", "RbacAuthorizationV1Api", "list_namespaced_role",
     True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "RbacAuthorizationV1Api",
     "list_namespaced_role_binding", True),
    ("rbac.authorization.k8s.io/v1", "ClusterRole", "RbacAuthorizationV1Api",
     "list_cluster_role", False),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "RbacAuthorizationV1Api",
     "list_cluster_role_binding", False),
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration",
     "AdmissionregistrationV1Api", "list_mutating_webhook_configuration", False),
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration",
     "AdmissionregistrationV1Api", "list_validating_webhook_configuration", False),
)  # fmt: skip


def reference(api_version: str, kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    """An object's reference as `kubectl delete -f -` reads it."""
    out = {"name": meta["name"]}
    if meta.get("namespace"):
        out["namespace"] = meta["namespace"]
    return {"apiVersion": api_version, "kind": kind, "metadata": out}


@click.command()
@options.control_plane_namespace()
@options.cluster
def prune(control_plane_namespace: str, kubeconfig: Path | None, context: str | None) -> None:
    """Print references to the installed control plane's objects that `meshlet upgrade` would
    no longer render (labelled app.kubernetes.io/part-of=meshlet and
    meshlet.io/control-plane-ns), for `kubectl delete -f -`.

    \b
    meshlet upgrade | kubectl apply -f -
    meshlet prune | kubectl delete -f -

    The CRDs, the namespace and Secrets that cert-manager owns (they are not labelled) are
    never listed.
    """
    from kubernetes import client as k8s

    from meshlet.api import wellknown as wk
    from meshlet.cli.charts import ChartError
    from meshlet.cli.cluster import NotFound, read_json
    from meshlet.cli.install import control_plane, merge
    from meshlet.cli.installed import require

    ns = control_plane_namespace
    why = "meshlet prune compares the cluster with the current manifests"
    api, found = require(kubeconfig, context, ns, why)
    try:
        rendered = control_plane(merge(found.user_values, found.kept), found.user_values, ns,
                                 quiet=True)  # fmt: skip
    except ChartError as exc:
        raise click.UsageError(str(exc)) from None
    wanted = {(m.doc["kind"], m.doc["metadata"].get("namespace", ""), m.doc["metadata"]["name"])
              for m in rendered}  # fmt: skip
    selector = f"{PART_OF},{wk.CONTROL_PLANE_NS_LABEL}={ns}"
    extra = []
    for api_version, kind, api_class, method, namespaced in KINDS:
        call = getattr(getattr(k8s, api_class)(api), method)
        args = (ns,) if namespaced else ()
        try:
            listing = read_json(f"{kind} objects", call, *args, label_selector=selector)
        except NotFound:  # an API the cluster does not serve
            continue
        for item in listing.get("items") or []:
            meta = item.get("metadata") or {}
            if (kind, meta.get("namespace", "") if namespaced else "", meta.get("name")) in wanted:
                continue
            extra.append((f"{kind} not rendered by meshlet {found.version}",
                          reference(api_version, kind, meta)))  # fmt: skip
    click.echo(f"meshlet prune: {len(extra)} object(s) of namespace {ns}'s control plane are no"
               " longer in its manifests", err=True)  # fmt: skip
    sys.stdout.write(stream(extra))
