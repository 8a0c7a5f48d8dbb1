"""The demo's cluster as data: every process gets what it needs, in both layouts."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import wellknown
from meshlet.cli.demo import topology
from meshlet.cli.demo.topology import Mode
from meshlet.proxy.config import load


@pytest.mark.parametrize("mode", list(Mode))
def test_every_proxy_environment_loads_with_the_proxys_own_loader(mode: Mode, test_ca: Any) -> None:
    layout = topology.layout(mode)
    for pod in layout.pods:
        env = topology.proxy_env(
            layout, pod, token_file="/t", identity_dir="/d", anchors_pem=test_ca.anchors_pem,
            anchors_file="/ca/trust-anchors.pem",
        )  # fmt: skip
        config = load(env)
        assert config.identity_local_name == pod.identity
        assert config.identity is not None
        assert config.identity.trust_anchors_file == Path("/ca/trust-anchors.pem")
        assert config.destination_svc_addr == f"{layout.control_ip}:{wellknown.DESTINATION_PORT}"
        opaque = topology.STORE_PORT in config.inbound_ports_disable_protocol_detection
        assert opaque == (pod.workload == "store")  # what the injector writes from the annotation


def test_netns_pods_listen_on_every_address_and_loopback_pods_on_their_own() -> None:
    netns, loopback = topology.layout(Mode.NETNS), topology.layout(Mode.LOOPBACK)
    web = netns.pod("web-1")
    env = topology.proxy_env(netns, web, token_file="t", identity_dir="d", anchors_pem="x")
    assert env["MESHLET_PROXY_INBOUND_LISTEN_ADDR"] == "0.0.0.0:4143"
    assert env["MESHLET_PROXY_OUTBOUND_LISTEN_ADDR"] == "127.0.0.1:4140"
    web = loopback.pod("web-1")
    env = topology.proxy_env(loopback, web, token_file="t", identity_dir="d", anchors_pem="x")
    assert env["MESHLET_PROXY_INBOUND_LISTEN_ADDR"] == f"{web.ip}:4143"
    assert env["MESHLET_PROXY_OUTBOUND_LISTEN_ADDR"] == f"{web.ip}:4140"
    assert len({pod.ip for pod in loopback.pods}) == len(loopback.pods)


def test_apps_call_services_by_name_or_through_their_proxy() -> None:
    netns, loopback = topology.layout(Mode.NETNS), topology.layout(Mode.LOOPBACK)
    argv = topology.app_argv(netns, netns.pod("web-1"), rate=20, stats_file="s", root="/r")
    assert argv[argv.index("--api") + 1] == "api.demo.svc.cluster.local:9090"
    assert argv[argv.index("--store") + 1] == "store.demo.svc.cluster.local:7000"
    assert "--via-proxy" not in argv
    argv = topology.app_argv(loopback, loopback.pod("web-1"), rate=20, stats_file="s", root="/r")
    assert argv[argv.index("--via-proxy") + 1] == "127.0.77.10:4140"
    assert argv[argv.index("--store") + 1] == "127.0.77.30:7000"  # opaque: direct
    slow = topology.app_argv(
        netns, netns.pod(topology.SLOW_REPLICA), rate=20, stats_file="s", root="/r"
    )
    assert float(slow[slow.index("--delay") + 1]) == topology.SLOW_DELAY


def test_hosts_map_service_names_to_cluster_ips() -> None:
    hosts = topology.hosts_file(topology.layout(Mode.NETNS))
    for svc in topology.SERVICES:
        assert f"{svc.cluster_ip} {svc.fqdn} {svc.name}.demo {svc.name}\n" in hosts


def test_the_destination_reads_the_manifests_as_the_demo_means_them() -> None:
    """The manifests, read by the destination's own state: each cluster IP names its service,
    every pod is known at its address, and the store's port is opaque."""
    from meshlet.controlplane.destination.state import ClusterState
    from meshlet.controlplane.k8s.events import DESTINATION_KINDS, Kind, Snapshot

    layout = topology.layout(Mode.NETNS)
    objs = [o for objs in topology.manifests_static().values() for o in objs]
    objs += [topology.pod_manifest(pod) for pod in layout.pods]
    state = ClusterState()
    for kind in DESTINATION_KINDS:
        of_kind = tuple(o for o in objs if Kind.of(o["apiVersion"], o["kind"]) is kind)
        state.apply(Snapshot(kind, of_kind))
    for svc in topology.SERVICES:
        found = state.service_at(svc.cluster_ip)
        assert found is not None and found.key == (topology.NAMESPACE, svc.name)
        assert (svc.port in found.opaque_ports) == svc.opaque
    for pod in layout.pods:
        known = state.pod_at(pod.ip)
        assert known is not None and known.name == pod.name
    # no ServiceProfile: one with routes would make the proxies ignore api's HTTPRoute
    assert state.profile_of((topology.NAMESPACE, "api")) is None


def test_the_policy_controller_splits_api_by_the_demos_route() -> None:
    """The manifests through the controller's own outbound index: api's one route sends 90 %
    to api and 10 % to the canary; the Service's annotations give it a 1 s request timeout,
    retries of resets and consecutive failure accrual, with no annotation refused."""
    from meshlet.controlplane.k8s.events import Kind, Upsert
    from meshlet.controlplane.policy.annotations import annotation_problems
    from meshlet.controlplane.policy.outbound_index import OutboundIndex

    index = OutboundIndex()
    for objs in topology.manifests_static().values():
        for obj in objs:
            kind = Kind.of(obj["apiVersion"], obj["kind"])
            if kind in (Kind.SERVICE, Kind.GATEWAY_HTTP_ROUTE):
                index.apply(Upsert(kind, obj))
    assert annotation_problems(topology.API_ANNOTATIONS) == []
    policy = index.get(topology.NAMESPACE, "api", topology.API_PORT)
    assert policy is not None
    http = policy.protocol.detect.http2
    assert http.failure_accrual.consecutive_failures.max_failures == 7
    assert http.failure_accrual.consecutive_failures.backoff.max_backoff.seconds == 5
    (route,) = http.routes
    assert route.metadata.resource.name == topology.API_ROUTE
    (rule,) = route.rules
    assert rule.timeouts.request.seconds == 1 and rule.retry.max_retries == 2
    split = {b.backend.backend.metadata.resource.name: b.weight
             for b in rule.backends.random_available.backends}  # fmt: skip
    assert split == {"api": 90, topology.CANARY: 10}


@pytest.mark.parametrize("weights", [(0, 0), (-1, 10)])
def test_bad_weights_are_refused(weights: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="weights"):
        topology.api_route(*weights)


@pytest.mark.parametrize("mode", list(Mode))
def test_every_proxy_follows_its_apps_port_policy_from_the_controller(
    mode: Mode, test_ca: Any
) -> None:
    """The policy env as the injector writes it: the controller's address and TLS name, the
    pod, its app's port (none for the load generator), and the demo's subnet as the cluster
    networks."""
    layout = topology.layout(mode)
    for pod in layout.pods:
        env = topology.proxy_env(
            layout, pod, token_file="/t", identity_dir="/d", anchors_pem=test_ca.anchors_pem
        )
        config = load(env)
        assert config.policy is not None
        assert str(config.policy.svc_addr) == f"{layout.control_ip}:{wellknown.POLICY_PORT}"
        assert config.policy.svc_name == wellknown.POLICY_SERVICE_NAME
        assert json.loads(config.policy.workload) == {"ns": "demo", "pod": pod.name}
        assert config.inbound_default_policy == "all-unauthenticated"
        networks = [ipaddress.ip_network(n) for n in config.policy_cluster_networks]
        for other in layout.pods:
            assert any(ipaddress.ip_address(other.ip) in n for n in networks), other
        want = {"load": (), "web": (8080,), "api": (9090,), "store": (7000,)}[pod.app]
        assert config.policy.ports == want, pod.name


def test_the_store_policy_is_one_server_admitting_only_webs_identity() -> None:
    """The policy objects parse with the controller's own reader, and name what the demo
    means: store's opaque port, a deny access policy, web's ServiceAccount as the only client."""
    from meshlet.controlplane.policy import resources

    objs = topology.manifests_static()["policy-store"]
    parsed = {type(o).__name__: o for o in map(resources.parse, objs)}
    server = parsed["Server"]
    assert server.port == topology.STORE_PORT and server.protocol == "opaque"
    assert server.access_policy == "deny"
    assert server.selector.matches({"app": "store"})
    assert not server.selector.matches({"app": "web"})
    mtls = parsed["MeshTLSAuthentication"]
    assert [(r.kind, r.name) for r in mtls.identity_refs] == [("ServiceAccount", "web")]
    policy = parsed["AuthorizationPolicy"]
    assert (policy.target.kind, policy.target.name) == ("Server", server.meta.name)
    assert [(r.kind, r.name) for r in policy.authentications] == [
        ("MeshTLSAuthentication", mtls.meta.name)
    ]


def test_the_controller_sends_stores_proxy_a_policy_admitting_only_web() -> None:
    """The manifests through the policy controller's own index: store's port authorizes web's
    identity alone; api's port keeps the default policy, open to every client."""
    from meshlet.controlplane.k8s.events import POLICY_KINDS, Kind, Snapshot
    from meshlet.controlplane.policy.index import ClusterConfig, Index, parse_networks

    layout = topology.layout(Mode.NETNS)
    objs = [o for objs in topology.manifests_static().values() for o in objs]
    objs += [topology.pod_manifest(pod) for pod in layout.pods]
    networks = parse_networks(layout.cluster_network)
    index = Index(ClusterConfig(networks=networks, default_policy=topology.DEFAULT_POLICY))
    for kind in POLICY_KINDS:
        of_kind = tuple(o for o in objs if Kind.of(o["apiVersion"], o["kind"]) is kind)
        index.apply(Snapshot(kind, of_kind))
    store = index.get(topology.NAMESPACE, "store-1", topology.STORE_PORT)
    assert store is not None and store.protocol.WhichOneof("kind") == "opaque"
    (authz,) = store.authorizations  # the policy's; the Server's `deny` adds none
    mesh_tls = authz.authentication.meshTLS
    assert [i.name for i in mesh_tls.identities.identities] == [layout.pod("web-1").identity]
    assert not mesh_tls.identities.suffixes
    api = index.get(topology.NAMESPACE, "api-1", topology.API_PORT)
    assert api is not None and dict(api.labels)["name"] == topology.DEFAULT_POLICY
    assert any(a.authentication.HasField("unauthenticated") for a in api.authorizations)
