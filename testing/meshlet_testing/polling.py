"""Waiting in tests for what no event announces: poll a condition against a deadline generous
enough for a busy machine, never sleep a guessed time and hope."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# A condition that holds within this on an idle machine in milliseconds; the slack is for a
# machine whose cores are busy with something else.
DEADLINE = 10.0


async def eventually(condition: Callable[[], bool], within: float = DEADLINE) -> None:
    """Returns once `condition()` holds; fails with TimeoutError after `within` seconds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polls state that no event announces
            await asyncio.sleep(0.01)
