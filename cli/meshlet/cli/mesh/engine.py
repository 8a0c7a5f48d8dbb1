"""A local mesh of an application's own services, built from the demo's parts: a place of its
own on the machine (slot, addresses, bridge and namespace names, state folder: several run
side by side), a control plane (identity, destination, policy, tap), and per pod a
`meshlet-proxy` and the service's command; plus a meshed client pod, from which `get` calls by
name as any app would.

Two modes, as the demo has:
- **netns** (root): each pod a network namespace with `meshlet-init`'s rules (the proxy runs
  with GID 2102), the control plane in one of its own. Traffic is intercepted as in a cluster:
  apps call services by name (/etc/hosts) and never know the proxy is there.
- **loopback** (no root needed): pods are addresses on 127.N.77.0/24. Nothing intercepts, so
  each app gets its proxy as its HTTP proxy (`HTTP_PROXY`, `http_proxy`, `grpc_proxy`): HTTP
  clients send it their requests (absolute-form) and gRPC clients open CONNECT tunnels, naming
  the service as they would in a pod (`store`, `store.shop`, the full name); the proxy finds the
  service in discovery and calls a replica over mTLS. An app must bind its pod's address
  (`{ip}`: `--host {ip}`), and calls made without the proxy settings bypass the mesh. `fail`
  and `slow` need iptables, so netns mode.

The manifests folder the controllers read holds what a cluster's API server would: a Service
per service (a cluster IP that exists only in the pods' /etc/hosts and rules), every pod (`up`
returns once each one's proxy holds a certificate and its app listens, as readiness probes
would have it), and the application's own policy resources
(`apply`). Drills change the mesh as a test runs: `kill` a pod, `fail` or `slow` an app,
`restart` a controller, `deny` one service another. `stat` reads what the proxies measured,
`tap` the requests they see.

Network namespaces need root (`MeshError` says so otherwise); without it, loopback is the
default mode (`mode=`, or `$MESHLET_MESH_MODE`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.cli.demo import lock, network, run, topology
from meshlet.cli.demo.supervisor import (
    Process,
    Record,
    StartError,
    Supervisor,
    command,
    shm_folder,
    state_root,
)
from meshlet.cli.demo.topology import Layout, Mode, Place, Pod
from meshlet.cli.mesh import interpose
from meshlet.cli.mesh.spec import CLIENT, Service, Spec, problems
from meshlet.cli.stats import QUANTILES, Row, Scrape, combine, parse, row, traffic
from meshlet.controlplane.injector.validators import VALIDATORS
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.events import DESTINATION_KINDS, POLICY_SERVER_KINDS, Kind
from meshlet.controlplane.k8s.manifests import ManifestsFolder

READY_WITHIN: Final = 30.0
CONTROL_PLANE: Final = run.CONTROL_PLANE  # identity, destination, policy, tap
_COUNTER = itertools.count(1)
# The variables HTTP and gRPC clients read their proxy from (grpcio: grpc_proxy first)
PROXY_VARIABLES: Final = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy",
                          "grpc_proxy")  # fmt: skip
# The controllers reading the manifests folder: (process, admin port, its events counter, the
# kinds it reads)
READERS: Final = (
    ("destination", wellknown.DESTINATION_ADMIN_PORT, "destination_source_events_total",
     DESTINATION_KINDS),
    ("policy", wellknown.POLICY_ADMIN_PORT, "policy_source_events_total", POLICY_SERVER_KINDS),
)  # fmt: skip
RESOLV_CONF: Final = "# the mesh's names are in /etc/hosts; no DNS server\n"
MODE_ENV: Final = "MESHLET_MESH_MODE"  # netns or loopback, when `Mesh(mode=)` is not given


class MeshError(Exception):
    """The mesh could not be built or changed; the message says what and why."""


@dataclass(frozen=True, slots=True)
class Response:
    """What the client pod's curl got: the status (0: no response; `error` says why), the
    response's header fields (lower-case names) and body."""

    status: int
    headers: dict[str, str]
    body: str
    error: str = ""

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Stat:
    """What the proxies of a workload's pods measured of the requests they served (inbound),
    since they started: `meshlet viz stat`'s numbers."""

    requests: float
    success_rate: float | None  # fraction of responses classified success
    latency_ms: dict[float, float | None]  # quantile (0.5, 0.95, 0.99) → ms
    mtls: float | None  # fraction of requests (or, for TCP, connections) over mutual TLS
    denied: float  # requests and connections authorization refused
    peers: tuple[str, ...]  # the clients' identities

    @classmethod
    def of(cls, r: Row) -> Stat:
        return cls(r.requests, r.success, dict(zip(QUANTILES, r.quantiles, strict=True)),
                   r.mtls, r.denied, r.peers)  # fmt: skip


class Mesh:
    """`up()` builds it (MeshError, everything made removed, if it cannot); `down()` removes
    all of it, whatever happened before; both are safe to call twice."""

    def __init__(
        self,
        spec: Spec,
        *,
        name: str | None = None,
        mode: str | None = None,
        lock_wait: float = 120.0,
    ) -> None:
        wrong = problems(spec)
        if wrong:
            raise MeshError("the mesh's spec: " + "; ".join(wrong))
        self.mode = _mode(mode)
        self.spec = spec
        self.name = name or f"t{os.getpid()}-{next(_COUNTER)}"
        problem = topology.name_problem(self.name)
        if problem is not None:
            raise MeshError(problem)
        self.lock_wait = lock_wait
        self.started_in: float | None = None  # seconds `up` took
        self.layout: Layout | None = None
        self.record: Record | None = None
        self.sup: Supervisor | None = None
        self.control: dict[str, Process] = {}
        self._claim: contextlib.ExitStack | None = None
        self._apps: dict[str, Process] = {}
        self._pods: dict[str, Service | None] = {}  # pod → its service (None: the client)

    # -- building it ----------------------------------------------------------------------

    def up(self) -> Mesh:
        started = time.monotonic()
        if self.mode is Mode.NETNS and os.geteuid() != 0:
            raise MeshError("a local mesh of network namespaces needs root (loopback mode"
                            " does not: mode='loopback')")  # fmt: skip
        try:
            self._up()
        except (StartError, network.NetworkError, lock.LockBusy, OSError) as exc:
            self.down()
            raise MeshError(str(exc)) from None
        except BaseException:
            self.down()
            raise
        self.started_in = time.monotonic() - started
        return self

    def _up(self) -> None:
        self._claim = contextlib.ExitStack()
        place = self._claim.enter_context(
            lock.claimed(self.name, self.lock_wait, run.reserved_slots)
        )
        layout = self.layout = self._layout(place)
        root = state_root(self.name)
        previous = Record.load(root)
        if previous is not None:
            run.undo(previous)  # a mesh of this name that died: its processes, network, files
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.record = Record(mode=self.mode.value, root=str(root), shm=shm_folder(self.name),
                             name=self.name, slot=place.slot, owner=os.getpid())  # fmt: skip
        netns = self.mode is Mode.NETNS
        if netns:
            self.record.netns = [m.netns for m in network.members(layout)]
            self.record.etc = [str(network.ETC_NETNS / layout.netns(pod.name))
                               for pod in layout.pods]  # fmt: skip
            if not network.ETC_NETNS.exists():
                self.record.etc.append(str(network.ETC_NETNS))
        self.record.save()
        if netns:
            run.sweep(layout)
        self.sup = Supervisor(self.record)
        anchors = run.write_ca(root / "ca")
        (root / "tokens.yaml").write_text(self._tokens())
        manifests = self.manifests
        manifests.root.mkdir(exist_ok=True)
        for svc, cluster_ip in zip(self.spec.services, self._cluster_ips(), strict=True):
            manifests.put(f"service-{svc.name}", self._service(svc, cluster_ip))
        if netns:
            network.apply(network.plan(layout))
            for folder in network.write_hosts(layout, self._hosts()):
                if folder != network.ETC_NETNS:
                    # No DNS server is reachable from a pod: with none named, glibc asks the
                    # pod's own loopback and fails at once, where the machine's server would
                    # time out (a reverse lookup at start-up, as Python's http.server makes,
                    # took 10 s).
                    (folder / "resolv.conf").write_text(RESOLV_CONF)
        self._start_control_plane()
        self._start_pods(anchors)
        if self.spec.policy is not None:
            self.apply(self.spec.policy)

    def _layout(self, place: Place) -> Layout:
        base = topology.layout(self.mode, place)
        subnet = base.pods[0].ip.rsplit(".", 1)[0]  # the place's pods' /24
        names: list[tuple[str, Service | None]] = [
            (pod, svc) for svc in self.spec.services for pod in svc.pods()
        ]
        names.append((CLIENT, None))
        pods = []
        for host, (pod, svc) in enumerate(names, start=10):
            workload = svc.name if svc is not None else CLIENT
            pods.append(Pod(pod, workload, f"{subnet}.{host}", workload))
            self._pods[pod] = svc
        return Layout(self.mode, tuple(pods), base.control_ip, base.host_ip, base.prefix, place)

    def _cluster_ips(self) -> list[str]:
        return [f"10.96.0.{n}" for n in range(10, 10 + len(self.spec.services))]

    def _service(self, svc: Service, cluster_ip: str) -> dict[str, Any]:
        annotations = dict(svc.annotations)
        if svc.protocol == "opaque":
            annotations[wellknown.OPAQUE_PORTS_ANNOTATION] = str(svc.port)
        return objects.service(svc.name, self.spec.namespace, ports=[("p", svc.port, svc.port)],
                               cluster_ip=cluster_ip, annotations=annotations)  # fmt: skip

    def _hosts(self) -> str:
        ns, domain = self.spec.namespace, wellknown.CLUSTER_DOMAIN
        lines = ["127.0.0.1 localhost"]
        for svc, ip in zip(self.spec.services, self._cluster_ips(), strict=True):
            lines.append(f"{ip} {svc.name}.{ns}.svc.{domain} {svc.name}.{ns} {svc.name}")
        return "\n".join(lines) + "\n"

    def _tokens(self) -> str:
        assert self.layout is not None
        return "".join(
            f"token-{pod.name}: {{namespace: {self.spec.namespace},"
            f" serviceaccount: {pod.workload}}}\n"
            for pod in self.layout.pods
        )

    def _start_control_plane(self) -> None:
        assert self.sup is not None and self.layout is not None and self.record is not None
        ip, netns = self.layout.control_ip, self._netns("control")
        argv = run.controller_argv(ip, Path(self.record.root),
                                   cluster_networks=self.layout.cluster_network)  # fmt: skip
        for name, _ in CONTROL_PLANE:
            self.control[name] = Process(name, argv[name], {}, netns, None,
                                         self.sup.logs / f"{name}.log")  # fmt: skip
            self.sup.restart(name, self.control[name])
        for name, admin in CONTROL_PLANE:
            self.sup.wait_ready(name, f"http://{ip}:{admin}/ready", READY_WITHIN)

    def _start_pods(self, anchors: str) -> None:
        sup, layout, record = self.sup, self.layout, self.record
        assert sup is not None and layout is not None and record is not None
        root, shm = Path(record.root), Path(record.shm)
        shm.mkdir(mode=0o700, exist_ok=True)
        (root / "tokens").mkdir(exist_ok=True)
        # The pods are in the manifests from the start (`up` returns once every one is ready):
        # a proxy that asked for its ports' policies before its pod was known would be told
        # NOT_FOUND and ask again only after a backoff of seconds.
        for pod in layout.pods:
            self.manifests.put(f"pod-{pod.name}", self._pod_manifest(pod))
        written = time.time()
        if self.mode is Mode.NETNS:
            init = [*command("meshlet-init"), "--proxy-gid", str(wellknown.PROXY_GID)]
            for pod in layout.pods:
                sup.run_once(f"init-{pod.name}", init, netns=layout.netns(pod.name))
        for pod in layout.pods:
            svc = self._pods[pod.name]
            token = root / "tokens" / pod.name
            token.write_text(f"token-{pod.name}")
            (shm / pod.name).mkdir(mode=0o700, exist_ok=True)
            env = topology.proxy_env(
                layout, pod, token_file=str(token), identity_dir=str(shm / pod.name),
                anchors_pem=anchors, anchors_file=str(root / "ca" / "trust-anchors.pem"),
                namespace=self.spec.namespace, ports=(svc.port,) if svc is not None else (),
                opaque_ports=(svc.port,) if svc is not None and svc.protocol == "opaque" else (),
            )  # fmt: skip
            gid = wellknown.PROXY_GID if self.mode is Mode.NETNS else None
            sup.start(f"proxy-{pod.name}", command("meshlet-proxy"), env=env,
                      netns=self._netns(pod.name), gid=gid)  # fmt: skip
            if svc is not None:
                self._start_app(pod, svc)
        for pod in layout.pods:
            sup.wait_ready(f"proxy-{pod.name}", f"{layout.admin(pod)}/ready", READY_WITHIN)
        for pod in layout.pods:
            svc = self._pods[pod.name]
            if svc is not None:
                self._wait_listening(pod.name, svc.port)
        run.wait_destination_read(layout.control_ip, written)
        want = sum(1 for svc in self._pods.values() if svc is not None)
        run.wait_policies_followed(layout.control_ip, want, sup.logs)

    def _start_app(self, pod: Pod, svc: Service) -> None:
        assert self.sup is not None
        values = {"port": str(svc.port), "pod": pod.name, "ip": pod.ip,
                  "namespace": self.spec.namespace}  # fmt: skip
        argv = [_fill(arg, values) for arg in svc.command]
        env = {**svc.env, "PORT": str(svc.port), "POD_NAME": pod.name, "POD_IP": pod.ip,
               "POD_NAMESPACE": self.spec.namespace, **self._via_proxy(pod.name)}  # fmt: skip
        self._apps[pod.name] = self.sup.start(f"app-{pod.name}", argv, env=env,
                                              netns=self._netns(pod.name))  # fmt: skip

    def _netns(self, member: str) -> str | None:
        """The network namespace of a pod (or `control`); None in loopback mode."""
        assert self.layout is not None
        return self.layout.netns(member) if self.mode is Mode.NETNS else None

    def _via_proxy(self, pod: str) -> dict[str, str]:
        """In loopback mode, what makes a pod's clients use its proxy: the proxy settings HTTP
        and gRPC libraries read (curl, requests, httpx, urllib, aiohttp with trust_env, grpcio),
        pointing at its outbound listener. None in netns mode, where rules intercept."""
        if self.mode is Mode.NETNS:
            return {}
        proxy = f"http://{self.ip(pod)}:{wellknown.PROXY_OUTBOUND_PORT}"
        return {**{name: proxy for name in PROXY_VARIABLES}, "NO_PROXY": "", "no_proxy": ""}

    def _wait_listening(self, pod: str, port: int, within: float = READY_WITHIN) -> None:
        """Until the pod's app listens on `port` (its namespace's /proc/net/tcp{,6}, read
        through the app's own pid): what a readiness probe would wait for."""
        proc = self._apps[pod]
        assert proc.popen is not None
        deadline = time.monotonic() + within
        ip = self.ip(pod) if self.mode is Mode.LOOPBACK else None
        while not _listens(proc.popen.pid, port, ip):
            if proc.popen.poll() is not None:
                raise StartError(f"app-{pod} exited ({proc.popen.returncode}):\n{proc.tail(20)}")
            if time.monotonic() > deadline:
                raise StartError(f"app-{pod} does not listen on {port} after {within:g}s:\n"
                                 f"{proc.tail(20)}")  # fmt: skip
            time.sleep(0.02)

    def _pod_manifest(self, pod: Pod) -> dict[str, Any]:
        svc = self._pods[pod.name]
        annotations = dict(svc.annotations) if svc is not None else {}
        if svc is not None and svc.protocol == "opaque":
            annotations[wellknown.OPAQUE_PORTS_ANNOTATION] = str(svc.port)
        return objects.pod(
            pod.name, pod.ip, self.spec.namespace, app=pod.workload, sa=pod.workload,
            annotations=annotations,
            owner=("ReplicaSet", f"{pod.workload}-{objects.TEMPLATE_HASH}"),
            container_ports=[("app", svc.port)] if svc is not None else [],
        )  # fmt: skip

    # -- taking it down ---------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stops every process and removes the namespaces, links and folders; the problems met
        (none, normally)."""
        problems: list[str] = []
        if self.sup is not None:
            self.sup.stop_all(grace=3.0)
        if self.record is not None:
            problems += run.undo(self.record)
        if self._claim is not None:
            self._claim.close()  # the locks: its name and its slot are free again
            self._claim = None
        self.sup = None
        return problems

    def __enter__(self) -> Mesh:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        problems = self.down()
        if problems:
            raise MeshError("taking the mesh down: " + "; ".join(problems))

    # -- what tests do ----------------------------------------------------------------------

    @property
    def manifests(self) -> ManifestsFolder:
        assert self.record is not None, "the mesh is not up"
        return ManifestsFolder(Path(self.record.root) / "manifests")

    @property
    def pods(self) -> list[str]:
        return list(self._pods)

    def ip(self, pod: str) -> str:
        assert self.layout is not None, "the mesh is not up"
        if pod not in self._pods:
            raise KeyError(f"{pod}: no such pod (pods: {', '.join(self.pods)})")
        return self.layout.pod(pod).ip

    def url(self, service: str, path: str = "/") -> str:
        """`http://<service>.<namespace>:<port><path>`: how a pod calls the service."""
        svc = self.spec.service(service)
        return f"http://{svc.name}.{self.spec.namespace}:{svc.port}{path}"

    def get(self, service: str, path: str = "/", *curl_options: str) -> Response:
        """One request from the mesh's client pod to the service by name, by curl: through the
        client's proxy, over mTLS to a replica's proxy, to its app."""
        return self.curl(CLIENT, self.url(service, path), *curl_options)

    def curl(self, pod: str, url: str, *options: str) -> Response:
        """One request by curl run in `pod`'s namespace (as its app: through its proxy)."""
        done = self.exec(pod, "curl", "-sS", "--max-time", "10", "-D", "-", *options, url)
        return _response(done.stdout, done.stderr)

    def exec(self, pod: str, *argv: str, timeout: float = 30.0) -> Any:
        """`argv` run as the pod's app runs: in its network namespace (not with the proxy's
        GID), or in loopback mode with its proxy settings; its connections go through the
        pod's proxy. The CompletedProcess (text)."""
        import subprocess

        assert self.layout is not None, "the mesh is not up"
        if self.mode is Mode.NETNS:
            self.ip(pod)  # a KeyError for a pod the mesh lacks
            full, env = ["ip", "netns", "exec", self.layout.netns(pod), *argv], None
        else:
            full, env = list(argv), {**os.environ, **self._via_proxy(pod)}
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout,
                              check=False, env=env)  # fmt: skip

    def stat(self, target: str) -> Stat:
        """`deploy/NAME` (every replica) or `pod/NAME`: what their proxies measured."""
        assert self.layout is not None, "the mesh is not up"
        pods = self._pods_of(target)
        parts = [traffic(None, self._scrape(p)) for p in pods]
        return Stat.of(row(target, f"{len(parts)}/{len(pods)}", combine(parts)))

    def _scrape(self, pod: Pod) -> Scrape:
        assert self.layout is not None
        with urllib.request.urlopen(f"{self.layout.admin(pod)}/metrics", timeout=5) as r:
            return Scrape(pod.name, time.monotonic(), parse(r.read().decode()))

    def _running(self, pod: str) -> bool:
        return self.sup is not None and self.sup.alive(f"proxy-{pod}")

    @contextlib.contextmanager
    def tap(
        self,
        target: str,
        *,
        to: str | None = None,
        method: str | None = None,
        path: str | None = None,
        max_rps: float = 100.0,
    ) -> Iterator[Tap]:
        """The requests the proxies of `target` (`deploy/NAME`, `pod/NAME`) see while the block
        runs, as `meshlet viz tap` shows them (from the mesh's tap controller): the block
        starts once every one of those proxies is being tapped, so no request of the block is
        missed."""
        from meshlet.cli import tap as taps

        assert self.layout is not None and self.sup is not None, "the mesh is not up"
        pods = self._pods_of(target)
        path_query = taps.query({
            "resource": target, "namespace": self.spec.namespace, "to": to,
            "to_namespace": self.spec.namespace if to else None, "method": method,
            "path": path, "max_rps": f"{max_rps:g}",
        })  # fmt: skip
        tapped = Tap(self.layout.control_ip, wellknown.TAP_PORT, path_query)
        try:
            deadline = time.monotonic() + READY_WITHIN
            while not all(_gauge(self._scrape(p).series, "tap_open") >= 1 for p in pods):
                if tapped.error is not None or time.monotonic() > deadline:
                    raise MeshError(f"the tap of {target} did not start: {tapped.error}")
                time.sleep(0.02)
            yield tapped
        finally:
            tapped.close()

    def _pods_of(self, target: str) -> list[Pod]:
        assert self.layout is not None
        kind, _, name = target.partition("/")
        if kind in ("deploy", "deployment"):
            pods = [p for p in self.layout.pods if p.workload == name]
        elif kind in ("po", "pod"):
            pods = [p for p in self.layout.pods if p.name == name]
        else:
            raise ValueError(f"{target!r}: deploy/NAME or pod/NAME")
        pods = [p for p in pods if self._running(p.name)]
        if not pods:
            raise KeyError(f"{target}: no running pod or deployment of that name in the mesh")
        return pods

    # -- drills -----------------------------------------------------------------------------

    def kill(self, pod: str) -> None:
        """The pod dies (SIGKILL to its proxy and app) and is deleted (it leaves its service's
        endpoints), as a node losing it would."""
        assert self.sup is not None, "the mesh is not up"
        if pod not in self._pods or pod == CLIENT:
            raise KeyError(f"{pod}: no such pod of a service (pods: {', '.join(self.pods)})")
        for process in (f"proxy-{pod}", f"app-{pod}"):
            if process in self.sup.processes:
                self.sup.kill(process)
        with self._read({Kind.POD}):
            self.manifests.remove(f"pod-{pod}")

    def slow(self, target: str, delay: str | float) -> None:
        """Every reply of the app of `target` (a pod, or every pod of a service) comes `delay`
        late (seconds, or a duration: "50ms"), until `heal`: its proxy's connections to the
        app go through a relay that holds back what the app sends."""
        from meshlet.api.durations import parse_duration

        seconds = delay if isinstance(delay, float | int) else parse_duration(delay)
        for pod in self._targets(target):
            svc = self._pods[pod]
            assert svc is not None
            self._interpose(pod, svc, ["--to", f"{self.ip(pod)}:{svc.port}",
                                       "--delay", str(seconds)])  # fmt: skip

    def fail(self, target: str, status: int = 503) -> None:
        """Every request to the app of `target` (a pod, or every pod of a service) is answered
        `status` without reaching the app (gRPC calls: the matching gRPC status, 503 →
        UNAVAILABLE), until `heal`. Connections the proxy holds to the app are cut, so no
        request slips through on one."""
        if not 100 <= status <= 599:
            raise ValueError(f"status {status}: not an HTTP status")
        for pod in self._targets(target):
            svc = self._pods[pod]
            assert svc is not None
            self._interpose(pod, svc, ["--status", str(status)])

    def heal(self, target: str) -> None:
        """Undoes `slow` and `fail` on `target`: its proxy reaches its app again."""
        for pod in self._targets(target):
            self._unpose(pod)

    def _targets(self, target: str) -> list[str]:
        """A pod of a service, or every live pod of a service."""
        assert self.sup is not None, "the mesh is not up"
        if target in self._pods and self._pods[target] is not None:
            return [target]
        svc = self.spec.service(target)
        return [pod for pod in svc.pods() if self.sup.alive(f"proxy-{pod}")]

    def _interpose(self, pod: str, svc: Service, args: list[str]) -> None:
        assert self.sup is not None and self.layout is not None
        if self.mode is not Mode.NETNS:
            raise MeshError(
                "fail and slow need netns mode (root): they put a relay between"
                " a pod's proxy and its app with an iptables rule in the pod"
            )
        self._unpose(pod)
        name = f"drill-{pod}"
        port = interpose.PORT
        proc = self.sup.start(name, [sys.executable, "-m", "meshlet.cli.mesh.interpose",
                                     "--listen", f"127.0.0.1:{port}", *args],
                              netns=self.layout.netns(pod))  # fmt: skip
        assert proc.popen is not None
        deadline = time.monotonic() + READY_WITHIN
        while not _listens(proc.popen.pid, port):
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise MeshError(f"the drill's relay in {pod} did not start:\n{proc.tail(20)}")
            time.sleep(0.02)
        self._redirect(pod, svc, "-I")
        self._cut(pod, svc)

    def _unpose(self, pod: str) -> None:
        assert self.sup is not None
        name = f"drill-{pod}"
        if name not in self.sup.processes:
            return
        svc = self._pods[pod]
        assert svc is not None
        self._redirect(pod, svc, "-D")
        self._cut(pod, svc)
        self.sup.stop(name, grace=1.0)

    def _redirect(self, pod: str, svc: Service, verb: str) -> None:
        """Adds (-I) or deletes (-D) the pod's rule sending its proxy's new connections to
        the app's port to the drill's relay."""
        rule = ["-p", "tcp", "-d", self.ip(pod), "--dport", str(svc.port), "-m", "owner",
                "--gid-owner", str(wellknown.PROXY_GID), "-j", "REDIRECT",
                "--to-ports", str(interpose.PORT)]  # fmt: skip
        where = ["1"] if verb == "-I" else []
        done = self.exec(pod, "iptables-legacy", "-w", "-t", "nat", verb, "OUTPUT", *where, *rule)
        if done.returncode != 0:
            raise MeshError(f"iptables in {pod}: {done.stderr.strip()}")

    def _cut(self, pod: str, svc: Service) -> None:
        """Ends the proxy's open connections to the app's port (`ss -K`): the next request
        dials again, and meets the rules as they are now."""
        self.exec(pod, "ss", "-K", "dst", self.ip(pod), "dport", "=", str(svc.port))

    def restart(self, controller: str) -> None:
        """A controller (identity, destination, policy, tap) killed and started again, until it is
        ready."""
        assert self.sup is not None and self.layout is not None, "the mesh is not up"
        if controller not in self.control:
            raise KeyError(f"{controller}: the controllers are {', '.join(self.control)}")
        self.sup.kill(controller)
        self.sup.restart(controller, self.control[controller])
        admin = dict(CONTROL_PLANE)[controller]
        self.sup.wait_ready(controller, f"http://{self.layout.control_ip}:{admin}/ready",
                            READY_WITHIN)  # fmt: skip

    def deny(self, client: str, server: str) -> None:
        """From now on `server`'s port admits every meshed workload of the mesh but `client`
        (a Server, a MeshTLSAuthentication and an AuthorizationPolicy, as a user would write
        them); requests from `client` get 403, connections are refused."""
        svc = self.spec.service(server)
        others = [w for w in {*self.spec.names, CLIENT} if w != client]
        protocol = "opaque" if svc.protocol == "opaque" else "unknown"  # unknown: detected
        docs = topology.admit_only(f"{server}-admits", self.spec.namespace, server, svc.port,
                                   protocol, sorted(others))  # fmt: skip
        with self._read({kind for kind in map(_kind, docs) if kind is not None}):
            self.manifests.put(f"deny-{client}-{server}", *docs)

    def apply(self, path: Path | str) -> list[str]:
        """The YAML documents of a file, or of every *.yaml / *.yml file of a folder, added to
        what the controllers read (as `kubectl apply`); the files applied. A document that
        is not an object with a kind the controllers read, a name and this mesh's namespace
        (or none), or that the admission webhook would refuse (its validators), is a MeshError
        naming every problem, and nothing is applied."""
        import yaml

        path = Path(path)
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")) if \
            path.is_dir() else [path]  # fmt: skip
        loaded: list[tuple[str, list[dict[str, Any]]]] = []
        wrong = []
        for file in files:
            try:
                docs = [d for d in yaml.safe_load_all(file.read_text()) if d is not None]
            except (OSError, yaml.YAMLError) as exc:
                wrong.append(f"{file}: {exc}")
                continue
            for n, doc in enumerate(docs, 1):
                meta = doc.get("metadata") if isinstance(doc, dict) else None
                if not isinstance(meta, dict) or not doc.get("kind") or not meta.get("name"):
                    wrong.append(f"{file}, document {n}: not an object with a kind and a name")
                    continue
                if _kind(doc) is None:
                    wrong.append(f"{file}, document {n}: {doc.get('apiVersion')}"
                                 f" {doc.get('kind')} is not a kind the mesh's controllers"
                                 " read")  # fmt: skip
                    continue
                group = str(doc.get("apiVersion")).rpartition("/")[0]
                judge = VALIDATORS.get((group, str(doc.get("kind"))))
                for problem in judge(doc) if judge is not None else []:
                    wrong.append(f"{file}, document {n} ({doc['kind']} {meta['name']}): {problem}")
                ns = meta.setdefault("namespace", self.spec.namespace)
                if ns != self.spec.namespace:
                    wrong.append(f"{file}, document {n}: namespace {ns!r} is not the mesh's"
                                 f" ({self.spec.namespace})")  # fmt: skip
            loaded.append((file.name, docs))
        if wrong:
            raise MeshError("cannot apply: " + "; ".join(wrong))
        kinds = {kind for _, docs in loaded for kind in map(_kind, docs) if kind is not None}
        with self._read(kinds):
            for name, docs in loaded:
                self.manifests.put(f"applied-{re.sub(r'[^a-z0-9-]', '-', name.lower())}", *docs)
        return [str(f) for f in files]

    @contextlib.contextmanager
    def _read(self, kinds: set[Kind], within: float = READY_WITHIN) -> Iterator[None]:
        """Around a change of the manifests folder: after it, until every controller that
        reads one of `kinds` has applied an event of each (the folder is polled, twice a
        second): then the proxies are being told."""
        before = self._events()
        yield
        want = [(name, kind.kind) for name, _, _, read in READERS for kind in kinds if kind in read]
        deadline = time.monotonic() + within
        while True:
            now = self._events()
            late = [key for key in want if now.get(key, 0.0) <= before.get(key, 0.0)]
            if not late:
                return
            if time.monotonic() > deadline:
                raise MeshError(f"the controllers did not read the change within {within:g}s:"
                                f" {', '.join(f'{n} ({k})' for n, k in late)}")  # fmt: skip
            time.sleep(0.05)

    def _events(self) -> dict[tuple[str, str], float]:
        """Each controller's events applied so far, by kind: (controller, kind) → count."""
        assert self.layout is not None
        found: dict[tuple[str, str], float] = {}
        for name, port, counter, _ in READERS:
            url = f"http://{self.layout.control_ip}:{port}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                for (sample, labels), value in parse(r.read().decode()).items():
                    if sample == counter:
                        found[(name, dict(labels).get("kind", ""))] = value
        return found


@dataclass(frozen=True, slots=True)
class TapRequest:
    """One request a tapped proxy saw: its request, response and end events joined."""

    proxy: str  # namespace/pod of the proxy that saw it
    direction: str  # inbound or outbound
    method: str
    authority: str
    path: str
    status: int | None  # None while (or when) no response came
    grpc_status: int | None
    latency_ms: float | None  # to the response's head
    tls: bool
    src: str
    dst: str
    src_labels: dict[str, str]
    dst_labels: dict[str, str]


class Tap:
    """The events of one tap, read by a thread of its own while the test runs."""

    def __init__(self, host: str, port: int, path: str) -> None:
        import http.client
        import threading

        from meshlet.cli import tap as taps

        self.events: list[dict[str, Any]] = []
        self.error: str | None = None
        self._closed = False
        self._connection = http.client.HTTPConnection(host, port, timeout=10)
        self._lines = taps.stream(host, port, path, connection=self._connection)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="meshlet-tap", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        from meshlet.cli.tap import TapError

        try:
            for line in self._lines:
                with self._lock:
                    self.events.append(line)
        except TapError as exc:
            if not self._closed:
                self.error = str(exc)

    def close(self) -> None:
        """Ends the tap: its connection shut, its reader thread gone."""
        import socket

        self._closed = True
        sock = self._connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self._connection.close()

    def requests(self) -> list[TapRequest]:
        """The requests seen so far whose response head came, in the order they started."""
        with self._lock:
            events = list(self.events)
        started: dict[str, dict[str, Any]] = {}
        answered: dict[str, dict[str, Any]] = {}
        ended: dict[str, dict[str, Any]] = {}
        for event in events:
            into = {"req": started, "rsp": answered, "end": ended}.get(event.get("type", ""))
            if into is not None:
                into[event["id"]] = event
        found = []
        for key, req in started.items():
            rsp, end = answered.get(key), ended.get(key, {})
            if rsp is None:
                continue
            found.append(TapRequest(
                proxy=req["proxy"], direction=req["direction"], method=req["method"],
                authority=req["authority"], path=req["path"], status=rsp.get("status"),
                grpc_status=end.get("grpc_status"),
                latency_ms=rsp["latency"] * 1000 if rsp.get("latency") is not None else None,
                tls=req.get("tls") == "true", src=req["src"], dst=req["dst"],
                src_labels=req["src_labels"], dst_labels=req["dst_labels"],
            ))  # fmt: skip
        return found

    def wait(self, count: int, within: float = 10.0) -> list[TapRequest]:
        """The requests seen, once there are at least `count` (MeshError after `within` s)."""
        deadline = time.monotonic() + within
        while True:
            seen = self.requests()
            if len(seen) >= count:
                return seen
            if self.error is not None or time.monotonic() > deadline:
                raise MeshError(f"the tap saw {len(seen)} of {count} requests in {within:g}s"
                                + (f": {self.error}" if self.error else ""))  # fmt: skip
            time.sleep(0.02)


def _gauge(series: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in series.items() if n == name)


def _kind(doc: dict[str, Any]) -> Kind | None:
    return Kind.of(str(doc.get("apiVersion")), str(doc.get("kind")))


def _fill(arg: str, values: dict[str, str]) -> str:
    """`{port}`, `{pod}`, `{ip}`, `{namespace}` in `arg` replaced; other braces kept."""
    return re.sub(r"\{(port|pod|ip|namespace)\}", lambda m: values[m.group(1)], arg)


def _listens(pid: int, port: int, ip: str | None = None) -> bool:
    """Whether a socket listens on `port` in the network namespace of process `pid` (with
    `ip`: on that IPv4 address, or every address)."""
    # as /proc/net/tcp{,6} write them: IPv4 in host byte order (little-endian here); an IPv6
    # socket (grpcio's) holds the address v4-mapped (::ffff:a.b.c.d); or every address
    v4 = "".join(f"{int(octet):02X}" for octet in reversed(ip.split("."))) if ip else ""
    wanted = None if ip is None else {v4, "00000000", "0000000000000000FFFF0000" + v4, "0" * 32}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) <= 3 or fields[3] != "0A":
                continue
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and (wanted is None or address in wanted):
                return True
    return False


def _mode(asked: str | None) -> Mode:
    """The mode asked for (or `$MESHLET_MESH_MODE`); else netns where network namespaces can
    be made (as the demo decides), loopback otherwise."""
    from meshlet.cli.demo.command import choose_mode

    value = asked or os.environ.get(MODE_ENV)
    if value is None:
        return choose_mode("auto")[0]
    if value not in (Mode.NETNS.value, Mode.LOOPBACK.value):
        raise MeshError(f"mode {value!r}: netns or loopback")
    return Mode(value)


def _response(output: str, stderr: str) -> Response:
    """curl's `-D -` output as a Response (the last response's head: after 1xx ones)."""
    rest = output.replace("\r\n", "\n")
    head, body = "", rest
    while rest.startswith("HTTP/"):
        head, _, rest = rest.partition("\n\n")
        body = rest
    lines = head.splitlines()
    status = int(lines[0].split()[1]) if lines else 0
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(status, headers, body, "" if status else stderr.strip())


@contextlib.contextmanager
def running(spec: Spec, name: str | None = None) -> Iterator[Mesh]:
    """A mesh up for the block and down after it, whatever happened in it."""
    with Mesh(spec, name=name) as mesh:
        yield mesh
