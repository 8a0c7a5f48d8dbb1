"""What the rules do to real connections: a pod namespace with meshlet-init's rules and a remote
namespace on a veth pair, tiny servers and clients as processes, no proxy.

In the pod, a listener on 127.0.0.1:4140 stands for the outbound proxy and one on :4143 for the
inbound proxy; every listener answers with its label and the SO_ORIGINAL_DST of the connection
("-" when it was not redirected). Every test that shows traffic bypassing the proxy also shows a
neighbouring connection that does not, so none of them passes without the rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshlet.api import wellknown

INIT = str(Path(sys.executable).with_name("meshlet-init"))
POD_IP, REMOTE_IP, REMOTE_IGNORED_IP = "10.254.9.1", "10.254.9.2", "10.254.9.200"
IGNORED_SUBNET = "10.254.9.192/26"
# the same on IPv6 (`ip addr add … nodad`: usable at once, no duplicate address detection)
POD_IP6, REMOTE_IP6, REMOTE_IGNORED_IP6 = "fd77:9::1", "fd77:9::2", "fd77:9::c8"
IGNORED_SUBNET6 = "fd77:9::c0/122"
GID = wellknown.PROXY_GID

SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    from meshlet.proxy.io.sockets import original_dst

    def serve(listener, label):
        while True:
            conn, _ = listener.accept()
            dst = original_dst(conn)
            conn.sendall((f"{label} {dst[0]}:{dst[1]}" if dst else f"{label} -").encode())
            conn.close()

    listeners = []
    for spec in sys.argv[1:]:
        label, _, addr = spec.partition("@")
        host, _, port = addr.rpartition(":")
        family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
        listeners.append((socket.create_server((host.strip("[]"), int(port)), family=family),
                          label))
    for listener, label in listeners:
        threading.Thread(target=serve, args=(listener, label), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

CLIENT = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    sys.stdout.write(data.decode())
    """
)

# A client that needs no Python: a process running as the proxy's UID cannot read an interpreter
# installed under root's home (DESIGN §7), but it can run bash.
BASH_CLIENT = 'exec 3<>"/dev/tcp/$0/$1" && cat <&3'


@dataclass
class Namespace:
    name: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)

    def run(self, *argv: str, group: int | None = None) -> str:
        result = subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            capture_output=True, text=True, timeout=30, group=group,
        )  # fmt: skip
        assert result.returncode == 0, result
        return result.stdout

    def connect(self, host: str, port: int, group: int | None = None) -> str:
        return self.run(sys.executable, "-c", CLIENT, host, str(port), group=group)

    def connect_as(self, uid: int, gid: int, host: str, port: int) -> str:
        return self.run(
            "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "bash", "-c", BASH_CLIENT, host, str(port),
        )  # fmt: skip

    def serve(self, *specs: str) -> None:
        server = subprocess.Popen(
            ["ip", "netns", "exec", self.name, sys.executable, "-c", SERVER, *specs],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.servers.append(server)
        assert server.stdout is not None
        assert server.stdout.readline() == "ready\n", server.communicate()


@pytest.fixture(scope="module", params=["legacy", "nft"])
def pods(
    request: pytest.FixtureRequest, netns_available: None
) -> Iterator[tuple[Namespace, Namespace]]:
    """(pod, remote), the pod's table programmed by `meshlet-init --mode <param>`."""
    tag = f"{os.getpid() % 100000}-{request.param}"
    pod, remote = Namespace(f"mli-pod-{tag}"), Namespace(f"mli-remote-{tag}")
    try:
        for ns in (pod, remote):
            subprocess.run(["ip", "netns", "add", ns.name], check=True)
        subprocess.run(
            ["ip", "link", "add", "mli-pod", "netns", pod.name, "type", "veth",
             "peer", "name", "mli-remote", "netns", remote.name], check=True,
        )  # fmt: skip
        for ns, dev, ips in ((pod, "mli-pod", [POD_IP, POD_IP6]),
                             (remote, "mli-remote", [REMOTE_IP, REMOTE_IGNORED_IP, REMOTE_IP6,
                                                     REMOTE_IGNORED_IP6])):  # fmt: skip
            for ip in ips:
                if ":" in ip:
                    ns.run("ip", "addr", "add", f"{ip}/64", "dev", dev, "nodad")
                else:
                    ns.run("ip", "addr", "add", f"{ip}/24", "dev", dev)
            ns.run("ip", "link", "set", dev, "up")
            ns.run("ip", "link", "set", "lo", "up")
        pod.run(
            INIT, "--mode", request.param, "--proxy-gid", str(GID),
            "--inbound-ports-to-ignore", "7001",
            "--outbound-ports-to-ignore", "5001,6000-6010",
            "--subnets-to-ignore", f"{IGNORED_SUBNET},{IGNORED_SUBNET6}",
        )  # fmt: skip
        pod.serve(
            "outbound-proxy@127.0.0.1:4140", "inbound-proxy@0.0.0.0:4143",
            "app@0.0.0.0:8080", "app@0.0.0.0:7001", "app@0.0.0.0:7002",
            "proxy-control@0.0.0.0:4190", "proxy-admin@0.0.0.0:4191", "local@127.0.0.1:8081",
            # the proxy's listeners on a dual-stack pod, and the app's
            "outbound-proxy@[::1]:4140", "inbound-proxy@[::]:4143", "app@[::]:8080",
            "app@[::]:7001", "local@[::1]:8081",
        )  # fmt: skip
        ports = (8080, 5000, 5001, 5999, 6000, 6010, 6011)
        remote.serve(*(f"remote@{host}:{p}" for p in ports for host in ("0.0.0.0", "[::]")))
        yield pod, remote
    finally:
        for ns in (pod, remote):
            for server in ns.servers:
                server.kill()
                server.communicate()
            subprocess.run(["ip", "netns", "del", ns.name], check=False)


@pytest.mark.netns
def test_outbound_tcp_reaches_the_proxy_with_its_original_destination(
    pods: tuple[Namespace, Namespace],
) -> None:
    pod, _ = pods
    assert pod.connect(REMOTE_IP, 8080) == f"outbound-proxy {REMOTE_IP}:8080"


@pytest.mark.netns
def test_the_proxys_group_is_not_redirected(pods: tuple[Namespace, Namespace]) -> None:
    """The proxy's own connections leave the pod directly: no loop back into the proxy."""
    pod, _ = pods
    assert pod.connect(REMOTE_IP, 8080, group=GID) == "remote -"
    assert pod.connect(REMOTE_IP, 8080, group=GID + 1) == f"outbound-proxy {REMOTE_IP}:8080"


@pytest.mark.netns
def test_the_proxys_user_is_not_redirected(pods: tuple[Namespace, Namespace]) -> None:
    pod, _ = pods
    uid = wellknown.PROXY_UID
    assert pod.connect_as(uid, GID + 100, REMOTE_IP, 8080) == "remote -"
    assert pod.connect_as(uid + 1, GID + 100, REMOTE_IP, 8080) == f"outbound-proxy {REMOTE_IP}:8080"


@pytest.mark.netns
def test_ignored_outbound_ports_bypass_the_proxy(pods: tuple[Namespace, Namespace]) -> None:
    pod, _ = pods
    for port in (5001, 6000, 6010):  # a port, then both ends of a range
        assert pod.connect(REMOTE_IP, port) == "remote -", port
    for port in (5000, 5999, 6011):  # their neighbours
        assert pod.connect(REMOTE_IP, port) == f"outbound-proxy {REMOTE_IP}:{port}"


@pytest.mark.netns
def test_ignored_subnets_bypass_the_proxy(pods: tuple[Namespace, Namespace]) -> None:
    pod, _ = pods
    assert pod.connect(REMOTE_IGNORED_IP, 8080) == "remote -"
    assert pod.connect(REMOTE_IP, 8080) == f"outbound-proxy {REMOTE_IP}:8080"  # same remote


@pytest.mark.netns
def test_loopback_is_not_redirected(pods: tuple[Namespace, Namespace]) -> None:
    pod, _ = pods
    assert pod.connect("127.0.0.1", 8081) == "local -"
    assert pod.connect(POD_IP, 8080) == "app -"  # the pod's own address goes over lo too
    assert pod.connect(REMOTE_IP, 8080) == f"outbound-proxy {REMOTE_IP}:8080"


@pytest.mark.netns
def test_inbound_tcp_reaches_the_proxys_inbound_port(pods: tuple[Namespace, Namespace]) -> None:
    _, remote = pods
    assert remote.connect(POD_IP, 8080) == f"inbound-proxy {POD_IP}:8080"
    assert remote.connect(POD_IP, 7002) == f"inbound-proxy {POD_IP}:7002"


@pytest.mark.netns
def test_ignored_inbound_ports_reach_the_app(pods: tuple[Namespace, Namespace]) -> None:
    _, remote = pods
    assert remote.connect(POD_IP, 7001) == "app -"
    assert remote.connect(POD_IP, 4190) == "proxy-control -"
    assert remote.connect(POD_IP, 4191) == "proxy-admin -"
    assert remote.connect(POD_IP, 7002) == f"inbound-proxy {POD_IP}:7002"  # the next port


@pytest.mark.netns
def test_ipv6_gets_the_same_redirects(pods: tuple[Namespace, Namespace]) -> None:
    """Without ip6tables rules a dual-stack pod's IPv6 traffic would pass around the proxy and
    its policy: outbound to the proxy's [::1]:4140 with its original destination, inbound to
    [::]:4143, the ignored ports and networks and the proxy's own group left alone, as on IPv4."""
    pod, remote = pods
    assert pod.connect(REMOTE_IP6, 8080) == f"outbound-proxy {REMOTE_IP6}:8080"
    assert pod.connect(REMOTE_IP6, 5001) == "remote -"  # an ignored port
    assert pod.connect(REMOTE_IGNORED_IP6, 8080) == "remote -"  # an ignored network
    assert pod.connect(REMOTE_IP6, 8080, group=GID) == "remote -"  # the proxy's own
    assert pod.connect("::1", 8081) == "local -"  # loopback
    assert remote.connect(POD_IP6, 8080) == f"inbound-proxy {POD_IP6}:8080"
    assert remote.connect(POD_IP6, 7001) == "app -"  # an ignored inbound port
