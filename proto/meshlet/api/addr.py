"""Conversions between `ipaddress` values and the `io.linkerd.proxy.net` messages."""

from __future__ import annotations

import ipaddress

from meshlet.api import net_pb2

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_to_proto(ip: IP) -> net_pb2.IPAddress:
    if isinstance(ip, ipaddress.IPv4Address):
        return net_pb2.IPAddress(ipv4=int(ip))
    packed = ip.packed
    return net_pb2.IPAddress(
        ipv6=net_pb2.IPv6(
            first=int.from_bytes(packed[:8], "big"), last=int.from_bytes(packed[8:], "big")
        )
    )


def ip_from_proto(msg: net_pb2.IPAddress) -> IP:
    """The address in `msg`; ValueError when no address is set."""
    kind = msg.WhichOneof("ip")
    if kind == "ipv4":
        return ipaddress.IPv4Address(msg.ipv4)
    if kind == "ipv6":
        return ipaddress.IPv6Address(
            msg.ipv6.first.to_bytes(8, "big") + msg.ipv6.last.to_bytes(8, "big")
        )
    raise ValueError("IPAddress carries no address")


def tcp_to_proto(ip: IP, port: int) -> net_pb2.TcpAddress:
    return net_pb2.TcpAddress(ip=ip_to_proto(ip), port=port)


def tcp_from_proto(msg: net_pb2.TcpAddress) -> tuple[IP, int]:
    return ip_from_proto(msg.ip), msg.port
