"""10,000 Servers and 10,000 AuthorizationPolicies in one index: its memory, and how long an
update takes to reach a watcher."""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import pytest

from meshlet.controlplane.k8s.events import Kind, Snapshot, Upsert
from meshlet.controlplane.policy.index import (
    LINKERD_CLUSTER_NETWORKS,
    ClusterConfig,
    Index,
    parse_networks,
)
from meshlet.controlplane.policy.mailbox import Mailbox

G = "policy.meshlet.io"
NAMESPACES, PER_NS = 100, 100  # 10,000 Servers, pods and policies


def objects(i: int, ns: str) -> tuple[dict[str, Any], ...]:
    name = f"app-{i}"
    return (
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-0", "namespace": ns, "labels": {"app": name}},
            "spec": {
                "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]
            },
        },
        {
            "apiVersion": f"{G}/v1beta3",
            "kind": "Server",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"podSelector": {"matchLabels": {"app": name}}, "port": "http"},
        },
        {
            "apiVersion": f"{G}/v1alpha1",
            "kind": "AuthorizationPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "targetRef": {"group": G, "kind": "Server", "name": name},
                "requiredAuthenticationRefs": [{"kind": "ServiceAccount", "name": name}],
            },
        },
    )


# ~11 s alone; the suite's other lane runs the local mesh meanwhile, and a timeout here ends the
# whole run (pytest-timeout's thread method), so it gets room beyond the default minute.
@pytest.mark.timeout(240)
def test_ten_thousand_servers(capsys: Any) -> None:
    by_kind: dict[Kind, list[dict[str, Any]]] = {
        Kind.POD: [],
        Kind.SERVER: [],
        Kind.AUTHORIZATION_POLICY: [],
    }
    for n in range(NAMESPACES):
        for i in range(PER_NS):
            pod, srv, pol = objects(i, f"ns-{n}")
            by_kind[Kind.POD].append(pod)
            by_kind[Kind.SERVER].append(srv)
            by_kind[Kind.AUTHORIZATION_POLICY].append(pol)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = Index(ClusterConfig(networks=parse_networks(LINKERD_CLUSTER_NETWORKS)))
    started = time.perf_counter()
    for kind, objs in by_kind.items():
        index.apply(Snapshot(kind, tuple(objs)))
    load = time.perf_counter() - started
    boxes = []
    for n in range(NAMESPACES):  # one watch per pod: 10,000 watches
        for i in range(PER_NS):
            box = Mailbox()
            assert index.subscribe(f"ns-{n}", f"app-{i}-0", 8080, box)
            box.take()
            boxes.append(box)
    memory = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    latencies = []
    for n in range(0, NAMESPACES, 10):
        pol = objects(7, f"ns-{n}")[2]
        pol["spec"]["requiredAuthenticationRefs"] = [{"kind": "ServiceAccount", "name": "x"}]
        started = time.perf_counter()
        index.apply(Upsert(Kind.AUTHORIZATION_POLICY, pol))
        latencies.append(time.perf_counter() - started)
        assert boxes[n * PER_NS + 7].take() is not None
        assert boxes[n * PER_NS + 8].take() is None
    worst = max(latencies)
    with capsys.disabled():
        print(
            f"\n10,000 Servers/policies/pods and 10,000 watches: {memory / 2**20:.1f} MiB"
            f" (tracemalloc), loaded in {load:.2f}s; an update reaches its watcher in"
            f" {1000 * sorted(latencies)[len(latencies) // 2]:.1f} ms (median),"
            f" {1000 * worst:.1f} ms (worst)"
        )
    assert memory < 400 * 2**20
    assert worst < 1.0
