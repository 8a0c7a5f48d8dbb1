"""Why a mesh connection was refused: a closed set of reasons (bounded metric label values),
the TLS failures they classify, and what an operator can do about each (pure)."""

from __future__ import annotations

import enum
import ssl
from typing import Final

from meshlet.api import wellknown

# OpenSSL's X509_V_ERR_* codes (x509_vfy.h) that have a reason of their own.
_NOT_YET_VALID: Final = 9
_EXPIRED: Final = 10
_HOSTNAME_MISMATCH: Final = 62
_UNTRUSTED_CODES: Final = frozenset(
    {
        2,  # unable to get issuer certificate
        7,  # certificate signature failure
        18,  # depth zero self-signed certificate
        19,  # self-signed certificate in chain
        20,  # unable to get local issuer certificate
        21,  # unable to verify the first certificate
    }
)
_VERSION_REASONS: Final = frozenset(
    {
        "UNSUPPORTED_PROTOCOL",
        "NO_PROTOCOLS_AVAILABLE",
        "WRONG_SSL_VERSION",
        "TLSV1_ALERT_PROTOCOL_VERSION",
    }
)
_NO_CERTIFICATE_REASONS: Final = frozenset(
    {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED"}
)


class Refusal(enum.Enum):
    """Why a mesh connection was refused; the value is the metric label."""

    UNTRUSTED = "untrusted_certificate"
    EXPIRED = "expired_certificate"
    NOT_YET_VALID = "certificate_not_yet_valid"
    INVALID_CERTIFICATE = "invalid_certificate"
    WRONG_IDENTITY = "wrong_identity"
    NO_CLIENT_CERTIFICATE = "no_client_certificate"
    TLS_VERSION = "tls_version"
    NO_MESH_ALPN = "no_mesh_alpn"
    HANDSHAKE_FAILED = "handshake_failed"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    HELLO_TIMEOUT = "client_hello_timeout"
    HEADER_TIMEOUT = "transport_header_timeout"
    BAD_HEADER = "bad_transport_header"
    CLOSED = "closed_before_header"
    LOOP = "loop"

    @property
    def hint(self) -> str:
        """What to check next, for the log line."""
        return _hint(self)


def _hint(reason: Refusal) -> str:
    match reason:
        case Refusal.UNTRUSTED:
            return (
                "the certificate is not issued under this proxy's trust anchors; both proxies "
                "must share MESHLET_PROXY_IDENTITY_TRUST_ANCHORS"
            )
        case Refusal.EXPIRED | Refusal.NOT_YET_VALID:
            return "check the peer's identity renewal and both hosts' clocks"
        case Refusal.WRONG_IDENTITY:
            return "the peer is not the workload discovery named; check its service account"
        case Refusal.NO_CLIENT_CERTIFICATE:
            return "the client proxy has no identity yet, or the client is not a meshed proxy"
        case Refusal.TLS_VERSION:
            return "proxies speak TLS 1.3 only"
        case Refusal.NO_MESH_ALPN:
            return "the peer did not negotiate ALPN transport.l5d.io/v1: it is not a mesh proxy"
        case Refusal.HANDSHAKE_TIMEOUT | Refusal.HELLO_TIMEOUT | Refusal.HEADER_TIMEOUT:
            return "the peer stalled; check the network path and the detect timeout"
        case Refusal.BAD_HEADER:
            return "the peer sent no valid transport header after the TLS handshake"
        case Refusal.LOOP:
            return "the transport header names one of the proxy's own ports"
        case _:
            return "the peer closed or reset the connection; see its logs"


def classify_tls_error(exc: BaseException) -> Refusal:
    """The reason for a failed TLS handshake, from the exception it raised."""
    if isinstance(exc, TimeoutError):
        return Refusal.HANDSHAKE_TIMEOUT
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _EXPIRED:
            return Refusal.EXPIRED
        if code == _NOT_YET_VALID:
            return Refusal.NOT_YET_VALID
        if code == _HOSTNAME_MISMATCH:
            return Refusal.WRONG_IDENTITY
        if code in _UNTRUSTED_CODES:
            return Refusal.UNTRUSTED
        return Refusal.INVALID_CERTIFICATE
    if isinstance(exc, ssl.SSLError):
        reason = getattr(exc, "reason", None)
        if reason in _VERSION_REASONS:
            return Refusal.TLS_VERSION
        if reason in _NO_CERTIFICATE_REASONS:
            return Refusal.NO_CLIENT_CERTIFICATE
    return Refusal.HANDSHAKE_FAILED


def describe(exc: BaseException) -> str:
    """A TLS failure in words, also for exceptions without a message (a reset)."""
    text = str(exc)
    if text:
        return text
    return f"the connection was closed during the TLS handshake ({type(exc).__name__})"


def check_session(
    version: str | None, alpn: str | None, peer_id: str | None, expected_id: str | None
) -> Refusal | None:
    """Checks a completed mesh handshake: TLS 1.3, ALPN transport.l5d.io/v1, and the peer's
    verified identity: equal to `expected_id` (the server, seen by a client), or present at all
    when `expected_id` is None (the client, seen by a server). None when all hold."""
    if version != "TLSv1.3":
        return Refusal.TLS_VERSION
    if alpn != wellknown.TRANSPORT_ALPN:
        return Refusal.NO_MESH_ALPN
    if peer_id is None:
        return Refusal.NO_CLIENT_CERTIFICATE if expected_id is None else Refusal.WRONG_IDENTITY
    if expected_id is not None and peer_id != expected_id:
        return Refusal.WRONG_IDENTITY
    return None
