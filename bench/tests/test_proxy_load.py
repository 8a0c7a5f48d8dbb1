"""The load generators' command lines: saturation is timed, a fixed rate is spread evenly."""

from __future__ import annotations

from bench import proxy_load


def _h2load(**kwargs: object) -> list[str]:
    return proxy_load.h2load("http://127.0.0.1:1/", authority="a", clients=10, seconds=8, **kwargs)  # type: ignore[arg-type]


def test_saturation_is_timed() -> None:
    argv = _h2load(streams=16)
    assert "-D8" in argv and "-m16" in argv
    assert not any(a.startswith(("-n", "-r", "--rps")) for a in argv)


def test_a_fixed_rate_starts_the_clients_one_by_one() -> None:
    # 10 clients at 100/s each: one started every millisecond, so that their request timers
    # tick 1 ms apart (1,000 evenly spaced requests a second), counted in requests, not timed.
    argv = _h2load(rps_per_client=100.0, log_file="/tmp/log")
    assert {"--rps=100", "-n8000", "-r1", "--rate-period=1ms", "--log-file=/tmp/log"} <= set(argv)
    assert not any(a.startswith("-D") for a in argv)


def test_a_fast_fixed_rate_starts_several_clients_per_millisecond() -> None:
    argv = _h2load(rps_per_client=400.0)
    assert {"-n32000", "-r4", "--rate-period=1ms"} <= set(argv)
    slow = _h2load(rps_per_client=10.0)
    assert {"-n800", "-r1", "--rate-period=10ms"} <= set(slow)
