"""The demo's screen: denials shown beside the allowed traffic, and whom they refused."""

from __future__ import annotations

from rich.console import Console

from meshlet.cli.demo.view import Snapshot, render
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
