"""The fake API server and a real `kubernetes` client bound to it, for the k8s tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from meshlet.controlplane.k8s.fakeapi import FakeKubeAPI


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as fake:
        yield fake


@pytest.fixture
def api_client(api: FakeKubeAPI) -> Iterator[client.ApiClient]:
    with client.ApiClient(api.client_configuration()) as c:
        yield c
