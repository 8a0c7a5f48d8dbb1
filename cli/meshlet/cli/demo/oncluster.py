"""`meshlet demo --cluster`: the demo application on a real Kubernetes, with the local mesh's
live view and drills.

The control plane must be installed already (`meshlet install`); the demo applies its objects
(`kube.manifests`: namespace `demo`, annotated for injection) by server-side apply, the load
generator last, once every other Deployment is available. The view is the local demo's: every
second each meshed pod's proxy metrics are read through the API server's pod proxy (as `meshlet
viz stat` reads them), the load generator's own count by `kubectl exec`-style exec every
STATS_EVERY seconds, the control plane's Deployments' readiness. Pods get the local mesh's
names (api-1, api-2 for Deployment api's pods, api-3 for api-slow's, a replacement the next
number), so the drills speak of the same replicas; the view lists the real names below.

The drills act on the cluster as a user would: a replica killed is its pod deleted (its
Deployment makes another), a control-plane component killed is its pod deleted, a slow or
failing replica is a signal or a fault flag sent into its container, the canary's weights a new
HTTPRoute applied, the deny drill's intruder a client run inside api-1's app container (so its
connections leave through api-1's proxy, with api's identity). At the end the namespace is
deleted, unless --keep.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from rich.console import Console

from meshlet.api import wellknown
from meshlet.cli import scrape as kscrape
from meshlet.cli import workloads
from meshlet.cli.cluster import unreachable
from meshlet.cli.demo import drills, kube, topology
from meshlet.cli.demo.apps import SLOW_DRILL_DELAY
from meshlet.cli.demo.drills import Step
from meshlet.cli.demo.run import Demo, DemoError, Options
from meshlet.cli.demo.topology import Layout, Pod
from meshlet.cli.stats import Scrape, parse

NAMESPACE: Final = topology.NAMESPACE
FIELD_MANAGER: Final = "meshlet-demo"
READY_WITHIN: Final = 300.0  # seconds for the demo's Deployments to become available
DNS_WITHIN: Final = 90.0  # seconds for cluster DNS to give the demo's Services' addresses
BACK_WITHIN: Final = 180.0  # seconds a deleted control-plane pod's Deployment gets to be ready
# Seconds the proxies get to reopen their discovery streams once the new destination pod is
# ready. On a cluster the old pod's end likely decides it too: the proxies' streams stay on it
# until its destination stops them and its sidecar sends GOAWAY (typically 1 s after the new pod
# is ready; once more than 16 s, on a busy CI run whose new pod took 12 s to be ready).
RESUBSCRIBE_WITHIN: Final = 30.0
GONE_KEPT: Final = 20.0  # seconds a pod no longer listed stays in the view, marked gone
STATS_EVERY: Final = 2.0  # seconds between reads of the load generator's count
DELETED_WITHIN: Final = 180.0  # seconds `down` waits for the namespace to be gone
# The control plane's Deployments shown in the view (meshlet-<name>).
CONTROL: Final = ("identity", "destination", "policy", "tap", "proxy-injector")
INTRUDER_FILE: Final = "/tmp/intruder.json"
LOAD: Final = "load"


class ClusterDemo(Demo):
    def __init__(
        self,
        options: Options,
        console: Console,
        api: Any,
        control_ns: str = wellknown.CONTROL_PLANE_NAMESPACE,
        image: str | None = None,
    ) -> None:
        super().__init__(options, console)
        self.api = api
        self.control_ns = control_ns
        self.image = image
        self.scrapes = defaultdict(deque)
        self.notes = {}
        self.slow = {}
        self.alias: dict[str, str] = {}  # real pod name → its name in the view (api-1)
        self.real: dict[str, str] = {}  # and back
        self.numbers: dict[str, int] = defaultdict(int)  # workload → the last number given
        self.listed: dict[str, Mapping[str, Any]] = {}  # alias → the pod as last listed
        self.missing: dict[str, float] = {}  # alias → when it was first not listed
        self.restarts: dict[str, int] = {}  # alias → its containers' restarts
        self.control: list[tuple[str, str]] = [(name, "?") for name in CONTROL]
        self.stats: dict[str, Any] | None = None
        self.intruder: dict[str, Any] | None = None
        self._stats_read = 0.0
        self._stats_pending: Any = None
        self._exec_client: Any = None

    # -- bringing it up ---------------------------------------------------------------------

    def up(self) -> None:
        destination = self._deployment(self.control_ns, "meshlet-destination")
        if destination is None:
            raise DemoError(
                f"meshlet's control plane is not in namespace {self.control_ns} of this cluster;"
                " install it first: meshlet install --crds | kubectl apply -f - && meshlet"
                " install | kubectl apply -f -"
            )
        if self.image is None:  # the demo image beside the installed controller's
            controller = destination["spec"]["template"]["spec"]["containers"][0]["image"]
            self.image = controller.replace("/controller:", "/demo:")
        objs = kube.manifests(self.image, rate=self.options.rate)
        apps = [
            o for o in objs if not (o["kind"] == "Deployment" and o["metadata"]["name"] == LOAD)
        ]
        self.apply(apps)
        self._event(f"applied the demo to namespace {NAMESPACE} (image {self.image})")
        self._wait_available(time.monotonic() + READY_WITHIN)
        self._wait_dns(time.monotonic() + DNS_WITHIN)
        self.apply([o for o in objs if o not in apps])
        self._wait_available(time.monotonic() + READY_WITHIN)
        self._relist(self._list("pods", NAMESPACE))
        self.load_started = time.monotonic()
        self._event(f"load started: {self.options.rate:g} calls/s to web")

    def apply(self, objs: Sequence[Mapping[str, Any]]) -> None:
        """Server-side apply of each object, as `kubectl apply --server-side` does."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.dynamic import DynamicClient
        from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

        dynamic = DynamicClient(self.api)  # type: ignore[no-untyped-call]
        for obj in objs:
            what = f"{obj['kind']} {obj['metadata']['name']}"
            try:
                resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
                dynamic.server_side_apply(  # type: ignore[no-untyped-call]
                    resource, body=dict(obj), field_manager=FIELD_MANAGER, force_conflicts=True
                )
            except ResourceNotFoundError:
                raise DemoError(
                    f"the cluster does not know {obj['kind']} ({obj['apiVersion']}), needed for"
                    f" {what}: meshlet install --crds | kubectl apply -f - installs it"
                ) from None
            except (ApiException, DynamicApiError) as exc:
                raise DemoError(f"applying {what}: {kscrape.status_reason(exc)}") from None

    def _wait_dns(self, deadline: float) -> None:
        """Waits until the cluster's DNS, asked from web's pod, gives each demo Service's
        address. A demo run again soon after one whose namespace was deleted finds its Services
        at new addresses while cluster DNS still answers the old ones from its cache (30 s in
        kubeadm's and this repository's Corefile): a client connecting then would keep a
        connection to an address nothing serves."""
        from kubernetes import client as k8s

        services = {
            svc["metadata"]["name"]: svc["spec"].get("clusterIP", "")
            for svc in _raw(k8s.CoreV1Api(self.api).list_namespaced_service, NAMESPACE)["items"]
        }
        names = sorted(services)
        ask = (
            "import socket, sys; print(' '.join(socket.gethostbyname(n + '.' + sys.argv[1] +"
            " '.svc.cluster.local') for n in sys.argv[2:]))"
        )
        web = next(n for n in self.alias if n.startswith("web-")) if self.alias else None
        if web is None:
            self._relist(self._list("pods", NAMESPACE))
            web = next(n for n in self.alias if n.startswith("web-"))
        started, answers = time.monotonic(), []
        while True:
            try:
                answers = self.exec(web, "web", ["python3", "-c", ask, NAMESPACE, *names]).split()
            except Exception as exc:  # the exec itself failed: say so if it goes on
                answers = [f"({exc})"]
            if answers == [services[n] for n in names]:
                break
            if time.monotonic() > deadline:
                raise DemoError(
                    f"cluster DNS still answers {dict(zip(names, answers, strict=False))} for"
                    f" the demo's Services, at {services}, after {DNS_WITHIN:g} s"
                )
            time.sleep(2)
        waited = time.monotonic() - started
        if waited > 1:
            self._event(
                f"cluster DNS gave the Services' old addresses for {waited:.0f} s (its cache,"
                " after the last demo's namespace was deleted): waited"
            )

    def _wait_available(self, deadline: float) -> None:
        while True:
            deployments = self._list("deployments", NAMESPACE)
            waiting = [
                d["metadata"]["name"] for d in deployments
                if (d.get("status") or {}).get("availableReplicas", 0) < d["spec"]["replicas"]
            ]  # fmt: skip
            if deployments and not waiting:
                return
            if time.monotonic() > deadline:
                problems = [
                    why for pod in self._list("pods", NAMESPACE) if (why := _not_ready(pod))
                ]
                raise DemoError(
                    f"the demo's Deployments {', '.join(waiting)} were not available within"
                    f" {READY_WITHIN:g} s: "
                    + ("; ".join(problems) or "no pods")
                    + f". The demo image {self.image} must be on the node (make images, then"
                    " make cluster imports it; k3d image import on k3d); --image names another"
                )
            time.sleep(2)

    # -- reading the cluster ----------------------------------------------------------------

    def _list(self, kind: str, namespace: str) -> list[dict[str, Any]]:
        from kubernetes import client as k8s

        call = {
            "pods": k8s.CoreV1Api(self.api).list_namespaced_pod,
            "deployments": k8s.AppsV1Api(self.api).list_namespaced_deployment,
        }[kind]
        items: list[dict[str, Any]] = _raw(call, namespace)["items"]
        return items

    def _deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client as k8s

        try:
            found: dict[str, Any] = _raw(
                k8s.AppsV1Api(self.api).read_namespaced_deployment, name, namespace
            )
        except _Missing:
            return None
        return found

    def _relist(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """Names new pods, notes those gone, and makes the layout of the pods listed (and of
        those gone for less than GONE_KEPT seconds)."""
        now = time.monotonic()
        order = {name: i for i, name in enumerate(["api", *kube.API_DEPLOYMENTS])}

        def key(pod: Mapping[str, Any]) -> tuple[int, str, str]:
            meta = pod["metadata"]
            rank = order.get((meta.get("labels") or {}).get("deployment", ""), 9)
            return rank, meta.get("creationTimestamp", ""), meta["name"]

        seen = set()
        for pod in sorted(pods, key=key):
            real = pod["metadata"]["name"]
            labels = pod["metadata"].get("labels") or {}
            workload = labels.get("app", real)
            if real not in self.alias:
                self.numbers[workload] += 1
                name = f"{workload}-{self.numbers[workload]}"
                self.alias[real], self.real[name] = name, real
                if labels.get("deployment") == "api-slow":
                    self.slow[name] = topology.SLOW_DELAY * 1000
                    self.notes.setdefault(name, f"+{topology.SLOW_DELAY * 1000:.0f} ms")
                if self.load_started is not None:  # not one the demo started with
                    self._event(f"new pod {name} ({real})")
            name = self.alias[real]
            seen.add(name)
            self.listed[name] = pod
            self.missing.pop(name, None)
            self._note_restarts(name, pod)
        for name in list(self.listed):
            if name not in seen:
                self.missing.setdefault(name, now)
                if now - self.missing[name] > GONE_KEPT:
                    del self.listed[name]
        pods_now = tuple(_pod(n, p) for n, p in self.listed.items())
        self.layout = Layout(topology.Mode.CLUSTER, pods_now, control_ip="", host_ip="", prefix=32)

    def _note_restarts(self, name: str, pod: Mapping[str, Any]) -> None:
        status = pod.get("status") or {}
        containers = [*(status.get("initContainerStatuses") or []),
                      *(status.get("containerStatuses") or [])]  # fmt: skip
        total = sum(int(c.get("restartCount") or 0) for c in containers)
        before = self.restarts.setdefault(name, total)
        if total > before:
            self.restarts[name] = total
            self._event(f"{name}: a container restarted ({total} restarts in all)")

    def _scrape_pods(self) -> list[Scrape | None]:
        try:
            self._relist(self._list("pods", NAMESPACE))
            listed = self._list("deployments", self.control_ns)
        except Exception as exc:  # the API server restarting, the network: the view goes on
            self._event(f"cannot list the pods: {exc}")
            return []
        deployments = {d["metadata"]["name"]: d for d in listed}
        self.control = [
            (name, "up" if ((deployments.get(f"meshlet-{name}") or {}).get("status") or {})
             .get("readyReplicas") else "down")
            for name in CONTROL
        ]  # fmt: skip
        self._read_stats_now_and_then()
        meshed = [(name, workloads.pod_of(pod)) for name, pod in self.listed.items()
                  if name not in self.missing]  # fmt: skip

        def one(item: tuple[str, workloads.Pod]) -> Scrape | None:
            name, pod = item
            if not pod.meshed or pod.name == "" or not pod.running:
                return None
            got = kscrape.scrape(self.api, pod)
            if isinstance(got, kscrape.Failure):
                return None
            return Scrape(name, got.at, parse(got.text))

        return list(self._pool.map(one, meshed))

    def _watch_processes(self) -> None:
        """Nothing to watch here: the cluster restarts what dies (a restart is an event)."""

    # -- the load generator's count, read inside its pod ------------------------------------

    def exec(self, alias: str, container: str, argv: Sequence[str], timeout: float = 20) -> str:
        """`argv`'s output in the pod's container (as `kubectl exec`)."""
        from kubernetes import client as k8s
        from kubernetes.stream import stream

        if self._exec_client is None:  # the exec replaces its client's request: its own client
            self._exec_client = k8s.ApiClient(configuration=self.api.configuration)
        core = k8s.CoreV1Api(self._exec_client)
        out: str = stream(
            core.connect_get_namespaced_pod_exec, self.real.get(alias, alias), NAMESPACE,
            container=container, command=list(argv), stderr=True, stdin=False, stdout=True,
            tty=False, _request_timeout=timeout,
        )  # fmt: skip
        return out

    def _read_stats_now_and_then(self) -> None:
        pending = self._stats_pending
        if pending is not None and not pending.done():
            return
        if time.monotonic() - self._stats_read < STATS_EVERY:
            return
        load = next((n for n in self.listed if n.startswith(f"{LOAD}-")
                     and n not in self.missing), None)  # fmt: skip
        if load is None:
            return
        self._stats_read = time.monotonic()

        def read() -> None:
            try:
                text = self.exec(load, LOAD, ["cat", "/tmp/stats.json"], timeout=5)
                self.stats = json.loads(text)
            except Exception:  # not written yet, or the exec failed: the last count stays
                return

        self._stats_pending = self._pool.submit(read)

    def _load_stats(self) -> dict[str, Any] | None:
        """The load's count, its pods by the view's names."""
        stats = self.stats
        if stats is None:
            return None
        out = dict(stats)
        out["by_api"] = {self.alias.get(p, p): n for p, n in stats.get("by_api", {}).items()}
        out["recent"] = [[at, outcome, self.alias.get(pod, pod)]
                         for at, outcome, pod in stats.get("recent", [])]  # fmt: skip
        return out

    def intruder_stats(self) -> dict[str, Any] | None:
        return self.intruder

    def set_route(self, api: int, canary: int) -> None:
        self.apply([topology.api_route(api, canary)])

    # -- what is shown ----------------------------------------------------------------------

    def _where(self) -> str:
        return f"Kubernetes at {self.api.configuration.host}"

    def _control(self) -> list[tuple[str, str]]:
        return self.control

    def _footer(self) -> str:
        pods = " · ".join(f"{n} = {self.real[n]}" for n in sorted(self.listed) if n in self.real)
        end = (f"Ctrl-C stops the demo and deletes namespace {NAMESPACE}" if not self.options.keep
               else f"Ctrl-C stops the view; namespace {NAMESPACE} stays")  # fmt: skip
        return f"pods: {pods}\n{end}"

    # -- drills -----------------------------------------------------------------------------

    def _perform(self, step: Step) -> list[Step]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return perform(step, self)
        except (ApiException, DemoError, HTTPError, OSError, ValueError) as exc:
            self._event(f"drill step {step.action!r} failed: {str(exc).splitlines()[0]}")
            return []

    def delete_pods(self, namespace: str, names: Sequence[str]) -> None:
        from kubernetes import client as k8s

        core = k8s.CoreV1Api(self.api)
        for name in names:
            core.delete_namespaced_pod(name, namespace)

    def control_pods(self, component: str) -> list[str]:
        """The running pods of the control plane's Deployment meshlet-<component>."""
        deployment = self._deployment(self.control_ns, f"meshlet-{component}")
        if deployment is None:
            return []
        selector = deployment["spec"]["selector"].get("matchLabels") or {}
        return [
            p["metadata"]["name"] for p in self._list("pods", self.control_ns)
            if workloads.selects({"matchLabels": selector}, p["metadata"].get("labels") or {})
            and not p["metadata"].get("deletionTimestamp")
        ]  # fmt: skip

    def control_ready(self, component: str) -> bool:
        """Every replica of meshlet-<component> ready, none terminating."""
        deployment = self._deployment(self.control_ns, f"meshlet-{component}")
        if deployment is None:
            return False
        status = deployment.get("status") or {}
        want = deployment["spec"].get("replicas", 1)
        return bool(status.get("readyReplicas", 0) >= want and status.get("replicas", 0) == want
                    and status.get("updatedReplicas", 0) >= want)  # fmt: skip

    def destination_streams(self) -> float:
        """The Get/GetProfile streams the destination pods serve (their admin metrics)."""
        total = 0.0
        for name in self.control_pods("destination"):
            pod = workloads.Pod(self.control_ns, name, "Running", {}, False,
                                wellknown.DESTINATION_ADMIN_PORT)  # fmt: skip
            got = kscrape.scrape(self.api, pod)
            if isinstance(got, kscrape.Metrics):
                total += sum(v for (n, _), v in parse(got.text).items()
                             if n == "destination_streams_active")  # fmt: skip
        return total

    def _finish(self) -> dict[str, Any]:
        return finish(self)

    # -- taking it down ---------------------------------------------------------------------

    def keep(self) -> None:
        self._pool.shutdown(wait=False)
        self.console.print(
            f"[bold]The demo keeps running in namespace {NAMESPACE}[/bold]; `meshlet viz stat"
            f" deploy -n {NAMESPACE}` shows it, `meshlet demo down --cluster` deletes it."
        )

    def down(self) -> list[str]:
        self._pool.shutdown(wait=False)
        return delete_namespace(self.api)

    def keep_logs(self) -> Any:
        return None


def perform(step: Step, demo: ClusterDemo) -> list[Step]:
    """A drill step done to the cluster; the steps it leads to. Steps that only read or mark
    (weigh, watch, mark) are the local demo's own."""
    verb, _, what = step.action.partition(" ")
    checks = demo.checks
    if verb == "kill" and what in ("destination", "identity"):
        if what == "destination":
            checks["streams_before_kill"] = demo.destination_streams()
        pods = demo.control_pods(what)
        demo.delete_pods(demo.control_ns, pods)
        checks[f"{what}_killed_at"] = time.time()
        demo._event(f"drill: {what} killed (pod {', '.join(pods)} deleted)")
        return [Step(step.at + 2, f"start {what}")]  # its Deployment starts another: wait for it
    if verb == "start":  # on a cluster, the Deployment starts it: wait until it is ready
        killed = checks[f"{what}_killed_at"]
        if not demo.control_ready(what):
            if time.time() - killed < BACK_WITHIN:
                return [Step(step.at + 1, step.action)]
            demo._event(f"{what} not ready {BACK_WITHIN:g} s after its pod was deleted")
            return []
        if f"{what}_back_at" in checks:
            return []
        checks[f"{what}_back_at"] = time.time()
        checks[f"{what}_back_after_s"] = round(time.time() - killed, 1)
        demo._event(f"drill: {what} back, {time.time() - killed:.1f} s after its pod was deleted")
        if what == "destination":
            return [Step(step.at + 0.5, "await resubscribed")]
        return []
    if verb == "await":  # every proxy's discovery streams open again?
        waited = time.time() - checks["destination_back_at"]
        streams = demo.destination_streams()
        # the count at each look, for a run that waits long to be read
        checks.setdefault("streams_after_back", []).append((round(waited, 1), streams))
        if streams < checks["streams_before_kill"]:
            if waited < RESUBSCRIBE_WITHIN:
                return [Step(step.at + 1, step.action)]
            demo._event(f"proxies did not all reopen their streams within {waited:.0f}s")
        checks["resubscribed_after_s"] = round(waited, 1)
        demo._event(f"proxies resubscribed {waited:.1f}s after the destination came back")
        # an update the proxies only see if discovery resumed: api-1's pod replaced
        demo.delete_pods(NAMESPACE, [demo.real["api-1"]])
        demo.notes["api-1"] = "deleted (the update)"
        demo._event("api-1's pod deleted: its Deployment replaces it, discovery must tell")
        return [Step(step.at + drills.SETTLE, "mark after-update")]
    if verb == "kill":  # a replica
        checks["failed_before_kill"] = drills._failed(demo)
        demo.delete_pods(NAMESPACE, [demo.real[what]])
        demo.notes[what] = "killed (pod deleted)"
        demo._event(f"drill: {what} killed: pod {demo.real[what]} deleted")
        return []
    if verb == "remove":  # the endpoints controller takes a deleted pod out by itself
        return []
    if verb in ("slow", "heal"):
        signal = "SIGUSR1" if verb == "slow" else "SIGUSR2"
        demo.exec(what, "api", ["python3", "-c", f"import os, signal; os.kill(1, signal.{signal})"])
        if verb == "slow":
            demo.notes[what] = "+200 ms (drill)"
            demo.slow[what] = SLOW_DRILL_DELAY * 1000
            demo._event(f"drill: {what} 200 ms slower")
        else:
            demo.notes[what] = "healed"
            demo.slow.pop(what, None)
            demo._event(f"drill: {what} fast again")
        return []
    if verb == "intrude":
        seconds = max(1, round(_repair_at(demo) - step.at))
        argv = drills.intruder_argv(INTRUDER_FILE)[2:]  # after `meshlet demo app`
        command = ["timeout", "-s", "INT", str(seconds), "python3", "-m",
                   "meshlet.cli.demo.apps", *argv]  # fmt: skip
        demo.exec(what, "api", ["rm", "-f", INTRUDER_FILE])
        demo._pool.submit(demo.exec, what, "api", command, seconds + 30)
        demo.notes[what] = "+ intruder → store"
        demo._event(f"drill: a client in {what} (api's identity) calls store for {seconds} s")
        return []
    if verb == "leave":
        try:
            demo.intruder = json.loads(demo.exec(what, "api", ["cat", INTRUDER_FILE]))
        except ValueError:
            demo.intruder = None
        demo.notes[what] = ""
        demo._event(f"drill: the client in {what} stopped")
        return []
    if verb in ("fail", "repair"):
        argv = ["touch", kube.FAULT_FLAG] if verb == "fail" else ["rm", "-f", kube.FAULT_FLAG]
        demo.exec(what, "api", argv)
        checks["failing_at" if verb == "fail" else "repaired_at"] = time.time()
        demo.notes[what] = "answers INTERNAL (drill)" if verb == "fail" else "repaired"
        demo._event(f"drill: {what} answers every call with INTERNAL" if verb == "fail"
                    else f"drill: {what} answers normally again")  # fmt: skip
        return []
    return drills.perform(step, demo)


def _repair_at(demo: ClusterDemo) -> float:
    duration = demo.options.duration
    return 0.6 * duration if duration else 20.0


def finish(demo: ClusterDemo) -> dict[str, Any]:
    """What the drill measured: the local demo's account, less what a cluster cannot show
    (with the installed 24 h certificates, no renewal happens during a run)."""
    out = drills.finish(demo)
    if demo.options.drill == "restart-identity":
        out.pop("renewed_after_restart", None)
    if demo.options.drill == "kill-destination":  # api-1 was deleted: who answered after
        stats = demo._load_stats() or {}
        out["api_calls_by_pod_at_end"] = dict(stats.get("by_api", {}))
    return out


def delete_namespace(api: Any) -> list[str]:
    """Deletes the demo's namespace and waits until it is gone; what could not be done."""
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    core = k8s.CoreV1Api(api)
    try:
        core.delete_namespace(NAMESPACE, _request_timeout=10)
    except ApiException as exc:
        if exc.status == 404:
            return []
        return [f"namespace {NAMESPACE}: {kscrape.status_reason(exc)}"]
    except (HTTPError, OSError) as exc:
        return [f"namespace {NAMESPACE}: {unreachable(exc)}"]
    deadline = time.monotonic() + DELETED_WITHIN
    while time.monotonic() < deadline:
        try:
            core.read_namespace(NAMESPACE, _request_timeout=10)
        except ApiException as exc:
            if exc.status == 404:
                return []
        except (HTTPError, OSError):
            pass  # the API server restarting: ask again
        time.sleep(1)
    return [f"namespace {NAMESPACE} still terminating after {DELETED_WITHIN:g} s"]


class _Missing(DemoError):
    """The object read does not exist."""


def _raw(call: Callable[..., Any], *args: Any) -> Any:
    """`meshlet.cli.cluster.read_json`, its errors as the demo's: _Missing for a 404, a
    DemoError for any other failure."""
    from meshlet.cli.cluster import ClusterError, NotFound, read_json

    what = " ".join(str(a) for a in args) or call.__name__
    try:
        return read_json(what, call, *args)
    except NotFound as exc:
        raise _Missing(exc.message) from None
    except ClusterError as exc:
        raise DemoError(exc.message) from None


def _pod(name: str, pod: Mapping[str, Any]) -> Pod:
    labels = pod["metadata"].get("labels") or {}
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return Pod(name, labels.get("app", name), (pod.get("status") or {}).get("podIP") or "",
               containers[0].get("name", ""))  # fmt: skip


def _not_ready(pod: Mapping[str, Any]) -> str:
    """Why a pod is not ready ("" when it is): its containers' waiting reasons."""
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    if conditions.get("Ready") == "True":
        return ""
    reasons = []
    for c in [*(status.get("initContainerStatuses") or []),
              *(status.get("containerStatuses") or [])]:  # fmt: skip
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            message = f": {waiting['message']}" if waiting.get("message") else ""
            reasons.append(f"{c.get('name')} {waiting['reason']}{message}")
    name = pod["metadata"]["name"]
    return f"{name}: " + (", ".join(reasons) or status.get("phase", "Pending"))
