"""Runs the fake Kubernetes API server as its own process, preloaded with N services of M
endpoints each, for destination benchmarks. Prints its kubeconfig path, then serves until its
standard input closes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshlet.controlplane.k8s import objects
from meshlet_testing.fakeapi import FakeKubeAPI


def endpoint_ip(service: int, endpoint: int) -> str:
    return f"10.{100 + service // 250}.{service % 250}.{endpoint + 1}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    args = parser.parse_args()
    with FakeKubeAPI(bookmark_interval=60.0) as api:
        for s in range(args.services):
            name = f"svc-{s}"
            api.apply(objects.service(name, "bench", cluster_ip=f"10.96.{s // 250}.{s % 250}"))
            api.apply(
                objects.endpoint_slice(
                    f"{name}-a",
                    name,
                    [(endpoint_ip(s, e), True, None) for e in range(args.endpoints)],
                    "bench",
                )
            )
        api.write_kubeconfig(args.kubeconfig)
        print(args.kubeconfig, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
