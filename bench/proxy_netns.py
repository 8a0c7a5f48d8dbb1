"""The proxy benchmark's own network namespace, and the iptables REDIRECT of its TCP client.

As root the benchmark re-executes itself under `unshare --net`: a namespace of its own with only
a loopback device, where it may add iptables rules without touching the host's. The TCP client
(iperf3) runs with group CLIENT_GID, and for each proxy's TCP row one rule in the nat table's
OUTPUT chain sends that group's connections to the upstream to the proxy's TCP listener, as
meshlet-init's rules send an application's connections to its sidecar; the proxy reads where
the connection was going with SO_ORIGINAL_DST. Only the client's group is matched, so the
proxies' own connections to the upstream are left alone. A REDIRECT in OUTPUT lands on
127.0.0.1, so every proxy's TCP listener is there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Final

NETNS_ENV: Final = "MESHLET_BENCH_IN_NETNS"
CLIENT_GID: Final = 47110  # the TCP client's gid, which the REDIRECT matches


def inside() -> bool:
    """Whether this process is the re-executed benchmark in its own network namespace."""
    return bool(os.environ.get(NETNS_ENV))


def enter(module: str, argv: list[str]) -> None:
    """Re-run `python -m module argv` in a fresh network namespace (root only; this process is
    replaced); returns if it cannot."""
    if inside() or shutil.which("unshare") is None:
        return
    os.environ[NETNS_ENV] = "1"
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, "-m", module, *argv])


def loopback_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def redirect_rule(action: str, host: str, port: int | str, to_port: int | str) -> list[str]:
    """The iptables command that adds (`-A`) or deletes (`-D`) the rule sending the TCP
    client's connections for `host`:`port` to 127.0.0.1:`to_port`."""
    return (
        f"iptables -t nat {action} OUTPUT -p tcp -d {host} --dport {port} "
        f"-m owner --gid-owner {CLIENT_GID} -j REDIRECT --to-ports {to_port}"
    ).split()


def unavailable() -> str:
    """ "" when rules can be added here, else why not."""
    if not inside():
        return "needs the bench's own network namespace (root, no --no-netns) for iptables"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    return ""


@contextlib.contextmanager
def redirected(host: str, port: int, to_port: int) -> Iterator[None]:
    """The REDIRECT rule in place for the `with` block; RuntimeError if iptables refuses it."""
    added = subprocess.run(redirect_rule("-A", host, port, to_port), capture_output=True, text=True)
    if added.returncode:
        raise RuntimeError(f"iptables REDIRECT failed: {added.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(redirect_rule("-D", host, port, to_port), capture_output=True)
