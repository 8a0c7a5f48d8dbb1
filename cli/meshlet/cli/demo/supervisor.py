"""The demo's processes and what it made, recorded so that `meshlet demo down` can undo a mesh
left running with `--keep` from another process.

Every process is one of this repository's commands (`meshlet-controller`, `meshlet-init`,
`meshlet-proxy`, `meshlet demo app`), started in its pod's namespace with `ip netns exec`, in a
session of its own (so that it outlives the demo with `--keep`), its output in a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from meshlet.cli.demo.topology import DEFAULT_NAME

STATE_FILE: Final = "state.json"
STOP_GRACE: Final = 5.0

# Console scripts and the modules behind them (used when the scripts are not installed).
_MODULES: Final = {
    "meshlet": "meshlet.cli.main",
    "meshlet-proxy": "meshlet.proxy.main",
    "meshlet-controller": "meshlet.controlplane.main",
    "meshlet-init": "meshlet.init.main",
}


def command(name: str) -> list[str]:
    """How to run the console script `name` of this installation."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", _MODULES[name]]


def state_root(name: str = DEFAULT_NAME) -> Path:
    """Where the local mesh called `name` keeps its files: the default's /run/meshlet-demo (as
    root), another's /run/meshlet-demo-<name>."""
    suffix = _suffix(name)
    if os.geteuid() == 0:
        return Path(f"/run/meshlet-demo{suffix}")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime, f"meshlet-demo{suffix}")
    return Path(f"/tmp/meshlet-demo-{os.getuid()}{suffix}")


def shm_folder(name: str = DEFAULT_NAME) -> str:
    """The memory-backed folder of the proxies' identities (their keys) of the mesh `name`."""
    return f"/dev/shm/meshlet-demo-{os.getuid()}{_suffix(name)}"


def _suffix(name: str) -> str:
    """What a mesh's name adds to the names of its folders: nothing for the default one."""
    return "" if name == DEFAULT_NAME else f"-{name}"


def records() -> list[Record]:
    """The records of every local mesh of this user: the default's, then the others' by name."""
    default = state_root()
    found = [r for r in (Record.load(default),) if r is not None]
    for folder in sorted(default.parent.glob(f"{default.name}-*")):
        record = Record.load(folder)
        if record is not None and record.root == str(folder):
            found.append(record)
    return found


@dataclass
class Record:
    """What a demo made, as written to its state file."""

    mode: str
    root: str  # the state folder: CA, manifests, tokens, logs
    shm: str  # the proxies' identity folders (memory-backed)
    netns: list[str] = field(default_factory=list)
    etc: list[str] = field(default_factory=list)  # /etc/netns/<ns> folders
    processes: dict[str, int] = field(default_factory=dict)  # name → pid
    started: float = field(default_factory=time.time)
    urls: dict[str, str] = field(default_factory=dict)  # what a user can reach, for --keep
    name: str = DEFAULT_NAME  # the mesh's name and slot: its Place
    slot: int = 0
    # The process the mesh lives and dies with (a test's), 0 for one that outlives its
    # command (`meshlet demo --keep`): when it is gone, the mesh is left over.
    owner: int = 0

    def save(self) -> None:
        path = Path(self.root, STATE_FILE)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, root: Path) -> Record | None:
        try:
            return cls(**json.loads((root / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None


class StartError(Exception):
    """A process could not start, or died, or never became ready; the message has its log."""


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    netns: str | None
    gid: int | None
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])


class Supervisor:
    def __init__(self, record: Record) -> None:
        self.record = record
        self.logs = Path(record.root, "logs")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, Process] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        gid: int | None = None,
    ) -> Process:
        proc = Process(name, argv, env or {}, netns, gid, self.logs / f"{name}.log")
        self.processes[name] = proc
        self._spawn(proc)
        return proc

    def _spawn(self, proc: Process) -> None:
        full = ["ip", "netns", "exec", proc.netns, *proc.argv] if proc.netns else proc.argv
        base = {k: v for k, v in os.environ.items() if not k.startswith("MESHLET_")}
        with proc.log.open("ab") as log:
            proc.popen = subprocess.Popen(
                full, env={**base, **proc.env}, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, group=proc.gid,
            )  # fmt: skip
        self.record.processes[proc.name] = proc.popen.pid
        self.record.save()

    def run_once(self, name: str, argv: list[str], *, netns: str | None = None) -> None:
        """Runs a command to completion (meshlet-init); StartError with its output on failure."""
        full = ["ip", "netns", "exec", netns, *argv] if netns else argv
        result = subprocess.run(full, capture_output=True, text=True, timeout=60, check=False)
        (self.logs / f"{name}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise StartError(f"{name} failed (exit {result.returncode}):\n{result.stderr}")

    def alive(self, name: str) -> bool:
        proc = self.processes.get(name)
        return proc is not None and proc.popen is not None and proc.popen.poll() is None

    def died(self) -> list[Process]:
        """Processes that exited on their own."""
        return [
            p for p in self.processes.values() if p.popen is not None and p.popen.poll() is not None
        ]

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.processes[name]
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.send_signal(sig)

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would end it."""
        proc = self.processes.pop(name)
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()
        self.record.processes.pop(name, None)
        self.record.save()

    def stop(self, name: str, grace: float = STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL after `grace`: an end the demo meant, not a failure."""
        proc = self.processes.pop(name)
        if proc.popen is not None and proc.popen.poll() is None:
            proc.popen.terminate()
            try:
                proc.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.record.processes.pop(name, None)
        self.record.save()

    def restart(self, name: str, proc: Process) -> None:
        self.processes[name] = proc
        self._spawn(proc)

    def wait_ready(self, name: str, url: str, within: float) -> None:
        """Until `url` answers 200; StartError if the process dies or `within` passes."""
        proc = self.processes[name]
        deadline = time.monotonic() + within
        while not http_ok(url):
            if proc.popen is not None and proc.popen.poll() is not None:
                raise StartError(f"{name} exited ({proc.popen.returncode}):\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise StartError(f"{name} not ready within {within:g}s ({url}):\n{proc.tail()}")
            time.sleep(0.05)

    def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM to every process, then SIGKILL to those still there after `grace`."""
        stop_pids(list(self.record.processes.values()), grace)
        for proc in self.processes.values():
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=0.1)
        self.record.processes.clear()
        self.record.save()


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status) == 200
    except (OSError, urllib.error.HTTPError):
        return False


def stop_pids(pids: list[int], grace: float, group: bool = True) -> None:
    """SIGTERM to each process group (each process, without `group`), then SIGKILL to those
    left after `grace` seconds."""
    kill = os.killpg if group else os.kill
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_runs(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(pid_runs(pid) for pid in pids):
        time.sleep(0.05)


def pid_runs(pid: int) -> bool:
    """Whether `pid` is still a running process (not a zombie waiting for its parent)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status.rsplit(")", 1)[-1].split()[0] != "Z"
