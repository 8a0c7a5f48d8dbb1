"""Fixtures shared by every component's tests: a CA on disk, golden files, network namespaces."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshlet_testing.testca import TestCA, make_ca

pytest_plugins = ["meshlet_testing.fixtures", "meshlet_testing.leaks"]


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


# How long a test of the machine's own network waits for a demo that holds the lock (a demo test
# runs for a minute or two); such a test's timeout allows for it.
MACHINE_LOCK_WAIT = 300.0


@pytest.fixture(scope="module")
def machine_network(netns_available: None) -> Iterator[None]:
    """Holds the demo's lock (`meshlet.cli.demo.lock`) for the tests of a module that read the
    machine's own network state or could change it (its iptables): no demo runs beside them,
    and they never disturb one. Held from the first such test to the module's end, so that
    the module waits for a running demo once, not once per test; the first test's timeout must
    allow for the wait (MACHINE_LOCK_WAIT)."""
    from meshlet.cli.demo import lock

    with lock.held(MACHINE_LOCK_WAIT):
        yield


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
