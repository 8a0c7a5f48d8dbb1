"""Refusal reasons (pure): TLS failures classified from the exceptions `ssl` raises, the checks
of a completed mesh session, and a hint for every reason."""

from __future__ import annotations

import ssl

import pytest

from meshlet.api import wellknown
from meshlet.proxy.mesh.refusal import Refusal, check_session, classify_tls_error, describe

ALPN = wellknown.TRANSPORT_ALPN


def verify_error(code: int) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "certificate verify failed")
    exc.verify_code = code
    return exc


def ssl_error(reason: str) -> ssl.SSLError:
    exc = ssl.SSLError(1, reason)
    exc.reason = reason
    return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (verify_error(10), Refusal.EXPIRED),
        (verify_error(9), Refusal.NOT_YET_VALID),
        (verify_error(62), Refusal.WRONG_IDENTITY),
        (verify_error(20), Refusal.UNTRUSTED),
        (verify_error(19), Refusal.UNTRUSTED),
        (verify_error(26), Refusal.INVALID_CERTIFICATE),  # e.g. an unsuitable certificate purpose
        (ssl_error("UNSUPPORTED_PROTOCOL"), Refusal.TLS_VERSION),
        (ssl_error("TLSV1_ALERT_PROTOCOL_VERSION"), Refusal.TLS_VERSION),
        (ssl_error("PEER_DID_NOT_RETURN_A_CERTIFICATE"), Refusal.NO_CLIENT_CERTIFICATE),
        (ssl_error("TLSV13_ALERT_CERTIFICATE_REQUIRED"), Refusal.NO_CLIENT_CERTIFICATE),
        (ssl_error("TLSV1_ALERT_UNKNOWN_CA"), Refusal.HANDSHAKE_FAILED),
        (ConnectionResetError(), Refusal.HANDSHAKE_FAILED),
        (TimeoutError(), Refusal.HANDSHAKE_TIMEOUT),
    ],
)
def test_tls_failures_are_classified(exc: BaseException, reason: Refusal) -> None:
    assert classify_tls_error(exc) is reason


def test_a_failure_without_a_message_is_still_described() -> None:
    exc = ssl_error("UNSUPPORTED_PROTOCOL")
    assert describe(exc) == str(exc) != ""
    assert "ConnectionResetError" in describe(ConnectionResetError())


@pytest.mark.parametrize(
    ("session", "refusal"),
    [
        (("TLSv1.3", ALPN, "db", "db"), None),
        (("TLSv1.3", ALPN, "web", None), None),  # a server accepts any verified identity
        (("TLSv1.2", ALPN, "db", "db"), Refusal.TLS_VERSION),
        (("TLSv1.3", None, "db", "db"), Refusal.NO_MESH_ALPN),
        (("TLSv1.3", "h2", "db", "db"), Refusal.NO_MESH_ALPN),
        (("TLSv1.3", ALPN, "web", "db"), Refusal.WRONG_IDENTITY),
        (("TLSv1.3", ALPN, None, "db"), Refusal.WRONG_IDENTITY),
        (("TLSv1.3", ALPN, None, None), Refusal.NO_CLIENT_CERTIFICATE),
    ],
)
def test_a_completed_session_is_checked(
    session: tuple[str, str | None, str | None, str | None], refusal: Refusal | None
) -> None:
    assert check_session(*session) is refusal


def test_every_reason_is_a_distinct_label_with_a_hint() -> None:
    assert len({r.value for r in Refusal}) == len(Refusal)
    assert all(r.hint and r.value.isidentifier() for r in Refusal)
