"""The instruction budget: per row of `bench.instructions`, the instructions per request of a
recorded reference (bench/instructions-budget.json), and the verdict on a new count.

A row more than TOLERANCE over its budget is over (callgrind's counts of the same code move by
well under 1 % from run to run: hash seeds, the garbage collector's timing). The budget only
goes down: `record` lowers a row to a lower count and never raises one; raising a row is an edit
of the file, with its reason in the commit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

FILE: Final = Path(__file__).resolve().parent / "instructions-budget.json"
TOLERANCE: Final = 0.02


@dataclass(frozen=True)
class Verdict:
    budget: float | None  # None: the row has no budget
    ratio: float | None  # the count ÷ the budget
    over: bool

    @property
    def cell(self) -> str:
        """The table's cell: the ratio, marked when over."""
        if self.ratio is None:
            return "no budget"
        text = f"{self.ratio:.3f}x"
        return f"**{text}: over by more than {TOLERANCE:.0%}**" if self.over else text


def load(path: Path = FILE) -> dict[str, float]:
    """Each row's budget (instructions per request); none without the file."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {row: float(entry["instructions"]) for row, entry in data["rows"].items()}


def judge(row: str, count: float, budgets: Mapping[str, float]) -> Verdict:
    budget = budgets.get(row)
    if budget is None:
        return Verdict(None, None, False)
    ratio = count / budget
    return Verdict(budget, ratio, ratio > 1 + TOLERANCE)


def record(counts: Mapping[str, float], revision: str, path: Path = FILE) -> list[str]:
    """Lowers each row whose count is below its budget (a row without one gets it); the rows
    changed. A count above its budget is left out: the budget only goes down."""
    data = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    rows = data.setdefault("rows", {})
    changed = []
    for row, count in counts.items():
        entry = rows.get(row)
        if entry is None or count < float(entry["instructions"]):
            rows[row] = {"instructions": round(count), "revision": revision,
                         "date": time.strftime("%Y-%m-%d")}  # fmt: skip
            changed.append(row)
    if changed:
        path.write_text(json.dumps(data, indent=2) + "\n")
    return changed


def section(counts: Mapping[str, float], path: Path = FILE) -> list[str]:
    """`counts` (row → instructions per request) held to their budgets, as a Markdown table."""
    budgets = load(path)
    lines = ["| row | instructions | budget | now/budget |", "| --- | ---: | ---: | ---: |"]
    for row, count in counts.items():
        verdict = judge(row, count, budgets)
        limit = f"{verdict.budget:,.0f}" if verdict.budget is not None else "-"
        lines.append(f"| {row} | {count:,.0f} | {limit} | {verdict.cell} |")
    return lines
