"""Processes the proxy benchmark starts: pinned launches, /proc CPU and RSS, certain cleanup.

Every process runs in its own session so that stopping it stops its children too (nginx
workers); `Processes` stops whatever is still running when its `with` block ends, whether it
ends normally, by an exception or by Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

CLK_TCK = os.sysconf("SC_CLK_TCK")


class StartError(RuntimeError):
    """A process did not come up; the message says why (its last log lines included)."""


def _stat_fields(pid: int) -> list[str]:
    # the command name may contain spaces and parentheses: split after the last ')'
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree(*pids: int) -> list[int]:
    """`pids` and all of their live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """utime + stime of each live pid (all threads included), in seconds."""
    result = {}
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        result[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return result


def rss_kib(pids: Sequence[int]) -> int:
    """The summed VmRSS of the live pids."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


def machine_cpu() -> tuple[float, float]:
    """Seconds of CPU the whole machine has spent in user and system mode, and stolen by
    the hypervisor, since boot (the `cpu` line of /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, steal = (int(fields[i]) for i in (0, 1, 2, 7))
    return (user + nice + system) / CLK_TCK, steal / CLK_TCK


def own_cpu() -> float:
    """Seconds of CPU this process and its reaped children (and theirs) have used."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class CpuMeter:
    """CPU time process trees spend between `__init__` and `stop()`, summed over the trees (one
    per proxy process: two for a meshed pair), and their peak RSS, summed and of each tree."""

    def __init__(self, *roots: int) -> None:
        self.roots = roots
        self.trees = [tree(root) for root in roots]
        self.pids = [pid for pids in self.trees for pid in pids]
        self.before = cpu_seconds(self.pids)
        self.peak_each = [0] * len(roots)
        self.peak_rss_kib = 0
        self.sample()

    def sample(self) -> None:
        """Note the RSS now: cheap (the trees' pids are those found at the start)."""
        each = [rss_kib(pids) for pids in self.trees]
        self.peak_each = [max(a, b) for a, b in zip(self.peak_each, each, strict=True)]
        self.peak_rss_kib = max(self.peak_rss_kib, sum(each))

    def stop(self) -> float:
        """Seconds of CPU used since the meter started (children started since count fully)."""
        self.sample()
        after = cpu_seconds(tree(*self.roots))
        return sum(after[pid] - self.before.get(pid, 0.0) for pid in after)


def pinned(argv: Sequence[str], cpu: int | None) -> list[str]:
    """`argv` run on one CPU (through taskset, so forked workers inherit it), or as is."""
    if cpu is None or shutil.which("taskset") is None:
        return list(argv)
    return ["taskset", "-c", str(cpu), *argv]


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float, host: str = "127.0.0.1"
) -> None:
    """Until something accepts on `host`:`port`; StartError if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartError(f"exited with {proc.returncode}: {log_tail(log, 3)}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise StartError(f"nothing listening on port {port} after {timeout:g} s: {log_tail(log)}")


def wait_for_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until GET `url` answers 200 (a /ready endpoint); StartError if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartError(f"exited with {proc.returncode}: {log_tail(log, 3)}")
        with (
            contextlib.suppress(OSError),  # not listening yet, or 503 (urllib's HTTPError)
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.1)
    raise StartError(f"GET {url} did not answer 200 within {timeout:g} s: {log_tail(log)}")


def wait_for_line(text: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Until `text` appears in the process's log; StartError if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise StartError(f"exited with {proc.returncode}: {log_tail(log, 3)}")
        time.sleep(0.05)
    raise StartError(f"no {text!r} after {timeout:g} s: {log_tail(log)}")


def log_tail(log: Path, lines: int = 1) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no output)"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " / ".join(kept) or "(no output)"


class Processes:
    """Starts processes with their output in `logs`; stops all still running on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[subprocess.Popen[bytes]] = []
        self._count = 0

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in reversed(self.running):
            self.stop(proc)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cpu: int | None = None,
        env: Mapping[str, str] | None = None,
        group: int | None = None,
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """Start `argv`; returns the process and the file holding its stdout and stderr."""
        self._count += 1
        log = self.logs / f"{self._count:03d}-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                pinned(argv, cpu),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                group=group,
                start_new_session=True,
            )
        self.running.append(proc)
        return proc, log

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        """SIGTERM the process's session; SIGKILL whatever is left of it after `grace` s."""
        if proc in self.running:
            self.running.remove(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a stuck leader, or workers it left behind
        proc.wait()


def local_proxy_env(ports: Mapping[str, int]) -> dict[str, str]:
    """This process's environment without its MESHLET_PROXY_* settings, plus a meshlet proxy's
    four listeners on 127.0.0.1 at `ports` (outbound, inbound, admin, control), errors-only
    logs and a short grace period (nothing is in flight when a benchmark stops it)."""
    from meshlet.api.wellknown import PROXY_ENV_PREFIX, ProxyEnv

    env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
    env.update({
        ProxyEnv.OUTBOUND_LISTEN_ADDR: f"127.0.0.1:{ports['outbound']}",
        ProxyEnv.INBOUND_LISTEN_ADDR: f"127.0.0.1:{ports['inbound']}",
        ProxyEnv.ADMIN_LISTEN_ADDR: f"127.0.0.1:{ports['admin']}",
        ProxyEnv.CONTROL_LISTEN_ADDR: f"127.0.0.1:{ports['control']}",
        ProxyEnv.LOG: "error",
        ProxyEnv.SHUTDOWN_GRACE_PERIOD: "1s",
    })  # fmt: skip
    return env
