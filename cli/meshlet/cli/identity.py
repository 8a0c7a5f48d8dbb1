"""`meshlet identity`: create the mesh's trust anchor and issuer as PEM files."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import click

from meshlet.api import wellknown


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if private:
        path.chmod(0o600)


@click.group()
def identity() -> None:
    """Certificates of the mesh's identity service."""


@identity.group("ca")
def ca_group() -> None:
    """The trust anchor."""


@ca_group.command("create")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder to write into (must not hold a CA already).",
)
@click.option("--anchor-days", type=click.IntRange(min=1), default=365, show_default=True,
              help="How long the trust anchor is valid.")  # fmt: skip
@click.option("--issuer-days", type=click.IntRange(min=1), default=365, show_default=True,
              help="How long the issuer certificate is valid.")  # fmt: skip
def ca_create(out: Path, anchor_days: int, issuer_days: int) -> None:
    """Create a trust anchor and an issuer signed by it.

    Writes OUT/trust-anchors.pem (give it to every proxy and to `meshlet-controller identity
    --trust-anchors`), OUT/trust-anchor.key.pem (keep it offline: it signs new issuers), and
    OUT/issuer/crt.pem + OUT/issuer/key.pem (the `--issuer-dir` of the identity service, or the
    Secret meshlet-identity-issuer).
    """
    from meshlet.controlplane.identity import ca

    anchors = out / "trust-anchors.pem"
    if anchors.exists():
        raise click.UsageError(f"{anchors} exists; refusing to overwrite a CA")
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now, dt.timedelta(days=anchor_days))
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now, dt.timedelta(days=issuer_days))
    _write(anchors, ca.cert_pem(anchor))
    _write(out / "trust-anchor.key.pem", ca.key_pem(anchor_key), private=True)
    _write(out / "issuer" / wellknown.ISSUER_CERT_KEY, ca.cert_pem(issuer))
    _write(out / "issuer" / wellknown.ISSUER_KEY_KEY, ca.key_pem(issuer_key), private=True)
    click.echo(f"trust anchor valid until {anchor.not_valid_after_utc.isoformat()}: {anchors}")
    click.echo(f"issuer valid until {issuer.not_valid_after_utc.isoformat()}: {out / 'issuer'}")


@identity.group("issuer")
def issuer_group() -> None:
    """The issuer (intermediate CA) that signs proxies' certificates."""


@issuer_group.command("create")
@click.option(
    "--ca",
    "ca_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Folder made by `meshlet identity ca create`.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Folder for crt.pem and key.pem (replaced atomically, for rotation).",
)
@click.option("--days", type=click.IntRange(min=1), default=365, show_default=True,
              help="How long the issuer certificate is valid.")  # fmt: skip
def issuer_create(ca_dir: Path, out: Path, days: int) -> None:
    """Create a new issuer from the trust anchor, e.g. to rotate the running one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from meshlet.controlplane.identity import ca

    anchor = x509.load_pem_x509_certificate((ca_dir / "trust-anchors.pem").read_bytes())
    anchor_key = serialization.load_pem_private_key(
        (ca_dir / "trust-anchor.key.pem").read_bytes(), password=None
    )
    if not isinstance(anchor_key, ec.EllipticCurvePrivateKey):
        raise click.UsageError("the trust anchor key is not an ECDSA key")
    now = dt.datetime.now(dt.UTC)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now, dt.timedelta(days=days))
    # Key first: a reader never sees a certificate without its key for long, and the identity
    # service refuses a mismatched pair and keeps its current issuer until both are written.
    for name, data in (
        (wellknown.ISSUER_KEY_KEY, ca.key_pem(issuer_key)),
        (wellknown.ISSUER_CERT_KEY, ca.cert_pem(issuer)),
    ):
        tmp = out / (name + ".tmp")
        _write(tmp, data, private=name == wellknown.ISSUER_KEY_KEY)
        tmp.replace(out / name)
    click.echo(f"issuer valid until {issuer.not_valid_after_utc.isoformat()}: {out}")
