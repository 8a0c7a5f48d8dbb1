"""The `cli` extra (Helm engine, jsonpatch, rich) and the test-only schema validator stay out
of the long-running processes: the proxy (30 MB budget) and the controller."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI_ONLY = ("helm_python", "jsonpatch", "rich", "kubernetes_validate", "meshlet_testing")


@pytest.mark.parametrize(
    "modules",
    [
        ("meshlet.proxy.main", "meshlet.proxy.app", "meshlet.proxy.config"),
        ("meshlet.controlplane.main", "meshlet.controlplane.injector.server"),
    ],
)
def test_not_imported(modules: tuple[str, ...]) -> None:
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {CLI_ONLY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
