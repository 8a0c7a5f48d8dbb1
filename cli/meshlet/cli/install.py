"""`meshlet install`: the charts rendered with a real Helm engine, certificates made when none
are given, the control plane's own pods meshed with the injector's patch."""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import click
import yaml
from cryptography.exceptions import InvalidSignature

from meshlet.api import wellknown as wk
from meshlet.cli import charts, options
from meshlet.cli.charts import ChartError, Manifest
from meshlet.cli.cluster import unreachable
from meshlet.cli.installed import external_issuer
from meshlet.cli.manifests import stream


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's coalescing for user values: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        current = out.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            out[key] = merge(current, value)
        else:
            out[key] = value
    return out


def user_values(
    values_files: tuple[Path, ...], sets: tuple[str, ...], ha: bool = False
) -> dict[str, Any]:
    """The chart's values-ha.yaml with `ha`, then --values files in order, then --set
    expressions; problems raise click.UsageError."""
    values: dict[str, Any] = charts.ha_values() if ha else {}
    problems: list[str] = []
    for path in values_files:
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            problems.append(f"--values {path}: {exc}")
            continue
        if doc is None:
            continue
        if not isinstance(doc, dict):
            problems.append(f"--values {path}: expected a mapping of values")
            continue
        values = merge(values, doc)
    for expression in sets:
        try:
            values = merge(values, charts.parse_set(expression))
        except ChartError as exc:
            problems.append(str(exc))
    if problems:
        raise click.UsageError("; ".join(problems))
    return values


def _identity_files(
    anchors: Path | None, issuer_cert: Path | None, issuer_key: Path | None, external: bool
) -> dict[str, Any]:
    given = {
        "--identity-trust-anchors-file": anchors,
        "--identity-issuer-certificate-file": issuer_cert,
        "--identity-issuer-key-file": issuer_key,
    }
    if external:
        if issuer_cert is not None or issuer_key is not None:
            raise click.UsageError("an external issuer is cert-manager's: give only"
                                   " --identity-trust-anchors-file")  # fmt: skip
        return {} if anchors is None else {"identityTrustAnchorsPEM": anchors.read_text()}
    if all(v is None for v in given.values()):
        return {}
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        raise click.UsageError("the identity files go together; missing " + ", ".join(missing))
    assert anchors is not None and issuer_cert is not None and issuer_key is not None
    return {
        "identityTrustAnchorsPEM": anchors.read_text(),
        "identity": {
            "issuer": {"tls": {"crtPEM": issuer_cert.read_text(), "keyPEM": issuer_key.read_text()}}
        },
    }


def _check_identity(values: Mapping[str, Any], now: dt.datetime) -> None:
    """The issuer must chain to the anchors and be valid now: refuse to install one that the
    identity service would refuse to load."""
    from meshlet.controlplane.identity import ca

    tls = values["identity"]["issuer"]["tls"]
    try:
        issuer = ca.load_issuer(
            str(tls["crtPEM"]).encode(),
            str(tls["keyPEM"]).encode(),
            str(values["identityTrustAnchorsPEM"]).encode(),
        )
    except ca.IssuerError as exc:
        raise click.UsageError(f"identity: {exc}") from None
    if issuer.not_after <= now:
        raise click.UsageError(
            f"identity: the issuer chain expired at {issuer.not_after.isoformat()}; create a new"
            " issuer with `meshlet identity issuer create`"
        )


def generated(
    values: Mapping[str, Any], namespace: str, now: dt.datetime, quiet: bool = False
) -> dict[str, Any]:
    """Certificates the values lack: a CA for the mesh, the webhook's own, the tap
    controller's."""
    from meshlet.controlplane.identity import ca
    from meshlet.controlplane.injector import tls

    out: dict[str, Any] = {}
    issuer = (values.get("identity") or {}).get("issuer", {}).get("tls", {})
    external = external_issuer(values)
    if not values.get("identityTrustAnchorsPEM") and not issuer.get("crtPEM") and not external:
        anchor, anchor_key = ca.create_trust_anchor(now)
        cert, key = ca.create_issuer(anchor, anchor_key, now)
        out["identityTrustAnchorsPEM"] = ca.cert_pem(anchor).decode()
        out["identity"] = {
            "issuer": {
                "tls": {"crtPEM": ca.cert_pem(cert).decode(), "keyPEM": ca.key_pem(key).decode()}
            }
        }
        if not quiet:
            click.echo(
                "meshlet install: generated a trust anchor and issuer valid until"
                f" {cert.not_valid_after_utc.date()}; the anchor's key is not kept (make your own"
                " with `meshlet identity ca create` to rotate issuers later)",
                err=True,
            )
    tap = values.get("tap") or {}
    mesh = merge(values, out)
    issuer_tls = (mesh.get("identity") or {}).get("issuer", {}).get("tls", {})
    anchors = mesh.get("identityTrustAnchorsPEM")
    have_tap = bool(tap.get("crtPEM") and tap.get("keyPEM"))
    stale = have_tap and not _issued_by(str(tap["crtPEM"]), str(issuer_tls.get("crtPEM") or ""))
    if not external and (not have_tap or stale) and issuer_tls.get("crtPEM") and anchors:
        with contextlib.suppress(ca.IssuerError, KeyError):  # _check_identity says what's wrong
            domain = str(mesh.get("identityTrustDomain") or wk.TRUST_DOMAIN)
            out["tap"] = tap_certificate(issuer_tls, str(anchors), namespace, now, domain)
            if stale:  # told whatever `quiet`: the user's Secret is replaced
                click.echo(STALE_TAP, err=True)
    injector = values.get("proxyInjector") or {}
    if not (injector.get("caBundle") and injector.get("crtPEM") and injector.get("keyPEM")):
        webhook = tls.webhook_certificate(namespace, now)
        out["proxyInjector"] = {
            "caBundle": webhook.ca_pem, "crtPEM": webhook.cert_pem, "keyPEM": webhook.key_pem
        }  # fmt: skip
    return out


STALE_TAP: Final = (
    "meshlet: the tap controller's certificate was issued by an earlier issuer; it gets a new"
    " one from the current issuer (proxies that no longer trust the old anchor refuse the old one)"
)


def _issued_by(chain_pem: str, issuer_pem: str) -> bool:
    """Whether the first certificate of `chain_pem` is signed by the first of `issuer_pem`
    (True when either cannot be read: the identity checks say what is wrong)."""
    from cryptography import x509

    try:
        leaf = x509.load_pem_x509_certificates(chain_pem.encode())[0]
        issuer = x509.load_pem_x509_certificates(issuer_pem.encode())[0]
    except (ValueError, IndexError):
        return True
    try:
        leaf.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def tap_certificate(
    issuer_tls: Mapping[str, str],
    anchors: str,
    namespace: str,
    now: dt.datetime,
    trust_domain: str = wk.TRUST_DOMAIN,
) -> dict[str, str]:
    """The tap controller's certificate and key (PEM) for its identity, from the mesh's issuer,
    valid as long as the issuer is: proxies answer a tap only for that identity."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from meshlet.controlplane.identity import ca, signer

    issuer = ca.load_issuer(
        issuer_tls["crtPEM"].encode(), issuer_tls["keyPEM"].encode(), anchors.encode()
    )
    key = ca.new_key()
    name = wk.identity_name(wk.TAP_NAME, namespace, namespace, trust_domain)
    leaf = signer.issue_leaf(issuer, key.public_key(), name, now, issuer.not_after - now)
    pem = x509.load_der_x509_certificate(leaf.der).public_bytes(serialization.Encoding.PEM)
    chain = pem + ca.cert_pem(*issuer.chain)
    return {"crtPEM": chain.decode(), "keyPEM": ca.key_pem(key).decode()}


def mesh_control_plane(manifests: list[Manifest], namespace: str) -> list[Manifest]:
    """The control plane's pods meshed with the injector's patch, configured from the
    meshlet-config ConfigMap rendered beside them (the webhook cannot inject its own)."""
    from meshlet.cli.injecting import manual
    from meshlet.controlplane.injector.config import ConfigError, load

    def data(name: str) -> Mapping[str, str]:
        doc = next(m.doc for m in manifests if m.doc["kind"] == "ConfigMap" and
                   m.doc["metadata"]["name"] == name)  # fmt: skip
        return doc["data"]  # type: ignore[no-any-return]

    try:
        config = load(data(wk.CONFIG_CONFIGMAP)[wk.CONFIG_KEY],
                      data(wk.TRUST_ROOTS_CONFIGMAP)[wk.TRUST_ROOTS_KEY])  # fmt: skip
    except ConfigError as exc:
        raise click.UsageError("; ".join(exc.problems)) from None
    out = []
    for m in manifests:
        template = (
            m.doc.get("spec", {}).get("template", {}) if m.doc["kind"] == "Deployment" else {}
        )
        annotations = template.get("metadata", {}).get("annotations", {})
        if (
            m.doc["metadata"].get("namespace") == namespace
            and annotations.get(wk.INJECT_ANNOTATION) == wk.INJECT_ENABLED
        ):
            m = Manifest(m.source, manual(m.doc, config).doc)
        out.append(m)
    return out


GATEWAY_CRDS: Final = (
    "httproutes.gateway.networking.k8s.io",
    "grpcroutes.gateway.networking.k8s.io",
)


class GatewayAPI(enum.Enum):
    """Who provides the Gateway API's route CRDs in a cluster (Linkerd's GatewayAPICRDs)."""

    ABSENT = "absent"
    MESHLET = "meshlet"  # installed by meshlet install --crds (labelled part-of: meshlet)
    EXTERNAL = "external"


def gateway_api(crds: Sequence[Mapping[str, Any] | None]) -> GatewayAPI:
    """The state of the cluster from its route CRDs as read (None: not found)."""
    found = [c for c in crds if c is not None]
    if not found:
        return GatewayAPI.ABSENT
    ours = all(
        ((c.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/part-of")
        == "meshlet"
        for c in found
    )
    return GatewayAPI.MESHLET if ours else GatewayAPI.EXTERNAL


def _read_gateway_crds(kubeconfig: Path | None) -> list[Mapping[str, Any] | None]:
    """The route CRDs (None where absent); ClusterError when the cluster cannot be read."""
    from kubernetes import client
    from urllib3.exceptions import HTTPError

    from meshlet.cli.cluster import ClusterError, api_client

    api = client.ApiextensionsV1Api(api_client(kubeconfig))
    out: list[Mapping[str, Any] | None] = []
    for name in GATEWAY_CRDS:
        try:
            response: Any = api.read_custom_resource_definition(
                name, _preload_content=False, _request_timeout=10
            )
            out.append(json.loads(response.data))
        except client.ApiException as exc:
            if exc.status != 404:
                raise ClusterError(f"reading CRD {name}: {exc.status} {exc.reason}") from None
            out.append(None)
        except (HTTPError, OSError, ValueError) as exc:
            raise ClusterError(unreachable(exc)) from None
    return out


def _install_gateway_api(values: Mapping[str, Any], kubeconfig: Path | None) -> bool:
    """installGatewayAPI as Linkerd's CLI decides it: the user's value when given (refused over
    CRDs someone else installed), else whether the cluster lacks them or has meshlet's."""
    from meshlet.cli.cluster import ClusterError

    given = values.get("installGatewayAPI")
    if given is not None and not isinstance(given, bool):
        raise ChartError(f"installGatewayAPI: {given!r} is not true or false")
    try:
        state = gateway_api(_read_gateway_crds(kubeconfig))
    except ClusterError as exc:
        if given is None:
            click.echo(
                f"note: cannot tell whether the cluster has the Gateway API CRDs ({exc}); they"
                " are left out: add --set installGatewayAPI=true if it lacks them",
                err=True,
            )
        return bool(given)
    if given and state is GatewayAPI.EXTERNAL:
        raise ChartError(
            "the cluster has Gateway API CRDs that meshlet did not install; installing meshlet's"
            " would replace them: use --set installGatewayAPI=false"
        )
    if given is False and state is GatewayAPI.ABSENT:
        click.echo(
            "note: the cluster lacks the Gateway API CRDs, and the policy controller watches"
            " their routes: install them (a Gateway API release, or leave installGatewayAPI"
            " unset) before the control plane",
            err=True,
        )
    return state is not GatewayAPI.EXTERNAL if given is None else given


@click.command()
@click.option("--crds", is_flag=True, help="Render the CustomResourceDefinitions (first step).")
@options.chart_values("proxy.logLevel=debug")
@click.option(
    "--identity-trust-anchors-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM trust anchors (e.g. trust-anchors.pem from `meshlet identity ca create`).",
)
@click.option(
    "--identity-issuer-certificate-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM issuer certificate signed by the anchors (issuer/crt.pem).",
)
@click.option(
    "--identity-issuer-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM issuer key (issuer/key.pem).",
)
@click.option(
    "--identity-external-issuer",
    is_flag=True,
    help="The issuer is cert-manager's (identity.issuer.scheme=kubernetes.io/tls): Secrets"
    " meshlet-identity-issuer and meshlet-tap-k8s-tls come from Certificates you apply; give"
    " the anchors they chain to with --identity-trust-anchors-file (docs/identity.md).",
)
@options.control_plane_namespace(was_namespace=True)
@options.cluster
@click.option(
    "--ha",
    is_flag=True,
    help="High availability (the chart's values-ha.yaml, under --values and --set): 3 replicas"
    " of each controller on distinct nodes, a PodDisruptionBudget each, and a webhook that"
    " refuses pods while no injector answers.",
)
@click.option(
    "--ignore-cluster",
    is_flag=True,
    help="Render without asking the cluster whether meshlet is installed already.",
)
def install(
    crds: bool,
    sets: tuple[str, ...],
    values_files: tuple[Path, ...],
    identity_trust_anchors_file: Path | None,
    identity_issuer_certificate_file: Path | None,
    identity_issuer_key_file: Path | None,
    identity_external_issuer: bool,
    control_plane_namespace: str,
    kubeconfig: Path | None,
    context: str | None,
    ha: bool,
    ignore_cluster: bool,
) -> None:
    """Print the manifests of meshlet's control plane, for `kubectl apply -f -`.

    \b
    meshlet install --crds | kubectl apply -f -
    meshlet install | kubectl apply -f -
    meshlet check

    Without identity files or values, a trust anchor and an issuer are generated. With --crds,
    the Gateway API's HTTPRoute and GRPCRoute CRDs are included when the cluster lacks them
    (or has the ones meshlet installed), unless installGatewayAPI is set.

    Where meshlet is installed already, the control plane is refused (exit 1): `meshlet
    upgrade` keeps its trust anchor and issuer. Without any kubeconfig nothing is asked.
    """
    try:
        if crds:
            values = user_values(values_files, sets)
            values = merge(values, {"installGatewayAPI": _install_gateway_api(values, kubeconfig)})
            manifests = charts.render(charts.CRDS, values, control_plane_namespace)
        else:
            given = user_values(values_files, sets, ha)
            if identity_external_issuer:
                scheme = {"identity": {"issuer": {"scheme": wk.ISSUER_SCHEME_KUBERNETES}}}
                given = merge(given, scheme)
            if not ignore_cluster:
                _refuse_reinstall(kubeconfig, context, control_plane_namespace)
            values = merge(
                given,
                _identity_files(
                    identity_trust_anchors_file,
                    identity_issuer_certificate_file,
                    identity_issuer_key_file,
                    external_issuer(given),
                ),
            )
            if external_issuer(values) and not values.get("identityTrustAnchorsPEM"):
                raise click.UsageError("an external issuer chains to trust anchors of yours:"
                                       " give --identity-trust-anchors-file")  # fmt: skip
            manifests = control_plane(values, given, control_plane_namespace)
    except ChartError as exc:
        raise click.UsageError(str(exc)) from None
    sys.stdout.write(stream((m.source, m.doc) for m in manifests))


def _refuse_reinstall(kubeconfig: Path | None, context: str | None, namespace: str) -> None:
    from meshlet.cli.cluster import ClusterError
    from meshlet.cli.installed import configured_client, refuse_reinstall

    api = configured_client(kubeconfig, context)
    if api is None:
        click.echo("meshlet install: no kubeconfig, so no cluster was asked whether meshlet is"
                   " installed already", err=True)  # fmt: skip
        return
    try:
        refuse_reinstall(api, namespace)
    except ClusterError as exc:
        if "installed in namespace" in str(exc):
            raise
        raise ClusterError(f"{exc.message}; --ignore-cluster renders without asking") from None


# Values that are certificates or keys: never written into meshlet-config's install-values (a
# ConfigMap anyone with read access to the namespace may read); upgrade reads them from their
# own Secrets and ConfigMaps.
SECRET_VALUES: Final = (
    ("identityTrustAnchorsPEM",),
    ("identity", "issuer", "tls"),
    ("proxyInjector", "caBundle"), ("proxyInjector", "crtPEM"), ("proxyInjector", "keyPEM"),
    ("tap", "crtPEM"), ("tap", "keyPEM"),
)  # fmt: skip


def without_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` less SECRET_VALUES (and the sections left empty by their removal)."""
    out: dict[str, Any] = json.loads(json.dumps(dict(values)))  # a deep copy of plain data
    for path in SECRET_VALUES:
        parents = [out]
        for key in path[:-1]:
            child = parents[-1].get(key)
            if not isinstance(child, dict):
                break
            parents.append(child)
        else:
            parents[-1].pop(path[-1], None)
            for parent, key in zip(reversed(parents[:-1]), reversed(path[:-1]), strict=True):
                if parent.get(key) == {}:
                    del parent[key]
    return out


def control_plane(
    values: Mapping[str, Any], given: Mapping[str, Any], namespace: str, quiet: bool = False
) -> list[Manifest]:
    """The control plane's manifests from `values`: certificates the values lack generated, the
    issuer checked, the control plane's pods meshed; `given` (the user's own values) kept in
    meshlet-config for `meshlet upgrade`."""
    now = dt.datetime.now(dt.UTC)
    public = without_secrets(given)
    kept = yaml.safe_dump(public, sort_keys=True) if public else ""
    values = merge(values, {"installValues": kept})
    values = merge(values, generated(values, namespace, now, quiet=quiet))
    if external_issuer(values):
        if not quiet:
            click.echo(f"meshlet install: the issuer is cert-manager's: apply the Certificates"
                       f" that make Secrets {namespace}/{wk.ISSUER_SECRET} and"
                       f" {namespace}/{wk.TAP_TLS_SECRET} (docs/identity.md)",
                       err=True)  # fmt: skip
    else:
        _check_identity(values, now)
    manifests = charts.render(charts.CONTROL_PLANE, values, namespace)
    return mesh_control_plane(manifests, namespace)
