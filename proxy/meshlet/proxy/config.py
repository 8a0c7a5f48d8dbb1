"""The proxy's configuration: every `MESHLET_PROXY_*` variable in one table, parsed once.

Every error is collected and reported together; `main` exits 64 on any of them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.api.durations import parse_duration

Addr = tuple[str, int]
PREFIX: Final = wellknown.PROXY_ENV_PREFIX


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def parse_addr(text: str) -> Addr:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected host:port")
    host = host.strip("[]")
    ipaddress.ip_address(host)  # listeners take IP literals only
    return host, int(port)


def parse_svc_addr(text: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`, where host may be a DNS name."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            "expected host:port, e.g. meshlet-destination.meshlet.svc.cluster.local:8086"
        )
    return host, int(port)


def parse_ports(text: str) -> frozenset[int]:
    ports: set[int] = set()
    for item in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{item!r} is not a port or a range")
        lo, hi = int(low), int(high or low)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{item!r} is outside 1-65535")
        ports.update(range(lo, hi + 1))
    return frozenset(ports)


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


def _path(text: str) -> Path:
    return Path(text)


def _text(text: str) -> str:
    return text


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    # name (without prefix) → parser; the table below is the only place names appear
    inbound_listen_addr: Addr = ("0.0.0.0", wellknown.PROXY_INBOUND_PORT)
    outbound_listen_addr: Addr = ("127.0.0.1", wellknown.PROXY_OUTBOUND_PORT)
    admin_listen_addr: Addr = ("0.0.0.0", wellknown.PROXY_ADMIN_PORT)
    control_listen_addr: Addr = ("0.0.0.0", wellknown.PROXY_CONTROL_PORT)
    destination_svc_addr: str = ""
    destination_svc_name: str = ""
    destination_context: str = ""
    # Request authorities under these suffixes (and IP literals) are looked up in discovery.
    destination_profile_suffixes: tuple[str, ...] = ("svc.cluster.local",)
    identity_svc_addr: str = ""
    identity_svc_name: str = ""
    identity_local_name: str = ""
    identity_token_file: Path | None = None
    identity_trust_anchors: str = ""
    identity_dir: Path | None = None
    inbound_ports_disable_protocol_detection: frozenset[int] = wellknown.DEFAULT_OPAQUE_PORTS
    outbound_ports_disable_protocol_detection: frozenset[int] = wellknown.DEFAULT_OPAQUE_PORTS
    inbound_ports_require_identity: frozenset[int] = frozenset()
    inbound_detect_timeout: float = wellknown.DETECT_TIMEOUT_SECONDS
    outbound_detect_timeout: float = wellknown.DETECT_TIMEOUT_SECONDS
    outbound_connect_timeout: float = 1.0
    http1_pool_idle_timeout: float = 3.0
    http1_header_read_timeout: float = 10.0
    http_idle_timeout: float = 60.0
    http1_max_header_bytes: int = 64 * 1024
    http1_max_headers: int = 100
    http2_max_concurrent_streams: int = 100
    shutdown_grace_period: float = 120.0
    admin_shutdown_enabled: bool = False
    log: str = "info"
    extra: Mapping[str, str] = field(default_factory=dict)  # unknown MESHLET_PROXY_* names


_PARSERS: Final[dict[str, Callable[[str], Any]]] = {
    "inbound_listen_addr": parse_addr,
    "outbound_listen_addr": parse_addr,
    "admin_listen_addr": parse_addr,
    "control_listen_addr": parse_addr,
    "destination_svc_addr": _text,
    "destination_svc_name": _text,
    "destination_context": _text,
    "destination_profile_suffixes": parse_suffixes,
    "identity_svc_addr": _text,
    "identity_svc_name": _text,
    "identity_local_name": _text,
    "identity_token_file": _path,
    "identity_trust_anchors": _text,
    "identity_dir": _path,
    "inbound_ports_disable_protocol_detection": parse_ports,
    "outbound_ports_disable_protocol_detection": parse_ports,
    "inbound_ports_require_identity": parse_ports,
    "inbound_detect_timeout": parse_duration,
    "outbound_detect_timeout": parse_duration,
    "outbound_connect_timeout": parse_duration,
    "http1_pool_idle_timeout": parse_duration,
    "http1_header_read_timeout": parse_duration,
    "http_idle_timeout": parse_duration,
    "http1_max_header_bytes": _positive_int,
    "http1_max_headers": _positive_int,
    "http2_max_concurrent_streams": _positive_int,
    "shutdown_grace_period": parse_duration,
    "admin_shutdown_enabled": lambda t: {"true": True, "false": False}[t.strip().lower()],
    "log": _log_level,
}


def env_name(field_name: str) -> str:
    return PREFIX + field_name.upper()


def load(env: Mapping[str, str]) -> ProxyConfig:
    """The configuration from `env` (os.environ or a test's dict); ConfigError lists every
    bad or unknown variable."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    known = {env_name(name): name for name in _PARSERS}
    for key, raw in sorted(env.items()):
        if not key.startswith(PREFIX):
            continue
        name = known.get(key)
        if name is None:
            problems.append(f"{key}: unknown setting")
            continue
        try:
            values[name] = _PARSERS[name](raw)
        except (ValueError, KeyError) as exc:
            problems.append(f"{key}={raw[:80]!r}: {exc}")
    identity = [values.get(n) for n in ("identity_svc_addr", "identity_local_name")]
    if any(identity) and not all(identity):
        problems.append(
            f"{env_name('identity_svc_addr')} and {env_name('identity_local_name')} go together"
        )
    if problems:
        raise ConfigError(problems)
    return ProxyConfig(**values)


def defaults_table() -> list[tuple[str, str]]:
    """(variable, default as it would be written in the environment) for every setting, for
    --help."""
    defaults = ProxyConfig()
    return [
        (env_name(f.name), _env_text(getattr(defaults, f.name)))
        for f in fields(ProxyConfig)
        if f.name in _PARSERS
    ]


def _env_text(value: object) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}s"
    if isinstance(value, frozenset):
        return ",".join(str(port) for port in sorted(value)) or "none"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return f"{value[0]}:{value[1]}"
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    return str(value)
