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
