"""The soak (`make soak`): its accounting on made-up load stats, and a short real run of the
local mesh with two faults."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soak import Period, drift, load_window, process_usage, report, wait_listening
from meshlet.cli.demo import lock


def test_a_window_counts_the_calls_between_two_stats_and_its_own_slowest_call() -> None:
    before = {"sent": 100, "late": 1, "failed": {"http 502": 2}, "why": {"api: UNAVAILABLE": 2},
              "slowest": [[10, 900.0], [20, 15.0]]}  # fmt: skip
    after = {"sent": 160, "late": 1, "failed": {"http 502": 5, "timeout": 1},
             "why": {"api: UNAVAILABLE": 3},
             "slowest": [[20, 15.0], [21, 40.5], [30, 5000.0]]}  # fmt: skip
    window = load_window(after, before, 20, 30)
    assert window == {
        "sent": 60, "failed": 4, "late": 0, "slowest_ms": 40.5,
        "why": {"http 502": 3, "timeout": 1, "web's reason api: UNAVAILABLE": 1},
    }  # fmt: skip


def test_drift_is_warm_up_peak_and_end_per_process() -> None:
    periods = [Period(i, "f", 0.0, rss_mib=rss) for i, rss in enumerate(
        [{"proxy-web-1": 30.0, "destination": 50.0}, {"proxy-web-1": 34.0},
         {"proxy-web-1": 31.0, "destination": 52.0}], 1)]  # fmt: skip
    assert drift(periods, lambda p: p.rss_mib) == {
        "proxy-web-1": [30.0, 34.0, 31.0], "destination": [50.0, 52.0, 52.0],
    }  # fmt: skip


def test_the_report_totals_failures_and_names_the_slowest_call_of_each_fault() -> None:
    periods = [
        Period(1, "kill-replica", 0.0, sent=1200, failed=3, why={"http 502": 3},
               slowest_ms=812.0, rss_mib={"tap": 40.0}, open_files={"tap": 12}),
        Period(2, "restart-identity", 60.0, sent=1200, slowest_ms=20.0,
               rss_mib={"tap": 41.0}, open_files={"tap": 12}),
    ]  # fmt: skip
    text = report(periods, [], 2, 20)
    assert "**3 failed of 2400 calls**" in text
    assert "kill-replica 812 ms, restart-identity 20 ms" in text
    assert "| tap | 40.0 → 41.0 → 41.0 | 12 → 12 → 12 |" in text
    assert text.endswith("processes that ended by themselves: none")


def test_a_process_s_memory_and_files_are_read_and_a_gone_one_is_none() -> None:
    rss, files = process_usage(os.getpid()) or (0.0, 0)
    assert rss > 10 and files >= 3
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_usage(child.pid) is None


@pytest.mark.demo
def test_a_short_soak_runs_its_faults_and_measures_every_process(
    netns_available: None, tmp_path: Path
) -> None:
    """Two 10 s periods of the real local mesh: api-2 killed and brought back, the destination
    restarted; the load went on through both, every process was measured, nothing was left."""
    out = tmp_path / "soak.json"
    with lock.held(300.0):  # the soak runs under it, as this test's child
        run = subprocess.run(
            [sys.executable, "-m", "bench.soak", "--minutes", "0.34", "--period", "10",
             "--json", str(out)],
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    periods = json.loads(out.read_text())
    assert [p["fault"] for p in periods] == ["kill-replica", "restart-destination"]
    for period in periods:
        assert period["sent"] >= 100, period  # 20 calls/s for 10 s, less a busy machine's lag
        assert {"destination", "identity", "policy", "tap", "proxy-web-1", "app-web-1",
                "proxy-api-2"} <= set(period["rss_mib"]), period  # fmt: skip
        assert all(v > 5 for v in period["rss_mib"].values()), period
        assert all(v >= 3 for v in period["open_files"].values()), period
    assert periods[0]["events"][0].startswith("kill-replica at ")
    assert periods[0]["events"][1].startswith("repaired at ")
    assert "failed of" in run.stdout and "processes that ended by themselves: none" in run.stdout
    assert "could not remove" not in run.stdout


def test_a_restarted_app_counts_as_up_once_it_listens() -> None:
    """The harness puts a rolled pod back in the endpoints only when its app listens (a pod
    put back while its app was starting got web's calls refused)."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        started = time.monotonic()
        wait_listening(os.getpid(), "127.0.0.1", port, within=5)
        assert time.monotonic() - started < 1
    started = time.monotonic()
    wait_listening(os.getpid(), "127.0.0.1", port, within=0.3)  # closed: waits it out
    assert time.monotonic() - started >= 0.3
    # grpcio and asyncio servers given 0.0.0.0 may listen dual-stack, on [::] (tcp6)
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as both:
        started = time.monotonic()
        wait_listening(os.getpid(), "10.77.1.21", both.getsockname()[1], within=5)
        assert time.monotonic() - started < 1
