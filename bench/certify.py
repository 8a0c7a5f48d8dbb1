"""Certify throughput: N concurrent proxies' clients against one identity service process.

Runs `meshlet-controller identity` as its own process (TLS, tokens file), then for a fixed time
drives it with concurrent grpclib clients (the proxy's own client), each re-sending one CSR as a
proxy does at renewal. Prints a markdown table and saves it under bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from meshlet.api import wellknown
from meshlet.controlplane.identity import ca
from meshlet.proxy.identity import prestart
from meshlet.proxy.identity.certify import CertifyClient
from meshlet_testing.sockets import free_port as _free_port

RESULTS = Path(__file__).parent / "results"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _client_loop(
    port: int, anchors: str, name: str, csr: bytes, until: float, latencies: list[float]
) -> None:
    client = CertifyClient("127.0.0.1", port, wellknown.IDENTITY_SERVICE_NAME, anchors)
    try:
        while time.perf_counter() < until:
            start = time.perf_counter()
            await client.certify(name, b"tok-bench", csr)
            latencies.append(time.perf_counter() - start)
    finally:
        client.close()


async def _drive(port: int, anchors: str, csr: bytes, clients: int, seconds: float) -> list[float]:
    name = wellknown.identity_name("bench", "default")
    latencies: list[float] = []
    await _client_loop(port, anchors, name, csr, time.perf_counter() + 0.5, [])  # warm-up
    until = time.perf_counter() + seconds
    async with asyncio.TaskGroup() as tasks:
        for _ in range(clients):
            tasks.create_task(_client_loop(port, anchors, name, csr, until, latencies))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshlet-bench-"))
    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    (root / "issuer").mkdir()
    (root / "anchors.pem").write_bytes(ca.cert_pem(anchor))
    (root / "issuer" / "crt.pem").write_bytes(ca.cert_pem(issuer))
    (root / "issuer" / "key.pem").write_bytes(ca.key_pem(issuer_key))
    (root / "tokens.yaml").write_text("tok-bench: {namespace: default, serviceaccount: bench}\n")
    files = prestart.prepare(root / "proxy", wellknown.identity_name("bench", "default"))
    port, admin = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshlet.controlplane.main", "identity",
         "--addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
         "--trust-anchors", str(root / "anchors.pem"), "--issuer-dir", str(root / "issuer"),
         "--tokens-file", str(root / "tokens.yaml"), "--log-level", "warning"],
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        rss_idle = _rss_mib(proc.pid)
        cpu_before = _cpu_seconds(proc.pid)
        latencies = asyncio.run(
            _drive(port, (root / "anchors.pem").read_text(), files.csr.read_bytes(),
                   args.clients, args.seconds)
        )  # fmt: skip
        cpu = _cpu_seconds(proc.pid) - cpu_before
        rss_load = _rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    latencies.sort()
    count = len(latencies)
    table = "\n".join(
        [
            f"# Certify benchmark ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, "
            f"{os.cpu_count()} CPUs, server and clients on one machine)",
            "",
            "| clients | seconds | calls | calls/s | p50 ms | p99 ms | server CPU µs/call "
            "| server RSS idle / load MiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {args.clients} | {args.seconds:.0f} | {count} | {count / args.seconds:.0f} "
            f"| {statistics.median(latencies) * 1e3:.2f} "
            f"| {latencies[int(count * 0.99) - 1] * 1e3:.2f} | {cpu / count * 1e6:.0f} "
            f"| {rss_idle:.0f} / {rss_load:.0f} |",
        ]
    )
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "certify.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
