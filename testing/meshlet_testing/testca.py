"""A trust anchor and an issuer on disk, written as the identity service reads them: for tests
(the root conftest's `test_ca` fixture) and for benchmarks that start the mesh's processes."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca


@dataclass
class TestCA:
    """A trust anchor and an issuer, written as the identity service reads them."""

    __test__ = False  # not a test class

    root: Path
    anchor: x509.Certificate
    anchor_key: ec.EllipticCurvePrivateKey
    issuer: x509.Certificate
    issuer_key: ec.EllipticCurvePrivateKey

    @property
    def anchors_path(self) -> Path:
        return self.root / "anchors.pem"

    @property
    def issuer_dir(self) -> Path:
        return self.root / "issuer"

    @property
    def anchors_pem(self) -> str:
        return self.anchors_path.read_text()

    def write(self) -> None:
        self.issuer_dir.mkdir(parents=True, exist_ok=True)
        self.anchors_path.write_bytes(ca.cert_pem(self.anchor))
        (self.issuer_dir / wellknown.ISSUER_CERT_KEY).write_bytes(ca.cert_pem(self.issuer))
        (self.issuer_dir / wellknown.ISSUER_KEY_KEY).write_bytes(ca.key_pem(self.issuer_key))

    def serving_cert(self, name: str, directory: Path) -> tuple[Path, Path]:
        """(chain, key) PEM files of a leaf for `name` from the current issuer: a control-plane
        service's TLS certificate."""
        from meshlet.controlplane.identity import signer

        issuer = ca.Issuer(chain=(self.issuer,), key=self.issuer_key, anchors=(self.anchor,))
        now = dt.datetime.now(dt.UTC)
        return signer.write_serving_files(issuer, name, directory, now, signer.LEAF_LIFETIME)

    def rotate_issuer(
        self, now: dt.datetime | None = None, lifetime: dt.timedelta = ca.ISSUER_LIFETIME
    ) -> x509.Certificate:
        """A new issuer from the same anchor, written over the old one."""
        now = now or dt.datetime.now(dt.UTC)
        self.issuer, self.issuer_key = ca.create_issuer(
            self.anchor, self.anchor_key, now, lifetime, name=f"issuer-{now.timestamp()}"
        )
        self.write()
        return self.issuer

    def new_anchor(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """Another trust anchor (not written, not in force): the next one of a rotation, with
        the same name as the first, as a rotation by Linkerd's procedure makes it."""
        return ca.create_trust_anchor(dt.datetime.now(dt.UTC))

    def write_anchors(self, *anchors: x509.Certificate) -> str:
        """The bundle of `anchors` written as the anchors file; its PEM."""
        pem = ca.cert_pem(*anchors)
        self.anchors_path.write_bytes(pem)
        return pem.decode()

    def issue_from(self, anchor: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        """A new issuer signed by `anchor`, written over the old one; `anchor` becomes this
        CA's anchor (the anchors file is left as it is: write_anchors says what is trusted)."""
        now = dt.datetime.now(dt.UTC)
        self.anchor, self.anchor_key = anchor, key
        self.issuer, self.issuer_key = ca.create_issuer(
            anchor, key, now, ca.ISSUER_LIFETIME, name=f"issuer-{now.timestamp()}"
        )
        self.issuer_dir.mkdir(parents=True, exist_ok=True)
        (self.issuer_dir / wellknown.ISSUER_CERT_KEY).write_bytes(ca.cert_pem(self.issuer))
        (self.issuer_dir / wellknown.ISSUER_KEY_KEY).write_bytes(ca.key_pem(self.issuer_key))


def make_ca(root: Path) -> TestCA:
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    test_ca = TestCA(root, anchor, anchor_key, issuer, issuer_key)
    test_ca.write()
    return test_ca
