"""Identity names and the well-known values other processes depend on."""

from __future__ import annotations

import pytest

from meshlet.api import wellknown


def test_identity_name_round_trip() -> None:
    name = wellknown.identity_name("web", "emojivoto")
    assert name == "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"
    assert wellknown.parse_identity_name(name) == ("web", "emojivoto", "meshlet", "cluster.local")


def test_control_plane_identities() -> None:
    assert wellknown.IDENTITY_SERVICE_NAME == (
        "meshlet-identity.meshlet.serviceaccount.identity.meshlet.cluster.local"
    )
    assert wellknown.DESTINATION_SERVICE_NAME == (
        "meshlet-destination.meshlet.serviceaccount.identity.meshlet.cluster.local"
    )


@pytest.mark.parametrize(
    "name",
    [
        "",
        "web.emojivoto",
        "web.emojivoto.serviceaccount.identity.meshlet",
        "Web.emojivoto.serviceaccount.identity.meshlet.cluster.local",
        "web..serviceaccount.identity.meshlet.cluster.local",
        "web.emojivoto.serviceaccount.identity.meshlet.cluster.local.",
        "a" * 64 + ".ns.serviceaccount.identity.meshlet.cluster.local",
        "web.emojivoto.serviceaccount.identity.meshlet.cluster.local\n",
    ],
)
def test_not_identity_names(name: str) -> None:
    assert wellknown.parse_identity_name(name) is None


def test_spiffe_uri() -> None:
    assert wellknown.spiffe_uri("web", "emojivoto") == "spiffe://cluster.local/ns/emojivoto/sa/web"


def test_proxy_ports_are_distinct_from_default_opaque_ports() -> None:
    assert not wellknown.PROXY_PORTS & wellknown.DEFAULT_OPAQUE_PORTS
