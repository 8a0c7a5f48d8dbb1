"""The demo's cluster as data (pure): its pods, addresses, services, manifests and the environment
of every process it starts.

Two layouts. In **netns** mode every pod is a network namespace on a bridge with its own IP, and
apps call each other by service name: each pod's /etc/hosts (`ip netns exec` mounts
/etc/netns/<ns>/hosts over it) maps the names to the services' cluster IPs, which exist nowhere:
the pod's iptables rules send the connection to its proxy, which finds the service from the
original destination, as in a cluster where kube-proxy never sees meshed traffic. Cluster IPs
rather than pod IPs in /etc/hosts because that is what makes the proxy's discovery and balancing
visible: the app names one address, the proxy picks a replica per request.

In **loopback** mode (no root, or no network namespaces) pods are addresses on 127.0.0.0/8 and
apps send their calls to their own proxy's outbound listener with the service name as authority;
nothing intercepts traffic, so the store (opaque TCP, which carries no authority) is called
directly, outside the mesh.

Outbound policy: api's calls follow an HTTPRoute whose parent is the api Service and whose
backends are api (weight 90) and api-v2 (weight 10), a second version with its own Service and
pod: the canary. The api Service's annotations give every route of it a request timeout of 1 s,
up to two retries of a reset call, and failure accrual (a replica failing 7 calls in a row leaves
the callers' balancers until a probe, after 1 s doubling up to 5 s, succeeds). An HTTPRoute reads
only the HTTP retry annotations, so an INTERNAL (which comes with HTTP status 200) is not
retried: the failing-replica drill's errors reach the client until the breaker ejects the
replica. api has no ServiceProfile: while a profile with routes exists for a Service, the
proxies use it and ignore the Service's routes and annotations.

Authorization: the store's port is a `Server` whose `AuthorizationPolicy` admits only web's
identity (a `MeshTLSAuthentication` naming web's ServiceAccount). Every other port has the
default policy, `all-unauthenticated`, as a cluster installed with defaults would.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.api.hostport import HostPort
from meshlet.controlplane.k8s import objects

NAMESPACE: Final = "demo"
CLUSTER_DOMAIN: Final = wellknown.CLUSTER_DOMAIN
API_PORT: Final = 9090
WEB_PORT: Final = 8080
WEB_SERVICE_PORT: Final = 80
STORE_PORT: Final = 7000  # opaque by the pods' annotation: the store speaks first
API_METHOD: Final = "/demo.Api/Quote"
SLOW_REPLICA: Final = "api-3"
SLOW_DELAY: Final = 0.05  # seconds the slow replica adds to every call
CANARY: Final = "api-v2"  # the canary's Service and workload
API_ROUTE: Final = "api-split"  # the HTTPRoute splitting api's calls between api and the canary
CANARY_WEIGHTS: Final = (90, 10)  # api's weight, the canary's
# The api Service's outbound policy (Linkerd 2.16's annotations, meshlet's prefix).
API_ANNOTATIONS: Final = {
    wellknown.TIMEOUT_REQUEST_ANNOTATION: "1s",
    wellknown.RETRY_LIMIT_ANNOTATION: "2",
    wellknown.FAILURE_ACCRUAL_ANNOTATION: "consecutive",
    wellknown.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION: "5s",
}
FAULTS_DIR: Final = (
    "faults"  # in the state folder: an api pod fails every call while <pod>.fail exists
)
BRIDGE: Final = "meshlet0"
NETNS_PREFIX: Final = "meshlet-"
VETH_PREFIX: Final = "mlv-"
DEFAULT_NAME: Final = "demo"  # the local mesh `meshlet demo` builds unless named otherwise
SLOTS: Final = 16  # places for local meshes on one machine: the default's 0, named ones 1-15
NAME_MAX: Final = 20
DEFAULT_POLICY: Final = "all-unauthenticated"
STORE_SERVER: Final = "store"  # the Server, MeshTLSAuthentication and AuthorizationPolicy's name
STORE_CLIENTS: Final = ("web",)  # the only ServiceAccounts store admits


class Mode(enum.Enum):
    NETNS = "netns"
    LOOPBACK = "loopback"
    CLUSTER = "cluster"  # a real Kubernetes: the pods are the cluster's, found as they come


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    cluster_ip: str
    port: int
    target_port: int
    opaque: bool = False

    @property
    def fqdn(self) -> str:
        return f"{self.name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"

    @property
    def authority(self) -> str:
        return f"{self.fqdn}:{self.port}"


@dataclass(frozen=True, slots=True)
class Pod:
    name: str  # api-1
    workload: str  # api: its Deployment, ServiceAccount and app label
    ip: str
    app: str  # which demo app runs in it: web, api (also the canary's), store, load

    @property
    def identity(self) -> str:
        return wellknown.identity_name(self.workload, NAMESPACE)

    @property
    def token(self) -> str:
        return f"token-{self.name}"


SERVICES: Final = (
    Service("web", "10.96.77.10", WEB_SERVICE_PORT, WEB_PORT),
    Service("api", "10.96.77.11", API_PORT, API_PORT),
    Service("store", "10.96.77.12", STORE_PORT, STORE_PORT, opaque=True),
    Service(CANARY, "10.96.77.13", API_PORT, API_PORT),
)
_PODS: Final = (  # (name, workload, app, host part of the address)
    ("web-1", "web", "web", 10),
    ("api-1", "api", "api", 21),
    ("api-2", "api", "api", 22),
    ("api-3", "api", "api", 23),
    ("api-v2-1", CANARY, "api", 24),
    ("store-1", "store", "store", 30),
    ("load-1", "load", "load", 40),
)


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a local mesh (it names a folder and a lock file), or None."""
    if re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) is None or len(name) > NAME_MAX:
        return (
            f"{name!r}: a local mesh's name is up to {NAME_MAX} lower-case letters, digits"
            " and '-', starting and ending with a letter or digit"
        )
    return None


@dataclass(frozen=True, slots=True)
class Place:
    """Where one local mesh lives on the machine, so that several run side by side: its name
    (its state folder's) and its slot, which gives it its addresses and the names of its
    bridge, namespaces and veths. Slot 0 is the default mesh's (`meshlet demo`): the bridge
    meshlet0, namespaces meshlet-<pod>, veths mlv-<pod>, 10.77.0.0/20 or 127.0.77.0/24. Slot n
    (1-15): meshlet<n>, meshlet<n>-<pod>, mlv<n>-<pod>, 10.77.<16n>.0/20 or 127.<n>.77.0/24.
    Every mesh's processes listen on its own addresses, so the ports are the same in each."""

    name: str = DEFAULT_NAME
    slot: int = 0

    def __post_init__(self) -> None:
        problem = name_problem(self.name)
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= self.slot < SLOTS:
            raise ValueError(f"slot {self.slot}: a local mesh's slot is 0 to {SLOTS - 1}")

    @property
    def default(self) -> bool:
        return self.name == DEFAULT_NAME

    @property
    def bridge(self) -> str:
        return f"meshlet{self.slot}"

    @property
    def netns_prefix(self) -> str:
        return NETNS_PREFIX if self.slot == 0 else f"meshlet{self.slot}-"

    @property
    def veth_prefix(self) -> str:
        return VETH_PREFIX if self.slot == 0 else f"mlv{self.slot}-"


DEFAULT_PLACE: Final = Place()


@dataclass(frozen=True, slots=True)
class Layout:
    mode: Mode
    pods: tuple[Pod, ...]
    control_ip: str  # where destination and identity listen
    host_ip: str  # the bridge's address in netns mode (what scrapes the pods), else control_ip
    prefix: int  # the pods' subnet length
    place: Place = DEFAULT_PLACE

    def netns(self, member: str) -> str:
        """`web-1` → `meshlet-web-1` (the default mesh's); `control` for the control plane's
        namespace."""
        return self.place.netns_prefix + member

    def pod(self, name: str) -> Pod:
        return next(pod for pod in self.pods if pod.name == name)

    def of(self, workload: str) -> tuple[Pod, ...]:
        return tuple(pod for pod in self.pods if pod.workload == workload)

    @property
    def destination(self) -> HostPort:
        return HostPort(self.control_ip, wellknown.DESTINATION_PORT)

    @property
    def identity(self) -> HostPort:
        return HostPort(self.control_ip, wellknown.IDENTITY_PORT)

    @property
    def policy(self) -> HostPort:
        return HostPort(self.control_ip, wellknown.POLICY_PORT)

    @property
    def cluster_network(self) -> str:
        """The pods' and the control plane's subnet, as a CIDR: the `cluster-*` policies'
        networks."""
        return str(ipaddress.ip_network(f"{self.control_ip}/{self.prefix}", strict=False))

    def admin(self, pod: Pod) -> str:
        return f"http://{pod.ip}:{wellknown.PROXY_ADMIN_PORT}"


def layout(mode: Mode, place: Place = DEFAULT_PLACE) -> Layout:
    if mode is Mode.CLUSTER:  # no pods until the cluster lists them
        return Layout(mode, (), control_ip="", host_ip="", prefix=32)
    if mode is Mode.NETNS:
        base = 16 * place.slot  # the third octet of the mesh's /20
        pods = tuple(Pod(n, w, f"10.77.{base + 1}.{host}", app) for n, w, app, host in _PODS)
        return Layout(mode, pods, control_ip=f"10.77.{base}.2", host_ip=f"10.77.{base}.1",
                      prefix=20, place=place)  # fmt: skip
    net = f"127.{place.slot}.77"
    pods = tuple(Pod(n, w, f"{net}.{host}", app) for n, w, app, host in _PODS)
    return Layout(mode, pods, control_ip=f"{net}.1", host_ip=f"{net}.1", prefix=8, place=place)


def service(name: str) -> Service:
    return next(s for s in SERVICES if s.name == name)


def app_port(pod: Pod) -> int | None:
    """The port the pod's app serves (the container port the injector would read); None for
    the load generator, which serves nothing."""
    return {"web": WEB_PORT, "api": API_PORT, "store": STORE_PORT}.get(pod.app)


def hosts_file(layout: Layout) -> str:
    """A pod's /etc/hosts in netns mode: the services' names resolve to their cluster IPs."""
    lines = ["127.0.0.1 localhost"]
    for svc in SERVICES:
        lines.append(f"{svc.cluster_ip} {svc.fqdn} {svc.name}.{NAMESPACE} {svc.name}")
    return "\n".join(lines) + "\n"


# -- manifests: what the destination service reads -----------------------------------------


def manifests_static() -> dict[str, list[dict[str, Any]]]:
    """The Services, api's HTTPRoute and the store's policy (file name → objects)."""
    files: dict[str, list[dict[str, Any]]] = {}
    for svc in SERVICES:
        annotations = {wellknown.OPAQUE_PORTS_ANNOTATION: str(svc.port)} if svc.opaque else {}
        if svc.name == "api":
            annotations = dict(API_ANNOTATIONS)
        files[f"service-{svc.name}"] = [
            objects.service(
                svc.name, NAMESPACE, ports=[(f"{svc.name}", svc.port, svc.target_port)],
                cluster_ip=svc.cluster_ip, annotations=annotations,
            )
        ]  # fmt: skip
    files[ROUTE_FILE] = [api_route(*CANARY_WEIGHTS)]
    files["policy-store"] = store_policy()
    return files


ROUTE_FILE: Final = "route-api"  # the manifests file holding api's HTTPRoute


def api_route(api: int, canary: int) -> dict[str, Any]:
    """api's HTTPRoute (gateway.networking.k8s.io v1): every call to the api Service goes to
    api or to the canary at random, by the weights given."""
    if min(api, canary) < 0 or api + canary == 0:
        raise ValueError(f"weights {api}/{canary}: each must be 0 or more, and not both 0")
    port = service("api").port
    backends = [{"name": name, "port": port, "weight": weight}
                for name, weight in (("api", api), (CANARY, canary))]  # fmt: skip
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": API_ROUTE, "namespace": NAMESPACE},
        "spec": {
            "parentRefs": [{"group": "core", "kind": "Service", "name": "api", "port": port}],
            "rules": [{"backendRefs": backends}],
        },
    }


def store_policy() -> list[dict[str, Any]]:
    """store's port admits only web's identity (opaque: the store speaks first)."""
    return admit_only(STORE_SERVER, NAMESPACE, "store", STORE_PORT, "opaque", STORE_CLIENTS)


def admit_only(
    name: str,
    namespace: str,
    app: str,
    port: int,
    protocol: str,
    service_accounts: Sequence[str],
) -> list[dict[str, Any]]:
    """The port `port` of the pods labelled app=`app` admits only `service_accounts`'
    identities: a Server for the port (its `proxyProtocol` `protocol`), the clients as a
    MeshTLSAuthentication, and the AuthorizationPolicy joining them, all called `name`. The
    Server's own access policy is `deny`, so a client the policy does not name is refused
    whatever the default policy."""
    group = wellknown.POLICY_API_GROUP

    def resource(version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{group}/{version}",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }

    return [
        resource("v1beta3", "Server", {
            "podSelector": {"matchLabels": {"app": app}},
            "port": port,
            "proxyProtocol": protocol,
            "accessPolicy": "deny",
        }),
        resource("v1alpha1", "MeshTLSAuthentication", {
            "identityRefs": [{"kind": "ServiceAccount", "name": sa} for sa in service_accounts],
        }),
        resource("v1alpha1", "AuthorizationPolicy", {
            "targetRef": {"group": group, "kind": "Server", "name": name},
            "requiredAuthenticationRefs": [
                {"group": group, "kind": "MeshTLSAuthentication", "name": name}
            ],
        }),
    ]  # fmt: skip


def pod_manifest(pod: Pod) -> dict[str, Any]:
    """The Pod as the API server would report it once running and ready (written when its
    proxy is ready, so that it joins its service's endpoints then, as a readiness probe does)."""
    annotations = {}
    if pod.workload == "store":
        annotations[wellknown.OPAQUE_PORTS_ANNOTATION] = str(STORE_PORT)
    port = app_port(pod)
    return objects.pod(
        pod.name, pod.ip, NAMESPACE, app=pod.workload, sa=pod.workload,
        annotations=annotations, owner=("ReplicaSet", f"{pod.workload}-{objects.TEMPLATE_HASH}"),
        container_ports=[(pod.app, port)] if port is not None else [],
    )  # fmt: skip


def tokens_file(layout: Layout) -> str:
    """The identity service's tokens file: each pod's token names its ServiceAccount."""
    return "".join(
        f"{pod.token}: {{namespace: {NAMESPACE}, serviceaccount: {pod.workload}}}\n"
        for pod in layout.pods
    )


# -- the environment of each process ----------------------------------------------------------


def proxy_env(
    layout: Layout,
    pod: Pod,
    *,
    token_file: str,
    identity_dir: str,
    anchors_pem: str,
    anchors_file: str | None = None,
    namespace: str = NAMESPACE,
    ports: tuple[int, ...] | None = None,
    opaque_ports: tuple[int, ...] | None = None,
) -> dict[str, str]:
    """Everything `meshlet-proxy` reads, as the injector would write it for this pod; with
    `anchors_file`, the bundle the proxy follows (the one the identity service reads). The
    pod's Kubernetes namespace, its containers' ports and its opaque ports are the demo's
    unless given."""
    p = wellknown.PROXY_ENV_PREFIX
    netns = layout.mode is Mode.NETNS
    bind = "0.0.0.0" if netns else pod.ip
    opaque = set(wellknown.DEFAULT_OPAQUE_PORTS)
    if opaque_ports is not None:
        opaque.update(opaque_ports)
    elif pod.workload == "store":
        opaque.add(STORE_PORT)
    context = {"ns": namespace, "nodeName": "local", "pod": pod.name}
    workload = {"ns": namespace, "pod": pod.name}
    if ports is None:
        port = app_port(pod)
        ports = (port,) if port is not None else ()
    policy = {  # the injector writes INBOUND_PORTS only for a pod with ports
        f"{p}POLICY_SVC_ADDR": str(layout.policy),
        f"{p}POLICY_SVC_NAME": wellknown.POLICY_SERVICE_NAME,
        f"{p}POLICY_WORKLOAD": json.dumps(workload, separators=(",", ":")),
        f"{p}POLICY_CLUSTER_NETWORKS": layout.cluster_network,
        f"{p}INBOUND_DEFAULT_POLICY": DEFAULT_POLICY,
        **({f"{p}INBOUND_PORTS": ",".join(map(str, ports))} if ports else {}),
    }
    return {
        f"{p}INBOUND_LISTEN_ADDR": f"{bind}:{wellknown.PROXY_INBOUND_PORT}",
        f"{p}OUTBOUND_LISTEN_ADDR": f"{'127.0.0.1' if netns else pod.ip}:"
        f"{wellknown.PROXY_OUTBOUND_PORT}",
        f"{p}ADMIN_LISTEN_ADDR": f"{bind}:{wellknown.PROXY_ADMIN_PORT}",
        f"{p}CONTROL_LISTEN_ADDR": f"{bind}:{wellknown.PROXY_CONTROL_PORT}",
        f"{p}DESTINATION_SVC_ADDR": str(layout.destination),
        f"{p}DESTINATION_SVC_NAME": wellknown.DESTINATION_SERVICE_NAME,
        f"{p}DESTINATION_CONTEXT": json.dumps(context, separators=(",", ":")),
        f"{p}IDENTITY_SVC_ADDR": str(layout.identity),
        f"{p}IDENTITY_SVC_NAME": wellknown.IDENTITY_SERVICE_NAME,
        f"{p}IDENTITY_LOCAL_NAME": wellknown.identity_name(pod.workload, namespace),
        f"{p}IDENTITY_TOKEN_FILE": token_file,
        f"{p}IDENTITY_TRUST_ANCHORS": anchors_pem,
        **({f"{p}IDENTITY_TRUST_ANCHORS_FILE": anchors_file} if anchors_file else {}),
        f"{p}IDENTITY_DIR": identity_dir,
        **policy,
        f"{p}INBOUND_PORTS_DISABLE_PROTOCOL_DETECTION": ",".join(map(str, sorted(opaque))),
        f"{p}SHUTDOWN_GRACE_PERIOD": "2s",
        f"{p}LOG": "info",
        # Pods share the host's loopback: connections to a peer come from the pod's address,
        # not the 127.0.0.1 the kernel would pick for all of them.
        **({} if netns else {f"{p}OUTBOUND_MESH_SOURCE_IP": pod.ip}),
    }


def fault_flag(root: str, pod: Pod) -> str:
    """The file whose existence makes an api pod answer every call with INTERNAL."""
    return f"{root}/{FAULTS_DIR}/{pod.name}.fail"


def app_argv(layout: Layout, pod: Pod, *, rate: float, stats_file: str, root: str) -> list[str]:
    """`meshlet demo app …` for the pod's app (after the `meshlet` command itself); `root` is
    the state folder (an api pod's fault flag is in it)."""
    netns = layout.mode is Mode.NETNS
    listen_ip = "0.0.0.0" if netns else pod.ip
    via = [] if netns else ["--via-proxy", f"{pod.ip}:{wellknown.PROXY_OUTBOUND_PORT}"]
    web, api, store = service("web"), service("api"), service("store")
    if pod.app == "api":
        delay = SLOW_DELAY if pod.name == SLOW_REPLICA else 0.0
        return ["demo", "app", "api", "--listen", f"{listen_ip}:{API_PORT}", "--pod", pod.name,
                "--delay", str(delay), "--fail-flag", fault_flag(root, pod)]  # fmt: skip
    if pod.app == "store":
        return ["demo", "app", "store", "--listen", f"{listen_ip}:{STORE_PORT}",
                "--pod", pod.name]  # fmt: skip
    if pod.app == "web":
        # Loopback: the store is opaque TCP, which only iptables can send through the proxy.
        store_addr = store.authority if netns else f"{layout.of('store')[0].ip}:{STORE_PORT}"
        return ["demo", "app", "web", "--listen", f"{listen_ip}:{WEB_PORT}", "--pod", pod.name,
                "--api", api.authority, "--store", store_addr, *via]  # fmt: skip
    return ["demo", "app", "load", "--target", web.authority, "--rate", str(rate),
            "--stats", stats_file, *via]  # fmt: skip
