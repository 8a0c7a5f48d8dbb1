"""Destination paths: what is a service, an IP lookup, or invalid."""

from __future__ import annotations

import ipaddress

import pytest

from meshlet.controlplane.destination.paths import IPPort, PathError, ServiceName, parse


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("web.emojivoto.svc.cluster.local:8080", ServiceName("emojivoto", "web", 8080)),
        ("web.emojivoto.svc.cluster.local", ServiceName("emojivoto", "web", 80)),
        ("Web.Emojivoto.svc.cluster.local.:80", ServiceName("emojivoto", "web", 80)),
    ],
)
def test_service_names(path: str, expected: ServiceName) -> None:
    assert parse(path) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("10.1.2.3:8080", IPPort(ipaddress.ip_address("10.1.2.3"), 8080)),
        ("[fd00::1]:80", IPPort(ipaddress.ip_address("fd00::1"), 80)),
    ],
)
def test_ip_lookups(path: str, expected: IPPort) -> None:
    assert parse(path, allow_ip=True) == expected


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "empty"),
        ("10.1.2.3:8080", "IP address is not a service"),
        ("[fd00::1]:80", "IP address is not a service"),
        ("fd00::1", "IP address is not a service"),
        ("web.emojivoto.svc.cluster.local:0", "1-65535"),
        ("web.emojivoto.svc.cluster.local:70000", "1-65535"),
        ("web.emojivoto.svc.cluster.local:http", "1-65535"),
        ("web.emojivoto.svc.cluster.local:-1", "1-65535"),
        ("web.emojivoto.svc.cluster.local:0000080", "1-65535"),
        ("example.com:80", "not a service name"),
        ("emojivoto.svc.cluster.local:80", "not a service name"),
        ("a.web.emojivoto.svc.cluster.local:80", "not a service name"),
        ("-web.emojivoto.svc.cluster.local:80", "not a service name"),
        ("w_b.emojivoto.svc.cluster.local:80", "not a service name"),
        ("x" * 64 + ".ns.svc.cluster.local:80", "not a service name"),
        ("x" * 300 + ".ns.svc.cluster.local:80", "longer than a DNS name"),
        ("wéb.emojivoto.svc.cluster.local:80", "not ASCII"),
        ("[fd00::1:80", "malformed"),
    ],
)
def test_invalid(path: str, message: str) -> None:
    with pytest.raises(PathError, match=message):
        parse(path)


def test_ip_lookup_needs_port() -> None:
    with pytest.raises(PathError, match="needs a port"):
        parse("10.1.2.3", allow_ip=True)
