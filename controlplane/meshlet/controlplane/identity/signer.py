"""Leaf certificates for workload identities, never outliving their issuer."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlet.api import wellknown
from meshlet.controlplane.identity.ca import Issuer
from meshlet.controlplane.identity.errors import CertifyError

LEAF_LIFETIME: Final = dt.timedelta(seconds=wellknown.LEAF_LIFETIME_SECONDS)
SKEW: Final = dt.timedelta(seconds=wellknown.CLOCK_SKEW_SECONDS)
_CN_MAX: Final = 64  # X.509 upper bound of a common name


@dataclass(frozen=True, slots=True)
class Leaf:
    der: bytes
    not_after: dt.datetime


def check_issuer_usable(issuer: Issuer, now: dt.datetime) -> None:
    if now >= issuer.not_after:
        raise CertifyError(
            grpc.StatusCode.UNAVAILABLE,
            f"issuer expired at {issuer.not_after.isoformat()}; rotate the issuer certificate",
        )
    if now < issuer.not_before:
        raise CertifyError(
            grpc.StatusCode.UNAVAILABLE,
            f"issuer is not valid before {issuer.not_before.isoformat()}; check the clock",
        )


def issue_leaf(
    issuer: Issuer,
    public_key: ec.EllipticCurvePublicKey,
    identity: str,
    now: dt.datetime,
    lifetime: dt.timedelta = LEAF_LIFETIME,
) -> Leaf:
    """Signs a leaf for `identity`; not_after is clamped to the issuer chain's expiry."""
    check_issuer_usable(issuer, now)
    not_after = min(now + lifetime + SKEW, issuer.not_after)
    parsed = wellknown.parse_identity_name(identity)
    sans: list[x509.GeneralName] = [x509.DNSName(identity)]
    if parsed is not None:
        sa, ns, _, trust_domain = parsed
        sans.append(x509.UniformResourceIdentifier(wellknown.spiffe_uri(sa, ns, trust_domain)))
    subject = (
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)])
        if len(identity) <= _CN_MAX
        else x509.Name([])
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        # RFC 5280 §4.2.1.6: with an empty subject the SAN extension is critical.
        .add_extension(x509.SubjectAlternativeName(sans), critical=not subject)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
        .sign(issuer.key, hashes.SHA256())
    )
    return Leaf(der=cert.public_bytes(serialization.Encoding.DER), not_after=not_after)


def write_serving_files(
    issuer: Issuer, name: str, directory: Path, now: dt.datetime, lifetime: dt.timedelta
) -> tuple[Path, Path]:
    """A fresh key and a leaf for `name` (a control-plane service's TLS identity), written as
    `<name>.crt` (the leaf and the issuer chain, PEM) and `<name>.key` (mode 0600) in
    `directory`; returns the two paths."""
    from meshlet.controlplane.identity import ca

    key = ca.new_key()
    leaf = issue_leaf(issuer, key.public_key(), name, now, lifetime)
    directory.mkdir(parents=True, exist_ok=True)
    chain, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    leaf_pem = x509.load_der_x509_certificate(leaf.der).public_bytes(serialization.Encoding.PEM)
    chain.write_bytes(leaf_pem + ca.cert_pem(*issuer.chain))
    key_path.touch(mode=0o600)
    key_path.write_bytes(ca.key_pem(key))
    return chain, key_path
