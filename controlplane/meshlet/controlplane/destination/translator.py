"""Endpoint-set changes as `Update` messages, following the Get stream rules (pure)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from meshlet.api import addr, destination_pb2, wellknown
from meshlet.controlplane.destination.endpoints import Endpoint, Resolution

WEIGHT = 10000


def weighted_addr(ep: Endpoint) -> destination_pb2.WeightedAddr:
    msg = destination_pb2.WeightedAddr(
        addr=addr.tcp_to_proto(ipaddress.ip_address(ep.ip), ep.port),
        weight=WEIGHT,
        metric_labels=dict(ep.labels),
    )
    if ep.identity is not None:
        msg.tls_identity.dns_like_identity.name = ep.identity
        msg.tls_identity.server_name.name = ep.identity
        if ep.opaque:
            msg.protocol_hint.opaque.SetInParent()
        else:
            msg.protocol_hint.h2.SetInParent()
        msg.protocol_hint.opaque_transport.inbound_port = wellknown.PROXY_INBOUND_PORT
    return msg


def _add(
    endpoints: Mapping[tuple[str, int], Endpoint], set_labels: Mapping[str, str]
) -> destination_pb2.Update:
    return destination_pb2.Update(
        add=destination_pb2.WeightedAddrSet(
            addrs=[weighted_addr(ep) for _, ep in sorted(endpoints.items())],
            metric_labels=dict(set_labels),
        )
    )


def _no_endpoints(exists: bool) -> destination_pb2.Update:
    return destination_pb2.Update(no_endpoints=destination_pb2.NoEndpoints(exists=exists))


def updates(
    old: Resolution | None, new: Resolution, set_labels: Mapping[str, str]
) -> list[destination_pb2.Update]:
    """The messages that take a client from `old` (None: nothing sent yet) to `new`.

    New and changed endpoints are added before gone ones are removed, so a client never sees
    a transiently empty set; removing the last endpoint is followed by no_endpoints.
    """
    if old is None:
        if new.endpoints:
            return [_add(new.endpoints, set_labels)]
        return [_no_endpoints(new.exists)]
    messages = []
    changed = {a: ep for a, ep in new.endpoints.items() if old.endpoints.get(a) != ep}
    if changed:
        messages.append(_add(changed, set_labels))
    gone = sorted(set(old.endpoints) - set(new.endpoints))
    if gone:
        messages.append(
            destination_pb2.Update(
                remove=destination_pb2.AddrSet(
                    addrs=[addr.tcp_to_proto(ipaddress.ip_address(ip), port) for ip, port in gone]
                )
            )
        )
    if not new.endpoints and (old.endpoints or old.exists != new.exists):
        messages.append(_no_endpoints(new.exists))
    return messages
