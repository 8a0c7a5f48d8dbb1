"""A stream's listener: a bounded queue between publishers and one gRPC stream."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

M = TypeVar("M")


class Overflow(Exception):
    """The stream's client fell behind and its queue filled up."""


class Listener(Generic[M]):
    """Publishers `offer` messages without ever waiting; a full queue marks the listener
    overflowed and wakes its stream, which then ends: a slow client never stalls others."""

    def __init__(self, capacity: int, on_overflow: Callable[[], None] | None = None) -> None:
        self._queue: deque[M] = deque()
        self._capacity = capacity
        self._wakeup = asyncio.Event()
        self._on_overflow = on_overflow
        self.overflowed = False

    def offer(self, messages: Sequence[M]) -> None:
        if self.overflowed or not messages:
            return
        if len(self._queue) + len(messages) > self._capacity:
            self.overflowed = True
            self._queue.clear()
            if self._on_overflow is not None:
                self._on_overflow()
        else:
            self._queue.extend(messages)
        self._wakeup.set()

    async def get(self) -> M:
        """The next message; raises Overflow once the listener overflowed."""
        while not self._queue:
            if self.overflowed:
                raise Overflow
            self._wakeup.clear()
            await self._wakeup.wait()
        if self.overflowed:
            raise Overflow
        return self._queue.popleft()
