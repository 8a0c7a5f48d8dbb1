"""Instructions per proxied request (callgrind): a measure of the proxy's own work that a busy or
noisy machine does not change, beside `bench.proxy`'s CPU time.

    python -m bench.instructions [--baseline REV] [--requests N]

For HTTP/1.1 and HTTP/2 (h2c, prior knowledge) one hop, meshlet's proxy runs under `valgrind
--tool=callgrind`; one client sends requests one after the other on one connection to an upstream
that answers `200 ok` at once (outside valgrind). Each count is taken twice, with WARMUP requests
and with WARMUP + N, and the difference divided by N: start-up, imports and the first requests'
caches cancel out, and what is left is the instructions of one request (user space: the kernel's
share of a request, its syscalls, is not counted). With `--baseline REV` the same is measured
for revision REV's proxy (bench/proxy_baseline.py), and the table gives the ratio now/then.
Each row is also held to its instruction budget (bench/budget.py, bench/instructions-budget.json):
the table marks a row more than 2 % over it. `--check` (CI) exits 1 when a row is over;
`--record` lowers the budget of each row now below it (the budget only goes down). Without
valgrind on the machine it says so and exits 0 (`--check`: 2, a check that cannot run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import h2.config
import h2.connection
import h2.events

from bench import budget, proxy_baseline
from bench.proxy_procs import local_proxy_env
from meshlet.api.wellknown import PROXY_ENV_PREFIX
from meshlet_testing.sockets import free_port

REPO: Final = Path(__file__).resolve().parent.parent
WARMUP: Final = 300
REQUESTS: Final = 1000
START_TIMEOUT: Final = 300.0  # seconds for a proxy under valgrind to listen (it is ~50x slower)
_TOTAL: Final = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)


# -- the upstream: a subprocess answering 200 "ok" on HTTP/1.1 and on h2c --------------------

UPSTREAM: Final = """
import asyncio, sys
import h2.config, h2.connection, h2.events

class H1(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        while b"\\r\\n\\r\\n" in self.buffer:
            _, self.buffer = self.buffer.split(b"\\r\\n\\r\\n", 1)
            self.transport.write(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")

class H2(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())
    def data_received(self, data):
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.h2.send_headers(event.stream_id, [(":status", "200"),
                                                       ("content-length", "2")])
                self.h2.send_data(event.stream_id, b"ok", end_stream=True)
        self.transport.write(self.h2.data_to_send())

async def main():
    loop = asyncio.get_running_loop()
    host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    await loop.create_server(H1, host, int(sys.argv[1]))
    await loop.create_server(H2, host, int(sys.argv[2]))
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextmanager
def upstream(host: str = "127.0.0.1") -> Iterator[tuple[int, int]]:
    ports = free_port(), free_port()
    with subprocess.Popen([sys.executable, "-c", UPSTREAM, *map(str, ports), host],
                          stdout=subprocess.PIPE, text=True) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield ports
        finally:
            proc.terminate()


# -- clients: N requests one after the other on one connection --------------------------------


def h1_requests(port: int, upstream_port: int, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        h1_exchange(sock, f"127.0.0.1:{upstream_port}", count)


def h1_exchange(
    sock: socket.socket,
    authority: str,
    count: int,
    headers: Sequence[tuple[str, str]] = (),
    path: str = "/",
) -> None:
    """`count` GETs of `path` for `authority` (with `headers`) one after the other on `sock`,
    each answered."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    request = f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode()
    for _ in range(count):
        sock.sendall(request)
        got = b""
        while not got.endswith(b"ok"):
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the proxy closed the connection")
            got += data


def h2_requests(port: int, upstream_port: int, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        h2_exchange(sock, f"127.0.0.1:{upstream_port}", count)


def h2_exchange(
    sock: socket.socket,
    authority: str,
    count: int,
    headers: Sequence[tuple[str, str]] = (),
    path: str = "/",
) -> None:
    """`count` GETs of `path` for `authority` (with `headers`) one after the other on `sock` (h2
    prior knowledge)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    headers = [(":method", "GET"), (":scheme", "http"),
               (":authority", authority), (":path", path), *headers]  # fmt: skip
    for _ in range(count):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, headers, end_stream=True)
        sock.sendall(conn.data_to_send())
        done = False
        while not done:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the proxy closed the connection")
            for event in conn.receive_data(data):
                done = done or (isinstance(event, h2.events.StreamEnded)
                                and event.stream_id == sid)  # fmt: skip
            if out := conn.data_to_send():
                sock.sendall(out)


CLIENTS: Final[dict[str, tuple[Callable[[int, int, int], None], int]]] = {
    # name: (client, which upstream port)
    "HTTP/1.1": (h1_requests, 0),
    "HTTP/2 (h2c)": (h2_requests, 1),
}


# -- one count -------------------------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the proxy did not listen within {START_TIMEOUT:g}s")


def count(pythonpath: str | None, client: str, upstream_ports: tuple[int, int], n: int,
          scratch: Path) -> int:  # fmt: skip
    """Instructions of one proxy's whole life, serving `n` requests of `client`."""
    ports = {name: free_port() for name in ("outbound", "inbound", "admin", "control")}
    # The proxy's settings and nothing else of this process's environment: the names in it
    # moved a count by up to 1.2 % (run by make, which adds MAKELEVEL and MAKEFLAGS, against
    # the same command typed), the values' lengths not at all.
    env = {k: v for k, v in local_proxy_env(ports).items() if k.startswith(PROXY_ENV_PREFIX)}
    env["PATH"] = os.environ.get("PATH", os.defpath)
    # One hash seed for both counts: their dicts and sets then lay out alike, so start-up cancels
    # out (a random seed moved a count by about 1 %).
    env["PYTHONHASHSEED"] = "0"
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    out = scratch / f"callgrind.{n}.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         sys.executable, "-m", "meshlet.proxy.main"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(ports["outbound"], proc)
        run, which = CLIENTS[client]
        run(ports["outbound"], upstream_ports[which], n)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    return total(out)


def total(out: Path) -> int:
    """The instructions counted in callgrind's output file `out`."""
    match = _TOTAL.search(out.read_text())
    if match is None:
        raise RuntimeError(f"no total in {out}")
    return int(match.group(1))


def compile_tree(pythonpath: str | None) -> None:
    """Writes the byte code of every module of the proxy's tree (`pythonpath`'s, else this
    one's) before counting: a module compiled during one count and not the other (the first
    run after an edit) moved a count by its whole size, once below zero."""
    code = (
        "import compileall, meshlet, sys; "
        "sys.exit(not all([compileall.compile_dir(d, quiet=2) for d in meshlet.__path__]))"
    )
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)


def per_request(pythonpath: str | None, client: str, upstream_ports: tuple[int, int],
                requests: int) -> float:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="meshlet-instructions-") as scratch:
        low = count(pythonpath, client, upstream_ports, WARMUP, Path(scratch))
        high = count(pythonpath, client, upstream_ports, WARMUP + requests, Path(scratch))
    return (high - low) / requests


# -- the table -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REV", help="also measure revision REV's proxy")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a row is more than 2%% over its budget")  # fmt: skip
    parser.add_argument(
        "--record",
        metavar="REV",
        help="lower the budget of each row now below it, naming revision REV",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("instructions per request: valgrind is not installed here; nothing measured")
        return 2 if args.check else 0
    rows: list[tuple[str, float, float | None]] = []
    with upstream() as ports, _baseline(args.baseline) as base:
        compile_tree(None)
        if base is not None:
            compile_tree(base.pythonpath)
        for client in CLIENTS:
            print(f"{client} ...", file=sys.stderr, flush=True)
            now = per_request(None, client, ports, args.requests)
            then = per_request(base.pythonpath, client, ports, args.requests) if base else None
            rows.append((client, now, then))
    budgets = budget.load()
    verdicts = {client: budget.judge(client, now, budgets) for client, now, _ in rows}
    print("\n## Instructions per request (callgrind, one hop, user space)\n")
    print("\n".join(table(rows, verdicts, f"meshlet@{base.short}" if base else "")))
    if args.record:
        changed = budget.record({client: now for client, now, _ in rows}, args.record)
        print(f"\nbudget lowered: {', '.join(changed) or 'no row'} ({budget.FILE.name})")
    over = [client for client, verdict in verdicts.items() if verdict.over]
    if over:
        print(f"\nover the instruction budget: {', '.join(over)}", file=sys.stderr)
    unbudgeted = [client for client, verdict in verdicts.items() if verdict.budget is None]
    if args.check and unbudgeted:
        print(f"\nno instruction budget for: {', '.join(unbudgeted)}", file=sys.stderr)
    return 1 if args.check and (over or unbudgeted) else 0


def table(rows: Sequence[tuple[str, float, float | None]], verdicts: dict[str, budget.Verdict],
          baseline: str = "") -> list[str]:  # fmt: skip
    """The rows (protocol, now, then) as a Markdown table, each with its budget's verdict."""
    head = ["protocol", "meshlet", "budget", "now/budget"]
    if baseline:
        head += [baseline, "now/then"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for client, now, then in rows:
        verdict = verdicts[client]
        limit = f"{verdict.budget:,.0f}" if verdict.budget is not None else "-"
        cells = [client, f"{now:,.0f}", limit, verdict.cell]
        if baseline:
            cells += [f"{then:,.0f}", f"**{now / then:.3f}x**"] if then else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@contextmanager
def _baseline(rev: str | None) -> Iterator[proxy_baseline.Baseline | None]:
    if rev is None:
        yield None
        return
    with proxy_baseline.checked_out(REPO, rev) as base:
        yield base


if __name__ == "__main__":
    sys.exit(main())
