"""The report: meshlet beside the others with its ratios, and no figures for a row that failed."""

from __future__ import annotations

import dataclasses
import datetime as dt

from bench.proxy_report import Row, RunFacts, Scenario, aims, compare, render, versus

H1, H2 = Scenario.H1, Scenario.H2
ROWS = [
    Row(H1, "direct", 50_000.0, p50_ms=0.40, p99_ms=0.80),
    Row(H1, "meshlet", 10_000.0, 1.0, cpu_us=100.0, p50_ms=1.40, p99_ms=3.0,
        fixed_cpu_us=150.0, rss_idle_kib=(35 * 1024,), rss_load_kib=(40 * 1024,),
        rss_load_sum_kib=40 * 1024),
    Row(H1, "envoy", 12_000.0, 1.0, cpu_us=80.0, p50_ms=1.20, fixed_cpu_us=100.0),
    Row(H1, "nginx", 50_000.0, 1.0, cpu_us=20.0, p50_ms=0.45, fixed_cpu_us=50.0),
    Row(H1, "meshlet-mesh", 4_000.0, 1.0, cpu_us=300.0, p50_ms=2.40, fixed_cpu_us=400.0,
        rss_idle_kib=(37 * 1024, 36 * 1024), rss_load_kib=(41 * 1024, 44 * 1024),
        rss_load_sum_kib=85 * 1024),
    Row(H1, "envoy-mesh", 4_000.0, 1.0, cpu_us=250.0, p50_ms=2.0, fixed_cpu_us=500.0),
    Row(H1, "nginx-mesh", notes=("failed: TLS probe: the server side answered 400",)),
    Row(H2, "direct", p50_ms=0.3),
    Row(H2, "meshlet-mesh", cpu_us=600.0, p50_ms=4.3),
    Row(H2, "envoy-mesh", cpu_us=150.0, p50_ms=1.3),
]  # fmt: skip


def test_cpu_side_by_side_with_ratios_per_path() -> None:
    lines = compare(ROWS, "cpu")
    assert (
        "| HTTP/1.1 keep-alive | one hop | 100.00 | 80.00 | 20.00 | — | **1.25x** | **5.00x** |"
        in lines
    )
    assert (
        "| HTTP/1.1 keep-alive | meshed pair (mTLS 1.3) | 300.00 | 250.00 | — | — | **1.20x** "
        "| — |" in lines
    )
    assert (
        "| HTTP/2 (h2c) | meshed pair (mTLS 1.3) | 600.00 | 150.00 | — | — | **4.00x** | — |"
        in (lines)
    )
    assert not any(line.startswith("| TCP") for line in lines)  # nothing measured there


def test_added_latency_is_over_going_direct() -> None:
    lines = compare(ROWS, "p50")
    assert "| HTTP/1.1 keep-alive | one hop | 1.00 | 0.80 | 0.05 | — | **1.25x** | — |" in lines


def test_no_ratio_over_an_added_latency_below_zero() -> None:
    rows = [Row(H2, "direct", p50_ms=0.30), Row(H2, "meshlet", p50_ms=4.30),
            Row(H2, "nginx", p50_ms=0.20)]  # fmt: skip
    assert "| HTTP/2 (h2c) | one hop | 4.00 | — | -0.10 | — | — | — |" in compare(rows, "p50")


def test_the_aims_quote_the_meshed_pairs() -> None:
    text = "\n".join(aims(ROWS, 1000.0))
    assert "HTTP/2 meshed pair, CPU per request, meshlet ÷ Envoy: **4.00x** at saturation" in text
    assert (
        "HTTP/1.1 meshed pair, meshlet ÷ Envoy: **1.20x** at saturation (300 / 250 µs), "
        "**0.80x** at 1,000/s (400 / 500 µs)" in text
    )
    assert "meshlet ÷ the nginx pair: n/a (failed: TLS probe" in text
    assert "HTTP/1.1 keep-alive +2.00 ms, HTTP/2 (h2c) +4.00 ms, gRPC unary — ms" in text
    assert "35.0 MiB alone, 36.0 to 37.0 MiB in the pair" in text
    assert "up to 44.0 MiB" in text


def test_a_failed_row_shows_no_figures() -> None:
    facts = RunFacts(
        when=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), machine="m", placement="p", duration=8,
        rate=1000, rate_clients=10, h1_connections=32, h2_clients=8, h2_streams=16,
        meshlet_command="", noise="n", commands=[],
    )  # fmt: skip
    line = next(
        line
        for line in render(ROWS, facts).splitlines()
        if line.startswith("| HTTP/1.1 keep-alive | nginx-mesh |")
    )
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert set(cells[2:-1]) == {"—"}
    assert cells[-1].startswith("failed: TLS probe")


THEN = "meshlet@abc1234"
VERSUS = [
    *ROWS,
    Row(H1, THEN, 8_000.0, 1.0, cpu_us=125.0, p50_ms=1.65, fixed_cpu_us=150.0,
        rss_load_sum_kib=32 * 1024),
    Row(H1, f"{THEN}-mesh", notes=("failed: probe: HTTP/1.1 answered 502 b''",)),
    Row(H2, f"{THEN}-mesh", cpu_us=500.0, p50_ms=5.3),
]  # fmt: skip


def test_meshlet_beside_its_previous_revision_with_the_ratio_now_then() -> None:
    lines = versus(VERSUS, THEN, 1000.0)
    assert lines[0] == (
        "| scenario | path | req/s saturated (TCP: MiB/s) | CPU µs/req saturated (TCP: per MiB) "
        "| CPU µs/req @ 1,000/s | added p50 ms @ 1,000/s | RSS load MiB |"
    )
    assert (
        "| HTTP/1.1 keep-alive | one hop | 10,000 / 8,000 → **1.25x** | 100.0 / 125.0 → **0.80x** "
        "| 150.0 / 150.0 → **1.00x** | +1.00 / +1.25 → **0.80x** | 40.0 / 32.0 → **1.25x** |"
        in lines
    )
    # the baseline's pair failed: its figures are missing, so there is no ratio
    assert (
        "| HTTP/1.1 keep-alive | meshed pair (mTLS 1.3) | 4,000 / — → — | 300.0 / — → — "
        "| 400.0 / — → — | +2.00 / — → — | 85.0 / — → — |" in lines
    )
    assert (
        "| HTTP/2 (h2c) | meshed pair (mTLS 1.3) | — | 600.0 / 500.0 → **1.20x** | — "
        "| +4.00 / +5.00 → **0.80x** | — |" in lines
    )
    assert len(lines) == 5  # nothing measured in the other scenarios and paths


def test_the_report_opens_with_the_baseline_only_when_one_ran() -> None:
    facts = RunFacts(
        when=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), machine="m", placement="p", duration=8,
        rate=1000, rate_clients=10, h1_connections=32, h2_clients=8, h2_streams=16,
        meshlet_command="", noise="n", commands=[],
    )  # fmt: skip
    assert "## meshlet now ÷" not in render(ROWS, facts)
    with_baseline = dataclasses.replace(facts, baseline=THEN, baseline_about="revision abc1234")
    text = render(VERSUS, with_baseline)
    assert "## meshlet now ÷ meshlet@abc1234\n\nmeshlet@abc1234: revision abc1234. " in text
    assert text.index("## meshlet now ÷") < text.index("## The issue's aims")
    assert "| HTTP/1.1 keep-alive | meshlet@abc1234 | 8,000 |" in text  # among every row
