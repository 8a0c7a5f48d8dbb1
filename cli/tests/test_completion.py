"""`meshlet completion`: click's scripts for each shell."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.parametrize(("shell", "marker"), [("bash", "complete -o nosort"), ("zsh", "compdef"),
                                               ("fish", "complete --no-files")])  # fmt: skip
def test_scripts(shell: str, marker: str, meshlet: Callable[..., Any]) -> None:
    run = meshlet("completion", shell)
    assert run.code == 0 and marker in run.out and "_MESHLET_COMPLETE" in run.out


def test_unknown_shell(meshlet: Callable[..., Any]) -> None:
    assert meshlet("completion", "tcsh").code == 64
