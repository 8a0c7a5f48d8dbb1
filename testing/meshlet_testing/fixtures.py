"""Pytest fixtures around the fake Kubernetes API server (loaded by the root conftest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from meshlet_testing.fakeapi import FakeKubeAPI


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as fake:
        yield fake


@pytest.fixture
def api_client(api: FakeKubeAPI) -> Iterator[client.ApiClient]:
    with client.ApiClient(api.client_configuration()) as c:
        yield c
