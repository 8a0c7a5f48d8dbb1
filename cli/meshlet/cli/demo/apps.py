"""The demo application, one process per pod (`meshlet demo app web|api|store|load`).

- **api** (gRPC, unary `/demo.Api/Quote`): answers with its pod name after `--delay` seconds;
  SIGUSR1 adds 200 ms (the slow-replica drill), SIGUSR2 takes it back. While the file
  `--fail-flag` exists (looked at every 0.1 s) it answers every call with INTERNAL, gRPC's
  500 (the failing-replica drill creates and removes it; `touch` does the same by hand).
- **store** (TCP, the server speaks first): `STORE <pod> ready`, then answers each `GET <key>`
  line with `VALUE <key> <pod>`.
- **web** (HTTP/1.1): every `GET /` calls api once (gRPC) and store once (a new TCP connection,
  timing its first byte), and answers with JSON naming who answered.
- **load** (HTTP/1.1 client): calls web at a fixed rate (open loop: a slow answer never delays
  the next call) and writes what it saw, as JSON, to `--stats` every second: the client's truth.
- **intruder** (the deny drill; runs in an api pod, so its connections leave through that pod's
  proxy with api's identity): connects to the store at a fixed rate and writes, as JSON to
  `--stats` every second, how each attempt ended: admitted (the store's banner came), refused
  (closed or reset before it), or failed otherwise.

Apps address services by name; in loopback mode (`--via-proxy`) they send HTTP and gRPC to
their proxy's outbound listener with the service as authority, as an app would with an HTTP
proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

import click

from meshlet.api.hostport import parse_hostport
from meshlet.cli.demo import topology

SLOW_DRILL_DELAY: Final = 0.2
FLAG_POLL: Final = 0.1  # seconds between an api's looks at its fault flag
LATENCY_BUCKETS_MS: Final = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
MAX_IN_FLIGHT: Final = 64  # load: calls past this are counted as dropped, not queued
# load: a call the generator itself reaches this many seconds after its time (the process was
# not scheduled: a busy machine) is counted late and not sent, so a pause of the client is never
# mistaken for the mesh holding calls (a burst of catch-up calls would count as dropped)
LATE_AFTER: Final = 1.0
CALL_TIMEOUT: Final = 5.0
KEEPALIVE_FOR: Final = 15.0  # seconds a load connection may sit idle and still be reused
SLOWEST_KEPT: Final = 120  # seconds of the load's slowest call per second kept in its stats


@click.group(hidden=True)
def app() -> None:
    """The demo application's processes (started by `meshlet demo`)."""


# -- api ---------------------------------------------------------------------------------------


@app.command()
@click.option("--listen", required=True, help="ip:port to serve on.")
@click.option("--pod", required=True, help="The pod's name, in every answer.")
@click.option("--delay", type=float, default=0.0, help="Seconds each answer waits.")
@click.option("--fail-flag", type=click.Path(path_type=Path), default=None,
              help="while this file exists, answer every call with INTERNAL")  # fmt: skip
def api(listen: str, pod: str, delay: float, fail_flag: Path | None) -> None:
    """gRPC: answers /demo.Api/Quote with its pod name."""
    asyncio.run(_api(listen, pod, delay, fail_flag))


async def _api(listen: str, pod: str, delay: float, fail_flag: Path | None = None) -> None:
    import grpc

    extra = [0.0]
    failing = [False]

    async def watch_flag(flag: Path) -> None:
        while True:
            failing[0] = await asyncio.to_thread(flag.exists)
            await asyncio.sleep(FLAG_POLL)

    async def quote(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        pause = delay + extra[0]
        if pause:
            await asyncio.sleep(pause)
        if failing[0]:
            await context.abort(grpc.StatusCode.INTERNAL, f"{pod} fails every call ({fail_flag})")
        return json.dumps({"pod": pod, "delay_ms": round(pause * 1000)}).encode()

    server = grpc.aio.server()
    handler: grpc.RpcMethodHandler[bytes, bytes] = grpc.unary_unary_rpc_method_handler(quote)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("demo.Api", {"Quote": handler}),)
    )
    server.add_insecure_port(listen)
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: extra.__setitem__(0, SLOW_DRILL_DELAY))
    loop.add_signal_handler(signal.SIGUSR2, lambda: extra.__setitem__(0, 0.0))
    watcher = loop.create_task(watch_flag(fail_flag)) if fail_flag is not None else None
    await _until_terminated()
    if watcher is not None:
        watcher.cancel()
    await server.stop(grace=1)


# -- store -------------------------------------------------------------------------------------


@app.command()
@click.option("--listen", required=True, help="ip:port to serve on.")
@click.option("--pod", required=True, help="The pod's name, in every answer.")
def store(listen: str, pod: str) -> None:
    """TCP, server speaks first: a banner, then GET <key> → VALUE <key> <pod>."""
    asyncio.run(_store(listen, pod))


async def _store(listen: str, pod: str) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"STORE {pod} ready\n".encode())
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                key = line.decode(errors="replace").strip().removeprefix("GET ")
                writer.write(f"VALUE {key} {pod}\n".encode())
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, *parse_hostport(listen))
    await _until_terminated()
    server.close()


# -- web ---------------------------------------------------------------------------------------


@app.command()
@click.option("--listen", required=True, help="ip:port to serve on.")
@click.option("--pod", required=True, help="The pod's name, in every answer.")
@click.option("--api", "api_addr", required=True, help="api's service address (name:port)")
@click.option("--store", "store_addr", required=True, help="store's address (name:port)")
@click.option("--via-proxy", default="", help="send HTTP and gRPC through this proxy")
def web(listen: str, pod: str, api_addr: str, store_addr: str, via_proxy: str) -> None:
    """HTTP/1.1: each GET calls api (gRPC) and store (TCP)."""
    asyncio.run(_web(listen, pod, api_addr, store_addr, via_proxy))


async def _web(listen: str, pod: str, api_addr: str, store_addr: str, via_proxy: str) -> None:
    import grpc

    options = [("grpc.default_authority", api_addr)] if via_proxy else []
    channel = grpc.aio.insecure_channel(via_proxy or api_addr, options=options)
    quote: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(topology.API_METHOD)

    async def call_store() -> tuple[str, float]:
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection(*parse_hostport(store_addr))
        try:
            banner = await reader.readline()
            first_byte_ms = (time.perf_counter() - started) * 1000
            writer.write(b"GET quote\n")
            answer = (await reader.readline()).decode().split()
            if not banner.startswith(b"STORE") or len(answer) != 3:
                raise ConnectionError(f"unexpected answer from store: {banner!r} {answer}")
            return answer[2], first_byte_ms
        finally:
            writer.close()

    async def handle() -> tuple[int, dict[str, Any]]:
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                reply = json.loads(await quote(b"{}"))
                store_pod, first_byte_ms = await call_store()
        except grpc.aio.AioRpcError as exc:
            return 502, {"error": f"api: {exc.code().name}: {exc.details()}"}
        except (OSError, TimeoutError) as exc:
            return 502, {"error": f"store: {exc!r}"}
        body = {"web": pod, "api": reply["pod"], "store": store_pod,
                "store_first_byte_ms": round(first_byte_ms, 2)}  # fmt: skip
        return 200, body

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                status, body = await handle()
                data = json.dumps(body).encode()
                close = b"connection: close" in head.lower()
                writer.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                    b"%s\r\n%s" % (status, b"OK" if status == 200 else b"Bad Gateway", len(data),
                                   b"connection: close\r\n" if close else b"", data)
                )  # fmt: skip
                await writer.drain()
                if close:
                    break
        writer.close()

    server = await asyncio.start_server(serve, *parse_hostport(listen))
    await _until_terminated()
    server.close()
    await channel.close()


# -- load --------------------------------------------------------------------------------------


def _reason(error: str) -> str:
    """web's error in a few words: `api: UNAVAILABLE: …` → `api: UNAVAILABLE`, `store:
    ConnectionRefusedError(…)` → `store: ConnectionRefusedError`."""
    words = error.split("(", 1)[0].split(": ")
    return ": ".join(words[:2])[:60]


class _Stats:
    """What the load generator saw, cumulative since it started."""

    def __init__(self) -> None:
        self.started = time.time()
        self.sent = self.ok = self.dropped = self.late = 0
        self.lag_max = 0.0  # seconds: the longest the generator woke past a call's time
        self.failed: Counter[str] = Counter()
        self.why: Counter[str] = Counter()  # web's reasons for its errors: "api: UNAVAILABLE"
        self.latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.by_api: Counter[str] = Counter()
        self.by_store: Counter[str] = Counter()
        self.store_first_byte_max = 0.0
        self.store_first_byte = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.recent: list[tuple[float, str, str]] = []  # (time, outcome, api pod), last 30 s
        # the slowest call that ended in each second (Unix time), the last SLOWEST_KEPT of them
        self.slowest: dict[int, float] = {}

    def observe(self, ms: float, buckets: list[int]) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS_MS):
            if ms <= bound:
                buckets[i] += 1
                return
        buckets[-1] += 1

    def record(self, outcome: str, ms: float, body: dict[str, Any] | None) -> None:
        now = time.time()
        if outcome == "ok" and body is not None:
            self.ok += 1
            self.observe(ms, self.latency)
            self.by_api[str(body.get("api"))] += 1
            self.by_store[str(body.get("store"))] += 1
            first = float(body.get("store_first_byte_ms", 0.0))
            self.store_first_byte_max = max(self.store_first_byte_max, first)
            self.observe(first, self.store_first_byte)
        else:
            self.failed[outcome] += 1
            if body is not None and isinstance(body.get("error"), str):
                self.why[_reason(body["error"])] += 1
        self.recent.append((now, outcome, str(body.get("api")) if outcome == "ok" and body else ""))
        second = int(now)
        self.slowest[second] = max(self.slowest.get(second, 0.0), ms)
        if len(self.slowest) > SLOWEST_KEPT:
            del self.slowest[min(self.slowest)]
        while self.recent and self.recent[0][0] < now - 30:
            self.recent.pop(0)

    def as_json(self) -> dict[str, Any]:
        return {
            "started": self.started, "now": time.time(), "sent": self.sent, "ok": self.ok,
            "dropped": self.dropped, "late": self.late, "lag_max_ms": round(self.lag_max * 1000),
            "failed": dict(self.failed), "why": dict(self.why),
            "latency_buckets_ms": list(LATENCY_BUCKETS_MS), "latency": self.latency,
            "by_api": dict(self.by_api), "by_store": dict(self.by_store),
            "store_first_byte_max_ms": round(self.store_first_byte_max, 2),
            "store_first_byte": self.store_first_byte, "recent": self.recent,
            "slowest": [[second, round(ms, 2)] for second, ms in sorted(self.slowest.items())],
        }  # fmt: skip


@app.command()
@click.option("--target", required=True, help="web's service address (name:port)")
@click.option("--rate", type=float, default=20.0, help="calls per second")
@click.option("--stats", "stats_file", required=True, type=click.Path(path_type=Path),
              help="The JSON file of counts, rewritten every second.")  # fmt: skip
@click.option("--via-proxy", default="", help="send the calls through this proxy")
def load(target: str, rate: float, stats_file: Path, via_proxy: str) -> None:
    """Calls web at a fixed rate, writing what it saw to --stats every second."""
    asyncio.run(_load(target, rate, stats_file, via_proxy))


async def _load(target: str, rate: float, stats_file: Path, via_proxy: str) -> None:
    stats = _Stats()
    # kept-alive connections and when each was last used: one idle for KEEPALIVE_FOR is closed
    # rather than reused, as aiohttp's client does, before a server's idle timeout (the proxy's
    # is 60 s) can close it under a request (a reused connection's EOF: IncompleteReadError);
    # one that answered an error is not reused: a name resolved to a Service's address just
    # before it was deleted (a DNS cache's answer, for up to its TTL) is looked up again
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []
    in_flight = 0
    connect_to = parse_hostport(via_proxy or target)
    request = f"GET / HTTP/1.1\r\nHost: {target}\r\nuser-agent: meshlet-demo-load\r\n\r\n".encode()

    async def call() -> None:
        nonlocal in_flight
        in_flight += 1
        started = time.perf_counter()
        conn = None
        while idle and conn is None:
            reader, writer, since = idle.pop()
            if started - since < KEEPALIVE_FOR:
                conn = (reader, writer)
            else:
                writer.close()
        try:
            async with asyncio.timeout(CALL_TIMEOUT):
                if conn is None:
                    conn = await asyncio.open_connection(*connect_to)
                reader, writer = conn
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(
                    line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if ": " in line
                )
                length = int({k.lower(): v for k, v in fields.items()}.get("content-length", 0))
                body = await reader.readexactly(length)
            status = int(head.split(b" ", 2)[1])
            ms = (time.perf_counter() - started) * 1000
            if status == 200:
                stats.record("ok", ms, json.loads(body))
            else:
                try:
                    said = json.loads(body)
                except ValueError:
                    said = None
                stats.record(f"http {status}", ms, said if isinstance(said, dict) else None)
            if status == 200:
                idle.append((*conn, time.perf_counter()))
            else:  # the next call connects afresh, resolving the name again
                conn[1].close()
        except TimeoutError:
            stats.record("timeout", (time.perf_counter() - started) * 1000, None)
            if conn is not None:
                conn[1].transport.abort()
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            stats.record(type(exc).__name__, (time.perf_counter() - started) * 1000, None)
            if conn is not None:
                conn[1].transport.abort()
        finally:
            in_flight -= 1

    def write_stats() -> None:
        tmp = stats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats.as_json()))
        os.replace(tmp, stats_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks: set[asyncio.Task[None]] = set()
    interval = 1.0 / rate
    next_call = next_write = loop.time()
    try:
        while not stop.is_set():
            now = loop.time()
            if now >= next_write:
                write_stats()
                next_write += 1.0
            while next_call <= now:
                due, next_call = next_call, next_call + interval
                stats.lag_max = max(stats.lag_max, now - due)
                if now - due > LATE_AFTER:
                    stats.late += 1
                    continue
                stats.sent += 1
                if in_flight >= MAX_IN_FLIGHT:
                    stats.dropped += 1
                    continue
                task = loop.create_task(call())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, min(next_call, next_write) - now))
        if tasks:
            await asyncio.wait(tasks, timeout=CALL_TIMEOUT)
        write_stats()
    finally:
        for _, writer, _ in idle:
            writer.close()


# -- intruder ----------------------------------------------------------------------------------

INTRUDER_TIMEOUT: Final = 3.0  # seconds an attempt waits for the store's banner


def store_attempt(banner: bytes | None, error: BaseException | None) -> str:
    """How a connection to the store ended: `admitted` once its banner came; `refused` when the
    mesh closed or reset it before the banner (what a denial looks like to a TCP client);
    otherwise what went wrong."""
    if error is None and banner is not None and banner.startswith(b"STORE "):
        return "admitted"
    if error is None and banner == b"":
        return "refused"
    if isinstance(error, ConnectionResetError | asyncio.IncompleteReadError | BrokenPipeError):
        return "refused"
    if isinstance(error, TimeoutError):
        return "timeout"
    if error is not None:
        return type(error).__name__
    return "unexpected banner"


@app.command()
@click.option("--target", required=True, help="store's service address (name:port)")
@click.option("--rate", type=click.FloatRange(min=0.1, max=100), default=5.0,
              help="attempts per second")  # fmt: skip
@click.option("--stats", "stats_file", required=True, type=click.Path(path_type=Path),
              help="The JSON file of counts, rewritten every second.")  # fmt: skip
def intruder(target: str, rate: float, stats_file: Path) -> None:
    """Connects to the store at a fixed rate, writing how each attempt ended to --stats."""
    asyncio.run(_intruder(target, rate, stats_file))


async def _intruder(target: str, rate: float, stats_file: Path) -> None:
    outcomes: Counter[str] = Counter()
    started = time.time()

    async def attempt() -> str:
        banner: bytes | None = None
        error: BaseException | None = None
        writer = None
        try:
            async with asyncio.timeout(INTRUDER_TIMEOUT):
                reader, writer = await asyncio.open_connection(*parse_hostport(target))
                banner = await reader.readline()
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            error = exc
        finally:
            if writer is not None:
                writer.transport.abort()
        return store_attempt(banner, error)

    def write_stats() -> None:
        data = {"started": started, "now": time.time(), "attempts": sum(outcomes.values()),
                "outcomes": dict(outcomes)}  # fmt: skip
        tmp = stats_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, stats_file)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    next_attempt = next_write = loop.time()
    while not stop.is_set():
        if loop.time() >= next_attempt:  # one at a time: a slow attempt delays the next
            next_attempt = max(next_attempt + 1.0 / rate, loop.time())
            outcomes[await attempt()] += 1
        if loop.time() >= next_write:
            write_stats()
            next_write += 1.0
        with contextlib.suppress(TimeoutError):
            wait = min(next_attempt, next_write) - loop.time()
            await asyncio.wait_for(stop.wait(), max(0.0, wait))
    write_stats()


async def _until_terminated() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


if __name__ == "__main__":  # the demo image runs `python -m meshlet.cli.demo.apps APP …`
    app()
