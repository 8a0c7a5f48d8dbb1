"""`meshlet demo`: builds the local mesh out of this repository's commands, shows it working,
performs a drill, and takes everything down again.

Up: a CA, the control plane (`meshlet-controller identity` with a tokens file, `meshlet-controller
destination`, `meshlet-controller policy` and `meshlet-controller tap` on one manifests folder, over
TLS from the CA), then
every pod: `meshlet-init`'s rules, `meshlet-proxy` (GID 2102, so that its own connections skip the
rules), and the pod's app. A pod's manifest is written once its proxy holds a certificate, so it
joins its service's endpoints as a readiness probe would let it; the load starts once the
destination has read the pods and every proxy follows its ports' policies. Running: every second
each proxy's /metrics and the load generator's stats are read and shown: redrawn in place on a
terminal; elsewhere (`make demo | tee log`) each event as a line and the whole view every
SNAPSHOT_EVERY seconds. Down: processes, namespaces, links, files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.live import Live

from meshlet.api import wellknown
from meshlet.cli import localmesh
from meshlet.cli.demo import drills, network, outbound, topology
from meshlet.cli.demo.supervisor import (
    Process,
    Record,
    StartError,
    Supervisor,
    command,
    pid_runs,
    records,
    shm_folder,
    state_root,
    stop_pids,
)
from meshlet.cli.demo.topology import Layout, Mode, Place, Pod
from meshlet.cli.demo.view import Client, Outbound, Snapshot, certificates_line, fit
from meshlet.cli.stats import QUANTILES, Scrape, Traffic, combine, parse, row, traffic
from meshlet.cli.stats import replica_rows as make_replica_rows

WINDOW: Final = 10.0  # seconds the live view's rates and quantiles cover
WARMUP: Final = 5.0  # seconds of load before the summary's "after warm-up" numbers start
READY_WITHIN: Final = 30.0
# A pod whose proxy has not answered a scrape for this long is shown gone, without traffic.
GONE_AFTER: Final = 3.0
SNAPSHOT_EVERY: Final = 10.0  # seconds between the views printed when stdout is no terminal
WORKLOADS: Final = ("web", "api", topology.CANARY, "store")  # the rows of the workloads table
# The control plane's processes: (name, admin port), started and checked in this order.
CONTROL_PLANE: Final = (
    ("identity", wellknown.IDENTITY_ADMIN_PORT),
    ("destination", wellknown.DESTINATION_ADMIN_PORT),
    ("policy", wellknown.POLICY_ADMIN_PORT),
    ("tap", wellknown.TAP_ADMIN_PORT),
)


class DemoError(Exception):
    """The demo cannot go on; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Options:
    mode: Mode
    duration: float  # 0: until interrupted
    rate: float
    drill: str | None
    keep: bool
    issuance_lifetime: str
    summary_json: Path | None
    refresh: float = 1.0


class Demo:
    def __init__(
        self, options: Options, console: Console, place: Place = topology.DEFAULT_PLACE
    ) -> None:
        self.options = options
        self.console = console
        self.layout: Layout = topology.layout(options.mode, place)
        root = state_root(place.name)
        self.record = Record(mode=options.mode.value, root=str(root), shm=shm_folder(place.name),
                             name=place.name, slot=place.slot)  # fmt: skip
        self.root = root
        self.sup: Supervisor | None = None
        self.started = time.monotonic()
        self.load_started: float | None = None
        self.events: list[tuple[float, str]] = []
        self.scrapes: dict[str, deque[Scrape]] = {p.name: deque() for p in self.layout.pods}
        self.baseline: dict[str, Scrape] = {}  # the first scrape after the warm-up
        self.start_scrape: dict[str, Scrape] = {}  # the first scrape once the load runs
        self.notes: dict[str, str] = {
            topology.SLOW_REPLICA: f"+{topology.SLOW_DELAY * 1000:.0f} ms"
        }
        # pod → ms its app adds to each call (the slow replica, and the slow-replica drill's)
        self.slow: dict[str, float] = {topology.SLOW_REPLICA: topology.SLOW_DELAY * 1000}
        self.last_seen: dict[str, float] = {}  # pod → when its proxy last answered a scrape
        self.removed: set[str] = set()  # pods taken out of the manifests
        self.specs: dict[str, Process] = {}  # control-plane processes, to start again
        self.checks: dict[str, Any] = {}  # what the drill measured
        # api's route's weights now, by backend (the canary drill changes them)
        self.weights: dict[str, int] = dict(
            zip(("api", topology.CANARY), topology.CANARY_WEIGHTS, strict=True)
        )
        # Processes that ended without the demo or its drill ending them: the run failed.
        self.died: list[Process] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)

    # -- bringing it up ---------------------------------------------------------------------

    def up(self) -> None:
        """Builds the mesh; DemoError (after undoing what was made) if it cannot. Interrupted
        (Ctrl-C) or failing in any other way, it undoes what was made too, then lets go."""
        self._claim_root()
        try:
            self._build()
        except (StartError, network.NetworkError, OSError) as exc:
            self.down()
            raise DemoError(str(exc)) from None
        except BaseException:
            self.down()
            raise

    def _claim_root(self) -> None:
        running = running_demo(self.root)
        if running is not None:
            raise DemoError(running)
        previous = Record.load(self.root)
        if previous is not None:
            undo(previous)  # what a demo that died left behind
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.record.save()

    def _build(self) -> None:
        layout, root = self.layout, self.root
        self.sup = Supervisor(self.record)
        self._event("building the mesh")
        anchors_pem = self._ca()
        (root / "tokens.yaml").write_text(topology.tokens_file(layout))
        tokens = root / "tokens"
        tokens.mkdir(exist_ok=True)
        for pod in layout.pods:
            (tokens / pod.name).write_text(pod.token)
        (root / topology.FAULTS_DIR).mkdir(exist_ok=True)
        manifests = self._manifests()
        for name, objs in topology.manifests_static().items():
            manifests.put(name, *objs)
        if layout.mode is Mode.NETNS:
            left = sweep(layout)
            if left:
                self._event(f"removed what an earlier demo left: {', '.join(left)}")
            members = network.members(layout)
            self.record.netns = [m.netns for m in members]
            self.record.etc = [str(network.ETC_NETNS / m.netns) for m in members]
            if not network.ETC_NETNS.exists():
                self.record.etc.append(str(network.ETC_NETNS))
            self.record.save()
            network.apply(network.plan(layout))
            network.write_hosts(layout)
        self._start_control_plane()
        self._start_pods(anchors_pem)
        self.record.urls = {
            **{f"proxy {p.name}": f"{layout.admin(p)}/metrics" for p in layout.pods},
            **{
                f"{name} admin": f"http://{layout.control_ip}:{port}"
                for name, port in CONTROL_PLANE
            },
            "tap": f"http://{layout.control_ip}:{wellknown.TAP_PORT}",
        }
        self._start_prometheus()
        self.record.save()

    def _start_prometheus(self) -> None:
        """When Debian's prometheus is installed: one scraping every proxy and the control
        plane's admin ports each second (`meshlet viz` reads it); else nothing."""
        from meshlet.cli.demo import prometheus

        binary = prometheus.binary()
        if binary is None:
            return
        assert self.sup is not None
        layout = self.layout
        targets = [
            prometheus.Target(f"{p.ip}:{wellknown.PROXY_ADMIN_PORT}", topology.NAMESPACE, p.name,
                              p.workload, p.workload)
            for p in layout.pods
        ] + [
            prometheus.Target(f"{layout.control_ip}:{port}", wellknown.CONTROL_PLANE_NAMESPACE,
                              name, name, name, job=prometheus.CONTROLLER_JOB,
                              component=name)
            for name, port in CONTROL_PLANE
        ]  # fmt: skip
        config = self.root / "prometheus.yml"
        config.write_text(prometheus.config(targets))
        # another mesh's Prometheus may be starting beside it: a named mesh takes any free port
        listen = prometheus.listen_address(wanted=prometheus.PORT if self.layout.place.default
                                           else 0)  # fmt: skip
        self.sup.start("prometheus", prometheus.command(binary, config, self.root / "tsdb", listen))
        url = f"http://{listen}"
        try:
            prometheus.wait_ready(url)
        except TimeoutError as exc:
            self._event(f"{exc}; see {self.root / 'logs' / 'prometheus.log'}")
            return
        self.record.urls["prometheus"] = url
        self._event(f"Prometheus at {url} ({self._env}meshlet viz stat deploy -n demo)")
        self._start_dashboard(url)

    def _start_dashboard(self, prometheus_url: str) -> None:
        """The web dashboard, on this host's loopback beside Prometheus (which its pages read),
        relaying the control plane's tap controller for its tap page."""
        from meshlet.cli.demo import prometheus

        assert self.sup is not None
        web = prometheus.listen_address(
            wanted=wellknown.WEB_PORT if self.layout.place.default else 0
        )
        tap = f"{self.layout.control_ip}:{wellknown.TAP_PORT}"
        self.specs["web"] = Process(
            "web",
            [*command("meshlet-controller"), "web", "--addr", web, "--admin-addr", "127.0.0.1:0",
             "--prometheus-url", prometheus_url, "--tap-addr", tap],
            {}, None, None, self.sup.logs / "web.log",
        )  # fmt: skip
        # not waited for (about a second of imports, on every run): the supervisor reports it
        # if it dies, as every other process
        self._start_spec("web")
        self.record.urls["dashboard"] = f"http://{web}"
        self._event(f"dashboard at http://{web}/ ({self._env}meshlet viz dashboard)")

    @property
    def _env(self) -> str:
        """What a command needs before it to read this mesh: nothing for the default one."""
        place = self.layout.place
        return "" if place.default else f"{localmesh.NAME_ENV}={place.name} "

    def _ca(self) -> str:
        return write_ca(self.root / "ca")

    def _manifests(self) -> Any:
        from meshlet.controlplane.k8s.manifests import ManifestsFolder

        folder = self.root / "manifests"
        folder.mkdir(exist_ok=True)
        return ManifestsFolder(folder)

    def _start_control_plane(self) -> None:
        layout, root, sup = self.layout, self.root, self.sup
        assert sup is not None
        netns = layout.netns("control") if layout.mode is Mode.NETNS else None
        ip = layout.control_ip
        argv = controller_argv(ip, root, cluster_networks=layout.cluster_network,
                               issuance_lifetime=self.options.issuance_lifetime)  # fmt: skip
        for name, _ in CONTROL_PLANE:
            self.specs[name] = Process(name, argv[name], {}, netns, None, sup.logs / f"{name}.log")
        for name, _ in CONTROL_PLANE:
            self._start_spec(name)
        for name, port in CONTROL_PLANE:
            sup.wait_ready(name, f"http://{ip}:{port}/ready", READY_WITHIN)
        self._event("control plane up")

    def _start_spec(self, name: str) -> None:
        assert self.sup is not None
        spec = self.specs[name]
        self.sup.start(name, spec.argv, env=spec.env, netns=spec.netns, gid=spec.gid)

    def _start_pods(self, anchors_pem: str) -> None:
        layout, sup, root = self.layout, self.sup, self.root
        assert sup is not None
        netns_mode = layout.mode is Mode.NETNS
        if netns_mode:  # each pod's rules, all at once
            inits = list(self._pool.map(
                lambda pod: sup.run_once(
                    f"init-{pod.name}",
                    [*command("meshlet-init"), "--proxy-gid", str(wellknown.PROXY_GID)],
                    netns=layout.netns(pod.name),
                ),
                layout.pods,
            ))  # fmt: skip
            assert len(inits) == len(layout.pods)
        shm = Path(self.record.shm)
        shm.mkdir(mode=0o700, exist_ok=True)
        stats = root / "load-stats.json"
        for pod in layout.pods:
            identity_dir = shm / pod.name
            identity_dir.mkdir(mode=0o700, exist_ok=True)
            env = topology.proxy_env(
                layout, pod, token_file=str(root / "tokens" / pod.name),
                identity_dir=str(identity_dir), anchors_pem=anchors_pem,
                anchors_file=str(root / "ca" / "trust-anchors.pem"),
            )  # fmt: skip
            netns = layout.netns(pod.name) if netns_mode else None
            gid = wellknown.PROXY_GID if netns_mode else None
            sup.start(f"proxy-{pod.name}", command("meshlet-proxy"), env=env, netns=netns, gid=gid)
            if pod.app != "load":
                argv = topology.app_argv(layout, pod, rate=self.options.rate,
                                         stats_file=str(stats), root=str(root))  # fmt: skip
                app_env = {"GRPC_DNS_RESOLVER": "native"}
                sup.start(f"app-{pod.name}", [*command("meshlet"), *argv], env=app_env,
                          netns=netns)  # fmt: skip
        manifests = self._manifests()
        for pod in layout.pods:
            sup.wait_ready(f"proxy-{pod.name}", f"{layout.admin(pod)}/ready", READY_WITHIN)
            manifests.put(f"pod-{pod.name}", topology.pod_manifest(pod))
        self._event("pods up: every proxy holds a certificate")
        wait_destination_read(layout.control_ip, time.time())
        want = sum(1 for pod in layout.pods if topology.app_port(pod) is not None)
        wait_policies_followed(layout.control_ip, want, sup.logs)
        self._event("every proxy follows its port's policy")
        load = layout.of("load")[0]
        argv = topology.app_argv(layout, load, rate=self.options.rate, stats_file=str(stats),
                                 root=str(root))  # fmt: skip
        sup.start(f"app-{load.name}", [*command("meshlet"), *argv],
                  netns=layout.netns(load.name) if netns_mode else None)  # fmt: skip
        self.load_started = time.monotonic()
        self._event(f"load started: {self.options.rate:g} calls/s to web")

    # -- running ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Shows the mesh until the duration passes or the user interrupts; the summary."""
        schedule = drills.schedule(self.options.drill, self.options.duration)
        options = self.options
        deadline = time.monotonic() + options.duration if options.duration else None
        next_tick = time.monotonic()
        screen = Screen(self.console, self.events)
        with screen, sigterm_interrupts():
            try:
                while deadline is None or time.monotonic() < deadline:
                    now = time.monotonic()
                    while schedule and self._since_load(now) >= schedule[0].at:
                        schedule += self._perform(schedule.pop(0))
                        schedule.sort(key=lambda step: step.at)
                    self._scrape_all()
                    self._watch_processes()
                    screen.show(lambda: fit(self._snapshot(window=True), *screen.size))
                    next_tick += options.refresh
                    time.sleep(max(0.0, next_tick - time.monotonic()))
            except KeyboardInterrupt:
                self._event("interrupted")
        self._watch_processes()
        self._scrape_all()
        self.checks = self._finish()
        summary = self._summary()
        final = self._snapshot(window=False)
        self.console.print(fit(final, self.console.width, caption=summary["caption"]))
        if options.summary_json is not None:
            options.summary_json.write_text(json.dumps(summary, indent=1))
        return summary

    def _perform(self, step: drills.Step) -> list[drills.Step]:
        """A drill step; a control-plane process it starts that dies or never gets ready
        fails the run (its log is kept), and the drill goes on."""
        try:
            return drills.perform(step, self)
        except StartError as exc:
            self._event(f"drill step {step.action!r} failed: {str(exc).splitlines()[0]}")
            name = step.action.partition(" ")[2]
            proc = self.sup.processes.pop(name, None) if self.sup is not None else None
            if proc is not None and proc not in self.died:
                self.died.append(proc)
            return []

    def _finish(self) -> dict[str, Any]:
        """What the drill measured."""
        return drills.finish(self)

    def _since_load(self, now: float) -> float:
        return now - self.load_started if self.load_started is not None else 0.0

    def _event(self, what: str) -> None:
        self.events.append((time.monotonic() - self.started, what))

    def _scrape_pods(self) -> list[Scrape | None]:
        """Every pod's proxy metrics now (None: it did not answer)."""

        def one(pod: Pod) -> Scrape | None:
            try:
                with urllib.request.urlopen(f"{self.layout.admin(pod)}/metrics", timeout=0.8) as r:
                    text = r.read().decode()
            except OSError:
                return None
            return Scrape(pod.name, time.monotonic(), parse(text))

        return list(self._pool.map(one, self.layout.pods))

    def _scrape_all(self) -> None:
        load_age = self._since_load(time.monotonic())
        for scrape in self._scrape_pods():
            if scrape is None:
                continue
            self.last_seen[scrape.pod] = scrape.at
            history = self.scrapes[scrape.pod]
            history.append(scrape)
            while history and history[0].at < scrape.at - WINDOW - 1:
                history.popleft()
            if self.load_started is not None:
                self.start_scrape.setdefault(scrape.pod, scrape)
                if load_age >= WARMUP:
                    self.baseline.setdefault(scrape.pod, scrape)

    def _watch_processes(self) -> None:
        """Notes every process that ended on its own: the drills' kills and the demo's own
        stops take a process out of the supervisor first, so any other end is a failure."""
        assert self.sup is not None
        for proc in self.sup.died():
            self._event(f"{proc.name} exited unexpectedly ({exit_status(proc)})")
            self.notes[proc.name] = "exited"
            self.sup.processes.pop(proc.name, None)
            self.died.append(proc)

    def keep_logs(self) -> Path:
        """Copies the logs out of the state folder, which `down` removes; the copy."""
        kept = Path(tempfile.mkdtemp(prefix="meshlet-demo-logs-"))
        shutil.copytree(self.root / "logs", kept, dirs_exist_ok=True)
        return kept

    # -- what is shown ----------------------------------------------------------------------

    def _gone(self) -> dict[str, float]:
        """Pods whose proxy answered scrapes before and has not for GONE_AFTER seconds: how
        long it has been."""
        now = time.monotonic()
        return {pod: now - at for pod, at in self.last_seen.items() if now - at > GONE_AFTER}

    def _window_scrapes(self, window: bool) -> tuple[dict[str, Scrape | None], dict[str, Scrape]]:
        """Each live pod's (first, last) scrape: of the last WINDOW seconds, or of the run."""
        old: dict[str, Scrape | None] = {}
        new: dict[str, Scrape] = {}
        gone = self._gone() if window else {}
        for pod in self.layout.pods:
            history = self.scrapes[pod.name]
            if not history or pod.name in gone:
                continue
            new[pod.name] = history[-1]
            if window:
                old[pod.name] = next((s for s in history if s.at >= history[-1].at - WINDOW),
                                     history[0])  # fmt: skip
            else:
                old[pod.name] = self.start_scrape.get(pod.name)
        return old, new

    def _outbound(self, window: bool) -> Outbound:
        old, new = self._window_scrapes(window)
        seconds = max((n.at - o.at for p, n in new.items() if (o := old.get(p)) is not None),
                      default=0.0)  # fmt: skip
        balancers = outbound.balancers(new.values())
        return Outbound(
            route=topology.API_ROUTE, parent="api", weights=dict(self.weights),
            requests=outbound.split_between(old, new, "api"), seconds=seconds,
            balancers={b: e for b, e in balancers.items() if b in self.weights},
        )  # fmt: skip

    def _traffic(self, window: bool) -> dict[str, Traffic]:
        """Each pod's traffic: over the last WINDOW seconds (pods gone left out: their last
        rate is not theirs any more), or over the whole run."""
        out = {}
        gone = self._gone() if window else {}
        for pod in self.layout.pods:
            history = self.scrapes[pod.name]
            if not history or pod.name in gone:
                continue
            new = history[-1]
            old: Scrape | None
            if window:
                old = next((s for s in history if s.at >= new.at - WINDOW), history[0])
                if old is new and len(history) > 1:
                    old = history[-2]
            else:
                old = self.start_scrape.get(pod.name)
            out[pod.name] = traffic(old if old is not new else None, new)
        return out

    def _snapshot(self, window: bool) -> Snapshot:
        layout = self.layout
        by_pod = self._traffic(window)
        rows = []
        for workload in WORKLOADS:
            pods = layout.of(workload)
            ready = sum(1 for p in pods if p.name in by_pod and p.name not in self.removed)
            total = combine(by_pod[p.name] for p in pods if p.name in by_pod)
            rows.append(row(workload, f"{ready}/{len(pods)}", total))
        api_pods = [p.name for p in layout.of("api")]
        replicas = make_replica_rows(by_pod, api_pods)
        gone = {pod: s for pod, s in self._gone().items() if pod in api_pods} if window else {}
        certificates, now, back = (
            self._certificates(),
            time.time(),
            self.checks.get("identity_back_at"),
        )
        drill = f" · drill: {self.options.drill}" if self.options.drill else ""
        return Snapshot(
            title=f"meshlet demo · {self._where()}{drill} · {self.options.rate:g} calls/s",
            elapsed=time.monotonic() - self.started, workloads=rows, replicas=replicas,
            replica_notes=self.notes, client=self._client(), control=self._control(),
            events=self.events, footer=self._footer() if window else "", gone=gone,
            slow=self.slow,
            certificates=certificates_line(certificates, now, back),
            certificates_short=certificates_line(certificates, now, back, short=True),
            outbound=self._outbound(window),
        )  # fmt: skip

    def _where(self) -> str:
        """Where the mesh runs, for the view's title."""
        return "network namespaces + iptables" if self.layout.mode is Mode.NETNS else "loopback"

    def _control(self) -> list[tuple[str, str]]:
        """Each control-plane component, up or down."""
        return [(name, "up" if self.sup and self.sup.alive(name) else "down")
                for name, _ in CONTROL_PLANE]  # fmt: skip

    def _footer(self) -> str:
        footer = "Ctrl-C stops the demo and removes everything it made"
        if self.layout.mode is Mode.LOOPBACK:
            footer = (
                "loopback mode: apps call their proxy explicitly and the store directly;"
                " transparent interception needs root and network namespaces. " + footer
            )
        return footer

    def _client(self) -> Client | None:
        stats = self._load_stats()
        if stats is None:
            return None
        now = time.time()
        return Client(
            sent=stats["sent"], ok=stats["ok"], failed=stats["failed"], dropped=stats["dropped"],
            quantiles=latency_quantiles(stats),
            store_first_byte_max_ms=stats["store_first_byte_max_ms"],
            recent_success=outbound.success(stats.get("recent", []), now - WINDOW, now),
            late=stats.get("late", 0),
        )  # fmt: skip

    def _load_stats(self) -> dict[str, Any] | None:
        return _json_file(self.root / "load-stats.json")

    def intruder_stats(self) -> dict[str, Any] | None:
        """What the deny drill's intruder wrote (None before it did)."""
        return _json_file(self.root / drills.INTRUDER_STATS)

    def set_route(self, api: int, canary: int) -> None:
        """api's HTTPRoute with these weights, as the control plane reads it."""
        self._manifests().put(topology.ROUTE_FILE, topology.api_route(api, canary))

    def _summary(self) -> dict[str, Any]:
        layout = self.layout
        whole = self._traffic(window=False)
        after: dict[str, Traffic] = {}
        for pod in layout.pods:
            history = self.scrapes[pod.name]
            if history and pod.name in self.baseline and history[-1] is not self.baseline[pod.name]:
                after[pod.name] = traffic(self.baseline[pod.name], history[-1])
        api_pods = [p.name for p in layout.of("api")]
        meshed = combine(whole[p.name] for p in layout.pods if p.name in whole)
        handled = meshed.requests + meshed.connections
        stats = self._load_stats() or {}
        failed = sum(stats.get("failed", {}).values())
        done = stats.get("ok", 0) + failed
        split = self._outbound(window=False)
        summary: dict[str, Any] = {
            "mode": self.options.mode.value,
            "seconds": round(time.monotonic() - self.started, 1),
            "load_seconds": round(self._since_load(time.monotonic()), 1),
            "rate": self.options.rate,
            "drill": self.options.drill,
            "client": {
                "sent": stats.get("sent", 0),
                "ok": stats.get("ok", 0),
                "failed": failed,
                "failures": stats.get("failed", {}),
                "why": stats.get("why", {}),  # web's reasons for its 502s
                "dropped": stats.get("dropped", 0),
                "late": stats.get("late", 0),  # not sent: the generator itself was paused
                "lag_max_ms": stats.get("lag_max_ms", 0),
                "latency_ms": latency_quantiles(stats),
                "success_rate": stats.get("ok", 0) / done if done else None,
                "by_api": stats.get("by_api", {}),
                "store_first_byte_max_ms": stats.get("store_first_byte_max_ms"),
            },
            "workloads": {
                w: asdict(
                    row(w, "", combine(whole[p.name] for p in layout.of(w) if p.name in whole))
                )
                for w in WORKLOADS
            },
            "replicas": {
                r.name: {"requests": r.requests, "share": r.share}
                for r in make_replica_rows(whole, api_pods)
            },
            "replicas_after_warmup": {
                r.name: {"requests": r.requests, "share": r.share}
                for r in make_replica_rows(after, api_pods)
            },
            "slow_replica": topology.SLOW_REPLICA,
            "mtls_share": (meshed.mtls_requests + meshed.mtls_connections) / handled
            if handled
            else None,
            "events": [(round(t, 1), what) for t, what in self.events],
            "died": {p.name: exit_status(p) for p in self.died},
            "checks": self.checks,
            "certificates": self._certificates(),
            "outbound": {
                "route": split.route,
                "weights": split.weights,
                "requests": split.requests,
                "balancers": {b: asdict(e) for b, e in split.balancers.items()},
            },
        }
        share = summary["replicas_after_warmup"].get(topology.SLOW_REPLICA, {}).get("share")
        rate = summary["client"]["success_rate"]
        mtls = summary["mtls_share"]
        dead = "".join(f"FAILED: {p.name} ({exit_status(p)}); " for p in self.died)
        summary["caption"] = dead + (
            f"whole run ({summary['load_seconds']:.0f} s of load); client success "
            f"{'-' if rate is None else f'{rate * 100:.2f}%'}; slow replica "
            f"{topology.SLOW_REPLICA} got "
            f"{'-' if share is None else f'{share * 100:.1f}%'} of api calls after a "
            f"{WARMUP:g} s warm-up; mTLS share "
            f"{'-' if mtls is None else f'{mtls * 100:.1f}%'}"
            + drills.summary_line(self.options.drill, self.checks)
        )
        return summary

    def _certificates(self) -> dict[str, dict[str, float]]:
        out = {}
        for pod in self.layout.pods:
            history = self.scrapes[pod.name]
            if not history:
                continue
            series = history[-1].series
            out[pod.name] = {
                "refreshed_at": _value(series, "identity_cert_refresh_timestamp_seconds"),
                "expires_at": _value(series, "identity_cert_expiration_timestamp_seconds"),
                "refreshes_ok": _value(series, "identity_cert_refresh_total", result="ok"),
                "refreshes_failed": sum(
                    v for (n, labels), v in series.items()
                    if n == "identity_cert_refresh_total" and ("result", "ok") not in labels
                ),
            }  # fmt: skip
        return out

    # -- taking it down ---------------------------------------------------------------------

    def keep(self) -> None:
        """Leaves the mesh running; tells the user how to reach it and stop it."""
        self._pool.shutdown(wait=False)
        self.record.save()
        console = self.console
        console.print("[bold]The mesh keeps running.[/bold]")
        for line in reach(self.layout, self.record.urls, self.root / "logs"):
            console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)

    def down(self) -> list[str]:
        """Stops every process and removes what the demo made; problems left, if any."""
        self._pool.shutdown(wait=False)
        if self.sup is not None:
            self.sup.stop_all()
        # A process whose start an interrupt cut short (between the fork and the record) is
        # recorded nowhere, and may not be in its pod's namespace yet; it is this process's
        # child all the same. Left running, it would keep its pod's namespace, and the veth on
        # the bridge, alive after `ip netns del`: the next demo's `ip link add` of that veth
        # would fail with "File exists".
        stop_pids(children(os.getpid()), grace=2.0, group=False)
        return undo(self.record)


def reach(layout: Layout, urls: dict[str, str], logs: Path) -> list[str]:
    """How to reach a kept mesh: a shell in a pod and web by name (netns), or web through the
    load pod's proxy as the load generator calls it (loopback); then its addresses."""
    load = layout.of("load")[0]
    if layout.mode is Mode.NETNS:
        web = layout.of("web")[0]
        lines = [f"a shell in a pod:   ip netns exec {layout.netns(web.name)} bash",
                 f"call web by name:   ip netns exec {layout.netns(load.name)} "
                 "curl -s http://web.demo/"]  # fmt: skip
    else:
        lines = [f"call web through load-1's proxy:   curl -s -H 'host: "
                 f"{topology.service('web').authority}' "
                 f"http://{load.ip}:{wellknown.PROXY_OUTBOUND_PORT}/"]  # fmt: skip
    lines += [f"{name}: {url}" for name, url in urls.items()]
    return [*lines, f"logs: {logs}", f"stop it and remove everything: {down_command(layout.place)}"]


def down_command(place: Place) -> str:
    """The command that stops the local mesh at `place`."""
    return "meshlet demo down" + ("" if place.default else f" --name {place.name}")


class Screen:
    """Where the view goes: redrawn in place on a terminal (rich's Live); elsewhere each new
    event as a line and the whole view every SNAPSHOT_EVERY seconds, as plain text."""

    def __init__(self, console: Console, events: list[tuple[float, str]]) -> None:
        self.console = console
        self.events = events
        self.live: Live | None = None
        if console.is_terminal:
            self.live = Live(console=console, refresh_per_second=4, transient=True,
                             redirect_stdout=False, auto_refresh=False)  # fmt: skip
        self.printed_events = 0
        self.last_view: float | None = None

    @property
    def size(self) -> tuple[int, int | None]:
        """Columns, and lines when the view is redrawn in place (else it scrolls: any)."""
        width, height = self.console.size
        return width, height if self.live is not None else None

    def __enter__(self) -> Screen:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def show(self, view: Any) -> None:
        """`view()` builds what to show (only called when something is shown)."""
        if self.live is not None:
            self.live.update(view(), refresh=True)
            return
        for at, what in self.events[self.printed_events :]:
            self.console.print(f"{int(at) // 60:02d}:{int(at) % 60:02d} {what}", markup=False,
                               highlight=False)  # fmt: skip
        self.printed_events = len(self.events)
        now = time.monotonic()
        if self.last_view is None or now - self.last_view >= SNAPSHOT_EVERY:
            self.console.print(view())
            self.last_view = now


def latency_quantiles(stats: dict[str, Any]) -> tuple[float | None, ...]:
    """The load generator's latency at each of QUANTILES, in ms, from its histogram."""
    from meshlet.cli.stats import quantile

    bounds = [*(float(b) for b in stats.get("latency_buckets_ms", [])), float("inf")]
    cumulative, running = {}, 0.0
    for bound, count in zip(bounds, stats.get("latency", [0]), strict=True):
        running += count
        cumulative[bound] = running
    return tuple(quantile(q, cumulative) for q in QUANTILES)


def exit_status(proc: Process) -> str:
    """How a process ended: `exit 1`, `killed by SIGKILL`; `not ready` if it runs."""
    code = proc.popen.poll() if proc.popen is not None else None
    if code is None:
        return "not ready"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def _json_file(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


SERVING: Final = (
    ("destination", wellknown.DESTINATION_SERVICE_NAME),
    ("policy", wellknown.POLICY_SERVICE_NAME),
    ("tap", wellknown.TAP_SERVICE_NAME),
)


def write_ca(
    folder: Path,
    serving: tuple[tuple[str, str], ...] = SERVING,
    lifetime: dt.timedelta = dt.timedelta(days=30),
) -> str:
    """A local mesh's PKI in `folder`: a trust anchor, the identity service's issuer, and a
    serving certificate (of `lifetime`) for each (controller, TLS identity) of `serving`, in
    `folder/<controller>`; the anchor's PEM."""
    from meshlet.controlplane.identity import ca, signer

    now = dt.datetime.now(dt.UTC)
    anchor, anchor_key = ca.create_trust_anchor(now)
    issuer_cert, issuer_key = ca.create_issuer(anchor, anchor_key, now)
    (folder / "issuer").mkdir(parents=True, exist_ok=True)
    (folder / "trust-anchors.pem").write_bytes(ca.cert_pem(anchor))
    (folder / "issuer" / wellknown.ISSUER_CERT_KEY).write_bytes(ca.cert_pem(issuer_cert))
    key_file = folder / "issuer" / wellknown.ISSUER_KEY_KEY
    key_file.touch(mode=0o600)
    key_file.write_bytes(ca.key_pem(issuer_key))
    issuer = ca.Issuer(chain=(issuer_cert,), key=issuer_key, anchors=(anchor,))
    for name, identity in serving:
        signer.write_serving_files(issuer, identity, folder / name, now, lifetime)
    return ca.cert_pem(anchor).decode()


def controller_argv(
    ip: str,
    root: Path,
    *,
    cluster_networks: str,
    default_policy: str | None = topology.DEFAULT_POLICY,
    issuance_lifetime: str | None = None,
) -> dict[str, list[str]]:
    """Each controller of a local mesh (CONTROL_PLANE's) as a command: listening on `ip`, with
    the PKI of `write_ca` in `root`/ca, the tokens file `root`/tokens.yaml and the manifests
    folder `root`/manifests. The tap controller opens each tapped proxy's tap server over mTLS
    with the tap identity's certificate."""
    ca, manifests = root / "ca", str(root / "manifests")

    def serving(name: str, identity: str) -> list[str]:
        return ["--tls-cert", str(ca / name / f"{identity}.crt"),
                "--tls-key", str(ca / name / f"{identity}.key")]  # fmt: skip

    lifetime = ["--issuance-lifetime", issuance_lifetime] if issuance_lifetime else []
    default = ["--default-policy", default_policy] if default_policy else []
    argv = {
        "identity": ["--addr", f"{ip}:{wellknown.IDENTITY_PORT}",
                     "--trust-anchors", str(ca / "trust-anchors.pem"),
                     "--issuer-dir", str(ca / "issuer"),
                     "--tokens-file", str(root / "tokens.yaml"), *lifetime],
        "destination": ["--addr", f"{ip}:{wellknown.DESTINATION_PORT}", "--manifests", manifests,
                        *serving("destination", wellknown.DESTINATION_SERVICE_NAME)],
        "policy": ["--addr", f"{ip}:{wellknown.POLICY_PORT}", "--manifests", manifests,
                   *serving("policy", wellknown.POLICY_SERVICE_NAME),
                   "--cluster-networks", cluster_networks, *default],
        "tap": ["--addr", f"{ip}:{wellknown.TAP_PORT}", "--manifests", manifests,
                *serving("tap", wellknown.TAP_SERVICE_NAME),
                "--trust-anchors", str(ca / "trust-anchors.pem")],
    }  # fmt: skip
    return {
        name: [*command("meshlet-controller"), name, *argv[name], "--admin-addr", f"{ip}:{admin}"]
        for name, admin in CONTROL_PLANE
    }


def wait_destination_read(control_ip: str, since: float, within: float = READY_WITHIN) -> None:
    """Until the destination at `control_ip` has applied the Pod manifests written before
    `since` (Unix time), so that the first calls find their endpoints: it re-reads the folder on
    change, not at once."""
    url = f"http://{control_ip}:{wellknown.DESTINATION_ADMIN_PORT}/metrics"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            series = parse(r.read().decode())
            applied = _value(series, "destination_source_last_event_timestamp_seconds",
                             kind="Pod")  # fmt: skip
            if applied >= since:
                return
        time.sleep(0.05)
    raise StartError(f"the destination did not read the pods within {within:g}s")


def wait_policies_followed(
    control_ip: str, want: int, logs: Path, within: float = READY_WITHIN
) -> None:
    """Until `want` proxies follow their app's ports' policies (one WatchPort stream each): a
    proxy asks before its pod is in the manifests, is told NOT_FOUND and asks again with
    backoff, and until it is answered its ports have the default policy."""
    url = f"http://{control_ip}:{wellknown.POLICY_ADMIN_PORT}/metrics"
    deadline = time.monotonic() + within
    streams = 0.0
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            streams = _value(parse(r.read().decode()), "policy_watch_streams_active")
            if streams >= want:
                return
        time.sleep(0.1)
    raise StartError(
        f"only {streams:g} of {want} proxies follow their policies after {within:g}s;"
        f" see the proxies' logs and {logs}/policy.log"
    )


def _value(series: dict[Any, float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in series.items() if n == name and want <= ls)


def undo(record: Record) -> list[str]:
    """Stops a demo's processes and removes its namespaces, links and files (also those of a
    demo in another process, or one that died); the problems met."""
    stop_pids([pid for pid in record.processes.values() if _alive(pid)], grace=5.0)
    # What runs in a pod's namespace and was never recorded (started as an interrupt arrived):
    # while it lives, the namespace, and its veth on the host, outlive `ip netns del`.
    strays = [pid for ns in record.netns for pid in network.pids_in(ns)]
    stop_pids(strays, grace=2.0, group=False)
    problems = []
    if removes_network(record):
        bridge = Place(record.name, record.slot).bridge
        problems += network.undo(network.teardown(record.netns, bridge),
                                 [Path(p) for p in record.etc])  # fmt: skip
    shutil.rmtree(record.shm, ignore_errors=True)
    shutil.rmtree(record.root, ignore_errors=True)
    return problems


def sweep(layout: Layout) -> list[str]:
    """Removes what a demo that died left under the demo's names and no record says (the
    caller holds the demo's lock, so no running demo owns them): the processes in those
    namespaces, the namespaces, veths on the host whose other end lives on in a namespace
    nobody can name any more, and the bridge. What it found, by name."""
    members = network.members(layout)
    netns = set(network.existing_netns(layout.place.netns_prefix))
    left_netns = [m.netns for m in members if m.netns in netns]
    left_links = [m.veth for m in members if network.link_exists(m.veth)]
    name = layout.place.bridge
    bridge = [name] if network.link_exists(name) else []
    stop_pids([pid for ns in left_netns for pid in network.pids_in(ns)], 2.0, group=False)
    cmds = [*(("ip", "netns", "del", ns) for ns in left_netns)]
    cmds += [("ip", "link", "del", veth) for veth in left_links]  # one end takes the pair
    cmds += [("ip", "link", "del", name) for name in bridge]
    network.undo(cmds, [])
    return [*left_netns, *left_links, *bridge]


def children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z" and int(stat[1]) == pid:
            found.append(int(proc.name))
    return found


def running_demo(root: Path | None = None) -> str | None:
    """What to tell a user who starts a demo while the one recorded in `root` (the state
    folder; the default mesh's when not given) still runs; None when none does."""
    root = state_root() if root is None else root
    previous = Record.load(root)
    if previous is None or not running(previous):
        return None
    place = Place(previous.name, previous.slot)
    return (
        f"a demo is already running ({previous.mode} mode, state in {root});"
        f" stop it with `{down_command(place)}`"
    )


def reserved_slots() -> dict[int, str]:
    """The slots the local meshes recorded on this machine hold (slot → name), running or left
    by one that died (its leftovers are its own to remove, by `meshlet demo down --name`);
    a mesh whose owner process is gone (a test run killed, or timed out, before its
    teardown) is removed first, and its slot is free."""
    held = {}
    for record in records():
        if record.owner and not pid_runs(record.owner):
            undo(record)
            continue
        held[record.slot] = record.name
    return held


def running(record: Record) -> bool:
    """Whether any of the processes `record` names still runs."""
    return any(_alive(pid) for pid in record.processes.values())


def removes_network(record: Record) -> bool:
    """Whether undoing `record` removes namespaces and the bridge: only for a run that made
    them (it records its namespaces before making anything), never for a loopback run, which
    must leave a bridge of the same name alone (another run's, or another program's)."""
    return record.mode == Mode.NETNS.value and bool(record.netns)


def _alive(pid: int) -> bool:
    """Whether `pid` runs one of the demo's commands (not a process that took over the pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return b"meshlet" in cmdline and state != "Z"


@contextlib.contextmanager
def sigterm_interrupts() -> Any:
    """SIGTERM ends the demo (or the soak) as Ctrl-C does: KeyboardInterrupt, so that what was
    started is taken down."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
