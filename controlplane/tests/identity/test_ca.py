"""Trust anchors and issuers: what is created, and which material is refused."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography import x509

from meshlet.controlplane.identity import ca

NOW = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)


def test_anchor_and_issuer_are_p256_cas() -> None:
    anchor, anchor_key = ca.create_trust_anchor(NOW)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, NOW)
    for cert in (anchor, issuer):
        assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert anchor.not_valid_after_utc - NOW == ca.ANCHOR_LIFETIME
    issuer.verify_directly_issued_by(anchor)
    loaded = ca.load_issuer(ca.cert_pem(issuer), ca.key_pem(issuer_key), ca.cert_pem(anchor))
    assert loaded.cert == issuer
    assert loaded.not_after == min(issuer.not_valid_after_utc, anchor.not_valid_after_utc)


def test_issuer_never_outlives_its_anchor() -> None:
    anchor, anchor_key = ca.create_trust_anchor(NOW, lifetime=dt.timedelta(days=30))
    issuer, _ = ca.create_issuer(anchor, anchor_key, NOW, lifetime=dt.timedelta(days=365))
    assert issuer.not_valid_after_utc == anchor.not_valid_after_utc


def _material() -> dict[str, Any]:
    anchor, anchor_key = ca.create_trust_anchor(NOW)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, NOW)
    return {
        "anchor": anchor,
        "anchor_key": anchor_key,
        "issuer": issuer,
        "issuer_key": issuer_key,
    }


def test_refuses_issuer_from_another_anchor() -> None:
    mine, theirs = _material(), _material()
    with pytest.raises(ca.IssuerError, match="does not chain to the trust anchors"):
        ca.load_issuer(
            ca.cert_pem(theirs["issuer"]),
            ca.key_pem(theirs["issuer_key"]),
            ca.cert_pem(mine["anchor"]),
        )


def test_refuses_key_that_does_not_match() -> None:
    m = _material()
    with pytest.raises(ca.IssuerError, match="does not match"):
        ca.load_issuer(
            ca.cert_pem(m["issuer"]), ca.key_pem(m["anchor_key"]), ca.cert_pem(m["anchor"])
        )


def test_refuses_non_ca_issuer(test_ca: Any) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    from meshlet.controlplane.identity.signer import issue_leaf

    m = _material()
    issuer = ca.load_issuer(
        ca.cert_pem(m["issuer"]), ca.key_pem(m["issuer_key"]), ca.cert_pem(m["anchor"])
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = issue_leaf(
        issuer, leaf_key.public_key(), "web.ns.serviceaccount.identity.meshlet.cluster.local", NOW
    )
    leaf_cert = x509.load_der_x509_certificate(leaf.der)
    with pytest.raises(ca.IssuerError, match="is not a CA"):
        ca.load_issuer(
            ca.cert_pem(leaf_cert, m["issuer"]), ca.key_pem(leaf_key), ca.cert_pem(m["anchor"])
        )


@pytest.mark.parametrize(
    ("cert", "key", "anchors", "error"),
    [
        (b"junk", None, None, "not PEM"),
        (None, b"junk", None, "not an unencrypted PEM private key"),
        (None, None, b"junk", "not PEM certificates"),
    ],
)
def test_refuses_unparsable_material(
    cert: bytes | None, key: bytes | None, anchors: bytes | None, error: str
) -> None:
    m = _material()
    with pytest.raises(ca.IssuerError, match=error):
        ca.load_issuer(
            cert or ca.cert_pem(m["issuer"]),
            key or ca.key_pem(m["issuer_key"]),
            anchors or ca.cert_pem(m["anchor"]),
        )


def test_refuses_anchor_that_is_not_a_ca() -> None:
    m = _material()
    from cryptography.hazmat.primitives.asymmetric import ec

    from meshlet.controlplane.identity.signer import issue_leaf

    issuer = ca.load_issuer(
        ca.cert_pem(m["issuer"]), ca.key_pem(m["issuer_key"]), ca.cert_pem(m["anchor"])
    )
    leaf = x509.load_der_x509_certificate(
        issue_leaf(
            issuer,
            ec.generate_private_key(ec.SECP256R1()).public_key(),
            "web.ns.serviceaccount.identity.meshlet.cluster.local",
            NOW,
        ).der
    )
    with pytest.raises(ca.IssuerError, match=r"trust anchor .* is not a CA"):
        ca.load_anchors(ca.cert_pem(leaf))
