"""What observability costs the meshed pair's server-side proxy: instructions per request
(callgrind, which a busy machine does not move) and, as context, CPU time per request under load.

    python -m bench.instructions_observe [--requests N] [--load-requests M] [--smoke]

The proxy and the client are bench/instructions_mesh.py's (the server pod's proxy, mutual TLS
from the client pod's identity, one connection, HTTP/1.1 and HTTP/2). The rows:

- *baseline*: the proxy of the commit before tap landed (the parent of the first commit under
  proxy/meshlet/proxy/tap), checked out into a temporary worktree (bench/proxy_baseline.py) and
  run from there on this interpreter: the same proxy with no observability hooks at all, since
  this tree's cannot be run without them. Every commit since then under proxy/meshlet is
  observability's (tap, access logs, trace context), so the ratio is theirs.
- *defaults*: this tree's proxy as it runs unless told otherwise: no tap open, access logs off,
  tracing unconfigured. The issue asks it to be within DEFAULTS_LIMIT of the baseline.
- *tap open*: one Observe stream open on the proxy's control port, from a grpcio client holding
  the tap controller's identity (the one the proxy answers), matching every request and
  consuming its events; a count stands only if the events arrived.
- *access log*: `MESHLET_PROXY_ACCESS_LOG=json`, its lines on stderr into a file; a count stands
  only if a line per request was written.
- *tracing*: `MESHLET_PROXY_TRACE_COLLECTOR_SVC_ADDR` set to a local OTLP/HTTP sink of this
  module's (accepts, counts the spans, discards) and every request carrying a sampled W3C
  `traceparent`; a count stands only if a span per request reached the sink before the proxy
  stopped (so their export is counted too).

The load rows run the same proxy without valgrind, LOAD_CONNECTIONS connections sending
requests one after the other each, and divide the proxy's CPU time (user + system) by the
requests: each setting once forwards and once backwards, so a machine growing busier favours
none. On a shared machine they move by tens of percent; the instruction counts are the figure.
A tap reports at most its rate (Linkerd's 100 requests a second), so under load most requests
are matched and not reported; tracing's queue drops spans past its bound.

The pods' ports are the mesh's fixed ones, so as root it re-runs itself in a fresh network
namespace; without root it says so and exits 0, and without valgrind it gives only the load rows.
`--smoke` runs each of this tree's settings for a few requests, with their checks, and prints
JSON (bench/tests/ runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

import grpc

from bench import (
    instructions,
    instructions_mesh,
    proxy_baseline,
    proxy_evidence,
    proxy_mesh,
    proxy_netns,
)
from bench.instructions_mesh import CLIENTS, Run, ServerProxy, Setting
from bench.proxy_procs import CpuMeter
from meshlet.api import tap_pb2, wellknown
from meshlet.api.wellknown import ProxyEnv

REQUESTS: Final = instructions_mesh.REQUESTS
LOAD_REQUESTS: Final = 4000  # per setting, protocol and pass
LOAD_CONNECTIONS: Final = 4
SMOKE_REQUESTS: Final = 20
DEFAULTS_LIMIT: Final = 1.02  # the defaults' instructions ÷ the baseline's
SETTLE_TIMEOUT: Final = 60.0  # for the tap's events, the log's lines, the spans to arrive
TAP_ID: Final = wellknown.TAP_SERVICE_NAME  # the identity the bench's proxies answer on tap
OBSERVE: Final = "/io.linkerd.proxy.tap.Tap/Observe"
TAP_EVENTS: Final = 3  # per request: request init, response init, response end
TRACEPARENT: Final = ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
ACCESS_LINE: Final = b'"client.addr"'  # in every json access-log line
BASELINE: Final = "baseline"
DEFAULTS: Final = "defaults"
TAP: Final = "tap open"
ACCESS_LOG: Final = "access log"
TRACING: Final = "tracing"
SETTINGS: Final = (BASELINE, DEFAULTS, TAP, ACCESS_LOG, TRACING)
TAPPED: Final = "proxy/meshlet/proxy/tap"


def before_tap(repo: Path) -> str:
    """The parent of the first commit under TAPPED: the proxy before observability."""
    done = subprocess.run(
        ["git", "-C", str(repo), "log", "--format=%H", "--reverse", "--", TAPPED],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    first = done.stdout.split()
    if not first:
        raise proxy_baseline.BaselineError(f"no commit under {TAPPED} in {repo}")
    return f"{first[0]}^"


# -- the settings' checks ----------------------------------------------------------------------


def _settle(
    what: str, got: Callable[[], int], want: int, timeout: float, every: float = 0.2
) -> int:
    """Wait until `got()` reaches `want`, asking `every` seconds; RuntimeError naming `what`
    after `timeout`."""
    deadline = time.monotonic() + timeout
    while (n := got()) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {n} of {want} after {timeout:g} s")
        time.sleep(every)
    return n


def _quiet(what: str, got: Callable[[], int], want: int, quiet: float = 1.0) -> int:
    """Wait until `got()` reaches `want` or stops growing for `quiet` seconds (RuntimeError
    after SETTLE_TIMEOUT)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    last = -1
    while (n := got()) < want and n != last:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {n} of {want} after {SETTLE_TIMEOUT:g} s")
        last = n
        time.sleep(quiet)
    return n


class TapClient:
    """Observe on the server pod's control port as the tap controller, consuming events in a
    thread of its own."""

    def __init__(self, server: ServerProxy) -> None:
        leaf = next(o for o in server.pki.others if o.name == TAP_ID)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=server.pki.anchors.read_bytes(),
            private_key=leaf.key.read_bytes(), certificate_chain=leaf.chain.read_bytes(),
        )  # fmt: skip
        self._credentials = credentials
        self.events = 0
        self.refused = ""

    @contextlib.contextmanager
    def open(self, run: Run) -> Iterator[None]:
        """One tap open for the requests; then their events received: all of them, unless the
        tap's rate left some out (then what came within a while), and never none."""
        target = f"{proxy_mesh.SERVER_IP}:{wellknown.PROXY_CONTROL_PORT}"
        options = [("grpc.ssl_target_name_override", proxy_mesh.SERVER_ID)]
        with grpc.secure_channel(target, self._credentials, options=options) as channel:
            observe = channel.unary_stream(
                OBSERVE, request_serializer=tap_pb2.ObserveRequest.SerializeToString,
                response_deserializer=tap_pb2.TapEvent.FromString,
            )  # fmt: skip
            call = observe(tap_pb2.ObserveRequest(limit=0), wait_for_ready=True)
            self.events = 0
            reader = threading.Thread(target=self._read, args=(call,), daemon=True)
            reader.start()
            try:
                # seldom: each scrape is work of the proxy's, which the count would include
                _settle("taps open", lambda: _taps_open(run.proc), 1, SETTLE_TIMEOUT, every=1.0)
                yield
                self._received(run.requests)
            finally:
                call.cancel()
                reader.join(10)

    def _read(self, call: Any) -> None:
        try:
            for _ in call:
                self.events += 1
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.refused = f"{exc.code().name}: {exc.details()}"

    def _received(self, requests: int) -> None:
        """Every event, or (past the tap's rate) until no more come; never none."""
        if self.refused:
            raise RuntimeError(f"the tap was refused: {self.refused}")
        _quiet("tap events", lambda: self.events, TAP_EVENTS * requests)
        if self.events == 0:
            raise RuntimeError(f"the tap received no event for {requests} requests")


def _taps_open(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is not None:
        raise RuntimeError(f"the proxy exited with {proc.returncode}")
    with contextlib.suppress(OSError):
        for line in proxy_mesh.metrics("server").splitlines():
            if line.startswith("tap_open "):
                return int(float(line.split()[1]))
    return 0


class AccessLog:
    """The proxy's json access-log lines, counted in its log file."""

    def __init__(self) -> None:
        self.lines = 0

    @contextlib.contextmanager
    def written(self, run: Run) -> Iterator[None]:
        """The requests; then a line for each in the proxy's log."""
        before = _lines(run.log)
        yield
        self.lines = _settle(
            "access-log lines", lambda: _lines(run.log) - before, run.requests, SETTLE_TIMEOUT
        )


def _lines(log: Path) -> int:
    return log.read_bytes().count(ACCESS_LINE)


def _dropped_spans() -> float:
    return proxy_evidence.metric_sum(proxy_mesh.metrics("server"), "trace_spans_dropped_total", {})


class SpanSink:
    """A local OTLP/HTTP traces endpoint: accepts every export, counts its spans, keeps none."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans = 0
        self.dropped = 0  # by the proxy, in the last run
        sink = self
        request_type = trace_service_pb2.ExportTraceServiceRequest

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                exported = request_type.FromString(body)
                sink.spans += sum(
                    len(scope.spans) for rs in exported.resource_spans for scope in rs.scope_spans
                )
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @contextlib.contextmanager
    def traced(self, run: Run) -> Iterator[None]:
        """The requests; then a span for each at the sink, or counted dropped by the proxy (its
        queue is bounded: under load it drops, by design). Asked once a second (scraping the
        proxy is work of its own)."""
        before, dropped = self.spans, _dropped_spans()
        yield

        def accounted() -> int:
            return self.spans - before + int(_dropped_spans() - dropped)

        _settle("spans exported or dropped", accounted, run.requests, SETTLE_TIMEOUT, every=1.0)
        self.dropped = int(_dropped_spans() - dropped)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the settings ------------------------------------------------------------------------------


@dataclass(slots=True)
class Settings:
    by_name: dict[str, Setting]
    tap: TapClient
    log: AccessLog
    sink: SpanSink


def settings(server: ServerProxy, stack: ExitStack, baseline: str | None) -> Settings:
    """Each row's Setting (BASELINE only with the baseline's source roots)."""
    sink = SpanSink()
    stack.callback(sink.close)
    tap, log = TapClient(server), AccessLog()
    found = {
        DEFAULTS: Setting(),
        TAP: Setting(around=tap.open),
        ACCESS_LOG: Setting(env={ProxyEnv.ACCESS_LOG: "json"}, around=log.written),
        TRACING: Setting(
            env={ProxyEnv.TRACE_COLLECTOR_SVC_ADDR: sink.url},
            headers=(TRACEPARENT,),
            around=sink.traced,
        ),
    }
    if baseline is not None:
        found = {BASELINE: Setting(pythonpath=baseline), **found}
    return Settings(found, tap, log, sink)


@contextlib.contextmanager
def checked_out_baseline(server: ServerProxy) -> Iterator[str]:
    """The proxy before tap, checked out; its source roots (PYTHONPATH)."""
    with proxy_baseline.checked_out(instructions.REPO, before_tap(instructions.REPO)) as base:
        written = [k for k in server.env(Setting()) if k.startswith(wellknown.PROXY_ENV_PREFIX)]
        proxy_baseline.check(base, written)
        print(f"baseline: {base.short} {base.subject}", file=sys.stderr)
        yield base.pythonpath


# -- CPU per request under load ----------------------------------------------------------------


def load(server: ServerProxy, client: str, setting: Setting, requests: int,
         connections: int) -> tuple[float, float]:  # fmt: skip
    """The server proxy's CPU seconds per request and requests per second, `requests` sent
    over `connections` connections at once, each one after the other."""
    exchange, protocol, field = CLIENTS[client]
    port = getattr(server.upstream, field)
    each = requests // connections
    with server.serving(setting) as started:
        run = Run(started.proc, started.log, field, port, each * connections)
        errors: list[BaseException] = []
        socks = [server.connect(protocol, port) for _ in range(connections)]

        def send(sock: Any) -> None:
            try:
                with sock:
                    sock.settimeout(60)
                    exchange(sock, f"{proxy_mesh.SERVER_IP}:{port}", each, setting.headers)
            except (OSError, ConnectionError) as exc:
                errors.append(exc)

        with setting.around(run):
            meter = CpuMeter(started.proc.pid)
            start = time.monotonic()
            threads = [threading.Thread(target=send, args=(s,)) for s in socks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.monotonic() - start
            if errors:
                raise RuntimeError(f"a load connection failed: {errors[0]}")
        cpu = meter.stop()
    return cpu / run.requests, run.requests / elapsed


# -- measuring and the tables ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    setting: str
    client: str
    instructions: float | None = None  # per request
    cpu_us: float | None = None  # per request, under load
    rate: float | None = None  # requests a second, under load
    note: str = ""


def measure(
    requests: int, load_requests: int, callgrind: bool, chosen: Sequence[str] = SETTINGS
) -> list[Row]:
    """The rows of the `chosen` settings (BASELINE checks the baseline out)."""
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-instructions-observe-"))
    rows: list[Row] = []
    try:
        with ExitStack() as stack:
            server = ServerProxy(stack, scratch, others=(TAP_ID,))
            base = checked_out_baseline(server) if BASELINE in chosen else None
            made = settings(server, stack, stack.enter_context(base) if base else None)
            made.by_name = {name: made.by_name[name] for name in SETTINGS if name in chosen}
            for client in CLIENTS:
                counted = {name: _count(server, client, name, s, requests) if callgrind else None
                           for name, s in made.by_name.items()}  # fmt: skip
                loaded = _load(server, client, made, load_requests)
                rows += [Row(name, client, counted[name], *loaded[name]) for name in made.by_name]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _count(server: ServerProxy, client: str, name: str, setting: Setting, n: int) -> float:
    print(f"{client}, {name}: instructions ...", file=sys.stderr, flush=True)
    return server.per_request(client, setting, n)


Loaded = tuple[float | None, float | None, str]  # CPU µs per request, requests/s, a note


def _load(server: ServerProxy, client: str, made: Settings, requests: int) -> dict[str, Loaded]:
    """Each setting's mean CPU µs per request and rate over two passes, forwards then
    backwards, and what the load left out (tap events past its rate, spans dropped); a
    failed pass is the note."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in made.by_name}
    notes: dict[str, list[str]] = {name: [] for name in made.by_name}
    left_out: dict[str, list[int]] = {name: [] for name in made.by_name}
    for order in (list(made.by_name), list(reversed(made.by_name))):
        for name in order:
            print(f"{client}, {name}: CPU under load ...", file=sys.stderr, flush=True)
            try:
                cpu, rate = load(server, client, made.by_name[name], requests, LOAD_CONNECTIONS)
            except (RuntimeError, OSError) as exc:
                notes[name].append(f"failed: {exc}")
                continue
            samples[name].append((cpu * 1e6, rate))
            if name == TAP:
                left_out[name].append(made.tap.events // TAP_EVENTS)
            if name == TRACING:
                left_out[name].append(made.sink.dropped)
    found: dict[str, Loaded] = {}
    for name, got in samples.items():
        if left_out[name]:
            what = "reported" if name == TAP else "spans dropped"
            counts = ", ".join(map(str, left_out[name]))
            notes[name].insert(0, f"{what}: {counts} of {requests:,} a pass")
        note = "; ".join(notes[name])
        if not got:
            found[name] = (None, None, note)
            continue
        cpu_us, rate = (sum(x) / len(got) for x in zip(*got, strict=True))
        found[name] = (cpu_us, rate, note)
    return found


def table(rows: Sequence[Row]) -> list[str]:
    """Per protocol and setting: instructions per request and the ratio to the baseline (the
    defaults flagged over DEFAULTS_LIMIT), then CPU per request under load and its ratio."""
    lines = [
        "| protocol | setting | instructions/request | ÷ baseline | CPU µs/request (load) | "
        "÷ baseline | requests/s (load) | under load |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        base = next((r for r in rows if r.client == row.client and r.setting == BASELINE), None)
        ratio = _ratio(row.instructions, base.instructions if base else None)
        if row.setting == DEFAULTS and row.instructions and base and base.instructions:
            within = row.instructions / base.instructions <= DEFAULTS_LIMIT
            ratio += (
                f" (within {DEFAULTS_LIMIT:g}x)" if within else f" (**over {DEFAULTS_LIMIT:g}x**)"
            )
        cpu_ratio = _ratio(row.cpu_us, base.cpu_us if base else None)
        lines.append(
            f"| {row.client} | {row.setting} | {_number(row.instructions, ',.0f')} | {ratio} | "
            f"{_number(row.cpu_us, '.1f')} | {cpu_ratio} | {_number(row.rate, ',.0f')} | "
            f"{row.note} |"
        )
    return lines


def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"**{value / base:.3f}x**"


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def smoke(requests: int) -> dict[str, Any]:
    """Each of this tree's settings serving `requests` HTTP/1.1 requests, checks included
    (no valgrind, no baseline): what each got."""
    scratch = Path(tempfile.mkdtemp(prefix="meshlet-observe-smoke-"))
    found: dict[str, Any] = {}
    try:
        with ExitStack() as stack:
            server = ServerProxy(stack, scratch, others=(TAP_ID,))
            made = settings(server, stack, None)
            for name, setting in made.by_name.items():
                load(server, "HTTP/1.1", setting, requests, 1)
                found[name] = {"requests": requests}
            found[TAP]["events"] = made.tap.events
            found[ACCESS_LOG]["lines"] = made.log.lines
            found[TRACING]["spans"] = made.sink.spans
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return found


def _chosen(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if unknown := [name for name in names if name not in SETTINGS]:
        raise argparse.ArgumentTypeError(
            f"unknown setting {unknown[0]!r}: expected some of {', '.join(SETTINGS)}"
        )
    if not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(SETTINGS)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests counted")
    parser.add_argument("--load-requests", type=int, default=LOAD_REQUESTS,
                        help="requests per setting, protocol and pass under load")  # fmt: skip
    parser.add_argument("--settings", type=_chosen, default=SETTINGS,
                        help=f"which, comma-separated (default: {','.join(SETTINGS)})")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="a few requests each, as JSON")
    args = parser.parse_args()
    if min(args.requests, args.load_requests) < LOAD_CONNECTIONS:
        parser.error(f"--requests and --load-requests take at least {LOAD_CONNECTIONS}")
    title = "## Observability's cost: the meshed pair's server-side proxy"
    if os.geteuid() != 0:
        print(f"{title}: needs root (the pods' fixed ports, in a network namespace of its own)")
        return 0
    if not proxy_netns.inside():
        proxy_netns.enter("bench.instructions_observe", sys.argv[1:])
        print(f"{title}: unshare is not installed; nothing measured")
        return 0
    proxy_netns.loopback_up()
    if args.smoke:
        try:
            print(json.dumps(smoke(SMOKE_REQUESTS)))
        except (RuntimeError, OSError) as exc:
            print(json.dumps({"error": str(exc)}))
            return 1
        return 0
    callgrind = shutil.which("valgrind") is not None
    try:
        rows = measure(args.requests, args.load_requests, callgrind, args.settings)
    except proxy_baseline.BaselineError as exc:
        print(f"{title}: the baseline cannot be measured: {exc}")
        return 1
    print(f"\n{title}\n")
    print(_INTRO if callgrind else _INTRO + " valgrind is not installed here: no instructions.")
    print()
    print("\n".join(table(rows)))
    return 0


_INTRO = (
    "Inbound, mutual TLS from the client pod's identity. Instructions per request: callgrind, "
    "user space, one connection, requests one after the other. CPU µs per request: the proxy's "
    f"user + system time under {LOAD_CONNECTIONS} connections at once, mean of two passes "
    "(noisy: context only). Baseline: the proxy before tap landed; defaults: no tap open, "
    "access log off, tracing unconfigured; tap open: one Observe stream matching everything "
    "(reports at most 100 requests/s); access log: json to a file; tracing: a sampled "
    "traceparent on every request, spans exported over OTLP/HTTP to a local sink."
)


if __name__ == "__main__":
    sys.exit(main())
