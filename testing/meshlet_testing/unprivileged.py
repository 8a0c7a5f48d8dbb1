"""Running a command without privilege: every capability dropped (`setpriv`). The user stays
the same, so files only its owner may read (an interpreter under /root) stay readable, but no
network namespace, iptables rule, privileged port or other user's file is within reach."""

from __future__ import annotations

import shutil
import subprocess
from typing import Final

import pytest

UNPRIVILEGED: Final = ("setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
                       "--no-new-privs")  # fmt: skip


def unprivileged(*argv: str) -> list[str]:
    """`argv` run without a capability; skips the test where setpriv is missing, and fails it
    where dropping the capabilities does not take network namespaces away."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    probe = subprocess.run([*UNPRIVILEGED, "ip", "netns", "add", "meshlet-unprivileged-probe"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    if probe.returncode == 0:
        subprocess.run(["ip", "netns", "del", "meshlet-unprivileged-probe"], check=False)
        pytest.fail("a process without capabilities made a network namespace")
    return [*UNPRIVILEGED, *argv]
