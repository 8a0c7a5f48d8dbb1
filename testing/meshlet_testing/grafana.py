"""What a Grafana dashboard asks Prometheus: its panels' queries and its template variables,
and each query as Grafana sends it once the variables have values.

Grafana expands `$name` and `${name}` before a query leaves it, and a template variable's query
is not PromQL but `label_values(selector, label)`. A test that runs a dashboard's queries on a
real Prometheus must do both as Grafana does; the Prometheus calls are the caller's (`run`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# Grafana's own variables, at the value a one-minute window gives them.
BUILTIN: Final = {"__rate_interval": "1m", "__interval": "1m", "__range": "1m"}
_REF: Final = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES: Final = re.compile(r"label_values\((?:(.+),)?\s*(\w+)\s*\)", re.DOTALL)

Run = Callable[[str], list[Mapping[str, str]]]  # PromQL to the label sets of its samples


class DashboardError(Exception):
    """The dashboard is not one these helpers can read; the message names what and where."""


@dataclass(frozen=True, slots=True)
class Variable:
    """A query variable: the values of `label` on the series `selector` picks."""

    name: str
    selector: str
    label: str

    def promql(self) -> str:
        selector = self.selector or f'{{{self.label}!=""}}'
        return f"count by ({self.label}) ({selector})"


@dataclass(frozen=True, slots=True)
class Query:
    dashboard: str
    panel: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel!r}: {self.expr}"


def variables(board: Mapping[str, Any]) -> list[Variable]:
    """The dashboard's query variables, in order (a later one may refer to an earlier one)."""
    found = []
    for var in (board.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = _LABEL_VALUES.fullmatch(text.strip())
        if match is None:
            raise DashboardError(f"variable {var.get('name')}: not label_values(...): {text!r}")
        found.append(Variable(var["name"], (match[1] or "").strip(), match[2]))
    return found


def _panels(panels: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def queries(board: Mapping[str, Any], dashboard: str) -> list[Query]:
    """Every target's `expr` of every panel, rows' nested panels included."""
    return [
        Query(dashboard, str(panel.get("title") or f"panel {panel.get('id')}"), target["expr"])
        for panel in _panels(board.get("panels") or [])
        for target in panel.get("targets") or []
        if target.get("expr")
    ]


def used(text: str) -> set[str]:
    """The variables `text` refers to, Grafana's own left out."""
    return {m[1] or m[2] for m in _REF.finditer(text)} - set(BUILTIN)


def expand(text: str, values: Mapping[str, str]) -> str:
    """`text` with every `$name`/`${name}` replaced; DashboardError names one without a value."""
    known = {**BUILTIN, **values}

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in known:
            raise DashboardError(f"${name} has no value in {text}")
        return known[name]

    return _REF.sub(value, text)


def assignments(board_vars: Sequence[Variable], run: Run) -> tuple[list[dict[str, str]], list[str]]:
    """Every choice of values a user can make, each variable's values read with the earlier
    choices made; and, for each variable that offers no value for some choice, why."""
    choices: list[dict[str, str]] = [{}]
    problems: list[str] = []
    for var in board_vars:
        following = []
        for chosen in choices:
            promql = expand(var.promql(), chosen)
            values = sorted({labels[var.label] for labels in run(promql) if var.label in labels})
            if not values:
                problems.append(f"variable ${var.name} has no values for {chosen}: {promql}")
            following += [{**chosen, var.name: v} for v in values]
        choices = following
    return choices, problems


def projections(choices: Sequence[Mapping[str, str]], names: set[str]) -> list[dict[str, str]]:
    """The distinct choices of just `names`' values."""
    seen = {tuple(sorted((n, c[n]) for n in names if n in c)) for c in choices}
    return [dict(pairs) for pairs in sorted(seen)] or [{}]


def first_answering(query: Query, choices: Sequence[Mapping[str, str]], run: Run) -> str | None:
    """None when `query` returns data for one of the `choices`; else why not (nothing, or the
    error each attempt met)."""
    errors = []
    for values in projections(choices, used(query.expr)):
        try:
            if run(expand(query.expr, values)):
                return None
        except Exception as exc:  # the caller's Prometheus errors, named in the report
            errors.append(str(exc))
    tried = len(projections(choices, used(query.expr)))
    return f"{query} -> {'; '.join(errors) if errors else f'nothing for any of {tried} choices'}"
