"""When each drill acts, relative to the start of the load."""

from __future__ import annotations

import pytest

from meshlet.cli.demo import drills


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
