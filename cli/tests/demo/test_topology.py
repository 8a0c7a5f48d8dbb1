"""The demo's cluster as data: every process gets what it needs, in both layouts."""

from __future__ import annotations

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
            layout, pod, token_file="/t", identity_dir="/d", anchors_pem=test_ca.anchors_pem
        )
        config = load(env)
        assert config.identity_local_name == pod.identity
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
    argv = topology.app_argv(netns, netns.pod("web-1"), rate=20, stats_file="s")
    assert argv[argv.index("--api") + 1] == "api.demo.svc.cluster.local:9090"
    assert argv[argv.index("--store") + 1] == "store.demo.svc.cluster.local:7000"
    assert "--via-proxy" not in argv
    argv = topology.app_argv(loopback, loopback.pod("web-1"), rate=20, stats_file="s")
    assert argv[argv.index("--via-proxy") + 1] == "127.0.77.10:4140"
    assert argv[argv.index("--store") + 1] == "127.0.77.30:7000"  # opaque: direct
    slow = topology.app_argv(netns, netns.pod(topology.SLOW_REPLICA), rate=20, stats_file="s")
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
    assert state.profile_of((topology.NAMESPACE, "api")) is not None
