"""The injector's configuration as the chart renders it: every problem named at once."""

from __future__ import annotations

import pytest

from meshlet.controlplane.injector.config import ConfigError, load
from meshlet_testing import pki

VALUES = """
controlPlaneNamespace: mesh
identityTrustDomain: example.org
clusterDomain: cluster.local
clusterNetworks: "10.42.0.0/16, 10.43.0.0/16,fd00::/8"
version: 0.2.0
proxy:
  image: registry.local/meshlet/proxy:0.2.0
  imagePullPolicy: Always
  logLevel: warn
  defaultInboundPolicy: cluster-authenticated
  nativeSidecar: false
  opaquePorts: "3306"
  requireIdentityOnInboundPorts: ""
  outboundConnectTimeout: 2s
  shutdownGracePeriod: ""
  cpuRequest: 100m
  cpuLimit: ""
  memoryRequest: 20Mi
  memoryLimit: 250Mi
proxyInit:
  iptablesMode: nft
  ignoreInboundPorts: ""
  ignoreOutboundPorts: "443"
"""


def test_loads_the_rendered_values() -> None:
    config = load(VALUES, pki.anchors_pem())
    assert config.control_ns == "mesh" and config.trust_domain == "example.org"
    assert config.proxy.native_sidecar is False
    assert config.proxy.resources.memory_limit == "250Mi"
    assert config.proxy.iptables_mode == "nft"
    assert config.proxy.ignore_outbound_ports == "443"
    assert config.cluster_networks == "10.42.0.0/16,10.43.0.0/16,fd00::/8"
    assert config.proxy.default_inbound_policy == "cluster-authenticated"


def test_linkerds_defaults_without_the_policy_settings() -> None:
    config = load("controlPlaneNamespace: meshlet\n", pki.anchors_pem())
    assert config.cluster_networks == (
        "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8"
    )
    assert config.proxy.default_inbound_policy == "all-unauthenticated"


def test_every_problem_is_named() -> None:
    bad = """
controlPlaneNamespace: Not_A_Name
clusterNetworks: "10.0.0.1/8,cluster,"
proxy:
  logLevel: loud
  defaultInboundPolicy: allow
  cpuLimit: a lot
  colour: blue
proxyInit: []
"""
    with pytest.raises(ConfigError) as caught:
        load(bad, "not a certificate")
    assert caught.value.problems == [
        "proxyInit: expected a mapping",
        "controlPlaneNamespace='Not_A_Name': expected a DNS name such as cluster.local",
        "clusterNetworks='10.0.0.1/8,cluster,': expected CIDRs such as 10.0.0.0/8,fd00::/8;"
        " not '10.0.0.1/8', 'cluster', ''",
        "proxy.logLevel='loud': expected one of trace, debug, info, warn, error",
        "proxy.defaultInboundPolicy='allow': expected one of all-unauthenticated,"
        " all-authenticated, cluster-unauthenticated, cluster-authenticated, deny, audit",
        "proxy.cpuLimit='a lot': expected a quantity such as 100m, 1, 64Mi or 1Gi",
        "proxy.colour: unknown setting",
        "the trust anchors are not PEM certificates",
    ]


@pytest.mark.parametrize("text", ["{", "- a list", "proxy: {image: [1]}"])
def test_malformed_documents(text: str) -> None:
    with pytest.raises(ConfigError):
        load(text, pki.anchors_pem())
