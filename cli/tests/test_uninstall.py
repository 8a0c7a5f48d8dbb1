"""`meshlet uninstall`: a reference to every object install creates, namespace last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from meshlet_testing import pki


def refs(text: str) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(text) if d]


def test_every_installed_object_is_named(meshlet: Callable[..., Any]) -> None:
    installed = refs(meshlet("install", "--values", str(pki.VALUES)).out)
    removed = refs(meshlet("uninstall").out)
    assert sorted(removed) == sorted(installed)
    assert removed[-1] == ("Namespace", "meshlet")
    with_crds = refs(meshlet("uninstall", "--crds").out)
    assert ("CustomResourceDefinition", "serviceprofiles.meshlet.io") in with_crds
