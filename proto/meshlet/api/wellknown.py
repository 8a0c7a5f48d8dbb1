"""Every value that crosses a process boundary by convention: ports, names, env, annotations."""

from __future__ import annotations

import enum
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
POLICY_PORT: Final = 8090
POLICY_ADMIN_PORT: Final = 9997
TAP_PORT: Final = 8088
TAP_ADMIN_PORT: Final = 9998
# The web dashboard (Linkerd viz's web: 8084, admin 9994), in the tap controller's pod.
WEB_PORT: Final = 8084
PROMETHEUS_PORT: Final = 9090  # the chart's meshlet-prometheus (prometheus.enabled)
WEB_ADMIN_PORT: Final = 9994

CONTROL_PLANE_NAMESPACE: Final = "meshlet"
TRUST_DOMAIN: Final = "cluster.local"
CLUSTER_DOMAIN: Final = "cluster.local"
TOKEN_AUDIENCE: Final = "identity.meshlet.io"

# Identity material in Kubernetes.
ISSUER_SECRET: Final = "meshlet-identity-issuer"
ISSUER_CERT_KEY: Final = "crt.pem"
ISSUER_KEY_KEY: Final = "key.pem"
# Linkerd's identity.issuer.scheme: the issuer Secret as the chart writes it (crt.pem, key.pem),
# or a kubernetes.io/tls Secret (tls.crt, tls.key) that cert-manager owns and renews
ISSUER_SCHEME_MESHLET: Final = "meshlet.io/tls"
ISSUER_SCHEME_KUBERNETES: Final = "kubernetes.io/tls"
ISSUER_KEYS: Final = {
    ISSUER_SCHEME_MESHLET: (ISSUER_CERT_KEY, ISSUER_KEY_KEY),
    ISSUER_SCHEME_KUBERNETES: ("tls.crt", "tls.key"),
}
TRUST_ROOTS_CONFIGMAP: Final = "meshlet-identity-trust-roots"
TRUST_ROOTS_KEY: Final = "ca-bundle.crt"

# Annotations and labels.
INJECT_ANNOTATION: Final = "meshlet.io/inject"
INJECT_ENABLED: Final = "enabled"
INJECT_DISABLED: Final = "disabled"
CONFIG_ANNOTATION_PREFIX: Final = "config.meshlet.io/"
# The inbound policy of a namespace's or a pod's ports when no Server selects them.
DEFAULT_INBOUND_POLICY_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "default-inbound-policy"
SKIP_INBOUND_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "skip-inbound-ports"
SKIP_OUTBOUND_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "skip-outbound-ports"
OPAQUE_PORTS_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "opaque-ports"
PROXY_LOG_LEVEL_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-log-level"
PROXY_CPU_LIMIT_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-cpu-limit"
PROXY_MEMORY_LIMIT_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-memory-limit"
PROXY_CPU_REQUEST_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-cpu-request"
PROXY_MEMORY_REQUEST_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-memory-request"
PROXY_IMAGE_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-image"
PROXY_NATIVE_SIDECAR_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-native-sidecar"
# enabled (the default) / disabled: a classic sidecar holds the app back until it is ready
PROXY_AWAIT_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-await"
REQUIRE_IDENTITY_PORTS_ANNOTATION: Final = (
    CONFIG_ANNOTATION_PREFIX + "proxy-require-identity-inbound-ports"
)
OUTBOUND_CONNECT_TIMEOUT_ANNOTATION: Final = (
    CONFIG_ANNOTATION_PREFIX + "proxy-outbound-connect-timeout"
)
SHUTDOWN_GRACE_PERIOD_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-shutdown-grace-period"
# Linkerd's config.linkerd.io/access-log (apache or json) and trace-collector
ACCESS_LOG_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "access-log"
TRACE_COLLECTOR_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "trace-collector"
# What the pod's proxy does with `%2F` and `%5C` in the path of a request to the pod, before
# routing and authorizing it (`reject`, `keep` or `decode`; Envoy's
# path_with_escaped_slashes_action): docs/policy.md.
ESCAPED_SLASHES_ANNOTATION: Final = CONFIG_ANNOTATION_PREFIX + "proxy-escaped-slashes"
# Linkerd's idle timeout, on a pod or its namespace: how long a request through that pod's proxy
# may move no byte either way (unset: no limit).
IDLE_TIMEOUT_ANNOTATION: Final = "timeout.meshlet.io/idle"
# Written by the injector on the pods it meshes.
PROXY_VERSION_ANNOTATION: Final = "meshlet.io/proxy-version"
TRUST_ROOT_SHA256_ANNOTATION: Final = "meshlet.io/trust-root-sha256"
CREATED_BY_ANNOTATION: Final = "meshlet.io/created-by"
CONTROL_PLANE_NS_LABEL: Final = "meshlet.io/control-plane-ns"
WORKLOAD_NS_LABEL: Final = "meshlet.io/workload-ns"
PROXY_OWNER_LABEL_PREFIX: Final = "meshlet.io/proxy-"  # + <kind>: <owner name>
# On the control plane's own pods: destination, identity or proxy-injector.
CONTROL_PLANE_COMPONENT_LABEL: Final = "meshlet.io/control-plane-component"
# -- outbound policy annotations (Linkerd's retry.linkerd.io, timeout.linkerd.io and
# balancer.linkerd.io names), on a Service or a route whose parent is a Service.
RETRY_HTTP_ANNOTATION: Final = "retry.meshlet.io/http"  # 5xx, gateway-error, 503, 500-504
RETRY_GRPC_ANNOTATION: Final = "retry.meshlet.io/grpc"  # cancelled, unavailable, ...
RETRY_LIMIT_ANNOTATION: Final = "retry.meshlet.io/limit"
RETRY_TIMEOUT_ANNOTATION: Final = "retry.meshlet.io/timeout"
TIMEOUT_REQUEST_ANNOTATION: Final = "timeout.meshlet.io/request"
TIMEOUT_RESPONSE_ANNOTATION: Final = "timeout.meshlet.io/response"
TIMEOUT_IDLE_ANNOTATION: Final = "timeout.meshlet.io/idle"
FAILURE_ACCRUAL_ANNOTATION: Final = "balancer.meshlet.io/failure-accrual"  # consecutive
FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION: Final = (
    "balancer.meshlet.io/failure-accrual-consecutive-max-failures"
)
FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION: Final = (
    "balancer.meshlet.io/failure-accrual-consecutive-min-penalty"
)
FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION: Final = (
    "balancer.meshlet.io/failure-accrual-consecutive-max-penalty"
)
FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION: Final = (
    "balancer.meshlet.io/failure-accrual-consecutive-jitter-ratio"
)

PROXY_LOG_LEVELS: Final = ("trace", "debug", "info", "warn", "error")
DEFAULT_OPAQUE_PORTS: Final = frozenset({25, 587, 3306, 4444, 5432, 6379, 9300, 11211})
DETECT_TIMEOUT_SECONDS: Final = 10.0

PROXY_ENV_PREFIX: Final = "MESHLET_PROXY_"
CONTROLLER_ENV_PREFIX: Final = "MESHLET_"
INIT_ENV_PREFIX: Final = "MESHLET_INIT_"


class ProxyEnv(enum.StrEnum):
    """Every variable `meshlet-proxy` reads: the one table of names. The proxy's config loader
    maps each to a parser; the injector writes them."""

    INBOUND_LISTEN_ADDR = PROXY_ENV_PREFIX + "INBOUND_LISTEN_ADDR"
    OUTBOUND_LISTEN_ADDR = PROXY_ENV_PREFIX + "OUTBOUND_LISTEN_ADDR"
    # Every address of a listener (Linkerd's *_LISTEN_ADDRS): `0.0.0.0:4143,[::]:4143` on a
    # dual-stack pod; when set, the singular variable is not read.
    INBOUND_LISTEN_ADDRS = PROXY_ENV_PREFIX + "INBOUND_LISTEN_ADDRS"
    OUTBOUND_LISTEN_ADDRS = PROXY_ENV_PREFIX + "OUTBOUND_LISTEN_ADDRS"
    ADMIN_LISTEN_ADDR = PROXY_ENV_PREFIX + "ADMIN_LISTEN_ADDR"
    CONTROL_LISTEN_ADDR = PROXY_ENV_PREFIX + "CONTROL_LISTEN_ADDR"
    DESTINATION_SVC_ADDR = PROXY_ENV_PREFIX + "DESTINATION_SVC_ADDR"
    DESTINATION_SVC_NAME = PROXY_ENV_PREFIX + "DESTINATION_SVC_NAME"
    DESTINATION_CONTEXT = PROXY_ENV_PREFIX + "DESTINATION_CONTEXT"
    DESTINATION_PROFILE_SUFFIXES = PROXY_ENV_PREFIX + "DESTINATION_PROFILE_SUFFIXES"
    POLICY_SVC_ADDR = PROXY_ENV_PREFIX + "POLICY_SVC_ADDR"
    POLICY_SVC_NAME = PROXY_ENV_PREFIX + "POLICY_SVC_NAME"
    # `{"ns":"NAMESPACE","pod":"NAME"}`: the workload the proxy asks the policy controller for
    POLICY_WORKLOAD = PROXY_ENV_PREFIX + "POLICY_WORKLOAD"
    # CIDRs that `cluster-*` default policies admit
    POLICY_CLUSTER_NETWORKS = PROXY_ENV_PREFIX + "POLICY_CLUSTER_NETWORKS"
    # the default policy until the controller has answered (and without a controller)
    INBOUND_DEFAULT_POLICY = PROXY_ENV_PREFIX + "INBOUND_DEFAULT_POLICY"
    # the pod's ports whose policies the proxy watches
    INBOUND_PORTS = PROXY_ENV_PREFIX + "INBOUND_PORTS"
    IDENTITY_SVC_ADDR = PROXY_ENV_PREFIX + "IDENTITY_SVC_ADDR"
    IDENTITY_SVC_NAME = PROXY_ENV_PREFIX + "IDENTITY_SVC_NAME"
    IDENTITY_LOCAL_NAME = PROXY_ENV_PREFIX + "IDENTITY_LOCAL_NAME"
    IDENTITY_TOKEN_FILE = PROXY_ENV_PREFIX + "IDENTITY_TOKEN_FILE"
    IDENTITY_TRUST_ANCHORS = PROXY_ENV_PREFIX + "IDENTITY_TRUST_ANCHORS"
    IDENTITY_TRUST_ANCHORS_FILE = PROXY_ENV_PREFIX + "IDENTITY_TRUST_ANCHORS_FILE"
    IDENTITY_DIR = PROXY_ENV_PREFIX + "IDENTITY_DIR"
    INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION = (
        PROXY_ENV_PREFIX + "INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION"
    )
    OUTBOUND_PORTS_DISABLE_PROTOCOL_DETECTION = (
        PROXY_ENV_PREFIX + "OUTBOUND_PORTS_DISABLE_PROTOCOL_DETECTION"
    )
    INBOUND_PORTS_REQUIRE_IDENTITY = PROXY_ENV_PREFIX + "INBOUND_PORTS_REQUIRE_IDENTITY"
    INBOUND_DETECT_TIMEOUT = PROXY_ENV_PREFIX + "INBOUND_DETECT_TIMEOUT"
    OUTBOUND_DETECT_TIMEOUT = PROXY_ENV_PREFIX + "OUTBOUND_DETECT_TIMEOUT"
    OUTBOUND_CONNECT_TIMEOUT = PROXY_ENV_PREFIX + "OUTBOUND_CONNECT_TIMEOUT"
    # `true`: HTTP/1.1 requests to a meshed proxy that takes HTTP/2 go as its streams (opt-in)
    OUTBOUND_HTTP1_OVER_H2 = PROXY_ENV_PREFIX + "OUTBOUND_HTTP1_OVER_H2"
    # the address mTLS connections to other proxies come from (pods sharing one host's loopback)
    OUTBOUND_MESH_SOURCE_IP = PROXY_ENV_PREFIX + "OUTBOUND_MESH_SOURCE_IP"
    HTTP1_POOL_IDLE_TIMEOUT = PROXY_ENV_PREFIX + "HTTP1_POOL_IDLE_TIMEOUT"
    HTTP1_HEADER_READ_TIMEOUT = PROXY_ENV_PREFIX + "HTTP1_HEADER_READ_TIMEOUT"
    HTTP_IDLE_TIMEOUT = PROXY_ENV_PREFIX + "HTTP_IDLE_TIMEOUT"
    HTTP_STREAM_IDLE_TIMEOUT = PROXY_ENV_PREFIX + "HTTP_STREAM_IDLE_TIMEOUT"
    HTTP1_MAX_HEADER_BYTES = PROXY_ENV_PREFIX + "HTTP1_MAX_HEADER_BYTES"
    HTTP1_MAX_HEADERS = PROXY_ENV_PREFIX + "HTTP1_MAX_HEADERS"
    HTTP2_MAX_CONCURRENT_STREAMS = PROXY_ENV_PREFIX + "HTTP2_MAX_CONCURRENT_STREAMS"
    # `reject` (default), `keep` or `decode`: `%2F` and `%5C` in an inbound request's path
    INBOUND_HTTP_ESCAPED_SLASHES = PROXY_ENV_PREFIX + "INBOUND_HTTP_ESCAPED_SLASHES"
    LOAD_SHED_CONNECTIONS = PROXY_ENV_PREFIX + "LOAD_SHED_CONNECTIONS"
    LOAD_SHED_STREAMS = PROXY_ENV_PREFIX + "LOAD_SHED_STREAMS"
    LOAD_SHED_BUFFERED_BYTES = PROXY_ENV_PREFIX + "LOAD_SHED_BUFFERED_BYTES"
    SHUTDOWN_GRACE_PERIOD = PROXY_ENV_PREFIX + "SHUTDOWN_GRACE_PERIOD"
    ADMIN_SHUTDOWN_ENABLED = PROXY_ENV_PREFIX + "ADMIN_SHUTDOWN_ENABLED"
    # the identity the proxy's tap server (on the control port) answers; no other client
    TAP_SVC_NAME = PROXY_ENV_PREFIX + "TAP_SVC_NAME"
    LOG = PROXY_ENV_PREFIX + "LOG"
    LOG_FORMAT = PROXY_ENV_PREFIX + "LOG_FORMAT"
    # `apache` or `json`: one line per HTTP request on stderr (unset: none)
    ACCESS_LOG = PROXY_ENV_PREFIX + "ACCESS_LOG"
    # an OTLP/HTTP traces endpoint URL; sampled requests get a span per hop (unset: none)
    TRACE_COLLECTOR_SVC_ADDR = PROXY_ENV_PREFIX + "TRACE_COLLECTOR_SVC_ADDR"
    # the `service.name` of the spans the proxy exports
    TRACE_SERVICE_NAME = PROXY_ENV_PREFIX + "TRACE_SERVICE_NAME"


# Names of the control plane's objects (the charts render them; tests hold the two together).
DESTINATION_NAME: Final = "meshlet-destination"
IDENTITY_NAME: Final = "meshlet-identity"
INJECTOR_NAME: Final = "meshlet-proxy-injector"
INJECTOR_TLS_SECRET: Final = "meshlet-proxy-injector-k8s-tls"
INJECTOR_VALIDATE_PATH: Final = "/validate"  # the validating webhook, served by the injector
CONFIG_CONFIGMAP: Final = "meshlet-config"
CONFIG_KEY: Final = "values"
SERVICEPROFILE_CRD: Final = "serviceprofiles.meshlet.io"
POLICY_NAME: Final = "meshlet-policy"
POLICY_API_GROUP: Final = "policy.meshlet.io"
# The controllerName of the route status entries the policy controller writes (Linkerd:
# linkerd.io/policy-controller).
POLICY_CONTROLLER_NAME: Final = "meshlet.io/policy-controller"
TAP_NAME: Final = "meshlet-tap"  # the tap controller's ServiceAccount (its identity)
TAP_TLS_SECRET: Final = "meshlet-tap-k8s-tls"  # its certificate and key (kubernetes.io/tls)
WEB_NAME: Final = "meshlet-web"  # the dashboard's name (its container, the Host names it accepts)

# What the injector adds to a pod.
PROXY_CONTAINER: Final = "meshlet-proxy"
INIT_CONTAINER: Final = "meshlet-init"
# with meshlet-cni (cniEnabled), instead of meshlet-init: checks the redirection, unprivileged
VALIDATOR_CONTAINER: Final = "meshlet-network-validator"
VALIDATOR_UID: Final = 65534  # any user but the proxy's, whose connections are not redirected
PROXY_PORT_NAME: Final = "meshlet-proxy"
ADMIN_PORT_NAME: Final = "meshlet-admin"
IDENTITY_DIR_VOLUME: Final = "meshlet-identity-end-entity"
IDENTITY_DIR_PATH: Final = "/var/run/meshlet/identity/end-entity"
TOKEN_VOLUME: Final = "meshlet-identity-token"
# The trust-roots bundle's copy in each namespace with meshed pods (the injector keeps it), the
# volume that mounts it into the proxy (optional: a proxy starts on its environment's anchors
# without it) and where the proxy follows it.
TRUST_ROOTS_COPY: Final = "meshlet-trust-roots"
TRUST_ROOTS_COPY_LABEL: Final = "meshlet.io/trust-roots"  # value: "copy"
TRUST_ROOTS_VOLUME: Final = "meshlet-trust-roots"
TRUST_ROOTS_PATH: Final = "/var/run/meshlet/trust-roots"
TOKEN_DIR_PATH: Final = "/var/run/secrets/tokens"
TOKEN_FILE: Final = "meshlet-identity-token"

# Mesh transport between proxies.
TRANSPORT_ALPN: Final = "transport.l5d.io/v1"
CLIENT_ID_HEADER: Final = "meshlet-client-id"
PROXY_ERROR_HEADER: Final = "meshlet-proxy-error"
# Linkerd's names for the same two: an app moving from Linkerd may still trust them, so the
# proxy strips them as it strips its own.
LINKERD_CLIENT_ID_HEADER: Final = "l5d-client-id"
LINKERD_PROXY_ERROR_HEADER: Final = "l5d-proxy-error"
# On an HTTP/2 request from a peer proxy: the request was HTTP/1.1 (`HTTP/1.1`), and its proxy
# sent it to the app as such (Linkerd's `l5d-orig-proto`, also stripped from clients).
ORIG_PROTO_HEADER: Final = "meshlet-orig-proto"
LINKERD_ORIG_PROTO_HEADER: Final = "l5d-orig-proto"

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
POLICY_SERVICE_NAME: Final = identity_name(POLICY_NAME, CONTROL_PLANE_NAMESPACE)
TAP_SERVICE_NAME: Final = identity_name(TAP_NAME, CONTROL_PLANE_NAMESPACE)

# Default inbound policies (Linkerd's names): what a port allows when no Server selects it.
DEFAULT_INBOUND_POLICIES: Final = (
    "all-unauthenticated",
    "all-authenticated",
    "cluster-unauthenticated",
    "cluster-authenticated",
    "deny",
    "audit",
)
