"""The demo's lock: one local mesh at a time on a machine, and no test of the machine's own
network beside it.

`meshlet demo` holds an exclusive `flock` on LOCK_FILE from before it builds until it has removed
everything it made; whatever else reads or changes the machine's network state that a demo
changes or relies on (its fixed names and addresses, the host's iptables) holds it too: the tests
of `meshlet-init`'s refusal to touch the host, and any demo started by a test. A shell takes it
with `flock /tmp/meshlet-demo.lock <command>`. The kernel releases it with the process that
held it, so a run that was killed never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

LOCK_FILE: Final = Path("/tmp/meshlet-demo.lock")
POLL: Final = 0.05  # seconds between attempts, off the main thread, while another holds it


class LockBusy(Exception):
    """The lock stayed held for as long as the caller would wait."""


def _open(path: Path) -> int:
    """A descriptor of the lock file, made when missing; read-only, which `flock` needs no more
    than, so that another user's file can be locked (and no O_CREAT meets another user's file in
    a sticky /tmp, which fs.protected_regular refuses even to root)."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        try:
            return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            continue  # made meanwhile by another process: open that one
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def holders(fd: int, proc: Path = Path("/proc")) -> set[int]:
    """The processes holding a `flock` on the file open as `fd`, as /proc/locks names them
    (the process that took each lock)."""
    st = os.fstat(fd)
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = (proc / "locks").read_text().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter's line, not a holder's
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == file:
            found.add(int(fields[4]))
    return found


def ancestors(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """`pid`'s parent, its parent's parent, and so on up to PID 1."""
    found = set()
    while pid > 1:
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        found.add(pid)
    return found


@contextlib.contextmanager
def held(
    within: float,
    busy: Callable[[], None] = lambda: None,
    path: Path = LOCK_FILE,
) -> Iterator[None]:
    """Holds the lock for the block. When another process holds it, `busy()` is called once
    (it may raise, to give up at once, or say that this waits), then the lock is waited for up
    to `within` seconds; LockBusy after that, naming the file. Held by a process this one
    descends from (`flock /tmp/meshlet-demo.lock meshlet demo`, a test that holds it while it
    runs a demo), it is this process's already: the block runs at once."""
    fd = _open(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if holders(fd) & ancestors(os.getpid()):
                yield
                return
            busy()
            _wait(fd, within, path)
        yield
    finally:
        os.close(fd)  # releases the lock


def _wait(fd: int, within: float, path: Path) -> None:
    """Takes the lock within `within` seconds, else LockBusy. In the main thread the wait is
    the kernel's (a blocking `flock` that a timer interrupts): a waiter is woken as the holder
    lets go, before a holder that takes it again a moment later (back-to-back demo tests)
    would; elsewhere it polls."""
    busy = LockBusy(
        f"{path} stayed locked for {within:g}s (another demo, or a test of the machine's"
        " network, is running)"
    )
    if within > 0 and threading.current_thread() is threading.main_thread():

        def expired(signum: int, frame: object) -> None:
            raise busy

        previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, within)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return
    deadline = time.monotonic() + within
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise busy from None
            time.sleep(POLL)
