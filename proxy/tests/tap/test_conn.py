"""The tap server's connections, in the test's process: the real TapServer on a real socket,
real TLS from the test CA (the control port's context, as the identity manager builds it),
clients from tapproc.RawH2 in a thread of their own. Each bound of TapLimits, made small so
that it is reached at once: streams, the request's deadline, idleness, heads, connections,
handshakes, control-frame floods; and the tap's events going out as the client's windows
allow, the call ending once the tap's limit is reached."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from meshlet.api import tap_pb2
from meshlet.proxy.http.contract import Target
from meshlet.proxy.io.counters import ConnLabels
from meshlet.proxy.io.listener import bind
from meshlet.proxy.tap.conn import TapLimits
from meshlet.proxy.tap.server import TapServer
from meshlet.proxy.tap.taps import Taps
from meshlet.proxy.tls import contexts
from meshlet_testing import tapproc
from meshlet_testing.polling import eventually
from meshlet_testing.tapproc import (
    DATA,
    GOAWAY,
    HEADERS,
    OTHER_ID,
    PING,
    PROXY_ID,
    RST_STREAM,
    TAP_ID,
    Frame,
    RawH2,
    call_head,
    frame,
    goaway_code,
)

PROTOCOL_ERROR, REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x1, 0x7, 0xB
# uvloop's timers count whole milliseconds: a timeout may end up to 1 ms before its time as
# time.monotonic() measures it (0.19997 s for a 0.2 s one)
TIMER_SLACK = 0.002


class Certified:
    """The identity manager as the tap server uses it: certified, its control context built
    by the factory the manager uses."""

    ready = True

    def __init__(self, test_ca: Any, root: Path) -> None:
        chain, key = test_ca.serving_cert(PROXY_ID, root / "proxy")
        self.context = contexts.control_server_context(chain, key, test_ca.anchors_pem)

    def on_change(self, callback: Callable[[], None]) -> None:
        pass

    def control_context(self) -> Any:
        return self.context


class Tally:
    def __init__(self) -> None:
        self.refusals: Counter[str] = Counter()

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1


@dataclass
class Served:
    server: TapServer
    taps: Taps
    tally: Tally
    test_ca: Any
    root: Path

    @property
    def port(self) -> int:
        return self.server.address[1]

    async def client(self, identity: str | None = TAP_ID) -> RawH2:
        context = tapproc.client_context(self.test_ca, identity, self.root)
        return await asyncio.to_thread(RawH2, self.port, context)


@contextlib.asynccontextmanager
async def serving(test_ca: Any, root: Path, **limits: Any) -> AsyncIterator[Served]:
    taps, tally = Taps(), Tally()
    sock = bind(("127.0.0.1", 0))
    server = TapServer(sock, taps, Certified(test_ca, root), TAP_ID, TapLimits(**limits),
                       tally)  # type: ignore[arg-type]  # fmt: skip
    task = asyncio.create_task(server.run())
    try:
        yield Served(server, taps, tally, test_ca, root)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def message(request: tap_pb2.ObserveRequest, sid: int = 1) -> bytes:
    """A call's request message, ending its stream."""
    payload = request.SerializeToString()
    return frame(DATA, 1, sid, struct.pack(">BL", 0, len(payload)) + payload)


async def exchange(
    client: RawH2,
    out: list[bytes],
    within: float = 5.0,
    until: Callable[[list[Frame]], bool] | None = None,
) -> list[Frame]:
    await asyncio.to_thread(client.exchange, out, within, until)
    return client.received


def headers_on(frames: list[Frame], sid: int) -> list[dict[bytes, bytes]]:
    return [p for k, _, s, p in frames if k == HEADERS and s == sid]


def resets(frames: list[Frame]) -> dict[int, int]:
    return {s: int.from_bytes(p, "big") for k, _, s, p in frames if k == RST_STREAM}


def request_ends(served: Served) -> None:
    """One request seen by the proxy, start to end (as the request driver tells the taps)."""
    labels = ConnLabels("inbound", "10.0.0.5:8080", peer="10.0.0.9:5555")
    tapped = served.taps.request(Target("web:8080", "GET", "/x"), "inbound", labels, None, None)
    assert tapped is not None
    tapped.responded(200, 1.0)
    tapped.ended(None, False, 2)


async def test_a_call_streams_its_events_and_ends_at_its_limit(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path) as served:
        client = await served.client()
        await exchange(client, [call_head(1), message(tap_pb2.ObserveRequest(limit=2))],
                       within=0.5)  # fmt: skip
        await eventually(lambda: len(served.taps.taps) == 1)
        request_ends(served)
        request_ends(served)
        frames = await exchange(client, [], until=lambda f: len(headers_on(f, 1)) == 2)
        client.close()
        await eventually(lambda: not served.taps.taps)
    head, end = headers_on(frames, 1)
    assert head[b":status"] == b"200" and head[b"content-type"] == b"application/grpc"
    assert end == {b"grpc-status": b"0"}
    data = b"".join(p for k, _, s, p in frames if k == DATA and s == 1)
    events = []
    while data:
        length = struct.unpack_from(">L", data, 1)[0]
        events.append(tap_pb2.TapEvent.FromString(data[5 : 5 + length]))
        data = data[5 + length :]
    assert [e.http.WhichOneof("event") for e in events] == [
        "request_init", "response_init", "response_end"] * 2  # fmt: skip


async def test_past_the_most_streams_a_call_is_refused_and_the_connection_lives(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path, max_streams=2) as served:
        client = await served.client()
        frames = await exchange(client, [call_head(1), call_head(3), call_head(5)],
                                until=lambda f: 5 in resets(f))  # fmt: skip
        assert resets(frames) == {5: REFUSED_STREAM}
        await exchange(client, [message(tap_pb2.ObserveRequest(limit=1))], within=0.5)
        await eventually(lambda: len(served.taps.taps) == 1)  # stream 1 was served
        client.close()


async def test_a_call_whose_message_is_late_gets_deadline_exceeded(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path, request_timeout=0.2) as served:
        client = await served.client()
        started = time.monotonic()
        frames = await exchange(client, [call_head(1)], until=lambda f: bool(headers_on(f, 1)))
        client.close()
    (answer,) = headers_on(frames, 1)
    assert answer[b"grpc-status"] == b"4" and 0.2 <= time.monotonic() - started < 2
    assert answer[b"grpc-message"] == b"the request message did not arrive within 0.2s"


async def test_an_idle_connection_is_closed_with_goaway(test_ca: Any, tmp_path: Path) -> None:
    async with serving(test_ca, tmp_path, idle_timeout=0.2) as served:
        client = await served.client()
        frames = await exchange(client, [], within=5)
        client.close()
    assert client.closed
    assert [goaway_code(p) for k, _, _, p in frames if k == GOAWAY] == [0]


async def test_heads_that_are_not_an_observe_call(test_ca: Any, tmp_path: Path) -> None:
    bad_name = frame(HEADERS, 0x5, 1, b"\x00\x05Upper\x01x")  # a literal "Upper: x", END_STREAM
    get = call_head(3, method="GET")
    other = call_head(5, path="/io.linkerd.proxy.tap.Tap/X")
    async with serving(test_ca, tmp_path) as served:
        client = await served.client()
        frames = await exchange(client, [bad_name, get, other],
                                until=lambda f: bool(headers_on(f, 5)))  # fmt: skip
        # the connection lives on: a good call is still served
        await exchange(client, [call_head(7), message(tap_pb2.ObserveRequest(limit=1), 7)],
                       within=0.5)  # fmt: skip
        await eventually(lambda: len(served.taps.taps) == 1)
        client.close()
    assert resets(frames)[1] == PROTOCOL_ERROR
    assert headers_on(frames, 3)[0][b":status"] == b"405"
    assert headers_on(frames, 5)[0][b"grpc-status"] == b"12"


async def test_a_ping_flood_gets_goaway_enhance_your_calm(test_ca: Any, tmp_path: Path) -> None:
    async with serving(test_ca, tmp_path) as served:
        client = await served.client()
        pings = [b"".join(frame(PING, 0, 0, b"12345678") for _ in range(500))] * 10
        frames = await exchange(client, pings, within=10)
        client.close()
    assert [goaway_code(p) for k, _, _, p in frames if k == GOAWAY] == [ENHANCE_YOUR_CALM]
    assert client.closed and served.tally.refusals["abuse"] == 1


async def test_another_identity_gets_permission_denied_and_the_connection_closes(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path, refused_linger=0.2) as served:
        client = await served.client(OTHER_ID)
        frames = await exchange(client, [call_head(1), call_head(3)], within=5)
        client.close()
    assert headers_on(frames, 1) == [{
        b":status": b"200", b"content-type": b"application/grpc", b"grpc-status": b"7",
        b"grpc-message": f"{OTHER_ID} may not tap this proxy".encode(),
    }]  # fmt: skip
    assert not headers_on(frames, 3)  # never read: the connection stopped reading
    assert [goaway_code(p) for k, _, _, p in frames if k == GOAWAY] == [0]
    assert client.closed and served.tally.refusals == {"identity": 1}
    assert not served.taps.taps


async def test_past_the_most_connections_the_controllers_are_kept(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path, max_connections=2) as served:
        first, second = await served.client(), await served.client()
        await eventually(lambda: served.server.connections == 2)
        with pytest.raises((ConnectionError, OSError)):  # both are the tap controller's
            await served.client()
        assert served.tally.refusals["busy"] == 1
        first.close()
        await eventually(lambda: served.server.connections == 1)
        third = await served.client()  # a slot is free again
        third.close()
        second.close()


async def test_connections_holding_the_port_make_room_for_the_controller(
    test_ca: Any, tmp_path: Path
) -> None:
    """Handshakes left hanging and another identity's connection fill the port: each new
    connection takes the place of the oldest of them, so the tap controller still gets in."""
    async with serving(test_ca, tmp_path, max_connections=3) as served:
        loop = asyncio.get_running_loop()
        silent = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(2)]
        await eventually(lambda: served.server.connections == 2)
        other = await served.client(OTHER_ID)
        await eventually(lambda: served.server.connections == 3)
        controller = await served.client()  # the oldest silent handshake makes room
        frames = await exchange(controller, [call_head(1), message(tap_pb2.ObserveRequest())],
                                within=0.5)  # fmt: skip
        await eventually(lambda: len(served.taps.taps) == 1)
        assert not [f for f in frames if f[0] == GOAWAY]
        silent[0].setblocking(False)
        async with asyncio.timeout(5):
            assert await loop.sock_recv(silent[0], 1) == b""  # closed
        again = await served.client()  # the other silent one, then the other identity's
        third = await served.client()
        await asyncio.to_thread(other.exchange, [], 2)
        assert other.closed
        assert served.tally.refusals["busy"] == 3
        for sock in silent:
            sock.close()
        for client in (controller, again, third, other):
            client.close()


async def test_another_identity_that_sends_no_call_is_closed_all_the_same(
    test_ca: Any, tmp_path: Path
) -> None:
    async with serving(test_ca, tmp_path, request_timeout=0.3) as served:
        started = time.monotonic()  # before the handshake: the server's clock starts after it
        client = await served.client(OTHER_ID)
        await asyncio.to_thread(client.exchange, [], 5)
        client.close()
    assert client.closed and 0.3 - TIMER_SLACK <= time.monotonic() - started < 2


async def test_a_handshake_that_does_not_finish_is_cut(test_ca: Any, tmp_path: Path) -> None:
    async with serving(test_ca, tmp_path, handshake_timeout=0.2) as served:
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", served.port)) as silent:
            silent.setblocking(False)
            started = time.monotonic()
            async with asyncio.timeout(5):
                assert await loop.sock_recv(silent, 1) == b""
            assert 0.2 - TIMER_SLACK <= time.monotonic() - started < 2
        assert served.tally.refusals == {"handshake": 1}
        assert served.server.connections == 0
