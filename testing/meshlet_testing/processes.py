"""Ending a test's own processes: asked first (SIGTERM), forced when they take too long."""

from __future__ import annotations

import subprocess
from typing import Any


def stop(proc: subprocess.Popen[Any], within: float = 10.0) -> int:
    """Terminates `proc`, kills it if it is still running after `within` seconds; its status."""
    proc.terminate()
    try:
        return proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
