"""The contracts' wire bytes, pinned: a change here breaks every deployed proxy."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api import addr, destination_pb2, identity_pb2, net_pb2, transport_header
from meshlet.api.transport_header import Header, SessionProtocol


def test_tcp_address_bytes() -> None:
    msg = addr.tcp_to_proto(ipaddress.IPv4Address("10.1.2.3"), 8080)
    assert msg.SerializeToString().hex() == "0a050d0302010a10903f"


def test_update_add_bytes() -> None:
    update = destination_pb2.Update(
        add=destination_pb2.WeightedAddrSet(
            addrs=[
                destination_pb2.WeightedAddr(
                    addr=addr.tcp_to_proto(ipaddress.IPv4Address("10.1.2.3"), 8080), weight=10000
                )
            ]
        )
    )
    assert update.SerializeToString().hex() == "0a110a0f0a0a0a050d0302010a10903f18904e"


def test_transport_header_bytes() -> None:
    encoded = transport_header.encode(Header(port=8080, protocol=SessionProtocol.HTTP2))
    assert encoded == b"transport.l5d.io/v1\r\n\r\n" + bytes.fromhex("0000000708903f1a021200")


def test_ipv4_is_big_endian_integer() -> None:
    assert addr.ip_to_proto(ipaddress.IPv4Address("10.1.2.3")).ipv4 == 0x0A010203


def test_ipv6_halves() -> None:
    msg = addr.ip_to_proto(ipaddress.IPv6Address("2001:db8::1"))
    assert msg.ipv6.first == 0x20010DB800000000
    assert msg.ipv6.last == 1


@given(st.ip_addresses())
def test_ip_round_trip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    wire = addr.ip_to_proto(ip).SerializeToString()
    parsed = net_pb2.IPAddress()
    parsed.ParseFromString(wire)
    assert addr.ip_from_proto(parsed) == ip


def test_empty_ip_is_rejected() -> None:
    with pytest.raises(ValueError, match="no address"):
        addr.ip_from_proto(net_pb2.IPAddress())


def test_method_paths_match_linkerd() -> None:
    destination = destination_pb2.DESCRIPTOR.services_by_name["Destination"]
    identity = identity_pb2.DESCRIPTOR.services_by_name["Identity"]
    assert destination.full_name == "io.linkerd.proxy.destination.Destination"
    assert [m.name for m in destination.methods] == ["Get", "GetProfile"]
    assert identity.full_name == "io.linkerd.proxy.identity.Identity"
    assert [m.name for m in identity.methods] == ["Certify"]


def test_weighted_addr_field_numbers() -> None:
    fields = {f.name: f.number for f in destination_pb2.WeightedAddr.DESCRIPTOR.fields}
    assert fields == {
        "addr": 1,
        "weight": 3,
        "metric_labels": 4,
        "tls_identity": 5,
        "protocol_hint": 6,
        "authority_override": 7,
        "http2": 8,
        "resource_ref": 9,
    }
    tls = {f.name: f.number for f in destination_pb2.TlsIdentity.DESCRIPTOR.fields}
    assert tls == {"dns_like_identity": 1, "uri_like_identity": 3, "server_name": 4}


@pytest.mark.parametrize("protocol", list(SessionProtocol))
@pytest.mark.parametrize("name", ["", "web.emojivoto.svc.cluster.local:80"])
def test_transport_header_round_trip(protocol: SessionProtocol, name: str) -> None:
    header = Header(port=4143, name=name, protocol=protocol)
    encoded = transport_header.encode(header) + b"GET / HTTP/1.1\r\n"
    assert transport_header.decode(encoded) == transport_header.Decoded(
        header, len(encoded) - len(b"GET / HTTP/1.1\r\n")
    )


def test_transport_header_arrives_in_pieces() -> None:
    encoded = transport_header.encode(Header(port=80, protocol=SessionProtocol.HTTP1))
    for cut in range(len(encoded)):
        result = transport_header.decode(encoded[:cut])
        assert isinstance(result, transport_header.Incomplete)
        assert cut < result.needed <= len(encoded)
    assert isinstance(transport_header.decode(encoded), transport_header.Decoded)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"GET / HTTP/1.1\r\n", "preface"),
        (transport_header.PREFACE + (10_000).to_bytes(4, "big"), "exceeds"),
        (transport_header.PREFACE + b"\x00\x00\x00\x02\xff\xff", "not a valid message"),
        (transport_header.PREFACE + b"\x00\x00\x00\x00", "port 0"),
        (transport_header.PREFACE + b"\x00\x00\x00\x03\x08\x80\x80", "not a valid message"),
    ],
)
def test_transport_header_rejects(data: bytes, error: str) -> None:
    with pytest.raises(transport_header.TransportHeaderError, match=error):
        transport_header.decode(data)
