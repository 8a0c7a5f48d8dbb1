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
import datetime as dt
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Final

from bench import instructions, proxy_evidence, proxy_mesh, proxy_netns, proxy_policy
from bench.proxy_configs import Ports
from bench.proxy_launch import MESHLET_ENV
from bench.proxy_pki import Pki, make_pki
from bench.proxy_procs import Processes, free_port, wait_for_line, wait_for_ready
from bench.proxy_report import POLICY_LIMIT
from meshlet.api.transport_header import SessionProtocol
from meshlet.api.wellknown import POLICY_API_GROUP, PROXY_ENV_PREFIX, ProxyEnv

WARMUP: Final = instructions.WARMUP
REQUESTS: Final = instructions.REQUESTS
CONTROL_TIMEOUT: Final = 30.0
Exchange = Callable[..., None]
CLIENTS: Final[dict[str, tuple[Exchange, SessionProtocol, str]]] = {
    # name: (requests on a socket, the transport header's protocol, the Ports field)
    "HTTP/1.1": (instructions.h1_exchange, SessionProtocol.HTTP1, "h1"),
    "HTTP/2": (instructions.h2_exchange, SessionProtocol.HTTP2, "h2"),
}


class Mesh:
    """What every count shares: the upstream on the server pod, the control plane, the
    policy controller and the certificates."""

    def __init__(self, procs: Processes, scratch: Path, upstream: Ports, pki: Pki) -> None:
        self.procs, self.scratch, self.upstream, self.pki = procs, scratch, upstream, pki
        self.control = proxy_mesh.start_control_plane(
            procs, scratch / "mesh", pki, upstream, None, CONTROL_TIMEOUT
        )
        self.policy_port = proxy_policy.start_controller(
            procs, scratch / "mesh", upstream, None, CONTROL_TIMEOUT
        )
        self._runs = 0

    def count(self, client: str, policy: bool, n: int) -> int:
        """Instructions of one server proxy's whole life, serving `n` requests of `client`."""
        exchange, protocol, field = CLIENTS[client]
        port = getattr(self.upstream, field)
        env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
        env.update(MESHLET_ENV)
        env.update(self.control.proxy_env("server"))
        env[ProxyEnv.LOG] = "info"  # the line saying the policy arrived (none per request)
        if policy:
            env.update(proxy_policy.server_env(self.policy_port, self.upstream))
        self._runs += 1
        out = self.scratch / f"callgrind.{self._runs}.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                sys.executable, "-m", "meshlet.proxy.main"]  # fmt: skip
        proc, log = self.procs.start(f"server-{self._runs}", argv, env=env)
        try:
            admin = proxy_mesh.admin_url("server", "/ready")
            wait_for_ready(admin, proc, log, instructions.START_TIMEOUT)
            if policy:  # the proxy's log line (inbound_policy.py) once the Server arrived
                server = f"server.{POLICY_API_GROUP}/{proxy_policy.policy_name(field)}"
                line = f"port {port}: policy {server}"
                wait_for_line(line, proc, log, instructions.START_TIMEOUT)
            before = _allowed(policy, field)
            with proxy_policy.mesh_socket(
                self.pki.client, self.pki.anchors, port, protocol, proxy_mesh.CLIENT_IP
            ) as sock:
                sock.settimeout(60)
                exchange(sock, f"{proxy_mesh.SERVER_IP}:{port}", n)
            if policy and (why := _not_by_policy(field, _allowed(policy, field) - before, n)):
                raise RuntimeError(why)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            self.procs.stop(proc)
        return instructions.total(out)

    def per_request(self, client: str, policy: bool, requests: int) -> float:
        low = self.count(client, policy, WARMUP)
        high = self.count(client, policy, WARMUP + requests)
        return (high - low) / requests


def _allowed(policy: bool, field: str) -> float:
    return proxy_policy.allowed_by_policy(proxy_mesh.metrics("server"), field) if policy else 0.0


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
            up = stack.enter_context(instructions.upstream(proxy_mesh.SERVER_IP))
            upstream = Ports(up[0], up[1], free_port(), free_port())
            pki = make_pki(scratch / "pki", proxy_mesh.CLIENT_ID, proxy_mesh.SERVER_ID,
                           dt.datetime.now(dt.UTC))  # fmt: skip
            procs = stack.enter_context(Processes(scratch))
            mesh = Mesh(procs, scratch, upstream, pki)
            for client in CLIENTS:
                print(f"{client}, inbound, without and with the policy ...", file=sys.stderr)
                without = mesh.per_request(client, False, requests)
                with_ = mesh.per_request(client, True, requests)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
