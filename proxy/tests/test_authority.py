"""Targets: how an authority splits into host and port, and the endpoint an un-redirected
request's authority names (IP literals and `localhost` only: no lookup leaves the machine)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from meshlet.proxy import authority
from meshlet.proxy.authority import by_authority, resolve, split_authority
from meshlet.proxy.core.loops import SelfTargets
from meshlet.proxy.http.contract import Addr, Endpoint, RouteError

POD_IP = "10.0.0.7"
NO_AUTHORITY = RouteError(400, "the request names no authority (Host or absolute URI)")
LOOP = RouteError(403, "the request targets the proxy itself (a routing loop)")
PROXY = SelfTargets([("0.0.0.0", 4140), ("0.0.0.0", 4143), ("127.0.0.1", 4191)])


@pytest.mark.parametrize(
    ("authority", "addr"),
    [
        ("web:8080", ("web", 8080)),
        ("web", ("web", 80)),  # the default port
        ("10.1.2.3:443", ("10.1.2.3", 443)),
        ("[fd00::1]:8080", ("fd00::1", 8080)),
        ("[fd00::1]", ("fd00::1", 80)),
        ("web:0", None),
        ("web:65536", None),
        ("web:http", None),
        ("web/x:80", None),
        ("user@web:80", None),
        ("", None),
        ("[fd00::1:80", None),
    ],
)
def test_an_authority_splits_into_host_and_port(authority: str, addr: Addr | None) -> None:
    assert split_authority(authority) == addr


async def test_ip_literals_are_not_looked_up_and_names_are() -> None:
    assert await resolve("10.1.2.3", 80) == ("10.1.2.3", 80)
    assert await resolve("fd00::1", 80) == ("fd00::1", 80)
    host, port = await resolve("localhost", 8080) or ("", 0)
    assert host in ("127.0.0.1", "::1") and port == 8080


@pytest.mark.parametrize(
    ("authority", "outcome"),
    [
        (None, NO_AUTHORITY),
        ("", NO_AUTHORITY),
        ("web:http", RouteError(400, "the request's authority is malformed")),
        (
            "127.0.0.1:4140",
            RouteError(403, "the request targets the proxy itself (a routing loop)"),
        ),
        (
            f"{POD_IP}:4143",
            RouteError(403, "the request targets the proxy itself (a routing loop)"),
        ),
        ("10.1.2.3", Endpoint(("10.1.2.3", 80), "10.1.2.3:80")),
        ("10.1.2.3:8080", Endpoint(("10.1.2.3", 8080), "10.1.2.3:8080")),
        ("127.0.0.1:8080", Endpoint(("127.0.0.1", 8080), "127.0.0.1:8080")),
    ],
)
async def test_by_authority_names_the_endpoint_or_says_why_not(
    authority: str | None, outcome: Endpoint | RouteError
) -> None:
    assert await by_authority(authority, PROXY, POD_IP) == outcome


async def test_a_name_is_labelled_as_written_and_sent_where_it_resolves() -> None:
    endpoint = await by_authority("localhost:8080", PROXY, POD_IP)
    assert isinstance(endpoint, Endpoint)
    assert endpoint.authority_label == "localhost:8080"
    assert endpoint.addr in (("127.0.0.1", 8080), ("::1", 8080))


async def test_a_name_resolving_to_the_proxy_itself_is_a_loop() -> None:
    assert await by_authority("localhost:4191", PROXY, POD_IP) == LOOP


async def test_slow_name_lookups_leave_the_loops_pool_alone_and_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Names whose lookups hang (a resolver answering in seconds) once held uvloop's thread
    pool, and connections to mesh peers timed out behind them. Lookups have threads of their
    own now, at most MAX_LOOKUPS, each bounded by LOOKUP_TIMEOUT: 504, not a wait."""
    real = socket.getaddrinfo

    def slow(host: str, *args: Any, **kwargs: Any) -> Any:
        if host.startswith("slow"):
            time.sleep(2.0)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(authority, "LOOKUP_TIMEOUT", 0.5)
    monkeypatch.setattr(socket, "getaddrinfo", slow)
    loop = asyncio.get_running_loop()
    lookups = [asyncio.create_task(by_authority(f"slow{n}:80", PROXY, POD_IP))
               for n in range(3 * authority.MAX_LOOKUPS)]  # fmt: skip
    await asyncio.sleep(0.05)
    started = time.monotonic()
    for _ in range(8):  # the loop's own pool (uvloop: libuv's four threads) is free
        await loop.getaddrinfo("localhost", 80)
    assert time.monotonic() - started < 0.5
    answers = await asyncio.gather(*lookups)
    assert set(answers) == {RouteError(504, "the lookup of the request's authority timed out")}
    # every slot held by a hung lookup: a new one waits for a slot, within its own limit
    assert await by_authority("localhost:80", PROXY, POD_IP) == RouteError(
        504, "the lookup of the request's authority timed out"
    )
    await asyncio.sleep(1.6)  # the hung lookups end: their slots are free again
    assert await by_authority("localhost:8080", PROXY, POD_IP) == Endpoint(
        Addr("127.0.0.1", 8080), "localhost:8080"
    )
