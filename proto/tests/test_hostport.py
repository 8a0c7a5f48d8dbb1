"""The one host:port grammar and address type: what each kind of setting accepts, how it says
no, and how an address prints (IPv6 in brackets, wherever it is printed)."""

from __future__ import annotations

import logging
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.hostport import HostPort, format_hostport, parse_hostport


@pytest.mark.parametrize(
    ("text", "options", "expected"),
    [
        ("10.0.0.1:80", {}, ("10.0.0.1", 80)),
        ("[fd00::1]:8086", {}, ("fd00::1", 8086)),
        ("web.ns.svc.cluster.local:8086", {}, ("web.ns.svc.cluster.local", 8086)),
        ("web", {"default_port": 80}, ("web", 80)),
        ("[fd00::1]", {"default_port": 80}, ("fd00::1", 80)),
        (":8080", {"empty_host": "0.0.0.0"}, ("0.0.0.0", 8080)),
        ("127.0.0.1:0", {"names": False, "port_zero": True}, ("127.0.0.1", 0)),
    ],
)
def test_accepted(text: str, options: dict[str, object], expected: tuple[str, int]) -> None:
    assert parse_hostport(text, **options) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "options", "says"),
    [
        ("nowhere", {}, "has no port"),
        ("web:http", {}, "is not a port"),
        ("web:70000", {}, "outside 1-65535"),
        ("web:0", {}, "outside 1-65535"),
        ("fd00::1:80", {}, "[addr]:port"),
        ("[web]:80", {}, "not an IPv6 address"),
        ("web.local:80", {"names": False}, "not an IP address"),
        (":8080", {}, "names no host"),
        ("a b:80", {}, "not host:port"),
        ("user@host:80", {}, "not host:port"),
        ("-bad-.example:80", {}, "not a host name"),
        ("web:٣", {}, "is not a port"),
    ],
)
def test_refused_with_a_reason(text: str, options: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_hostport(text, **options)  # type: ignore[arg-type]
    assert says in str(caught.value)


@given(st.ip_addresses(), st.integers(1, 65535))
def test_format_then_parse_is_identity(ip: object, port: int) -> None:
    host = str(ip)
    assert parse_hostport(format_hostport(host, port), names=False) == (host, port)


_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
_NAME = st.lists(_LABEL, min_size=1, max_size=4).map(".".join)


@given(st.one_of(st.ip_addresses().map(str), _NAME), st.integers(1, 65535))
def test_an_address_prints_as_it_parses(host: str, port: int) -> None:
    parsed = parse_hostport(str(HostPort(host, port)))
    assert type(parsed) is HostPort
    assert parsed == HostPort(host, port)
    assert str(parsed) == format_hostport(host, port)


@pytest.mark.parametrize(
    ("addr", "text"),
    [
        (HostPort("10.0.0.1", 80), "10.0.0.1:80"),
        (HostPort("::1", 8080), "[::1]:8080"),
        (HostPort("fd00::1", 4143), "[fd00::1]:4143"),
        (HostPort("web.ns.svc.cluster.local", 8086), "web.ns.svc.cluster.local:8086"),
        (HostPort("0.0.0.0", 0), "0.0.0.0:0"),
    ],
)
def test_an_address_prints_one_way_everywhere(
    addr: HostPort, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert str(addr) == f"{addr}" == format_hostport(*addr) == text
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("connect to %s failed", addr)
    assert caplog.messages == [f"connect to {text} failed"]


def test_an_address_is_the_tuple_sockets_take() -> None:
    addr = HostPort("10.0.0.1", 80)
    assert addr == ("10.0.0.1", 80) and hash(addr) == hash(("10.0.0.1", 80))
    host, port = addr
    assert (host, port) == (addr.host, addr.port)
    with socket.socket() as sock:
        sock.bind(HostPort("127.0.0.1", 0))
        assert HostPort.from_sockaddr(sock.getsockname()).host == "127.0.0.1"


@pytest.mark.parametrize(
    ("sockaddr", "expected"),
    [
        (("10.0.0.1", 80), HostPort("10.0.0.1", 80)),
        (("::1", 8080, 0, 0), HostPort("::1", 8080)),  # IPv6: flowinfo and scope id dropped
    ],
)
def test_a_socket_address_becomes_an_address(
    sockaddr: tuple[object, ...], expected: HostPort
) -> None:
    got = HostPort.from_sockaddr(sockaddr)
    assert type(got) is HostPort and got == expected


def test_a_socket_address_of_another_family_is_refused() -> None:
    with pytest.raises(TypeError, match="not an IP socket address"):
        HostPort.from_sockaddr(("/run/socket", None))


@given(st.text(max_size=40))
def test_anything_parses_or_is_refused_with_value_error(text: str) -> None:
    try:
        host, port = parse_hostport(text, default_port=80)
    except ValueError:
        return
    assert host and 1 <= port <= 65535
