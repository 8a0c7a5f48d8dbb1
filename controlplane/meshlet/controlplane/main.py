"""`meshlet-controller`: one entry point for the control-plane services."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.cli import (
    EX_CONFIG,
    Addr,
    Duration,
    cluster_source,
    listen_options,
    log_level_option,
    option,
    reload_interval_option,
    setup_logging,
    watching_options,
    watching_problems,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """meshlet control-plane services. Every flag can also be set as MESHLET_<FLAG>."""


@cli.command()
@listen_options(wellknown.IDENTITY_PORT, wellknown.IDENTITY_ADMIN_PORT, "gRPC (TLS)")
@option(
    "--trust-anchors",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM trust anchors (default with Kubernetes: ConfigMap meshlet-identity-trust-roots).",
)
@option(
    "--issuer-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Folder with the issuer's crt.pem and key.pem (default with Kubernetes: Secret"
    " meshlet-identity-issuer).",
)
@option(
    "--issuer-scheme",
    type=click.Choice(sorted(wellknown.ISSUER_KEYS)),
    default=wellknown.ISSUER_SCHEME_MESHLET,
    show_default=True,
    help="Which keys hold the issuer: crt.pem and key.pem, or tls.crt and tls.key"
    " (kubernetes.io/tls: a Secret cert-manager owns and renews).",
)
@option(
    "--tokens-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="YAML map token → {namespace, serviceaccount} (the local mesh); default: TokenReview.",
)
@option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reach the Kubernetes API with this kubeconfig.",
)
@option("--in-cluster", is_flag=True, help="Reach the Kubernetes API as the pod's service account.")
@option("--controller-namespace", default=wellknown.CONTROL_PLANE_NAMESPACE, show_default=True)
@option("--trust-domain", default=wellknown.TRUST_DOMAIN, show_default=True)
@reload_interval_option(5.0, "a rotated issuer")
@option(
    "--issuance-lifetime",
    type=Duration(),
    default="24h",
    show_default=True,
    help="How long the certificates it signs are valid (plus 20s of clock skew).",
)
@log_level_option()
def identity(
    addr: HostPort,
    admin_addr: HostPort,
    trust_anchors: Path | None,
    issuer_dir: Path | None,
    issuer_scheme: str,
    tokens_file: Path | None,
    kubeconfig: Path | None,
    in_cluster: bool,
    controller_namespace: str,
    trust_domain: str,
    reload_interval: float,
    issuance_lifetime: float,
    log_level: str,
) -> None:
    """Certificate authority: signs proxies' CSRs after checking their ServiceAccount token."""
    from meshlet.controlplane.identity.server import IdentityConfig, serve
    from meshlet.controlplane.k8s.client import api_client

    problems = []
    if kubeconfig is not None and in_cluster:
        problems.append("--kubeconfig and --in-cluster exclude each other")
    kube = kubeconfig is not None or in_cluster
    if issuer_dir is None and not kube:
        problems.append("--issuer-dir is required without Kubernetes access")
    if issuer_dir is not None and trust_anchors is None:
        problems.append("--issuer-dir needs --trust-anchors")
    if tokens_file is None and not kube:
        problems.append("--tokens-file is required without Kubernetes access (TokenReview)")
    if not 1 <= issuance_lifetime <= 365 * 24 * 3600:
        problems.append("--issuance-lifetime must be between 1s and 8760h")
    if problems:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    config = IdentityConfig(
        addr=addr,
        admin_addr=admin_addr,
        trust_anchors=trust_anchors,
        issuer_dir=issuer_dir,
        tokens_file=tokens_file,
        kube_api=api_client(kubeconfig, in_cluster),
        control_ns=controller_namespace,
        trust_domain=trust_domain,
        reload_interval=reload_interval,
        issuance_lifetime=dt.timedelta(seconds=issuance_lifetime),
        issuer_scheme=issuer_scheme,
    )
    _run(serve(config))


@cli.command()
@listen_options(wellknown.DESTINATION_PORT, wellknown.DESTINATION_ADMIN_PORT, "gRPC")
@watching_options("Services, EndpointSlices, Pods and ServiceProfiles")
@option("--cluster-domain", default=wellknown.CLUSTER_DOMAIN, show_default=True)
@option(
    "--stream-queue",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="Updates queued per stream before a slow stream is closed.",
)
def destination(
    addr: HostPort,
    admin_addr: HostPort,
    kubeconfig: Path | None,
    in_cluster: bool,
    manifests: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    max_streams: int,
    max_streams_per_peer: int,
    log_level: str,
    cluster_domain: str,
    stream_queue: int,
) -> None:
    """Service discovery: streams endpoint sets and profiles to proxies."""
    from prometheus_client import CollectorRegistry

    from meshlet.controlplane.destination.server import DestinationConfig, informer_lag, serve
    from meshlet.controlplane.k8s.client import api_client
    from meshlet.controlplane.k8s.events import Source

    problems = watching_problems(kubeconfig, in_cluster, manifests, tls_cert, tls_key)
    if problems:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    registry = CollectorRegistry()
    source: Source
    if manifests is not None:
        from meshlet.controlplane.k8s.manifests import ManifestsSource

        source = ManifestsSource(manifests)
    else:
        from meshlet.controlplane.k8s.informer import KubernetesSource

        lag = informer_lag(registry)
        source = KubernetesSource(
            api_client(kubeconfig, in_cluster),
            on_event=lambda kind, seconds: lag.labels(kind.kind).observe(seconds),
        )
    config = DestinationConfig(
        addr=addr,
        admin_addr=admin_addr,
        source=source,
        derive_from_pods=manifests is not None,
        tls=(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None,
        cluster_domain=cluster_domain,
        max_streams=max_streams,
        max_streams_per_peer=max_streams_per_peer,
        stream_queue=stream_queue,
    )
    _run(serve(config, registry))


@cli.command()
@listen_options(wellknown.INJECTOR_PORT, wellknown.INJECTOR_ADMIN_PORT, "The webhook's HTTPS")
@option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM certificate chain the webhook serves (Secret meshlet-proxy-injector-k8s-tls).",
)
@option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The proxy defaults: the `values` key of ConfigMap meshlet-config; default: built-in.",
)
@option(
    "--trust-anchors",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM trust anchors written into every proxy (ConfigMap meshlet-identity-trust-roots);"
    " re-read while it runs, so pods admitted after a rotation's step get the new bundle.",
)
@reload_interval_option(10.0, "a rotated webhook certificate or new trust anchors")
@option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Read namespace annotations through the Kubernetes API reached with this kubeconfig.",
)
@option(
    "--in-cluster",
    is_flag=True,
    help="Read namespace annotations as the pod's service account. Without Kubernetes access"
    " only the pods' own annotations count.",
)
@option(
    "--answer-within",
    type=click.FloatRange(min=0.1, max=29.0),
    default=8.0,
    show_default=True,
    help="Seconds before a review is answered without a patch (below the webhook's timeout).",
)
@log_level_option()
def injector(
    addr: HostPort,
    admin_addr: HostPort,
    tls_cert: Path | None,
    tls_key: Path | None,
    config_file: Path | None,
    trust_anchors: Path | None,
    reload_interval: float,
    kubeconfig: Path | None,
    in_cluster: bool,
    answer_within: float,
    log_level: str,
) -> None:
    """Proxy injector: a mutating admission webhook that adds the proxy to pods."""
    from meshlet.controlplane.injector.config import ConfigError, load
    from meshlet.controlplane.injector.server import InjectorConfig, serve, server_context
    from meshlet.controlplane.k8s.client import api_client

    problems = []
    if tls_cert is None or tls_key is None:
        problems.append("--tls-cert and --tls-key are required: the webhook serves HTTPS only")
    if trust_anchors is None:
        problems.append("--trust-anchors is required: every proxy gets them")
    if kubeconfig is not None and in_cluster:
        problems.append("--kubeconfig and --in-cluster exclude each other")
    inject = None
    if trust_anchors is not None:
        try:
            values = config_file.read_text() if config_file is not None else ""
            inject = load(values, trust_anchors.read_text())
        except ConfigError as exc:
            where = f"--config {config_file}" if config_file is not None else "--trust-anchors"
            problems.extend(f"{where}: {problem}" for problem in exc.problems)
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"cannot read the configuration: {exc}")
    if tls_cert is not None and tls_key is not None:
        try:
            server_context(tls_cert, tls_key)
        except (OSError, ssl.SSLError) as exc:
            problems.append(f"--tls-cert/--tls-key: not a usable certificate and key ({exc})")
    if problems or inject is None or tls_cert is None or tls_key is None:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    config = InjectorConfig(
        addr=addr,
        admin_addr=admin_addr,
        tls_cert=tls_cert,
        tls_key=tls_key,
        inject=inject,
        kube_api=api_client(kubeconfig, in_cluster),
        answer_within=answer_within,
        trust_anchors=trust_anchors,
        reload_interval=reload_interval,
    )
    _run(serve(config))


@cli.command()
@listen_options(wellknown.POLICY_PORT, wellknown.POLICY_ADMIN_PORT, "gRPC")
@watching_options("Namespaces, Pods and the policy resources")
@option(
    "--cluster-networks",
    default="10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8",
    show_default=True,
    help="Comma-separated CIDRs that the cluster-* default policies admit.",
)
@option(
    "--default-policy",
    default="all-unauthenticated",
    show_default=True,
    help="Policy of ports no Server selects, unless a pod or namespace annotation says"
    f" otherwise: one of {', '.join(wellknown.DEFAULT_INBOUND_POLICIES)}.",
)
@option("--control-plane-namespace", default=wellknown.CONTROL_PLANE_NAMESPACE, show_default=True)
@option("--trust-domain", default=wellknown.TRUST_DOMAIN, show_default=True)
def policy(
    addr: HostPort,
    admin_addr: HostPort,
    kubeconfig: Path | None,
    in_cluster: bool,
    manifests: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    max_streams: int,
    max_streams_per_peer: int,
    log_level: str,
    cluster_networks: str,
    default_policy: str,
    control_plane_namespace: str,
    trust_domain: str,
) -> None:
    """Inbound and outbound policy: streams each workload port's authorization policy, and each
    Service port's routes, retries, timeouts and failure accrual, to proxies."""
    from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS, Source
    from meshlet.controlplane.policy.index import ClusterConfig, parse_networks
    from meshlet.controlplane.policy.server import PolicyConfig, serve

    problems = watching_problems(kubeconfig, in_cluster, manifests, tls_cert, tls_key)
    networks: tuple[Any, ...] = ()
    try:
        networks = parse_networks(cluster_networks)
    except ValueError as exc:
        problems.append(f"--cluster-networks: {exc}")
    if default_policy not in wellknown.DEFAULT_INBOUND_POLICIES:
        problems.append(
            f"--default-policy: {default_policy!r} is not one of"
            f" {', '.join(wellknown.DEFAULT_INBOUND_POLICIES)}"
        )
    if problems:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    source: Source = cluster_source(manifests, kubeconfig, in_cluster, POLICY_SERVER_KINDS)
    status_patch = None
    if manifests is None:
        from meshlet.controlplane.k8s.client import api_client
        from meshlet.controlplane.policy.status import kubernetes_patch

        status_patch = kubernetes_patch(api_client(kubeconfig, in_cluster))
    config = PolicyConfig(
        addr=addr,
        admin_addr=admin_addr,
        source=source,
        cluster=ClusterConfig(
            networks=networks,
            default_policy=default_policy,
            control_ns=control_plane_namespace,
            trust_domain=trust_domain,
        ),
        tls=(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None,
        max_streams=max_streams,
        max_streams_per_peer=max_streams_per_peer,
        status_patch=status_patch,
    )
    _run(serve(config))


@cli.command()
@listen_options(wellknown.TAP_PORT, wellknown.TAP_ADMIN_PORT, "The tap API's HTTP")
@option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Watch pods through the Kubernetes API reached with this kubeconfig.",
)
@option("--in-cluster", is_flag=True, help="Watch pods as the pod's service account.")
@option(
    "--manifests",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Read Pods from YAML files here (the local mesh).",
)
@option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=f"PEM certificate chain the controller presents to proxies ({wellknown.TAP_NAME}'s"
    " identity).",
)
@option("--tls-key", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@option(
    "--trust-anchors",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM trust anchors that proxies' certificates are verified against.",
)
@option(
    "--max-taps",
    type=click.IntRange(min=1, max=10_000),
    default=100,
    show_default=True,
    help="Concurrent taps; one more is refused (HTTP 429).",
)
@option(
    "--max-rps",
    type=click.FloatRange(min=0.1, max=100_000, min_open=False),
    default=100.0,
    show_default=True,
    help="Requests per second one tap passes on at most (a tap may ask for fewer).",
)
@option(
    "--proxy-control-port",
    type=click.IntRange(min=1, max=65535),
    default=wellknown.PROXY_CONTROL_PORT,
    show_default=True,
    help="The port of the proxies' tap server.",
)
@option("--control-plane-namespace", default=wellknown.CONTROL_PLANE_NAMESPACE, show_default=True)
@option("--trust-domain", default=wellknown.TRUST_DOMAIN, show_default=True)
@log_level_option()
def tap(
    addr: HostPort,
    admin_addr: HostPort,
    kubeconfig: Path | None,
    in_cluster: bool,
    manifests: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    trust_anchors: Path | None,
    max_taps: int,
    max_rps: float,
    proxy_control_port: int,
    control_plane_namespace: str,
    trust_domain: str,
    log_level: str,
) -> None:
    """Tap: streams the live requests of a resource's proxies (JSON lines over HTTP)."""
    from meshlet.controlplane.k8s.events import Source
    from meshlet.controlplane.tap.server import TAP_KINDS, TapConfig, serve

    problems = watching_problems(kubeconfig, in_cluster, manifests, tls_cert, tls_key)
    if tls_cert is None:
        problems.append("--tls-cert and --tls-key are required: proxies answer only over mTLS")
    if trust_anchors is None:
        problems.append("--trust-anchors is required: every proxy's certificate is verified")
    if tls_cert is not None and tls_key is not None:
        try:
            ssl.create_default_context().load_cert_chain(tls_cert, tls_key)
        except (OSError, ssl.SSLError) as exc:
            problems.append(f"--tls-cert/--tls-key: not a usable certificate and key ({exc})")
    if problems or tls_cert is None or tls_key is None or trust_anchors is None:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    source: Source = cluster_source(manifests, kubeconfig, in_cluster, TAP_KINDS)
    config = TapConfig(
        addr=addr,
        admin_addr=admin_addr,
        source=source,
        tls=(tls_cert, tls_key),
        trust_anchors=trust_anchors,
        max_taps=max_taps,
        max_rps=max_rps,
        proxy_port=proxy_control_port,
        control_ns=control_plane_namespace,
        trust_domain=trust_domain,
    )
    _run(serve(config))


@cli.command()
@listen_options(wellknown.WEB_PORT, wellknown.WEB_ADMIN_PORT, "The dashboard's HTTP")
@option(
    "--prometheus-url",
    default="http://127.0.0.1:9090",
    show_default=True,
    help="The Prometheus that scrapes the proxies, which every page asks.",
)
@option(
    "--tap-addr",
    type=Addr(),
    default=f"127.0.0.1:{wellknown.TAP_PORT}",
    show_default=True,
    help="The tap controller's API, which the live tap view reads (the pod's loopback).",
)
@option(
    "--enforced-host",
    default=None,
    help="A regular expression the whole Host header must match, else 403 (against DNS"
    " rebinding). Default: localhost, 127.0.0.1, [::1] and the dashboard's Service names,"
    " with any port.",
)
@log_level_option()
def web(
    addr: HostPort,
    admin_addr: HostPort,
    prometheus_url: str,
    tap_addr: HostPort,
    enforced_host: str | None,
    log_level: str,
) -> None:
    """Web dashboard: namespaces, workloads, topology, routes and a live tap, read-only."""
    import re

    from meshlet.controlplane.vizmetrics import MetricsError, Prometheus
    from meshlet.controlplane.web.server import DEFAULT_ENFORCED_HOST, WebConfig, serve

    problems = []
    try:
        Prometheus(prometheus_url)
    except MetricsError as exc:
        problems.append(f"--prometheus-url: {exc}")
    pattern = DEFAULT_ENFORCED_HOST if enforced_host is None else enforced_host
    try:
        re.compile(pattern)
    except re.error as exc:
        problems.append(f"--enforced-host: not a regular expression ({exc})")
    if problems:
        raise click.UsageError("; ".join(problems))
    setup_logging(log_level)
    config = WebConfig(
        addr=addr,
        admin_addr=admin_addr,
        prometheus_url=prometheus_url,
        tap_addr=tap_addr,
        enforced_host=pattern,
    )
    _run(serve(config))


def _run(serving: Coroutine[Any, Any, int]) -> None:
    """Runs a controller to its end: exit 1 when an address is taken (one line) or when a
    background task failed for good (its log says which)."""
    from meshlet.controlplane.listen import ListenError

    try:
        code = asyncio.run(serving)
    except ListenError as exc:
        sys.stderr.write(f"meshlet-controller: {exc}\n")
        code = 1
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="meshlet-controller", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        sys.exit(EX_CONFIG)
    except click.Abort:
        sys.exit(130)


if __name__ == "__main__":
    main()
