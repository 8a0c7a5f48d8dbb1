"""The instruction count's parts that need no valgrind: its upstream and its clients, talking
to each other directly (what they measure through the proxy is this same exchange)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import instructions


@pytest.mark.parametrize("client", list(instructions.CLIENTS))
def test_each_client_completes_its_requests_against_the_upstream(client: str) -> None:
    run, which = instructions.CLIENTS[client]
    with instructions.upstream() as ports:
        run(ports[which], ports[which], 25)  # straight to the upstream: no proxy between


def test_a_total_is_read_from_callgrinds_output() -> None:
    text = "events: Ir\nsummary: 123456\ntotals: 123456\n"
    match = instructions._TOTAL.search(text)
    assert match is not None and int(match.group(1)) == 123456


def test_the_policy_table_gives_the_ratio_and_flags_over_three_percent() -> None:
    from bench.instructions_policy import table

    lines = table([("HTTP/1.1", 1_000_000.0, 1_020_000.0), ("HTTP/2", 2_000_000.0, 2_080_000.0)])
    assert lines[-2] == "| HTTP/1.1 | 1,000,000 | 1,020,000 | **1.020x** | yes |"
    assert lines[-1] == "| HTTP/2 | 2,000,000 | 2,080,000 | **1.040x** | **no: over 1.03x** |"


def test_a_row_over_its_budget_by_more_than_two_percent_is_marked_and_fails_the_check(
    tmp_path: Path,
) -> None:
    from bench import budget

    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"rows": {"HTTP/1.1": {"instructions": 100_000},
                                         "HTTP/2 (h2c)": {"instructions": 200_000}}}))  # fmt: skip
    budgets = budget.load(path)
    rows: list[tuple[str, float, float | None]] = [
        ("HTTP/1.1", 101_900.0, None), ("HTTP/2 (h2c)", 204_100.0, None), ("new", 5.0, None)
    ]  # fmt: skip
    verdicts = {row: budget.judge(row, now, budgets) for row, now, _ in rows}
    assert [v.over for v in verdicts.values()] == [False, True, False]
    lines = instructions.table(rows, verdicts)
    assert lines[2] == "| HTTP/1.1 | 101,900 | 100,000 | 1.019x |"
    assert lines[3] == "| HTTP/2 (h2c) | 204,100 | 200,000 | **1.020x: over by more than 2%** |"
    assert lines[4] == "| new | 5 | - | no budget |"


def test_recording_only_ever_lowers_the_budget(tmp_path: Path) -> None:
    from bench import budget

    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"rows": {"HTTP/1.1": {"instructions": 100_000},
                                         "HTTP/2 (h2c)": {"instructions": 200_000}}}))  # fmt: skip
    changed = budget.record({"HTTP/1.1": 90_000.4, "HTTP/2 (h2c)": 250_000.0}, "abc1234", path)
    assert changed == ["HTTP/1.1"]
    assert budget.load(path) == {"HTTP/1.1": 90_000.0, "HTTP/2 (h2c)": 200_000.0}
    assert json.loads(path.read_text())["rows"]["HTTP/1.1"]["revision"] == "abc1234"


def test_the_recorded_budget_names_every_row_the_ci_check_measures() -> None:
    from bench import budget

    assert set(instructions.CLIENTS) <= set(budget.load())


def test_a_benchmarks_rows_are_shown_against_their_budgets(tmp_path: Path) -> None:
    from bench import budget

    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"rows": {"a": {"instructions": 1_000}}}))
    lines = budget.section({"a": 1_030.0, "b": 7.0}, path)
    assert lines[2:] == ["| a | 1,030 | 1,000 | **1.030x: over by more than 2%** |",
                         "| b | 7 | - | no budget |"]  # fmt: skip
