"""Which workload a pod belongs to, from its own metadata (no API call): the value of the
`meshlet.io/proxy-<kind>: <owner>` label."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

_LABEL_VALUE: Final = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


@dataclass(frozen=True, slots=True)
class Owner:
    kind: str  # lower case: deployment, statefulset, daemonset, job, cronjob, pod, …
    name: str


def valid_label_value(value: str) -> bool:
    return bool(_LABEL_VALUE.fullmatch(value))


def of_pod(metadata: Mapping[str, Any]) -> Owner | None:
    """The controller in `ownerReferences`; a ReplicaSet named `<deployment>-<pod-template-hash>`
    stands for its Deployment. A pod without one owns itself; None when nothing is known."""
    refs = metadata.get("ownerReferences")
    ref = None
    if isinstance(refs, list):
        owners = [r for r in refs if isinstance(r, dict)]
        ref = next(
            (r for r in owners if r.get("controller") is True), owners[0] if owners else None
        )
    if ref is not None and isinstance(ref.get("kind"), str) and isinstance(ref.get("name"), str):
        kind, name = ref["kind"], ref["name"]
        labels = metadata.get("labels")
        hash_ = labels.get("pod-template-hash") if isinstance(labels, dict) else None
        if kind == "ReplicaSet" and isinstance(hash_, str) and name.endswith(f"-{hash_}"):
            return Owner("deployment", name.removesuffix(f"-{hash_}"))
        return Owner(kind.lower(), name)
    name = metadata.get("name")
    return Owner("pod", name) if isinstance(name, str) and name else None


def of_workload(kind: str, metadata: Mapping[str, Any]) -> Owner | None:
    """A workload (Deployment, …) owns the pods of its template."""
    name = metadata.get("name")
    return Owner(kind.lower(), name) if isinstance(name, str) and name else None
