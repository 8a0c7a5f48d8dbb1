"""Checks of a certification request's identity name and CSR (pure: bytes in, verdict out)."""

from __future__ import annotations

from typing import Final

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec

from meshlet.api import wellknown
from meshlet.controlplane.identity.errors import CertifyError

# An ECDSA P-256 CSR with one long SAN is under 600 bytes; 16 KiB-key RSA CSRs are refused here,
# before any parsing cost is paid.
MAX_CSR_BYTES: Final = 4096
MAX_TOKEN_BYTES: Final = 16 * 1024

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def check_fields(identity: str, token: bytes, csr_der: bytes) -> None:
    """Every field present and within bounds; the identity well-formed."""
    missing = [
        name
        for name, value in (
            ("identity", identity),
            ("token", token),
            ("certificate_signing_request", csr_der),
        )
        if not value
    ]
    if missing:
        raise CertifyError(_INVALID, f"missing field(s): {', '.join(missing)}")
    if len(csr_der) > MAX_CSR_BYTES:
        raise CertifyError(
            _INVALID, f"CSR of {len(csr_der)} bytes exceeds the {MAX_CSR_BYTES}-byte limit"
        )
    if len(token) > MAX_TOKEN_BYTES:
        raise CertifyError(
            _INVALID, f"token of {len(token)} bytes exceeds the {MAX_TOKEN_BYTES}-byte limit"
        )
    if wellknown.parse_identity_name(identity) is None:
        raise CertifyError(
            _INVALID,
            f"identity {identity[:300]!r} is not of the form"
            " <serviceaccount>.<namespace>.serviceaccount.identity.<control-ns>.<trust-domain>",
        )


def check_csr(identity: str, csr_der: bytes) -> ec.EllipticCurvePublicKey:
    """The CSR's public key, once the CSR is proven to request exactly `identity`."""
    try:
        csr = x509.load_der_x509_csr(csr_der)
    except ValueError as exc:
        raise CertifyError(_INVALID, f"CSR is not DER PKCS#10: {exc}") from exc
    try:
        key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CertifyError(_PRECONDITION, f"CSR public key is unusable: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise CertifyError(_PRECONDITION, "CSR key must be ECDSA P-256")
    if not csr.is_signature_valid:
        raise CertifyError(_PRECONDITION, "CSR signature does not verify")
    try:
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertifyError(_PRECONDITION, "CSR has no subjectAltName") from None
    except (ValueError, x509.DuplicateExtension) as exc:
        raise CertifyError(_PRECONDITION, f"CSR extensions are malformed: {exc}") from exc
    others = [n for n in sans if not isinstance(n, x509.DNSName)]
    if others:
        kinds = sorted({type(n).__name__ for n in others})
        raise CertifyError(_PRECONDITION, f"CSR may carry only a DNS SAN, not {', '.join(kinds)}")
    names = sans.get_values_for_type(x509.DNSName)
    if names != [identity]:
        raise CertifyError(
            _PRECONDITION,
            f"CSR must carry exactly one DNS SAN equal to the identity; it has {len(names)}"
            + ("" if len(names) != 1 else f" ({names[0][:300]!r})"),
        )
    return key
