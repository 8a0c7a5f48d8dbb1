"""The demo's network in netns mode: a bridge and one namespace per pod, as iproute2 commands.

`plan` and `teardown` are pure: lists of argv that `apply` runs (and a golden test pins). The
bridge carries the host's address (what scrapes the pods' admin ports, like a node reaching its
pods); the control plane gets a namespace of its own and no iptables rules; every pod namespace
has a veth on the bridge, its own address, and a default route through the bridge.
Deleting a namespace removes the veth in it and so its peer on the bridge: `teardown` deletes the
namespaces, then the bridge, then the per-namespace /etc files `ip netns exec` mounts.

The names of the bridge, the namespaces and the host's veths are the layout's place's (each
local mesh's its own) unless a `Names` is given: a test's network of pods lives beside running
demos under names of its own.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from meshlet.cli.demo.topology import Layout, Place, hosts_file

ETC_NETNS: Final = Path("/etc/netns")
Argv = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Member:
    """A namespace on the bridge: its name (`meshlet-web-1`), its veth on the bridge and its
    address."""

    netns: str
    veth: str
    ip: str


@dataclass(frozen=True, slots=True)
class Names:
    """What the bridge is called, and what each member's namespace and veth on the bridge are
    called after the member's name (a veth's whole name fits in 15 characters)."""

    bridge: str
    netns_prefix: str
    veth_prefix: str

    @classmethod
    def of(cls, place: Place) -> Names:
        return cls(place.bridge, place.netns_prefix, place.veth_prefix)


def members(layout: Layout, names: Names | None = None) -> list[Member]:
    names = names or Names.of(layout.place)

    def member(name: str, ip: str) -> Member:
        return Member(names.netns_prefix + name, names.veth_prefix + name, ip)

    return [member("control", layout.control_ip), *(member(p.name, p.ip) for p in layout.pods)]


def plan(layout: Layout, names: Names | None = None) -> list[Argv]:
    """The commands that build the network, in order."""
    names = names or Names.of(layout.place)
    bridge = names.bridge
    cmds: list[Argv] = [
        ("ip", "link", "add", bridge, "type", "bridge"),
        ("ip", "addr", "add", f"{layout.host_ip}/{layout.prefix}", "dev", bridge),
        ("ip", "link", "set", bridge, "up"),
    ]
    for m in members(layout, names):
        cmds += [
            ("ip", "netns", "add", m.netns),
            ("ip", "link", "add", m.veth, "type", "veth", "peer", "name", "eth0", "netns",
             m.netns),
            ("ip", "link", "set", m.veth, "master", bridge),
            ("ip", "link", "set", m.veth, "up"),
            ("ip", "-n", m.netns, "addr", "add", f"{m.ip}/{layout.prefix}", "dev", "eth0"),
            ("ip", "-n", m.netns, "link", "set", "eth0", "up"),
            ("ip", "-n", m.netns, "link", "set", "lo", "up"),
            ("ip", "-n", m.netns, "route", "add", "default", "via", layout.host_ip),
        ]  # fmt: skip
    return cmds


def teardown(netns: Sequence[str], bridge: str) -> list[Argv]:
    """The commands that remove what `plan` built (each may find its object already gone)."""
    return [*(("ip", "netns", "del", ns) for ns in netns), ("ip", "link", "del", bridge)]


def write_hosts(layout: Layout, hosts: str | None = None) -> list[Path]:
    """Each pod namespace's /etc/hosts (mounted by `ip netns exec`): `hosts`, else the demo's
    services; the folders made, /etc/netns itself first when it did not exist."""
    made = [] if ETC_NETNS.exists() else [ETC_NETNS]
    text = hosts_file(layout) if hosts is None else hosts
    for pod in layout.pods:
        folder = ETC_NETNS / layout.netns(pod.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(text)
        made.append(folder)
    return made


class NetworkError(Exception):
    """A command failed; the message says which and why."""


def apply(cmds: Sequence[Argv]) -> None:
    for argv in cmds:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            raise NetworkError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")


def undo(cmds: Sequence[Argv], folders: Sequence[Path]) -> list[str]:
    """Runs every teardown command and removes `folders`, whatever fails; the problems."""
    problems = []
    for argv in cmds:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        gone = "Cannot find device" in result.stderr or "No such file" in result.stderr
        if result.returncode != 0 and not gone:
            problems.append(f"`{' '.join(argv)}`: {result.stderr.strip()}")
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):  # deepest first
        if folder == ETC_NETNS:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: others may keep files there
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return problems


def existing_netns(prefix: str) -> list[str]:
    """The network namespaces whose name starts with `prefix`."""
    result = subprocess.run(("ip", "netns", "list"), capture_output=True, text=True, check=False)
    names = (line.split()[0] for line in result.stdout.splitlines() if line.strip())
    return [name for name in names if name.startswith(prefix)]


def pids_in(netns: str) -> list[int]:
    """The processes running in the network namespace `netns` (none when it is gone)."""
    result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                            timeout=30, check=False)  # fmt: skip
    return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()
