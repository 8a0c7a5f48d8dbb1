"""gRPC traffic that the proxy must leave alone, driven with grpcio (a client nobody here wrote):
a storm of deadline expiries beside ordinary calls on one channel."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc


@dataclass
class Storm:
    """What a deadline storm's calls ended with, and how long it took."""

    deadlines: Counter[grpc.StatusCode] = field(default_factory=Counter)  # the slow calls
    replies: list[bytes] = field(default_factory=list)  # the ordinary calls', in order
    seconds: float = 0.0


async def deadline_storm(
    slow: Any, ordinary: Any, waves: int = 10, expiring: int = 100, deadline: float = 0.2
) -> Storm:
    """`waves` times: `expiring` calls of `slow` (a method that answers only after its caller's
    deadline) with `deadline`, beside ten ordinary calls of `ordinary` (a unary method echoing
    its request), all at once on the same channel. The requests of the ordinary calls are
    b"0", b"1", ... in order."""
    storm = Storm()

    async def expire() -> None:
        try:
            await slow(b"", timeout=deadline)
        except grpc.aio.AioRpcError as error:
            storm.deadlines[error.code()] += 1

    loop = asyncio.get_running_loop()
    started = loop.time()
    for wave in range(waves):
        calls = [ordinary(b"%d" % (10 * wave + i), timeout=5) for i in range(10)]
        got = await asyncio.gather(*calls, *(expire() for _ in range(expiring)))
        storm.replies += [bytes(reply) for reply in got[:10]]
    storm.seconds = loop.time() - started
    return storm
