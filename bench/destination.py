"""Destination fan-out: EndpointSlice change to delta on every subscribed Get stream.

The fake API server runs as its own process preloaded with 1,000 services x 10 endpoints;
`meshlet-controller destination --kubeconfig` watches it; 2,000 Get streams (two per service)
stay open; the benchmark then replaces one endpoint of a random service through the API at a
fixed rate and records, per stream, the time from the API write to the delta's arrival. A
second run puts every stream on one hot service. Prints a markdown table; saves it under
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from kubernetes import client, config

from bench.fakeapi_server import endpoint_ip
from meshlet.api import addr, destination_pb2, destination_pb2_grpc
from meshlet.controlplane.k8s import objects
from meshlet_testing.sockets import free_port as _free_port

RESULTS = Path(__file__).parent / "results"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class Recorder:
    """Maps each newly added IP to the time its change was written."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.latencies: list[float] = []
        self.closed = 0  # streams the server closed because they fell behind

    def saw(self, update: destination_pb2.Update) -> None:
        if update.WhichOneof("update") != "add":
            return
        now = time.perf_counter()
        for entry in update.add.addrs:
            ip = str(ipaddress.ip_address(addr.ip_from_proto(entry.addr.ip)))
            started = self.sent.get(ip)
            if started is not None:
                self.latencies.append(now - started)


async def _reader(stub: Any, path: str, recorder: Recorder, opened: asyncio.Event) -> None:
    stream = stub.Get(destination_pb2.GetDestination(path=path))
    await stream.read()  # the initial set
    opened.set()
    try:
        while (update := await stream.read()) is not grpc.aio.EOF:
            recorder.saw(update)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        recorder.closed += 1


async def _scenario(
    port: int, api: Any, paths: list[str], services: list[int], rate: float, changes: int,
    endpoints: int, server_pid: int,
) -> tuple[list[float], float, int]:  # fmt: skip
    recorder = Recorder()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(20)]
    stubs = [destination_pb2_grpc.DestinationStub(c) for c in channels]
    tasks = []
    for i, path in enumerate(paths):
        opened = asyncio.Event()
        tasks.append(asyncio.create_task(_reader(stubs[i % len(stubs)], path, recorder, opened)))
        await opened.wait()
    rng = random.Random(7)
    generation: dict[int, int] = {}
    loop = asyncio.get_running_loop()
    started = loop.time()
    for n in range(changes):
        await asyncio.sleep(max(0.0, started + n / rate - loop.time()))
        s = rng.choice(services)
        generation[s] = generation.get(s, 0) + 1
        fresh = f"10.{200 + (n // 62500) % 50}.{(n // 250) % 250}.{n % 250 + 1}"
        ips = [endpoint_ip(s, e) for e in range(1, endpoints)] + [fresh]
        body = objects.endpoint_slice(f"svc-{s}-a", f"svc-{s}", [(ip, True, None) for ip in ips],
                                      "bench")  # fmt: skip
        recorder.sent[fresh] = time.perf_counter()
        await asyncio.to_thread(api.replace_namespaced_endpoint_slice, f"svc-{s}-a", "bench", body)
    await asyncio.sleep(2.0)  # let the last deltas arrive
    rss = _rss_mib(server_pid)  # with every stream still open
    for task in tasks:
        if task.done() and task.exception() is not None:
            raise RuntimeError("a stream reader failed") from task.exception()
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return recorder.latencies, rss, recorder.closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=20.0, help="EndpointSlice changes per second")
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument(
        "--hot-rate",
        type=float,
        default=2.0,
        help="changes per second when every stream watches one service",
    )
    parser.add_argument("--hot-changes", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshlet-bench-dst-"))
    kubeconfig = root / "kubeconfig"
    fake = subprocess.Popen(
        [sys.executable, "-m", "bench.fakeapi_server",
         "--services", str(args.services), "--endpoints", str(args.endpoints),
         "--kubeconfig", str(kubeconfig)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert fake.stdout is not None
    fake.stdout.readline()
    port, admin = _free_port(), _free_port()
    destination = subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", "destination",
         "--kubeconfig", str(kubeconfig), "--addr", f"127.0.0.1:{port}",
         "--admin-addr", f"127.0.0.1:{admin}", "--log-level", "warning"],
    )  # fmt: skip
    rows = []
    try:
        synced_at = time.perf_counter()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        sync_seconds = time.perf_counter() - synced_at
        rss_synced = _rss_mib(destination.pid)
        api_client = config.new_client_from_config(config_file=str(kubeconfig))
        api = client.DiscoveryV1Api(api_client)
        suffix = ".bench.svc.cluster.local:80"
        spread = [f"svc-{i % args.services}{suffix}" for i in range(args.streams)]
        for label, paths, services, rate, changes in (
            (f"{args.streams} streams over {args.services} services", spread,
             list(range(args.services)), args.rate, args.changes),
            (f"{args.streams} streams on one service", [f"svc-0{suffix}"] * args.streams, [0],
             args.hot_rate, args.hot_changes),
        ):  # fmt: skip
            latencies, rss, closed = asyncio.run(
                _scenario(port, api, paths, services, rate, changes, args.endpoints,
                          destination.pid)
            )  # fmt: skip
            expected = changes * len(paths) // len(services)
            rows.append(
                f"| {label} | {rate:g}/s x {changes} | {len(latencies)} / {expected} | {closed} "
                f"| {statistics.median(latencies) * 1e3:.1f} | {_pct(latencies, 0.99) * 1e3:.1f} "
                f"| {max(latencies) * 1e3:.1f} | {rss:.0f} |"
            )
        api_client.close()
    finally:
        destination.terminate()
        destination.wait(timeout=15)
        assert fake.stdin is not None
        fake.stdin.close()
        fake.wait(timeout=15)
    table = "\n".join(
        [
            f"# Destination benchmark ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
            f"{os.cpu_count()} CPUs; API server, destination and clients on one machine)",
            "",
            f"{args.services} services x {args.endpoints} endpoints; initial sync "
            f"{sync_seconds:.1f} s; destination RSS after sync {rss_synced:.0f} MiB.",
            "",
            "| scenario | changes | deltas received / expected | streams closed (fell behind) "
            "| p50 ms | p99 ms | max ms | destination RSS MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "destination.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
