"""`meshlet authz`: the authorization policy in force on each port of a workload, as the policy
controller computes it, from the cluster's objects read through the API server.

The computation is the controller's own (`meshlet.controlplane.policy.index`), fed with the
same objects, so the table shows what the controller sends the workload's proxies: per port,
the Server that selects it (or the default policy that applies), each route, and each
authorization with the clients it admits. The pods of a Deployment share their labels and
annotations, so its first live pod stands for it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from meshlet.api import inbound_pb2, meta_pb2, net_pb2
from meshlet.cli import localmesh, options
from meshlet.cli.localmesh import NAMESPACE_HELP

ALL = ("0.0.0.0/0", "::/0")


@dataclass(frozen=True, slots=True)
class Row:
    port: int
    server: str  # `Server/NAME`, or `default:POLICY`
    route: str  # `HTTPRoute/NAME`, `default`, or `-` (an opaque port has no routes)
    authorization: str  # `AuthorizationPolicy/NAME`, `default:POLICY`, or `-` (none: denied)
    clients: str  # who the authorization admits


# -- what a Server message says (pure) -----------------------------------------------------


def _ref(metadata: meta_pb2.Metadata, labels: Mapping[str, str]) -> str:
    which = metadata.WhichOneof("kind")
    if which == "resource":
        return f"{metadata.resource.kind}/{metadata.resource.name}"
    if which == "default":
        return f"default:{metadata.default}"
    kind, name = labels.get("kind", ""), labels.get("name", "")
    return f"default:{name}" if kind == "default" else f"{kind}/{name}" if name else "-"


def _network(network: net_pb2.IPNetwork) -> str:
    from meshlet.api.addr import ip_from_proto

    return f"{ip_from_proto(network.ip)}/{network.prefix_len}"


def clients(authz: inbound_pb2.Authz) -> str:
    """Who `authz` admits, in words: the authentication, then the networks unless all."""
    authn = authz.authentication
    if authn.WhichOneof("permit") == "unauthenticated":
        who = "any client"
    elif authn.meshTLS.WhichOneof("clients") == "identities":
        ids = authn.meshTLS.identities
        names = [i.name for i in ids.identities]
        names += ["*" if not s.parts else "*." + ".".join(s.parts) for s in ids.suffixes]
        who = "mTLS from " + ", ".join(names) if names else "no identity"
    else:
        who = "any mTLS client"
    nets = []
    for network in authz.networks:
        text = _network(network.net)
        excepts = [_network(e) for e in getattr(network, "except")]
        nets.append(text + (f" except {', '.join(excepts)}" if excepts else ""))
    if not nets:
        return who + " (no network: ignored)"
    if sorted(nets) == sorted(ALL) or nets == ["0.0.0.0/0"]:
        return who
    return f"{who} in {'; '.join(nets)}"


def rows(port: int, server: inbound_pb2.Server) -> list[Row]:
    """The table rows of one port's policy: a row per (route, authorization); a route's
    requests are allowed by its own authorizations and by the Server's, as proxies decide."""
    name = _ref(meta_pb2.Metadata(), server.labels)
    protocol = server.protocol
    kind = protocol.WhichOneof("kind")
    routes: Sequence[Any] = ()
    if kind == "detect":
        routes = protocol.detect.http_routes
    elif kind in ("http1", "http2", "grpc"):
        routes = getattr(protocol, kind).routes
    out: list[Row] = []
    if not routes:
        for authz in server.authorizations:
            out.append(Row(port, name, "-", _ref(authz.metadata, authz.labels), clients(authz)))
        if not server.authorizations:
            out.append(Row(port, name, "-", "-", "none: every connection is refused"))
        return out
    for route in routes:
        # a request of the route is allowed by the route's authorizations or the Server's
        route_name = _ref(route.metadata, {})
        every = [*route.authorizations, *server.authorizations]
        for authz in every:
            out.append(
                Row(port, name, route_name, _ref(authz.metadata, authz.labels), clients(authz))
            )
        if not every:
            out.append(Row(port, name, route_name, "-", "none: every request is refused"))
    return out


def render(table: Sequence[Row]) -> str:
    from meshlet.cli import tables

    header = ["PORT", "SERVER", "ROUTE", "AUTHORIZATION", "CLIENTS"]
    cells = [[str(r.port), r.server, r.route, r.authorization, r.clients] for r in table]
    return tables.render(header, cells, left=set(header[1:]))


# -- reading the cluster --------------------------------------------------------------------


def _items(listed: Mapping[str, Any], api_version: str, kind: str) -> tuple[dict[str, Any], ...]:
    """A list's items with their apiVersion and kind (a list's items may omit them)."""
    out = []
    for item in listed.get("items") or []:
        if isinstance(item, dict):
            out.append({"apiVersion": api_version, "kind": kind, **item})
    return tuple(out)


def _name(obj: Mapping[str, Any]) -> object:
    meta = obj.get("metadata")
    return meta.get("name") if isinstance(meta, dict) else None


def _cluster(api: Any, control_ns: str) -> Any:
    """The installation's default policy and cluster networks (meshlet-config), else Linkerd's
    defaults."""
    import yaml

    from meshlet.api import wellknown as wk
    from meshlet.cli.cluster import ClusterError, read_config_map
    from meshlet.controlplane.policy.index import (
        LINKERD_CLUSTER_NETWORKS,
        ClusterConfig,
        parse_networks,
    )

    try:
        text = read_config_map(api, control_ns, wk.CONFIG_CONFIGMAP).get(wk.CONFIG_KEY, "")
        values = yaml.safe_load(text) or {}
    except (ClusterError, yaml.YAMLError):
        values = {}
    values = values if isinstance(values, dict) else {}
    proxy = values.get("proxy")
    proxy = proxy if isinstance(proxy, dict) else {}
    policy = str(proxy.get("defaultInboundPolicy") or "all-unauthenticated")
    if policy not in wk.DEFAULT_INBOUND_POLICIES:
        policy = "all-unauthenticated"
    networks = values.get("clusterNetworks")
    try:
        parsed = parse_networks(str(networks) if networks else LINKERD_CLUSTER_NETWORKS)
    except ValueError:
        parsed = parse_networks(LINKERD_CLUSTER_NETWORKS)
    return ClusterConfig(parsed, default_policy=policy, control_ns=control_ns)


def policies(api: Any, namespace: str, target: str, control_ns: str) -> list[Row]:
    """The rows for `target` (`deploy/NAME`, `pod/NAME`, `NAME`) in `namespace`, from the
    cluster's objects."""
    from kubernetes import client as k8s

    from meshlet.cli.cluster import ClusterError, NotFound, read_json
    from meshlet.cli.workloads import Kind, deployments, pod_of
    from meshlet.controlplane.k8s.events import POLICY_KINDS
    from meshlet.controlplane.k8s.events import Kind as Watched

    wanted = _parse(target)
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    pod_list = read_json("pods", core.list_namespaced_pod, namespace)
    raw_pods = [p for p in pod_list.get("items") or [] if isinstance(p, dict)]
    pods = [pod_of(p) for p in raw_pods]
    name = wanted.names[0]
    if wanted.kind is Kind.DEPLOYMENT:
        objs = [read_json(f"deployment {namespace}/{name}", apps.read_namespaced_deployment,
                          name, namespace)]  # fmt: skip
        members = deployments(objs, pods)[0].pods
        if not members:
            raise ClusterError(f"deployment {namespace}/{name} has no live pods")
    else:
        members = tuple(p for p in pods if p.name == name)
        if not members:
            raise NotFound(f"pod {namespace}/{name} not found")
    chosen = next((p for p in members if p.running), members[0])

    custom = k8s.CustomObjectsApi(api)
    objects: dict[Watched, tuple[dict[str, Any], ...]] = {}
    for kind in POLICY_KINDS:
        if kind is Watched.POD:
            listed: Mapping[str, Any] = {"items": raw_pods}
        elif kind is Watched.NAMESPACE:
            listed = {"items": [read_json(f"namespace {namespace}", core.read_namespace,
                                          namespace)]}  # fmt: skip
        else:
            group, version = kind.api_version.split("/")
            try:
                listed = read_json(kind.plural, custom.list_namespaced_custom_object, group,
                                   version, namespace, kind.plural)  # fmt: skip
            except NotFound:  # the CRD is not installed (Gateway API's, say)
                listed = {}
        objects[kind] = _items(listed, kind.api_version, kind.kind)
    raw = next(p for p in raw_pods if _name(p) == chosen.name)
    return computed(objects, _cluster(api, control_ns), namespace, raw)


def local_policies(mesh: Any, namespace: str, target: str) -> list[Row]:
    """The rows for `target` in a kept local mesh (`localmesh.Kept`): from the manifests its
    policy controller reads, with the cluster networks and default policy it runs with."""
    from meshlet.cli.cluster import ClusterError, NotFound
    from meshlet.cli.demo import topology
    from meshlet.cli.workloads import Kind
    from meshlet.controlplane.k8s.events import POLICY_KINDS
    from meshlet.controlplane.k8s.events import Kind as Watched
    from meshlet.controlplane.k8s.manifests import (
        ManifestError,
        group_by_kind,
        read_manifest,
        scan,
    )
    from meshlet.controlplane.policy.index import ClusterConfig, parse_networks
    from meshlet.controlplane.tap.targets import deployment_of

    wanted = _parse(target)
    try:
        read = [obj for path in sorted(scan(mesh.manifests)) for obj in read_manifest(path)]
    except ManifestError as exc:
        raise ClusterError(f"the local mesh's manifests: {exc}") from None
    objects = group_by_kind(read, POLICY_KINDS)
    pods = [
        p for p in objects[Watched.POD] if (p.get("metadata") or {}).get("namespace") == namespace
    ]
    name = wanted.names[0]
    if wanted.kind is Kind.DEPLOYMENT:
        members = [p for p in pods if deployment_of(p) == name]
        what = f"deployment {namespace}/{name}"
    else:
        members = [p for p in pods if _name(p) == name]
        what = f"pod {namespace}/{name}"
    if not members:
        raise NotFound(f"{what} not found in the local mesh ({mesh.manifests})")
    chosen = next((p for p in members if (p.get("status") or {}).get("phase") == "Running"),
                  members[0])  # fmt: skip
    layout = mesh.layout
    cluster = ClusterConfig(parse_networks(layout.cluster_network),
                            default_policy=topology.DEFAULT_POLICY)  # fmt: skip
    return computed(objects, cluster, namespace, chosen)


def computed(
    objects: Mapping[Any, tuple[dict[str, Any], ...]],
    cluster: Any,
    namespace: str,
    pod: Mapping[str, Any],
) -> list[Row]:
    """The rows of each declared port of `pod`, as the policy controller's index computes its
    answer from `objects` (by watched kind) and the installation's `cluster` settings."""
    from meshlet.controlplane.k8s.events import Snapshot
    from meshlet.controlplane.policy.index import Index
    from meshlet.controlplane.policy.index import pod_of as policy_pod

    index = Index(cluster)
    for kind, items in objects.items():
        index.apply(Snapshot(kind, items))
    parsed = policy_pod(dict(pod))
    ports = sorted({n for numbers in (parsed.ports.values() if parsed else ()) for n in numbers})
    out: list[Row] = []
    for port in ports:
        server = index.get(namespace, str(_name(pod)), port)
        if server is not None:
            out.extend(rows(port, server))
    return out


def _parse(target: str) -> Any:
    from meshlet.cli.workloads import parse_target

    try:
        return parse_target(target)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="RESOURCE") from None


@click.command()
@click.argument("resource", metavar="deploy/NAME | pod/NAME")
@click.option("-n", "--namespace", help=NAMESPACE_HELP)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True, help="table, or json (one object per row).")  # fmt: skip
@options.control_plane_namespace()
@options.cluster
def authz(
    resource: str,
    namespace: str | None,
    output: str,
    control_plane_namespace: str,
    kubeconfig: Path | None,
    context: str | None,
) -> None:
    """The authorization policy on each declared port of a workload: the Server (or default
    policy), each route and each authorization, with the clients it admits.

    Computed as the policy controller computes it, from the Servers, AuthorizationPolicies,
    authentications, routes and annotations in the cluster; `meshlet diagnostics policy` shows
    what the controller itself sends a proxy. When no cluster is named (no --kubeconfig or
    --context, no $KUBECONFIG, no ~/.kube/config) and a local mesh is kept running (`meshlet
    demo --keep`), from the manifests its policy controller reads.

    \b
    meshlet authz deploy/store -n demo
    meshlet authz pod/web-5d8f7-abcde -n shop -o json
    """
    from meshlet.cli.cluster import api_client

    kept = None if localmesh.cluster_named(kubeconfig, context) else localmesh.kept()
    ns = localmesh.namespace(namespace, kept, kubeconfig, context)
    if kept is not None:
        table = local_policies(kept, ns, resource)
    else:
        table = policies(api_client(kubeconfig, context), ns, resource, control_plane_namespace)
    if output == "json":
        click.echo(json.dumps([asdict(r) for r in table], indent=2))
    elif not table:
        click.echo(f"{resource} declares no container ports: the default policy applies to each.")
    else:
        click.echo(render(table), nl=False)
