"""Access log and trace plumbing that needs no mesh: the bounded stderr writer, the trace
context parser, and that a proxy without a collector never imports opentelemetry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from meshlet.proxy.http import tracing
from meshlet.proxy.http.observe import LineWriter
from meshlet.proxy.series import CounterChild

H = tracing.TRACEPARENT


def test_a_reader_that_never_reads_costs_dropped_lines_never_a_blocked_writer() -> None:
    read, write = os.pipe()
    try:
        dropped = CounterChild()
        writer = LineWriter(write, dropped, limit=64 * 1024)
        line = b"x" * 1023 + b"\n"
        started = time.perf_counter()
        for _ in range(2000):  # 2 MB into a pipe of 64 KiB nobody reads, behind 64 KiB
            writer.write(line)
        assert time.perf_counter() - started < 1.0
        assert 0 < dropped.value < 2000
    finally:
        os.close(read)  # the writer's thread gets EPIPE and moves on
        writer.close()
        os.close(write)


def test_trace_context_of_each_header_family() -> None:
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    w3c = tracing.parse([(H, f"00-{trace}-{span}-01".encode())])
    assert w3c == tracing.TraceContext("w3c", trace, span, True, b"00")
    assert not tracing.parse([(b"TraceParent", f"00-{trace}-{span}-00".encode())]).sampled  # type: ignore[union-attr]
    assert tracing.parse([(H, b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01")]) is None
    assert tracing.parse([(H, b"garbage")]) is None
    multi = tracing.parse([(b"x-b3-traceid", trace[:16].encode()),
                           (b"x-b3-spanid", span.encode()), (b"x-b3-sampled", b"1")])  # fmt: skip
    assert multi is not None and multi.sampled and multi.trace_id == trace[:16]
    single = tracing.parse([(b"b3", f"{trace}-{span}-1".encode())])
    assert single is not None and single.sampled and single.kind == "b3-single"
    assert w3c is not None
    change = tracing.continued(w3c, "1111111111111111")
    assert change.apply([(H, b"old"), (b"tracestate", b"a=b")]) == [
        (b"tracestate", b"a=b"), (H, f"00-{trace}-1111111111111111-01".encode())
    ]  # fmt: skip


IMPORTS = """
import json, sys
from meshlet.proxy.app import Proxy
from meshlet.proxy.config import load
proxy = Proxy(load(json.loads(sys.argv[1])))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))
"""


def _otel_modules(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", IMPORTS, json.dumps(env)], capture_output=True,
                          text=True, check=True, timeout=60)  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_only_a_proxy_with_a_collector_imports_opentelemetry() -> None:
    assert _otel_modules({"MESHLET_PROXY_ACCESS_LOG": "json"}) == []
    url = {"MESHLET_PROXY_TRACE_COLLECTOR_SVC_ADDR": "http://127.0.0.1:4318"}
    assert "opentelemetry.exporter.otlp.proto.http.trace_exporter" in _otel_modules(url)
