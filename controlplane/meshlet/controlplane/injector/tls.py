"""The webhook's serving certificate: a CA of its own (the `caBundle` the API server trusts)
and a leaf for the injector Service, made by `meshlet install` when none is given."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca

LIFETIME: Final = dt.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class WebhookCertificate:
    ca_pem: str
    cert_pem: str
    key_pem: str


def service_names(namespace: str) -> list[str]:
    """The names the API server may use to reach the injector Service."""
    svc = wellknown.INJECTOR_NAME
    return [f"{svc}.{namespace}.svc", f"{svc}.{namespace}.svc.{wellknown.CLUSTER_DOMAIN}"]


def webhook_certificate(
    namespace: str, now: dt.datetime, lifetime: dt.timedelta = LIFETIME
) -> WebhookCertificate:
    root, root_key = ca.create_trust_anchor(
        now, lifetime, name=f"{wellknown.INJECTOR_NAME}.{namespace}.webhook-ca"
    )
    key = ca.new_key()
    names = service_names(namespace)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(root.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(root.not_valid_before_utc)
        .not_valid_after(root.not_valid_after_utc)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(root_key, hashes.SHA256())
    )
    return WebhookCertificate(
        ca_pem=ca.cert_pem(root).decode(),
        cert_pem=ca.cert_pem(leaf).decode(),
        key_pem=ca.key_pem(key).decode(),
    )
