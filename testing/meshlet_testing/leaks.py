"""What a test leaves behind fails that test: tasks still pending a while after its fixtures
are torn down, threads still running, and transports, sockets or files left to the garbage
collector.

Without these checks a leak shows up later, somewhere else, or not at all: the event loop
cancels pending tasks without a word when it closes, and an unclosed transport warns only when
the collector finalizes it, often during another test, or fails the loop's close when its
handle is still busy."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import pytest

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
