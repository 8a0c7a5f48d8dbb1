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
        ip, port = target
        if port not in self._ports:
            return False
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return address.is_loopback or address.is_unspecified or ip == local_ip
