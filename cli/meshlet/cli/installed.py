"""What an installed control plane keeps in the cluster and an upgrade must keep too: the values
its user gave (`meshlet-config`'s `install-values`), the trust anchors, the issuer, the webhook's
and the tap controller's certificates. Read by `meshlet upgrade`; `meshlet install` asks only
whether there is one."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from meshlet.api import wellknown as wk
from meshlet.cli.cluster import ClusterError, NotFound, api_client, read_json

CONFIG: Final = "meshlet-config"
INSTALL_VALUES: Final = "install-values"  # the key of CONFIG holding the user's values
TRUST_ROOTS: Final = "meshlet-identity-trust-roots"
ISSUER: Final = "meshlet-identity-issuer"
INJECTOR_TLS: Final = "meshlet-proxy-injector-k8s-tls"
INJECTOR_WEBHOOK: Final = "meshlet-proxy-injector-webhook-config"
TAP_TLS: Final = wk.TAP_TLS_SECRET


def external_issuer(values: Mapping[str, Any]) -> bool:
    """Whether the issuer is cert-manager's (identity.issuer.scheme kubernetes.io/tls): then
    meshlet makes and checks no issuer and no tap certificate."""
    issuer = (values.get("identity") or {}).get("issuer") or {}
    return bool(issuer.get("scheme") == wk.ISSUER_SCHEME_KUBERNETES)


@dataclass(frozen=True, slots=True)
class Installed:
    namespace: str
    version: str
    user_values: dict[str, Any]  # as the user gave them (files, then --set), nothing generated
    kept: dict[str, Any]  # chart values of the certificates and keys in the cluster


def configured_client(kubeconfig: Path | None, context: str | None) -> Any | None:
    """A client of the kubeconfig's cluster; None when no cluster is named at all (no
    --kubeconfig or --context, no `$KUBECONFIG`, no ~/.kube/config), as `localmesh` decides."""
    from meshlet.cli.localmesh import cluster_named

    if not cluster_named(kubeconfig, context):
        return None
    return api_client(kubeconfig, context)


def find(api: Any, namespace: str) -> dict[str, str] | None:
    """The control plane's `meshlet-config` data in `namespace`; None when there is none."""
    from kubernetes import client as k8s

    try:
        core = k8s.CoreV1Api(api)
        found = read_json(f"ConfigMap {namespace}/{CONFIG}", core.read_namespaced_config_map,
                          CONFIG, namespace)  # fmt: skip
    except NotFound:
        return None
    return {str(k): str(v) for k, v in (found.get("data") or {}).items()}


def read(api: Any, namespace: str) -> Installed | None:
    """What the control plane in `namespace` keeps; None when meshlet is not installed there."""
    from kubernetes import client as k8s

    config = find(api, namespace)
    if config is None:
        return None
    core = k8s.CoreV1Api(api)
    admission = k8s.AdmissionregistrationV1Api(api)

    def secret(name: str) -> dict[str, str]:
        data = read_json(f"Secret {namespace}/{name}", core.read_namespaced_secret, name,
                         namespace).get("data") or {}  # fmt: skip
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    roots = read_json(f"ConfigMap {namespace}/{TRUST_ROOTS}", core.read_namespaced_config_map,
                      TRUST_ROOTS, namespace).get("data") or {}  # fmt: skip
    webhook = read_json(f"MutatingWebhookConfiguration {INJECTOR_WEBHOOK}",
                        admission.read_mutating_webhook_configuration,
                        INJECTOR_WEBHOOK)  # fmt: skip
    bundles = [w.get("clientConfig", {}).get("caBundle") for w in webhook.get("webhooks") or []]
    try:
        user = yaml.safe_load(config.get(INSTALL_VALUES) or "{}") or {}
        version = str((yaml.safe_load(config.get("values") or "{}") or {}).get("version", "?"))
    except yaml.YAMLError as exc:
        raise ClusterError(f"ConfigMap {namespace}/{CONFIG} does not parse: {exc}") from None
    user = dict(user) if isinstance(user, dict) else {}
    external = external_issuer(user)  # cert-manager's issuer and tap Secrets: not kept
    injector = secret(INJECTOR_TLS)
    issuer, tap = ({}, {}) if external else (secret(ISSUER), secret(TAP_TLS))
    missing = [name for name, have in (
        (f"{TRUST_ROOTS} ca-bundle.crt", roots.get("ca-bundle.crt")),
        *(() if external else ((f"{ISSUER} crt.pem", issuer.get("crt.pem")),
                               (f"{ISSUER} key.pem", issuer.get("key.pem")))),
        (f"{INJECTOR_TLS} tls.crt", injector.get("tls.crt")),
        (f"{INJECTOR_WEBHOOK} caBundle", bundles and bundles[0]),
    ) if not have]  # fmt: skip
    if missing:
        raise ClusterError(f"the control plane in {namespace} lacks {', '.join(missing)}")
    kept: dict[str, Any] = {
        "identityTrustAnchorsPEM": roots["ca-bundle.crt"],
        "proxyInjector": {"caBundle": base64.b64decode(str(bundles[0])).decode(),
                          "crtPEM": injector["tls.crt"], "keyPEM": injector["tls.key"]},
    }  # fmt: skip
    if not external:
        kept["identity"] = {"issuer": {"tls": {"crtPEM": issuer["crt.pem"],
                                               "keyPEM": issuer["key.pem"]}}}  # fmt: skip
        if tap.get("tls.crt") and tap.get("tls.key"):
            kept["tap"] = {"crtPEM": tap["tls.crt"], "keyPEM": tap["tls.key"]}
    return Installed(namespace, version, user, kept)


def require(
    kubeconfig: Path | None, context: str | None, namespace: str, why: str
) -> tuple[Any, Installed]:
    """The cluster's client and the control plane installed in `namespace`; a ClusterError
    saying `why` the verb needs a cluster when none is named, and how to install when meshlet
    is not installed there."""
    api = configured_client(kubeconfig, context)
    if api is None:
        raise ClusterError(f"{why}: give --kubeconfig or set KUBECONFIG")
    found = read(api, namespace)
    if found is None:
        raise ClusterError(f"meshlet is not installed in namespace {namespace}: meshlet install"
                           " | kubectl apply -f - installs it")  # fmt: skip
    return api, found


def refuse_reinstall(api: Any, namespace: str) -> None:
    """ClusterError when meshlet is installed in `namespace` already."""
    config = find(api, namespace)
    if config is None:
        return
    try:
        version = (yaml.safe_load(config.get("values") or "{}") or {}).get("version", "?")
    except yaml.YAMLError:
        version = "?"
    raise ClusterError(
        f"meshlet {version} is installed in namespace {namespace} already: `meshlet upgrade |"
        " kubectl apply -f -` keeps its trust anchor and issuer (a new install would replace"
        " them and cut every meshed pod off from the others); --ignore-cluster renders anyway"
    )
