"""Starting each proxy under test, alone or as a meshed pair, and what the benchmark needs of it.

A proxy's name says what runs: `meshlet`, `envoy`, `nginx`, `haproxy` are one hop on 127.0.0.1
in plaintext; `<name>-mesh` is a pair (client side on 127.0.0.1 → mutual TLS 1.3 → server side
on the server pod's address 127.0.0.3 → the upstream there); `direct` is no proxy at all. Every
process runs on the proxy CPU. `Launcher.check` writes and checks every config before the first
run (`envoy --mode validate`, `nginx -t`, `haproxy -c`): a proxy whose config is refused has its
rows skipped with the tool's words. `Launcher.start` returns a `Launched`: the processes, where
the load goes, where the TCP client connects (an iptables REDIRECT takes it to `redirect_port`),
what the TLS probe through the pair must answer, and the pair's judge of its own counters
(bench/proxy_evidence.py). meshlet's rows may run under other names too (`meshlet@REV`, a previous
revision's proxy, bench/proxy_baseline.py): `Launcher.meshlet_commands` says how to start each.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import proxy_configs, proxy_envoy, proxy_evidence, proxy_mesh, proxy_policy
from bench.proxy_configs import Ports
from bench.proxy_evidence import Verdict
from bench.proxy_pki import Pki, client_tls, server_tls
from bench.proxy_procs import Processes, StartError, wait_for_port, wait_for_ready
from meshlet.api.wellknown import PROXY_ENV_PREFIX, ProxyEnv
from meshlet_testing.sockets import free_port

ONE_HOP: Final = ("meshlet", "envoy", "nginx", "haproxy")
PAIRS: Final = tuple(f"{name}-mesh" for name in ONE_HOP)
PROXIES: Final = ("direct", *ONE_HOP, *PAIRS, proxy_policy.PAIR)
CLIENT_HOST: Final = "127.0.0.1"  # the client pod's loopback: its side's listeners
SERVER_HOST: Final = proxy_mesh.SERVER_IP  # the server pod: its side's listeners, the upstreams
CONFIG_SUFFIX: Final = {"envoy": "json", "nginx": "conf", "haproxy": "cfg"}
# every meshlet proxy's settings besides its listeners (and the pair's discovery and identity);
# a short grace period, as nothing is in flight when a row stops it
MESHLET_ENV: Final[dict[str, str]] = {ProxyEnv.LOG: "warn", ProxyEnv.SHUTDOWN_GRACE_PERIOD: "1s"}
MESHLET_LISTEN_ENV: Final[dict[str, str]] = {
    "outbound": ProxyEnv.OUTBOUND_LISTEN_ADDR,
    "inbound": ProxyEnv.INBOUND_LISTEN_ADDR,
    "admin": ProxyEnv.ADMIN_LISTEN_ADDR,
    "control": ProxyEnv.CONTROL_LISTEN_ADDR,
}

Started = tuple[subprocess.Popen[bytes], Path]
Judge = Callable[[str, int], Verdict]  # (scenario's Ports field, at least) -> the verdict


@dataclass
class Launched:
    """A proxy (or pair) up and serving: how the load reaches it, how the row checks it."""

    procs: list[Started]  # client side first
    host: str  # where the HTTP load goes, with the port from `listen`
    listen: Ports
    authority: Callable[[int], str]  # the authority the load names, from the upstream port
    tcp_host: str  # where the TCP client connects (the upstream, as the application sees it)
    redirect_port: int | None  # the TCP listener an iptables REDIRECT sends it to
    tls_probe: str = ""  # what TLS_PROBE_PATH answers through the pair, when it answers
    judge: Judge | None = None  # pairs: the counters proving the traffic crossed mutual TLS
    # before the runs: probes (the callable) through the path until it is as the row needs
    # it (a policy in force for the scenario's Ports field); returns the probes made
    settle: Callable[[str, Callable[[], None]], int] | None = None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self.procs]


def _local(port: int) -> str:
    return f"127.0.0.1:{port}"


def _ports() -> Ports:
    return Ports(free_port(), free_port(), free_port(), free_port())


@dataclass
class Launcher:
    """Starts proxies fresh for each row; keeps what rows share (ports, configs, the control
    plane of the meshlet pair)."""

    procs: Processes
    scratch: Path
    upstream: Ports
    pki: Pki
    cpu: int | None  # the proxy CPU
    load_cpu: int | None  # the control plane's
    meshlet_commands: dict[str, str]  # "meshlet" (or "meshlet@REV") -> its command, with {python}
    envoy: str | None
    nginx_stream: bool
    timeout: float
    meshlet_ports: dict[str, int] = field(default_factory=dict)
    ports: dict[str, Ports] = field(default_factory=dict)  # proxy or side -> its listeners
    admin: dict[str, int] = field(default_factory=dict)  # Envoy side -> admin port
    nginx_status: int = 0  # the nginx server side's stub_status port
    configs: dict[str, Path] = field(default_factory=dict)
    control_plane: proxy_mesh.ControlPlane | None = None
    policy_port: int | None = None  # the policy controller's, once the policy pair started it

    def __post_init__(self) -> None:
        self.meshlet_ports = {n: free_port() for n in ("outbound", "inbound", "admin", "control")}
        for side in ("envoy", "envoy-client", "envoy-server", "nginx", "nginx-client",
                     "nginx-server", "haproxy", "haproxy-client", "haproxy-server"):  # fmt: skip
            self.ports[side] = _ports()
        self.admin = {side: free_port() for side in ("envoy", "envoy-client", "envoy-server")}
        self.nginx_status = free_port()

    # -- configs -----------------------------------------------------------------------------

    def check(self, proxy: str) -> str:
        """Write `proxy`'s configs and have the proxy itself check them; "" or what it said."""
        name = proxy.removesuffix("-mesh")
        if name == "direct" or name in self.meshlet_commands or proxy == proxy_policy.PAIR:
            return ""
        pair = proxy.endswith("-mesh")
        sides = ("client", "server") if pair else ("",)
        for side in sides:
            key = f"{name}-{side}" if side else name
            path = self.scratch / f"{key}.{CONFIG_SUFFIX[name]}"
            path.write_text(self._config(name, side))
            self.configs[key] = path
            if said := _check(name, path, self.envoy):
                return f"config refused ({key}): {said}"
        return ""

    def _config(self, name: str, side: str) -> str:
        up, p, s = self.upstream, self.ports, self.scratch
        server = p[f"{name}-server"]
        if name == "envoy":
            if side == "client":
                config = proxy_envoy.client_side(
                    self.admin["envoy-client"], p["envoy-client"], SERVER_HOST, server,
                    client_tls(self.pki),
                )  # fmt: skip
            elif side == "server":
                config = proxy_envoy.server_side(
                    self.admin["envoy-server"], SERVER_HOST, server, SERVER_HOST, up,
                    server_tls(self.pki),
                )  # fmt: skip
            else:
                config = proxy_envoy.one_hop(self.admin["envoy"], p["envoy"], "127.0.0.1", up)
            return proxy_envoy.dumps(config)
        if name == "nginx":
            stream = self.nginx_stream
            if side == "client":
                tls = client_tls(self.pki)
                return proxy_configs.nginx_client_side(
                    s, p["nginx-client"], SERVER_HOST, server, tls, stream
                )
            if side == "server":
                return proxy_configs.nginx_server_side(
                    s, SERVER_HOST, server, SERVER_HOST, up, server_tls(self.pki), stream,
                    self.nginx_status,
                )  # fmt: skip
            return proxy_configs.nginx_proxy(s, p["nginx"], up, stream)
        if side == "client":
            return proxy_configs.haproxy_client_side(
                p["haproxy-client"], SERVER_HOST, server, client_tls(self.pki)
            )
        if side == "server":
            return proxy_configs.haproxy_server_side(
                SERVER_HOST, server, SERVER_HOST, up, server_tls(self.pki), self._haproxy_socket
            )
        return proxy_configs.haproxy(p["haproxy"], up)

    @property
    def _haproxy_socket(self) -> Path:
        return self.scratch / "haproxy-server.sock"

    # -- starting ----------------------------------------------------------------------------

    def start(self, proxy: str) -> Launched:
        """`proxy` started fresh and serving; StartError (with its log's words) if it is not."""
        if proxy == "direct":
            return Launched([], "127.0.0.1", self.upstream, _local, "127.0.0.1", None)
        if proxy == proxy_policy.PAIR:
            return self._meshlet_pair("meshlet", policy=True)
        name = proxy.removesuffix("-mesh")
        if name in self.meshlet_commands:
            return self._meshlet_pair(name) if proxy.endswith("-mesh") else self._meshlet(name)
        if not proxy.endswith("-mesh"):
            ports = self.ports[name]
            alone = [self._start_side(name, "", ports)]
            return Launched(alone, "127.0.0.1", ports, _local, "127.0.0.1", ports.tcp)
        started: list[Started] = []
        try:  # the server side first, so that the client side's first connection finds it
            started.append(self._start_side(name, "server", self.ports[f"{name}-server"]))
            client = self.ports[f"{name}-client"]
            started.insert(0, self._start_side(name, "client", client))
        except StartError:
            for proc, _ in started:
                self.procs.stop(proc)
            raise
        probe = {"nginx": proxy_configs.NGINX_TLS_OK, "haproxy": proxy_configs.HAPROXY_TLS_OK}
        return Launched(
            started, CLIENT_HOST, client, proxy_mesh.authority, SERVER_HOST, client.tcp,
            tls_probe=probe.get(name, ""), judge=self._judge(name),
        )  # fmt: skip

    def _start_side(self, name: str, side: str, ports: Ports) -> Started:
        key = f"{name}-{side}" if side else name
        config = self.configs[key]
        host = SERVER_HOST if side == "server" else "127.0.0.1"
        if name == "envoy":
            assert self.envoy is not None
            argv = proxy_envoy.argv(self.envoy, config)
        elif name == "nginx":
            argv = ["nginx", "-c", str(config), "-e", str(self.scratch / f"{key}-error.log")]
        else:
            argv = ["haproxy", "-db", "-f", str(config)]
        proc, log = self.procs.start(key, argv, cpu=self.cpu)
        if name == "envoy":
            wait_for_ready(f"http://{host}:{self.admin[key]}/ready", proc, log, self.timeout)
        for port in (ports.h1, ports.h2, ports.grpc):
            wait_for_port(port, proc, log, self.timeout, host=host)
        return proc, log

    def _meshlet(self, name: str) -> Launched:
        listen = {MESHLET_LISTEN_ENV[k]: _local(port) for k, port in self.meshlet_ports.items()}
        out = self.meshlet_ports["outbound"]
        started = [self._start_meshlet(name, name, listen)]
        return Launched(started, "127.0.0.1", Ports(out, out, out, out), _local, "127.0.0.1", out)

    def _meshlet_pair(self, name: str, policy: bool = False) -> Launched:
        """The control plane (once), then the server pod's proxy and the client pod's; with
        `policy`, the policy controller (once) too, and the server pod's proxy watching it."""
        if self.control_plane is None:
            self.control_plane = proxy_mesh.start_control_plane(
                self.procs, self.scratch / "mesh", self.pki, self.upstream, self.load_cpu,
                self.timeout,
            )  # fmt: skip
        if policy and self.policy_port is None:
            self.policy_port = proxy_policy.start_controller(
                self.procs, self.scratch / "mesh", self.upstream, self.load_cpu, self.timeout
            )
        process = proxy_policy.NAME if policy else name
        started: list[Started] = []
        try:
            for pod in ("server", "client"):
                settings = self.control_plane.proxy_env(pod)
                if policy and pod == "server":
                    assert self.policy_port is not None
                    settings.update(proxy_policy.server_env(self.policy_port, self.upstream))
                started.insert(0, self._start_meshlet(name, f"{process}-{pod}", settings))
        except StartError:
            for proc, _ in started:
                self.procs.stop(proc)
            raise
        host, port = proxy_mesh.OUTBOUND
        listen = Ports(port, port, port, port)
        if policy:
            return Launched(
                started, host, listen, proxy_mesh.authority, SERVER_HOST, port,
                judge=proxy_policy.judge, settle=proxy_policy.wait_in_force,
            )  # fmt: skip
        return Launched(
            started, host, listen, proxy_mesh.authority, SERVER_HOST, port,
            judge=_meshlet_judge,
        )  # fmt: skip

    def _start_meshlet(self, name: str, process: str, settings: dict[str, str]) -> Started:
        """One meshlet proxy (`name`'s command) with MESHLET_ENV and `settings` (the listeners'
        addresses among them), once its admin listener answers /ready: at once without
        identity, with identity once the proxy holds its certificate."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
        env.update(MESHLET_ENV)
        env.update(settings)
        argv = shlex.split(self.meshlet_commands[name].replace("{python}", sys.executable))
        proc, log = self.procs.start(process, argv, cpu=self.cpu, env=env)
        admin = settings[ProxyEnv.ADMIN_LISTEN_ADDR]
        wait_for_ready(f"http://{admin}/ready", proc, log, self.timeout)
        return proc, log

    # -- the pairs' own counters -------------------------------------------------------------

    def _judge(self, name: str) -> Judge:
        if name == "envoy":
            client = f"127.0.0.1:{self.admin['envoy-client']}"
            server = f"{SERVER_HOST}:{self.admin['envoy-server']}"
            return lambda scenario, at_least: proxy_evidence.envoy_pair(
                proxy_envoy.stats(client), proxy_envoy.stats(server), scenario, at_least
            )
        if name == "nginx":
            status = f"http://{SERVER_HOST}:{self.nginx_status}/"
            stream_log = self.scratch / proxy_configs.NGINX_STREAM_LOG

            def nginx(scenario: str, at_least: int) -> Verdict:
                if scenario == "tcp":
                    text = stream_log.read_text() if stream_log.exists() else ""
                    return proxy_evidence.nginx_stream(text, at_least)
                return proxy_evidence.nginx_requests(_get(status), at_least)

            return nginx
        sock = self._haproxy_socket
        return lambda scenario, at_least: proxy_evidence.haproxy_pair(
            _haproxy_command(sock, "show info"), _haproxy_command(sock, "show stat"), scenario,
            at_least,
        )  # fmt: skip


def meshlet_env_names() -> frozenset[str]:
    """Every MESHLET_PROXY_* name the bench sets for a meshlet proxy, alone or in the pair."""
    placeholder = proxy_mesh.ControlPlane(Path(), 0, 0, "", 0)
    pods = (placeholder.proxy_env(pod) for pod in proxy_mesh.PODS)
    return frozenset({*MESHLET_ENV, *MESHLET_LISTEN_ENV.values()}.union(*pods))


def _meshlet_judge(scenario: str, at_least: int) -> Verdict:
    server = proxy_mesh.metrics("server")
    if scenario == "tcp":
        return proxy_evidence.meshlet_bytes(server, proxy_mesh.CLIENT_ID, at_least)
    client = proxy_mesh.metrics("client")
    return proxy_evidence.meshlet_requests(client, server, proxy_mesh.SERVER_ID, at_least)


def _check(name: str, config: Path, envoy: str | None) -> str:
    """The proxy's own verdict on `config`: "" or its last words."""
    if name == "envoy":
        assert envoy is not None
        return proxy_envoy.validate(envoy, config)
    argv = (
        ["nginx", "-t", "-c", str(config)]
        if name == "nginx"
        else ["haproxy", "-c", "-f", str(config)]
    )
    if name == "nginx":
        argv += ["-e", str(config.with_suffix(".check-error.log"))]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode == 0:
        return ""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return " / ".join(lines[-3:]) or f"exit {result.returncode}"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _haproxy_command(path: Path, command: str) -> str:
    """One command on haproxy's stats socket, and its whole answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        sock.sendall(command.encode() + b"\n")
        chunks = []
        with contextlib.suppress(TimeoutError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks).decode()
