"""The tap match table: each leaf, the combinators, and what is refused."""

from __future__ import annotations

import ipaddress
import time
from typing import Any

import pytest

from meshlet.api import tap_pb2
from meshlet.proxy.tap.match import (
    MAX_DEPTH,
    MAX_LEAVES,
    InvalidMatch,
    Seen,
    compile_match,
    parse_addr,
)

Match = tap_pb2.ObserveRequest.Match

SEEN = Seen(
    method="POST", scheme="http", authority="web.ns.svc.cluster.local:80", path="/api/v1?x=1",
    source=parse_addr("10.1.2.3", 40000), destination=parse_addr("10.9.8.7", 8080),
    destination_labels={"namespace": "ns", "service": "web"}, route_labels={"route": "api"},
)  # fmt: skip


def _net(ip: str, mask: int) -> Any:
    m = Match.Tcp(netmask=Match.Tcp.Netmask(mask=mask))
    address = ipaddress.ip_address(ip)
    if address.version == 4:
        m.netmask.ip.ipv4 = int(address)
    else:
        m.netmask.ip.ipv6.first, m.netmask.ip.ipv6.last = (
            int(address) >> 64,
            int(address) & (2**64 - 1),
        )
    return m


def _http(**kw: Any) -> Any:
    return Match(http=Match.Http(**kw))


S = Match.Http.StringMatch
GET, POST = _http(method={"registered": 0}), _http(method={"registered": 1})
CASES = [
    (Match(), True),
    (Match(all=Match.Seq()), True),
    (Match(any=Match.Seq()), False),
    (Match(source=_net("10.1.0.0", 16)), True),
    (Match(source=_net("10.2.0.0", 16)), False),
    (Match(destination=_net("10.9.8.7", 32)), True),
    (Match(destination=_net("::1", 128)), False),
    (Match(destination=Match.Tcp(ports=Match.Tcp.PortRange(min=8000, max=8100))), True),
    (Match(destination=Match.Tcp(ports=Match.Tcp.PortRange(min=9000, max=9100))), False),
    (Match(source=Match.Tcp(ports=Match.Tcp.PortRange(min=40000))), True),
    (_http(scheme={"registered": 0}), True),
    (_http(scheme={"registered": 1}), False),
    (_http(method={"registered": 1}), True),
    (_http(method={"registered": 0}), False),
    (_http(method={"unregistered": "POST"}), True),
    (_http(authority=S(exact="web.ns.svc.cluster.local:80")), True),
    (_http(authority=S(exact="web")), False),
    (_http(authority=S(prefix="web.ns.")), True),
    (_http(path=S(prefix="/api/")), True),
    (_http(path=S(exact="/api/v1")), False),
    (Match(destination_label=Match.Label(key="service", value="web")), True),
    (Match(destination_label=Match.Label(key="service", value="db")), False),
    (Match(route_label=Match.Label(key="route", value="api")), True),
    (Match(route_label=Match.Label(key="route", value="x")), False),
    (Match(**{"not": _http(path=S(prefix="/api/"))}), False),
    (
        Match(all=Match.Seq(matches=[_http(method={"registered": 1}), _http(path=S(prefix="/x"))])),
        False,
    ),
    (
        Match(
            any=Match.Seq(matches=[_http(method={"registered": 0}), _http(path=S(prefix="/api"))])
        ),
        True,
    ),
]


@pytest.mark.parametrize(("match", "expected"), CASES)
def test_match_table(match: Any, expected: bool) -> None:
    assert compile_match(match)(SEEN) is expected


def test_an_unknown_address_matches_no_address_leaf() -> None:
    unknown = SEEN._replace(source=None)
    assert (
        compile_match(Match(source=Match.Tcp(ports=Match.Tcp.PortRange(min=0))))(unknown) is False
    )


@pytest.mark.parametrize(
    ("match", "why"),
    [
        (Match(source=_net("10.0.0.0", 33)), "netmask /33"),
        (Match(source=Match.Tcp(ports=Match.Tcp.PortRange(min=90, max=80))), "port range"),
        (Match(source=Match.Tcp(netmask=Match.Tcp.Netmask(mask=8))), "needs an IP"),
    ],
)
def test_malformed_matches_are_refused(match: Any, why: str) -> None:
    with pytest.raises(InvalidMatch, match=why):
        compile_match(match)


def test_depth_is_bounded() -> None:
    match = Match()
    for _ in range(MAX_DEPTH + 2):
        match = Match(**{"not": match})
    with pytest.raises(InvalidMatch, match="deeper"):
        compile_match(match)


def _port(low: int, high: int = 0) -> Any:
    return Match(destination=Match.Tcp(ports=Match.Tcp.PortRange(min=low, max=high)))


def test_a_port_range_without_max_is_its_min_alone() -> None:
    # tap.proto: "Inclusive; `max` 0 means `min` alone": 8000 is not 8080 (SEEN's port)
    assert compile_match(_port(8000))(SEEN) is False
    assert compile_match(_port(8080))(SEEN) is True
    assert compile_match(_port(8000, 8080))(SEEN) is True
    assert compile_match(_port(8081, 9000))(SEEN) is False


def _not(inner: Any) -> Any:
    return Match(**{"not": inner})


def _leaves(n: int) -> Any:
    return Match(all=Match.Seq(matches=[_http(path=S(prefix="/"))] * n))


def test_the_leaves_of_a_match_are_bounded() -> None:
    assert compile_match(_leaves(MAX_LEAVES))(SEEN) is True
    with pytest.raises(InvalidMatch, match=f"more than {MAX_LEAVES} leaves"):
        compile_match(_leaves(MAX_LEAVES + 1))
    # spread over branches, counted all the same; empty matches and `not` count too
    half = MAX_LEAVES // 2 + 1
    spread = Match(any=Match.Seq(matches=[_leaves(half), _not(_leaves(half))]))
    with pytest.raises(InvalidMatch, match="leaves"):
        compile_match(spread)
    empties = Match(any=Match.Seq(matches=[Match(all=Match.Seq())] * (MAX_LEAVES + 1)))
    with pytest.raises(InvalidMatch, match="leaves"):
        compile_match(empties)


def test_a_million_leaves_are_refused_at_once() -> None:
    # as a client sends it: `any` of 1,000,000 empty matches, 2 bytes each on the wire
    seq = b"\x0a\x00" * 1_000_000
    size = len(seq)
    varint = bytearray()
    while size > 0x7F:
        varint.append(size & 0x7F | 0x80)
        size >>= 7
    varint.append(size)
    huge = Match.FromString(b"\x12" + bytes(varint) + seq)
    assert len(huge.any.matches) == 1_000_000
    started = time.perf_counter()
    with pytest.raises(InvalidMatch, match="leaves"):
        compile_match(huge)
    assert time.perf_counter() - started < 0.05
