"""The one host:port grammar: what each kind of setting accepts and how it says no."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.hostport import format_hostport, parse_hostport


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


@given(st.text(max_size=40))
def test_anything_parses_or_is_refused_with_value_error(text: str) -> None:
    try:
        host, port = parse_hostport(text, default_port=80)
    except ValueError:
        return
    assert host and 1 <= port <= 65535
