"""Reading meshed pods' proxy `/metrics` through the API server's pod proxy
(`/api/v1/namespaces/NS/pods/POD:4191/proxy/metrics`), the path `kubectl get --raw` takes: no
Prometheus, no port-forward, only the user's own API access."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from meshlet.cli.cluster import unreachable
from meshlet.cli.workloads import Pod

TIMEOUT: Final = 10.0  # seconds for one scrape
PARALLEL: Final = 16


@dataclass(frozen=True, slots=True)
class Metrics:
    """One pod's metrics text, and when it arrived (monotonic seconds)."""

    pod: Pod
    text: str
    at: float


@dataclass(frozen=True, slots=True)
class Failure:
    pod: Pod
    reason: str


def status_reason(exc: Any) -> str:
    """What the API server said: a Status' message, else the first line of the body."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body or ""
    try:
        message = json.loads(body).get("message") or ""
    except (ValueError, AttributeError):
        message = body.strip().splitlines()[0] if body.strip() else ""
    head = f"{exc.status} {exc.reason}".strip()
    return f"{head}: {message}" if message else head


def scrape(
    api_client: Any, pod: Pod, clock: Callable[[], float] = time.monotonic
) -> Metrics | Failure:
    """The pod's proxy metrics, or why they could not be read (never raises for a pod)."""
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    if not pod.running:
        return Failure(pod, f"pod is {pod.phase}, not Running")
    try:
        response: Any = k8s.CoreV1Api(api_client).connect_get_namespaced_pod_proxy_with_path(
            f"{pod.name}:{pod.admin_port}", pod.namespace, "metrics",
            _preload_content=False, _request_timeout=TIMEOUT,
        )  # fmt: skip
        text = response.data.decode(errors="replace")
    except ApiException as exc:
        return Failure(pod, status_reason(exc))
    except (HTTPError, OSError) as exc:
        return Failure(pod, unreachable(exc))
    return Metrics(pod, text, clock())


def scrape_all(
    api_client: Any, pods: Sequence[Pod], clock: Callable[[], float] = time.monotonic
) -> list[Metrics | Failure]:
    """Every pod at once (a few at a time), in the order given."""
    if not pods:
        return []
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(pods))) as pool:
        return list(pool.map(lambda pod: scrape(api_client, pod, clock), pods))
