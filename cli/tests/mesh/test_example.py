"""The example application (examples/shop) as its developers run its suite: `pytest -n 4`
(pytest-xdist), each worker with meshes of its own, green; then each mistake a plain test
cannot see, made in its policy folder, caught by the test written for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshlet.cli.mesh.engine import MODE_ENV
from meshlet_testing.unprivileged import unprivileged as without_privilege

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "shop"

pytestmark = pytest.mark.demo  # whole meshes: the suite's second lane


def run_suite(
    folder: Path, *args: str, unprivileged: bool = False
) -> subprocess.CompletedProcess[str]:
    """The suite run by pytest; `unprivileged`: without a capability (so in loopback mode)."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(folder),
            "-q", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != MODE_ENV}  # the mode as found
    return subprocess.run(without_privilege(*argv) if unprivileged else argv,
                          capture_output=True, text=True, timeout=300, check=False, cwd=folder,
                          env=env)  # fmt: skip


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    folder = tmp_path / "shop"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.mark.netns
def test_the_shops_suite_passes_with_four_workers(netns_available: None, shop: Path) -> None:
    run = run_suite(shop, "-n", "4")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout, run.stdout[-2000:]


def test_the_shops_suite_passes_without_privilege_and_catches_a_lockout(shop: Path) -> None:
    """Without a capability the meshes are loopback ones: the apps reach each other through
    their proxies as their HTTP proxy, and authorization still tells web from the rest."""
    run = run_suite(shop, unprivileged=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "4 passed" in run.stdout, run.stdout[-2000:]
    policy = shop / "policy" / "store-authz.yaml"
    policy.write_text(policy.read_text().replace("      name: web\n", "      name: frontend\n"))
    test = "tests/test_shop.py::test_web_reaches_the_store_and_no_one_else_does"
    run = run_suite(shop, test, unprivileged=True)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 failed" in run.stdout and "status=502" in run.stdout, run.stdout[-4000:]


# (the file in policy/, what the mistake changes, the test that catches it, what it sees)
ORDERS = "        pathRegex: /orders/[^/]+\n"
MISTAKES = [
    pytest.param("web-profile.yaml", (ORDERS, ORDERS + "      isRetryable: true\n"),
                 "test_placing_an_order_reserves_stock_once", "assert 2 == 1",
                 id="a-retried-POST"),
    pytest.param("web-profile.yaml", ("      timeout: 2s\n", "      timeout: 100ms\n"),
                 "test_the_report_has_time_for_the_stores_slow_path", "status=504",
                 id="a-timeout-shorter-than-the-slow-path"),
    pytest.param("store-authz.yaml", ("      name: web\n", "      name: frontend\n"),
                 "test_web_reaches_the_store_and_no_one_else_does", "status=502",
                 id="a-policy-locking-web-out"),
]  # fmt: skip


@pytest.mark.netns
@pytest.mark.parametrize(("file", "change", "test", "seen"), MISTAKES)
def test_each_mistake_is_caught_by_its_test(
    netns_available: None, shop: Path, file: str, change: tuple[str, str], test: str, seen: str
) -> None:
    policy = shop / "policy" / file
    text = policy.read_text()
    assert text.count(change[0]) == 1
    policy.write_text(text.replace(*change))
    run = run_suite(shop, f"tests/test_shop.py::{test}")
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 failed" in run.stdout and seen in run.stdout, run.stdout[-4000:]
