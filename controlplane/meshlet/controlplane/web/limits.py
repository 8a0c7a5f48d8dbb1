"""What the dashboard's clients may hold of it: the time a request head may take to arrive
(`Heads`, pure, under `HeadGuard`, a protocol wrapped around aiohttp's), and the pages computed
at once (`Pages`).

Any page on the web a user's browser shows can send requests to a dashboard on the user's
loopback (`Host: 127.0.0.1:PORT` is a name it answers), so these bound what a page elsewhere, or
a client that never finishes, can take: a head that is not complete `head_timeout` seconds after
the connection was accepted, or after its first byte on a kept-alive connection, closes the
connection (a first head gets a 408); a page past the ones being computed and the few waiting for
a worker is answered 503 at once, not queued behind Prometheus for minutes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Final, TypeVar

T = TypeVar("T")

END_OF_HEAD: Final = b"\r\n\r\n"
TIMED_OUT: Final = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class Heads:
    """Whether a connection awaits a request head (sans-IO): from the accept until its end
    (`\\r\\n\\r\\n`), then again from the next byte. The dashboard takes GETs only; bytes after a
    head begin the next one."""

    def __init__(self) -> None:
        self.pending = True  # the first head is due from the accept
        self.answered = 0  # heads complete so far
        self._tail = b""  # the end of a partial head: an END_OF_HEAD split across reads

    def feed(self, data: bytes) -> bool:
        """Reads `data`; whether a head is (still, or newly) awaited after it."""
        buffer = self._tail + data
        while buffer:
            if not self.pending:
                self.pending = True  # a byte after a head: the next one has begun
            at = buffer.find(END_OF_HEAD)
            if at < 0:
                self._tail = buffer[-(len(END_OF_HEAD) - 1) :]
                return True
            self.pending, self.answered = False, self.answered + 1
            buffer = buffer[at + len(END_OF_HEAD) :]
        self._tail = b""
        return self.pending


class HeadGuard(asyncio.Protocol):
    """aiohttp's protocol for one connection, with its heads timed: one that is not complete
    within `timeout` seconds closes the connection (`on_timeout` counts it)."""

    def __init__(
        self, inner: asyncio.Protocol, timeout: float, on_timeout: Callable[[], None]
    ) -> None:
        self._inner = inner
        self._timeout = timeout
        self._on_timeout = on_timeout
        self._heads = Heads()
        self._timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        was = self._heads.pending
        now = self._heads.feed(data)
        if now and not was:
            self._arm()
        elif not now and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._on_timeout()
        if self._heads.answered == 0:  # nothing else was or is being written on it
            transport.write(TIMED_OUT)
        transport.close()


class Busy(Exception):
    """Every worker is computing a page and as many pages wait: answer 503 now."""


class Pages:
    """Pages computed in `workers` threads of their own, and at most `waiting` more waiting for
    one; a page past those raises `Busy` at once."""

    def __init__(self, workers: int, waiting: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="page")
        self._limit = workers + waiting
        self.admitted = 0  # pages being computed or waiting for a worker

    async def run(self, work: Callable[[], T]) -> T:
        if self.admitted >= self._limit:
            raise Busy(f"{self._limit} pages are being computed or wait for a worker")
        self.admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            self.admitted -= 1

    async def close(self) -> None:
        """Drops the pages not started, and waits for the running ones (each is bounded by its
        queries' timeouts)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, True)
