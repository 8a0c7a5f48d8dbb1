"""The proxy benchmark's certificates: one CA from the project's own code, and the pods' leaves.

`make_pki` writes a trust anchor and an issuer as `meshlet identity ca create` does (so the
identity service of the meshlet pair signs with them), and for the Envoy, nginx and haproxy
pairs a key and a leaf for each side's identity, issued by the same code the identity service
uses (`signer.write_serving_files`): ECDSA P-256, the identity as DNS SAN (and its SPIFFE URI),
usable for server and client authentication. So every meshed pair checks the same kind of
chain: leaf, issuer, trust anchor.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca, signer

LIFETIME: Final = dt.timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One side's identity on disk: the chain (leaf first), its key, and both in one file."""

    name: str  # the identity, also the certificate's DNS SAN
    chain: Path  # PEM: leaf, then the issuer
    key: Path  # PEM, mode 0600
    combined: Path  # chain then key (haproxy's `crt`)


@dataclass(frozen=True, slots=True)
class Pki:
    root: Path  # holds trust-anchors.pem and issuer/, the identity service's inputs
    anchors: Path
    issuer_dir: Path
    client: Leaf
    server: Leaf
    others: tuple[Leaf, ...] = ()  # identities no pod runs as (clients a policy refuses)


def make_pki(
    root: Path, client_id: str, server_id: str, now: dt.datetime, others: Sequence[str] = ()
) -> Pki:
    """A fresh CA under `root`, and leaves for `client_id`, `server_id` and `others` signed by
    it."""
    anchor, anchor_key = ca.create_trust_anchor(now, LIFETIME)
    issuer_cert, issuer_key = ca.create_issuer(anchor, anchor_key, now, LIFETIME)
    issuer_dir = root / "issuer"
    issuer_dir.mkdir(parents=True)
    anchors = root / "trust-anchors.pem"
    anchors.write_bytes(ca.cert_pem(anchor))
    (issuer_dir / wellknown.ISSUER_CERT_KEY).write_bytes(ca.cert_pem(issuer_cert))
    key_file = issuer_dir / wellknown.ISSUER_KEY_KEY
    key_file.touch(mode=0o600)
    key_file.write_bytes(ca.key_pem(issuer_key))
    issuer = ca.Issuer((issuer_cert,), issuer_key, (anchor,))
    leaves = root / "leaves"
    return Pki(
        root,
        anchors,
        issuer_dir,
        _leaf(issuer, client_id, leaves, now),
        _leaf(issuer, server_id, leaves, now),
        tuple(_leaf(issuer, name, leaves, now) for name in others),
    )


def _leaf(issuer: ca.Issuer, name: str, directory: Path, now: dt.datetime) -> Leaf:
    chain, key = signer.write_serving_files(issuer, name, directory, now, LIFETIME)
    combined = directory / f"{name}.pem"
    combined.touch(mode=0o600)
    combined.write_bytes(chain.read_bytes() + key.read_bytes())
    return Leaf(name, chain, key, combined)


@dataclass(frozen=True, slots=True)
class Tls:
    """What one side of a meshed pair presents and checks: its own leaf, the trust anchors and,
    on the client side, the identity the server's certificate must name."""

    own: Leaf
    anchors: Path
    peer_id: str = ""


def client_tls(pki: Pki) -> Tls:
    return Tls(pki.client, pki.anchors, pki.server.name)


def server_tls(pki: Pki) -> Tls:
    return Tls(pki.server, pki.anchors)
