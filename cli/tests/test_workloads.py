"""Which pods a resource on the command line stands for."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.cli.tables import render
from meshlet.cli.workloads import (
    Kind,
    Resources,
    admin_port,
    deployments,
    parse_resources,
    parse_target,
    pod_of,
    pod_workloads,
    selects,
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["deploy"], Resources(Kind.DEPLOYMENT)),
        (["deployments", "web", "api", "web"], Resources(Kind.DEPLOYMENT, ("web", "api"))),
        (["deploy/web", "deployment/api"], Resources(Kind.DEPLOYMENT, ("web", "api"))),
        (["PO", "web-1"], Resources(Kind.POD, ("web-1",))),
        (["pods"], Resources(Kind.POD)),
    ],
)
def test_resources_as_kubectl_takes_them(args: list[str], expected: Resources) -> None:
    assert parse_resources(args) == expected


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ([], "name a resource type"),
        (["svc"], "unknown resource type 'svc'"),
        (["deploy/web", "pod/x"], "one type"),
        (["deploy/web", "api"], "one type"),
        (["deploy", "web/x"], "not both"),
        (["deploy/"], "empty"),
    ],
)
def test_bad_resources_say_why(args: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_resources(args)


def test_targets_default_to_pods() -> None:
    assert parse_target("web-1") == Resources(Kind.POD, ("web-1",))
    assert parse_target("deploy/web") == Resources(Kind.DEPLOYMENT, ("web",))
    with pytest.raises(ValueError, match="names no resource"):
        parse_target("deploy/")


def pod(name: str, labels: dict[str, str], phase: str = "Running", **spec: Any) -> Any:
    return pod_of({"metadata": {"name": name, "namespace": "ns", "labels": labels},
                   "spec": spec, "status": {"phase": phase}})  # fmt: skip


def test_the_admin_port_is_the_named_one() -> None:
    proxy = {"name": "meshlet-proxy", "ports": [{"name": "meshlet-admin", "containerPort": 9191}]}
    native = {"initContainers": [proxy]}
    assert admin_port(native) == 9191
    assert admin_port({"containers": [{"name": "app", "ports": [{"containerPort": 80}]}]}) == 4191
    assert pod("a", {"meshlet.io/control-plane-ns": "meshlet"}, **native).meshed
    assert not pod("b", {}).meshed


def test_selectors() -> None:
    labels = {"app": "api", "track": "stable"}
    assert selects({"matchLabels": {"app": "api"}}, labels)
    assert not selects({"matchLabels": {"app": "web"}}, labels)
    expr = [{"key": "track", "operator": "In", "values": ["stable", "beta"]}]
    assert selects({"matchExpressions": expr}, labels)
    assert not selects({"matchExpressions": [{**expr[0], "operator": "NotIn"}]}, labels)
    assert selects({"matchExpressions": [{"key": "app", "operator": "Exists"}]}, labels)
    assert not selects({"matchExpressions": [{"key": "app", "operator": "DoesNotExist"}]}, labels)
    assert not selects({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, labels)


def test_deployments_count_live_pods_and_meshed_ones() -> None:
    meshed = {"meshlet.io/control-plane-ns": "meshlet"}
    pods = [
        pod("web-1", {"app": "web", **meshed}),
        pod("web-2", {"app": "web"}),  # not meshed (yet)
        pod("web-3", {"app": "web", **meshed}, phase="Succeeded"),  # finished: not counted
        pod("web-4", {"meshlet.io/proxy-deployment": "web", **meshed}),  # the injector says so
        pod("api-1", {"app": "api", **meshed}),
    ]
    web = {"metadata": {"name": "web", "namespace": "ns"},
           "spec": {"selector": {"matchLabels": {"app": "web"}}}}  # fmt: skip
    other_ns = {"metadata": {"name": "web", "namespace": "elsewhere"},
                "spec": {"selector": {"matchLabels": {"app": "web"}}}}  # fmt: skip
    rows = deployments([web, other_ns], pods)
    assert [(w.namespace, w.name, w.meshed) for w in rows] == [
        ("elsewhere", "web", "0/0"), ("ns", "web", "2/3"),
    ]  # fmt: skip
    assert [p.name for p in rows[1].meshed_pods] == ["web-1", "web-4"]
    assert [(w.name, w.status, w.meshed) for w in pod_workloads(pods)] == [
        ("api-1", "Running", "1/1"), ("web-1", "Running", "1/1"), ("web-2", "Running", "0/1"),
        ("web-4", "Running", "1/1"),
    ]  # fmt: skip


def test_tables_align_names_left_and_numbers_right() -> None:
    text = render(["NAME", "RPS"], [["web", "2.0rps"], ["api-long", "10.5rps"]], left={"NAME"})
    assert text == "NAME           RPS\nweb         2.0rps\napi-long   10.5rps\n"
