"""A returned certificate is checked with `ssl` alone before use: chain, name, key, validity.

The certificates are built here with `cryptography` (tests only) by the control plane's own
signer, then handed to `verify`, which sees only files and PEM text.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca, signer
from meshlet.proxy.identity import prestart
from meshlet.proxy.identity.verify import Rejected, Validity, check_validity, verify
from meshlet.proxy.tls import contexts

WEB = wellknown.identity_name("web", "emojivoto")
EMOJI = wellknown.identity_name("emoji", "emojivoto")
DAY = dt.timedelta(days=1)


def issuer_of(test_ca: Any) -> ca.Issuer:
    return ca.Issuer(chain=(test_ca.issuer,), key=test_ca.issuer_key, anchors=(test_ca.anchor,))


@pytest.fixture
def web(tmp_path: Path) -> prestart.IdentityFiles:
    """Our key and CSR, as the pre-start step makes them."""
    return prestart.prepare(tmp_path / "web", WEB)


def public_key(files: prestart.IdentityFiles) -> ec.EllipticCurvePublicKey:
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key.public_key()


Check = Callable[..., Validity]


@pytest.fixture
def check(web: prestart.IdentityFiles, test_ca: Any) -> Check:
    """`check(leaf_der, intermediates, now=...)`: writes the chain and verifies it as `web`."""

    def run(
        leaf_der: bytes, intermediates: tuple[bytes, ...], now: float | None = None
    ) -> Validity:
        chain = contexts.write_chain(web.key.parent, leaf_der, intermediates)
        return verify(chain, web.key, test_ca.anchors_pem, WEB, time.time() if now is None else now)

    return run


def test_a_fresh_certificate_for_our_name_and_key_is_accepted(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    issuer = issuer_of(test_ca)
    now = dt.datetime.now(dt.UTC)
    leaf = signer.issue_leaf(issuer, public_key(web), WEB, now)
    validity = check(leaf.der, issuer.chain_der)
    assert validity.not_after == pytest.approx(leaf.not_after.timestamp(), abs=1)
    assert validity.not_before == pytest.approx(now.timestamp() - 20, abs=1)


def test_a_certificate_for_another_identity_is_rejected(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    issuer = issuer_of(test_ca)
    leaf = signer.issue_leaf(issuer, public_key(web), EMOJI, dt.datetime.now(dt.UTC))
    with pytest.raises(Rejected, match="Hostname mismatch"):
        check(leaf.der, issuer.chain_der)


def test_a_certificate_from_another_ca_is_rejected(
    web: prestart.IdentityFiles, check: Check
) -> None:
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)  # same names as ours, different keys
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    other = ca.Issuer(chain=(issuer,), key=issuer_key, anchors=(anchor,))
    leaf = signer.issue_leaf(other, public_key(web), WEB, dt.datetime.now(dt.UTC))
    with pytest.raises(Rejected, match="unable to get local issuer certificate"):
        check(leaf.der, other.chain_der)


def test_a_leaf_without_its_intermediate_is_rejected(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    leaf = signer.issue_leaf(issuer_of(test_ca), public_key(web), WEB, dt.datetime.now(dt.UTC))
    with pytest.raises(Rejected, match="unable to get local issuer certificate"):
        check(leaf.der, ())


def test_an_expired_certificate_is_rejected(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    test_ca.rotate_issuer(now=dt.datetime.now(dt.UTC) - 3 * DAY)  # an issuer that can backdate
    issuer = issuer_of(test_ca)
    leaf = signer.issue_leaf(issuer, public_key(web), WEB, dt.datetime.now(dt.UTC) - 2 * DAY)
    with pytest.raises(Rejected, match="certificate has expired"):
        check(leaf.der, issuer.chain_der)


def test_a_certificate_not_yet_valid_is_rejected(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    issuer = issuer_of(test_ca)
    leaf = signer.issue_leaf(issuer, public_key(web), WEB, dt.datetime.now(dt.UTC) + DAY)
    with pytest.raises(Rejected, match="certificate is not yet valid"):
        check(leaf.der, issuer.chain_der)


def test_validity_is_also_checked_against_the_callers_clock(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    issuer = issuer_of(test_ca)
    leaf = signer.issue_leaf(issuer, public_key(web), WEB, dt.datetime.now(dt.UTC))
    later = leaf.not_after.timestamp() + 1
    with pytest.raises(Rejected, match="expired"):
        check(leaf.der, issuer.chain_der, now=later)


def test_a_certificate_for_another_key_is_rejected(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    issuer = issuer_of(test_ca)
    stranger = ca.new_key().public_key()
    leaf = signer.issue_leaf(issuer, stranger, WEB, dt.datetime.now(dt.UTC))
    with pytest.raises(Rejected, match="not for our private key"):
        check(leaf.der, issuer.chain_der)


def leaf_naming(issuer: ca.Issuer, key: ec.EllipticCurvePublicKey, *names: str) -> bytes:
    """A leaf like the signer's, but with the DNS SANs given."""
    now = dt.datetime.now(dt.UTC)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(issuer.cert.subject)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + DAY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), True)
        .sign(issuer.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.DER)


@pytest.mark.parametrize(
    "names",
    [
        (WEB, EMOJI),  # us and someone else
        ("*.emojivoto.serviceaccount.identity.meshlet.cluster.local",),  # a wildcard
    ],
)
def test_a_certificate_must_name_exactly_us(
    web: prestart.IdentityFiles, test_ca: Any, check: Check, names: tuple[str, ...]
) -> None:
    issuer = issuer_of(test_ca)
    with pytest.raises(Rejected, match="not exactly"):
        check(leaf_naming(issuer, public_key(web), *names), issuer.chain_der)


def test_exactly_our_name_in_a_handmade_leaf_is_accepted(
    web: prestart.IdentityFiles, test_ca: Any, check: Check
) -> None:
    """The control for the two cases above: the same builder with one right name passes."""
    issuer = issuer_of(test_ca)
    check(leaf_naming(issuer, public_key(web), WEB), issuer.chain_der)


def test_bytes_that_are_not_a_certificate_are_rejected(test_ca: Any, check: Check) -> None:
    with pytest.raises(Rejected, match="cannot be loaded"):
        check(b"not a certificate", issuer_of(test_ca).chain_der)


@pytest.mark.parametrize(
    ("now", "problem"),
    [(99.0, "not valid before"), (100.0, None), (199.9, None), (200.0, "expired")],
)
def test_check_validity_bounds(now: float, problem: str | None) -> None:
    validity = Validity(not_before=100.0, not_after=200.0)
    if problem is None:
        check_validity(validity, now)
    else:
        with pytest.raises(Rejected, match=problem):
            check_validity(validity, now)
