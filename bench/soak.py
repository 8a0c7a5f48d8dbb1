"""The local mesh under steady load, a fault every period, for as long as asked (`make soak`).

    python -m bench.soak [--minutes 60] [--period 60] [--rate 20] [--json FILE]

The demo application of `meshlet demo` (network namespaces and iptables as root, loopback
otherwise) runs with its load generator: HTTP/1.1 calls to web, which calls api over gRPC
(HTTP/2) and store over opaque TCP, every hop through the proxies over mTLS. Each period
(`--period` seconds, a minute by default) one fault comes at a tenth of the period and is
repaired at half of it, in turn:

- kill-replica: api-2's proxy and app killed (SIGKILL); 2 s later api-2 leaves the endpoints,
  as the endpoints controller would notice; at the repair it starts again and returns.
- restart-destination, restart-identity, restart-policy: the controller stopped (SIGTERM) and
  started again, as a rollout or an eviction does.
- change-policy: api's HTTPRoute reweighed 90/10 → 50/50, and back at the repair.
- roll-upgrade: every controller restarted in turn, then api's three pods in turn as a rolling
  update does: out of the endpoints, 2 s, its proxy and app stopped (SIGTERM) and started
  again, back in the endpoints once its proxy is ready and its app listens. (The canary has
  one pod: a rolling update starts its successor first, which the local mesh's fixed pods
  cannot; it is left.)

Certificates are issued for --issuance-lifetime (90 s by default), so every proxy renews about
once a period, under the faults. Each period reports the load's calls, failures (and why) and
slowest call, the renewals, and every process's RSS and open files at its end; the summary says
how each process's RSS and open files moved from the end of the first period (the warm-up) to
the end. Exit status: 0, or 1 when the mesh could not be built or a process ended by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from rich.console import Console

from meshlet.api import wellknown
from meshlet.cli.demo import lock, topology
from meshlet.cli.demo.run import Demo, DemoError, Options, sigterm_interrupts
from meshlet.cli.demo.supervisor import Process, StartError
from meshlet.cli.demo.topology import Mode
from meshlet.cli.stats import Scrape

FAULTS: Final = ("kill-replica", "restart-destination", "restart-identity", "restart-policy",
                 "change-policy", "roll-upgrade")  # fmt: skip
KILLED: Final = "api-2"  # kill-replica's pod
ENDPOINTS_NOTICE: Final = 2.0  # seconds between a pod's end and its leaving the endpoints
CONTROLLERS: Final = ("destination", "identity", "policy", "tap")
READY_WITHIN: Final = 30.0
# The port each demo app serves, which a restarted pod's app must listen on before the pod is
# back in the endpoints.
APP_PORTS: Final = {"api": topology.API_PORT, "web": topology.WEB_PORT,
                    "store": topology.STORE_PORT}  # fmt: skip


def wait_listening(pid: int, ip: str, port: int, within: float) -> None:
    """Until the process's network namespace has a TCP socket listening on `ip` (or any
    address) and `port`, read from /proc/<pid>/net/tcp (the namespace's table), or `within`
    seconds."""
    deadline = time.monotonic() + within
    v4 = {socket.inet_aton(a)[::-1].hex().upper() for a in (ip, "0.0.0.0")}
    # a dual-stack socket ([::]) is in tcp6; an IPv4 address there is mapped (::ffff:a.b.c.d)
    v6 = {"0" * 32, *(f"0000000000000000FFFF0000{a}" for a in v4)}
    wanted = {f"{a}:{port:04X}" for a in v4 | v6}
    while time.monotonic() < deadline:
        rows = []
        for table in ("tcp", "tcp6"):
            try:
                text = Path(f"/proc/{pid}/net/{table}").read_text()
            except OSError:
                continue
            rows += [r.split() for r in text.splitlines()[1:]]
        if not Path(f"/proc/{pid}").exists():
            return  # the process is gone: the period reports what follows
        if any(r[1] in wanted and r[3] == "0A" for r in rows):  # 0A: LISTEN
            return
        time.sleep(0.05)


LOCK_WAIT: Final = 300.0


@dataclass(slots=True)
class Period:
    """One period of the soak: its fault and what the load and the processes showed."""

    index: int
    fault: str
    started: float  # Unix time
    ended: float = 0.0
    sent: int = 0
    failed: int = 0
    late: int = 0
    why: dict[str, int] = field(default_factory=dict)
    slowest_ms: float = 0.0
    renewals: int = 0
    rss_mib: dict[str, float] = field(default_factory=dict)  # process → RSS at the end
    open_files: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def process_usage(pid: int) -> tuple[float, int] | None:
    """A process's resident memory (MiB) and open files; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        files = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024, files
    return None


def load_window(stats: dict[str, Any], before: dict[str, Any], start: float, end: float
                ) -> dict[str, Any]:  # fmt: skip
    """The load's calls between two of its stats files, and its slowest call that ended in
    [start, end) (Unix times)."""

    def failures(s: dict[str, Any]) -> Counter[str]:
        reasons = {f"web's reason {k}": v for k, v in s.get("why", {}).items()}
        return Counter({**s.get("failed", {}), **reasons})

    failed = Counter(stats.get("failed", {}))
    failed.subtract(before.get("failed", {}))
    why = failures(stats)
    why.subtract(failures(before))
    slowest = [ms for second, ms in stats.get("slowest", []) if start <= second < end]
    return {
        "sent": stats.get("sent", 0) - before.get("sent", 0),
        "failed": sum(v for v in failed.values() if v > 0),
        "late": stats.get("late", 0) - before.get("late", 0),
        "why": {k: v for k, v in why.items() if v > 0},
        "slowest_ms": max(slowest, default=0.0),
    }


def drift(periods: list[Period], pick: Callable[[Period], dict[str, Any]]) -> dict[str, Any]:
    """Each process's value at the end of the first period (the warm-up), its largest after,
    and at the end: [first, peak, last]."""
    if not periods:
        return {}
    first, rest = pick(periods[0]), periods[1:] or periods
    out: dict[str, Any] = {}
    for name, value in first.items():
        later = [pick(p)[name] for p in rest if name in pick(p)]
        if later:
            out[name] = [value, max(later), later[-1]]
    return out


class Soak:
    def __init__(self, demo: Demo, period: float, say: Callable[[str], None]) -> None:
        assert demo.sup is not None, "the mesh is up"
        self.demo = demo
        self.sup = demo.sup
        self.period = period
        self.say = say
        self.saved: dict[str, Process] = {}
        self.periods: list[Period] = []

    # -- the faults -----------------------------------------------------------------------

    def fault(self, name: str, current: Period) -> None:
        demo = self.demo
        if name == "kill-replica":
            for proc in (f"proxy-{KILLED}", f"app-{KILLED}"):
                self.saved[proc] = self.sup.processes[proc]
                self.sup.kill(proc)
            time.sleep(ENDPOINTS_NOTICE)
            demo._manifests().remove(f"pod-{KILLED}")
        elif name.startswith("restart-"):
            self._restart_controller(name.removeprefix("restart-"))
        elif name == "change-policy":
            demo.set_route(50, 50)
        elif name == "roll-upgrade":
            for controller in CONTROLLERS:
                self._restart_controller(controller)
            for pod in demo.layout.of("api"):
                self._roll_pod(pod.name)
        current.events.append(f"{name} at {time.time() - current.started:.1f}s")

    def repair(self, name: str, current: Period) -> None:
        demo = self.demo
        if name == "kill-replica":
            self._start_pod(KILLED, self.saved.pop(f"proxy-{KILLED}"),
                            self.saved.pop(f"app-{KILLED}"))  # fmt: skip
        elif name == "change-policy":
            demo.set_route(*topology.CANARY_WEIGHTS)
        else:
            return
        current.events.append(f"repaired at {time.time() - current.started:.1f}s")

    def _restart_controller(self, name: str) -> None:
        demo = self.demo
        self.sup.stop(name)
        demo._start_spec(name)
        port = dict(CONTROL_ADMIN)[name]
        self.sup.wait_ready(name, f"http://{demo.layout.control_ip}:{port}/ready", READY_WITHIN)

    def _roll_pod(self, pod: str) -> None:
        demo = self.demo
        demo._manifests().remove(f"pod-{pod}")
        time.sleep(ENDPOINTS_NOTICE)
        procs = (self.sup.processes[f"proxy-{pod}"], self.sup.processes[f"app-{pod}"])
        for proc in procs:
            self.sup.stop(proc.name)
        self._start_pod(pod, *procs)

    def _start_pod(self, pod: str, proxy: Process, app: Process) -> None:
        """The pod's proxy, then its app, and the pod back in the endpoints once both are ready
        (as the kubelet's readiness probes would have it)."""
        demo = self.demo
        self.sup.restart(proxy.name, proxy)
        self.sup.wait_ready(proxy.name, f"{demo.layout.admin(demo.layout.pod(pod))}/ready",
                            READY_WITHIN)  # fmt: skip
        self.sup.restart(app.name, app)
        started = self.sup.processes[app.name].popen
        if started is not None:
            spec = demo.layout.pod(pod)
            wait_listening(started.pid, spec.ip, APP_PORTS[spec.app], READY_WITHIN)
        demo._manifests().put(f"pod-{pod}", topology.pod_manifest(demo.layout.pod(pod)))

    # -- measuring --------------------------------------------------------------------------

    def usage(self, current: Period) -> None:
        for name, proc in sorted(self.sup.processes.items()):
            got = process_usage(proc.popen.pid) if proc.popen is not None else None
            if got is not None:
                current.rss_mib[name], current.open_files[name] = round(got[0], 1), got[1]

    def renewals(self) -> dict[str, float]:
        """Each proxy's certificate renewals so far, by pod."""
        counts: dict[str, float] = {}
        for scrape in self.demo._scrape_pods():
            if isinstance(scrape, Scrape):
                counts[scrape.pod] = sum(v for (n, labels), v in scrape.series.items()
                                         if n == "identity_cert_refresh_total"
                                         and ("result", "ok") in labels)  # fmt: skip
        return counts

    def run(self, minutes: float) -> list[Period]:
        periods = max(1, round(minutes * 60 / self.period))
        stats = self.demo._load_stats() or {}
        renewed = self.renewals()
        for index in range(periods):
            name = FAULTS[index % len(FAULTS)]
            current = Period(index + 1, name, time.time())
            start = time.monotonic()
            self._at(start + 0.1 * self.period)
            self.fault(name, current)
            self._at(start + 0.5 * self.period)
            self.repair(name, current)
            self._at(start + self.period)
            current.ended = time.time()
            now_stats = self.demo._load_stats() or {}
            for key, value in load_window(now_stats, stats, current.started,
                                          current.ended).items():  # fmt: skip
                setattr(current, key, value)
            stats = now_stats
            counts = self.renewals()
            # a proxy started again in the period counts from 0: all of its count is new
            current.renewals = int(sum(
                n - renewed[pod] if n >= renewed.get(pod, 0) and pod in renewed else n
                for pod, n in counts.items()
            ))  # fmt: skip
            renewed = counts
            self.usage(current)
            self.periods.append(current)
            self.say(line(current))
        return self.periods

    def _at(self, when: float) -> None:
        """Sleeps until `when` (monotonic), noting processes that end by themselves."""
        while (left := when - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
            self.demo._watch_processes()


CONTROL_ADMIN: Final = (
    ("destination", wellknown.DESTINATION_ADMIN_PORT),
    ("identity", wellknown.IDENTITY_ADMIN_PORT),
    ("policy", wellknown.POLICY_ADMIN_PORT),
    ("tap", wellknown.TAP_ADMIN_PORT),
)


def line(p: Period) -> str:
    why = ", ".join(f"{k} {v}" for k, v in sorted(p.why.items())) or "-"
    rss = sum(p.rss_mib.values())
    return (f"period {p.index:3d} {p.fault:20s} sent {p.sent:6d} failed {p.failed:4d} ({why})"
            f" late {p.late} slowest {p.slowest_ms:7.1f} ms renewals {p.renewals:3d}"
            f" RSS {rss:7.1f} MiB files {sum(p.open_files.values()):5d}")  # fmt: skip


def report(periods: list[Period], died: list[str], minutes: float, rate: float) -> str:
    """The soak's summary as Markdown."""
    out = [f"# Soak: {minutes:g} min at {rate:g} calls/s, {len(periods)} periods", ""]
    out += ["| period | fault | sent | failed | why | slowest (ms) | renewals |",
            "| ---: | --- | ---: | ---: | --- | ---: | ---: |"]  # fmt: skip
    for p in periods:
        why = ", ".join(f"{k} {v}" for k, v in sorted(p.why.items())) or ""
        out.append(f"| {p.index} | {p.fault} | {p.sent} | {p.failed} | {why} |"
                   f" {p.slowest_ms:.1f} | {p.renewals} |")  # fmt: skip
    sent, failed = sum(p.sent for p in periods), sum(p.failed for p in periods)
    out += ["", f"**{failed} failed of {sent} calls**; slowest by fault: " + ", ".join(
        f"{f} {max((p.slowest_ms for p in periods if p.fault == f), default=0):.0f} ms"
        for f in FAULTS if any(p.fault == f for p in periods))]  # fmt: skip
    out += ["", "| process | RSS MiB: warm-up → peak → end | open files: warm-up → peak → end |",
            "| --- | --- | --- |"]  # fmt: skip
    rss, files = drift(periods, lambda p: p.rss_mib), drift(periods, lambda p: p.open_files)
    for name in rss:
        r, f = rss[name], files.get(name, ["", "", ""])
        out.append(f"| {name} | {r[0]:.1f} → {r[1]:.1f} → {r[2]:.1f} |"
                   f" {f[0]} → {f[1]} → {f[2]} |")  # fmt: skip
    out.append("")
    out.append("processes that ended by themselves: " + (", ".join(died) or "none"))
    return "\n".join(out)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="how long (default 60)")
    parser.add_argument("--period", type=float, default=60.0,
                        help="seconds between faults (default 60)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=20.0, help="the load's calls per second")
    parser.add_argument("--issuance-lifetime", default="90s",
                        help="the proxies' certificates' lifetime (default 90s)")  # fmt: skip
    parser.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    parser.add_argument("--json", type=Path, help="also write the periods as JSON here")
    args = parser.parse_args(argv)
    if args.period < 10:
        parser.error("--period must be at least 10 seconds")
    mode = {"netns": Mode.NETNS, "loopback": Mode.LOOPBACK}.get(args.mode)
    if mode is None:
        mode = Mode.NETNS if os.geteuid() == 0 else Mode.LOOPBACK
    console = Console(stderr=True)
    options = Options(mode=mode, duration=args.minutes * 60, rate=args.rate, drill=None,
                      keep=False, issuance_lifetime=args.issuance_lifetime,
                      summary_json=None)  # fmt: skip
    demo = Demo(options, console)
    try:
        busy = lambda: console.print("waiting for the demo's lock")  # noqa: E731
        with sigterm_interrupts(), lock.held(LOCK_WAIT, busy=busy):
            demo.up()
            try:
                console.print(f"soak: {args.minutes:g} min, a fault every {args.period:g} s,"
                              f" {args.rate:g} calls/s ({mode.value} mode)")  # fmt: skip
                soak = Soak(demo, args.period, _progress)
                try:
                    periods = soak.run(args.minutes)
                except KeyboardInterrupt:  # Ctrl-C: the report of the periods so far
                    periods = soak.periods
                    _progress("interrupted")
            finally:
                problems = demo.down()
    except (DemoError, StartError, lock.LockBusy) as exc:
        console.print(f"[red]soak: {exc}[/red]")
        return 1
    died = [proc.name for proc in demo.died]
    print(report(periods, died, args.minutes, args.rate))
    for problem in problems:
        print(f"could not remove: {problem}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(p) for p in periods], indent=1))
    return 1 if died or problems else 0


if __name__ == "__main__":
    sys.exit(main())
