"""`meshlet-cni` run as a container runtime runs it: Debian's containernetworking-plugins first
(`loopback`, then `bridge` with `host-local` addresses), `meshlet-cni` chained after them in one
network configuration list, each plugin a process given `CNI_*` variables and its
configuration (with the previous plugin's result) on standard input, ADD in order and DEL in
reverse. The node is a network namespace of the test's own (the bridge lives there, not on the
machine), the pod another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.netns

PLUGINS = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
MESHLET_CNI = str(Path(sys.executable).with_name("meshlet-cni"))
SUBNET, GATEWAY = "10.254.77.0/24", "10.254.77.1"

# A stand-in for the proxy's inbound listener in the pod: it names itself to whoever connects.
PROXY = (
    "import socket\n"
    "s = socket.create_server(('0.0.0.0', 4143))\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'inbound proxy'); c.close()\n"
)


MESHED = {"meshlet.io/proxy-version": "0.1.0", "meshlet.io/inject": "enabled"}
ANNOTATIONS = "io.kubernetes.cri.pod-annotations"


class Runtime:
    """What a container runtime does with a configuration list (libcni's job), for a pod with
    `annotations` (None: a runtime that passes none)."""

    def __init__(
        self,
        node: str,
        conflist: dict[str, Any],
        annotations: dict[str, str] | None = MESHED,
        binary: str = MESHLET_CNI,
    ) -> None:
        self.node, self.conflist, self.annotations = node, conflist, annotations
        self.binary = binary

    def plugin(self, kind: str, command: str, netns: str, config: dict[str, Any],
               container: str = "pod-1") -> tuple[int, Any, str]:  # fmt: skip
        binary = self.binary if kind == "meshlet-cni" else str(PLUGINS / kind)
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container, "CNI_NETNS": netns,
               "CNI_IFNAME": "eth0", "CNI_PATH": str(PLUGINS), "PATH": os.environ["PATH"],
               "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1"}  # fmt: skip
        done = subprocess.run(["ip", "netns", "exec", self.node, binary], input=json.dumps(config),
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        out = json.loads(done.stdout) if done.stdout.strip() else None
        return done.returncode, out, done.stderr

    def each(self, command: str, netns: str, previous: Any = None) -> Any:
        plugins = self.conflist["plugins"]
        for entry in plugins if command == "ADD" else list(reversed(plugins)):
            config = {"cniVersion": self.conflist["cniVersion"], "name": self.conflist["name"],
                      **entry}  # fmt: skip
            # libcni hands a plugin the runtime's values of the capabilities it asks for
            asked = entry.get("capabilities") or {}
            if asked.get(ANNOTATIONS) and self.annotations is not None:
                config["runtimeConfig"] = {ANNOTATIONS: self.annotations}
            if previous is not None:
                config["prevResult"] = previous
            code, out, err = self.plugin(entry["type"], command, netns, config)
            assert code == 0, (entry["type"], command, out, err)
            if command == "ADD":
                previous = out
        return previous


@pytest.fixture
def node_and_pod(netns_available: None, tmp_path: Path) -> Iterator[tuple[str, str]]:
    tag = f"{os.getpid() % 100000}"
    node, pod = f"mcni-node-{tag}", f"mcni-pod-{tag}"
    for ns in (node, pod):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", node, "link", "set", "lo", "up"], check=True)
        yield node, pod
    finally:
        for ns in (pod, node):  # the node's bridge goes with its namespace
            subprocess.run(["ip", "netns", "del", ns], check=False)


def conflist(tmp_path: Path, **meshlet: Any) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "meshlet-test",
        "plugins": [
            {"type": "loopback"},
            {"type": "bridge", "bridge": "mcni0", "isGateway": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": SUBNET}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(tmp_path / "ipam")}},
            {"type": "meshlet-cni", "capabilities": {ANNOTATIONS: True},
             "meshlet": {"proxy-gid": "2102", **meshlet}},
        ],
    }  # fmt: skip


def nat(pod: str) -> str:
    saved = subprocess.run(["ip", "netns", "exec", pod, "iptables-legacy-save", "-t", "nat"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    return "\n".join(line for line in saved.splitlines() if line.startswith("-A"))


def test_chained_after_the_standard_plugins_it_redirects_the_pod_and_del_undoes_it(
    node_and_pod: tuple[str, str], tmp_path: Path
) -> None:
    node, pod = node_and_pod
    netns = f"/run/netns/{pod}"
    runtime = Runtime(node, conflist(tmp_path, **{"inbound-ports-to-ignore": "7001"}))
    before = nat(pod)
    result = runtime.each("ADD", netns)
    # a chained plugin passes the previous result on: the bridge's address for the pod
    (address,) = [ip["address"] for ip in result["ips"]]
    assert address.startswith("10.254.77.") and result["cniVersion"] == "1.0.0"
    assert "meshlet-init/redirect-all-incoming-to-proxy-port" in nat(pod)
    assert "--dports 4190,4191,7001" in nat(pod)
    check = {"cniVersion": "1.0.0", "name": "meshlet-test", **runtime.conflist["plugins"][2],
             "prevResult": result, "runtimeConfig": {ANNOTATIONS: MESHED}}  # fmt: skip
    assert runtime.plugin("meshlet-cni", "CHECK", netns, check)[0] == 0

    # the pod's TCP goes to its proxy: from the node, port 8080 of the pod reaches :4143
    proxy = subprocess.Popen(["ip", "netns", "exec", pod, sys.executable, "-c", PROXY],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proxy.stdout is not None and proxy.stdout.readline() == "ready\n"
        pod_ip = address.split("/")[0]
        client = ("import socket, sys; s = socket.create_connection((sys.argv[1], 8080),"
                  " timeout=5); print(s.recv(100).decode())")  # fmt: skip
        got = subprocess.run(["ip", "netns", "exec", node, sys.executable, "-c", client, pod_ip],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        assert got.stdout.strip() == "inbound proxy", got.stderr
    finally:
        proxy.kill()
        proxy.communicate()

    # a rule taken away: CHECK says what differs, as a CNI error
    subprocess.run(["ip", "netns", "exec", pod, "iptables-legacy", "-t", "nat", "-F",
                    "PROXY_INIT_OUTPUT"], check=True)  # fmt: skip
    code, error, _ = runtime.plugin("meshlet-cni", "CHECK", netns, check)
    assert code == 1 and error["code"] == 5, error
    assert "PROXY_INIT_OUTPUT does not hold the planned rules" in error["details"]

    runtime.each("DEL", netns, result)
    assert nat(pod) == before  # the pod's table as it was
    # DEL again, and DEL once the namespace is gone: nothing to do, no error
    runtime.each("DEL", netns, result)
    assert runtime.plugin("meshlet-cni", "DEL", "/run/netns/gone", check)[0] == 0


@pytest.mark.parametrize(
    ("change", "command", "code", "says"),
    [
        ({"meshlet": {"proxy-guid": "2102"}}, "ADD", 7, "unknown meshlet settings: proxy-guid"),
        ({"meshlet": {"incoming-proxy-port": "99999"}}, "ADD", 7, "meshlet-init apply failed"),
        ({"cniVersion": "9.9.9"}, "ADD", 1, "CNI version 9.9.9 is not supported"),
        ({"prevResult": None}, "ADD", 7, "no prevResult"),
        ({}, "GC?", 4, "CNI_COMMAND GC? is not one of"),
        ({"netns": "/run/netns/gone"}, "ADD", 4, "CNI_NETNS /run/netns/gone is not a network"),
    ],
)
def test_bad_config_or_environment_is_a_cni_error_never_a_traceback(
    node_and_pod: tuple[str, str], tmp_path: Path, change: dict[str, Any], command: str,
    code: int, says: str,
) -> None:  # fmt: skip
    node, pod = node_and_pod
    runtime = Runtime(node, conflist(tmp_path))
    config: dict[str, Any] = {"cniVersion": "1.0.0", "name": "meshlet-test",
                              "type": "meshlet-cni", "meshlet": {},
                              "prevResult": {"cniVersion": "1.0.0", "ips": []},
                              "runtimeConfig": {ANNOTATIONS: MESHED}}  # fmt: skip
    netns = str(change.pop("netns", f"/run/netns/{pod}"))
    config.update(change)
    if config.get("prevResult") is None:
        del config["prevResult"]
    before = nat(pod)
    got, error, err = runtime.plugin("meshlet-cni", command, netns, config)
    assert got == 1, (error, err)
    assert error["code"] == code and error["cniVersion"] == "1.1.0", error
    assert says in error["msg"], error
    assert "Traceback" not in err + json.dumps(error)
    assert nat(pod) == before  # nothing changed


def test_version_and_status(node_and_pod: tuple[str, str], tmp_path: Path) -> None:
    node, _ = node_and_pod
    runtime = Runtime(node, conflist(tmp_path))
    code, out, _ = runtime.plugin("meshlet-cni", "VERSION", "", {})
    assert code == 0 and "1.0.0" in out["supportedVersions"] and out["cniVersion"] == "1.1.0"
    config = {"cniVersion": "1.1.0", "name": "meshlet-test", "type": "meshlet-cni"}
    started = time.monotonic()
    assert runtime.plugin("meshlet-cni", "STATUS", "", config)[:2] == (0, None)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("annotations", "why"),
    [
        ({"meshlet.io/inject": "enabled"}, "no meshlet.io/proxy-version annotation"),
        (None, "the runtime passed no pod annotations"),
    ],
    ids=["not-meshed", "no-annotations"],
)
def test_a_pod_the_injector_did_not_mesh_is_passed_through_untouched(
    node_and_pod: tuple[str, str], tmp_path: Path, annotations: dict[str, str] | None, why: str
) -> None:
    node, pod = node_and_pod
    netns = f"/run/netns/{pod}"
    runtime = Runtime(node, conflist(tmp_path), annotations)
    before = nat(pod)
    entry = {"cniVersion": "1.0.0", "name": "meshlet-test", **runtime.conflist["plugins"][2],
             "prevResult": {"cniVersion": "1.0.0", "ips": []}}  # fmt: skip
    if annotations is not None:
        entry["runtimeConfig"] = {ANNOTATIONS: annotations}
    code, out, err = runtime.plugin("meshlet-cni", "ADD", netns, entry)
    assert code == 0 and out == {"cniVersion": "1.0.0", "ips": []}, (out, err)
    assert why in err
    assert nat(pod) == before
    assert runtime.plugin("meshlet-cni", "CHECK", netns, entry)[0] == 0
    assert runtime.plugin("meshlet-cni", "DEL", netns, entry)[0] == 0


def test_a_pods_skip_annotations_replace_the_configurations_ports(
    node_and_pod: tuple[str, str], tmp_path: Path
) -> None:
    node, pod = node_and_pod
    pod_annotations = {**MESHED, "config.meshlet.io/skip-inbound-ports": "9901",
                       "config.meshlet.io/skip-outbound-ports": "5432"}  # fmt: skip
    runtime = Runtime(node, conflist(tmp_path, **{"inbound-ports-to-ignore": "7001"}),
                      pod_annotations)  # fmt: skip
    runtime.each("ADD", f"/run/netns/{pod}")
    rules = nat(pod)
    assert "--dports 4190,4191,9901" in rules and "7001" not in rules
    assert "--dports 5432" in rules

    bad = Runtime(node, conflist(tmp_path), {**MESHED, "config.meshlet.io/skip-inbound-ports":
                                             "ninety"})  # fmt: skip
    entry = {"cniVersion": "1.0.0", "name": "meshlet-test", **bad.conflist["plugins"][2],
             "prevResult": {"cniVersion": "1.0.0", "ips": []},
             "runtimeConfig": {ANNOTATIONS: bad.annotations}}  # fmt: skip
    code, error, err = bad.plugin("meshlet-cni", "ADD", f"/run/netns/{pod}", entry)
    assert code == 1 and error["code"] == 7 and "ninety" in error["details"], (error, err)


def validator(pod: str, timeout: float = 5.0) -> subprocess.CompletedProcess[str]:
    """meshlet-network-validator in the pod, as nobody (any user but the proxy's)."""
    return subprocess.run(
        ["ip", "netns", "exec", pod, "setpriv", "--reuid=65534", "--regid=65534",
         "--clear-groups", sys.executable, "-m", "meshlet.init.validate",
         f"--timeout={timeout}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_launcher_runs_the_plugin_in_its_own_root_and_the_validator_sees_it(
    node_and_pod: tuple[str, str], tmp_path: Path
) -> None:
    """The script the DaemonSet writes on a node, run as the runtime runs a plugin: it enters
    the pod's namespace, mounts /proc and /dev in a root (here the machine's own, /) and runs
    the plugin there. The unprivileged validator fails before and passes after."""
    from meshlet.init.cni_install import launcher

    node, pod = node_and_pod
    binary = tmp_path / "meshlet-cni"
    binary.write_text(launcher("/", sys.executable))
    binary.chmod(0o755)
    runtime = Runtime(node, conflist(tmp_path), MESHED, str(binary))
    netns = f"/run/netns/{pod}"
    before = nat(pod)
    runtime.each("ADD", netns)
    assert "meshlet-init/redirect-all-outgoing-to-proxy-port" in nat(pod)
    started = time.monotonic()
    passed = validator(pod)
    assert passed.returncode == 0, passed.stderr
    assert "outbound TCP is redirected to port 4140" in passed.stdout
    assert time.monotonic() - started < 10

    runtime.each("DEL", netns)
    assert nat(pod) == before
    failed = validator(pod, timeout=2.0)
    assert failed.returncode == 1
    assert "was not redirected" in failed.stderr and "meshlet-cni" in failed.stderr
    assert "Traceback" not in failed.stderr
    # no netns: VERSION through the launcher too
    code, out, _ = runtime.plugin("meshlet-cni", "VERSION", "", {})
    assert code == 0 and out["cniVersion"] == "1.1.0"
