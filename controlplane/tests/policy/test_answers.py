"""The policy controller's wire answers for one varied cluster (golden/cluster.yaml): every
inbound `Server` of every pod port and every outbound `OutboundPolicy` of every Service port,
for clients in the Service's namespace and in another, as the proxies receive them. The golden
file was first written by the controller as it was before the policy resources were read into
one model each; any change to an answer shows here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import text_format

from meshlet.controlplane.k8s.events import POLICY_SERVER_KINDS, Kind, Snapshot
from meshlet.controlplane.policy.index import ClusterConfig, parse_networks

HERE = Path(__file__).parent / "golden"
POD_PORTS = (5432, 7000, 8080, 8081, 9090)  # declared, probed, undeclared, opaque by annotation
CLIENTS = ("shop", "mall")


def cluster() -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all((HERE / "cluster.yaml").read_text()) if o]


def answers(index: Any, outbound: Any) -> str:
    """Every answer, in a fixed order, as protobuf text (index and outbound already fed)."""
    out = []
    for obj in cluster():
        meta = obj["metadata"]
        ns, name = meta.get("namespace", "default"), meta["name"]
        if obj["kind"] == "Pod":
            for port in POD_PORTS:
                server = index.get(ns, name, port)
                out.append(f"# inbound {ns}/{name}:{port}\n{text_format.MessageToString(server)}")
        elif obj["kind"] == "Service":
            for port in [p["port"] for p in obj["spec"]["ports"]]:
                for client in CLIENTS:
                    policy = outbound.get(ns, name, port, client)
                    text = text_format.MessageToString(policy)
                    out.append(f"# outbound {ns}/{name}:{port} for {client}\n{text}")
    return "\n".join(out)


def fed(make_index: Callable[[], Any], make_outbound: Callable[[], Any]) -> tuple[Any, Any]:
    index, outbound = make_index(), make_outbound()
    objs = cluster()
    for kind in POLICY_SERVER_KINDS:
        of_kind = tuple(o for o in objs if Kind.of(o["apiVersion"], o["kind"]) is kind)
        event = Snapshot(kind, of_kind)
        index.apply(event)
        outbound.apply(event)
    return index, outbound


def config() -> ClusterConfig:
    return ClusterConfig(networks=parse_networks("10.0.0.0/8,fd00::/8"))


def test_every_answer_is_the_one_the_proxies_got_before(
    golden: Callable[[Path, str], None],
) -> None:
    from meshlet.controlplane.policy.catalog import Catalog
    from meshlet.controlplane.policy.index import Index
    from meshlet.controlplane.policy.outbound_index import OutboundIndex

    shared = Catalog()  # as the controller runs them: one catalog for both indexes
    index, outbound = fed(lambda: Index(config(), shared), lambda: OutboundIndex(catalog=shared))
    golden(HERE / "answers.txt", answers(index, outbound))
    alone = fed(lambda: Index(config()), OutboundIndex)  # each index with a catalog of its own
    assert answers(*alone) == answers(index, outbound)
