"""Fixtures shared by every component's tests: a CA on disk, golden files, network namespaces."""

from __future__ import annotations

import datetime as dt
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca

pytest_plugins = ["meshlet_testing.fixtures", "meshlet_testing.leaks"]


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


def make_ca(root: Path) -> TestCA:
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    test_ca = TestCA(root, anchor, anchor_key, issuer, issuer_key)
    test_ca.write()
    return test_ca


@pytest.fixture
def test_ca(tmp_path: Path) -> TestCA:
    return make_ca(tmp_path / "ca")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite golden files from current output"
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[Path, str], None]:
    """`golden(path, text)`: compares `text` with the file, or rewrites it with --update-golden."""
    update = bool(request.config.getoption("--update-golden"))

    def check(path: Path, text: str) -> None:
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        assert path.exists(), f"{path} missing; run pytest --update-golden"
        assert text == path.read_text(), f"{path} differs; review, then pytest --update-golden"

    return check


@pytest.fixture(scope="session")
def netns_available() -> None:
    """Skips (or, with MESHLET_REQUIRE_NETNS=1 as in CI, fails) without root, iproute2 and
    iptables, which the network-namespace tests need."""
    problem = None
    if os.geteuid() != 0:
        problem = "network namespace tests need root"
    elif shutil.which("ip") is None or shutil.which("iptables-legacy-restore") is None:
        problem = "network namespace tests need iproute2 and iptables"
    if problem:
        if os.environ.get("MESHLET_REQUIRE_NETNS") == "1":
            pytest.fail(f"{problem} (MESHLET_REQUIRE_NETNS=1)")
        pytest.skip(problem)


@pytest.fixture
def netns(netns_available: None) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """A fresh network namespace; yields `run(*argv)` executing inside it."""
    name = f"meshlet-test-{os.getpid()}-{next(_netns_ids)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)

        def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["ip", "netns", "exec", name, *argv],
                check=check,
                capture_output=True,
                text=True,
                timeout=30,
            )

        yield run
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


_netns_ids = itertools.count()
