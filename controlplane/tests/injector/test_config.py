"""The injector's configuration as the chart renders it: every problem named at once."""

from __future__ import annotations

import pytest

from meshlet.controlplane.injector.config import ConfigError, load
from meshlet_testing import pki

VALUES = """
controlPlaneNamespace: mesh
identityTrustDomain: example.org
clusterDomain: cluster.local
version: 0.2.0
proxy:
  image: registry.local/meshlet/proxy:0.2.0
  imagePullPolicy: Always
  logLevel: warn
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


def test_every_problem_is_named() -> None:
    bad = """
controlPlaneNamespace: Not_A_Name
proxy:
  logLevel: loud
  cpuLimit: a lot
  colour: blue
proxyInit: []
"""
    with pytest.raises(ConfigError) as caught:
        load(bad, "not a certificate")
    assert caught.value.problems == [
        "proxyInit: expected a mapping",
        "controlPlaneNamespace='Not_A_Name': expected a DNS name such as cluster.local",
        "proxy.logLevel='loud': expected one of trace, debug, info, warn, error",
        "proxy.cpuLimit='a lot': expected a quantity such as 100m, 1, 64Mi or 1Gi",
        "proxy.colour: unknown setting",
        "the trust anchors are not PEM certificates",
    ]


@pytest.mark.parametrize("text", ["{", "- a list", "proxy: {image: [1]}"])
def test_malformed_documents(text: str) -> None:
    with pytest.raises(ConfigError):
        load(text, pki.anchors_pem())
