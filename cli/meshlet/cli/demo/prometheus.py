"""A Prometheus for the local mesh (and the tests that query one): its scrape config, one job
per proxy and control-plane admin port, and its command line.

In a cluster, Prometheus learns a pod's namespace, name, workload and ServiceAccount from
Kubernetes service discovery and relabels its series with them (Linkerd's config does so); here
each target is written with those labels, so the same queries (`meshlet.cli.vizmetrics`)
answer for both.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

SCRAPE_INTERVAL: Final = "1s"
READY_WITHIN: Final = 20.0
PORT: Final = 9090
# The chart's scrape jobs (charts/meshlet-control-plane/templates/_prometheus.tpl).
PROXY_JOB: Final = "meshlet-proxy"
CONTROLLER_JOB: Final = "meshlet-controller"


@dataclass(frozen=True, slots=True)
class Target:
    """An admin port to scrape (`host:port`) and the pod it belongs to."""

    address: str
    namespace: str
    pod: str
    workload: str
    serviceaccount: str
    job: str = PROXY_JOB
    component: str = ""  # a controller's, as the chart's scrape config labels it


def binary() -> str | None:
    return shutil.which("prometheus")


def config(targets: Sequence[Target], interval: str = SCRAPE_INTERVAL) -> str:
    """The config file (JSON, which is YAML): a static target per admin port, labelled as
    Kubernetes service discovery would label it."""
    jobs: dict[str, list[dict[str, object]]] = {}
    for t in targets:
        labels = {"namespace": t.namespace, "pod": t.pod, "deployment": t.workload,
                  "serviceaccount": t.serviceaccount}  # fmt: skip
        if t.component:
            labels["component"] = t.component
        jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": labels})
    doc = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": statics,
            }
            for job, statics in sorted(jobs.items())
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


def command(prometheus: str, config_file: Path, storage: Path, listen: str) -> list[str]:
    return [
        prometheus,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={storage}",
        f"--web.listen-address={listen}",
        "--storage.tsdb.retention.time=1d",
    ]


def listen_address(host: str = "127.0.0.1", wanted: int = PORT) -> str:
    """`host:wanted` (Prometheus' 9090) when that port is free, else a free port of the
    system's choosing."""
    import socket

    for port in (wanted, 0):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Prometheus binds
            try:
                s.bind((host, port))
            except OSError:
                continue
            return f"{host}:{s.getsockname()[1]}"
    raise OSError(f"no free port on {host}")


def wait_ready(url: str, within: float = READY_WITHIN) -> None:
    """Until `url`/-/ready answers 200; TimeoutError after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prometheus at {url} was not ready within {within:g}s")
        time.sleep(0.2)
