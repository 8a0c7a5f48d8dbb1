"""The demo's locks: one local mesh of a name, and one in a slot, at a time on a machine.

`meshlet demo` holds an exclusive `flock` on LOCK_FILE from before it builds until it has removed
everything it made (or left it running, with --keep); whatever else reads or changes what the
default mesh's place (slot 0: its names and addresses) holds it too, as any demo started by a
test does. A shell takes it with `flock /tmp/meshlet-demo.lock <command>`. A mesh with a name of
its own (`meshlet demo --name NAME`) holds its name's lock instead, and the lock of the slot it
found free (`claimed`). The kernel releases a lock with the process that held it, so a run that
was killed never leaves one held.
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

from meshlet.cli.demo.topology import SLOTS, Place

LOCK_FILE: Final = Path("/tmp/meshlet-demo.lock")
CLAIMS_FILE: Final = Path("/tmp/meshlet-demo-claims.lock")  # held while a slot is chosen
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


def name_file(name: str) -> Path:
    """The lock of the local mesh called `name` (the default's is LOCK_FILE, slot 0's too)."""
    return LOCK_FILE if Place(name).default else Path(f"/tmp/meshlet-demo-{name}.lock")


def slot_file(slot: int) -> Path:
    return LOCK_FILE if slot == 0 else Path(f"/tmp/meshlet-demo-slot{slot}.lock")


@contextlib.contextmanager
def claimed(
    name: str,
    within: float,
    reserved: Callable[[], dict[int, str]],
    busy: Callable[[], None] = lambda: None,
) -> Iterator[Place]:
    """The place of the local mesh `name`, held for the block: the default mesh's slot 0 under
    LOCK_FILE, as `held`; another's under its name's lock, in the first slot from 1 that no
    other mesh's record reserves (`reserved()`: slot → the name of the mesh recorded in it,
    called while no one else chooses) and no other process holds. LockBusy when every slot is
    taken, naming the meshes in them."""
    if Place(name).default:
        with held(within, busy):
            yield Place(name)
        return
    with held(within, busy, path=name_file(name)):
        fd = None
        with held(within, path=CLAIMS_FILE):
            taken = {slot: owner for slot, owner in reserved().items() if owner != name}
            for slot in range(1, SLOTS):
                if slot in taken:
                    continue
                fd = _take(slot_file(slot))
                if fd is not None:
                    break
        if fd is None:
            names = ", ".join(sorted(set(taken.values()))) or "none recorded"
            raise LockBusy(
                f"every local mesh slot (1-{SLOTS - 1}) is taken (meshes: {names});"
                " stop one with `meshlet demo down --name NAME`"
            )
        try:
            yield Place(name, slot)
        finally:
            os.close(fd)


def _take(path: Path) -> int | None:
    """A descriptor holding `path`'s lock, or None when another process holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
