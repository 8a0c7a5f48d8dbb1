"""The identity service's own TLS certificate, issued by the issuer it serves with."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import cast

import grpc
from cryptography.hazmat.primitives import serialization

from meshlet.api import wellknown
from meshlet.controlplane.identity.ca import Issuer, key_pem, new_key
from meshlet.controlplane.identity.signer import Leaf, issue_leaf

RENEW_AT = 0.7  # of the certificate's lifetime


class ServingCertificate:
    """Re-issued when the issuer changes or 70 % of its lifetime has passed; handed to grpc
    through dynamic credentials so that new connections see the new certificate."""

    def __init__(self, name: str = wellknown.IDENTITY_SERVICE_NAME) -> None:
        self.name = name
        self._key = new_key()
        self._lock = threading.Lock()
        self._config: grpc.ServerCertificateConfiguration | None = None
        self._fresh = False
        self._leaf: Leaf | None = None
        self._renew_after: dt.datetime | None = None

    def issue(self, issuer: Issuer, now: dt.datetime) -> None:
        leaf = issue_leaf(issuer, self._key.public_key(), self.name, now)
        chain = ssl_pem(leaf.der) + b"".join(ssl_pem(der) for der in issuer.chain_der)
        config = grpc.ssl_server_certificate_configuration([(key_pem(self._key), chain)])
        with self._lock:
            self._config, self._fresh, self._leaf = config, True, leaf
            self._renew_after = now + (leaf.not_after - now) * RENEW_AT

    def due(self, now: dt.datetime) -> bool:
        return self._renew_after is None or now >= self._renew_after

    @property
    def leaf(self) -> Leaf | None:
        return self._leaf

    def credentials(self) -> grpc.ServerCredentials:
        with self._lock:
            if self._config is None:
                raise RuntimeError("serving certificate not issued yet")
            initial, self._fresh = self._config, False
        # grpc's stub omits that the fetcher may return None ("unchanged").
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self._fetch)
        return grpc.dynamic_ssl_server_credentials(initial, fetch)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by grpc before handshakes; None means "unchanged".
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self._config


def ssl_pem(der: bytes) -> bytes:
    from cryptography import x509

    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)
