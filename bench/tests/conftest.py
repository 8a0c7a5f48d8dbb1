"""Fixtures of the benchmark's tests: the bench's certificates, made fresh in a temporary dir."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from bench.proxy_pki import Pki, make_pki
from meshlet.api.wellknown import identity_name


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    client, server = identity_name("client", "bench"), identity_name("server", "bench")
    return make_pki(tmp_path / "pki", client, server, dt.datetime.now(dt.UTC))
