"""The supervisor of the controllers' background tasks: restarts, readiness, giving up."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import pytest

from meshlet.controlplane.supervise import MAX_FAILURES, Policy, Supervisor

QUICK = Policy(backoff=(0.01, 0.05))


class Task:
    """A background task whose runs the test ends: `fail()` makes the current run raise."""

    def __init__(self) -> None:
        self.runs = 0
        self.running = asyncio.Event()
        self._end: asyncio.Future[None] | None = None

    async def __call__(self) -> None:
        self.runs += 1
        self._end = asyncio.get_running_loop().create_future()
        self.running.set()
        try:
            await self._end
        finally:
            self.running.clear()

    def fail(self, exc: Exception) -> None:
        assert self._end is not None
        self._end.set_exception(exc)

    def end(self) -> None:
        assert self._end is not None
        self._end.set_result(None)


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polls state that no event announces
            await asyncio.sleep(0.005)


async def test_a_task_that_raises_is_unhealthy_at_once_then_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = Task()
    supervisor = Supervisor("destination", QUICK, rng=random.Random(1))
    supervisor.add("the source", task)
    running = asyncio.create_task(supervisor.run())
    await task.running.wait()
    assert supervisor.healthy
    with caplog.at_level(logging.ERROR):
        task.fail(RuntimeError("watch broke"))
        await until(lambda: not task.running.is_set())
        assert not supervisor.healthy
    await until(lambda: task.runs == 2 and supervisor.healthy)
    assert "the source stopped (RuntimeError: watch broke); destination is not ready" in caplog.text
    supervisor.stop()
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


async def test_a_task_that_keeps_failing_gives_up_after_max_failures() -> None:
    async def broken() -> None:
        raise OSError("no such file")

    supervisor = Supervisor("identity", QUICK, rng=random.Random(1))
    supervisor.add("the issuer watch", broken)
    async with asyncio.timeout(10):
        await supervisor.run()  # returns: the one task gave up
    assert supervisor.stopping.is_set()
    assert supervisor.failure == (
        f"the issuer watch failed {MAX_FAILURES} times in a row (last: OSError: no such file)"
    )
    assert not supervisor.healthy


async def test_returning_is_a_failure_before_shutdown_and_not_after() -> None:
    task = Task()
    supervisor = Supervisor("injector", QUICK)
    supervisor.add("the certificate watch", task)
    running = asyncio.create_task(supervisor.run())
    await task.running.wait()
    task.end()  # nobody asked it to stop
    await until(lambda: task.runs == 2 and task.running.is_set())
    supervisor.stop()
    task.end()
    async with asyncio.timeout(10):
        await running
    assert task.runs == 2
    assert supervisor.failure is None


async def test_a_long_run_makes_the_next_failure_the_first_in_a_row() -> None:
    now = [0.0]
    task = Task()
    policy = Policy(max_failures=2, backoff=(0.01, 0.05), healthy_run=60.0)
    supervisor = Supervisor("destination", policy, clock=lambda: now[0])
    supervisor.add("the source", task)
    running = asyncio.create_task(supervisor.run())
    for _ in range(3):  # three failures, each after an hour of service
        await task.running.wait()
        now[0] += 3600
        task.fail(RuntimeError("once an hour"))
        await until(lambda: not task.running.is_set())
    await until(lambda: task.runs == 4 and task.running.is_set())
    assert supervisor.failure is None
    task.fail(RuntimeError("at once"))  # the second in a row: gives up
    async with asyncio.timeout(10):
        await running
    assert supervisor.failure is not None
    assert supervisor.failure.startswith("the source failed 2 times in a row")


@pytest.mark.parametrize("made_of_it", ["an error", "a return"])
async def test_a_cancel_a_task_turns_into_an_error_or_a_return_ends_the_supervisor(
    made_of_it: str,
) -> None:
    """Cancelled without `stop()` (as when the TaskGroup above it is cancelled), a task whose
    library turns the CancelledError into an error of its own, or that swallows it, is never
    restarted: the supervisor ends."""

    async def swallowing() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if made_of_it == "an error":
                raise ConnectionResetError("stream terminated") from None

    supervisor = Supervisor("policy", QUICK, rng=random.Random(1))
    supervisor.add("the watch", swallowing)
    running = asyncio.create_task(supervisor.run())
    try:
        await asyncio.sleep(0.05)
        running.cancel()
        done, _ = await asyncio.wait({running}, timeout=2)
        assert done, "the supervisor restarted the cancelled task instead of ending"
        assert running.cancelled()
        assert supervisor.failure is None
    finally:
        supervisor.stop()
        running.cancel()
        await asyncio.wait({running}, timeout=2)
