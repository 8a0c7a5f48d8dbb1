"""Shared by the mesh transport tests: leaves under the test CA, written as a proxy's identity
directory (chain + key files that the `ssl` contexts load)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshlet.controlplane.identity import ca, signer
from meshlet.proxy.tls import contexts


@dataclass
class Pki:
    """Issues leaves under the test CA (or another) into files the `ssl` contexts load."""

    root: Path
    test_ca: Any
    now: dt.datetime  # when the test CA was made: its issuer is valid from 20 s before
    count: int = 0

    @property
    def anchors(self) -> str:
        return str(self.test_ca.anchors_pem)

    def issuer(self, valid_from: dt.datetime | None = None) -> ca.Issuer:
        if valid_from is None:
            cert, key = self.test_ca.issuer, self.test_ca.issuer_key
        else:
            cert, key = ca.create_issuer(self.test_ca.anchor, self.test_ca.anchor_key, valid_from)
        return ca.Issuer((cert,), key, (self.test_ca.anchor,))

    def other_issuer(self) -> ca.Issuer:
        anchor, anchor_key = ca.create_trust_anchor(self.now)
        cert, key = ca.create_issuer(anchor, anchor_key, self.now)
        return ca.Issuer((cert,), key, (anchor,))

    def leaf(
        self,
        name: str,
        issuer: ca.Issuer | None = None,
        issued_at: dt.datetime | None = None,
        lifetime: dt.timedelta = dt.timedelta(hours=1),
    ) -> tuple[Path, Path]:
        """(chain, key) files for `name`."""
        issuer = issuer or self.issuer()
        issued_at = issued_at or self.now
        self.count += 1
        directory = self.root / f"{self.count}-{name[:20]}"
        directory.mkdir(parents=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = signer.issue_leaf(issuer, key.public_key(), name, issued_at, lifetime)
        key_path = directory / "key.pem"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return contexts.write_chain(directory, cert.der, issuer.chain_der), key_path

    def expired_leaf(self, name: str) -> tuple[Path, Path]:
        day_ago = self.now - dt.timedelta(days=1)
        return self.leaf(name, self.issuer(day_ago), day_ago, dt.timedelta(hours=1))


@pytest.fixture
def pki(test_ca: Any, tmp_path: Path) -> Pki:
    return Pki(tmp_path / "leaves", test_ca, dt.datetime.now(dt.UTC))
