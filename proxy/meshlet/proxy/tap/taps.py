"""The proxy's open taps and what each has seen (sans-IO: `now` comes from an injected clock).

`Taps` is the one registry a proxy has. The request driver (http/attempts.py) asks it, per
request, only `open` (no tap: nothing else runs); with a tap open it calls `request` once the
request is routed and keeps the `Tapped` it returns (None: no tap matched) to tell it the
response head (`responded`: ResponseInit) and the exchange's end (`ended`: ResponseEnd, with
the response body's bytes).

A request's destination is where it went: inbound, the proxy's own target (the app's port); on
the outbound side, the endpoint the balancer picked, with its labels, even when it was reached
through its proxy's inbound port over mTLS.

Each tap is bounded three ways, all explicit:
- `limit` requests (Linkerd's `ObserveRequest.limit`; 0 or more than `MAX_LIMIT` means
  `MAX_LIMIT`): once that many requests matched and ended, the tap is `done`;
- `rate` requests a second (a token bucket of one second's worth): a matching request past it
  is not reported at all, and the drop is counted (`tap_events_dropped_total{reason="rate"}`);
- `buffer` events waiting for the client: past it events are dropped and counted
  (`reason="buffer"`), so a slow client never holds memory or slows a request.
A proxy holds at most `max_taps` taps at once (`TooManyTaps` past it).

Events carry no body, ever; headers only when the tap asked for them.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Protocol

from google.protobuf.duration_pb2 import Duration

from meshlet.api import http_types_pb2, net_pb2, tap_pb2
from meshlet.proxy.io.counters import DST_LABELS
from meshlet.proxy.tap.match import METHODS, SCHEMES, Addr, Predicate, Seen, parse_addr

MAX_LIMIT: Final = 10_000  # requests one tap may ask for
DEFAULT_RATE: Final = 100.0  # requests reported a second, per tap
DEFAULT_BUFFER: Final = 1_000  # events waiting for a tap's client
DEFAULT_MAX_TAPS: Final = 8  # taps open at once, per proxy
# ResponseEnd's reset code when the exchange was cut short (HTTP/2 INTERNAL_ERROR).
RESET_INTERNAL_ERROR: Final = 2

Clock = Callable[[], float]
Header = tuple[bytes, bytes]

_EVENT = tap_pb2.TapEvent
_INBOUND = _EVENT.INBOUND
_OUTBOUND = _EVENT.OUTBOUND


class TooManyTaps(Exception):
    """The proxy already holds its most taps (RESOURCE_EXHAUSTED to the client)."""


class Drops(Protocol):
    """Where dropped events and open taps are counted (metrics.TapCounts, or a test's tally)."""

    def dropped(self, reason: str, events: int) -> None: ...

    def opened(self, count: int) -> None: ...


class _Uncounted:
    def dropped(self, reason: str, events: int) -> None:
        pass

    def opened(self, count: int) -> None:
        pass


class Tap:
    """One client's tap: its match, bounds, and the events waiting for its client."""

    def __init__(
        self, match: Predicate, limit: int, headers: bool, rate: float, buffer: int, now: float
    ) -> None:
        self.match = match
        self.limit = MAX_LIMIT if limit <= 0 or limit > MAX_LIMIT else limit
        self.headers = headers
        self.rate = rate
        self.buffer = buffer
        self.tokens = rate
        self.refilled = now
        self.matched = 0  # requests taken (reported), at most `limit`
        self.ended = 0  # of those, the ones whose end was reported
        self.events: deque[Any] = deque()
        self.wake: Callable[[], None] | None = None  # told when events are queued or it is done

    @property
    def full(self) -> bool:
        """It has taken its `limit` of requests."""
        return self.matched >= self.limit

    @property
    def done(self) -> bool:
        """Every request it took has ended: nothing more will be queued."""
        return self.full and self.ended >= self.matched

    def admit(self, now: float) -> bool:
        """A token for one more request (the bucket refills at `rate` a second)."""
        if now > self.refilled:
            self.tokens = min(self.rate, self.tokens + (now - self.refilled) * self.rate)
            self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def push(self, event: Any, drops: Drops) -> None:
        if len(self.events) >= self.buffer:
            drops.dropped("buffer", 1)
        else:
            self.events.append(event)
        if self.wake is not None:
            self.wake()


class Taps:
    """The proxy's taps (see the module docstring)."""

    def __init__(
        self,
        drops: Drops | None = None,
        clock: Clock | None = None,
        *,
        local_id: str = "",
        max_taps: int = DEFAULT_MAX_TAPS,
        rate: float = DEFAULT_RATE,
        buffer: int = DEFAULT_BUFFER,
        base: int | None = None,
    ) -> None:
        import time

        self.open = False  # the one thing the request driver reads per request
        self.taps: list[Tap] = []
        self.drops: Drops = drops or _Uncounted()
        self.clock = clock or time.monotonic
        self.local_id = local_id
        self.max_taps = max_taps
        self.rate = rate
        self.buffer = buffer
        self.base = random.getrandbits(32) if base is None else base
        self.streams = 0

    def add(self, match: Predicate, limit: int, headers: bool) -> Tap:
        if len(self.taps) >= self.max_taps:
            raise TooManyTaps(f"this proxy already serves {self.max_taps} taps")
        tap = Tap(match, limit, headers, self.rate, self.buffer, self.clock())
        self.taps.append(tap)
        self.open = True
        self.drops.opened(len(self.taps))
        return tap

    def remove(self, tap: Tap) -> None:
        if tap in self.taps:
            self.taps.remove(tap)
        self.open = bool(self.taps)
        self.drops.opened(len(self.taps))

    def request(
        self,
        target: Any,
        direction: str,
        labels: Any,
        endpoint: Any,
        route: Any,
    ) -> Tapped | None:
        """A request was routed (or answered by the proxy): the taps that take it, with its
        RequestInit queued on each; None when none does."""
        seen, source, destination = _seen(target, direction, labels, endpoint, route, self.local_id)
        now = self.clock()
        taking: list[Tap] = []
        for tap in self.taps:
            if tap.full or not tap.match(seen):
                continue
            if not tap.admit(now):
                self.drops.dropped("rate", 3)
                continue
            tap.matched += 1
            taking.append(tap)
        if not taking:
            return None
        self.streams += 1
        tapped = Tapped(self, taking, now, self.streams, source, destination, direction)
        headers = getattr(target, "headers", ())
        for tap in taking:
            init = _EVENT.Http.RequestInit(
                id=tapped.id, method=_method(seen.method), scheme=_scheme(seen.scheme),
                authority=seen.authority, path=seen.path,
            )  # fmt: skip
            if tap.headers:
                init.headers.CopyFrom(_headers(headers))
            tap.push(tapped.event(http=_EVENT.Http(request_init=init)), self.drops)
        return tapped


class Tapped:
    """One request some taps took: its id, sides, and when it started."""

    __slots__ = (
        "destination",
        "direction",
        "id",
        "source",
        "started",
        "taps",
        "taps_of",
        "to_head",
    )

    def __init__(
        self,
        taps_of: Taps,
        taps: list[Tap],
        now: float,
        stream: int,
        source: tuple[Any, dict[str, str]],
        destination: tuple[Any, dict[str, str]],
        direction: str,
    ) -> None:
        self.taps_of = taps_of
        self.taps = taps
        self.started = now
        self.to_head: float | None = None  # seconds from the request to its response head
        self.id = _EVENT.Http.StreamId(base=taps_of.base, stream=stream)
        self.source = source
        self.destination = destination
        self.direction = _INBOUND if direction == "inbound" else _OUTBOUND

    def event(self, **kwargs: Any) -> Any:
        (src, src_meta), (dst, dst_meta) = self.source, self.destination
        event = _EVENT(proxy_direction=self.direction, **kwargs)
        if src is not None:
            event.source.CopyFrom(src)
        if dst is not None:
            event.destination.CopyFrom(dst)
        event.source_meta.labels.update(src_meta)
        event.destination_meta.labels.update(dst_meta)
        return event

    def responded(
        self, status: int, latency_ms: float | None, headers: Sequence[Header] = ()
    ) -> None:
        """The response head the client got (`status` 0: none; `latency_ms`: from the
        request's arrival to it, None: not known): ResponseInit on each tap."""
        if not status or self.to_head is not None:
            return
        total = max(0.0, self.taps_of.clock() - self.started)
        to_head = self.to_head = total if latency_ms is None else min(total, latency_ms / 1000.0)
        drops = self.taps_of.drops
        for tap in self.taps:
            init = _EVENT.Http.ResponseInit(
                id=self.id, since_request_init=_duration(to_head), http_status=status
            )
            if tap.headers:
                init.headers.CopyFrom(_headers(headers))
            tap.push(self.event(http=_EVENT.Http(response_init=init)), drops)

    def ended(self, grpc_status: str | None, failed: bool, response_bytes: int) -> None:
        """The exchange is over: the response body's bytes the client got, and how it ended
        (`failed`: cut short, or no response at all; else the gRPC status of its trailers
        when it has one): ResponseEnd on each tap."""
        drops = self.taps_of.drops
        total = max(0.0, self.taps_of.clock() - self.started)
        to_head = total if self.to_head is None else self.to_head
        eos = tap_pb2.Eos()
        if failed:
            eos.reset_error_code = RESET_INTERNAL_ERROR
        elif grpc_status is not None and grpc_status.isdigit():
            eos.grpc_status_code = int(grpc_status)
        for tap in self.taps:
            end = _EVENT.Http.ResponseEnd(
                id=self.id, since_request_init=_duration(total),
                since_response_init=_duration(total - to_head), response_bytes=response_bytes,
                eos=eos,
            )  # fmt: skip
            tap.ended += 1
            tap.push(self.event(http=_EVENT.Http(response_end=end)), drops)


def _seen(
    target: Any, direction: str, labels: Any, endpoint: Any, route: Any, local_id: str
) -> tuple[Seen, tuple[Any, dict[str, str]], tuple[Any, dict[str, str]]]:
    """What a tap matches, and each side's address and labels."""
    authority = target.authority or ""
    scheme = getattr(target, "scheme", None) or "http"
    source_addr = _addr(getattr(labels, "peer", ""))
    dst_labels: dict[str, str] = {}
    values = endpoint.labels if endpoint is not None else None
    if values is not None:  # a discovered endpoint: its own address (`target_addr`), not the
        dest_addr = _addr(values[1])  # port of its proxy that carries the request there
    elif endpoint is not None:
        dest_addr = parse_addr(endpoint.addr.host, endpoint.addr.port)
    else:
        dest_addr = _addr(labels.target_addr)
    if values is not None:
        tls, client_id, server_id = values[2], local_id, values[5]
        dst_labels = {k: v for k, v in zip(DST_LABELS, values[6:], strict=False) if v}
    elif direction == "inbound":
        tls, client_id, server_id = labels.tls, labels.client_id, local_id
    else:
        tls, client_id, server_id = labels.tls, "", labels.server_id
    src_meta = {"tls": tls}
    if client_id and tls == "true":
        src_meta["client_id"] = client_id
    dst_meta = {"tls": tls, **dst_labels}
    if server_id and tls == "true":
        dst_meta["server_id"] = server_id
    route_labels: dict[str, str] = {}
    if route is not None:
        route_labels = {"route": route.policy.name} if route.policy.name else {}
        if route.dst:
            dst_labels.setdefault("authority", route.dst)
    seen = Seen(
        method=target.method, scheme=scheme, authority=authority, path=target.path,
        source=source_addr, destination=dest_addr, destination_labels=dst_labels,
        route_labels=route_labels,
    )  # fmt: skip
    return seen, (_tcp(source_addr), src_meta), (_tcp(dest_addr), dst_meta)


def _addr(text: str) -> Addr | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return parse_addr(host, int(port))


def _tcp(addr: Addr | None) -> Any:
    if addr is None:
        return None
    ip = net_pb2.IPAddress()
    if addr.ip.version == 4:
        ip.ipv4 = int(addr.ip)
    else:
        value = int(addr.ip)
        ip.ipv6.first, ip.ipv6.last = value >> 64, value & ((1 << 64) - 1)
    return net_pb2.TcpAddress(ip=ip, port=addr.port)


def _method(method: str) -> Any:
    if method in METHODS:
        return http_types_pb2.HttpMethod(
            registered=http_types_pb2.HttpMethod.Registered.Value(method)
        )
    return http_types_pb2.HttpMethod(unregistered=method)


def _scheme(scheme: str) -> Any:
    lowered = scheme.lower()
    if lowered in SCHEMES:
        return http_types_pb2.Scheme(
            registered=http_types_pb2.Scheme.Registered.Value(lowered.upper())
        )
    return http_types_pb2.Scheme(unregistered=scheme)


def _headers(headers: Iterable[Header]) -> Any:
    out = http_types_pb2.Headers()
    for name, value in headers:
        out.headers.add(name=name.decode("latin-1"), value=bytes(value))
    return out


def _duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration
