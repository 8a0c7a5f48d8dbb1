"""Taps: the limit, the rate bound (on an injected clock), the buffer, the number of taps, and
the events a request makes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from meshlet.api import tap_pb2
from meshlet.api.hostport import HostPort
from meshlet.proxy.core.routes import DEFAULT_ROUTE
from meshlet.proxy.http.contract import Endpoint, RouteTarget, Target
from meshlet.proxy.io.counters import NO_DST, ConnLabels
from meshlet.proxy.tap.match import compile_match
from meshlet.proxy.tap.taps import MAX_LIMIT, Drops, Taps, TooManyTaps


class Tally(Drops):
    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()
        self.open = 0

    def dropped(self, reason: str, events: int) -> None:
        self.drops[reason] += events

    def opened(self, count: int) -> None:
        self.open = count


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


EVERYTHING = compile_match(tap_pb2.ObserveRequest.Match())
INBOUND = ConnLabels("inbound", "10.0.0.5:8080", tls="true", no_tls_reason="",
                     client_id="client.ns.serviceaccount.identity.meshlet.cluster.local",
                     peer="10.0.0.9:5555")  # fmt: skip
TARGET = Target("web:8080", "GET", "/hello")


class Head(Target):
    headers = ((b"x-secret", b"v"),)


def _taps(**kw: Any) -> tuple[Taps, Tally, Clock]:
    tally, clock = Tally(), Clock()
    taps = Taps(tally, clock, local_id="web.ns.serviceaccount.identity.meshlet.cluster.local",
                base=7, **kw)  # fmt: skip
    return taps, tally, clock


def _one(
    taps: Taps, clock: Clock, status: int = 200, grpc: str | None = None, size: int = 0
) -> None:
    tapped = taps.request(TARGET, "inbound", INBOUND, None, None)
    if tapped is not None:
        clock.now += 0.004
        tapped.responded(status, 4.0)
        clock.now += 0.006
        tapped.ended(grpc, False, size)


def test_no_tap_open_means_closed() -> None:
    taps, tally, _ = _taps()
    assert taps.open is False
    tap = taps.add(EVERYTHING, 1, False)
    assert taps.open is True and tally.open == 1
    taps.remove(tap)
    assert taps.open is False and tally.open == 0


def test_events_of_an_inbound_request() -> None:
    taps, _, clock = _taps()
    tap = taps.add(EVERYTHING, 10, False)
    _one(taps, clock, 200, "0", size=1234)
    init, head, end = (e for e in tap.events)
    assert [e.http.WhichOneof("event") for e in (init, head, end)] == [
        "request_init", "response_init", "response_end"]  # fmt: skip
    req = init.http.request_init
    assert (req.id.base, req.id.stream) == (7, 1)
    assert req.method.registered == 0 and req.scheme.registered == 0
    assert (req.authority, req.path) == ("web:8080", "/hello")
    assert not req.HasField("headers")
    assert init.proxy_direction == tap_pb2.TapEvent.INBOUND
    assert init.source.port == 5555 and init.destination.port == 8080
    assert init.source.ip.ipv4 == (10 << 24) + 9
    assert dict(init.source_meta.labels) == {"tls": "true", "client_id": INBOUND.client_id}
    assert init.destination_meta.labels["server_id"] == taps.local_id
    assert head.http.response_init.http_status == 200
    assert head.http.response_init.since_request_init.ToMilliseconds() == 4
    ended = end.http.response_end
    assert ended.eos.grpc_status_code == 0 and ended.eos.WhichOneof("end") == "grpc_status_code"
    assert ended.since_request_init.ToMilliseconds() == 10
    assert ended.since_response_init.ToMilliseconds() == 6
    assert ended.response_bytes == 1234


def test_the_head_is_reported_when_it_goes_and_the_end_when_the_body_ends() -> None:
    taps, _, clock = _taps()
    tap = taps.add(EVERYTHING, 10, False)
    tapped = taps.request(TARGET, "inbound", INBOUND, None, None)
    assert tapped is not None
    clock.now += 0.002
    tapped.responded(200, 2.0)
    assert [e.http.WhichOneof("event") for e in tap.events] == ["request_init", "response_init"]
    assert not tap.done and tap.ended == 0
    clock.now += 1.0  # a long body
    tapped.ended(None, False, 10_000_000)
    end = tap.events[2].http.response_end
    assert end.response_bytes == 10_000_000 and end.since_response_init.ToMilliseconds() == 1000
    assert end.eos.WhichOneof("end") is None


def test_headers_only_when_asked() -> None:
    taps, _, _ = _taps()
    quiet, asking = taps.add(EVERYTHING, 10, False), taps.add(EVERYTHING, 10, True)
    tapped = taps.request(Head("a", "GET", "/"), "inbound", INBOUND, None, None)
    assert tapped is not None
    tapped.responded(200, 1.0, [(b"server", b"x")])
    assert not quiet.events[0].http.request_init.HasField("headers")
    assert [(h.name, h.value) for h in asking.events[0].http.request_init.headers.headers] == [
        ("x-secret", b"v")]  # fmt: skip
    assert asking.events[1].http.response_init.headers.headers[0].name == "server"


def test_outbound_sides_come_from_the_endpoint() -> None:
    taps, _, _ = _taps()
    tap = taps.add(EVERYTHING, 10, False)
    values = ("outbound", "10.0.0.7:80", "true", "", "", "db.ns.serviceaccount.identity.x",
              "ns", "db", *NO_DST[2:])  # fmt: skip
    endpoint = Endpoint(HostPort("10.0.0.7", 80), "db", labels=values)
    route = RouteTarget("db.ns.svc", DEFAULT_ROUTE, None, None)  # type: ignore[arg-type]
    labels = ConnLabels("outbound", "10.0.0.7:80", peer="127.0.0.1:40000")
    taps.request(TARGET, "outbound", labels, endpoint, route)
    event = tap.events[0]
    assert event.proxy_direction == tap_pb2.TapEvent.OUTBOUND
    assert event.destination_meta.labels["server_id"] == "db.ns.serviceaccount.identity.x"
    assert event.destination_meta.labels["service"] == "db"
    assert event.source_meta.labels["client_id"] == taps.local_id
    assert event.destination.port == 80


def test_a_meshed_endpoints_destination_is_the_endpoint_not_its_proxys_port() -> None:
    # the request goes to the pod's proxy (:4143, over mTLS) and on to the app at :8080
    taps, _, _ = _taps()
    tap = taps.add(EVERYTHING, 10, False)
    values = ("outbound", "10.0.0.7:8080", "true", "", "", "db.ns.serviceaccount.identity.x",
              "ns", "db", "db-1", *NO_DST[3:])  # fmt: skip
    endpoint = Endpoint(HostPort("10.0.0.7", 4143), "db", labels=values)
    labels = ConnLabels("outbound", "10.96.0.1:8080", peer="127.0.0.1:40000")
    taps.request(TARGET, "outbound", labels, endpoint, None)
    event = tap.events[0]
    assert (event.destination.ip.ipv4, event.destination.port) == ((10 << 24) + 7, 8080)
    assert dict(event.destination_meta.labels) == {
        "tls": "true", "server_id": "db.ns.serviceaccount.identity.x", "namespace": "ns",
        "service": "db", "pod": "db-1",
    }  # fmt: skip
    Tcp = tap_pb2.ObserveRequest.Match.Tcp
    on_8080 = taps.add(
        compile_match(tap_pb2.ObserveRequest.Match(
            destination=Tcp(ports=Tcp.PortRange(min=8080)))), 10, False,
    )  # fmt: skip
    taps.request(TARGET, "outbound", labels, endpoint, None)
    assert len(on_8080.events) == 1


def test_a_reset_is_the_end() -> None:
    taps, _, _ = _taps()
    tap = taps.add(EVERYTHING, 10, False)
    tapped = taps.request(TARGET, "inbound", INBOUND, None, None)
    assert tapped is not None
    tapped.ended(None, True, 0)
    assert [e.http.WhichOneof("event") for e in tap.events] == ["request_init", "response_end"]
    assert tap.events[1].http.response_end.eos.reset_error_code == 2


def test_limit_ends_the_tap() -> None:
    taps, _, clock = _taps()
    tap = taps.add(EVERYTHING, 2, False)
    for _ in range(5):
        clock.now += 1
        _one(taps, clock)
    assert tap.done and tap.matched == 2 and len(tap.events) == 6


def test_limit_is_capped() -> None:
    taps, _, _ = _taps()
    assert taps.add(EVERYTHING, 0, False).limit == MAX_LIMIT
    assert taps.add(EVERYTHING, MAX_LIMIT * 10, False).limit == MAX_LIMIT
    assert taps.add(EVERYTHING, 5, False).limit == 5


def test_rate_bound_drops_and_counts() -> None:
    taps, tally, clock = _taps(rate=10.0)
    tap = taps.add(EVERYTHING, 1000, False)
    for _ in range(25):  # all within one instant: a second's worth goes, the rest is dropped
        clock.now = 100.0
        _one(taps, clock)
    assert tap.matched == 10 and tally.drops["rate"] == 15 * 3
    for _ in range(10):  # half a second later: half the bucket refilled
        clock.now = 100.5
        _one(taps, clock)
    assert tap.matched == 15
    clock.now = 99.0  # a clock that steps back refills nothing
    _one(taps, clock)
    assert tap.matched == 15


def test_buffer_bound_drops_and_counts() -> None:
    taps, tally, clock = _taps(buffer=4)
    tap = taps.add(EVERYTHING, 100, False)
    for _ in range(3):
        clock.now += 1
        _one(taps, clock)
    assert len(tap.events) == 4 and tally.drops["buffer"] == 5


def test_at_most_max_taps() -> None:
    taps, _, _ = _taps(max_taps=2)
    taps.add(EVERYTHING, 1, False)
    taps.add(EVERYTHING, 1, False)
    with pytest.raises(TooManyTaps):
        taps.add(EVERYTHING, 1, False)


def test_unmatched_requests_make_nothing() -> None:
    taps, _, _ = _taps()
    Http = tap_pb2.ObserveRequest.Match.Http
    tap = taps.add(compile_match(tap_pb2.ObserveRequest.Match(
        http=Http(path=Http.StringMatch(prefix="/other")))), 10, False)  # fmt: skip
    assert taps.request(TARGET, "inbound", INBOUND, None, None) is None
    assert not tap.events and taps.streams == 0
