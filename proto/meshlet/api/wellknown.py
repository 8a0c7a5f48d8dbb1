"""Every value that crosses a process boundary by convention: ports, names, env, annotations."""

from __future__ import annotations

import re
from typing import Final

# Proxy listeners.
PROXY_INBOUND_PORT: Final = 4143
PROXY_OUTBOUND_PORT: Final = 4140
PROXY_ADMIN_PORT: Final = 4191
PROXY_CONTROL_PORT: Final = 4190
PROXY_PORTS: Final = frozenset(
    {PROXY_INBOUND_PORT, PROXY_OUTBOUND_PORT, PROXY_ADMIN_PORT, PROXY_CONTROL_PORT}
)
# The proxy's UID (and, in the local mesh, GID): skipped by the OUTPUT redirect.
PROXY_UID: Final = 2102
PROXY_GID: Final = 2102

# Control-plane services.
DESTINATION_PORT: Final = 8086
IDENTITY_PORT: Final = 8080
INJECTOR_PORT: Final = 8443
INJECTOR_SERVICE_PORT: Final = 443
DESTINATION_ADMIN_PORT: Final = 9996
IDENTITY_ADMIN_PORT: Final = 9990
INJECTOR_ADMIN_PORT: Final = 9995

CONTROL_PLANE_NAMESPACE: Final = "meshlet"
TRUST_DOMAIN: Final = "cluster.local"
CLUSTER_DOMAIN: Final = "cluster.local"
TOKEN_AUDIENCE: Final = "identity.meshlet.io"

# Identity material in Kubernetes.
ISSUER_SECRET: Final = "meshlet-identity-issuer"
ISSUER_CERT_KEY: Final = "crt.pem"
ISSUER_KEY_KEY: Final = "key.pem"
TRUST_ROOTS_CONFIGMAP: Final = "meshlet-identity-trust-roots"
TRUST_ROOTS_KEY: Final = "ca-bundle.crt"

# Annotations and labels.
INJECT_ANNOTATION: Final = "meshlet.io/inject"
INJECT_ENABLED: Final = "enabled"
INJECT_DISABLED: Final = "disabled"
CONFIG_ANNOTATION_PREFIX: Final = "config.meshlet.io/"
SKIP_INBOUND_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "skip-inbound-ports"
SKIP_OUTBOUND_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "skip-outbound-ports"
OPAQUE_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "opaque-ports"
PROXY_LOG_LEVEL_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-log-level"
PROXY_CPU_LIMIT_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-cpu-limit"
PROXY_MEMORY_LIMIT_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-memory-limit"
CONTROL_PLANE_NS_LABEL: Final = "meshlet.io/control-plane-ns"
PROXY_OWNER_LABEL_PREFIX: Final = "meshlet.io/proxy-"  # + <kind>: <owner name>

DEFAULT_OPAQUE_PORTS: Final = frozenset({25, 587, 3306, 4444, 5432, 6379, 9300, 11211})
DETECT_TIMEOUT_SECONDS: Final = 10.0

PROXY_ENV_PREFIX: Final = "MESHLET_PROXY_"
CONTROLLER_ENV_PREFIX: Final = "MESHLET_"
INIT_ENV_PREFIX: Final = "MESHLET_INIT_"

# Mesh transport between proxies.
TRANSPORT_ALPN: Final = "transport.l5d.io/v1"
CLIENT_ID_HEADER: Final = "meshlet-client-id"
PROXY_ERROR_HEADER: Final = "meshlet-proxy-error"

# Identity issuance.
LEAF_LIFETIME_SECONDS: Final = 24 * 3600
CLOCK_SKEW_SECONDS: Final = 20

_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_IDENTITY_RE: Final = re.compile(
    rf"(?P<sa>{_LABEL})\.(?P<ns>{_LABEL})\.serviceaccount\.identity\."
    rf"(?P<control_ns>{_LABEL})\.(?P<trust_domain>{_LABEL}(\.{_LABEL})*)"
)


def identity_name(
    serviceaccount: str,
    namespace: str,
    control_ns: str = CONTROL_PLANE_NAMESPACE,
    trust_domain: str = TRUST_DOMAIN,
) -> str:
    """The DNS-like identity of a workload's service account."""
    return f"{serviceaccount}.{namespace}.serviceaccount.identity.{control_ns}.{trust_domain}"


def parse_identity_name(name: str) -> tuple[str, str, str, str] | None:
    """(serviceaccount, namespace, control_ns, trust_domain), or None when not an identity name."""
    match = _IDENTITY_RE.fullmatch(name)
    if match is None:
        return None
    return match["sa"], match["ns"], match["control_ns"], match["trust_domain"]


def spiffe_uri(serviceaccount: str, namespace: str, trust_domain: str = TRUST_DOMAIN) -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{serviceaccount}"


IDENTITY_SERVICE_NAME: Final = identity_name("meshlet-identity", CONTROL_PLANE_NAMESPACE)
DESTINATION_SERVICE_NAME: Final = identity_name("meshlet-destination", CONTROL_PLANE_NAMESPACE)
