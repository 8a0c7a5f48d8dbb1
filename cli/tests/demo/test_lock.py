"""The demo's lock (`meshlet.cli.demo.lock`) against real `flock`s held by other processes: the
holder found in /proc/locks, a wait with its limit, a lock a killed holder left, and a lock
held by the process that started this one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlet.cli.demo import lock, topology

HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX)"


@contextlib.contextmanager
def holding(path: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """A process that takes the lock on `path`, says so, and holds it for `seconds` (killed
    at the end of the block if still there)."""
    code = f"{HOLD}; print('held', flush=True); time.sleep({seconds})"
    with subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        try:
            yield proc
        finally:
            proc.kill()


def test_held_by_another_process_it_waits_then_says_which_file(tmp_path: Path) -> None:
    path = tmp_path / "demo.lock"
    told: list[str] = []
    with holding(path, 30):
        started = time.monotonic()
        with (
            pytest.raises(lock.LockBusy, match=f"{path} stayed locked for 0.3s"),
            lock.held(0.3, busy=lambda: told.append("busy"), path=path),
        ):
            pytest.fail("entered a lock another process holds")
        assert 0.3 <= time.monotonic() - started < 5
    assert told == ["busy"]


def test_a_lock_whose_holder_ends_or_is_killed_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "demo.lock"
    with holding(path, 0.5) as ends, lock.held(10, path=path):  # waits for its half second
        assert ends.wait(5) == 0  # taken as the holder let go, on its way out
    with holding(path, 60) as killed:
        killed.kill()
        killed.wait()
        with lock.held(0, path=path):  # the kernel released it with the process
            pass


def test_busy_may_give_up_at_once(tmp_path: Path) -> None:
    path = tmp_path / "demo.lock"

    def refuse() -> None:
        raise RuntimeError("a demo is already running")

    with holding(path, 30):
        started = time.monotonic()
        with (
            pytest.raises(RuntimeError, match="already running"),
            lock.held(30, busy=refuse, path=path),
        ):
            pytest.fail("entered a lock another process holds")
        assert time.monotonic() - started < 5


def test_a_lock_held_by_the_process_that_started_this_one_is_this_ones(tmp_path: Path) -> None:
    """`flock FILE meshlet demo`, or a test holding the lock while it runs a demo: the demo
    runs at once under its caller's lock, which an unrelated process still cannot take."""
    path = tmp_path / "demo.lock"
    inner = (
        "import sys; from pathlib import Path; from meshlet.cli.demo import lock\n"
        "with lock.held(0, path=Path(sys.argv[1])): print('ran')\n"
    )
    script = (
        f"{HOLD}\n"
        "import subprocess\n"
        f"subprocess.run([sys.executable, '-c', {inner!r}, sys.argv[1]], check=True)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=30
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "ran\n"
    with holding(path, 30):
        unrelated = subprocess.run(
            [sys.executable, "-c", inner, str(path)], capture_output=True, text=True, timeout=30
        )
    assert unrelated.returncode != 0 and "LockBusy" in unrelated.stderr


def test_holders_reads_proc_locks(tmp_path: Path) -> None:
    path = tmp_path / "demo.lock"
    with holding(path, 30) as other, path.open() as f:
        assert lock.holders(f.fileno()) == {other.pid}
    with path.open() as f:
        assert lock.holders(f.fileno()) == set()


def test_a_waiter_gets_the_lock_before_a_holder_that_takes_it_again_at_once(
    tmp_path: Path,
) -> None:
    """As back-to-back demo tests in one lane would (each lets go, the next takes it within
    milliseconds), while a test of the machine's network in the other lane waits."""
    path = tmp_path / "demo.lock"
    churn = (
        "import fcntl, sys, time\n"
        "f = open(sys.argv[1], 'a')\n"
        "for i in range(600):\n"
        "    fcntl.flock(f, fcntl.LOCK_EX)\n"
        "    if i == 0: print('held', flush=True)\n"
        "    time.sleep(0.05)\n"
        "    fcntl.flock(f, fcntl.LOCK_UN)\n"
        "    time.sleep(0.0005)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", churn, str(path)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            started = time.monotonic()
            with lock.held(20, path=path):
                waited = time.monotonic() - started
            assert waited < 2, f"waited {waited:.1f}s through the holder's quick turns"
        finally:
            holder.kill()


@pytest.fixture
def lock_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The named meshes' lock files in a folder of this test's (the machine's stay untouched)."""
    monkeypatch.setattr(lock, "name_file", lambda name: tmp_path / f"name-{name}.lock")
    monkeypatch.setattr(lock, "slot_file", lambda slot: tmp_path / f"slot{slot}.lock")
    monkeypatch.setattr(lock, "CLAIMS_FILE", tmp_path / "claims.lock")
    return tmp_path


def test_meshes_of_other_names_claim_free_slots_side_by_side(lock_files: Path) -> None:
    """Each named mesh gets the first slot from 1 that no record reserves for another name and
    no other process holds; its own record's slot is its to take again."""
    reserved = {1: "old"}  # a mesh called old is recorded in slot 1 (running, or died)
    with (
        lock.claimed("a", 1.0, lambda: reserved) as a,
        holding(lock_files / "slot3.lock", 30),  # another process is choosing slot 3
        lock.claimed("b", 1.0, lambda: reserved) as b,
        lock.claimed("c", 1.0, lambda: reserved) as c,
    ):
        assert (a.slot, b.slot, c.slot) == (2, 4, 5)
        assert (a.name, b.name, c.name) == ("a", "b", "c")
    with lock.claimed("old", 1.0, lambda: reserved) as old:
        assert old.slot == 1  # its own leftovers are its own


def test_a_mesh_of_a_name_being_built_is_waited_for_and_every_slot_taken_is_an_error(
    lock_files: Path,
) -> None:
    with (
        holding(lock_files / "name-a.lock", 30),
        pytest.raises(lock.LockBusy, match=r"name-a\.lock stayed locked"),
        lock.claimed("a", 0.2, dict),
    ):
        pass
    everyone = {slot: f"m{slot}" for slot in range(1, topology.SLOTS)}
    with (
        pytest.raises(lock.LockBusy, match=r"every local mesh slot .* taken .*m1, m10"),
        lock.claimed("new", 0.2, lambda: everyone),
    ):
        pass
    with lock.claimed("new", 0.2, dict) as place:  # the failed claim held nothing
        assert place.slot == 1
