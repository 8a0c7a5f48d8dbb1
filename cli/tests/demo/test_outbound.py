"""api's outbound policy as the demo reads it from the callers' proxies' metrics (real
exposition text, parsed as the demo parses it) and shows it: the route's split per backend, the
balancers' ready and pending endpoints, the load's success in a window; the new drills' steps
and their summaries."""

from __future__ import annotations

import pytest
from rich.console import Console
from rich.text import Text

from meshlet.cli.demo import drills, outbound, topology
from meshlet.cli.demo.outbound import Endpoints
from meshlet.cli.demo.view import Outbound, outbound_lines
from meshlet.cli.stats import Scrape, parse

PARENT = ('parent_group="core",parent_kind="Service",parent_namespace="demo",parent_name="{p}",'
          'parent_port="9090",parent_section_name=""')  # fmt: skip
BACKEND = ('backend_group="core",backend_kind="Service",backend_namespace="demo",'
           'backend_name="{b}",backend_port="9090",backend_section_name=""')  # fmt: skip
ROUTE = 'route_group="gateway.networking.k8s.io",route_kind="HTTPRoute",route_namespace="demo",route_name="api-split"'  # noqa: E501


def exposition(
    requests: dict[tuple[str, str], float], endpoints: dict[str, tuple[int, int]]
) -> str:
    lines = ["# TYPE outbound_http_route_backend_requests counter"]
    for (parent, backend), n in requests.items():
        labels = ",".join((PARENT.format(p=parent), ROUTE, BACKEND.format(b=backend)))
        lines.append(f"outbound_http_route_backend_requests_total{{{labels}}} {n}")
    lines.append("# TYPE outbound_http_balancer_endpoints gauge")
    for backend, (ready, pending) in endpoints.items():
        both = ",".join((PARENT.format(p=backend), BACKEND.format(b=backend)))
        for state, n in (("ready", ready), ("pending", pending)):
            lines.append(f'outbound_http_balancer_endpoints{{{both},endpoint_state="{state}"}} {n}')
    return "\n".join(lines) + "\n"


def scrape(pod: str, at: float, requests: dict[tuple[str, str], float],
           endpoints: dict[str, tuple[int, int]] | None = None) -> Scrape:  # fmt: skip
    return Scrape(pod, at, parse(exposition(requests, endpoints or {})))


def test_the_split_counts_each_backend_of_the_parent_between_two_scrapes() -> None:
    old = {"web-1": scrape("web-1", 0.0, {("api", "api"): 100, ("api", "api-v2"): 10}),
           "load-1": None}  # fmt: skip
    new = {
        "web-1": scrape("web-1", 10.0, {("api", "api"): 190, ("api", "api-v2"): 20,
                                        ("other", "x"): 50}),
        "load-1": scrape("load-1", 10.0, {("api", "api-v2"): 5}),  # from its proxy's start
    }  # fmt: skip
    counts = outbound.split_between(old, new, "api")
    assert counts == {"api": 90.0, "api-v2": 15.0}
    assert outbound.shares(counts) == pytest.approx({"api": 90 / 105, "api-v2": 15 / 105})
    assert outbound.shares({}) == {}


def test_a_counter_that_went_back_counts_nothing() -> None:
    """A proxy restarted between the scrapes: its counter restarts low; no negative calls."""
    old = {"web-1": scrape("web-1", 0.0, {("api", "api"): 100})}
    new = {"web-1": scrape("web-1", 5.0, {("api", "api"): 3})}
    assert outbound.split_between(old, new, "api") == {"api": 0.0}


def test_balancers_sum_ready_and_pending_over_the_proxies() -> None:
    scrapes = [scrape("web-1", 1.0, {}, {"api": (2, 1), "api-v2": (1, 0)}),
               scrape("load-1", 1.0, {}, {"web": (1, 0)})]  # fmt: skip
    assert outbound.balancers(scrapes) == {
        "api": Endpoints(2, 1), "api-v2": Endpoints(1, 0), "web": Endpoints(1, 0),
    }  # fmt: skip


def test_success_counts_the_calls_that_ended_in_the_window() -> None:
    calls = [(1.0, "ok", "api-1"), (2.0, "http 502", ""), (3.0, "ok", "api-2"), (4.0, "ok", "")]
    assert outbound.success(calls, 1.0, 3.0) == 0.5  # [1, 3): the ok at 1 and the 502 at 2
    assert outbound.success(calls, 3.0, 10.0) == 1.0
    assert outbound.success(calls, 5.0, 10.0) is None


def text(o: Outbound) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(outbound_lines(o))
    return console.export_text()


def test_the_screen_puts_the_weights_beside_the_shares_and_shows_pending_endpoints() -> None:
    pending = {"api": Endpoints(2, 1), "api-v2": Endpoints(1, 0)}
    shown = text(Outbound(route="api-split", parent="api", weights={"api": 90, "api-v2": 10},
                          requests={"api": 171.0, "api-v2": 19.0}, seconds=10.0,
                          balancers=pending))  # fmt: skip
    assert ("api's HTTPRoute api-split, weights api 90 · api-v2 10: api 90.0% (17.1/s) · api-v2"
            " 10.0% (1.9/s)") in shown  # fmt: skip
    assert ("balancers (callers' proxies): api 2 ready, 1 pending (ejected by failure accrual,"
            " or backing off) · api-v2 1 ready") in shown  # fmt: skip
    quiet = text(Outbound(route="api-split", parent="api", weights={"api": 0, "api-v2": 100},
                          requests={}, seconds=0.0, balancers={}))  # fmt: skip
    assert quiet.strip() == "api's HTTPRoute api-split, weights api 0 · api-v2 100: no calls yet"


def test_the_canary_drill_shifts_the_weights_at_the_fault_and_the_repair() -> None:
    steps = drills.schedule("canary", 20)
    assert [(s.at, s.action) for s in steps] == [(6.0, "weigh 50/50"), (12.0, "weigh 0/100")]
    assert topology.CANARY_WEIGHTS == (90, 10)


def test_the_failing_replica_drill_watches_from_the_fault_to_the_end() -> None:
    steps = drills.schedule("failing-replica", 20)
    assert [(s.at, s.action) for s in steps] == [
        (6.0, "watch balancers"), (6.0, "fail api-2"), (12.0, "repair api-2"),
    ]  # fmt: skip


def test_the_summaries_say_what_moved() -> None:
    canary = {"canary_steps": [{"weights": "90/10", "canary_share": 0.095},
                               {"weights": "50/50", "canary_share": 0.4875},
                               {"weights": "0/100", "canary_share": 1.0}]}  # fmt: skip
    assert drills.summary_line("canary", canary) == (
        "; canary drill: api-v2 got 9.5% at 90/10, 48.8% at 50/50, 100.0% at 0/100"
    )
    failing = {"success_before": 1.0, "success_until_ejected": 0.825,
               "success_while_ejected": 0.983, "success_after_repair": 1.0,
               "ejected_after_s": 2.0, "restored_after_s": None}  # fmt: skip
    assert drills.summary_line("failing-replica", failing) == (
        "; failing-replica drill: client success 100.0% before, 82.5% until api-2 was ejected"
        " (after 2 s), 98.3% while ejected, 100.0% after the repair (api-2 not back by the end)"
    )


def test_the_client_line_shows_the_last_windows_success_in_red_under_99_percent() -> None:
    from meshlet.cli.demo.view import Client, client_line

    def line(recent: float | None) -> Text:
        return client_line(Client(sent=100, ok=95, failed={"http 502": 5}, dropped=0,
                                  quantiles=(1.0, 2.0, 3.0), store_first_byte_max_ms=1.0,
                                  recent_success=recent))  # fmt: skip

    dipped = line(0.825)
    assert dipped.plain.endswith("; last 10 s: success 82.50%")
    assert any(str(span.style) == "bold red" and dipped.plain[span.start : span.end] == "82.50%"
               for span in dipped.spans)  # fmt: skip
    recovered = line(1.0)
    assert recovered.plain.endswith("; last 10 s: success 100%")
    assert all(recovered.plain[span.start : span.end] != "100%" for span in recovered.spans)
    assert "last 10 s" not in line(None).plain
