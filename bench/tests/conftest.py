"""Fixtures of the benchmark's tests: the bench's certificates, made fresh in a temporary dir;
the test support on the path of every `python -m bench.X` a test runs, as `make bench` has it."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest

from bench.proxy_pki import Pki, make_pki
from meshlet.api.wellknown import identity_name


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    client, server = identity_name("client", "bench"), identity_name("server", "bench")
    return make_pki(tmp_path / "pki", client, server, dt.datetime.now(dt.UTC))


@pytest.fixture(autouse=True)
def bench_finds_the_test_support(monkeypatch: pytest.MonkeyPatch) -> None:
    testing = str(Path(__file__).resolve().parents[2] / "testing")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (testing, os.environ.get("PYTHONPATH")) if p
    ))  # fmt: skip
