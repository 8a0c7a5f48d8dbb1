"""Who the tap server answers, and what a request asks of it."""

from __future__ import annotations

from meshlet.api import tap_pb2, wellknown
from meshlet.proxy.app import tap_identity
from meshlet.proxy.config import ProxyConfig, load
from meshlet.proxy.tap.server import wants_headers
from meshlet.proxy.tls.contexts import cert_identity

Extract = tap_pb2.ObserveRequest.Extract


def test_the_tap_controller_of_the_proxys_own_control_plane_by_default() -> None:
    name = wellknown.identity_name("web", "shop", "mesh-system", "example.org")
    assert tap_identity(ProxyConfig(identity_local_name=name)) == (
        "meshlet-tap.mesh-system.serviceaccount.identity.mesh-system.example.org"
    )
    assert tap_identity(ProxyConfig()) == wellknown.identity_name(
        wellknown.TAP_NAME, wellknown.CONTROL_PLANE_NAMESPACE
    )


def test_the_env_names_another() -> None:
    config = load({wellknown.ProxyEnv.TAP_SVC_NAME: "tap.example"})
    assert tap_identity(config) == "tap.example"


def test_peer_identity_is_the_dns_san() -> None:
    assert cert_identity(None) is None
    assert cert_identity({}) is None
    cert = {"subjectAltName": (("URI", "spiffe://x"), ("DNS", "a.b"))}
    assert cert_identity(cert) == "a.b"


def test_headers_only_when_asked() -> None:
    assert not wants_headers(tap_pb2.ObserveRequest())
    assert not wants_headers(tap_pb2.ObserveRequest(extract=Extract(http=Extract.Http())))
    asked = Extract(http=Extract.Http(headers=Extract.Http.Headers()))
    assert wants_headers(tap_pb2.ObserveRequest(extract=asked))
