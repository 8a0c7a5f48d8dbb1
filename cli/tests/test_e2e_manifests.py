"""The k3d end-to-end test's own manifests, checked here where no cluster runs."""

from __future__ import annotations

from pathlib import Path

import yaml

from meshlet.api import wellknown
from meshlet_testing.schema import validate

DEMO = Path(__file__).parents[2] / "e2e" / "demo.yaml"


def test_the_demo_application_is_schema_valid() -> None:
    for doc in yaml.safe_load_all(DEMO.read_text()):
        validate(doc)


def test_no_demo_app_runs_as_the_proxy() -> None:
    """The rules let the proxy's UID and GID past the proxy: an app running as them would
    never be meshed (its calls would skip its own proxy)."""
    containers = [
        container
        for doc in yaml.safe_load_all(DEMO.read_text())
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]
    assert len(containers) == 3
    for container in containers:
        context = container.get("securityContext") or {}
        assert context.get("runAsUser") not in (None, wellknown.PROXY_UID), container["name"]
        assert context.get("runAsGroup") not in (None, wellknown.PROXY_GID), container["name"]
