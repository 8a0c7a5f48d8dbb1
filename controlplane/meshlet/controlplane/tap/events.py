"""Tap events as the controller's API speaks them: Linkerd's `TapEvent` turned into one flat
JSON object per event (the dashboard's and `meshlet viz tap`'s input), and a tap's filters
turned into the `ObserveRequest.Match` each proxy applies. Pure."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import http_types_pb2, net_pb2, tap_pb2

METHODS: Final = {
    name: value for name, value in http_types_pb2.HttpMethod.Registered.items()
}  # GET → 0, …
DIRECTIONS: Final = {
    tap_pb2.TapEvent.INBOUND: "inbound", tap_pb2.TapEvent.OUTBOUND: "outbound"
}  # fmt: skip
MAX_FILTER: Final = 1024


@dataclass(frozen=True, slots=True)
class Filters:
    """What a tap asks of each request; empty strings match everything."""

    method: str = ""
    path: str = ""  # a prefix
    authority: str = ""

    def problems(self) -> list[str]:
        found = [
            f"{name} is longer than {MAX_FILTER} characters"
            for name, value in (("method", self.method), ("path", self.path),
                                ("authority", self.authority))
            if len(value) > MAX_FILTER
        ]  # fmt: skip
        if self.path and not self.path.startswith("/"):
            found.append(f"path {self.path!r} must start with /")
        return found


def observe_request(filters: Filters, limit: int) -> tap_pb2.ObserveRequest:
    """The Observe request for `filters`: every given filter must hold (`all`)."""
    Match = tap_pb2.ObserveRequest.Match
    http: list[Any] = []
    if filters.method:
        method = http_types_pb2.HttpMethod()
        if filters.method.upper() in METHODS:
            method.registered = METHODS[filters.method.upper()]
        else:
            method.unregistered = filters.method
        http.append(Match(http=Match.Http(method=method)))
    if filters.path:
        http.append(Match(http=Match.Http(path=Match.Http.StringMatch(prefix=filters.path))))
    if filters.authority:
        authority = Match.Http.StringMatch(exact=filters.authority)
        http.append(Match(http=Match.Http(authority=authority)))
    return tap_pb2.ObserveRequest(limit=limit, match=Match(all=Match.Seq(matches=http)))


def address(tcp: net_pb2.TcpAddress) -> str:
    """`10.1.2.3:8080`, `[fd00::1]:8080`, or `` when the proxy gave none."""
    which = tcp.ip.WhichOneof("ip")
    if which == "ipv4":
        return f"{ipaddress.IPv4Address(tcp.ip.ipv4)}:{tcp.port}"
    if which == "ipv6":
        value = (tcp.ip.ipv6.first << 64) | tcp.ip.ipv6.last
        return f"[{ipaddress.IPv6Address(value)}]:{tcp.port}"
    return ""


def _method(method: http_types_pb2.HttpMethod) -> str:
    if method.WhichOneof("type") == "unregistered":
        return method.unregistered
    return str(http_types_pb2.HttpMethod.Registered.Name(method.registered))


def _seconds(duration: Any) -> float:
    return round(float(duration.seconds + duration.nanos / 1e9), 6)


def stream_key(proxy: str, event: tap_pb2.TapEvent) -> tuple[str, str, tuple[str, int, int]]:
    """(kind `req`|`rsp`|`end`|``, its key for the rate) of an event from `proxy`."""
    http = event.http
    kind = http.WhichOneof("event")
    if kind is None:
        return "", "", (proxy, 0, 0)
    part = getattr(http, kind)
    short = {"request_init": "req", "response_init": "rsp", "response_end": "end"}[kind]
    return short, kind, (proxy, part.id.base, part.id.stream)


def to_json(proxy: str, event: tap_pb2.TapEvent) -> dict[str, Any] | None:
    """The API's object for one event from the proxy of pod `proxy` (`ns/name`), or None for an
    event that is not HTTP."""
    short, kind, (_, base, stream) = stream_key(proxy, event)
    if not short:
        return None
    src_labels, dst_labels = dict(event.source_meta.labels), dict(event.destination_meta.labels)
    out: dict[str, Any] = {
        "type": short,
        "proxy": proxy,
        "id": f"{base}:{stream}",
        "direction": DIRECTIONS.get(event.proxy_direction, "unknown"),
        "src": address(event.source),
        "dst": address(event.destination),
        "tls": src_labels.get("tls") or dst_labels.get("tls") or "",
        "src_labels": src_labels,
        "dst_labels": dst_labels,
    }
    part = getattr(event.http, kind)
    if short == "req":
        out |= {"method": _method(part.method), "authority": part.authority, "path": part.path}
    elif short == "rsp":
        out |= {"status": part.http_status, "latency": _seconds(part.since_request_init)}
    else:
        out |= {"duration": _seconds(part.since_request_init), "bytes": part.response_bytes}
        end = part.eos.WhichOneof("end")
        if end is not None:
            out[end] = getattr(part.eos, end)
    return out


def request_fields(event: tap_pb2.TapEvent) -> tuple[str, str, str]:
    """(method, authority, path) of a `req` event."""
    init = event.http.request_init
    return _method(init.method), init.authority, init.path


def admits(filters: Filters, event: tap_pb2.TapEvent) -> bool:
    """Whether a `req` event meets `filters` (the controller checks again what proxies were
    asked, so a proxy that ignores a match cannot widen a tap)."""
    method, authority, path = request_fields(event)
    if filters.method and method.upper() != filters.method.upper():
        return False
    if filters.path and not path.startswith(filters.path):
        return False
    return not (filters.authority and authority != filters.authority)
