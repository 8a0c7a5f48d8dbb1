"""The instruction count's parts that need no valgrind: its upstream and its clients, talking
to each other directly (what they measure through the proxy is this same exchange)."""

from __future__ import annotations

import pytest

from bench import instructions


@pytest.mark.parametrize("client", list(instructions.CLIENTS))
def test_each_client_completes_its_requests_against_the_upstream(client: str) -> None:
    run, which = instructions.CLIENTS[client]
    with instructions.upstream() as ports:
        run(ports[which], ports[which], 25)  # straight to the upstream: no proxy between


def test_a_total_is_read_from_callgrinds_output() -> None:
    text = "events: Ir\nsummary: 123456\ntotals: 123456\n"
    match = instructions._TOTAL.search(text)
    assert match is not None and int(match.group(1)) == 123456


def test_the_policy_table_gives_the_ratio_and_flags_over_three_percent() -> None:
    from bench.instructions_policy import table

    lines = table([("HTTP/1.1", 1_000_000.0, 1_020_000.0), ("HTTP/2", 2_000_000.0, 2_080_000.0)])
    assert lines[-2] == "| HTTP/1.1 | 1,000,000 | 1,020,000 | **1.020x** | yes |"
    assert lines[-1] == "| HTTP/2 | 2,000,000 | 2,080,000 | **1.040x** | **no: over 1.03x** |"
