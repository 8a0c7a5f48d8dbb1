"""Instructions per request (callgrind) of the meshed pair's server-side proxy, for a benchmark
comparing that proxy with itself under different settings (bench/instructions_policy.py,
bench/instructions_observe.py).

The server pod's proxy of `bench.proxy`'s meshed pair (bench/proxy_mesh.py: the same identity
and destination services, the same pods) runs under `valgrind --tool=callgrind`; a client of
this module's own plays the client pod's proxy: from the client pod's address 127.0.0.2 it opens
one mutual-TLS connection to the proxy's inbound listener with the client pod's identity, sends
the transport header (HTTP/1.1 or HTTP/2) and then requests one after the other, to an upstream
on the server pod that answers `200 ok` at once. Each comparison is of one proxy with itself, so
the client pod's proxy, which would add the same work to every row, is left out.

A `Setting` says what differs: the proxy's extra environment, the sources it runs from (another
revision's checkout: bench/proxy_baseline.py), the request headers, and what happens around the
requests (`around`: wait until the setting is in force, then check it did what it should; a
failed check raises and no count stands). As `bench.instructions` does, each count is taken
twice, with WARMUP requests and with WARMUP + N, and the difference divided by N, so that
start-up, the TLS handshake and the first requests cancel out.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import instructions, proxy_mesh, proxy_policy
from bench.proxy_configs import Ports
from bench.proxy_launch import MESHLET_ENV
from bench.proxy_pki import Pki, make_pki
from bench.proxy_procs import Processes, wait_for_ready
from meshlet.api.transport_header import SessionProtocol
from meshlet.api.wellknown import PROXY_ENV_PREFIX, ProxyEnv
from meshlet_testing.sockets import free_port

WARMUP: Final = instructions.WARMUP
REQUESTS: Final = instructions.REQUESTS
CONTROL_TIMEOUT: Final = 30.0
Exchange = Callable[..., None]
CLIENTS: Final[dict[str, tuple[Exchange, SessionProtocol, str]]] = {
    # name: (requests on a socket, the transport header's protocol, the Ports field)
    "HTTP/1.1": (instructions.h1_exchange, SessionProtocol.HTTP1, "h1"),
    "HTTP/2": (instructions.h2_exchange, SessionProtocol.HTTP2, "h2"),
}


@dataclass(frozen=True, slots=True)
class Run:
    """One server proxy being counted: what `around` may look at."""

    proc: subprocess.Popen[bytes]
    log: Path  # its stdout and stderr
    field: str  # the upstream's Ports field (h1, h2)
    port: int  # the upstream's port
    requests: int  # how many the client is about to send


Around = Callable[[Run], AbstractContextManager[None]]


def _nothing(_run: Run) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class Setting:
    """What the server proxy runs with, beside `ServerProxy.env`."""

    env: Mapping[str, str] = field(default_factory=dict)
    pythonpath: str | None = None  # another revision's source roots (None: this tree's)
    headers: Sequence[tuple[str, str]] = ()  # sent with every request
    around: Around = _nothing  # entered once the proxy is ready, around the requests


class ServerProxy:
    """What every count shares: the upstream on the server pod, the control plane and the
    certificates (also leaves for `others`, identities no pod runs as)."""

    def __init__(self, stack: ExitStack, scratch: Path, others: Sequence[str] = ()) -> None:
        up = stack.enter_context(instructions.upstream(proxy_mesh.SERVER_IP))
        self.upstream = Ports(up[0], up[1], free_port(), free_port())
        self.pki: Pki = make_pki(scratch / "pki", proxy_mesh.CLIENT_ID, proxy_mesh.SERVER_ID,
                                 dt.datetime.now(dt.UTC), others=others)  # fmt: skip
        self.procs = stack.enter_context(Processes(scratch))
        self.scratch = scratch
        self.control = proxy_mesh.start_control_plane(
            self.procs, scratch / "mesh", self.pki, self.upstream, None, CONTROL_TIMEOUT
        )
        self._runs = 0

    def env(self, setting: Setting) -> dict[str, str]:
        """The server pod's proxy's whole environment under `setting`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
        env.update(MESHLET_ENV)
        env.update(self.control.proxy_env("server"))
        env[ProxyEnv.LOG] = "info"  # lines saying a setting is in force (none per request)
        env.update(setting.env)
        if setting.pythonpath is not None:
            env["PYTHONPATH"] = setting.pythonpath
        return env

    @contextlib.contextmanager
    def serving(self, setting: Setting, argv_prefix: Sequence[str] = ()) -> Iterator[Run]:
        """The server proxy under `setting` (run by `argv_prefix`, e.g. valgrind), once ready;
        stopped on exit. The Run's `field`, `port` and `requests` are left for the caller."""
        self._runs += 1
        argv = [*argv_prefix, sys.executable, "-m", "meshlet.proxy.main"]
        proc, log = self.procs.start(f"server-{self._runs}", argv, env=self.env(setting))
        try:
            admin = proxy_mesh.admin_url("server", "/ready")
            wait_for_ready(admin, proc, log, instructions.START_TIMEOUT)
            yield Run(proc, log, "", 0, 0)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
            self.procs.stop(proc)

    def connect(self, protocol: SessionProtocol, port: int) -> ssl.SSLSocket:
        """A connection to the server pod's `port` as the client pod's proxy opens it."""
        return proxy_policy.mesh_socket(
            self.pki.client, self.pki.anchors, port, protocol, proxy_mesh.CLIENT_IP
        )

    def count(self, client: str, setting: Setting, n: int) -> int:
        """Instructions of one server proxy's whole life, serving `n` requests of `client`."""
        exchange, protocol, field_ = CLIENTS[client]
        port = getattr(self.upstream, field_)
        out = self.scratch / f"callgrind.{self._runs + 1}.out"
        valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        with self.serving(setting, valgrind) as started:
            run = Run(started.proc, started.log, field_, port, n)
            with setting.around(run), self.connect(protocol, port) as sock:
                sock.settimeout(60)
                exchange(sock, f"{proxy_mesh.SERVER_IP}:{port}", n, setting.headers)
        return instructions.total(out)

    def per_request(self, client: str, setting: Setting, requests: int) -> float:
        low = self.count(client, setting, WARMUP)
        high = self.count(client, setting, WARMUP + requests)
        return (high - low) / requests
