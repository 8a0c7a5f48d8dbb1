"""Which targets would loop back into the proxy: its own listening ports on this host (pure)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Addr = tuple[str, int]


class SelfTargets:
    """The proxy's own listening ports: never a destination (a routing loop)."""

    def __init__(self, listen: Iterable[Addr]) -> None:
        self._ports = {port for _, port in listen}

    def loops(self, target: Addr, local_ip: str) -> bool:
        """Whether `target` is one of the proxy's ports on a loopback, unspecified or its own
        address (`local_ip`), however the address is spelt (an IPv4-mapped IPv6 address is
        its IPv4 address)."""
        ip, port = target
        if port not in self._ports:
            return False
        address = _address(ip)
        if address is None:
            return False
        return address.is_loopback or address.is_unspecified or address == _address(local_ip)


def _address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])  # a zone names no other host
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
