"""When each drill acts, relative to the start of the load, and where it can run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from meshlet.cli.demo import drills, topology
from meshlet.cli.demo.topology import Mode


def test_no_drill_no_steps() -> None:
    assert drills.schedule(None, 20) == []


@pytest.mark.parametrize("drill", drills.DRILLS)
def test_the_fault_comes_at_30_percent_and_the_repair_at_60(drill: str) -> None:
    steps = drills.schedule(drill, 20)
    assert steps == sorted(steps, key=lambda step: step.at)
    assert steps[0].at == pytest.approx(6.0)
    assert all(step.at < 20 for step in steps)  # everything happens, and is measured, in time


def test_without_a_duration_the_drill_comes_at_10_and_20_seconds() -> None:
    steps = drills.schedule("kill-destination", 0)
    assert [(s.at, s.action) for s in steps[:2]] == [
        (10.0, "kill destination"),
        (20.0, "start destination"),
    ]


def test_the_deny_drill_marks_around_its_client() -> None:
    """The store's counters are read before the client starts and after it stops, so that the
    window holds all of its attempts."""
    steps = drills.schedule("deny", 20)
    assert [(s.at, s.action) for s in steps] == [
        (6.0, "mark intruding"),
        (6.0, f"intrude {drills.INTRUDER_POD}"),
        (12.0, f"leave {drills.INTRUDER_POD}"),
        (12.0, "mark left"),
    ]


def test_the_deny_drill_needs_network_namespaces() -> None:
    problem = drills.unavailable("deny", Mode.LOOPBACK)
    assert problem is not None and "needs netns mode" in problem and "directly" in problem
    assert drills.unavailable("deny", Mode.NETNS) is None
    for drill in drills.DRILLS:
        if drill != "deny":
            assert drills.unavailable(drill, Mode.LOOPBACK) is None


def test_the_intruder_calls_store_by_name_from_an_api_pod() -> None:
    argv = drills.intruder_argv("/s.json")
    assert argv[:3] == ["demo", "app", "intruder"]
    assert argv[argv.index("--target") + 1] == "store.demo.svc.cluster.local:7000"
    layout = topology.layout(Mode.NETNS)
    assert layout.pod(drills.INTRUDER_POD).workload not in topology.STORE_CLIENTS


def test_loopback_mode_refuses_the_deny_drill_before_building_anything(
    meshlet: Callable[..., Any],
) -> None:
    result = meshlet("demo", "--mode", "loopback", "--drill", "deny", "--duration", "5")
    assert result.code == 64  # a usage error
    assert "--drill deny needs netns mode" in result.err
    assert "this run: loopback mode, asked for" in result.err
    assert "building the mesh" not in result.out
