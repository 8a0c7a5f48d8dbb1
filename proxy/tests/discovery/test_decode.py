"""DiscoveredEndpoint values decoded from the destination service's `Update` and `WeightedAddr`."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api import addr, destination_pb2
from meshlet.controlplane.destination import endpoints as cp
from meshlet.controlplane.destination import translator
from meshlet.proxy.core.endpoints import (
    Add,
    DiscoveredEndpoint,
    Hint,
    NoEndpoints,
    Remove,
    TlsIdentity,
)
from meshlet.proxy.discovery.decode import DecodeError, decode_endpoint, decode_update

WEB_ID = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"


def weighted(ip: str, port: int = 8080, **labels: str) -> destination_pb2.WeightedAddr:
    return destination_pb2.WeightedAddr(
        addr=addr.tcp_to_proto(ipaddress.ip_address(ip), port), weight=10000, metric_labels=labels
    )


def meshed(ip: str, *, opaque: bool = False) -> destination_pb2.WeightedAddr:
    msg = weighted(ip, pod="web-1", serviceaccount="web")
    msg.tls_identity.dns_like_identity.name = WEB_ID
    msg.tls_identity.server_name.name = WEB_ID
    (msg.protocol_hint.opaque if opaque else msg.protocol_hint.h2).SetInParent()
    msg.protocol_hint.opaque_transport.inbound_port = 4143
    return msg


def add(*msgs: destination_pb2.WeightedAddr, **labels: str) -> destination_pb2.Update:
    return destination_pb2.Update(
        add=destination_pb2.WeightedAddrSet(addrs=list(msgs), metric_labels=labels)
    )


def test_a_meshed_endpoint_carries_its_identity_and_hints() -> None:
    update = decode_update(add(meshed("10.0.0.1"), service="web", namespace="emojivoto"))
    assert update == Add(
        (
            DiscoveredEndpoint(
                addr=("10.0.0.1", 8080),
                weight=10000,
                labels=(
                    ("namespace", "emojivoto"),
                    ("pod", "web-1"),
                    ("service", "web"),
                    ("serviceaccount", "web"),
                ),
                identity=TlsIdentity(WEB_ID, WEB_ID),
                hint=Hint.H2,
                opaque_transport_port=4143,
            ),
        )
    )


def test_an_unmeshed_endpoint_has_no_identity_and_no_hints() -> None:
    [endpoint] = decode_update(add(weighted("10.0.0.2"))).endpoints  # type: ignore[union-attr]
    assert endpoint.identity is None
    assert endpoint.hint is None
    assert endpoint.opaque_transport_port is None


def test_opaque_hint_and_ipv6() -> None:
    endpoint = decode_endpoint(meshed("fd00::1", opaque=True), {})
    assert endpoint.addr == ("fd00::1", 8080)
    assert endpoint.hint is Hint.OPAQUE


def test_per_address_labels_override_set_labels() -> None:
    endpoint = decode_endpoint(weighted("10.0.0.1", zone="b"), {"zone": "a", "service": "web"})
    assert endpoint.labels == (("service", "web"), ("zone", "b"))


def test_a_server_name_without_identity_name_falls_back_to_the_name() -> None:
    msg = weighted("10.0.0.1")
    msg.tls_identity.dns_like_identity.name = WEB_ID
    assert decode_endpoint(msg, {}).identity == TlsIdentity(WEB_ID, WEB_ID)


def test_an_unusable_identity_rejects_the_address_instead_of_going_plaintext() -> None:
    broken = weighted("10.0.0.9")
    broken.tls_identity.SetInParent()  # present, but names nothing
    update = decode_update(add(meshed("10.0.0.1"), broken))
    assert isinstance(update, Add)
    assert [e.addr for e in update.endpoints] == [("10.0.0.1", 8080)]
    [reason] = update.rejected
    assert "tls_identity" in reason


def test_addresses_without_ip_or_port_are_rejected() -> None:
    no_ip = destination_pb2.WeightedAddr(weight=1)
    no_ip.addr.port = 80
    zero_port = weighted("10.0.0.1", port=0)
    update = decode_update(add(no_ip, zero_port))
    assert isinstance(update, Add)
    assert update.endpoints == ()
    assert len(update.rejected) == 2


def test_remove_and_no_endpoints_decode() -> None:
    remove = destination_pb2.Update(
        remove=destination_pb2.AddrSet(
            addrs=[addr.tcp_to_proto(ipaddress.ip_address("10.0.0.1"), 80)]
        )
    )
    assert decode_update(remove) == Remove((("10.0.0.1", 80),))
    none = destination_pb2.Update(no_endpoints=destination_pb2.NoEndpoints(exists=True))
    assert decode_update(none) == NoEndpoints(True)
    with pytest.raises(DecodeError, match="no update"):
        decode_update(destination_pb2.Update())


cp_endpoints_st = st.builds(
    cp.Endpoint,
    ip=st.sampled_from(["10.0.0.1", "10.0.0.2", "fd00::7"]),
    port=st.integers(1, 65535),
    labels=st.dictionaries(st.sampled_from(["pod", "zone"]), st.text(max_size=5)).map(
        lambda d: tuple(sorted(d.items()))
    ),
    identity=st.none() | st.just(WEB_ID),
    opaque=st.booleans(),
)


@given(cp_endpoints_st, st.dictionaries(st.sampled_from(["service", "zone"]), st.text(max_size=5)))
def test_decoding_what_the_control_plane_encodes(
    sent: cp.Endpoint, set_labels: dict[str, str]
) -> None:
    encoded = destination_pb2.WeightedAddrSet(
        addrs=[translator.weighted_addr(sent)], metric_labels=set_labels
    )
    update = decode_update(destination_pb2.Update(add=encoded))
    meshed = sent.identity is not None
    assert update == Add(
        (
            DiscoveredEndpoint(
                addr=(sent.ip, sent.port),
                weight=10000,
                labels=tuple(sorted({**set_labels, **dict(sent.labels)}.items())),
                identity=TlsIdentity(WEB_ID, WEB_ID) if meshed else None,
                hint=(Hint.OPAQUE if sent.opaque else Hint.H2) if meshed else None,
                opaque_transport_port=4143 if meshed else None,
            ),
        )
    )
