"""A proxy's memory goes back near its idle size after a burst (memory.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import cast

import h2.config
import h2.connection
import h2.events

from meshlet.api.wellknown import PROXY_ENV_PREFIX, ProxyEnv
from meshlet.proxy import memory
from meshlet_testing.sockets import free_port

BODY = b"x" * (4 << 20)
DOWNLOADS = 100


def test_the_c_librarys_trim_returns_freed_memory() -> None:
    trim = memory.malloc_trim()
    assert trim is not None  # glibc (Debian): the proxy's images and this machine
    chunks = [bytes(16384) for _ in range(4000)]  # 64 MiB from malloc, then freed
    del chunks
    assert trim() is True


_CHURN = """
import os, sys
from meshlet.proxy import memory

def minor_faults():
    with open("/proc/self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])

if sys.argv[1] == "keep":
    assert memory.keep_pages()
kept = []
before = minor_faults()
for _ in range(2000):
    read = os.urandom(16) * (262144 // 16)  # a read of 256 KiB, as uvloop's
    record = read[:200000] + b"x"  # what is made of it
    kept.append(bytes(600))  # and smaller objects that stay, between them
    del read, record
print((minor_faults() - before) / 2000)
"""


def test_freed_buffers_stay_in_the_heap_for_the_next_ones() -> None:
    """Buffers of a relay's size allocated and freed in turn: with the thresholds `keep_pages`
    sets, their pages are reused, not faulted in again (with glibc's defaults, 1.8 page faults
    per round here)."""
    done = subprocess.run([sys.executable, "-c", _CHURN, "keep"], capture_output=True,
                          text=True, check=True, timeout=60)  # fmt: skip
    assert float(done.stdout) < 0.5, done.stdout


class _Downloads(asyncio.Protocol):
    """An h2c upstream answering every request with BODY, as fast as windows allow."""

    def __init__(self, opened: list[asyncio.BaseTransport]) -> None:
        self.opened = opened

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.opened.append(transport)
        self.transport = cast(asyncio.Transport, transport)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        self.sent: dict[int, int] = {}
        self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.h2.send_headers(event.stream_id, [(":status", "200")])
                self.sent[event.stream_id] = 0
            elif isinstance(event, h2.events.StreamReset):
                self.sent.pop(event.stream_id, None)
        for sid, offset in list(self.sent.items()):
            while offset < len(BODY):
                size = min(self.h2.local_flow_control_window(sid), 16384, len(BODY) - offset)
                if size <= 0:
                    break
                self.h2.send_data(sid, BODY[offset : offset + size])
                offset += size
            self.sent[sid] = offset
        self.transport.write(self.h2.data_to_send())


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_after_a_burst_of_stalled_downloads_the_proxy_shrinks_back(tmp_path: Path) -> None:
    """100 HTTP/2 downloads of 4 MiB through a one-hop proxy whose clients never read: the
    proxy buffers each stream's window (it grows by 20 MiB or more). Once the clients are gone,
    within two trims its RSS is back within 40 % of that growth of its idle size (without the
    trim it stayed at the peak for good)."""
    loop = asyncio.get_running_loop()
    opened: list[asyncio.BaseTransport] = []
    upstream = await loop.create_server(lambda: _Downloads(opened), "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    outbound = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
    env.update({
        ProxyEnv.OUTBOUND_LISTEN_ADDR: f"127.0.0.1:{outbound}",
        ProxyEnv.INBOUND_LISTEN_ADDR: f"127.0.0.1:{free_port()}",
        ProxyEnv.ADMIN_LISTEN_ADDR: f"127.0.0.1:{free_port()}",
        ProxyEnv.CONTROL_LISTEN_ADDR: f"127.0.0.1:{free_port()}",
        ProxyEnv.LOG: "error",
    })  # fmt: skip
    log = (tmp_path / "proxy.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshlet.proxy.main", env=env, stdout=log, stderr=subprocess.STDOUT
    )
    clients: list[asyncio.StreamWriter] = []
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", outbound), 1).close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        idle = _rss_mib(proc.pid)
        for _ in range(DOWNLOADS):
            _, writer = await asyncio.open_connection("127.0.0.1", outbound)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            conn.send_headers(1, [(":method", "GET"), (":scheme", "http"),
                                  (":authority", f"127.0.0.1:{up_port}"), (":path", "/")],
                              end_stream=True)  # fmt: skip
            writer.write(conn.data_to_send())
            clients.append(writer)
        peak = idle
        for _ in range(50):  # until the windows are full: the RSS stops growing
            await asyncio.sleep(0.2)
            now = _rss_mib(proc.pid)
            if now - peak < 0.1 and now - idle >= 20:
                break
            peak = max(peak, now)
        grown = peak - idle
        assert grown >= 20, (idle, peak)
        for writer in clients:
            writer.transport.abort()
        for _ in range(int(2 * memory.TRIM_EVERY + 2) * 2):  # two trims, every half second
            after = _rss_mib(proc.pid)
            if after <= idle + 0.4 * grown:
                break
            await asyncio.sleep(0.5)
        assert after <= idle + 0.4 * grown, (idle, peak, after)
    finally:
        for writer in clients:
            writer.transport.abort()
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        log.close()
        upstream.close()
        for transport in opened:
            transport.abort()  # type: ignore[attr-defined]
        await upstream.wait_closed()
