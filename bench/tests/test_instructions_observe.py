"""Observability's cost comparison: its table, its baseline's revision, and a short run of each
of this tree's settings with their checks (the tap's events, the access log's lines, the spans
at the sink), in a network namespace of its own, without valgrind."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import instructions_observe as observe
from bench.instructions_observe import Row

REPO = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT = 40.0  # ~6 s on a quiet machine


def test_the_table_gives_ratios_to_the_baseline_and_flags_defaults_over_two_percent() -> None:
    rows = [
        Row(observe.BASELINE, "HTTP/1.1", 1_000_000.0, 100.0, 900.0),
        Row(observe.DEFAULTS, "HTTP/1.1", 1_015_000.0, 110.0, 850.0),
        Row("tap open", "HTTP/1.1", 1_300_000.0, None, None),
        Row(observe.BASELINE, "HTTP/2", 2_000_000.0),
        Row(observe.DEFAULTS, "HTTP/2", 2_050_000.0),
    ]
    lines = observe.table(rows)
    assert lines[3] == (
        "| HTTP/1.1 | defaults | 1,015,000 | **1.015x** (within 1.02x) | 110.0 | **1.100x** | 850 "
        "|  |"
    )
    assert lines[4] == "| HTTP/1.1 | tap open | 1,300,000 | **1.300x** | n/a | n/a | n/a |  |"
    assert lines[6].startswith("| HTTP/2 | defaults | 2,050,000 | **1.025x** (**over 1.02x**) |")


def test_the_baseline_is_the_proxy_before_tap_landed() -> None:
    rev = observe.before_tap(REPO)
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "-d", rev, "proxy/meshlet/proxy/tap"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert listed.stdout == ""
    now = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "-d", "HEAD", "proxy/meshlet/proxy/tap"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert now.stdout.strip().endswith("proxy/meshlet/proxy/tap")


def test_each_setting_serves_its_requests_and_does_its_work(netns_available: None) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.instructions_observe", "--smoke"],
        cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT,
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, found
    n = observe.SMOKE_REQUESTS
    assert set(found) == set(observe.SETTINGS) - {observe.BASELINE}
    assert found["tap open"]["events"] == observe.TAP_EVENTS * n
    assert found["access log"]["lines"] == n
    assert found["tracing"]["spans"] == n


def test_the_settings_asked_for_are_checked_by_name() -> None:
    assert observe._chosen("baseline, defaults") == (observe.BASELINE, observe.DEFAULTS)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown setting 'tap'"):
        observe._chosen("defaults,tap")
    with pytest.raises(argparse.ArgumentTypeError, match="expected some of"):
        observe._chosen(",")
