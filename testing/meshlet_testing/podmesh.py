"""A local mesh of real processes for end-to-end tests, built from the demo's pieces: pods as
network namespaces on a bridge (`meshlet.cli.demo.network`, under names of this module so that
it lives beside a running demo), each meshed pod with `meshlet-init`'s rules and a
`meshlet-proxy` (GID 2102) in the environment the demo gives its proxies, and the control plane
(`meshlet-controller identity`, `destination` and `policy`, over TLS from a CA made here) in a
namespace of its own, reading one manifests folder that the tests rewrite.

Every pod has its own address, so a proxy sees each client's real address and identity (on
loopback every client would be 127.0.0.1, which a controller's policy always allows). Clients
are programs nobody here wrote, run in a pod's namespace: curl, grpcio, a plain socket. A meshed
client's connections go through its own proxy (the iptables rules), an unmeshed client's go out
as they are.

One mesh at a time on a machine: `up` takes an exclusive lock, removes what a mesh that died
left (its namespaces, the processes in them, the bridge), then builds; `down` undoes all of it,
also after a failed `up`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.cli.demo import network, run, topology
from meshlet.cli.demo.supervisor import Process, Record, Supervisor, command, stop_pids
from meshlet.cli.demo.topology import Layout, Mode, Pod
from meshlet.cli.stats import Series, parse
from meshlet.controlplane.k8s import objects
from meshlet.controlplane.k8s.manifests import ManifestsFolder

NAMES: Final = network.Names(bridge="mpm0", netns_prefix="meshlet-pm-", veth_prefix="mpm-")
LOCK: Final = Path("/tmp/meshlet-podmesh.lock")
NS: Final = topology.NAMESPACE  # the pods' Kubernetes namespace (the demo's proxy_env names it)
READY_WITHIN: Final = 30.0
TESTING: Final = Path(__file__).resolve().parent.parent  # what makes meshlet_testing importable
# (process, admin port): the local mesh's controllers that pods need (a test that taps starts its
# own tap controller)
CONTROL_PLANE: Final = tuple(
    (name, port)
    for name, port in run.CONTROL_PLANE
    if name in ("identity", "destination", "policy")
)


class MeshError(Exception):
    """The mesh could not be built; the message says what failed, with the process's log."""


@dataclass(frozen=True, slots=True)
class PodSpec:
    """A pod of the mesh: `meshed` pods have a proxy and their identity (ServiceAccount
    `pod.workload`); `app` pods run `meshlet_testing.podapp`, and their proxy follows the
    policy of `policy_ports` from the policy controller."""

    pod: Pod
    meshed: bool = True
    app: bool = False
    policy_ports: tuple[int, ...] = ()
    opaque_ports: tuple[int, ...] = ()
    namespace: str = NS

    @property
    def identity(self) -> str:
        return wellknown.identity_name(self.pod.workload, self.namespace)


@dataclass(frozen=True, slots=True)
class Curl:
    """What curl saw: the status (0 when no response came: `exit` says why), the response
    header fields (lower-case names) and the body."""

    status: int
    headers: dict[str, str]
    body: str
    exit: int

    def json(self) -> Any:
        return json.loads(self.body)


class PodMesh:
    def __init__(
        self,
        root: Path,
        layout: Layout,
        specs: list[PodSpec],
        *,
        cluster_networks: str,
        annotations: Mapping[str, Mapping[str, str]] | None = None,
        ipv6: bool = False,
    ) -> None:
        self.ipv6 = ipv6  # dual stack: each pod also has `ip6(pod)`, as a dual-stack cluster's
        self.root = root
        self.layout = layout
        self.specs = {spec.pod.name: spec for spec in specs}
        self.cluster_networks = cluster_networks
        self.annotations = {name: dict(a) for name, a in (annotations or {}).items()}
        self.record = Record(mode=Mode.NETNS.value, root=str(root),
                             shm=f"/dev/shm/meshlet-podmesh-{os.getpid()}")  # fmt: skip
        self.sup: Supervisor | None = None
        self.manifests = ManifestsFolder(root / "manifests")
        self.control: dict[str, Process] = {}
        self._lock: int | None = None

    # -- building it ----------------------------------------------------------------------

    def up(self) -> None:
        try:
            self._take_lock()
            sweep()
            self._build()
        except BaseException:
            self.down()
            raise

    def _take_lock(self, within: float = 120.0) -> None:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + within
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = fd
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise MeshError(f"another mesh held {LOCK} for {within:g}s") from None
                time.sleep(0.2)

    def _build(self) -> None:
        root, layout = self.root, self.layout
        root.mkdir(parents=True, exist_ok=True)
        self.manifests.root.mkdir(exist_ok=True)
        anchors_pem = write_ca(root / "ca")
        (root / "tokens.yaml").write_text(self.tokens_file())
        for name, spec in self.specs.items():
            if spec.meshed:
                self.manifests.put(f"pod-{name}", self.pod_manifest(name))
        members = network.members(layout, NAMES)
        self.record.netns = [m.netns for m in members]
        self.sup = Supervisor(self.record)
        network.apply(network.plan(layout, NAMES))
        if self.ipv6:  # `nodad`: usable at once, without duplicate address detection
            network.apply([("ip", "-n", self.netns(name), "addr", "add", f"{self.ip6(name)}/64",
                            "dev", "eth0", "nodad") for name in self.specs])  # fmt: skip
        self._start_control_plane()
        self._start_pods(anchors_pem)

    def tokens_file(self) -> str:
        """The identity service's tokens file (the demo's, with each pod's own namespace)."""
        return "".join(
            topology.tokens_file(Layout(Mode.NETNS, (s.pod,), "", "", 0)).replace(
                f"namespace: {NS},", f"namespace: {s.namespace},"
            )
            for s in self.specs.values()
            if s.meshed
        )

    def _start_control_plane(self) -> None:
        assert self.sup is not None
        ip = self.layout.control_ip
        argv = run.controller_argv(ip, self.root, cluster_networks=self.cluster_networks)
        netns = NAMES.netns_prefix + "control"
        for name, _ in CONTROL_PLANE:
            log = self.sup.logs / f"{name}.log"
            self.control[name] = Process(name, argv[name], {}, netns, None, log)
            self.sup.restart(name, self.control[name])
        for name, admin in CONTROL_PLANE:
            self._wait_ready(name, f"http://{ip}:{admin}/ready")

    def _start_pods(self, anchors_pem: str) -> None:
        sup = self.sup
        assert sup is not None
        shm = Path(self.record.shm)
        shm.mkdir(mode=0o700, exist_ok=True)
        for name, spec in self.specs.items():
            if not spec.meshed:
                continue
            netns = self.netns(name)
            try:
                sup.run_once(f"init-{name}", [*command("meshlet-init"), "--proxy-gid",
                                              str(wellknown.PROXY_GID)], netns=netns)  # fmt: skip
            except Exception as exc:
                raise MeshError(str(exc)) from None
            token = self.root / f"token-{name}"
            token.write_text(spec.pod.token)
            (shm / name).mkdir(mode=0o700)
            env = self.proxy_env(spec, str(token), str(shm / name), anchors_pem)
            sup.start(f"proxy-{name}", command("meshlet-proxy"), env=env, netns=netns,
                      gid=wellknown.PROXY_GID)  # fmt: skip
            if spec.app:
                host = ["--host", ""] if self.ipv6 else []  # "": both families
                sup.start(f"app-{name}", [sys.executable, "-m", "meshlet_testing.podapp",
                                          "--pod", name, *host],
                          env={"PYTHONPATH": str(TESTING)}, netns=netns)  # fmt: skip
        for name, spec in self.specs.items():
            if spec.meshed:
                self._wait_ready(f"proxy-{name}", f"{self.layout.admin(spec.pod)}/ready")
            for port in spec.policy_ports:  # the controller has answered for each port
                self.wait_log(f"proxy-{name}", rf"port {port}: policy ", since=0)
            if spec.app:
                self.wait_log(f"app-{name}", "^ready$", since=0)

    def proxy_env(
        self, spec: PodSpec, token_file: str, identity_dir: str, anchors_pem: str
    ) -> dict[str, str]:
        """The demo's proxy environment, and for a pod with policy ports the policy
        controller's address and the ports it watches, as the injector writes them."""
        env = topology.proxy_env(self.layout, spec.pod, token_file=token_file,
                                 identity_dir=identity_dir, anchors_pem=anchors_pem)  # fmt: skip
        p = wellknown.PROXY_ENV_PREFIX
        opaque = set(wellknown.DEFAULT_OPAQUE_PORTS) | set(spec.opaque_ports)
        env[f"{p}INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION"] = ",".join(map(str, sorted(opaque)))
        env[f"{p}LOG"] = "info"
        if self.ipv6:  # as the injector writes them
            for direction, any_, port in (("INBOUND", "0.0.0.0,[::]", wellknown.PROXY_INBOUND_PORT),
                                          ("OUTBOUND", "127.0.0.1,[::1]",
                                           wellknown.PROXY_OUTBOUND_PORT)):  # fmt: skip
                env.pop(f"{p}{direction}_LISTEN_ADDR", None)
                env[f"{p}{direction}_LISTEN_ADDRS"] = ",".join(
                    f"{host}:{port}" for host in any_.split(",")
                )
        env[f"{p}IDENTITY_LOCAL_NAME"] = spec.identity
        context = {"ns": spec.namespace, "nodeName": "local", "pod": spec.pod.name}
        env[f"{p}DESTINATION_CONTEXT"] = json.dumps(context, separators=(",", ":"))
        if spec.policy_ports:
            env.update({
                f"{p}POLICY_SVC_ADDR": f"{self.layout.control_ip}:{wellknown.POLICY_PORT}",
                f"{p}POLICY_SVC_NAME": wellknown.POLICY_SERVICE_NAME,
                f"{p}POLICY_WORKLOAD": json.dumps({"ns": spec.namespace, "pod": spec.pod.name}),
                f"{p}POLICY_CLUSTER_NETWORKS": self.cluster_networks,
                f"{p}INBOUND_DEFAULT_POLICY": "deny",  # until the controller answers
                f"{p}INBOUND_PORTS": ",".join(map(str, spec.policy_ports)),
            })  # fmt: skip
        return env

    def pod_manifest(self, name: str) -> dict[str, Any]:
        spec = self.specs[name]
        annotations = dict(self.annotations.get(name, {}))
        if spec.opaque_ports:
            annotations[wellknown.OPAQUE_PORTS_ANNOTATION] = ",".join(map(str, spec.opaque_ports))
        ports = [(f"p{port}", port) for port in spec.policy_ports]
        pod = objects.pod(
            name, spec.pod.ip, spec.namespace, app=spec.pod.workload, sa=spec.pod.workload,
            annotations=annotations, container_ports=ports,
            owner=("ReplicaSet", f"{spec.pod.workload}-1"),
        )  # fmt: skip
        if self.ipv6:
            pod["status"]["podIPs"] = [{"ip": spec.pod.ip}, {"ip": self.ip6(name)}]
        return pod

    def _wait_ready(self, name: str, url: str) -> None:
        assert self.sup is not None
        try:
            self.sup.wait_ready(name, url, READY_WITHIN)
        except Exception as exc:
            raise MeshError(str(exc)) from None

    # -- taking it down -------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stops every process, removes the namespaces, the bridge and the files; the
        problems met (none, normally)."""
        problems: list[str] = []
        if self.sup is not None:
            self.sup.stop_all(grace=3.0)
        strays = [pid for ns in self.record.netns for pid in network.pids_in(ns)]
        stop_pids(strays, grace=2.0, group=False)
        if self.record.netns or network.link_exists(NAMES.bridge):
            problems += network.undo(network.teardown(self.record.netns, NAMES.bridge), [])
        shutil.rmtree(self.record.shm, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None
        return problems

    # -- what tests do --------------------------------------------------------------------

    def netns(self, pod: str) -> str:
        return NAMES.netns_prefix + pod

    def ip6(self, pod: str) -> str:
        """The pod's IPv6 address (with `ipv6`): fd00:78:: and the two last bytes of its IPv4."""
        *_, third, fourth = (int(b) for b in self.specs[pod].pod.ip.split("."))
        return f"fd00:78::{third * 256 + fourth:x}"

    def ip(self, pod: str) -> str:
        return self.specs[pod].pod.ip

    def annotate(self, pod: str, annotations: Mapping[str, str]) -> None:
        """Replaces the pod's annotations (in the manifests the controllers read)."""
        self.annotations[pod] = dict(annotations)
        self.manifests.put(f"pod-{pod}", self.pod_manifest(pod))

    def log(self, process: str) -> Path:
        assert self.sup is not None
        return self.sup.logs / f"{process}.log"

    def log_size(self, process: str) -> int:
        try:
            return self.log(process).stat().st_size
        except FileNotFoundError:
            return 0

    def wait_log(self, process: str, pattern: str, *, since: int, within: float = 10.0) -> str:
        """The first line matching `pattern` written to the process's log after byte
        `since`, waiting up to `within` seconds; MeshError with the log's end otherwise."""
        deadline = time.monotonic() + within
        regex = re.compile(pattern)
        while True:
            with self.log(process).open("rb") as f:
                f.seek(since)
                for line in f.read().decode(errors="replace").splitlines():
                    if regex.search(line):
                        return line
            assert self.sup is not None
            if not self.sup.alive(process) or time.monotonic() > deadline:
                tail = self.log(process).read_text(errors="replace")[-3000:]
                raise MeshError(
                    f"{process}: no line matching {pattern!r} within {within:g}s; its log ends:"
                    f"\n{tail}"
                )
            time.sleep(0.02)

    def run(self, pod: str, *argv: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        """`argv` in the pod's namespace (as the pod's app would run it: not the proxy's
        GID, so a meshed pod's connections go through its proxy)."""
        full = ["ip", "netns", "exec", self.netns(pod), *argv]
        return subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)

    def curl(self, pod: str, url: str, *options: str) -> Curl:
        """One request by curl from the pod."""
        done = self.run(pod, "curl", "-sS", "--max-time", "5", "-D", "-", *options, url)
        return _curl(done.stdout, done.returncode)

    def curl_codes(self, pod: str, url: str, count: int, *options: str) -> list[int]:
        """`count` requests by one curl (one connection, one after the other): each status."""
        urls = [arg for _ in range(count) for arg in ("-o", "/dev/null", url)]
        done = self.run(pod, "curl", "-s", "--max-time", "10", "-w", "%{http_code}\\n",
                        *options, *urls)  # fmt: skip
        return [int(code) for code in done.stdout.split()]

    def grpc(self, pod: str, target: str, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """One unary call by grpcio from the pod: {"code": status name, "details", "body"}."""
        done = self.run(pod, sys.executable, "-c", _GRPC_CALL, target, json.dumps(metadata))
        if done.returncode != 0:
            raise AssertionError(f"the gRPC client failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    def tcp(self, pod: str, host: str, port: int, send: str = "") -> Any:
        """A TCP connection from the pod: sends `send`, half-closes, reads until the server
        closes: {"received": text, "error": exception name or None}."""
        done = self.run(pod, sys.executable, "-c", _TCP_CALL, host, str(port), send)
        if done.returncode != 0:
            raise AssertionError(f"the TCP client failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    def metrics(self, pod: str) -> Series:
        """The pod's proxy's metrics (its admin port, reached from the host over the bridge)."""
        import urllib.request

        url = f"{self.layout.admin(self.specs[pod].pod)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return parse(response.read().decode())

    def kill(self, process: str) -> None:
        """SIGKILL, as a crash ends it."""
        assert self.sup is not None
        self.sup.kill(process)

    def start_again(self, process: str) -> None:
        """Starts a control-plane process killed by `kill`, until it is ready."""
        assert self.sup is not None
        self.sup.restart(process, self.control[process])
        admin = dict(CONTROL_PLANE)[process]
        self._wait_ready(process, f"http://{self.layout.control_ip}:{admin}/ready")


def metric(series: Series, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, have), v in series.items() if n == name and want <= have)


def write_ca(folder: Path) -> str:
    """The demo's PKI, with serving certificates for the destination and policy controllers
    (a day long); the anchors' PEM."""
    return run.write_ca(folder, run.SERVING[:2], dt.timedelta(days=1))


def sweep() -> None:
    """Removes what a mesh that died (killed with its test run) left: the processes in its
    namespaces, the namespaces, the bridge."""
    left = network.existing_netns(NAMES.netns_prefix)
    stop_pids([pid for ns in left for pid in network.pids_in(ns)], grace=2.0, group=False)
    if left or network.link_exists(NAMES.bridge):
        network.undo(network.teardown(left, NAMES.bridge), [])


@contextlib.contextmanager
def running(mesh: PodMesh) -> Iterator[PodMesh]:
    """The mesh, up for the block, down after it (whatever happened); a problem taking it
    down fails the block."""
    mesh.up()
    try:
        yield mesh
    finally:
        problems = mesh.down()
        left = network.existing_netns(NAMES.netns_prefix)
        if left or network.link_exists(NAMES.bridge):
            problems.append(f"left behind: {left} and the bridge {NAMES.bridge}")
        if problems:
            raise MeshError("taking the mesh down: " + "; ".join(problems))


def _curl(output: str, exit_code: int) -> Curl:
    """curl's `-D -` output (line ends made `\\n` by the text mode) as a `Curl`."""
    head, _, body = output.partition("\n\n")
    lines = head.splitlines()
    status = 0
    if lines and lines[0].startswith("HTTP/"):
        status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Curl(status, headers, body, exit_code)


_GRPC_CALL = """
import json, sys, grpc
target, metadata = sys.argv[1], tuple(map(tuple, json.loads(sys.argv[2])))
with grpc.insecure_channel(target) as channel:
    call = channel.unary_unary("/meshlet.test.Echo/Unary")
    try:
        body = call(b"hi", timeout=5, metadata=metadata or None)
        print(json.dumps({"code": "OK", "details": "", "body": body.decode()}))
    except grpc.RpcError as exc:
        print(json.dumps({"code": exc.code().name, "details": exc.details(), "body": ""}))
"""

_TCP_CALL = """
import json, socket, sys
host, port, send = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
data, error = b"", None
try:
    with socket.create_connection((host, port), timeout=5) as s:
        if send:
            s.sendall(send)
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(65536):
            data += chunk
except OSError as exc:
    error = type(exc).__name__
print(json.dumps({"received": data.decode(errors="replace"), "error": error}))
"""
