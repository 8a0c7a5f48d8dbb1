"""What Prometheus scrapes, as its HTTP service discovery reads it (`http_sd_configs`): the
destination's admin port serves the meshed pods' proxies and the control plane's admin ports
from the pods it already watches, for a Prometheus built without Kubernetes discovery (Debian's
is). Each group's labels are what the chart's `kubernetes_sd_configs` jobs relabel to, so that
`meshlet viz` reads the same series either way:

- /prometheus/proxies: every running meshed pod's proxy admin port (`meshlet-admin`, 4191),
  with `namespace`, `pod` and one label per `meshlet.io/proxy-<kind>` label of the pod
  (`deployment`, `replicaset`, ...), as the `labelmap` of the proxy job makes them;
- /prometheus/controllers: every control-plane pod's `admin-http` port (a pod labelled
  `meshlet.io/control-plane-component`), with `component`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.api.hostport import format_hostport
from meshlet.controlplane.destination.model import Pod

PROXIES_PATH: Final = b"/prometheus/proxies"
CONTROLLERS_PATH: Final = b"/prometheus/controllers"
CONTROLLER_ADMIN_PORT_NAME: Final = "admin-http"
_NOT_LABEL: Final = re.compile(r"[^a-zA-Z0-9_]")


def _running(pods: Iterable[Pod]) -> list[Pod]:
    return sorted((p for p in pods if p.ip and not p.terminating), key=lambda p: p.key)


def proxies(pods: Iterable[Pod]) -> list[dict[str, Any]]:
    groups = []
    for pod in _running(pods):
        if pod.control_plane_ns is None:  # not meshed: no proxy to scrape
            continue
        assert pod.ip is not None
        labels = {"namespace": pod.namespace, "pod": pod.name}
        for key, value in pod.labels:
            if key.startswith(wellknown.PROXY_OWNER_LABEL_PREFIX):
                name = _NOT_LABEL.sub("_", key[len(wellknown.PROXY_OWNER_LABEL_PREFIX) :])
                labels[name] = value
        target = format_hostport(pod.ip, wellknown.PROXY_ADMIN_PORT)
        groups.append({"targets": [target], "labels": labels})
    return groups


def controllers(pods: Iterable[Pod]) -> list[dict[str, Any]]:
    groups = []
    for pod in _running(pods):
        port = pod.named_port(CONTROLLER_ADMIN_PORT_NAME)
        component = dict(pod.labels).get(wellknown.CONTROL_PLANE_COMPONENT_LABEL)
        if port is None or component is None:
            continue
        assert pod.ip is not None
        groups.append({"targets": [format_hostport(pod.ip, port)],
                       "labels": {"component": component}})  # fmt: skip
    return groups


def render(groups: list[dict[str, Any]]) -> bytes:
    return json.dumps(groups, separators=(",", ":")).encode()
