"""The route-cost benchmark's table and its route tables (the middle route the requests hit is
a path prefix, the tables hold the kinds of route the docstring says, and the policy controller
reads them), and a short run of its rows with their checks, without valgrind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench import instructions_routes as routes
from meshlet.controlplane.policy.resources import parse
from meshlet.controlplane.policy.routes import Route

REPO = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT = 40.0  # ~4 s on a quiet machine


def test_the_table_gives_the_ratio_to_no_route_and_judges_the_hundred() -> None:
    lines = routes.table({"HTTP/1.1": {0: 1_000_000.0, 100: 1_040_000.0, 10_000: 1_200_000.0},
                          "HTTP/2": {0: 2_000_000.0, 100: 2_200_000.0}})  # fmt: skip
    assert lines[2] == "| HTTP/1.1 | 0 | 1,000,000 | **1.000x** |  |"
    assert lines[3] == "| HTTP/1.1 | 100 | 1,040,000 | **1.040x** | yes |"
    assert lines[4] == "| HTTP/1.1 | 10,000 | 1,200,000 | **1.200x** |  |"
    assert lines[6] == "| HTTP/2 | 100 | 2,200,000 | **1.100x** | **no: over 1.05x** |"


def kind(route: dict) -> str:  # type: ignore[type-arg]
    match = route["spec"]["rules"][0]["matches"][0]
    if "headers" in match:
        return "header"
    return str(match["path"]["type"])


def test_the_tables_mix_prefixes_exact_paths_headers_and_regexes() -> None:
    for n in (routes.ROUTES, routes.MANY):
        i, path = routes.target(n)
        assert kind(routes.http_route(i)) == "PathPrefix" and path.startswith(f"/svc{i:05d}/api/")
    kinds = Counter(kind(routes.http_route(i)) for i in range(routes.ROUTES))
    assert kinds == {"PathPrefix": 69, "Exact": 19, "header": 10, "RegularExpression": 2}
    edited = routes.http_route(50, edit=2)["spec"]["rules"][0]["filters"][0]
    assert edited["responseHeaderModifier"]["set"] == [{"name": "x-edit", "value": "2"}]


def test_the_policy_controller_reads_every_kind_of_route_the_table_holds() -> None:
    for i in (0, 1, 3, 17, 50):
        read = parse(routes.http_route(i, edit=i == 50))
        assert isinstance(read, Route) and read.services == (("shop", "api", None),)
        assert len(read.rules) == 1 and len(read.rules[0].matches) == 1


def test_each_row_routes_its_requests_by_the_expected_route_and_an_edit_is_used() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.instructions_routes", "--smoke"],
        cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    rows = {f"{client} {n}" for client in routes.CLIENTS for n in (0, routes.ROUTES)}
    assert {k: v for k, v in found.items() if k in rows} == dict.fromkeys(rows, "ok")
    assert 0 < found["update seconds"] < SMOKE_TIMEOUT
