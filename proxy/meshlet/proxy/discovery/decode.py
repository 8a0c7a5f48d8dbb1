"""The destination service's messages decoded into the core's endpoint values (`Update`,
`DiscoveredEndpoint`): every field checked against the contract (DESIGN §4).

Decoding never downgrades security: an address whose `tls_identity` is present but unusable is
rejected (reported in `Add.rejected`), never kept as a plaintext endpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from meshlet.api import addr, destination_pb2, net_pb2
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.endpoints import (
    Add,
    Addr,
    DiscoveredEndpoint,
    Hint,
    NoEndpoints,
    Remove,
    TlsIdentity,
    Update,
)


class DecodeError(ValueError):
    """A message that breaks the contract; the text says which field."""


def decode_addr(msg: net_pb2.TcpAddress) -> Addr:
    try:
        ip, port = addr.tcp_from_proto(msg)
    except ValueError as exc:
        raise DecodeError(f"address: {exc}") from None
    if not 1 <= port <= 65535:
        raise DecodeError(f"address {ip}: port {port} is not in 1-65535")
    return HostPort(str(ip), port)


def _identity(msg: destination_pb2.TlsIdentity) -> TlsIdentity:
    strategy = msg.WhichOneof("strategy")
    server_name = msg.server_name.name if msg.HasField("server_name") else ""
    if strategy == "dns_like_identity" and msg.dns_like_identity.name:
        name = msg.dns_like_identity.name
        return TlsIdentity(name, server_name or name)
    if strategy == "uri_like_identity" and msg.uri_like_identity.uri and server_name:
        return TlsIdentity(msg.uri_like_identity.uri, server_name, "uri")
    raise DecodeError("tls_identity is set without a usable name (or a URI without server_name)")


def decode_endpoint(
    msg: destination_pb2.WeightedAddr, set_labels: Mapping[str, str]
) -> DiscoveredEndpoint:
    """One `WeightedAddr`; DecodeError when it cannot be used safely."""
    if not msg.HasField("addr"):
        raise DecodeError("WeightedAddr without addr")
    address = decode_addr(msg.addr)
    identity = _identity(msg.tls_identity) if msg.HasField("tls_identity") else None
    hint: Hint | None = None
    transport_port: int | None = None
    if msg.HasField("protocol_hint"):
        protocol = msg.protocol_hint.WhichOneof("protocol")
        hint = Hint.H2 if protocol == "h2" else Hint.OPAQUE if protocol == "opaque" else None
        if msg.protocol_hint.HasField("opaque_transport"):
            transport_port = msg.protocol_hint.opaque_transport.inbound_port
            if not 1 <= transport_port <= 65535:
                raise DecodeError(f"{address[0]}: opaque_transport port {transport_port}")
    override = msg.authority_override.authority_override or None
    return DiscoveredEndpoint(
        addr=address,
        weight=msg.weight,
        labels=tuple(sorted({**set_labels, **msg.metric_labels}.items())),
        identity=identity,
        hint=hint,
        opaque_transport_port=transport_port,
        authority_override=override,
    )


def _decode_all(
    items: Iterable[destination_pb2.WeightedAddr], set_labels: Mapping[str, str]
) -> tuple[tuple[DiscoveredEndpoint, ...], tuple[str, ...]]:
    endpoints, rejected = [], []
    for item in items:
        try:
            endpoints.append(decode_endpoint(item, set_labels))
        except DecodeError as exc:
            rejected.append(str(exc))
    return tuple(endpoints), tuple(rejected)


def decode_update(msg: destination_pb2.Update) -> Update:
    """An `Update`; malformed addresses are left out and named in `rejected`. DecodeError when no
    update is set at all."""
    kind = msg.WhichOneof("update")
    if kind == "add":
        endpoints, rejected = _decode_all(msg.add.addrs, msg.add.metric_labels)
        return Add(endpoints, rejected)
    if kind == "remove":
        addrs, problems = [], []
        for item in msg.remove.addrs:
            try:
                addrs.append(decode_addr(item))
            except DecodeError as exc:
                problems.append(str(exc))
        return Remove(tuple(addrs), tuple(problems))
    if kind == "no_endpoints":
        return NoEndpoints(msg.no_endpoints.exists)
    raise DecodeError("Update with no update set")
