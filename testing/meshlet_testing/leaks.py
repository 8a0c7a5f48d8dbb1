"""What a test leaves behind fails that test: tasks still pending a while after its fixtures
are torn down, threads still running, and transports, sockets or files left to the garbage
collector.

Without these checks a leak shows up later, somewhere else, or not at all: the event loop
cancels pending tasks without a word when it closes, and an unclosed transport warns only when
the collector finalizes it, often during another test, or fails the loop's close when its
handle is still busy."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Collection, Iterator

import pytest

from meshlet_testing.polling import eventually

TASK_GRACE = 5.0  # seconds a task may take to finish after the test's fixtures are torn down
THREAD_GRACE = 10.0  # seconds a thread the test started may take to finish after its teardown
# grpc.aio's completion-queue poller ("Thread-N (_poll_wrapper)") is grpc's own: it stops once
# no grpc.aio object is left, and pytest holds the fixtures' requests until after teardown.
GRPC_POLLER = "(_poll_wrapper)"
_THREADS_BEFORE = pytest.StashKey[set[threading.Thread]]()


@pytest.fixture(autouse=True)
def _no_task_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails an asyncio test that leaves a task pending after its fixtures are torn down (the
    loop would cancel it unseen). Set up before the test's other fixtures, so torn down after
    them, and before the loop closes."""
    if "_function_scoped_runner" not in request.fixturenames:
        yield
        return
    runner: asyncio.Runner = request.getfixturevalue("_function_scoped_runner")
    yield
    loop = runner.get_loop()
    if loop.is_closed():
        return
    # What was cancelled or stopped last gets a while to finish (a grpc.aio server's call
    # tasks end some loop turns after its stop returns; later still on a busy machine).
    pending = asyncio.all_tasks(loop)
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=TASK_GRACE))
    pending = {task for task in pending if not task.done()}
    if pending:
        message = f"the test left {len(pending)} task(s) pending: {pending}"
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        pytest.fail(message, pytrace=False)


def open_sockets() -> set[str]:
    """This process's open sockets (their inodes, as /proc names them: `socket:[N]`)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:"):
            found.add(target[len("socket:[") : -1])
    return found


def _tcp_inodes(ends: Collection[str | tuple[str, int]]) -> set[str]:
    """Inodes of the TCP sockets (IPv4) with either end on one of `ends`: an address (any
    port) or an (address, port)."""
    wanted = {
        socket.inet_aton(end)[::-1].hex().upper() if isinstance(end, str)
        else f"{socket.inet_aton(end[0])[::-1].hex().upper()}:{end[1]:04X}"
        for end in ends
    }  # fmt: skip
    found = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if {local, remote, local.split(":")[0], remote.split(":")[0]} & wanted:
                found.add(inode)
    return found


async def sockets_closed(
    before: set[str], ends: Collection[str | tuple[str, int]], within: float = 5.0
) -> None:
    """Runs the loop until every TCP socket this process opened since `before` (open_sockets)
    with an end on one of `ends` (an address, or an address and port) is closed, or `within`
    seconds passed: a TLS connection one in-process part closed finishes its close_notify
    exchange with its peer some loop turns later (later still on a busy machine), and must not
    be left to a loop that closes."""

    def gone() -> bool:
        return not (open_sockets() - before) & _tcp_inodes(ends)

    with contextlib.suppress(TimeoutError):  # what is left then, the leak checks report
        await eventually(gone, within)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_THREADS_BEFORE] = set(threading.enumerate())


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """While the test's fixtures are torn down (its event loop closed) and right after, under
    the test's warning filters: what the loop's close or the collector finalizes (an unclosed
    transport's ResourceWarning) fails this test, not whichever runs next, also when the
    teardown itself failed. Then waits a while for the threads the test started, and fails it
    if one still runs."""
    unraisable: list[str] = []

    def record(args: sys.UnraisableHookArgs) -> None:
        trace = "".join(traceback.format_exception(args.exc_value)) if args.exc_value else ""
        unraisable.append(f"{args.err_msg or 'Exception ignored in'}: {args.object!r}\n{trace}")

    previous, sys.unraisablehook = sys.unraisablehook, record
    try:
        try:
            yield
        finally:
            if isinstance(item, pytest.Function):
                item.funcargs.clear()  # the fixtures' values, torn down: theirs to collect too
            gc.collect()
    except BaseException as error:
        for text in unraisable:
            error.add_note(text)
        raise
    finally:
        sys.unraisablehook = previous
        # What survives is the session's (modules, caches): the next test's collection skips
        # it, and so costs what that test allocated, not the whole heap again.
        gc.freeze()
    if unraisable:
        pytest.fail("left to the garbage collector:\n" + "\n".join(unraisable), pytrace=False)
    before = item.stash.get(_THREADS_BEFORE, set())
    started = [t for t in threading.enumerate() if t not in before and GRPC_POLLER not in t.name]
    deadline = time.monotonic() + THREAD_GRACE
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [thread for thread in started if thread.is_alive()]
    if left:
        pytest.fail(f"the test left {len(left)} thread(s) running: {left}", pytrace=False)
