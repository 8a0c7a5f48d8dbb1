"""`meshlet identity ca create` and `issuer create` write material the identity service loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from meshlet.cli.main import main
from meshlet.controlplane.identity import ca


def run(*args: str) -> int:
    with pytest.raises(SystemExit) as caught:
        main([*args])
    return int(caught.value.code or 0)


def load(root: Path, issuer_dir: Path) -> ca.Issuer:
    return ca.load_issuer(
        (issuer_dir / "crt.pem").read_bytes(),
        (issuer_dir / "key.pem").read_bytes(),
        (root / "trust-anchors.pem").read_bytes(),
    )


def test_ca_create_then_rotate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ca"
    main(["identity", "ca", "create", "--out", str(root), "--issuer-days", "30"])
    assert "issuer valid until" in capsys.readouterr().out
    first = load(root, root / "issuer")
    assert (first.cert.not_valid_after_utc - first.cert.not_valid_before_utc).days == 30
    assert (root / "trust-anchor.key.pem").stat().st_mode & 0o777 == 0o600
    assert (root / "issuer" / "key.pem").stat().st_mode & 0o777 == 0o600

    main(["identity", "issuer", "create", "--ca", str(root), "--out", str(root / "issuer")])
    second = load(root, root / "issuer")
    assert second.cert.serial_number != first.cert.serial_number
    assert second.anchors == first.anchors


def test_ca_create_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["identity", "ca", "create", "--out", str(tmp_path)])
    before = (tmp_path / "trust-anchors.pem").read_bytes()
    assert run("identity", "ca", "create", "--out", str(tmp_path)) == 64
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (tmp_path / "trust-anchors.pem").read_bytes() == before
    assert x509.load_pem_x509_certificate(before)


def test_bad_flag_exits_64(tmp_path: Path) -> None:
    assert run("identity", "ca", "create", "--out", str(tmp_path), "--anchor-days", "0") == 64
