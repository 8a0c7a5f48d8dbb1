"""Who gets a proxy: the pod's annotation wins over its namespace's; hostNetwork and
already-injected pods never do."""

from __future__ import annotations

import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector.rules import At, Skip, decide

ON = {wk.INJECT_ANNOTATION: wk.INJECT_ENABLED}
OFF = {wk.INJECT_ANNOTATION: wk.INJECT_DISABLED}
SPEC = {"containers": [{"name": "web"}]}


@pytest.mark.parametrize(
    ("pod", "namespace", "skip", "at"),
    [
        (ON, {}, None, At.WORKLOAD),
        ({}, ON, None, At.NAMESPACE),
        (OFF, ON, Skip.DISABLED, At.WORKLOAD),
        (ON, OFF, None, At.WORKLOAD),
        ({}, OFF, Skip.DISABLED, At.NAMESPACE),
        ({}, {}, Skip.NOT_ENABLED, None),
    ],
)
def test_pod_annotation_wins(
    pod: dict[str, str], namespace: dict[str, str], skip: Skip | None, at: At | None
) -> None:
    decision = decide(pod, namespace, SPEC)
    assert (decision.inject, decision.skip, decision.at) == (skip is None, skip, at)


def test_host_network_pods_are_skipped() -> None:
    assert decide(ON, {}, {**SPEC, "hostNetwork": True}).skip is Skip.HOST_NETWORK
    assert decide(ON, {}, {**SPEC, "hostNetwork": False}).inject


@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_already_injected_pods_are_skipped(where: str) -> None:
    spec = {"containers": [{"name": "web"}], where: [{"name": wk.PROXY_CONTAINER}]}
    assert decide(ON, {}, spec).skip is Skip.ALREADY_INJECTED


def test_a_junk_value_is_ignored_with_a_message_and_the_namespace_decides() -> None:
    decision = decide({wk.INJECT_ANNOTATION: "yes please"}, ON, SPEC)
    assert decision.inject and decision.at is At.NAMESPACE
    assert decision.messages == (
        "workload annotation meshlet.io/inject='yes please' ignored: expected enabled or disabled",
    )


def test_every_skip_has_a_message() -> None:
    assert all(skip.message for skip in Skip)
