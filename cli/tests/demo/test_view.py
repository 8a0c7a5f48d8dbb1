"""The demo's screen: denials shown beside the allowed traffic, and whom they refused; what the
drills show in words; plain output when it is no terminal; how to reach a kept mesh."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from meshlet.api import wellknown
from meshlet.cli.demo import run, topology
from meshlet.cli.demo.outbound import Endpoints
from meshlet.cli.demo.supervisor import Record
from meshlet.cli.demo.topology import Mode
from meshlet.cli.demo.view import (
    Client,
    Outbound,
    Snapshot,
    balancer_caption,
    certificates_line,
    fit,
    render,
    replicas_table,
)
from meshlet.cli.stats import Row

API = "api.demo.serviceaccount.identity.meshlet.cluster.local"
WEB = "web.demo.serviceaccount.identity.meshlet.cluster.local"


def workload(name: str, allowed: float, denied: float, denied_peers: tuple[str, ...]) -> Row:
    return Row(name=name, meshed="1/1", requests=0, rps=None, success=None,
               quantiles=(None, None, None), mtls=1.0, connections_per_s=20.0, peers=(WEB,),
               allowed=allowed, denied=denied, denied_peers=denied_peers)  # fmt: skip


def screen(*rows: Row) -> list[str]:
    console = Console(width=200, record=True, color_system=None)
    snapshot = Snapshot(title="t", elapsed=1.0, workloads=rows, replicas=(), replica_notes={},
                        client=None, control=(("policy", "up"),), events=())  # fmt: skip
    console.print(render(snapshot))
    return console.export_text().splitlines()


def test_each_workload_shows_what_its_policies_allowed_and_denied() -> None:
    lines = screen(workload("web", 198, 0, ()), workload("store", 199, 47, (API,)))
    header = next(line for line in lines if line.lstrip().startswith("NAME"))
    assert header.split()[-2:] == ["ALLOWED", "DENIED"]
    store = next(line for line in lines if line.startswith("store"))
    assert store.split()[-3:] == ["199", "47", "(api)"]
    web = next(line for line in lines if line.startswith("web"))
    assert web.split()[-2:] == ["198", "0"]
    assert "policy up" in "\n".join(lines)


def replica(name: str, share: float | None, rps: float | None = 10.0) -> Row:
    return Row(name=name, meshed="", requests=100, rps=rps, success=1.0,
               quantiles=(4.0, 9.0, 20.0), mtls=1.0, connections_per_s=None, peers=(),
               share=share)  # fmt: skip


def text(renderable: Any) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_gone_replica_keeps_its_line_without_a_rate() -> None:
    table = replicas_table([replica("api-1", 0.5), replica("api-3", 0.5)],
                           {"api-2": "killed"}, {"api-2": 4.2})  # fmt: skip
    lines = text(table).splitlines()
    gone = next(line for line in lines if line.startswith("api-2"))
    assert gone.split()[1:5] == ["-", "-", "-", "-"]
    assert "gone: no metrics for 4 s (killed)" in gone
    assert [line.split()[1] for line in lines if line.startswith(("api-1", "api-3"))] == [
        "50.0%",
        "50.0%",
    ]


def test_a_slow_replicas_small_share_is_put_down_to_the_balancer() -> None:
    rows = [replica("api-1", 0.46), replica("api-2", 0.46), replica("api-3", 0.08)]
    caption = balancer_caption(rows, {"api-3": 50.0}).plain
    assert "api-3 answers 50 ms slower: it gets 8.0% of the calls, not the even 33%" in caption
    assert "the balancers see its latency" in caption
    early = balancer_caption([replica("api-1", 0.34), replica("api-2", 0.33),
                              replica("api-3", 0.33)], {"api-1": 200.0}).plain  # fmt: skip
    assert "api-1 answers 200 ms slower: it still gets 34.0%" in early
    assert balancer_caption(rows, {}).plain.count("\n") == 0


def test_certificate_renewals_are_counted_and_those_after_a_restart_named() -> None:
    now = 1_000.0
    certs = {
        "web-1": {"refreshed_at": 990.0, "expires_at": 1_012.0, "refreshes_ok": 3,
                  "refreshes_failed": 1},
        "api-1": {"refreshed_at": 960.0, "expires_at": 1_030.0, "refreshes_ok": 2,
                  "refreshes_failed": 0},
    }  # fmt: skip
    line = certificates_line(certs, now, since=980.0)
    assert line is not None
    assert line.plain == ("certificates: 2 proxies, 5 issued or renewed, 1 failed; soonest "
                          "expiry in 12 s; renewed since identity came back: 1/2")  # fmt: skip
    assert certificates_line({}, now) is None


def test_without_a_terminal_events_are_lines_and_the_view_comes_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None)
    assert not console.is_terminal
    events: list[tuple[float, str]] = [(1.0, "control plane up")]
    clock = [100.0]
    monkeypatch.setattr(run.time, "monotonic", lambda: clock[0])
    views = []

    def view() -> str:
        views.append(clock[0])
        return f"VIEW {len(views)}"

    with run.Screen(console, events) as screen:
        screen.show(view)
        events.append((65.0, "drill: api-2 killed"))
        clock[0] += 1.0
        screen.show(view)
        clock[0] += run.SNAPSHOT_EVERY
        screen.show(view)
    assert out.getvalue().splitlines() == [
        "00:01 control plane up", "VIEW 1", "01:05 drill: api-2 killed", "VIEW 2",
    ]  # fmt: skip


def test_a_kept_loopback_mesh_says_how_to_call_web() -> None:
    layout = topology.layout(Mode.LOOPBACK)
    lines = run.reach(layout, {"prometheus": "http://127.0.0.1:9090"}, Path("/run/x/logs"))
    load = layout.of("load")[0]
    assert lines[0] == (
        "call web through load-1's proxy:   curl -s -H 'host: web.demo.svc.cluster.local:80' "
        f"http://{load.ip}:{wellknown.PROXY_OUTBOUND_PORT}/"
    )
    assert lines[1:] == ["prometheus: http://127.0.0.1:9090", "logs: /run/x/logs",
                         "stop it and remove everything: meshlet demo down"]  # fmt: skip


def test_undoing_a_loopback_run_leaves_any_network_alone() -> None:
    loopback = Record(mode="loopback", root="/nonexistent", shm="/nonexistent")
    assert not run.removes_network(loopback)
    netns = Record(mode="netns", root="/nonexistent", shm="/nonexistent",
                   netns=["meshlet-web-1"])  # fmt: skip
    assert run.removes_network(netns)


def busiest_snapshot() -> Snapshot:
    """Everything the screen can show at once: a drill's title, a denied identity, two slow
    replicas and a gone one, a backend with endpoints pending, failed calls by reason, a
    control-plane process down, certificate renewals after a restart, long events, loopback's
    footer."""
    load = "load.demo.serviceaccount.identity.meshlet.cluster.local"

    def busy(name: str, meshed: str, peers: tuple[str, ...], denied: float = 0.0) -> Row:
        return Row(name=name, meshed=meshed, requests=2000, rps=123.4, success=0.9876,
                   quantiles=(4.2, 123.0, 1234.0), mtls=0.9876, connections_per_s=12.3,
                   peers=peers, allowed=12345, denied=denied,
                   denied_peers=(API,) if denied else ())  # fmt: skip

    workloads = [busy("web", "1/1", (load,)), busy("api", "2/3", (WEB,)),
                 busy("api-v2", "1/1", (WEB,)),
                 busy("store", "1/1", (WEB,), denied=1234)]  # fmt: skip
    replicas = [replica("api-1", 0.12), replica("api-3", 0.88)]
    certificates = {f"p{i}": {"refreshed_at": 990.0, "expires_at": 1_012.0, "refreshes_ok": 30,
                               "refreshes_failed": 2} for i in range(8)}  # fmt: skip
    return Snapshot(
        title="meshlet demo · network namespaces + iptables · drill: failing-replica · 20 calls/s",
        elapsed=3599.0, workloads=workloads, replicas=replicas,
        replica_notes={"api-1": "+200 ms", "api-2": "killed", "api-3": "+50 ms"},
        client=Client(sent=123456, ok=123000, failed={"UNAVAILABLE": 300, "INTERNAL": 156},
                      dropped=12, quantiles=(5.0, 20.0, 1234.0), store_first_byte_max_ms=31.0,
                      recent_success=0.8123),
        control=(("identity", "up"), ("destination", "down"), ("policy", "up"), ("tap", "up")),
        events=[(float(t), f"drill: event number {t} with a long description of what it did "
                           "to which replica and why, long enough to wrap twice at 80 columns")
                for t in range(10)],
        footer=("loopback mode: apps call their proxy explicitly and the store directly; "
                "transparent interception needs root and network namespaces. Ctrl-C stops the "
                "demo and removes everything it made"),
        gone={"api-2": 4.0}, slow={"api-1": 200.0, "api-3": 50.0},
        certificates=certificates_line(certificates, 1_000.0, since=980.0),
        certificates_short=certificates_line(certificates, 1_000.0, since=980.0, short=True),
        outbound=Outbound(route="api-split", parent="api", weights={"api": 50, "api-v2": 50},
                          requests={"api": 512.0, "api-v2": 488.0}, seconds=10.0,
                          balancers={"api": Endpoints(2, 1), "api-v2": Endpoints(1, 0)}),
    )  # fmt: skip


def test_the_live_view_fits_80x24_whole() -> None:
    """On an 80x24 terminal every part of the view shows, each line within 80 columns and no
    table column cut to an ellipsis, in at most 23 lines (the cursor keeps the 24th)."""
    console = Console(width=80, height=24, record=True, color_system=None)
    console.print(fit(busiest_snapshot(), 80, 24))
    lines = console.export_text().splitlines()
    assert len(lines) <= 23, "\n".join(lines)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.startswith("NAME"))
    assert header.split() == ["NAME", "MESHED", "SUCCESS", "RPS", "P50", "P99", "CONN/S", "mTLS",
                              "FROM", "ALLOWED", "DENIED"]  # fmt: skip
    store = next(line for line in lines if line.startswith("store"))
    assert store.split() == ["store", "1/1", "98.76%", "123.4", "4.2ms", "1234ms", "12.3",
                             "98.76%", "web", "12345", "1234", "(api)"]  # fmt: skip
    text = "\n".join(lines)
    for shown in ("gone: no metrics for 4 s (killed)", "api-1 (+200 ms) gets 12.0% of calls",
                  "route api-split: api 50 · api-v2 50 → api 51.2% · api-v2 48.8%",
                  "api 2 ready, 1 pending", "client: 123456 sent, 123000 ok, 456 failed",
                  "destination down", "00:09 drill: event number 9", "loopback mode",
                  "renewed since identity's return: 8/8"):  # fmt: skip
        assert shown in text, shown
    # where it fits, the full view, as before
    wide = Console(width=160, height=60, record=True, color_system=None)
    wide.print(fit(busiest_snapshot(), 160, 60))
    assert any(line.split()[:1] == ["NAME"] and "P95" in line
               for line in wide.export_text().splitlines())  # fmt: skip
