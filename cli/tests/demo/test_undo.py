"""What the demo's teardown finds to stop besides its record: its own children, recorded or not
(a start an interrupt cut short between the fork and the record)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from meshlet.cli.demo.run import children


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_children_are_the_live_processes_this_one_started() -> None:
    live = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ended = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while state(ended.pid) != "Z":  # exited, not yet waited for
            assert time.monotonic() < deadline
            time.sleep(0.01)
        found = children(os.getpid())
        assert live.pid in found
        assert ended.pid not in found  # a zombie holds nothing
    finally:
        ended.wait()
        live.kill()
        live.wait()
