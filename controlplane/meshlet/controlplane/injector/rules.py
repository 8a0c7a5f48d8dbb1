"""Whether a pod gets a proxy: Linkerd's rules, as a pure decision with its reason."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshlet.api import wellknown


class Skip(enum.Enum):
    """Why a pod is left as it is (the value is the metric's `skip_reason`)."""

    DISABLED = "injection_disabled"
    NOT_ENABLED = "injection_not_enabled"
    HOST_NETWORK = "host_network"
    ALREADY_INJECTED = "already_injected"

    @property
    def message(self) -> str:
        return _MESSAGES[self]


_MESSAGES = {
    Skip.DISABLED: f"{wellknown.INJECT_ANNOTATION} is {wellknown.INJECT_DISABLED}",
    Skip.NOT_ENABLED: (
        f"neither the pod nor its namespace has {wellknown.INJECT_ANNOTATION}:"
        f" {wellknown.INJECT_ENABLED}"
    ),
    Skip.HOST_NETWORK: "the pod uses the host's network: its traffic cannot be redirected",
    Skip.ALREADY_INJECTED: f"the pod already has a {wellknown.PROXY_CONTAINER} container",
}


class At(enum.Enum):
    """Where the annotation that enabled injection sits (the metric's `annotation_at`)."""

    WORKLOAD = "workload"
    NAMESPACE = "namespace"


@dataclass(frozen=True, slots=True)
class Decision:
    inject: bool
    skip: Skip | None
    at: At | None
    messages: tuple[str, ...] = ()


def _names(containers: Any) -> set[str]:
    if not isinstance(containers, list):
        return set()
    return {str(c.get("name")) for c in containers if isinstance(c, dict)}


def decide(
    pod_annotations: Mapping[str, str],
    namespace_annotations: Mapping[str, str],
    pod_spec: Mapping[str, Any],
) -> Decision:
    """The pod's annotation wins over its namespace's; hostNetwork and already-injected pods
    are always skipped."""
    messages: list[str] = []
    at: At | None = None
    enabled = False
    for where, found in (
        (At.WORKLOAD, pod_annotations),
        (At.NAMESPACE, namespace_annotations),
    ):
        value = found.get(wellknown.INJECT_ANNOTATION)
        if value in (wellknown.INJECT_ENABLED, wellknown.INJECT_DISABLED):
            at, enabled = where, value == wellknown.INJECT_ENABLED
            break
        if value is not None:
            messages.append(
                f"{where.value} annotation {wellknown.INJECT_ANNOTATION}={value[:40]!r} ignored:"
                f" expected {wellknown.INJECT_ENABLED} or {wellknown.INJECT_DISABLED}"
            )
    skip: Skip | None = None
    containers = _names(pod_spec.get("containers")) | _names(pod_spec.get("initContainers"))
    if wellknown.PROXY_CONTAINER in containers:
        skip = Skip.ALREADY_INJECTED
    elif pod_spec.get("hostNetwork") is True:
        skip = Skip.HOST_NETWORK
    elif at is None:
        skip = Skip.NOT_ENABLED
    elif not enabled:
        skip = Skip.DISABLED
    return Decision(skip is None, skip, at, tuple(messages))
