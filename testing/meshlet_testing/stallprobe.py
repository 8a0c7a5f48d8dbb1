"""Does a proxy's traffic keep flowing? A process of its own (so that an attack run by the test
does not slow the measure): an HTTP/1.1 upstream on 127.0.0.1, and requests to it through the
proxy's outbound listener, one after another on a keep-alive connection, each timed.

    python -m meshlet_testing.stallprobe --via 127.0.0.1:4140

It prints `{"ready": true}` once the first request came back, then runs until its stdin
closes, and prints `{"requests": N, "failures": F, "longest": S, "median": S}`: the longest
request (seconds) is the longest the proxy stalled this traffic. A request that fails (or
takes over 30 s) is counted and the connection opened again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Final

REQUEST_TIMEOUT: Final = 30.0


_WRITERS: set[asyncio.StreamWriter] = set()


async def _upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _WRITERS.add(writer)
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        _WRITERS.discard(writer)
        writer.close()


class Client:
    def __init__(self, via: tuple[str, int], upstream: int) -> None:
        self.via = via
        self.request = b"GET /probe HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % upstream
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self) -> None:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(*self.via)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200 "):
            raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        await self.reader.readexactly(length)

    def drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def main(via: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(_upstream, "127.0.0.1", 0)
    stop = asyncio.Event()

    def read_stdin() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=read_stdin, daemon=True).start()
    client = Client(via, server.sockets[0].getsockname()[1])
    took: list[float] = []
    failures = 0
    ready = False
    while not stop.is_set():
        started = time.monotonic()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await client.get()
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            failures += 1
            client.drop()
            print(f"probe: {exc!r}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.01)
            continue
        took.append(time.monotonic() - started)
        if not ready:
            ready = True
            print(json.dumps({"ready": True}), flush=True)
    client.drop()
    server.close()
    for writer in list(_WRITERS):
        writer.close()  # its handler sees the end and returns
    await asyncio.sleep(0.05)
    summary = {
        "requests": len(took),
        "failures": failures,
        "longest": max(took, default=0.0),
        "median": statistics.median(took) if took else 0.0,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", required=True, help="HOST:PORT of the proxy's outbound listener")
    args = parser.parse_args()
    host, _, port = args.via.rpartition(":")
    asyncio.run(main((host, int(port))))
