"""The trust anchors the proxy follows in a file (`identity.anchors.TrustAnchors`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from meshlet.api.bundle import problem
from meshlet.controlplane.identity import ca
from meshlet.proxy.identity.anchors import TrustAnchors


def test_the_file_wins_at_start_when_it_holds_a_bundle(test_ca: Any, tmp_path: Path) -> None:
    other, _ = test_ca.new_anchor()
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.cert_pem(test_ca.anchor, other))
    assert TrustAnchors(test_ca.anchors_pem, bundle).count == 2
    # missing (an optional ConfigMap not there yet) or broken: the PEM given
    assert TrustAnchors(test_ca.anchors_pem, tmp_path / "missing.pem").pem == test_ca.anchors_pem
    bundle.write_text("not a certificate")
    assert TrustAnchors(test_ca.anchors_pem, bundle).pem == test_ca.anchors_pem


def test_a_change_is_taken_once_and_told_and_a_broken_one_is_refused_once(
    test_ca: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_text(test_ca.anchors_pem)
    counts: dict[str, int] = {}

    class Child:
        def __init__(self, result: str) -> None:
            self.result = result

        def inc(self) -> None:
            counts[self.result] = counts.get(self.result, 0) + 1

    anchors = TrustAnchors(test_ca.anchors_pem, bundle, counted=Child)
    told: list[int] = []
    anchors.on_change(lambda: told.append(anchors.count))
    assert not anchors.check()  # unchanged

    other, _ = test_ca.new_anchor()
    bundle.write_bytes(ca.cert_pem(test_ca.anchor, other))
    assert anchors.check() and not anchors.check()
    assert told == [2] and anchors.version == 1

    caplog.set_level(logging.WARNING)
    bundle.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    assert not anchors.check() and not anchors.check()
    assert anchors.count == 2 and told == [2]
    refusals = [r for r in caplog.records if "keeping the 2 anchor(s) in force" in r.message]
    assert len(refusals) == 1, caplog.text

    bundle.unlink()  # a volume being swapped: nothing to read is no change
    assert not anchors.check() and anchors.count == 2
    bundle.write_bytes(ca.cert_pem(other))
    assert anchors.check() and told == [2, 1]
    assert counts == {"ok": 2, "invalid": 1}


def test_what_is_not_a_bundle_is_named() -> None:
    assert problem("") == "no PEM certificate in it"
    assert problem("/etc/meshlet/anchors.pem") == "no PEM certificate in it"
    broken = problem("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert broken is not None and broken.startswith("not a bundle of PEM certificates")
