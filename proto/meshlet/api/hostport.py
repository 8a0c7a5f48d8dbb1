"""`host:port` as every setting, flag and authority writes it: the one address type, parser and
formatter.

`host` is an IP literal (IPv6 in brackets: `[::1]:80`) or, where names are allowed, a DNS name;
`port` is 1-65535 (0 where a listener may ask for an ephemeral port). An empty host is a
listener's "every address" where the caller allows it (`:8080`). Errors say what was expected.

`HostPort` is an address as the mesh passes it around; its text (`str()`) is `format_hostport`,
so an IPv6 address reads `[::1]:8080` in logs, metric labels and discovery targets alike. It is a
tuple, so sockets and asyncio take it as it is.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final, NamedTuple

_NAME: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")
_FORBIDDEN: Final = frozenset(" /\\@\r\n\t?#")


class HostPort(NamedTuple):
    """A TCP address: an IP literal or a DNS name, and a port."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_hostport(self.host, self.port)

    @classmethod
    def from_sockaddr(cls, sockaddr: tuple[object, ...]) -> HostPort:
        """The address of a socket address as sockets and asyncio return it: `(host, port)` for
        IPv4, `(host, port, flowinfo, scope_id)` for IPv6."""
        host, port = sockaddr[0], sockaddr[1]
        if not isinstance(host, str) or not isinstance(port, int):
            raise TypeError(f"{sockaddr!r} is not an IP socket address")
        return cls(host, port)


def parse_hostport(
    text: str,
    *,
    names: bool = True,
    default_port: int | None = None,
    empty_host: str | None = None,
    port_zero: bool = False,
) -> HostPort:
    """The address `text` names; ValueError naming what is wrong.

    - `names`: a DNS name may stand for the host (else an IP literal is required);
    - `default_port`: the port when `text` has none (else a port is required);
    - `empty_host`: what an empty host (`:8080`) means (else an empty host is an error);
    - `port_zero`: port 0 is accepted (a listener's "any free port")."""
    text = text.strip()
    if not text or any(c in _FORBIDDEN for c in text):
        raise ValueError(f"{text!r} is not host:port")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: an IPv6 address is written [addr]:port")
        port_text = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text_or_host = text.rpartition(":")
        if not sep:
            host, port_text = text, None
        else:
            port_text = port_text_or_host
        if ":" in host:
            raise ValueError(f"{text!r}: an IPv6 address is written [addr]:port")
    port = _port(text, port_text, default_port, port_zero)
    if not host:
        if empty_host is None:
            raise ValueError(f"{text!r} names no host")
        return HostPort(empty_host, port)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not names:
            raise ValueError(f"{text!r}: {host!r} is not an IP address") from None
        if not _NAME.fullmatch(host):
            raise ValueError(f"{text!r}: {host!r} is not a host name") from None
    return HostPort(host, port)


def _port(text: str, port_text: str | None, default: int | None, zero: bool) -> int:
    if port_text is None or port_text == "":
        if default is None:
            raise ValueError(f"{text!r} has no port (host:port)")
        return default
    if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise ValueError(f"{text!r}: {port_text!r} is not a port")
    port = int(port_text)
    if not (0 if zero else 1) <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is outside {0 if zero else 1}-65535")
    return port


def format_hostport(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
