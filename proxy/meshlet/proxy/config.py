"""The proxy's configuration: every `MESHLET_PROXY_*` variable in one table, parsed once.

Every error is collected and reported together; `main` exits 64 on any of them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.api.durations import parse_duration
from meshlet.api.hostport import HostPort, parse_hostport
from meshlet.api.ports import PortRanges, parse_ports

Addr = HostPort
PREFIX: Final = wellknown.PROXY_ENV_PREFIX


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_ip(text: str) -> str:
    """An IPv4 or IPv6 address, as Python writes it."""
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address") from None


def parse_addr(text: str) -> Addr:
    """A listener's `ip:port` (IP literals only; port 0 picks a free port)."""
    return parse_hostport(text, names=False, port_zero=True)


def parse_addrs(text: str) -> tuple[Addr, ...]:
    """A listener's addresses, comma-separated (`0.0.0.0:4143,[::]:4143`), all on one port."""
    addrs = tuple(dict.fromkeys(parse_addr(item) for item in text.split(",") if item.strip()))
    if not addrs:
        raise ValueError("expected one or more ip:port, comma-separated")
    if len({addr.port for addr in addrs}) > 1:
        raise ValueError("every address of a listener has the same port")
    return addrs


def parse_svc_addr(text: str) -> Addr:
    """A service's `host:port` or `[v6]:port`, where host may be a DNS name."""
    return parse_hostport(text)


def parse_suffixes(text: str) -> tuple[str, ...]:
    """Comma-separated DNS suffixes (`svc.cluster.local.`); `.` alone means every name."""
    suffixes: list[str] = []
    for item in filter(None, (s.strip().lower() for s in text.split(","))):
        name = item.strip(".")
        if name and not re.fullmatch(
            r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", name
        ):
            raise ValueError(f"{item!r} is not a DNS suffix")
        suffixes.append(name)
    return tuple(suffixes)


def _log_level(text: str) -> str:
    level = text.strip().lower()
    if level not in ("trace", "debug", "info", "warn", "warning", "error"):
        raise ValueError("expected one of trace, debug, info, warn, error")
    return "warning" if level == "warn" else "debug" if level == "trace" else level


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("expected a positive integer")
    return value


def _optional_duration(text: str) -> float | None:
    """A duration, or nothing (empty or 0: no limit)."""
    if not text.strip():
        return None
    return parse_duration(text) or None


def _path(text: str) -> Path:
    return Path(text)


def _text(text: str) -> str:
    return text


Net = ipaddress.IPv4Network | ipaddress.IPv6Network
# Linkerd's default cluster networks (`clusterNetworks`).
CLUSTER_NETWORKS: Final = "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8"
MAX_INBOUND_PORTS: Final = 1000  # a WatchPort stream each


def parse_networks(text: str) -> tuple[Net, ...]:
    """Comma-separated CIDRs (`10.0.0.0/8,fd00::/8`)."""
    nets = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not a CIDR network such as 10.0.0.0/8") from None
    return tuple(nets)


def _default_policy(text: str) -> str:
    name = text.strip()
    if name not in wellknown.DEFAULT_INBOUND_POLICIES:
        raise ValueError("expected one of " + ", ".join(wellknown.DEFAULT_INBOUND_POLICIES))
    return name


def parse_port_list(text: str) -> tuple[int, ...]:
    """Comma-separated ports in 1-65535 (no ranges: each is watched on its own)."""
    ports: set[int] = set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        if not item.isdigit() or not 1 <= int(item) <= 65535:
            raise ValueError(f"{item!r} is not a port in 1-65535")
        ports.add(int(item))
    if len(ports) > MAX_INBOUND_PORTS:
        raise ValueError(f"more than {MAX_INBOUND_PORTS} ports")
    return tuple(sorted(ports))


def parse_workload(text: str) -> str:
    """`{"ns":"NAMESPACE","pod":"NAME"}` or `NAMESPACE:NAME`, kept as written."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError('expected JSON {"ns": "NAMESPACE", "pod": "NAME"}') from None
        if not (isinstance(value, dict) and isinstance(value.get("ns"), str) and value["ns"]
                and isinstance(value.get("pod"), str) and value["pod"]):  # fmt: skip
            raise ValueError('expected JSON {"ns": "NAMESPACE", "pod": "NAME"}')
        return text
    ns, sep, pod = text.partition(":")
    if not sep or not ns or not pod:
        raise ValueError('expected {"ns": "NAMESPACE", "pod": "NAME"} or NAMESPACE:NAME')
    return text


_DEFAULT_OPAQUE: Final = PortRanges.of(wellknown.DEFAULT_OPAQUE_PORTS)
_NO_PORTS: Final = PortRanges()


@dataclass(frozen=True, slots=True)
class IdentitySettings:
    """How the proxy gets its certificate (all of them, or identity is off)."""

    local_name: str
    svc_addr: Addr  # host (a name or an IP) and port
    svc_name: str  # the identity service's TLS identity
    token_file: Path
    trust_anchors_pem: str
    directory: Path | None = None  # None: a private temporary folder under /dev/shm
    trust_anchors_file: Path | None = None  # a bundle followed while the proxy runs


@dataclass(frozen=True, slots=True)
class DestinationSettings:
    """Where discovery asks (absent: no discovery, traffic goes where it was sent)."""

    svc_addr: Addr
    svc_name: str | None  # its TLS identity; None: plaintext
    context: str  # the context token (JSON)
    profile_suffixes: tuple[str, ...]
    trust_anchors_pem: str | None

    @property
    def namespace(self) -> str | None:
        """The pod's namespace, as its context token names it (`{"ns": …}`); None when the
        token is not that JSON."""
        try:
            value = json.loads(self.context)
        except ValueError:
            return None
        ns = value.get("ns") if isinstance(value, dict) else None
        return ns if isinstance(ns, str) and ns else None


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """Where the policy controller is and what to ask it (absent: every port has the default
    policy)."""

    svc_addr: Addr
    svc_name: str | None  # its TLS identity; None: plaintext
    workload: str
    ports: tuple[int, ...]
    trust_anchors_pem: str | None


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    inbound_listen_addr: Addr = HostPort("0.0.0.0", wellknown.PROXY_INBOUND_PORT)
    outbound_listen_addr: Addr = HostPort("127.0.0.1", wellknown.PROXY_OUTBOUND_PORT)
    inbound_listen_addrs: tuple[Addr, ...] = ()  # when set: every inbound address, instead
    outbound_listen_addrs: tuple[Addr, ...] = ()
    admin_listen_addr: Addr = HostPort("0.0.0.0", wellknown.PROXY_ADMIN_PORT)
    control_listen_addr: Addr = HostPort("0.0.0.0", wellknown.PROXY_CONTROL_PORT)
    destination_svc_addr: str = ""
    destination_svc_name: str = ""
    destination_context: str = ""
    # Request authorities under these suffixes (and IP literals) are looked up in discovery.
    destination_profile_suffixes: tuple[str, ...] = ("svc.cluster.local",)
    policy_svc_addr: str = ""
    policy_svc_name: str = ""
    policy_workload: str = ""
    policy_cluster_networks: tuple[Net, ...] = parse_networks(CLUSTER_NETWORKS)
    inbound_default_policy: str = "all-unauthenticated"
    inbound_ports: tuple[int, ...] = ()
    identity_svc_addr: str = ""
    identity_svc_name: str = ""
    identity_local_name: str = ""
    identity_token_file: Path | None = None
    identity_trust_anchors: str = ""
    identity_trust_anchors_file: Path | None = None
    identity_dir: Path | None = None
    # The tap controller's identity, the one client the tap server answers ("": the
    # `meshlet-tap` service account of the control plane this proxy's identity names).
    tap_svc_name: str = ""
    inbound_ports_disable_protocol_detection: PortRanges = _DEFAULT_OPAQUE
    outbound_ports_disable_protocol_detection: PortRanges = _DEFAULT_OPAQUE
    inbound_ports_require_identity: PortRanges = _NO_PORTS
    inbound_detect_timeout: float = wellknown.DETECT_TIMEOUT_SECONDS
    outbound_detect_timeout: float = wellknown.DETECT_TIMEOUT_SECONDS
    outbound_connect_timeout: float = 1.0
    outbound_mesh_source_ip: str | None = None  # None: the kernel picks
    # HTTP/1.1 requests to a meshed proxy that takes HTTP/2 go as its streams (orig_proto.py):
    # one connection instead of one per request in flight, but each request costs more CPU
    # (docs/proxy.md, "HTTP/1.1 between proxies"), so it is asked for.
    outbound_http1_over_h2: bool = False
    http1_pool_idle_timeout: float = 3.0
    http1_header_read_timeout: float = 10.0
    http_idle_timeout: float = 60.0
    http_stream_idle_timeout: float | None = None  # off unless set (a request may stay quiet)
    http1_max_header_bytes: int = 64 * 1024
    http1_max_headers: int = 100
    http2_max_concurrent_streams: int = 100
    inbound_http_escaped_slashes: str = "reject"  # reject, keep or decode (meshlet.api.target)
    # High-water marks of client connections, their streams and the bytes buffered for them:
    # past one, the connections that cost most for the least progress are shed.
    load_shed_connections: int = 4096
    load_shed_streams: int = 8192
    load_shed_buffered_bytes: int = 128 * 1024 * 1024
    shutdown_grace_period: float = 120.0
    admin_shutdown_enabled: bool = False
    log: str = "info"
    log_format: str = "plain"
    access_log: str = ""  # "", apache or json
    trace_collector_svc_addr: str = ""  # an OTLP/HTTP endpoint URL
    trace_service_name: str = "meshlet-proxy"
    # Derived by `load` from the settings above, checked with them.
    identity: IdentitySettings | None = None
    destination: DestinationSettings | None = None
    policy: PolicySettings | None = None

    @property
    def inbound_addrs(self) -> tuple[Addr, ...]:
        """Where the inbound listener listens: INBOUND_LISTEN_ADDRS, else INBOUND_LISTEN_ADDR."""
        return self.inbound_listen_addrs or (self.inbound_listen_addr,)

    @property
    def outbound_addrs(self) -> tuple[Addr, ...]:
        return self.outbound_listen_addrs or (self.outbound_listen_addr,)


def _log_format(text: str) -> str:
    value = text.strip().lower()
    if value not in ("plain", "json"):
        raise ValueError("expected plain or json")
    return value


def _escaped_slashes(text: str) -> str:
    value = text.strip().lower()
    if value not in ("reject", "keep", "decode"):
        raise ValueError("expected reject, keep or decode")
    return value


def _access_log(text: str) -> str:
    value = text.strip().lower()
    if value not in ("", "apache", "json"):
        raise ValueError("expected apache or json")
    return value


def _collector_url(text: str) -> str:
    """An OTLP/HTTP endpoint: `http(s)://host[:port][/path]` (the path defaults to
    /v1/traces, OTLP's)."""
    value = text.strip()
    if not value:
        return ""
    match = re.fullmatch(
        r"https?://([^/?#\s:]+|\[[0-9a-fA-F:.]+\])(:[0-9]{1,5})?(/[^?#\s]*)?", value
    )
    if match is None or (match[2] is not None and not 0 < int(match[2][1:]) < 65536):
        raise ValueError("expected an http:// or https:// URL")
    return value if match[3] not in (None, "/") else value.rstrip("/") + "/v1/traces"


def _service_name(text: str) -> str:
    value = text.strip()
    if not value or len(value) > 253 or not value.isprintable():
        raise ValueError("expected a printable name of 1 to 253 characters")
    return value


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ValueError("expected true or false")
    return value == "true"


E = wellknown.ProxyEnv
# The one table: each variable, the field it sets and its parser.
_TABLE: Final[dict[wellknown.ProxyEnv, tuple[str, Callable[[str], Any]]]] = {
    E.INBOUND_LISTEN_ADDR: ("inbound_listen_addr", parse_addr),
    E.OUTBOUND_LISTEN_ADDR: ("outbound_listen_addr", parse_addr),
    E.INBOUND_LISTEN_ADDRS: ("inbound_listen_addrs", parse_addrs),
    E.OUTBOUND_LISTEN_ADDRS: ("outbound_listen_addrs", parse_addrs),
    E.ADMIN_LISTEN_ADDR: ("admin_listen_addr", parse_addr),
    E.CONTROL_LISTEN_ADDR: ("control_listen_addr", parse_addr),
    E.DESTINATION_SVC_ADDR: ("destination_svc_addr", _text),
    E.DESTINATION_SVC_NAME: ("destination_svc_name", _text),
    E.DESTINATION_CONTEXT: ("destination_context", _text),
    E.DESTINATION_PROFILE_SUFFIXES: ("destination_profile_suffixes", parse_suffixes),
    E.POLICY_SVC_ADDR: ("policy_svc_addr", _text),
    E.POLICY_SVC_NAME: ("policy_svc_name", _text),
    E.POLICY_WORKLOAD: ("policy_workload", parse_workload),
    E.POLICY_CLUSTER_NETWORKS: ("policy_cluster_networks", parse_networks),
    E.INBOUND_DEFAULT_POLICY: ("inbound_default_policy", _default_policy),
    E.INBOUND_PORTS: ("inbound_ports", parse_port_list),
    E.IDENTITY_SVC_ADDR: ("identity_svc_addr", _text),
    E.IDENTITY_SVC_NAME: ("identity_svc_name", _text),
    E.IDENTITY_LOCAL_NAME: ("identity_local_name", _text),
    E.IDENTITY_TOKEN_FILE: ("identity_token_file", _path),
    E.IDENTITY_TRUST_ANCHORS: ("identity_trust_anchors", _text),
    E.IDENTITY_TRUST_ANCHORS_FILE: ("identity_trust_anchors_file", _path),
    E.IDENTITY_DIR: ("identity_dir", _path),
    E.TAP_SVC_NAME: ("tap_svc_name", _text),
    E.INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION: (
        "inbound_ports_disable_protocol_detection",
        parse_ports,
    ),
    E.OUTBOUND_PORTS_DISABLE_PROTOCOL_DETECTION: (
        "outbound_ports_disable_protocol_detection",
        parse_ports,
    ),
    E.INBOUND_PORTS_REQUIRE_IDENTITY: ("inbound_ports_require_identity", parse_ports),
    E.INBOUND_DETECT_TIMEOUT: ("inbound_detect_timeout", parse_duration),
    E.OUTBOUND_DETECT_TIMEOUT: ("outbound_detect_timeout", parse_duration),
    E.OUTBOUND_CONNECT_TIMEOUT: ("outbound_connect_timeout", parse_duration),
    E.OUTBOUND_MESH_SOURCE_IP: ("outbound_mesh_source_ip", parse_ip),
    E.OUTBOUND_HTTP1_OVER_H2: ("outbound_http1_over_h2", _flag),
    E.HTTP1_POOL_IDLE_TIMEOUT: ("http1_pool_idle_timeout", parse_duration),
    E.HTTP1_HEADER_READ_TIMEOUT: ("http1_header_read_timeout", parse_duration),
    E.HTTP_IDLE_TIMEOUT: ("http_idle_timeout", parse_duration),
    E.HTTP_STREAM_IDLE_TIMEOUT: ("http_stream_idle_timeout", _optional_duration),
    E.HTTP1_MAX_HEADER_BYTES: ("http1_max_header_bytes", _positive_int),
    E.HTTP1_MAX_HEADERS: ("http1_max_headers", _positive_int),
    E.HTTP2_MAX_CONCURRENT_STREAMS: ("http2_max_concurrent_streams", _positive_int),
    E.INBOUND_HTTP_ESCAPED_SLASHES: ("inbound_http_escaped_slashes", _escaped_slashes),
    E.LOAD_SHED_CONNECTIONS: ("load_shed_connections", _positive_int),
    E.LOAD_SHED_STREAMS: ("load_shed_streams", _positive_int),
    E.LOAD_SHED_BUFFERED_BYTES: ("load_shed_buffered_bytes", _positive_int),
    E.SHUTDOWN_GRACE_PERIOD: ("shutdown_grace_period", parse_duration),
    E.ADMIN_SHUTDOWN_ENABLED: ("admin_shutdown_enabled", _flag),
    E.LOG: ("log", _log_level),
    E.LOG_FORMAT: ("log_format", _log_format),
    E.ACCESS_LOG: ("access_log", _access_log),
    E.TRACE_COLLECTOR_SVC_ADDR: ("trace_collector_svc_addr", _collector_url),
    E.TRACE_SERVICE_NAME: ("trace_service_name", _service_name),
}
_FIELDS: Final = {field_name: env for env, (field_name, _) in _TABLE.items()}


def check(name: wellknown.ProxyEnv, raw: str) -> None:
    """Raises ValueError (saying what is expected) when the proxy would refuse `raw` as the
    value of `name`: the injector checks annotation values with this, so that an annotation
    never makes a proxy exit."""
    _, parse = _TABLE[name]
    try:
        parse(raw)
    except KeyError as exc:
        raise ValueError(str(exc)) from None


def env_name(field_name: str) -> str:
    return str(_FIELDS[field_name])


# The variables the kubelet gives every container for each Service of its namespace (its
# "service links"): a Service named meshlet-proxy-injector brings MESHLET_PROXY_INJECTOR_…,
# which begin as the proxy's own settings do.
_IP = r"(?:[0-9.]+|[0-9a-fA-F:]+)"
_SERVICE_LINK: Final = (
    (re.compile(r"[A-Z0-9_]+_SERVICE_HOST"), re.compile(_IP)),
    (re.compile(r"[A-Z0-9_]+_SERVICE_PORT(?:_[A-Z0-9_]+)?"), re.compile(r"[0-9]{1,5}")),
    (re.compile(r"[A-Z0-9_]+_PORT"), re.compile(rf"(?:tcp|udp|sctp)://{_IP}:[0-9]{{1,5}}")),
    (
        re.compile(r"[A-Z0-9_]+_PORT_[0-9]{1,5}_(?:TCP|UDP|SCTP)"),
        re.compile(rf"(?:tcp|udp|sctp)://{_IP}:[0-9]{{1,5}}"),
    ),
    (re.compile(r"[A-Z0-9_]+_PORT_[0-9]{1,5}_(?:TCP|UDP|SCTP)_PROTO"), re.compile("tcp|udp|sctp")),
    (re.compile(r"[A-Z0-9_]+_PORT_[0-9]{1,5}_(?:TCP|UDP|SCTP)_PORT"), re.compile(r"[0-9]{1,5}")),
    (re.compile(r"[A-Z0-9_]+_PORT_[0-9]{1,5}_(?:TCP|UDP|SCTP)_ADDR"), re.compile(_IP)),
)


def service_link(key: str, value: str) -> bool:
    """Whether `key=value` has the name and the value of a Kubernetes service-link variable
    (not a proxy setting, whatever its prefix); a misspelt setting has one or the other only."""
    return any(n.fullmatch(key) and v.fullmatch(value) for n, v in _SERVICE_LINK)


def load(env: Mapping[str, str]) -> ProxyConfig:
    """The configuration from `env` (os.environ or a test's dict); ConfigError lists every
    bad or unknown variable, and every identity or discovery setting that cannot work."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, raw in sorted(env.items()):
        if not key.startswith(PREFIX):
            continue
        try:
            name, parse = _TABLE[wellknown.ProxyEnv(key)]
        except ValueError:
            if not service_link(key, raw):
                problems.append(f"{key}: unknown setting")
            continue
        try:
            values[name] = parse(raw)
        except (ValueError, KeyError) as exc:
            problems.append(f"{key}={raw[:80]!r}: {exc}")
    config = ProxyConfig(**values)
    identity = _identity(config, problems)
    destination = _destination(config, problems)
    policy = _policy(config, problems)
    if problems:
        raise ConfigError(problems)
    return dataclasses.replace(config, identity=identity, destination=destination, policy=policy)


def _identity(config: ProxyConfig, problems: list[str]) -> IdentitySettings | None:
    if _identity_off(config):
        return None
    before = len(problems)
    svc_addr = HostPort("", 0)
    if not config.identity_svc_addr:
        problems.append(f"{E.IDENTITY_SVC_ADDR} is required with identity")
    else:
        try:
            svc_addr = parse_svc_addr(config.identity_svc_addr)
        except ValueError as exc:
            problems.append(f"{E.IDENTITY_SVC_ADDR}={config.identity_svc_addr[:80]!r}: {exc}")
    if not config.identity_local_name:
        problems.append(f"{E.IDENTITY_LOCAL_NAME} is required with identity")
    if config.identity_token_file is None:
        problems.append(
            f"{E.IDENTITY_TOKEN_FILE} is required with identity: the path of the pod's"
            " service-account token"
        )
    anchors = _anchors_problem(config.identity_trust_anchors)
    if anchors:
        problems.append(f"{E.IDENTITY_TRUST_ANCHORS}: {anchors}")
    if len(problems) > before or config.identity_token_file is None:
        return None
    return IdentitySettings(
        local_name=config.identity_local_name,
        svc_addr=svc_addr,
        svc_name=config.identity_svc_name or wellknown.IDENTITY_SERVICE_NAME,
        token_file=config.identity_token_file,
        trust_anchors_pem=config.identity_trust_anchors,
        directory=config.identity_dir,
        trust_anchors_file=config.identity_trust_anchors_file,
    )


def _destination(config: ProxyConfig, problems: list[str]) -> DestinationSettings | None:
    if not config.destination_svc_addr:
        if config.destination_svc_name:
            problems.append(f"{E.DESTINATION_SVC_NAME} needs {E.DESTINATION_SVC_ADDR}")
        return None
    try:
        svc_addr = parse_svc_addr(config.destination_svc_addr)
    except ValueError as exc:
        problems.append(f"{E.DESTINATION_SVC_ADDR}={config.destination_svc_addr[:80]!r}: {exc}")
        return None
    if config.destination_svc_name and not config.identity_trust_anchors:
        problems.append(
            f"{E.DESTINATION_SVC_NAME} (TLS to the destination service) needs"
            f" {E.IDENTITY_TRUST_ANCHORS}"
        )
    elif config.destination_svc_name and _identity_off(config):  # else _identity checked them
        anchors = _anchors_problem(config.identity_trust_anchors)
        if anchors:
            problems.append(f"{E.IDENTITY_TRUST_ANCHORS}: {anchors}")
    return DestinationSettings(
        svc_addr=svc_addr,
        svc_name=config.destination_svc_name or None,
        context=config.destination_context,
        profile_suffixes=config.destination_profile_suffixes,
        trust_anchors_pem=config.identity_trust_anchors or None,
    )


def _policy(config: ProxyConfig, problems: list[str]) -> PolicySettings | None:
    if config.inbound_default_policy.startswith("cluster-") and not config.policy_cluster_networks:
        problems.append(
            f"{E.INBOUND_DEFAULT_POLICY}={config.inbound_default_policy} needs"
            f" {E.POLICY_CLUSTER_NETWORKS}"
        )
    if not config.policy_svc_addr:
        if config.policy_svc_name:
            problems.append(f"{E.POLICY_SVC_NAME} needs {E.POLICY_SVC_ADDR}")
        return None
    before = len(problems)
    svc_addr = HostPort("", 0)
    try:
        svc_addr = parse_svc_addr(config.policy_svc_addr)
    except ValueError as exc:
        problems.append(f"{E.POLICY_SVC_ADDR}={config.policy_svc_addr[:80]!r}: {exc}")
    if not config.policy_workload:
        problems.append(
            f"{E.POLICY_SVC_ADDR} needs {E.POLICY_WORKLOAD}: the pod the policies are asked for"
        )
    if config.policy_svc_name and not config.identity_trust_anchors:
        problems.append(
            f"{E.POLICY_SVC_NAME} (TLS to the policy controller) needs {E.IDENTITY_TRUST_ANCHORS}"
        )
    if len(problems) > before:
        return None
    return PolicySettings(
        svc_addr=svc_addr,
        svc_name=config.policy_svc_name or None,
        workload=config.policy_workload,
        ports=config.inbound_ports,
        trust_anchors_pem=config.identity_trust_anchors or None,
    )


def _identity_off(config: ProxyConfig) -> bool:
    return not config.identity_svc_addr and not config.identity_local_name


def _anchors_problem(pem: str) -> str | None:
    if not pem.strip():
        return "the trust anchors (PEM text) are required with identity"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem)
    except (ssl.SSLError, ValueError) as exc:
        hint = ""
        if "-----BEGIN" not in pem and ("/" in pem or pem.endswith(".pem")):
            hint = "; the variable holds the certificates themselves, not a path to them"
        return f"not PEM certificates ({exc}){hint}"
    return None


def defaults_table() -> list[tuple[str, str]]:
    """(variable, default as it would be written in the environment) for every setting, for
    --help."""
    defaults = ProxyConfig()
    return [(str(env), _env_text(getattr(defaults, name))) for env, (name, _) in _TABLE.items()]


def _env_text(value: object) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}s"
    if isinstance(value, PortRanges):
        return str(value) or "none"
    if isinstance(value, HostPort):
        return str(value)
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value) or "none"
    return str(value)
