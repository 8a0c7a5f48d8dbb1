"""The dashboard reader the query tests rely on: variables, nested panels, expansion as Grafana
does it, and a report that names the query that answered nothing."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from meshlet_testing import grafana

BOARD = {
    "templating": {
        "list": [
            {"name": "namespace", "type": "query",
             "query": {"query": "label_values(up, namespace)"}},
            {"name": "deployment", "type": "query",
             "query": 'label_values(up{namespace="$namespace"}, deployment)'},
            {"name": "ds", "type": "datasource", "query": "prometheus"},
        ]
    },
    "panels": [
        {"type": "row", "title": "a row", "panels": [
            {"title": "nested", "targets": [{"expr": 'sum(up{deployment="${deployment}"})'}]},
        ]},
        {"title": "rate", "targets": [{"expr": "rate(x[$__rate_interval])"}, {"refId": "B"}]},
    ],
}  # fmt: skip

SERIES = [
    {"namespace": "a", "deployment": "web"},
    {"namespace": "a", "deployment": "api"},
    {"namespace": "b", "deployment": "db"},
]


def run(promql: str) -> list[Mapping[str, str]]:
    if promql == "count by (namespace) (up)":
        return [{"namespace": ns} for ns in sorted({s["namespace"] for s in SERIES})]
    if promql.startswith('count by (deployment) (up{namespace="'):
        ns = promql.split('"')[1]
        return [{"deployment": s["deployment"]} for s in SERIES if s["namespace"] == ns]
    if promql == 'sum(up{deployment="db"})':
        return [{}]
    return []


def test_variables_and_queries_are_read_in_order_rows_included() -> None:
    assert grafana.variables(BOARD) == [
        grafana.Variable("namespace", "up", "namespace"),
        grafana.Variable("deployment", 'up{namespace="$namespace"}', "deployment"),
    ]
    assert [(q.panel, q.expr) for q in grafana.queries(BOARD, "b.json")] == [
        ("nested", 'sum(up{deployment="${deployment}"})'),
        ("rate", "rate(x[$__rate_interval])"),
    ]


def test_choices_follow_the_earlier_variables() -> None:
    choices, problems = grafana.assignments(grafana.variables(BOARD), run)
    assert choices == [
        {"namespace": "a", "deployment": "api"},
        {"namespace": "a", "deployment": "web"},
        {"namespace": "b", "deployment": "db"},
    ]
    assert problems == []
    empty, problems = grafana.assignments([grafana.Variable("x", "nothing", "x")], run)
    assert empty == [] and problems == ["variable $x has no values for {}: count by (x) (nothing)"]


def test_expansion() -> None:
    assert grafana.expand('rate(x{d="${d}"}[$__rate_interval])', {"d": "web"}) == (
        'rate(x{d="web"}[1m])'
    )
    assert grafana.used('a{b="$b", c="${c:regex}"}[$__range]') == {"b", "c"}
    with pytest.raises(grafana.DashboardError, match=r"\$missing has no value"):
        grafana.expand('up{a="$missing"}', {})
    with pytest.raises(grafana.DashboardError, match="not label_values"):
        grafana.variables({"templating": {"list": [{"name": "v", "type": "query", "query": "up"}]}})


def test_a_query_answers_when_one_choice_gives_data() -> None:
    choices, _ = grafana.assignments(grafana.variables(BOARD), run)
    nested, rate = grafana.queries(BOARD, "b.json")
    assert grafana.first_answering(nested, choices, run) is None
    assert grafana.first_answering(rate, choices, run) == (
        "b.json / 'rate': rate(x[$__rate_interval]) -> nothing for any of 1 choices"
    )

    def broken(promql: str) -> list[Mapping[str, str]]:
        raise RuntimeError("parse error")

    assert grafana.first_answering(rate, choices, broken) == (
        "b.json / 'rate': rate(x[$__rate_interval]) -> parse error"
    )
