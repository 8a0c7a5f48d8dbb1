"""Proxy data path: direct vs meshlet vs the meshed hop vs nginx vs haproxy, per request and byte.

For HTTP/1.1 keep-alive, HTTP/2 (h2c), gRPC unary and TCP bulk, each proxy is started fresh,
checked with one real request, then driven (1) at saturation for a fixed time (wrk, h2load,
iperf3) and (2) at a fixed request rate (h2load --rps, per-request log). The proxy's CPU is
utime+stime of its process tree from /proc before and after each run, divided by the requests
(or MiB) completed; its RSS is VmRSS summed over the tree, idle after start and peak under load.
Load generators, upstreams and this script share CPU 0; the proxy under test has CPU 1.

`meshlet` is one unmeshed proxy routing by authority. `meshlet-mesh` is the full meshed hop
(bench/proxy_mesh.py): the load goes to a client-side meshlet's outbound listener, which finds
the server pod through the destination service and sends each request over mutual TLS 1.3 to
the server-side meshlet's inbound listener, which forwards it to the upstream. Both proxies run
on the proxy CPU and their CPU and RSS are summed; the control plane (identity, destination)
starts before the first such row, on the load CPU. Its rows fail unless the client proxy's
metrics count the probe and every request that succeeded as sent over mTLS to the server's
identity. Opaque TCP is not measured there: over the mesh it needs the original destination
(iptables) on the client side.

As root, missing tools are installed with apt-get and the whole run happens in a fresh network
namespace, where an iptables REDIRECT sends the TCP client's connections through meshlet's
outbound listener (opaque TCP is not routable by authority). Prints a markdown table; saves it
under bench/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import http.client
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import proxy_configs, proxy_load, proxy_mesh, proxy_tools
from bench.proxy_procs import (
    CpuMeter,
    Processes,
    StartError,
    free_port,
    log_tail,
    machine_cpu,
    own_cpu,
    rss_kib,
    tree,
    wait_for_line,
    wait_for_port,
    wait_for_ready,
)
from bench.proxy_report import Row, RunFacts, Scenario, render
from bench.proxy_upstream import PATH as GRPC_PATH
from bench.proxy_upstream import REQUEST as GRPC_REQUEST
from bench.proxy_upstream import RESPONSE as GRPC_RESPONSE
from bench.proxy_upstream import grpc_frame

RESULTS: Final = Path(__file__).parent / "results"
NETNS_ENV: Final = "MESHLET_BENCH_IN_NETNS"
CLIENT_GID: Final = 47110  # the TCP client's gid, which the iptables REDIRECT matches
GRPC_HEADERS: Final = ("content-type: application/grpc", "te: trailers")
PROXIES: Final = ("direct", "meshlet", "meshlet-mesh", "nginx", "haproxy")
STARTUP_TIMEOUT: Final = 20.0
DEFAULT_MESHLET: Final = "{python} -m meshlet.proxy.main"

MESH_NOTE: Final = (
    "two meshlet proxies (client side, server side) with mutual TLS between them: CPU and RSS "
    "summed over both"
)
MESH_TCP: Final = (
    "opaque TCP over the mesh needs the original destination (iptables) on the client side; "
    "not measured"
)

NEEDS: Final = {  # scenario -> (upstream, load tools) it cannot run without
    Scenario.H1: ("nginx", ("wrk", "h2load")),
    Scenario.H2: ("nginx", ("h2load",)),
    Scenario.GRPC: ("grpc-upstream", ("h2load",)),
    Scenario.TCP: ("iperf3", ("iperf3",)),
}


@dataclass
class Bench:
    """What every measurement shares: settings, the process list, ports, what is missing."""

    args: argparse.Namespace
    procs: Processes
    scratch: Path
    upstream: proxy_configs.Ports
    missing: dict[str, str]
    load_cpu: int | None
    proxy_cpu: int | None
    meshlet_ports: dict[str, int]  # listener name -> port
    redirect_rule: list[str]  # sends the TCP client through meshlet
    redirect: str  # "" when that rule is in place, else why not
    nginx_ports: proxy_configs.Ports | None = None
    haproxy_ports: proxy_configs.Ports | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # proxy -> why it did not start
    control_plane: proxy_mesh.ControlPlane | None = None  # started for the first meshed row
    noise: str = ""  # how much else the machine was doing meanwhile
    meshlet_idle_kib: int | None = None

    # -- proxies under test ------------------------------------------------------------------

    def start_proxy(self, proxy: str) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """Start `proxy` fresh on the proxy CPU and wait until it serves; returns its processes
        with their logs (none for direct, two for meshlet-mesh)."""
        if proxy == "direct":
            return []
        if proxy == "meshlet":
            listen = {
                f"MESHLET_PROXY_{name.upper()}_LISTEN_ADDR": f"127.0.0.1:{port}"
                for name, port in self.meshlet_ports.items()
            }
            return [self._start_meshlet("meshlet", listen)]
        if proxy == "meshlet-mesh":
            return self._start_mesh()
        if proxy == "nginx":
            ports = self.nginx_ports = self.nginx_ports or _ports()
            conf = self.scratch / "nginx-proxy.conf"
            stream = "nginx-stream" not in self.missing
            conf.write_text(proxy_configs.nginx_proxy(self.scratch, ports, self.upstream, stream))
            argv = ["nginx", "-c", str(conf), "-e", str(self.scratch / "nginx-proxy-error.log")]
        else:
            ports = self.haproxy_ports = self.haproxy_ports or _ports()
            conf = self.scratch / "haproxy.cfg"
            conf.write_text(proxy_configs.haproxy(ports, self.upstream))
            argv = ["haproxy", "-db", "-f", str(conf)]
        proc, log = self.procs.start(proxy, argv, cpu=self.proxy_cpu)
        wait_for_port(ports.h1, proc, log, STARTUP_TIMEOUT)
        return [(proc, log)]

    def _start_meshlet(
        self, name: str, settings: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """One meshlet proxy with `settings` (MESHLET_PROXY_* names, the listeners' addresses
        among them), once its admin listener answers /ready: at once without identity, with
        identity once the proxy holds its certificate."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHLET_PROXY_")}
        env["MESHLET_PROXY_LOG"] = "warn"
        env["MESHLET_PROXY_SHUTDOWN_GRACE_PERIOD"] = "1s"  # nothing is in flight when it stops
        env.update(settings)
        argv = shlex.split(self.args.meshlet_command.replace("{python}", sys.executable))
        proc, log = self.procs.start(name, argv, cpu=self.proxy_cpu, env=env)
        admin = settings["MESHLET_PROXY_ADMIN_LISTEN_ADDR"]
        wait_for_ready(f"http://{admin}/ready", proc, log, STARTUP_TIMEOUT)
        return proc, log

    def _start_mesh(self) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """The control plane (once), then the server pod's proxy and the client pod's."""
        if self.control_plane is None:
            self.control_plane = proxy_mesh.start_control_plane(
                self.procs, self.scratch / "mesh", self.upstream, self.load_cpu, STARTUP_TIMEOUT
            )
        started: list[tuple[subprocess.Popen[bytes], Path]] = []
        try:
            for pod in ("server", "client"):
                settings = self.control_plane.proxy_env(pod)
                started.append(self._start_meshlet(f"meshlet-{pod}", settings))
        except StartError:
            for proc, _ in started:
                self.procs.stop(proc)
            raise
        return started

    def target(self, proxy: str, scenario: Scenario) -> tuple[str, int, str]:
        """Where the load goes for `proxy` (address, port) and the authority it names."""
        upstream_port = getattr(self.upstream, scenario.port_field)
        authority = f"127.0.0.1:{upstream_port}"
        if proxy == "direct" or (proxy == "meshlet" and scenario is Scenario.TCP):
            return "127.0.0.1", upstream_port, authority  # meshlet TCP: the REDIRECT takes it
        if proxy == "meshlet":
            return "127.0.0.1", self.meshlet_ports["outbound"], authority
        if proxy == "meshlet-mesh":
            outbound = proxy_mesh.CLIENT_IP, proxy_mesh.OUTBOUND_PORT
            return *outbound, proxy_mesh.authority(upstream_port)
        ports = self.nginx_ports if proxy == "nginx" else self.haproxy_ports
        assert ports is not None
        return "127.0.0.1", getattr(ports, scenario.port_field), authority

    # -- one row -----------------------------------------------------------------------------

    def blocked(self, scenario: Scenario, proxy: str) -> str:
        """Why this row cannot run, or ""."""
        upstream, tools = NEEDS[scenario]
        if upstream in self.missing:
            return f"upstream: {upstream} {self.missing[upstream]}"
        for tool in (*tools, proxy):
            if tool in self.missing:
                return f"{tool} {self.missing[tool]}"
        if proxy == "nginx" and scenario is Scenario.TCP and "nginx-stream" in self.missing:
            return f"nginx stream module {self.missing['nginx-stream']}"
        if proxy == "meshlet" and scenario is Scenario.TCP and self.redirect:
            return f"not available: {self.redirect}"
        if proxy == "meshlet-mesh" and scenario is Scenario.TCP:
            return MESH_TCP
        return self.unavailable.get(proxy, "")

    def measure(self, scenario: Scenario, proxy: str) -> Row:
        if reason := self.blocked(scenario, proxy):
            return Row(scenario, proxy, notes=(reason,))
        print(f"{scenario.value} / {proxy} ...", file=sys.stderr, flush=True)
        try:
            started = self.start_proxy(proxy)
        except StartError as exc:
            self.unavailable[proxy] = f"not available: {exc}"
            return Row(scenario, proxy, notes=(self.unavailable[proxy],))
        try:
            return self._measure_running(scenario, proxy, [proc.pid for proc, _ in started])
        except (RuntimeError, ValueError, OSError) as exc:
            said = "".join(  # a log is named NNN-<process name>.log
                f"; {log.stem.partition('-')[2]}'s last log line: {log_tail(log)}"
                for _, log in started
                if log.stat().st_size
            )
            return Row(scenario, proxy, notes=(f"failed: {exc}{said}",))
        finally:
            for proc, _ in reversed(started):
                self.procs.stop(proc)

    def _measure_running(self, scenario: Scenario, proxy: str, pids: list[int]) -> Row:
        host, port, authority = self.target(proxy, scenario)
        time.sleep(0.5)  # let start-up work settle before calling it idle
        rss_idle = rss_kib(tree(*pids)) if pids else None
        if proxy == "meshlet" and self.meshlet_idle_kib is None:
            self.meshlet_idle_kib = rss_idle
        if scenario is not Scenario.TCP:
            _probe(scenario, host, port, authority, self.scratch)
        notes = []
        if proxy == "meshlet-mesh":
            _check_mtls(1)  # the probe
            notes.append(MESH_NOTE)
        if proxy == "nginx" and scenario is Scenario.H2:
            notes.append("h2 in, HTTP/1.1 to the upstream (proxy_pass speaks HTTP/1.x)")

        meter = CpuMeter(*pids) if pids else None
        run = self.saturating(scenario, host, port, authority)
        saturated = self._run(run, meter, scenario, proxy)
        cpu = meter.stop() if meter else None
        if saturated.ok == 0:
            raise RuntimeError(saturated.detail or "nothing completed")
        if saturated.detail:
            notes.append(f"saturated: {saturated.detail}")
        if cpu is not None and cpu < 0.01 * saturated.seconds:
            notes.append("the proxy used almost no CPU: did the traffic bypass it?")
        units = saturated.ok / 2**20 if scenario is Scenario.TCP else saturated.ok
        row = Row(
            scenario,
            proxy,
            saturated.rate,
            busy=None if cpu is None else cpu / saturated.seconds,
            cpu_us=None if cpu is None else cpu / units * 1e6,
            rss_idle_kib=rss_idle,
            rss_load_kib=meter.peak_rss_kib if meter else None,
        )
        if scenario is Scenario.TCP:
            return dataclasses.replace(row, notes=tuple(notes))

        log_file = self.scratch / "fixed-rate.log"
        log_file.unlink(missing_ok=True)
        meter = CpuMeter(*pids) if pids else None
        # no RSS sampling here: the bench shares the load CPU and would add to the latencies
        run = self.fixed(scenario, host, port, authority, log_file)
        fixed = self._run(run, None, scenario, proxy)
        cpu = meter.stop() if meter else None
        if proxy == "meshlet-mesh":
            _check_mtls(1 + saturated.ok + fixed.ok)  # the probe and every request that succeeded
        latencies = proxy_load.latencies_us(log_file.read_text())
        if not latencies:
            raise RuntimeError(fixed.detail or "no request completed at the fixed rate")
        if fixed.detail:
            notes.append(f"fixed rate: {fixed.detail}")
        if fixed.rate < 0.95 * self.args.rate:
            notes.append(f"fixed-rate run reached only {fixed.rate:.0f} req/s")
        return dataclasses.replace(
            row,
            p50_ms=proxy_load.percentile(latencies, 0.50) / 1e3,
            p99_ms=proxy_load.percentile(latencies, 0.99) / 1e3,
            fixed_cpu_us=None if cpu is None else cpu / max(fixed.ok, 1) * 1e6,
            rss_load_kib=None if meter is None else max(meter.peak_rss_kib, row.rss_load_kib or 0),
            notes=tuple(notes),
        )

    def saturating(
        self, scenario: Scenario, host: str, port: int | str, authority: str
    ) -> list[str]:
        """The load command driving `scenario` at saturation."""
        seconds, a = self.args.duration, self.args
        if scenario is Scenario.TCP:
            return proxy_load.iperf3_client(port, seconds)
        if scenario is Scenario.H1:
            url = f"http://{host}:{port}/"
            return proxy_load.wrk(
                url, authority=authority, connections=a.h1_connections, seconds=seconds
            )
        return self._h2load(
            scenario, host, port, authority, clients=a.h2_clients, streams=a.h2_streams
        )

    def fixed(
        self, scenario: Scenario, host: str, port: int | str, authority: str, log_file: Path
    ) -> list[str]:
        """The h2load command driving `scenario` at the fixed rate, logging each request."""
        clients = self.args.rate_clients
        return self._h2load(
            scenario,
            host,
            port,
            authority,
            clients=clients,
            streams=1,
            rps=self.args.rate / clients,
            log_file=log_file,
        )

    def _h2load(
        self,
        scenario: Scenario,
        host: str,
        port: int | str,
        authority: str,
        *,
        clients: int,
        streams: int,
        rps: float | None = None,
        log_file: Path | None = None,
    ) -> list[str]:
        grpc = scenario is Scenario.GRPC
        return proxy_load.h2load(
            f"http://{host}:{port}{GRPC_PATH if grpc else '/'}",
            authority=authority,
            clients=clients,
            streams=streams,
            seconds=self.args.duration,
            h1=scenario is Scenario.H1,
            rps_per_client=rps,
            log_file=None if log_file is None else str(log_file),
            body_file=str(self.scratch / "grpc-request.bin") if grpc else None,
            headers=GRPC_HEADERS if grpc else (),
        )

    def _run(
        self, argv: list[str], meter: CpuMeter | None, scenario: Scenario, proxy: str
    ) -> proxy_load.Outcome:
        """Run one load generator to completion on the load CPU, sampling the proxy's RSS."""
        started = []
        try:
            if scenario is Scenario.TCP:  # a fresh one-test iperf3 server for every run
                argv_server = proxy_load.iperf3_server(self.upstream.tcp)
                server, server_log = self.procs.start(
                    "iperf3-server", argv_server, cpu=self.load_cpu
                )
                started.append(server)
                wait_for_line("Server listening", server, server_log, STARTUP_TIMEOUT)
            group = CLIENT_GID if scenario is Scenario.TCP and proxy == "meshlet" else None
            proc, log = self.procs.start(argv[0], argv, cpu=self.load_cpu, group=group)
            started.append(proc)
            limit = self.args.duration + 30
            deadline = time.monotonic() + limit
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{argv[0]} did not finish within {limit:g} s")
                if meter is not None:
                    meter.sample()
                time.sleep(0.25)
        finally:
            for started_proc in started:
                self.procs.stop(started_proc)
        output = log.read_text(errors="replace")
        if argv[0] == "wrk":
            return proxy_load.parse_wrk(output)
        if argv[0] == "iperf3":
            return proxy_load.parse_iperf3(output)
        return proxy_load.parse_h2load(output)


def _ports() -> proxy_configs.Ports:
    return proxy_configs.Ports(free_port(), free_port(), free_port(), free_port())


def _probe(scenario: Scenario, host: str, port: int, authority: str, scratch: Path) -> None:
    """One real request through the path under test; RuntimeError when the answer is wrong."""
    if scenario is Scenario.H1:
        conn = http.client.HTTPConnection(host, port, timeout=5)
        try:
            conn.request("GET", "/", headers={"Host": authority})
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200 or body != b"ok":
            raise RuntimeError(f"probe: HTTP/1.1 answered {response.status} {body[:60]!r}")
        return
    argv = ["nghttp", "-v", "-H", f":authority: {authority}"]
    url = f"http://{host}:{port}/"
    if scenario is Scenario.GRPC:
        argv += ["-d", str(scratch / "grpc-request.bin")]
        argv += [f"-H{header}" for header in GRPC_HEADERS]
        url = f"http://{host}:{port}{GRPC_PATH}"
    result = subprocess.run([*argv, url], capture_output=True, timeout=10)
    got = dict(
        re.findall(rb"recv \(stream_id=\d+\) ([^:\s][^:]*|:status): ([^\n]*)", result.stdout)
    )
    expect_body = grpc_frame(GRPC_RESPONSE) if scenario is Scenario.GRPC else b"ok"
    good = got.get(b":status") == b"200" and expect_body in result.stdout
    if scenario is Scenario.GRPC:
        good = good and got.get(b"grpc-status") == b"0"
    if not good:
        answer = {k.decode(): v.decode(errors="replace") for k, v in got.items()}
        raise RuntimeError(f"probe: {scenario.value} answered {answer or result.stderr[-200:]!r}")


def _check_mtls(at_least: int) -> None:
    """RuntimeError unless the client proxy (fresh for the row) has sent `at_least` requests
    over mutual TLS to the server's identity: no meshed figures for traffic that bypassed it."""
    sent = proxy_mesh.mtls_requests()
    if sent < at_least:
        raise RuntimeError(
            f"the client proxy sent {sent:.0f} requests over mTLS to {proxy_mesh.SERVER_ID} "
            f"(request_total, outbound, tls=true), expected at least {at_least}: traffic "
            "bypassed the mesh"
        )


# -- set-up ------------------------------------------------------------------------------------


def _enter_netns(argv: list[str]) -> None:
    """Re-run this benchmark in a fresh network namespace (root only); returns if it cannot."""
    if os.environ.get(NETNS_ENV) or shutil.which("unshare") is None:
        return
    os.environ[NETNS_ENV] = "1"
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, "-m", "bench.proxy", *argv])


def _start_upstreams(bench: Bench) -> None:
    """nginx (HTTP/1.1, h2c) and the grpcio server on the load CPU, on 127.0.0.1 and on the
    server pod's address (the meshed hop's server proxy forwards there); a failure to start is
    recorded in `bench.missing`, so the rows that need that upstream say why they did not run."""
    scratch, upstream = bench.scratch, bench.upstream
    hosts = ("127.0.0.1", proxy_mesh.SERVER_IP)
    (scratch / "grpc-request.bin").write_bytes(grpc_frame(GRPC_REQUEST))
    try:
        if "nginx" not in bench.missing:
            conf = scratch / "nginx-upstream.conf"
            conf.write_text(proxy_configs.nginx_upstream(scratch, upstream, hosts))
            argv = ["nginx", "-c", str(conf), "-e", str(scratch / "nginx-upstream-error.log")]
            proc, log = bench.procs.start("nginx-upstream", argv, cpu=bench.load_cpu)
            wait_for_port(upstream.h1, proc, log, STARTUP_TIMEOUT)
    except StartError as exc:
        bench.missing["nginx"] = f"upstream did not start: {exc}"
    try:
        argv = [sys.executable, "-m", "bench.proxy_upstream", "--port", str(upstream.grpc)]
        argv += ["--hosts", ",".join(hosts)]
        proc, log = bench.procs.start("grpc-upstream", argv, cpu=bench.load_cpu)
        wait_for_line("ready", proc, log, STARTUP_TIMEOUT)
    except StartError as exc:
        bench.missing["grpc-upstream"] = f"did not start: {exc}"


def redirect_rule(upstream_port: int, outbound_port: int) -> list[str]:
    """The iptables rule sending the TCP client's connections (gid CLIENT_GID) for the
    upstream to meshlet's outbound listener."""
    return (
        f"iptables -t nat -A OUTPUT -p tcp -d 127.0.0.1 --dport {upstream_port} "
        f"-m owner --gid-owner {CLIENT_GID} -j REDIRECT --to-ports {outbound_port}"
    ).split()


def _apply(rule: list[str]) -> str:
    """Add `rule` in the bench's own network namespace; returns "" or why it was not added."""
    if not os.environ.get(NETNS_ENV):
        return "needs the bench's own network namespace (root, no --no-netns) for iptables"
    try:
        result = subprocess.run(rule, capture_output=True, text=True)
    except OSError as exc:
        return f"iptables: {exc}"
    return f"iptables REDIRECT failed: {result.stderr.strip()}" if result.returncode else ""


def _commands(bench: Bench) -> list[str]:
    """The commands as run, with placeholders where ports and files vary."""
    runs: list[tuple[Scenario, list[str]]] = []
    for scenario in Scenario:
        if scenario is Scenario.TCP:
            runs.append((scenario, proxy_load.iperf3_server("UPSTREAM_PORT")))
        runs.append((scenario, bench.saturating(scenario, "127.0.0.1", "PORT", "AUTHORITY")))
        if scenario is not Scenario.TCP:
            log = Path("LOG")
            runs.append((scenario, bench.fixed(scenario, "127.0.0.1", "PORT", "AUTHORITY", log)))
    lines = [
        f"- {scenario.value}: `{shlex.join(argv).replace(f'{bench.scratch}/', '')}`"
        for scenario, argv in runs
    ]
    if not bench.redirect:
        lines.append(
            f"- meshlet TCP: `{shlex.join(bench.redirect_rule)}`, client run with that gid"
        )
    lines.append(
        f"- meshlet-mesh: the HTTP commands sent to {proxy_mesh.CLIENT_IP} (the client pod) "
        f"instead of 127.0.0.1, PORT {proxy_mesh.OUTBOUND_PORT} (its proxy's outbound listener), "
        f"AUTHORITY `{proxy_mesh.authority('UPSTREAM_PORT')}`"
    )
    return lines


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _facts(bench: Bench) -> RunFacts:
    a = bench.args
    tools = proxy_tools.versions()
    if bench.proxy_cpu is None:
        placement = "no CPU pinning (fewer than 2 CPUs)"
    else:
        placement = (
            f"load generators, upstreams and this script on CPU {bench.load_cpu}, the proxy "
            f"under test on CPU {bench.proxy_cpu} (taskset)"
        )
    placement += "; in a fresh network namespace" if os.environ.get(NETNS_ENV) else ""
    return RunFacts(
        when=dt.datetime.now(dt.UTC),
        machine=f"{os.cpu_count()} CPUs ({_cpu_model()}), Linux {platform.release()}, "
        f"Python {platform.python_version()}; {tools}",
        placement=placement,
        duration=a.duration,
        rate=a.rate,
        rate_clients=a.rate_clients,
        h1_connections=a.h1_connections,
        h2_clients=a.h2_clients,
        h2_streams=a.h2_streams,
        meshlet_command="" if a.meshlet_command == DEFAULT_MESHLET else a.meshlet_command,
        noise=bench.noise,
        meshlet_idle_kib=bench.meshlet_idle_kib,
        commands=_commands(bench),
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--rate", type=float, default=1000.0, help="fixed rate, req/s")
    parser.add_argument("--rate-clients", type=int, default=10)
    parser.add_argument("--h1-connections", type=int, default=64)
    parser.add_argument("--h2-clients", type=int, default=8)
    parser.add_argument("--h2-streams", type=int, default=16)
    parser.add_argument("--proxies", default=",".join(PROXIES), help="comma-separated subset")
    parser.add_argument("--scenarios", default="h1,h2,grpc,tcp", help="comma-separated subset")
    parser.add_argument(
        "--meshlet-command",
        default=DEFAULT_MESHLET,
        help="how to start the proxy (another build, say); configured by MESHLET_PROXY_* env",
    )
    parser.add_argument("--no-netns", action="store_true", help="run in the host's network")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (configs, logs)")
    return parser.parse_args()


def _prepare(args: argparse.Namespace) -> dict[str, str]:
    """Install missing tools, move into a fresh network namespace (root; this re-executes the
    benchmark there), and return tool name -> why it is missing."""
    if not os.environ.get(NETNS_ENV):
        missing = proxy_tools.ensure_installed()  # while the registry is still reachable
        if os.geteuid() == 0 and not args.no_netns:
            _enter_netns(sys.argv[1:])
        return missing
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    return proxy_tools.missing("not installed (apt-get failed)")


def _measure_all(args: argparse.Namespace, missing: dict[str, str]) -> tuple[Bench, list[Row]]:
    proxies = [p for p in PROXIES if p in args.proxies.split(",")]
    scenarios = [s for s in Scenario if s.port_field in args.scenarios.split(",")]
    cpus = sorted(os.sched_getaffinity(0))
    load_cpu, proxy_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    if load_cpu is not None:
        os.sched_setaffinity(0, {load_cpu})
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-bench-proxy-"))
    os.chmod(scratch, 0o755)  # nginx workers run as nobody
    cpu_before, own_before, started = machine_cpu(), own_cpu(), time.monotonic()
    try:
        with Processes(scratch) as procs:
            upstream = _ports()
            meshlet = {n: free_port() for n in ("outbound", "inbound", "admin", "control")}
            rule = redirect_rule(upstream.tcp, meshlet["outbound"])
            bench = Bench(
                args, procs, scratch, upstream, missing, load_cpu, proxy_cpu,
                meshlet_ports=meshlet, redirect_rule=rule, redirect=_apply(rule),
            )  # fmt: skip
            _start_upstreams(bench)
            rows = [bench.measure(s, p) for s in scenarios for p in proxies]
    finally:
        if args.keep:
            print(f"scratch dir kept: {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    # every process has been stopped and reaped by now, so its CPU is in own_cpu()
    busy, steal = (b - a for a, b in zip(cpu_before, machine_cpu(), strict=True))
    others, elapsed = busy - (own_cpu() - own_before), time.monotonic() - started
    bench.noise = (
        f"machine noise: ~{max(others, 0.0):.0f} CPU-s used outside this benchmark and "
        f"{steal / (elapsed * len(cpus)):.1%} of CPU time stolen by the hypervisor during its "
        f"{elapsed:.0f} s (either makes the figures noisier)"
    )
    return bench, rows


def main() -> None:
    args = _parse_args()
    # SIGTERM unwinds like Ctrl-C, so every started process is stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    bench, rows = _measure_all(args, _prepare(args))
    table = render(rows, _facts(bench))
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "proxy.md").write_text(table)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted; every process the benchmark started has been stopped")
