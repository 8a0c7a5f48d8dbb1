"""Fixed certificates for golden files: a trust anchor and issuer valid from 2025 for 100
years, the proxy injector's webhook certificates and the tap controller's. Test material only:
never use it in a cluster. Regenerate with `python -m meshlet_testing.pki` (golden files then
change)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Final

DIR: Final = Path(__file__).parent / "pki"
TRUST_ANCHORS: Final = DIR / "trust-anchors.pem"
ISSUER_CRT: Final = DIR / "issuer.crt.pem"
ISSUER_KEY: Final = DIR / "issuer.key.pem"
VALUES: Final = DIR / "values.yaml"  # every certificate as `meshlet install --values` takes it


def anchors_pem() -> str:
    return TRUST_ANCHORS.read_text()


def _generate() -> None:
    import yaml

    from meshlet.cli.install import tap_certificate
    from meshlet.controlplane.identity import ca
    from meshlet.controlplane.injector import tls

    now = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    life = dt.timedelta(days=365 * 100)
    anchor, anchor_key = ca.create_trust_anchor(now, life)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now, life)
    TRUST_ANCHORS.write_bytes(ca.cert_pem(anchor))
    ISSUER_CRT.write_bytes(ca.cert_pem(issuer))
    ISSUER_KEY.write_bytes(ca.key_pem(issuer_key))
    webhook = tls.webhook_certificate("meshlet", now, life)
    issuer_tls = {"crtPEM": ISSUER_CRT.read_text(), "keyPEM": ISSUER_KEY.read_text()}
    tap = tap_certificate(issuer_tls, anchors_pem(), "meshlet", now)
    values = {
        "identityTrustAnchorsPEM": anchors_pem(),
        "identity": {
            "issuer": {"tls": {"crtPEM": ISSUER_CRT.read_text(), "keyPEM": ISSUER_KEY.read_text()}}
        },
        "tap": tap,
        "proxyInjector": {
            "caBundle": webhook.ca_pem,
            "crtPEM": webhook.cert_pem,
            "keyPEM": webhook.key_pem,
        },
    }

    def block(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
        return dumper.represent_scalar(
            "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
        )

    yaml.SafeDumper.add_representer(str, block)
    VALUES.write_text(yaml.safe_dump(values, sort_keys=False))


if __name__ == "__main__":
    _generate()
