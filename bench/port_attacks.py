"""One meshlet proxy's tap and admin ports under attack: memory and stalls
(`python -m bench.port_attacks`).

A real `meshlet-proxy` process, certified by a real identity service, serves tap and admin on
127.0.0.1 (meshlet_testing.tapproc). For each attack a fresh proxy is started (for the admin
attacks, with requests for 600 authorities relayed first, so that its /metrics is some 5 MB
and takes a few hundred milliseconds to render); meanwhile a probe process
(meshlet_testing.stallprobe) sends requests through the proxy's outbound listener one after
another. Reported per attack: the proxy's resident memory before, at its peak (sampled every
20 ms) and after (once the attack is over and the connections are gone), the longest and the
median request of the probe (the longest the attack held the proxy's traffic up), and what the
attacker got back.

    PYTHONPATH=testing python -m bench.port_attacks [--proxy-src DIR] [--only TEXT]
        [--out bench/results/port_attacks.md]

`--proxy-src DIR` runs the processes from another checkout's `proxy/` and `proto/` folders (to
measure a version before a change; `git archive REV proxy proto | tar -x -C DIR` makes one);
the clients run from this one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import os
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from meshlet_testing import tapproc
from meshlet_testing.tapproc import (
    DATA,
    GOAWAY,
    HEADERS,
    OTHER_ID,
    TAP_ID,
    Probe,
    RawH2,
    TapProxy,
    any_of,
    call_head,
    frame,
    goaway_code,
    grpc_prefix,
)
from meshlet_testing.testca import make_ca

MiB: Final = 1 << 20
RESULTS: Final = Path(__file__).parent / "results"


class Peak:
    """The proxy's RSS, sampled every 20 ms while a `with` block runs."""

    def __init__(self, proxy: TapProxy) -> None:
        self.proxy = proxy
        self.mib = proxy.rss_mib()
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, AssertionError):
                self.mib = max(self.mib, self.proxy.rss_mib())

    def __enter__(self) -> Peak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Row:
    attack: str
    before: float
    peak: float
    after: float
    longest: float
    median: float
    got: str


Attack = Callable[[TapProxy, Callable[[str | None], Any]], str]


def _data(sid: int, total: int) -> Iterator[bytes]:
    chunk = frame(DATA, 0, sid, b"\0" * 16384)
    for _ in range(total // 16384):
        yield chunk


def _answers(client: RawH2) -> str:
    parts = []
    for kind, _, sid, payload in client.received:
        if kind == HEADERS and b"grpc-status" in payload:
            parts.append(f"grpc-status {payload[b'grpc-status'].decode()} on stream {sid}")
        elif kind == GOAWAY:
            parts.append(f"GOAWAY {goaway_code(payload):#x}")
    if client.closed:
        parts.append("closed by the proxy")
    return "; ".join(parts) or "nothing"


def _got(*clients: RawH2) -> str:
    """What the attacker got back on its connections, in a few words."""
    answers = sorted({_answers(c) for c in clients})
    taken = [c.sent / MiB for c in clients]
    took = f"{taken[0]:.1f}" if len(clients) == 1 else f"{min(taken):.1f}-{max(taken):.1f}"
    each = "" if len(clients) == 1 else f"each of {len(clients)} connections: "
    return f"{each}{' / '.join(answers)}; {took} MiB taken by the proxy"


def nothing(proxy: TapProxy, _: Callable[[str | None], Any]) -> str:
    time.sleep(5)
    return "nothing: the machine's own noise, for comparison"


def no_certificate(proxy: TapProxy, context: Callable[[str | None], Any]) -> str:
    refused = 0
    for _ in range(200):
        client = RawH2(proxy.control, context(None))
        answered = lambda frames: any(k in (HEADERS, GOAWAY) for k, *_ in frames)  # noqa: E731
        client.exchange([call_head(1, end=True)], within=5, until=answered)
        refused += client.closed and not client.received
        client.close()
    return f"{refused} of 200 handshakes refused ({200 - refused} served HTTP/2)"


def message_of(identity: str, declared: int, sent: int, flow_control: bool = True) -> Attack:
    """A call declaring a `declared`-byte message and sending `sent` bytes of it: within the
    windows the proxy grants (as any HTTP/2 client does), or regardless of them."""

    def attack(proxy: TapProxy, context: Callable[[str | None], Any]) -> str:
        client = RawH2(proxy.control, context(identity))
        body = grpc_prefix(declared)
        if flow_control:
            client.send(call_head(1))
            client.upload(1, body, sent, within=60)
            client.exchange(within=5)
        else:
            head = [call_head(1), frame(DATA, 0, 1, body)]
            client.exchange(itertools.chain(head, _data(1, sent)), within=30)
        client.close()
        return _got(client)

    return attack


def huge_match(proxy: TapProxy, context: Callable[[str | None], Any]) -> str:
    """An ObserveRequest whose match is `any` of 1,000,000 empty matches, sent by the rules."""
    message = any_of(1_000_000)
    client = RawH2(proxy.control, context(TAP_ID))
    started = time.monotonic()
    client.send(call_head(1))
    client.upload(1, grpc_prefix(len(message)) + message, within=60)
    client.exchange(within=30, until=lambda frames: any(k == HEADERS for k, *_ in frames))
    client.close()
    return f"{_got(client)}; answered in {time.monotonic() - started:.2f} s"


def rapid_reset(identity: str) -> Attack:
    def attack(proxy: TapProxy, context: Callable[[str | None], Any]) -> str:
        clients = [RawH2(proxy.control, context(identity)) for _ in range(3)]
        threads = [
            threading.Thread(target=c.exchange, args=(tapproc.rapid_reset(30_000), 60))
            for c in clients
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for client in clients:
            client.close()
        return _got(*clients)

    return attack


def fill_metrics(proxy: TapProxy, authorities: int = 600) -> None:
    """Requests for `authorities` distinct authorities through the proxy (each refused by a
    closed port: 502), so that its metrics carry as many series as a busy proxy's."""
    with socket.create_connection(("127.0.0.1", proxy.outbound), timeout=10) as sock:
        reader = sock.makefile("rb")
        for i in range(authorities):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (20000 + i))
            length = 0
            reader.readline()
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)


def admin_get(proxy: TapProxy, path: str) -> int:
    """GET `path` from the admin port, reading the whole answer; its size."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.admin}{path}", timeout=60) as answer:
        return len(answer.read())


def scrape_flood(proxy: TapProxy, _: Callable[[str | None], Any]) -> str:
    stop = time.monotonic() + 5
    done = [0]

    def scrape() -> None:
        while time.monotonic() < stop:
            with contextlib.suppress(OSError):
                admin_get(proxy, "/metrics")
                done[0] += 1

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return f"{done[0]} scrapes of {admin_get(proxy, '/metrics') / 1e6:.1f} MB in 5 s"


def slow_readers(proxy: TapProxy, _: Callable[[str | None], Any]) -> str:
    socks = []
    for _ in range(300):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", proxy.admin))
        sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        socks.append(sock)
    time.sleep(15)
    fds = len(list(Path(f"/proc/{proxy.pid}/fd").iterdir()))
    for sock in socks:
        sock.close()
    return f"300 connections held for 15 s; the proxy's open files then: {fds}"


def partial_heads(proxy: TapProxy, _: Callable[[str | None], Any]) -> str:
    socks = []
    for _ in range(2000):
        sock = socket.create_connection(("127.0.0.1", proxy.admin), timeout=5)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
        socks.append(sock)
    fds = len(list(Path(f"/proc/{proxy.pid}/fd").iterdir()))
    ready = admin_get(proxy, "/ready")
    for sock in socks:
        sock.close()
    return f"the proxy's open files: {fds}; /ready answered ({ready} bytes)"


ADMIN_ATTACKS: Final = ("admin",)  # attacks whose proxy first gets a big /metrics

ATTACKS: Final[list[tuple[str, Attack]]] = [
    ("none: the probe alone for 5 s", nothing),
    ("no client certificate: 200 handshakes", no_certificate),
    ("another identity: an Observe declaring 300 MiB, 300 MiB sent",
     message_of(OTHER_ID, 300 * MiB, 300 * MiB)),
    ("the tap identity: an Observe declaring 1 GiB, 300 MiB sent",
     message_of(TAP_ID, 1 << 30, 300 * MiB)),
    ("the tap identity: the same, sent regardless of flow control",
     message_of(TAP_ID, 1 << 30, 300 * MiB, flow_control=False)),
    ("the tap identity: a match of 1,000,000 leaves (2 MB)", huge_match),
    ("another identity: 3 connections x 30,000 HEADERS+RST_STREAM", rapid_reset(OTHER_ID)),
    ("the tap identity: 3 connections x 30,000 HEADERS+RST_STREAM", rapid_reset(TAP_ID)),
    ("admin: 8 clients scraping /metrics back to back for 5 s", scrape_flood),
    ("admin: 300 clients asking for /metrics, never reading", slow_readers),
    ("admin: 2,000 connections sending a partial head", partial_heads),
]  # fmt: skip


def measure(root: Path, name: str, attack: Attack) -> Row:
    bench_ca = make_ca(root / "ca")
    with contextlib.ExitStack() as stack:
        proxy = tapproc.start(stack, root / "run", bench_ca)
        if name.startswith(ADMIN_ATTACKS):
            fill_metrics(proxy)
        time.sleep(1.0)  # let start-up settle
        before = proxy.rss_mib()

        def context(identity: str | None) -> Any:
            return tapproc.client_context(bench_ca, identity, root)

        with Probe(proxy) as probe, Peak(proxy) as peak:
            got = attack(proxy, context)
        time.sleep(1.0)
        after = proxy.rss_mib()
    result = probe.result
    return Row(name, before, max(peak.mib, after), after, result["longest"], result["median"],
               got)  # fmt: skip


def report(rows: list[Row], proxy_src: Path | None) -> str:
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# One meshlet proxy's tap and admin ports under attack (bench/port_attacks.py)",
        "",
        f"- {when}; proxy from {proxy_src or 'this checkout'}; RSS from /proc; the probe's"
        " requests go one after another through the proxy's outbound listener",
        "",
        "| attack | RSS before → peak → after (MB) | longest / median probe request (s) | the "
        "attacker got |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.attack} | {r.before:.0f} → {r.peak:.0f} → {r.after:.0f} | "
            f"{r.longest:.3f} / {r.median:.4f} | {r.got} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--proxy-src", type=Path, help="another checkout, whose proxy/ and proto/ to run"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "port_attacks.md")
    parser.add_argument("--only", help="run the attacks whose name contains this")
    args = parser.parse_args(argv)
    if args.proxy_src is not None:  # the processes started (the proxy) find it first
        found = f"{args.proxy_src / 'proxy'}:{args.proxy_src / 'proto'}"
        os.environ["PYTHONPATH"] = f"{found}:{os.environ.get('PYTHONPATH', '')}"
    rows = []
    for name, attack in ATTACKS:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="tap-bench-") as tmp:
            rows.append(measure(Path(tmp), name, attack))
        print(f"{name}: {rows[-1]}", flush=True)
    text = report(rows, args.proxy_src)
    print(text)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
