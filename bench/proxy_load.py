"""Load generators for the proxy benchmark: their command lines and their output, parsed.

Pure functions only: building an argv and reading wrk, h2load and iperf3 output. Running them
is the benchmark's job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one load run achieved: good (2xx) requests or bytes, errors, wall seconds."""

    ok: int
    errors: int
    seconds: float
    detail: str = ""  # the tool's own complaint, when there is one

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0


def wrk(url: str, *, authority: str, connections: int, seconds: float) -> list[str]:
    return ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-H", f"Host: {authority}", url]


def h2load(
    url: str,
    *,
    authority: str,
    clients: int,
    seconds: float,
    streams: int = 1,
    h1: bool = False,
    rps_per_client: float | None = None,
    log_file: str | None = None,
    body_file: str | None = None,
    headers: Sequence[str] = (),
) -> list[str]:
    """h2load for `seconds` (no warm-up); `body_file` makes it a POST.

    At saturation the run is timing-based (-D). At a fixed rate (`rps_per_client`) the clients'
    request timers must not tick together: h2load starts every client at once, so each tick
    would send `clients` requests in one burst and measure the queue that burst makes behind
    a one-core proxy rather than the proxy's latency. So the clients are started one by one,
    1 / (clients * rps) apart (-r1 --rate-period, to the millisecond), and their requests then
    arrive evenly spaced; the run is counted in requests (-n: -r excludes -D)."""
    argv = ["h2load", "-t1", f"-c{clients}", f"-m{streams}"]
    if rps_per_client is None:
        argv.append(f"-D{seconds:g}")
    else:
        rate = clients * rps_per_client  # h2load's periods are whole milliseconds
        starts, period_ms = (1, round(1000 / rate)) if rate <= 1000 else (round(rate / 1000), 1)
        argv += [f"-n{round(rate * seconds)}", f"-r{starts}", f"--rate-period={period_ms}ms"]
    argv += ["-H", f":authority: {authority}"]
    for header in headers:
        argv += ["-H", header]
    if h1:
        argv.append("--h1")
    if rps_per_client is not None:
        argv.append(f"--rps={rps_per_client:g}")
    if log_file is not None:
        argv.append(f"--log-file={log_file}")
    if body_file is not None:
        argv += ["-d", body_file]
    return [*argv, url]


def iperf3_client(
    host: str, port: int | str, *, seconds: float | None = None, size: int | None = None
) -> list[str]:
    """One iperf3 stream to `host`:`port` for `seconds`, or until `size` bytes are sent."""
    amount = ["-n", str(size)] if size is not None else ["-t", f"{seconds:g}"]
    return ["iperf3", "-c", host, "-p", str(port), *amount, "-J"]


def iperf3_server(port: int | str) -> list[str]:
    return ["iperf3", "-s", "-1", "--forceflush", "-p", str(port)]  # -1: one test, then exit


_WRK_TOTAL = re.compile(r"(\d+) requests in ([\d.]+)(us|ms|s|m)\b")
_WRK_NON2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_WRK_SOCKET = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_wrk(text: str) -> Outcome:
    total = _WRK_TOTAL.search(text)
    if total is None:
        raise ValueError(f"wrk printed no summary: {text.strip()[-200:]!r}")
    requests, seconds = int(total[1]), float(total[2]) * _WRK_UNITS[total[3]]
    non2xx = int(m[1]) if (m := _WRK_NON2XX.search(text)) else 0
    sockets = sum(map(int, m.groups())) if (m := _WRK_SOCKET.search(text)) else 0
    detail = f"{non2xx} non-2xx, socket errors {sockets}" if non2xx or sockets else ""
    return Outcome(requests - non2xx, non2xx + sockets, seconds, detail)


_H2_FINISHED = re.compile(r"finished in ([\d.]+)(us|ms|s|m)\b")
_H2_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
_H2_STATUS = re.compile(r"status codes: (\d+) 2xx")


def parse_h2load(text: str) -> Outcome:
    finished, requests, status = (p.search(text) for p in (_H2_FINISHED, _H2_REQUESTS, _H2_STATUS))
    if finished is None or requests is None or status is None:
        raise ValueError(f"h2load printed no summary: {text.strip()[-200:]!r}")
    seconds = float(finished[1]) * _WRK_UNITS[finished[2]]
    done, failed, ok = int(requests[3]), int(requests[5]), int(status[1])
    errors = max(done - ok, failed)
    detail = f"{errors} of {done} requests failed or not 2xx" if errors else ""
    return Outcome(ok, errors, seconds, detail)


def latencies_us(log_text: str) -> list[int]:
    """Per-request latencies (µs) of 2xx responses from an h2load --log-file."""
    result = []
    for line in log_text.splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[1].startswith("2"):
            result.append(int(fields[2]))
    return result


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q < 1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def parse_iperf3(text: str, *, sent: bool = False) -> Outcome:
    """Bytes received by the server (or `sent` by the client) over the test's seconds."""
    try:  # stderr shares the log: decode from the first brace, ignore what follows
        report, _ = json.JSONDecoder().raw_decode(text, text.index("{"))
    except ValueError:
        raise ValueError(f"iperf3 printed no JSON: {text.strip()[-200:]!r}") from None
    if "error" in report:
        return Outcome(0, 1, 0.0, f"iperf3: {report['error']}")
    summary = report["end"]["sum_sent" if sent else "sum_received"]
    return Outcome(int(summary["bytes"]), 0, float(summary["seconds"]))
