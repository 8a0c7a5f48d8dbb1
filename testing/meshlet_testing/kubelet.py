"""What the kubelet makes of a container's `env`: field references resolved from the pod and
`$(VAR)` references expanded, so tests can hand a container's environment to its program."""

from __future__ import annotations

import re
from typing import Any

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _field(pod: dict[str, Any], path: str) -> str:
    node: Any = pod
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def container_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """`container`'s environment in `pod` as the process sees it. Like the kubelet, a
    reference to a variable defined later or not at all is left as written."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "valueFrom" in var:
            value = _field(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            value = _REF.sub(
                lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), var.get("value", "")
            )
        env[var["name"]] = value
    return env
