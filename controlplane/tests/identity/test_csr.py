"""Certification requests: each malformed or abusive CSR meets the right status code."""

from __future__ import annotations

import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from meshlet.controlplane.identity import csr
from meshlet.controlplane.identity.errors import CertifyError

NAME = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def make_csr(
    sans: list[x509.GeneralName] | None = None,
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | None = None,
) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([]))
    if sans is None:
        sans = [x509.DNSName(NAME)]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def test_accepts_a_good_csr() -> None:
    key = csr.check_csr(NAME, make_csr())
    assert isinstance(key.curve, ec.SECP256R1)


def _broken_signature() -> bytes:
    der = bytearray(make_csr())
    der[-5] ^= 0xFF  # inside the signature value
    return bytes(der)


@pytest.mark.parametrize(
    ("der", "code", "message"),
    [
        (b"", INVALID, "not DER"),
        (b"\x30\x03\x02\x01\x00", INVALID, "not DER"),
        (b"garbage" * 10, INVALID, "not DER"),
        (make_csr(sans=[]), PRECONDITION, "no subjectAltName"),
        (
            make_csr(sans=[x509.DNSName(NAME), x509.DNSName("other." + NAME)]),
            PRECONDITION,
            "has 2",
        ),
        (make_csr(sans=[x509.DNSName("evil." + NAME)]), PRECONDITION, "exactly one DNS SAN"),
        (
            make_csr(sans=[x509.DNSName(NAME), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))]),
            PRECONDITION,
            "only a DNS SAN, not IPAddress",
        ),
        (
            make_csr(sans=[x509.DNSName(NAME), x509.UniformResourceIdentifier("spiffe://x/y")]),
            PRECONDITION,
            "UniformResourceIdentifier",
        ),
        (
            make_csr(sans=[x509.DNSName(NAME), x509.RFC822Name("a@b.c")]),
            PRECONDITION,
            "RFC822Name",
        ),
        (
            make_csr(key=rsa.generate_private_key(public_exponent=65537, key_size=2048)),
            PRECONDITION,
            "ECDSA P-256",
        ),
        (make_csr(key=ec.generate_private_key(ec.SECP384R1())), PRECONDITION, "ECDSA P-256"),
        (_broken_signature(), PRECONDITION, "signature"),
    ],
    ids=[
        "empty",
        "truncated-der",
        "garbage",
        "no-san",
        "two-sans",
        "other-name",
        "ip-san",
        "uri-san",
        "email-san",
        "rsa-key",
        "p384-key",
        "bad-signature",
    ],
)
def test_refuses(der: bytes, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(CertifyError, match=message) as caught:
        csr.check_csr(NAME, der)
    assert caught.value.code == code


@pytest.mark.parametrize(
    ("identity", "token", "der", "message"),
    [
        ("", b"t", b"c", "missing field\\(s\\): identity"),
        (NAME, b"", b"", "missing field\\(s\\): token, certificate_signing_request"),
        (NAME, b"t", b"x" * (csr.MAX_CSR_BYTES + 1), "CSR of 4097 bytes exceeds"),
        (NAME, b"t" * (csr.MAX_TOKEN_BYTES + 1), b"c", "token of 16385 bytes exceeds"),
        ("web.emojivoto", b"t", b"c", "is not of the form"),
        ("é" * 300, b"t", b"c", "is not of the form"),
    ],
)
def test_field_checks(identity: str, token: bytes, der: bytes, message: str) -> None:
    with pytest.raises(CertifyError, match=message) as caught:
        csr.check_fields(identity, token, der)
    assert caught.value.code == INVALID
