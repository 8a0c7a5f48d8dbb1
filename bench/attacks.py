"""One meshlet proxy under HTTP/2 attack, beside legitimate cancellations (`make bench`).

A real `meshlet-proxy` process (one hop, on its own CPU when there are two) relays h2c to an
upstream built on the `h2` library in a child process; the proxy's CPU is read from /proc.

- **rapid reset** (CVE-2023-44487): connections each sending 1,000 HEADERS + RST_STREAM pairs
  at once. Reported: the streams the upstream received per connection before the proxy's
  GOAWAY, the GOAWAY's code, and the proxy's CPU per attack stream sent.
- **cancellations**: a well-behaved client that cancels 1,000 requests once the upstream has
  them (a client giving up on long polls), 50 at a time. Reported: GOAWAYs it got (none is
  right) and CPU per cancelled request.
- **ordinary requests**: GETs answered at once, 50 in flight: CPU per request, the baseline.

    PYTHONPATH=testing python -m bench.attacks [--connections N] [--out bench/results/attacks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
)
from hpack import Encoder
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, RstStreamFrame, SettingsFrame

from bench.proxy_procs import (
    CpuMeter,
    Processes,
    local_proxy_env,
    wait_for_port,
    wait_for_ready,
)
from meshlet_testing.sockets import free_port, read_until_closed

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
RESULTS = Path(__file__).parent / "results"


# -- the upstream (a child process) --


class _Upstream(asyncio.Protocol):
    """Answers at once, except `/hold`, which it holds until the stream is reset; `/count`
    answers how many requests it received."""

    received = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except Exception as exc:  # the h2 library refused the proxy's bytes: say why
            print(f"upstream: {exc!r}", file=sys.stderr, flush=True)
            self.transport.close()
            return
        reset = {e.stream_id for e in events if isinstance(e, StreamReset)}
        for event in events:
            if isinstance(event, RequestReceived):
                path = dict(event.headers or ())[b":path"]
                if path == b"/count":
                    body = str(_Upstream.received).encode()
                    self.h2.send_headers(event.stream_id, [(b":status", b"200")])
                    self.h2.send_data(event.stream_id, body, end_stream=True)
                    continue
                _Upstream.received += 1
                if path != b"/hold" and event.stream_id not in reset:
                    self.h2.send_headers(event.stream_id, [(b":status", b"200")], end_stream=True)
        self.transport.write(self.h2.data_to_send())


async def _serve_upstream(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# -- clients --


def _request(port: int, upstream: int, path: bytes) -> list[tuple[bytes, bytes]]:
    return [(b":method", b"GET"), (b":scheme", b"http"), (b":path", path),
            (b":authority", b"127.0.0.1:%d" % upstream)]  # fmt: skip


class _Client:
    """An `h2` client over asyncio streams, reading in the background."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        self.ended: set[int] = set()
        self.goaways = 0
        self.changed = asyncio.Event()
        self.flush()
        self.task = asyncio.create_task(self._read())

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    async def _read(self) -> None:
        while data := await self.reader.read(65536):
            for event in self.h2.receive_data(data):
                if isinstance(event, StreamEnded | StreamReset):
                    self.ended.add(event.stream_id)
                elif isinstance(event, ConnectionTerminated):
                    self.goaways += 1
                elif isinstance(event, ResponseReceived):
                    pass
            self.flush()
            self.changed.set()

    async def until(self, done: Any) -> None:
        async with asyncio.timeout(30):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()


async def _count(port: int, upstream: int) -> int:
    """How many requests the upstream received so far (asked through the proxy)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    h2.initiate_connection()
    h2.send_headers(1, _request(port, upstream, b"/count"), end_stream=True)
    writer.write(h2.data_to_send())
    body = b""
    try:
        async with asyncio.timeout(10):
            while data := await reader.read(65536):
                for event in h2.receive_data(data):
                    if isinstance(event, DataReceived):
                        body += event.data or b""
                    elif isinstance(event, StreamEnded):
                        return int(body)
                writer.write(h2.data_to_send())
    finally:
        writer.close()
    raise ConnectionError("the proxy closed the connection before answering /count")


async def _rapid_reset(port: int, upstream: int) -> tuple[int, int | None, int]:
    """One attack connection: (streams sent, GOAWAY code, GOAWAY's last stream id)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    encoder = Encoder()
    frames: list[Frame] = [SettingsFrame(0)]
    for i in range(1000):
        sid = 2 * i + 1
        block = encoder.encode(_request(port, upstream, b"/x"))
        frames.append(HeadersFrame(sid, block, flags=["END_HEADERS", "END_STREAM"]))
        frames.append(RstStreamFrame(sid, error_code=8))
    with contextlib.suppress(ConnectionError):  # the proxy may close before it has all
        await loop.sock_sendall(sock, PREFACE + b"".join(f.serialize() for f in frames))
    received = await read_until_closed(sock, 30)
    code, last, pos = None, 0, 0
    while pos + 9 <= len(received):
        length = int.from_bytes(received[pos : pos + 3], "big")
        if received[pos + 3] == 0x7:
            frame = GoAwayFrame(0)
            frame.parse_body(memoryview(received[pos + 9 : pos + 9 + length]))
            code, last = frame.error_code, frame.last_stream_id
        pos += 9 + length
    return 1000, code, last


async def _cancellations(port: int, upstream: int, total: int) -> tuple[int, int]:
    """`total` requests cancelled once the upstream has them, 50 at a time, until the proxy
    sends a GOAWAY: (requests cancelled, GOAWAYs the client got)."""
    client = _Client(*await asyncio.open_connection("127.0.0.1", port))
    start = await _count(port, upstream)
    done = 0
    while done < total and not client.goaways:
        sids = []
        for _ in range(50):
            sid = client.h2.get_next_available_stream_id()
            client.h2.send_headers(sid, _request(port, upstream, b"/hold"), end_stream=True)
            sids.append(sid)
        client.flush()
        want = start + done + 50
        deadline = time.monotonic() + 10
        while await _count(port, upstream) < want and time.monotonic() < deadline:  # noqa: ASYNC110 - the upstream is another process
            await asyncio.sleep(0.002)
        if client.goaways:
            break
        for sid in sids:
            client.h2.reset_stream(sid, error_code=8)
        client.flush()
        done += 50
    await asyncio.sleep(0.2)
    goaways = client.goaways
    await client.close()
    return done, goaways


async def _ordinary(port: int, upstream: int, total: int) -> None:
    client = _Client(*await asyncio.open_connection("127.0.0.1", port))
    sent = 0
    while sent < total:
        batch = []
        for _ in range(50):
            sid = client.h2.get_next_available_stream_id()
            client.h2.send_headers(sid, _request(port, upstream, b"/"), end_stream=True)
            batch.append(sid)
        client.flush()
        await client.until(lambda b=batch: all(s in client.ended for s in b))
        sent += 50
    await client.close()


# -- the run --


@dataclass
class Row:
    scenario: str
    what: str
    cpu_us: float
    note: str


async def _measure(proxy_pid: int, port: int, upstream: int, connections: int) -> list[Row]:
    rows = []
    before = await _count(port, upstream)
    meter = CpuMeter(proxy_pid)
    outcomes = [await _rapid_reset(port, upstream) for _ in range(connections)]
    cpu = meter.stop()
    taken = await _count(port, upstream) - before - 1  # less the count request itself
    sent = sum(sent for sent, _, _ in outcomes)
    calm = sum(code == 11 for _, code, _ in outcomes)  # ENHANCE_YOUR_CALM
    lasts = sorted(last for _, _, last in outcomes)
    rows.append(Row(
        "rapid reset", f"{connections} connections x 1,000 HEADERS+RST_STREAM",
        cpu / sent * 1e6,
        f"GOAWAY ENHANCE_YOUR_CALM on {calm} of {connections} connections;"
        f" streams the upstream received per connection {taken / connections:.0f};"
        f" last stream id taken {lasts[0]}..{lasts[-1]}; CPU per stream the upstream got"
        f" {cpu / max(taken, 1) * 1e6:.0f} µs",
    ))  # fmt: skip
    meter = CpuMeter(proxy_pid)
    cancelled, goaways = await _cancellations(port, upstream, 1000)
    cpu = meter.stop()
    rows.append(Row("cancellations", "1,000 requests cancelled once the upstream had them",
                    cpu / max(cancelled, 1) * 1e6,
                    f"cancelled before any GOAWAY: {cancelled}; GOAWAYs the client got:"
                    f" {goaways}"))  # fmt: skip
    meter = CpuMeter(proxy_pid)
    await _ordinary(port, upstream, 5000)
    cpu = meter.stop()
    rows.append(Row("ordinary", "5,000 GETs, 50 in flight", cpu / 5000 * 1e6, "baseline"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "attacks.md")
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    if args.upstream:
        asyncio.run(_serve_upstream(args.upstream))
        return 0
    two = (os.cpu_count() or 1) >= 2
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp)) as procs:
        upstream = free_port()
        up, up_log = procs.start("upstream", [sys.executable, "-m", "bench.attacks",
                                              "--upstream", str(upstream)],
                                 cpu=0 if two else None)  # fmt: skip
        wait_for_port(upstream, up, up_log, 10)
        ports = {name: free_port() for name in ("outbound", "inbound", "admin", "control")}
        proxy, log = procs.start("meshlet", [sys.executable, "-m", "meshlet.proxy.main"],
                                 cpu=1 if two else None, env=local_proxy_env(ports))  # fmt: skip
        wait_for_ready(f"http://127.0.0.1:{ports['admin']}/ready", proxy, log, 20)
        rows = asyncio.run(_measure(proxy.pid, ports["outbound"], upstream, args.connections))
    lines = [
        "# One meshlet proxy under HTTP/2 attack (bench/attacks.py)",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; proxy CPU from /proc, the"
        " proxy pinned to CPU 1, the upstream and the clients to CPU 0 (on 2 CPUs)",
        "",
        "| scenario | load | proxy CPU µs per stream | notes |",
        "| --- | --- | ---: | --- |",
        *(f"| {r.scenario} | {r.what} | {r.cpu_us:.0f} | {r.note} |" for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
