"""A single-node Kubernetes from upstream parts, on this machine, without Docker.

    python cluster/node.py up       # `make cluster`: build (cached), configure, start, wait
    python cluster/node.py down     # `make cluster-down`: stop and remove everything it made
    python cluster/node.py env      # the KUBECONFIG and PATH lines to use it from a shell
    python cluster/node.py status   # exits 0 when every process of the node runs
    python cluster/node.py import IMAGE...   # podman images into the node's containerd

The parts: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy
of one Kubernetes release and CoreDNS, built from their Go modules (cluster/build); Debian's
containerd, runc and CNI plugins (bridge, host-local, loopback, portmap); a pause image and a
CoreDNS image built here (podman). Every process runs on the host as root, with its state under
one folder (MESHLET_CLUSTER_DIR, default /var/lib/meshlet-cluster) and its log in `logs/`.
Addresses: the node's own (the default route's source), pods 10.42.0.0/24 on the bridge
`mlcni0`, Services 10.43.0.0/16, cluster DNS 10.43.0.10.

`down` leaves nothing: processes, mounts, the pods' network namespaces and interfaces, the
iptables rules and chains of kube-proxy and the CNI plugins, the pods' cgroups, the sysctls the
kubelet and kube-proxy set (restored to what `up` found), and the folder.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIR = Path(os.environ.get("MESHLET_CLUSTER_DIR", "/var/lib/meshlet-cluster"))
NODE = "meshlet-node"
POD_CIDR = "10.42.0.0/24"
CLUSTER_CIDR = "10.42.0.0/16"
SERVICE_CIDR = "10.43.0.0/16"
API_SERVICE_IP = "10.43.0.1"
DNS_IP = "10.43.0.10"
BRIDGE = "mlcni0"
API_PORT = 6443
ETCD_PORTS = (2379, 2380)
PAUSE_IMAGE = "localhost/meshlet/pause:1"
COREDNS_IMAGE = "localhost/meshlet/coredns:1"
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# The runtime's CNI folders (its conf_dir and bin_dir, links to Debian's plugins), where the
# meshlet-cni DaemonSet adds its plugin; and where it copies the plugin's root.
CNI_CONF_DIR = DIR / "cni" / "net.d"
CNI_BIN_DIR = DIR / "cni" / "bin"
CNI_ROOT_DIR = DIR / "cni" / "meshlet-cni"
CONTAINERD_SOCK = DIR / "containerd" / "containerd.sock"
# The order processes start in; `down` stops them in reverse.
PROCESSES = (
    "containerd",
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
)
# What the kubelet and kube-proxy write (and a bridge needs): put back as `up` found them.
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBE_CGROUPS = ("kubepods", "kubepods.slice")
CHAIN_PREFIXES = ("KUBE-", "CNI-")


class ClusterError(Exception):
    """A step of `up` or `down` that failed, with what to read."""


def log(message: str) -> None:
    print(f"cluster: {message}", file=sys.stderr, flush=True)


def run(*argv: str | Path, check: bool = True, quiet: bool = False, **kw: object) -> str:
    result = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        check=False,
        **kw,  # type: ignore[call-overload]
    )
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, argv))}: {result.stderr.strip() or result.stdout}")
    if not quiet and result.returncode != 0:
        log(f"{' '.join(map(str, argv))}: {result.stderr.strip()}")
    return str(result.stdout)


def node_ip() -> str:
    """The source address of the default route (the node's InternalIP)."""
    routes = json.loads(run("ip", "-4", "-j", "route", "get", "203.0.113.1"))
    if not routes or "prefsrc" not in routes[0]:
        raise ClusterError("no IPv4 default route: the node needs an address to advertise")
    return str(routes[0]["prefsrc"])


# -- the PKI ---------------------------------------------------------------------------------------


@dataclass
class Pki:
    folder: Path

    def path(self, name: str) -> Path:
        return self.folder / name

    def make(self, ip: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = self._cert("meshlet-cluster-ca", [], ca_key, ca_key, None, ca=True)
        self._write("ca", ca, ca_key)
        server = [ExtendedKeyUsageOID.SERVER_AUTH]
        client = [ExtendedKeyUsageOID.CLIENT_AUTH]
        api_names = [
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
            "localhost",
            NODE,
        ]
        self._issue(
            "apiserver",
            "kube-apiserver",
            [],
            server,
            ca,
            ca_key,
            api_names,
            [ip, API_SERVICE_IP, "127.0.0.1"],
        )
        self._issue("kubelet", f"system:node:{NODE}", [], server, ca, ca_key, [NODE], [ip])
        for name, cn, orgs in (
            ("admin", "meshlet-cluster-admin", ["system:masters"]),
            ("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"]),
            ("kubelet-client", f"system:node:{NODE}", ["system:nodes"]),
            ("controller-manager", "system:kube-controller-manager", []),
            ("scheduler", "system:kube-scheduler", []),
            ("kube-proxy", "system:kube-proxy", []),
        ):
            self._issue(name, cn, orgs, client, ca, ca_key, [], [])
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.path("sa.key").write_bytes(
            sa.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.path("sa.pub").write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        for key in self.folder.glob("*.key"):
            key.chmod(0o600)

    def _issue(
        self,
        name: str,
        cn: str,
        orgs: list[str],
        usages: list[x509.ObjectIdentifier],
        ca: x509.Certificate,
        ca_key: ec.EllipticCurvePrivateKey,
        dns: list[str],
        ips: list[str],
    ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = self._cert(cn, orgs, key, ca_key, ca, usages=usages, sans=sans)
        self._write(name, cert, key)

    @staticmethod
    def _cert(
        cn: str,
        orgs: list[str],
        key: ec.EllipticCurvePrivateKey,
        signer: ec.EllipticCurvePrivateKey,
        issuer: x509.Certificate | None,
        *,
        ca: bool = False,
        usages: list[x509.ObjectIdentifier] | None = None,
        sans: list[x509.GeneralName] | None = None,
    ) -> x509.Certificate:
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        subject = x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer.subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_encipherment=not ca,
                    key_cert_sign=ca,
                    crl_sign=ca,
                    content_commitment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def _write(self, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.path(f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.path(f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    def kubeconfig(self, name: str, user: str, server: str) -> Path:
        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "meshlet-cluster",
                    "cluster": {
                        "server": server,
                        "certificate-authority-data": b64(self.path("ca.crt")),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate-data": b64(self.path(f"{name}.crt")),
                        "client-key-data": b64(self.path(f"{name}.key")),
                    },
                }
            ],
            "contexts": [
                {"name": "meshlet-cluster", "context": {"cluster": "meshlet-cluster", "user": user}}
            ],
            "current-context": "meshlet-cluster",
        }
        path = DIR / f"{name}.kubeconfig"
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)
        return path


# -- configuration files ---------------------------------------------------------------------


def containerd_config() -> Path:
    state = DIR / "containerd"
    text = f"""
version = 2
root = "{state}/root"
state = "{state}/state"
[grpc]
  address = "{CONTAINERD_SOCK}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Lowering an oom_score_adj is refused on some machines, even to root (a sandbox's -998
  # then fails runc's start): no container is given less than containerd's own.
  restrict_oom_score_adj = true
  enable_unprivileged_ports = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{CNI_CONF_DIR}"
"""
    path = state / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cni_config() -> None:
    conf = {
        "cniVersion": "1.0.0",
        "name": "meshlet-cluster",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(DIR / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    CNI_CONF_DIR.mkdir(parents=True, exist_ok=True)
    (CNI_CONF_DIR / "10-meshlet-cluster.conflist").write_text(json.dumps(conf, indent=2))
    CNI_BIN_DIR.mkdir(parents=True, exist_ok=True)
    for plugin in CNI_PLUGINS:
        link = CNI_BIN_DIR / plugin
        link.unlink(missing_ok=True)
        link.symlink_to(CNI_BIN / plugin)


def kubelet_config(pki: Pki) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.path("ca.crt"))},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "clusterDomain": "cluster.local",
        "clusterDNS": [DNS_IP],
        "tlsCertFile": str(pki.path("kubelet.crt")),
        "tlsPrivateKeyFile": str(pki.path("kubelet.key")),
        "failSwapOn": False,
        # cgroup v1 is in maintenance mode since 1.31; 1.34 still runs on it by default.
        "failCgroupV1": False,
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        # The test node's disk is shared with everything else on the machine: no evictions.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "podPidsLimit": 4096,
        "maxPods": 60,
        "protectKernelDefaults": False,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
    }
    path = DIR / "kubelet" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def command(name: str, bin: Path, pki: Pki, ip: str) -> list[str]:
    p = pki.path
    if name == "containerd":
        return ["containerd", "--config", str(DIR / "containerd" / "config.toml")]
    if name == "etcd":
        return [
            str(bin / "etcd"),
            "--name",
            NODE,
            "--data-dir",
            str(DIR / "etcd"),
            "--listen-client-urls",
            f"http://127.0.0.1:{ETCD_PORTS[0]}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{ETCD_PORTS[0]}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{ETCD_PORTS[1]}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{ETCD_PORTS[1]}",
            "--initial-cluster",
            f"{NODE}=http://127.0.0.1:{ETCD_PORTS[1]}",
            "--listen-metrics-urls",
            "",
            "--log-level",
            "warn",
        ]
    if name == "kube-apiserver":
        return [
            str(bin / name),
            f"--advertise-address={ip}",
            "--bind-address=0.0.0.0",
            f"--secure-port={API_PORT}",
            f"--etcd-servers=http://127.0.0.1:{ETCD_PORTS[0]}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--client-ca-file={p('ca.crt')}",
            f"--tls-cert-file={p('apiserver.crt')}",
            f"--tls-private-key-file={p('apiserver.key')}",
            f"--kubelet-client-certificate={p('apiserver-kubelet-client.crt')}",
            f"--kubelet-client-key={p('apiserver-kubelet-client.key')}",
            f"--kubelet-certificate-authority={p('ca.crt')}",
            "--kubelet-preferred-address-types=InternalIP",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p('sa.pub')}",
            f"--service-account-signing-key-file={p('sa.key')}",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-controller-manager":
        return [
            str(bin / name),
            *_controller_flags("controller-manager"),
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p('sa.key')}",
            f"--root-ca-file={p('ca.crt')}",
            f"--cluster-signing-cert-file={p('ca.crt')}",
            f"--cluster-signing-key-file={p('ca.key')}",
            f"--cluster-cidr={CLUSTER_CIDR}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allocate-node-cidrs=false",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-scheduler":
        return [
            str(bin / name),
            *_controller_flags("scheduler"),
            "--profiling=false",
            "--v=1",
        ]
    if name == "kubelet":
        return [
            str(bin / name),
            f"--config={DIR / 'kubelet' / 'config.json'}",
            f"--kubeconfig={DIR / 'kubelet-client.kubeconfig'}",
            f"--root-dir={DIR / 'kubelet'}",
            f"--hostname-override={NODE}",
            f"--node-ip={ip}",
            "--v=1",
        ]
    if name == "kube-proxy":
        return [
            str(bin / name),
            f"--kubeconfig={DIR / 'kube-proxy.kubeconfig'}",
            f"--hostname-override={NODE}",
            "--proxy-mode=iptables",
            f"--cluster-cidr={CLUSTER_CIDR}",
            "--conntrack-max-per-core=0",
            "--metrics-bind-address=127.0.0.1:10249",
            "--healthz-bind-address=127.0.0.1:10256",
            "--v=1",
        ]
    raise KeyError(name)


def _controller_flags(name: str) -> list[str]:
    """What kube-controller-manager and kube-scheduler share: one kubeconfig for the API and
    for checking their own clients, loopback only, no leader election (one node)."""
    kubeconfig = DIR / f"{name}.kubeconfig"
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
    ]


# -- processes -----------------------------------------------------------------------------------


def start(name: str, argv: list[str]) -> None:
    logs = DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("ab") as out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=DIR,
        )
    (DIR / "run").mkdir(exist_ok=True)
    (DIR / "run" / f"{name}.pid").write_text(str(process.pid))


def alive(name: str) -> bool:
    pid = _pid(name)
    return pid is not None and Path(f"/proc/{pid}").exists() and not _zombie(pid)


def _pid(name: str) -> int | None:
    try:
        return int((DIR / "run" / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_for(what: str, probe: object, timeout: float, process: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not alive(process):
            tail = _tail(DIR / "logs" / f"{process}.log")
            raise ClusterError(f"{process} exited while waiting for {what}:\n{tail}")
        with contextlib.suppress(Exception):
            if probe():  # type: ignore[operator]
                return
        time.sleep(0.5)
    tail = _tail(DIR / "logs" / f"{process}.log") if process else ""
    raise ClusterError(f"{what} not reached in {timeout:.0f} s\n{tail}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _https_ok(url: str, pki: Pki) -> bool:
    context = ssl.create_default_context(cafile=str(pki.path("ca.crt")))
    context.load_cert_chain(str(pki.path("admin.crt")), str(pki.path("admin.key")))
    with urllib.request.urlopen(url, context=context, timeout=3) as answer:
        return bool(answer.status == 200)


def kubectl(
    bin: Path, *args: str, stdin: str | None = None, check: bool = True, quiet: bool = False
) -> str:
    config = f"--kubeconfig={DIR / 'admin.kubeconfig'}"
    return run(bin / "kubectl", config, *args, input=stdin, check=check, quiet=quiet)


# -- images --------------------------------------------------------------------------------------


def podman(*args: str | Path) -> str:
    env = {**os.environ}
    env.setdefault("CONTAINERS_CONF", str(ROOT / "images" / "containers.conf"))
    return run("podman", *args, env=env)


def build_images(bin: Path) -> None:
    """The pause and CoreDNS images: one static binary each, from scratch."""
    for image, binary, entry in (
        (PAUSE_IMAGE, bin / "pause", "/pause"),
        (COREDNS_IMAGE, bin / "coredns", "/coredns"),
    ):
        with contextlib.suppress(ClusterError):
            podman("image", "exists", image)
            continue
        context = DIR / "build" / Path(entry).name
        context.mkdir(parents=True, exist_ok=True)
        shutil.copy2(binary, context / Path(entry).name)
        (context / "Containerfile").write_text(
            f'FROM scratch\nCOPY {Path(entry).name} {entry}\nENTRYPOINT ["{entry}"]\n'
        )
        podman("build", "--quiet", "-t", image, str(context))
        shutil.rmtree(context)


def import_images(images: list[str]) -> None:
    """Copies podman images into the node's containerd (namespace k8s.io), as a registry would."""
    archive = DIR / "build" / "images.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    try:
        podman("save", "--quiet", "--multi-image-archive", "-o", str(archive), *images)
        run(
            "ctr",
            f"--address={CONTAINERD_SOCK}",
            "-n",
            "k8s.io",
            "images",
            "import",
            "--no-unpack",
            str(archive),
        )
    finally:
        archive.unlink(missing_ok=True)


# -- up ------------------------------------------------------------------------------------------


COREDNS = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
  - apiGroups: [""]
    resources: [endpoints, services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        forward . /etc/resolv.conf
        cache 30
        loop
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      priorityClassName: system-cluster-critical
      containers:
        - name: coredns
          image: COREDNS_IMAGE
          imagePullPolicy: Never
          args: [-conf, /etc/coredns/Corefile]
          ports:
            - {containerPort: 53, name: dns, protocol: UDP}
            - {containerPort: 53, name: dns-tcp, protocol: TCP}
          securityContext:
            capabilities: {add: [NET_BIND_SERVICE], drop: [ALL]}
            readOnlyRootFilesystem: true
          readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2}
          livenessProbe: {httpGet: {path: /health, port: 8080}, initialDelaySeconds: 10}
          volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes: [{name: config, configMap: {name: coredns}}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: DNS_IP
  ports:
    - {name: dns, port: 53, protocol: UDP}
    - {name: dns-tcp, port: 53, protocol: TCP}
"""


def up() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the cluster needs root (containerd, the kubelet, iptables)")
    missing = [
        t for t in ("containerd", "runc", "ctr", "podman", "iptables") if not shutil.which(t)
    ]
    missing += [f"{CNI_BIN}/{p}" for p in CNI_PLUGINS if not (CNI_BIN / p).exists()]
    if missing:
        raise ClusterError(f"missing: {', '.join(missing)} (make cluster installs them)")
    if any(alive(name) for name in PROCESSES):
        raise ClusterError(f"a cluster is running under {DIR} (make cluster-down first)")
    began = time.monotonic()
    built = run(HERE / "build", check=True).strip().splitlines()[-1]
    bin = Path(built)
    log(f"binaries in {bin} ({time.monotonic() - began:.0f} s)")
    down(quiet=True)
    DIR.mkdir(parents=True, exist_ok=True)
    _save_sysctls()
    ip = node_ip()
    pki = Pki(DIR / "pki")
    pki.make(ip)
    server = f"https://{ip}:{API_PORT}"
    for name, user in (
        ("admin", "meshlet-cluster-admin"),
        ("controller-manager", "system:kube-controller-manager"),
        ("scheduler", "system:kube-scheduler"),
        ("kubelet-client", f"system:node:{NODE}"),
        ("kube-proxy", "system:kube-proxy"),
    ):
        pki.kubeconfig(name, user, server)
    containerd_config()
    cni_config()
    kubelet_config(pki)
    _sysctl("net/ipv4/ip_forward", "1")
    _sysctl("net/bridge/bridge-nf-call-iptables", "1")
    _sysctl("net/bridge/bridge-nf-call-ip6tables", "1")

    build_images(bin)
    t0 = time.monotonic()
    start("containerd", command("containerd", bin, pki, ip))
    wait_for("containerd's socket", CONTAINERD_SOCK.exists, 30, "containerd")
    import_images([PAUSE_IMAGE, COREDNS_IMAGE])
    start("etcd", command("etcd", bin, pki, ip))
    wait_for(
        "etcd",
        lambda: (
            urllib.request.urlopen(f"http://127.0.0.1:{ETCD_PORTS[0]}/health", timeout=2).status
            == 200
        ),
        60,
        "etcd",
    )
    start("kube-apiserver", command("kube-apiserver", bin, pki, ip))
    wait_for("the API server", lambda: _https_ok(f"{server}/readyz", pki), 120, "kube-apiserver")
    for name in ("kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy"):
        start(name, command(name, bin, pki, ip))
    wait_for(
        f"node {NODE} Ready",
        lambda: (
            "True"
            in kubectl(
                bin,
                "get",
                "node",
                NODE,
                "-o",
                'jsonpath={.status.conditions[?(@.type=="Ready")].status}',
            )
        ),
        120,
        "kubelet",
    )
    manifest = COREDNS.replace("COREDNS_IMAGE", COREDNS_IMAGE).replace("DNS_IP", DNS_IP)
    kubectl(bin, "apply", "-f", "-", stdin=manifest)
    wait_for(
        "the default ServiceAccount",
        lambda: kubectl(bin, "get", "serviceaccount", "default", check=False, quiet=True),
        60,
        "kube-controller-manager",
    )
    kubectl(bin, "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=120s")
    log(
        f"up in {time.monotonic() - began:.0f} s (processes started to DNS ready: "
        f"{time.monotonic() - t0:.0f} s); node {NODE} at {ip}"
    )
    print(env_lines(bin))


def env_lines(bin: Path) -> str:
    """KUBECONFIG, PATH, and the meshlet-cni chart's values for this node's CNI folders
    (`meshlet install-cni --set "$MESHLET_CNI_SETS"`)."""
    cni = (f"destCNINetDir={CNI_CONF_DIR},destCNIBinDir={CNI_BIN_DIR},"
           f"destRootDir={CNI_ROOT_DIR}")  # fmt: skip
    return (f"export KUBECONFIG={DIR / 'admin.kubeconfig'}\nexport PATH={bin}:$PATH\n"
            f"export MESHLET_CNI_SETS={cni}")  # fmt: skip


# -- down ----------------------------------------------------------------------------------------


def down(quiet: bool = False) -> None:
    if os.geteuid() != 0:
        raise ClusterError("taking the cluster down needs root")
    for name in reversed(PROCESSES[1:]):
        _stop(name)
    _kill_pods()
    _stop("containerd")
    _kill_shims()
    _remove_netns()
    _unmount_under(DIR)
    with contextlib.suppress(ClusterError):
        run("ip", "link", "delete", BRIDGE, quiet=True)
    _remove_chains()
    _remove_cgroups()
    _restore_sysctls()
    if DIR.exists():
        shutil.rmtree(DIR)
    left = leftovers()
    if left:
        raise ClusterError("down left:\n  " + "\n  ".join(left))
    if not quiet:
        log("down: nothing of the cluster is left")


def leftovers() -> list[str]:
    """What of a cluster is still on the machine: its processes (by the state folder or the
    node's binaries in their command line), mounts under the folder, the pods' network
    namespaces, the bridge, KUBE-/CNI- iptables chains, the pods' cgroups, the folder."""
    found = []
    needles = [str(DIR).encode(), str(CONTAINERD_SOCK).encode()]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            program = Path(argv[0].decode(errors="replace")).name
            if program in PROCESSES[1:] or any(n in arg for arg in argv for n in needles):
                found.append(f"process {proc.name}: {b' '.join(argv)[:120]!r}")
    prefix = str(DIR)
    for line in Path("/proc/mounts").read_text().splitlines():
        mount = line.split()[1]
        if mount == prefix or mount.startswith(prefix + "/"):
            found.append(f"mount {mount}")
    netns = Path("/var/run/netns")
    found += [f"netns {n.name}" for n in (netns.glob("cni-*") if netns.exists() else [])]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.append(f"interface {BRIDGE}")
    for family in ("iptables", "ip6tables"):
        for backend in ("nft", "legacy"):
            save = shutil.which(f"{family}-{backend}-save")
            if save:
                dump = run(save, check=False, quiet=True)
                chains = [line for line in dump.splitlines() if line.startswith(":")]
                found += [f"{family}-{backend} chain {line[1:].split()[0]}" for line in chains
                          if line[1:].startswith(CHAIN_PREFIXES)]  # fmt: skip
    found += [f"cgroup {c}" for c in _cgroup_dirs()]
    if DIR.exists():
        found.append(f"folder {DIR}")
    return found


def _stop(name: str, grace: float = 10) -> None:
    pid = _pid(name)
    if pid is None or not Path(f"/proc/{pid}").exists():
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and not _zombie(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _cgroup_dirs() -> list[Path]:
    found = []
    for hierarchy in CGROUP_ROOT.iterdir():
        for name in KUBE_CGROUPS:
            if (hierarchy / name).is_dir():
                found.append(hierarchy / name)
    return found


def _kill_pods() -> None:
    """Every process in the pods' cgroups (the shims are not in them), then the cgroups."""
    for _ in range(50):
        pids = set()
        for top in _cgroup_dirs():
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _kill_shims() -> None:
    """containerd's shims outlive it by design; ours name our containerd's socket."""
    needle = str(CONTAINERD_SOCK).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes()
            if b"containerd-shim" in argv and needle in argv:
                os.kill(int(proc.name), signal.SIGKILL)


def _remove_netns() -> None:
    folder = Path("/var/run/netns")
    for ns in folder.glob("cni-*") if folder.exists() else []:
        with contextlib.suppress(ClusterError):
            run("ip", "netns", "delete", ns.name, quiet=True)
        with contextlib.suppress(OSError):
            if ns.exists():
                run("umount", "-l", ns, check=False, quiet=True)
                ns.unlink()


def _unmount_under(folder: Path) -> None:
    prefix = str(folder.resolve() if folder.exists() else folder)
    for _ in range(5):
        mounts = [
            line.split()[1].encode().decode("unicode_escape")
            for line in Path("/proc/mounts").read_text().splitlines()
        ]
        ours = [m for m in mounts if m == prefix or m.startswith(prefix + "/")]
        if not ours:
            return
        for mount in sorted(ours, key=len, reverse=True):
            run("umount", "-l", mount, check=False, quiet=True)


def _remove_chains() -> None:
    """kube-proxy's (KUBE-*) and the CNI plugins' (CNI-*) chains and the rules jumping to them,
    in every table, in each iptables back end that has any."""
    for family in ("iptables", "ip6tables"):
        for backend in ("nft", "legacy"):
            save = shutil.which(f"{family}-{backend}-save")
            restore = shutil.which(f"{family}-{backend}-restore")
            if not save or not restore:
                continue
            dump = run(save, check=False, quiet=True)
            if not any(p in dump for p in CHAIN_PREFIXES):
                continue
            run(restore, "--noflush", input=_without_chains(dump), check=False)


def _without_chains(dump: str) -> str:
    """An iptables-restore input that deletes, table by table, every rule naming a chain of
    ours and then those chains."""
    out: list[str] = []
    table = None
    rules: list[str] = []
    chains: list[str] = []
    for line in dump.splitlines():
        if line.startswith("*"):
            table, rules, chains = line, [], []
        elif line.startswith(":") and table:
            name = line[1:].split()[0]
            if name.startswith(CHAIN_PREFIXES):
                chains.append(name)
        elif line.startswith("-A ") and table:
            parts = line.split()
            chain = parts[1]
            target = parts[parts.index("-j") + 1] if "-j" in parts else ""
            if not chain.startswith(CHAIN_PREFIXES) and target.startswith(CHAIN_PREFIXES):
                rules.append("-D " + line[3:])
        elif line == "COMMIT" and table:
            if rules or chains:
                out.append(table)
                out.extend(rules)
                out.extend(f"-F {c}" for c in chains)
                out.extend(f"-X {c}" for c in chains)
                out.append("COMMIT")
            table = None
    return "\n".join(out) + "\n"


def _remove_cgroups() -> None:
    for top in _cgroup_dirs():
        for folder in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)
        ):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _sysctl(name: str, value: str) -> None:
    path = Path("/proc/sys") / name
    with contextlib.suppress(OSError):
        path.write_text(value)


SYSCTL_RECORD = Path("/var/tmp/meshlet-cluster.sysctls.json")


def _save_sysctls() -> None:
    saved = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            saved[name] = (Path("/proc/sys") / name).read_text().strip()
    SYSCTL_RECORD.write_text(json.dumps(saved))


def _restore_sysctls() -> None:
    try:
        saved = json.loads(SYSCTL_RECORD.read_text())
    except (OSError, ValueError):
        return
    for name, value in saved.items():
        _sysctl(name, value)
    SYSCTL_RECORD.unlink()


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    try:
        if verb == "up":
            up()
        elif verb == "down":
            down()
        elif verb == "status":
            running = [name for name in PROCESSES if alive(name)]
            print(f"{len(running)}/{len(PROCESSES)} running: {' '.join(running)}")
            return 0 if len(running) == len(PROCESSES) else 3
        elif verb == "env":
            print(env_lines(Path(run(HERE / "build").strip().splitlines()[-1])))
        elif verb == "import" and len(argv) > 1:
            import_images(argv[1:])
        else:
            print(__doc__, file=sys.stderr)
            return 64
    except ClusterError as error:
        log(str(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
