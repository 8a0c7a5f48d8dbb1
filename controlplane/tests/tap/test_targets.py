"""A resource resolved to the proxies a tap reads."""

from __future__ import annotations

import pytest

from meshlet.api import wellknown
from meshlet.controlplane.k8s.objects import pod
from meshlet.controlplane.tap.targets import (
    Resource,
    ResourceError,
    matches,
    parse_resource,
    select,
)

PODS = [
    pod("web-5d8f7-a", "10.1.0.5", owner=("ReplicaSet", "web-5d8f7")),
    pod("web-5d8f7-b", "10.1.0.6", owner=("ReplicaSet", "web-5d8f7")),
    pod("web-admin-5d8f7-c", "10.1.0.7", owner=("ReplicaSet", "web-admin-5d8f7"), sa="admin"),
    pod("web-5d8f7-pending", None, owner=("ReplicaSet", "web-5d8f7")),
    pod("web-5d8f7-plain", "10.1.0.8", owner=("ReplicaSet", "web-5d8f7"), meshed=False),
    pod("web-5d8f7-other", "10.2.0.5", ns="other", owner=("ReplicaSet", "web-5d8f7")),
    pod("job-x", "10.1.0.9", owner=("Job", "job")),
]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("deploy/web", Resource("deployment", "web")),
        ("deployment/web", Resource("deployment", "web")),
        ("po/web-1", Resource("pod", "web-1")),
        ("pod/web-1", Resource("pod", "web-1")),
        ("ns/emojivoto", Resource("namespace", "emojivoto")),
        ("namespace/emojivoto", Resource("namespace", "emojivoto")),
    ],
)
def test_linkerds_kind_names_parse(text: str, expected: Resource) -> None:
    assert parse_resource(text) == expected


@pytest.mark.parametrize("text", ["web", "deploy/", "svc/web", "deploy/a/b", "deploy/" + "x" * 254])
def test_other_resources_are_refused_with_what_is_accepted(text: str) -> None:
    with pytest.raises(ResourceError, match="deploy, pod, ns"):
        parse_resource(text)


def test_a_deployment_is_its_running_meshed_pods_through_their_replicaset() -> None:
    found = select(Resource("deployment", "web"), "emojivoto", PODS)
    assert [(t.pod, t.ip) for t in found] == [
        ("web-5d8f7-a", "10.1.0.5"),
        ("web-5d8f7-b", "10.1.0.6"),
    ]
    assert found[0].identity == wellknown.identity_name("web", "emojivoto")


def test_a_pod_a_namespace_and_nothing() -> None:
    assert [t.pod for t in select(Resource("pod", "web-admin-5d8f7-c"), "emojivoto", PODS)] == [
        "web-admin-5d8f7-c"
    ]
    namespace = select(Resource("namespace", "emojivoto"), "ignored", PODS)
    assert [t.pod for t in namespace] == [
        "job-x",
        "web-5d8f7-a",
        "web-5d8f7-b",
        "web-admin-5d8f7-c",
    ]
    assert namespace[3].identity.startswith("admin.emojivoto.")
    assert select(Resource("pod", "web-5d8f7-plain"), "emojivoto", PODS) == []
    assert select(Resource("deployment", "web"), "nowhere", PODS) == []


def test_to_matches_the_peers_labels() -> None:
    labels = {"namespace": "emojivoto", "pod": "web-1", "deployment": "web"}
    assert matches(Resource("deployment", "web"), "emojivoto", labels)
    assert matches(Resource("pod", "web-1"), "emojivoto", labels)
    assert matches(Resource("namespace", "emojivoto"), "x", labels)
    assert not matches(Resource("deployment", "web"), "other", labels)
    assert not matches(Resource("deployment", "voting"), "emojivoto", labels)
