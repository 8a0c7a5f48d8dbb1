"""A retry loop's own cancellation, whatever a library made of it (`meshlet.api.cancellation`).

The library here is grpclib's own `Wrapper`, the piece that wakes a task blocked on a stream
whose connection was lost: it cancels the task and raises its error in place of the
CancelledError, and never withdraws its request."""

from __future__ import annotations

import asyncio

import pytest
from grpclib.exceptions import StreamTerminatedError
from grpclib.utils import Wrapper

from meshlet.api.cancellation import OwnCancellation, isolated


async def blocked(wrapper: Wrapper, started: asyncio.Event) -> None:
    """A call blocked inside the library, as `recv_message` waits for the next message."""
    with wrapper:
        started.set()
        await asyncio.Event().wait()


async def start(isolate: bool) -> tuple[asyncio.Task[str], Wrapper]:
    started = asyncio.Event()
    wrappers: list[Wrapper] = []

    async def round_() -> str:
        own = OwnCancellation()
        wrapper = Wrapper()
        wrappers.append(wrapper)
        try:
            coro = blocked(wrapper, started)
            await (isolated(coro) if isolate else coro)
        except StreamTerminatedError:
            own.check()
            return "retry"
        return "ended"

    task = asyncio.create_task(round_())
    await started.wait()
    return task, wrappers[0]


def lost(wrapper: Wrapper) -> None:
    wrapper.cancel(StreamTerminatedError("Connection lost"))


@pytest.mark.parametrize("owner_cancels", [True, False], ids=["owner-cancels", "wake-up-alone"])
async def test_the_library_s_error_cannot_say_whether_the_owner_cancelled(
    owner_cancels: bool,
) -> None:
    """Why the rest exists: awaited directly, the library's wake-up alone and the wake-up that
    meets the owner's cancel both end in StreamTerminatedError, and both leave requests on the
    task (one, or two), so neither the error nor a bare count tells a retry loop to stop."""
    wrapper = Wrapper()
    started = asyncio.Event()
    task = asyncio.create_task(blocked(wrapper, started))
    await started.wait()
    lost(wrapper)
    if owner_cancels:
        task.cancel()
    with pytest.raises(StreamTerminatedError):
        await task
    assert task.cancelling() == (2 if owner_cancels else 1)


async def test_isolated_a_cancel_that_meets_the_library_s_wake_up_is_a_cancel() -> None:
    task, wrapper = await start(isolate=True)
    lost(wrapper)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_isolated_the_library_s_wake_up_alone_is_its_error_and_leaves_no_request() -> None:
    task, wrapper = await start(isolate=True)
    lost(wrapper)
    assert await task == "retry"
    assert task.cancelling() == 0


async def test_isolated_a_plain_cancel_is_a_cancel() -> None:
    task, _ = await start(isolate=True)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_isolated_a_call_that_swallows_the_cancel_still_ends_its_caller() -> None:
    """A call that answers although it was cancelled: its caller was cancelled all the same."""
    inside = asyncio.Event()

    async def stubborn() -> str:
        inside.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "an answer"
        return "never"

    async def caller() -> str:
        return await isolated(stubborn())

    task = asyncio.create_task(caller())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_isolated_passes_results_and_errors_through() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 7

    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("no")

    assert await isolated(answer()) == 7
    with pytest.raises(ValueError, match="no"):
        await isolated(fail())
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_own_cancellation_counts_only_requests_made_after_the_loop_began() -> None:
    """A request left by someone before the loop began is not the loop's to judge."""
    ready = asyncio.Event()
    go = asyncio.Event()
    seen: list[bool] = []

    async def loop() -> None:
        with pytest.raises(asyncio.CancelledError):  # an earlier request, swallowed
            ready.set()
            await asyncio.Event().wait()
        own = OwnCancellation()
        seen.append(own.requested)
        ready.clear()
        await go.wait()
        own.check()  # nothing new: no exception
        seen.append(own.requested)

    task = asyncio.create_task(loop())
    await ready.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    go.set()
    await task
    assert seen == [False, False]
    assert task.cancelling() == 1
