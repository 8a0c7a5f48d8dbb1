"""The shop as the mesh runs it: web (two replicas) and store, in namespace shop, with the
policy folder applied; each test gets a mesh of its own (pytest-meshlet's `mesh` fixture)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshlet.cli.mesh import spec as s

HERE = Path(__file__).resolve().parent.parent


@pytest.fixture
def meshlet_spec() -> s.Spec:
    env = {"PYTHONPATH": str(HERE), "GRPC_DNS_RESOLVER": "native"}  # names from /etc/hosts
    web = s.service(
        "web", [sys.executable, "-m", "uvicorn", "shop.web:app", "--host", "{ip}",
                "--port", "{port}", "--no-access-log"],
        port=8080, replicas=2, env={**env, "STORE_ADDR": "store.shop:9090"},
    )  # fmt: skip
    store = s.service("store", [sys.executable, "-m", "shop.store", "--host", "{ip}",
                                "--port", "{port}"],
                      port=9090, protocol="grpc", env=env)  # fmt: skip
    return s.Spec((web, store), namespace="shop", policy=HERE / "policy")
