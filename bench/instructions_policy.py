"""Instructions per request (callgrind) of the meshed pair's server-side proxy, with and without
an AuthorizationPolicy in force: what the policy costs, on a figure a busy machine does not move.

    python -m bench.instructions_policy [--requests N]

The server pod's proxy of `bench.proxy`'s meshed pair (bench/proxy_mesh.py, same settings, same
identity and destination services) runs under `valgrind --tool=callgrind`; a client of this
module's own plays the client pod's proxy: from the client pod's address 127.0.0.2 it opens one
mutual-TLS connection to the proxy's inbound listener with the client pod's identity, sends the
transport header (HTTP/1.1 or HTTP/2) and then requests one after the other, to an upstream on
the server pod that answers `200 ok` at once. *Without*: the proxy's built-in default policy
(all-unauthenticated), as in `meshlet-mesh`. *With*: the proxy watches the policy controller
(bench/proxy_policy.py: a Server and an AuthorizationPolicy admitting the client pod's identity
on each HTTP port), as in `meshlet-policy-mesh`; the count is taken only once the proxy has
logged the Server's policy for the port, and stands only if the server proxy allowed every
request by that AuthorizationPolicy (none by the loopback exception).

As `bench.instructions` does, each count is taken twice, with WARMUP requests and with WARMUP +
N, and the difference divided by N, so that start-up, the TLS handshake and the first requests
cancel out. The pods' ports are the mesh's fixed ones, so as root it re-runs itself in a fresh
network namespace; without root, or without valgrind, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Final

from bench import (
    budget,
    instructions,
    instructions_mesh,
    proxy_evidence,
    proxy_mesh,
    proxy_netns,
    proxy_policy,
)
from bench.instructions_mesh import CLIENTS, Run, ServerProxy, Setting
from bench.proxy_procs import wait_for_line
from bench.proxy_report import POLICY_LIMIT
from meshlet.api.wellknown import POLICY_API_GROUP

WARMUP: Final = instructions_mesh.WARMUP
REQUESTS: Final = instructions_mesh.REQUESTS


def with_policy(policy_port: int, server: ServerProxy) -> Setting:
    """The server proxy watching the policy controller; a count stands only if every request
    was allowed by the AuthorizationPolicy."""
    return Setting(env=proxy_policy.server_env(policy_port, server.upstream), around=_in_force)


@contextlib.contextmanager
def _in_force(run: Run) -> Iterator[None]:
    """Once the proxy logged the Server's policy for the port (inbound_policy.py): the requests;
    then the proof that the AuthorizationPolicy allowed them all."""
    server = f"server.{POLICY_API_GROUP}/{proxy_policy.policy_name(run.field)}"
    line = f"port {run.port}: policy {server}"
    wait_for_line(line, run.proc, run.log, instructions.START_TIMEOUT)
    before = _allowed(run.field)
    yield
    if why := _not_by_policy(run.field, _allowed(run.field) - before, run.requests):
        raise RuntimeError(why)


def _allowed(field: str) -> float:
    return proxy_policy.allowed_by_policy(proxy_mesh.metrics("server"), field)


def _not_by_policy(field: str, allowed: float, n: int) -> str:
    server = proxy_mesh.metrics("server")
    return proxy_evidence.meshlet_authorized(
        server, proxy_mesh.CLIENT_ID, proxy_policy.policy_name(field), n
    ) or ("" if allowed >= n else f"only {allowed:.0f} of {n} requests allowed by the policy")


def measure(requests: int) -> list[tuple[str, float, float]]:
    """Per client: instructions per request without and with the policy."""
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-instructions-policy-"))
    rows = []
    try:
        with ExitStack() as stack:
            server = ServerProxy(stack, scratch)
            policy_port = proxy_policy.start_controller(
                server.procs, scratch / "mesh", server.upstream, None,
                instructions_mesh.CONTROL_TIMEOUT,
            )  # fmt: skip
            policy = with_policy(policy_port, server)
            for client in CLIENTS:
                print(f"{client}, inbound, without and with the policy ...", file=sys.stderr)
                without = server.per_request(client, Setting(), requests)
                with_ = server.per_request(client, policy, requests)
                rows.append((client, without, with_))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def table(rows: list[tuple[str, float, float]]) -> list[str]:
    lines = [
        f"| protocol | without | with the policy | with/without | within {POLICY_LIMIT:g}x |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for client, without, with_ in rows:
        ratio = with_ / without
        verdict = "yes" if ratio <= POLICY_LIMIT else f"**no: over {POLICY_LIMIT:g}x**"
        lines.append(f"| {client} | {without:,.0f} | {with_:,.0f} | **{ratio:.3f}x** | {verdict} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted")
    parser.add_argument(
        "--record",
        metavar="REV",
        help="lower the budget of each row now below it, naming revision REV",
    )
    args = parser.parse_args()
    title = "## Instructions per request, the meshed pair's server-side proxy (callgrind)"
    if shutil.which("valgrind") is None:
        print(f"{title}: valgrind is not installed here; nothing measured")
        return 0
    if os.geteuid() != 0:
        print(f"{title}: needs root (the pods' fixed ports, in a network namespace of its own)")
        return 0
    if not proxy_netns.inside():
        proxy_netns.enter("bench.instructions_policy", sys.argv[1:])
        print(f"{title}: unshare is not installed; nothing measured")
        return 0
    proxy_netns.loopback_up()
    rows = measure(args.requests)
    print(f"\n{title}\n")
    print("Inbound (mutual TLS from the client pod's identity, one connection, requests one "
          "after the other), without an AuthorizationPolicy (the built-in default) and with one "
          "admitting the client pod's identity; user space only.\n")  # fmt: skip
    print("\n".join(table(rows)))
    counts = {}
    for client, without, with_ in rows:
        counts[f"meshed server side, {client}"] = without
        counts[f"meshed server side, {client}, with an AuthorizationPolicy"] = with_
    print("\nHeld to the instruction budget (bench/instructions-budget.json, docs/bench.md):\n")
    print("\n".join(budget.section(counts)))
    if args.record:
        changed = budget.record(counts, args.record)
        print(f"\nbudget lowered: {', '.join(changed) or 'no row'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
