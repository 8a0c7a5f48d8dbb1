"""Trust anchors and issuers: creating them, loading them, and refusing bad ones."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from meshlet.api import wellknown

ANCHOR_LIFETIME = dt.timedelta(days=365)
ISSUER_LIFETIME = dt.timedelta(days=365)
ANCHOR_NAME = f"root.{wellknown.CONTROL_PLANE_NAMESPACE}.{wellknown.TRUST_DOMAIN}"
ISSUER_NAME = f"identity.{wellknown.CONTROL_PLANE_NAMESPACE}.{wellknown.TRUST_DOMAIN}"


class IssuerError(ValueError):
    """Issuer material that must not be used; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Issuer:
    """A CA certificate (with the intermediates above it) and its key, checked against anchors."""

    chain: tuple[x509.Certificate, ...]  # issuer first, then towards the anchors
    key: ec.EllipticCurvePrivateKey
    anchors: tuple[x509.Certificate, ...]

    @property
    def cert(self) -> x509.Certificate:
        return self.chain[0]

    @property
    def not_before(self) -> dt.datetime:
        return max(c.not_valid_before_utc for c in self.chain)

    @property
    def not_after(self) -> dt.datetime:
        """The last instant at which the whole chain to the anchors is valid."""
        return min(c.not_valid_after_utc for c in (*self.chain, *self.anchors))

    @property
    def chain_der(self) -> tuple[bytes, ...]:
        return tuple(c.public_bytes(serialization.Encoding.DER) for c in self.chain)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca_builder(
    subject: str,
    public_key: ec.EllipticCurvePublicKey,
    not_before: dt.datetime,
    not_after: dt.datetime,
    path_length: int | None,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def create_trust_anchor(
    now: dt.datetime, lifetime: dt.timedelta = ANCHOR_LIFETIME, name: str = ANCHOR_NAME
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed ECDSA P-256 root."""
    key = new_key()
    builder = _ca_builder(
        name, key.public_key(), now - _skew(), now + lifetime, path_length=None
    ).issuer_name(_name(name))
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False
    )
    return builder.sign(key, hashes.SHA256()), key


def create_issuer(
    anchor: x509.Certificate,
    anchor_key: ec.EllipticCurvePrivateKey,
    now: dt.datetime,
    lifetime: dt.timedelta = ISSUER_LIFETIME,
    name: str = ISSUER_NAME,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """An intermediate CA signed by `anchor`, never outliving it."""
    key = new_key()
    not_after = min(now + lifetime, anchor.not_valid_after_utc)
    builder = (
        _ca_builder(name, key.public_key(), now - _skew(), not_after, path_length=0)
        .issuer_name(anchor.subject)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(anchor_key.public_key()),
            critical=False,
        )
    )
    return builder.sign(anchor_key, hashes.SHA256()), key


def _skew() -> dt.timedelta:
    return dt.timedelta(seconds=wellknown.CLOCK_SKEW_SECONDS)


def cert_pem(*certs: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_anchors(pem: bytes) -> tuple[x509.Certificate, ...]:
    try:
        anchors = tuple(x509.load_pem_x509_certificates(pem))
    except ValueError as exc:
        raise IssuerError(f"trust anchors are not PEM certificates: {exc}") from exc
    for anchor in anchors:
        if not _is_ca(anchor):
            raise IssuerError(f"trust anchor {anchor.subject.rfc4514_string()} is not a CA")
    return anchors


def load_issuer(cert_pem_bytes: bytes, key_pem_bytes: bytes, anchors_pem: bytes) -> Issuer:
    """Parses and checks issuer material; raises IssuerError naming the first problem."""
    anchors = load_anchors(anchors_pem)
    try:
        chain = tuple(x509.load_pem_x509_certificates(cert_pem_bytes))
    except ValueError as exc:
        raise IssuerError(f"issuer certificate is not PEM: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_pem_bytes, password=None)
    except (ValueError, TypeError) as exc:
        raise IssuerError(f"issuer key is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise IssuerError("issuer key must be an ECDSA key")
    issuer = chain[0]
    if issuer.public_key() != key.public_key():
        raise IssuerError("issuer key does not match the issuer certificate")
    for cert in chain:
        if not _is_ca(cert):
            raise IssuerError(
                f"{cert.subject.rfc4514_string()} is not a CA (basicConstraints ca=false or"
                " missing keyCertSign); create the issuer with 'meshlet identity ca create'"
            )
    _check_chain(chain, anchors)
    return Issuer(chain=chain, key=key, anchors=anchors)


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    if not constraints.ca:
        return False
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return usage.key_cert_sign


def _check_chain(chain: Sequence[x509.Certificate], anchors: Sequence[x509.Certificate]) -> None:
    for child, parent in itertools.pairwise(chain):
        if not _issued_by(child, parent):
            raise IssuerError(
                f"{child.subject.rfc4514_string()} is not signed by the next certificate"
                " in the issuer chain"
            )
    top = chain[-1]
    if not any(_issued_by(top, anchor) for anchor in anchors):
        raise IssuerError(
            "the issuer does not chain to the trust anchors; issue it from the current anchor"
            " or add its anchor to the trust roots"
        )


def _issued_by(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
