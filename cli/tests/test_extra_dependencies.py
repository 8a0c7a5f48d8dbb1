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


# meshlet's CLI as `pip install meshlet` leaves it: the cli extra's modules cannot be imported.
WITHOUT_THE_EXTRA = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {"rich", "jsonpatch", "helm_python"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
from meshlet.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--version"], 0, "meshlet, version "),
        (["--help"], 0, "install"),
        (["version", "--client"], 0, "Client version: "),
        (["identity", "ca", "create", "--help"], 0, "--anchor-days"),
        (["check", "--kubeconfig", "/nonexistent"], 1, "needs the cli extra (it lacks rich)"),
        (["install", "--ignore-cluster"], 64, "pip install 'meshlet[cli]'"),
    ],
)
def test_the_cli_without_its_extra_works_or_names_the_extra(
    argv: list[str], code: int, says: str
) -> None:
    """`pip install meshlet` (no extra): --version, --help and the verbs that need nothing
    more work; a verb that needs rich, jsonpatch or the Helm engine says which extra to
    install, in one line, without a traceback."""
    run = subprocess.run([sys.executable, "-c", WITHOUT_THE_EXTRA, *argv],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == code, run.stderr
    assert says in run.stdout + run.stderr
    assert "Traceback" not in run.stderr
