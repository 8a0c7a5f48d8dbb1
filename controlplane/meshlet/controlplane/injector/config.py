"""The injector's configuration: the mesh-wide proxy defaults, read from the `meshlet-config`
ConfigMap that the control-plane chart renders (key `values`), and the trust anchors.

`load` reports every problem at once; the webhook exits 64 on any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import yaml

from meshlet.api import wellknown
from meshlet.controlplane.injector import grammar

DEFAULT_IMAGE: Final = "ghcr.io/meshlet/proxy:0.1.0"
PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")
IPTABLES_MODES: Final = ("legacy", "nft")
# Linkerd's: the private and shared address ranges that clusters give pods and nodes.
DEFAULT_CLUSTER_NETWORKS: Final = "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8"


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Resources:
    """The proxy container's requests and limits; empty means unset."""

    cpu_request: str = ""
    cpu_limit: str = ""
    memory_request: str = ""
    memory_limit: str = ""


@dataclass(frozen=True, slots=True)
class ProxyDefaults:
    """Mesh-wide proxy settings; `config.meshlet.io/*` annotations override them per pod."""

    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    log_level: str = "info"
    default_inbound_policy: str = "all-unauthenticated"
    native_sidecar: bool = True
    opaque_ports: str = ",".join(str(p) for p in sorted(wellknown.DEFAULT_OPAQUE_PORTS))
    require_identity_ports: str = ""
    outbound_connect_timeout: str = ""
    shutdown_grace_period: str = ""
    stream_idle_timeout: str = ""  # off: a request in flight is never cut for being quiet
    resources: Resources = field(default_factory=Resources)
    iptables_mode: str = "legacy"
    ignore_inbound_ports: str = ""
    ignore_outbound_ports: str = ""


@dataclass(frozen=True, slots=True)
class InjectConfig:
    trust_anchors_pem: str
    control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE
    trust_domain: str = wellknown.TRUST_DOMAIN
    cluster_domain: str = wellknown.CLUSTER_DOMAIN
    cluster_networks: str = DEFAULT_CLUSTER_NETWORKS
    version: str = "0.1.0"
    # meshlet-cni programs meshed pods' tables: no privileged init container, a validator
    cni_enabled: bool = False
    proxy: ProxyDefaults = field(default_factory=ProxyDefaults)


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError("expected one of " + ", ".join(options))
        return text

    return parse


def _dns_name(text: str) -> str:
    labels = text.split(".")
    if not text or len(text) > 253 or not all(grammar.DNS_LABEL.fullmatch(x) for x in labels):
        raise ValueError("expected a DNS name such as cluster.local")
    return text


def _optional(parse: Callable[[str], str]) -> Callable[[str], str]:
    return lambda text: parse(text) if text.strip() else ""


# (key in the values document, parser); the one table of the injector's settings.
_TOP: Final[dict[str, Callable[[str], Any]]] = {
    "controlPlaneNamespace": _dns_name,
    "identityTrustDomain": _dns_name,
    "clusterDomain": _dns_name,
    "clusterNetworks": grammar.networks,
    "version": str,
    "cniEnabled": grammar.flag,
}
_PROXY: Final[dict[str, Callable[[str], Any]]] = {
    "image": grammar.image,
    "imagePullPolicy": _choice(PULL_POLICIES),
    "logLevel": grammar.log_level,
    "defaultInboundPolicy": grammar.inbound_policy,
    "nativeSidecar": grammar.flag,
    "opaquePorts": grammar.ports,
    "requireIdentityOnInboundPorts": grammar.ports,
    "outboundConnectTimeout": _optional(grammar.duration),
    "shutdownGracePeriod": _optional(grammar.duration),
    "streamIdleTimeout": _optional(grammar.duration),
    "cpuRequest": _optional(grammar.quantity),
    "cpuLimit": _optional(grammar.quantity),
    "memoryRequest": _optional(grammar.quantity),
    "memoryLimit": _optional(grammar.quantity),
}
_INIT: Final[dict[str, Callable[[str], Any]]] = {
    "iptablesMode": _choice(IPTABLES_MODES),
    "ignoreInboundPorts": grammar.ports,
    "ignoreOutboundPorts": grammar.ports,
}
_FIELDS: Final = {
    "controlPlaneNamespace": "control_ns",
    "identityTrustDomain": "trust_domain",
    "clusterDomain": "cluster_domain",
    "clusterNetworks": "cluster_networks",
    "version": "version",
    "cniEnabled": "cni_enabled",
    "image": "image",
    "imagePullPolicy": "image_pull_policy",
    "logLevel": "log_level",
    "defaultInboundPolicy": "default_inbound_policy",
    "nativeSidecar": "native_sidecar",
    "opaquePorts": "opaque_ports",
    "requireIdentityOnInboundPorts": "require_identity_ports",
    "outboundConnectTimeout": "outbound_connect_timeout",
    "shutdownGracePeriod": "shutdown_grace_period",
    "streamIdleTimeout": "stream_idle_timeout",
    "cpuRequest": "cpu_request",
    "cpuLimit": "cpu_limit",
    "memoryRequest": "memory_request",
    "memoryLimit": "memory_limit",
    "iptablesMode": "iptables_mode",
    "ignoreInboundPorts": "ignore_inbound_ports",
    "ignoreOutboundPorts": "ignore_outbound_ports",
}
_RESOURCES: Final = frozenset({"cpuRequest", "cpuLimit", "memoryRequest", "memoryLimit"})


def _section(
    doc: Mapping[str, Any],
    where: str,
    table: Mapping[str, Callable[[str], Any]],
    problems: list[str],
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in doc.items():
        name = f"{where}{key}"
        parse = table.get(str(key))
        if parse is None:
            problems.append(f"{name}: unknown setting")
            continue
        if isinstance(raw, bool):
            raw = "true" if raw else "false"
        if raw is None:
            raw = ""
        if not isinstance(raw, str | int | float):
            problems.append(f"{name}: expected a string, got {type(raw).__name__}")
            continue
        try:
            values[_FIELDS[str(key)]] = parse(str(raw))
        except ValueError as exc:
            problems.append(f"{name}={str(raw)[:80]!r}: {exc}")
    return values


def from_values(doc: Any, trust_anchors_pem: str) -> InjectConfig:
    """The configuration from the parsed `values` document and the anchors PEM."""
    problems: list[str] = []
    if not isinstance(doc, Mapping):
        raise ConfigError(["the configuration must be a mapping of settings"])
    top: dict[str, Any] = {}
    sections: dict[str, Mapping[str, Any]] = {"proxy": {}, "proxyInit": {}}
    for key, value in doc.items():
        if key in sections:
            if not isinstance(value, Mapping):
                problems.append(f"{key}: expected a mapping")
            else:
                sections[key] = value
        else:
            top[key] = value
    values = _section(top, "", _TOP, problems)
    proxy = _section(sections["proxy"], "proxy.", _PROXY, problems)
    proxy.update(_section(sections["proxyInit"], "proxyInit.", _INIT, problems))
    if "-----BEGIN CERTIFICATE-----" not in trust_anchors_pem:
        problems.append("the trust anchors are not PEM certificates")
    if problems:
        raise ConfigError(problems)
    resources = Resources(**{_FIELDS[k]: proxy.pop(_FIELDS[k]) for k in _RESOURCES
                             if _FIELDS[k] in proxy})  # fmt: skip
    return InjectConfig(
        trust_anchors_pem=trust_anchors_pem,
        proxy=ProxyDefaults(resources=resources, **proxy),
        **values,
    )


def load(values_yaml: str, trust_anchors_pem: str) -> InjectConfig:
    """Parses the ConfigMap's `values` text (YAML or JSON)."""
    try:
        doc = yaml.safe_load(values_yaml)
    except yaml.YAMLError as exc:
        raise ConfigError([f"the configuration is not YAML: {exc}"]) from None
    return from_values(doc or {}, trust_anchors_pem)
