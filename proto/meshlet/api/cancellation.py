"""Whether a retry loop's own task has been asked to stop, whatever a library made of the
`CancelledError`: the check every retry loop of the proxy and the control plane makes before it
tries again, and the way the proxy awaits grpclib so that the check can be trusted.

A loop that retries after an error must never retry after its own cancellation, and the exception
it caught cannot tell it which it was. grpclib wakes a task blocked on a stream that broke by
cancelling the task, then raises `StreamTerminatedError` (or `TimeoutError` past a deadline) in
place of the `CancelledError`. When the task's owner cancels it in the same instant (a shutdown
that also breaks the connections, a controller killed as its proxies stop), the owner's
`CancelledError` is replaced too: a loop that reopens broken streams then reopens them for ever,
and its owner waits for ever.

Python counts a task's pending cancellation requests (`Task.cancelling()`), so the count decides:
a loop makes an `OwnCancellation` when it begins, which notes the count, and calls `check()`
before each retry, which raises `CancelledError` once the count has grown. The count is the
owner's only if no library cancels the task itself: grpclib does, to wake it, and never withdraws
the request (one request, or two when a stream is reset and its connection then lost). So the
proxy awaits grpclib through `isolated`, in a task of its own that takes those wake-ups; an
`isolated` call raises `CancelledError` itself when its caller was cancelled meanwhile, whatever
the call ended with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class OwnCancellation:
    """The current task's cancellation requests as they stood when a loop began (outside a task,
    never requested)."""

    __slots__ = ("_since", "_task")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self._since = 0 if self._task is None else self._task.cancelling()

    @property
    def requested(self) -> bool:
        """The task has been asked to stop since the loop began."""
        return self._task is not None and self._task.cancelling() > self._since

    def check(self) -> None:
        """Raises CancelledError when the task has been asked to stop: call it where a caught
        error would be retried."""
        if self.requested:
            raise asyncio.CancelledError


async def isolated(call: Coroutine[Any, Any, T]) -> T:
    """Awaits `call` in a task of its own, so that a library that cancels the task it runs in to
    wake it (grpclib) never adds to the caller's count. Cancelling the caller cancels `call`; the
    caller then gets CancelledError whether `call` ended with it, with an error made of it, or
    with a result."""
    own = OwnCancellation()
    child = asyncio.ensure_future(call)
    child.add_done_callback(_retrieve)
    try:
        result = await child
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if own.requested:
            raise asyncio.CancelledError from exc
        raise
    finally:
        child.cancel()  # a no-op once it has ended
    own.check()
    return result


def _retrieve(child: asyncio.Future[Any]) -> None:
    """Marks the child's error as seen: whoever awaited it has it, or was cancelled."""
    if not child.cancelled():
        child.exception()
