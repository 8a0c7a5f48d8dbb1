"""Whose network namespace this is: meshlet-init refuses to change the machine's own.

Run by hand on a host, the rules would send all of the host's outbound TCP to a proxy port where
nothing may listen. The machine's own namespace is the one its first process lives in: PID 1,
or, where PID 1's namespace cannot be read (as for root without ptrace rights over it), the
kernel thread kthreadd (PID 2), which always lives in the initial namespaces.

Inside a container with its own PID namespace (a Kubernetes init container), PID 1 is the
container's own first process, not the machine's, so the machine's namespace cannot be seen from
there; the namespace is then taken as the pod's, which the container runtime chose. A
hostNetwork pod is not meshed (the injector skips it), so nothing there runs meshlet-init.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# The inode number of the initial PID namespace, fixed since Linux 3.8 (PROC_PID_INIT_INO).
INITIAL_PID_NS_INO: Final = 0xEFFFFFFC


@dataclass(frozen=True, slots=True)
class NsId:
    """A namespace as the kernel names it: the device and inode of its /proc/<pid>/ns link."""

    dev: int
    ino: int


@dataclass(frozen=True, slots=True)
class Facts:
    own_net: NsId | None  # None: unreadable (no /proc)
    own_pid_ns: NsId | None
    machine_net: NsId | None  # the network namespace of PID 1 (or kthreadd); None: unreadable
    problem: str = ""  # why something could not be read


class Where(enum.Enum):
    MACHINE = "the machine's own network namespace"
    OWN = "a network namespace of its own"
    CONTAINER = "a container with its own PID namespace"
    UNKNOWN = "a network namespace that cannot be told apart from the machine's"

    @property
    def allowed(self) -> bool:
        return self in (Where.OWN, Where.CONTAINER)


def where(facts: Facts) -> Where:
    if facts.own_net is None or facts.own_pid_ns is None:
        return Where.UNKNOWN
    if facts.own_pid_ns.ino != INITIAL_PID_NS_INO:
        return Where.CONTAINER
    if facts.machine_net is None:
        return Where.UNKNOWN
    return Where.MACHINE if facts.own_net == facts.machine_net else Where.OWN


def refusal(facts: Facts, cleanup: bool, inbound_port: int, outbound_port: int) -> str | None:
    """What to tell a user whose command is refused where `facts` place it; None: allowed."""
    place = where(facts)
    if place.allowed:
        return None
    if place is Where.UNKNOWN:
        first = (
            "cannot tell whether this is the machine's own network namespace or a pod's"
            f" ({facts.problem})"
        )
    else:
        first = "this is the machine's own network namespace (its first process's), not a pod's"
    if cleanup:
        effect = "cleaning up would delete meshlet-init's chains from this machine's nat table"
        example = "ip netns exec <ns> meshlet-init cleanup"
    else:
        effect = (
            f"applying would redirect all of this machine's outbound TCP to port {outbound_port}"
            f" and its inbound TCP to port {inbound_port}, where no proxy may be listening,"
            " so that new TCP connections to and from this machine fail"
        )
        example = "ip netns exec <ns> meshlet-init"
    return (
        f"refusing to {'clean up' if cleanup else 'apply'}: {first}; {effect}. Run it inside a"
        f" pod's network namespace, e.g. `{example}`, or pass --force"
    )


def read_facts(proc: Path = Path("/proc")) -> Facts:
    """The namespaces of this process and of the machine's first process, from /proc."""
    try:
        own_net, own_pid_ns = _ns(proc / "self/ns/net"), _ns(proc / "self/ns/pid")
    except OSError as exc:
        return Facts(None, None, None, f"{exc.filename}: {exc.strerror}")
    try:
        return Facts(own_net, own_pid_ns, _ns(proc / "1/ns/net"))
    except OSError as first:
        problem = f"{proc}/1/ns/net: {first.strerror}"
    try:
        if (proc / "2/comm").read_text().strip() == "kthreadd":
            return Facts(own_net, own_pid_ns, _ns(proc / "2/ns/net"))
        problem += f"; {proc}/2 is not kthreadd"
    except OSError as second:
        problem += f"; {proc}/2/ns/net: {second.strerror}"
    return Facts(own_net, own_pid_ns, None, problem)


def _ns(path: Path) -> NsId:
    info = os.stat(path)
    return NsId(info.st_dev, info.st_ino)
