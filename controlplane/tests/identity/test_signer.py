"""Leaf certificates: contents, validity window, and the issuer's limits."""

from __future__ import annotations

import datetime as dt

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca
from meshlet.controlplane.identity.errors import CertifyError
from meshlet.controlplane.identity.signer import issue_leaf

NOW = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)
NAME = wellknown.identity_name("web", "emojivoto")


def _issuer(now: dt.datetime = NOW, lifetime: dt.timedelta = ca.ISSUER_LIFETIME) -> ca.Issuer:
    anchor, anchor_key = ca.create_trust_anchor(now)
    cert, key = ca.create_issuer(anchor, anchor_key, now, lifetime)
    return ca.load_issuer(ca.cert_pem(cert), ca.key_pem(key), ca.cert_pem(anchor))


def _leaf(issuer: ca.Issuer, name: str = NAME, now: dt.datetime = NOW) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    return x509.load_der_x509_certificate(issue_leaf(issuer, key.public_key(), name, now).der)


def test_leaf_contents() -> None:
    issuer = _issuer()
    leaf = _leaf(issuer)
    leaf.verify_directly_issued_by(issuer.cert)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [NAME]
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://cluster.local/ns/emojivoto/sa/web"
    ]
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_encipherment and not usage.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert leaf.not_valid_before_utc == NOW - dt.timedelta(seconds=20)
    assert leaf.not_valid_after_utc == NOW + dt.timedelta(hours=24, seconds=20)
    assert leaf.signature_hash_algorithm is not None
    assert leaf.signature_hash_algorithm.name == "sha256"
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == NAME


def test_long_identity_lives_in_the_san_only() -> None:
    name = wellknown.identity_name("s" * 63, "n" * 63)
    assert len(name) > 64
    leaf = _leaf(_issuer(), name)
    assert len(leaf.subject) == 0
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical
    assert san.value.get_values_for_type(x509.DNSName) == [name]


def test_leaf_never_outlives_issuer() -> None:
    issuer = _issuer(NOW - dt.timedelta(days=1), lifetime=dt.timedelta(days=1, hours=2))
    leaf = _leaf(issuer)
    assert leaf.not_valid_after_utc == issuer.not_after
    assert leaf.not_valid_after_utc < NOW + dt.timedelta(hours=24)


def test_expired_issuer_signs_nothing() -> None:
    issuer = _issuer(NOW - dt.timedelta(days=2), lifetime=dt.timedelta(days=1))
    with pytest.raises(CertifyError, match="issuer expired") as caught:
        _leaf(issuer)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_issuer_not_yet_valid_signs_nothing() -> None:
    issuer = _issuer(NOW + dt.timedelta(hours=1))
    with pytest.raises(CertifyError, match="not valid before"):
        _leaf(issuer)
