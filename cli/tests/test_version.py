"""`meshlet version`: the client's, and the control plane's from its meshlet-config."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from meshlet_testing import pki
from meshlet_testing.fakeapi import FakeKubeAPI


def test_client_and_server(meshlet: Callable[..., Any], api: FakeKubeAPI, tmp_path: Path) -> None:
    assert meshlet("version", "--client").out == "Client version: 0.1.0\n"
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
    run = meshlet("version", "--kubeconfig", kubeconfig)
    assert run.out.splitlines()[1].startswith("Server version: unavailable (cannot read ConfigMap")
    for doc in yaml.safe_load_all(meshlet("install", "--values", str(pki.VALUES)).out):
        if doc and doc["kind"] in ("Namespace", "ConfigMap"):
            api.apply(doc)
    assert meshlet("version", "--kubeconfig", kubeconfig).out.splitlines()[1] == (
        "Server version: 0.1.0"
    )
