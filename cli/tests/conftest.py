"""Running the `meshlet` command in-process, as a user would from a shell."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from meshlet.cli.main import main


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def meshlet(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*args: str) -> Run:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
