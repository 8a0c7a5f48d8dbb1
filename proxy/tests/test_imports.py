"""What the long-running proxy imports, and what each import costs in resident memory, measured
in a fresh interpreter (the proxy's memory budget is DESIGN §5's: 30 MB idle).

The modules are those a meshed proxy has loaded once it serves: the application and its stacks,
the admin server, uvloop, the destination client (grpclib, protobuf) and the identity manager;
`cryptography` only ever runs in the prestart subprocess that makes the key and the CSR.
"""

from __future__ import annotations

import json
import subprocess
import sys

# In import order: each row's cost is what it adds over the rows before it.
RUNNING = (
    "asyncio",
    "uvloop",
    "meshlet.proxy.main",
    "meshlet.proxy.app",
    "meshlet.proxy.metrics",
    "meshlet.proxy.http.h1",
    "meshlet.proxy.http.h2",
    "meshlet.proxy.identity.manager",
    "meshlet.proxy.discovery.client",
    "meshlet.proxy.discovery.resolver",
    "meshlet.proxy.outbound.destinations",
)
# Never in the running proxy: the CLI's, the controller's and the prestart's.
FORBIDDEN = (
    "cryptography", "grpc", "kubernetes", "yaml", "click", "rich", "aiohttp",
    "prometheus_client",  # the proxy renders its own metrics (series.py)
    "importlib.metadata",  # ~3 MiB for a version string (metrics.py reads METADATA itself)
)  # fmt: skip
# Resident memory once all of RUNNING is imported, in MiB (the proxy then adds its listeners,
# connections and tables); measured at 33.9 MiB on Python 3.11 / x86-64 (2026-12-03), of which
# asyncio (ssl, libcrypto) takes ~10. It only goes down.
BUDGET_MIB = 34.2

MEASURE = """
import importlib, json, sys

def rss():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

rows = [("python", rss())]
for name in sys.argv[1:]:
    importlib.import_module(name)
    rows.append((name, rss()))
print(json.dumps({"rows": rows, "modules": sorted(sys.modules)}))
"""


def measure() -> tuple[list[tuple[str, float]], set[str]]:
    done = subprocess.run([sys.executable, "-c", MEASURE, *RUNNING], capture_output=True,
                          text=True, check=True, timeout=60)  # fmt: skip
    got = json.loads(done.stdout)
    return [(name, mib) for name, mib in got["rows"]], set(got["modules"])


def table(rows: list[tuple[str, float]]) -> str:
    lines = [f"{'import':40} {'adds MiB':>9} {'total MiB':>10}"]
    before = 0.0
    for name, total in rows:
        lines.append(f"{name:40} {total - before:9.1f} {total:10.1f}")
        before = total
    return "\n".join(lines)


def test_the_running_proxy_imports_nothing_it_does_not_use_and_fits_its_budget() -> None:
    # The least of three fresh interpreters: one interpreter's resident memory after the same
    # imports varies by ~0.3 MiB (heap pages touched, arenas), the imports' cost does not.
    rows, modules = min((measure() for _ in range(3)), key=lambda run: run[0][-1][1])
    report = table(rows)
    print(report)  # `pytest -s` shows what each import costs
    loaded = {m for m in FORBIDDEN if m in modules or any(n.startswith(m + ".") for n in modules)}
    assert not loaded, f"the running proxy imports {sorted(loaded)}\n{report}"
    assert rows[-1][1] <= BUDGET_MIB, f"imports take {rows[-1][1]:.1f} MiB\n{report}"
