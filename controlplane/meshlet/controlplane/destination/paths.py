"""Parsing a `GetDestination.path` into what it names (pure)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from meshlet.api import wellknown

DEFAULT_PORT: Final = 80
MAX_PATH: Final = 253 + 6  # a DNS name and ":65535"
_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class PathError(ValueError):
    """Not a path this service can answer; maps to INVALID_ARGUMENT."""


@dataclass(frozen=True, slots=True)
class ServiceName:
    namespace: str
    name: str
    port: int

    @property
    def fqdn(self) -> str:
        return f"{self.name}.{self.namespace}.svc"


@dataclass(frozen=True, slots=True)
class IPPort:
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int


def _port(text: str, path: str) -> int:
    if not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise PathError(f"{path!r}: port must be in 1-65535")
    return int(text)


def _split(path: str) -> tuple[str, str | None]:
    if path.startswith("["):  # [v6]:port
        host, sep, rest = path[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise PathError(f"{path!r}: malformed bracketed address")
        return host, rest[1:] if rest else None
    host, sep, port = path.rpartition(":")
    if not sep:
        return path, None
    if ":" in host:  # bare IPv6 without port
        return path, None
    return host, port


def parse(
    path: str, cluster_domain: str = wellknown.CLUSTER_DOMAIN, allow_ip: bool = False
) -> ServiceName | IPPort:
    """`<svc>.<ns>.svc.<cluster-domain>[:port]` (port 80 when absent), or with `allow_ip` an
    `<ip>:<port>`; PathError otherwise."""
    if not path:
        raise PathError("empty path")
    if len(path) > MAX_PATH or not path.isascii():
        raise PathError(f"{path[:64]!r}…: longer than a DNS name or not ASCII")
    host, port_text = _split(path)
    port = DEFAULT_PORT if port_text is None else _port(port_text, path)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if not allow_ip:
            raise PathError(f"{path!r}: an IP address is not a service name")
        if port_text is None:
            raise PathError(f"{path!r}: an IP lookup needs a port")
        return IPPort(ip, port)
    host = host.lower().rstrip(".")
    suffix = f".svc.{cluster_domain}"
    if not host.endswith(suffix):
        raise PathError(f"{path!r}: not a service name of the form <svc>.<ns>{suffix}")
    labels = host[: -len(suffix)].split(".")
    if len(labels) != 2 or not all(_LABEL.fullmatch(label) for label in labels):
        raise PathError(f"{path!r}: not a service name of the form <svc>.<ns>{suffix}")
    return ServiceName(namespace=labels[1], name=labels[0], port=port)
