"""Which requests a tap sees: Linkerd's `ObserveRequest.Match`, compiled once into a predicate
over what the proxy knows of a request when it arrives (sans-IO).

A match is a tree: `all` / `any` / `not` of leaves on the source or destination address (a
netmask, or a port range), the request (scheme, method, authority and path, each exact or a
prefix) and the destination's or the route's labels. An empty match (no field set) matches
every request, as an empty `all` does; an empty `any` matches none. A port range is inclusive,
and a `max` of 0 means `min` alone (tap.proto). A request whose address is unknown matches no
address leaf. A malformed match (a netmask over its address's bits, a port range upside down) is
refused whole with `InvalidMatch`, and so is one too big to evaluate on every request: a tree
deeper than `MAX_DEPTH` or with more than `MAX_LEAVES` leaves. The size is measured first, by a
walk that stops at the first bound crossed, so a huge match costs no more than a small one to
refuse; a request is matched against at most `MAX_LEAVES` leaves per open tap.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

# Nested all/any/not past this depth is refused (a client's tree is recursed over).
MAX_DEPTH: Final = 16
# Leaves (address, HTTP and label tests, empty matches and empty `all`/`any`) past this are
# refused: each request a tap sees is matched against every one of them.
MAX_LEAVES: Final = 64

METHODS: Final = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "HEAD", "TRACE")
SCHEMES: Final = ("http", "https")

IpAddr = ipaddress.IPv4Address | ipaddress.IPv6Address


class Addr(NamedTuple):
    ip: IpAddr
    port: int


class Seen(NamedTuple):
    """A request as a tap matches it."""

    method: str
    scheme: str  # "http" | "https" (or another scheme as sent)
    authority: str
    path: str  # with the query
    source: Addr | None
    destination: Addr | None
    destination_labels: Mapping[str, str]
    route_labels: Mapping[str, str]


Predicate = Callable[[Seen], bool]


class InvalidMatch(ValueError):
    """The match cannot be used; the message says why (INVALID_ARGUMENT to the client)."""


def _all(_seen: Seen) -> bool:
    return True


def compile_match(match: Any) -> Predicate:
    """The predicate of an `ObserveRequest.Match` (a protobuf message, possibly empty)."""
    check_size(match)
    return _compile(match)


def check_size(match: Any) -> None:
    """Raises InvalidMatch when `match` is deeper than MAX_DEPTH or has more than MAX_LEAVES
    leaves; looks at no more than MAX_LEAVES leaves and MAX_DEPTH levels to say so."""
    leaves = 0
    todo = [(match, 0)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise InvalidMatch(f"the match is nested deeper than {MAX_DEPTH}")
        which = node.WhichOneof("match")
        if which in ("all", "any"):
            children = getattr(node, which).matches
            if len(children) > MAX_LEAVES:
                raise InvalidMatch(f"the match has more than {MAX_LEAVES} leaves")
            if children:
                todo.extend((child, depth + 1) for child in children)
                continue
        elif which == "not":
            todo.append((node.__getattribute__("not"), depth + 1))
            continue
        leaves += 1
        if leaves > MAX_LEAVES:
            raise InvalidMatch(f"the match has more than {MAX_LEAVES} leaves")


def _compile(match: Any) -> Predicate:
    which = match.WhichOneof("match")
    if which is None:
        return _all
    if which in ("all", "any"):
        parts = tuple(_compile(m) for m in getattr(match, which).matches)
        if which == "all":
            return lambda seen: all(p(seen) for p in parts)
        return lambda seen: any(p(seen) for p in parts)
    if which == "not":
        inner = _compile(match.__getattribute__("not"))
        return lambda seen: not inner(seen)
    if which == "source":
        tcp = _tcp(match.source)
        return lambda seen: seen.source is not None and tcp(seen.source)
    if which == "destination":
        tcp = _tcp(match.destination)
        return lambda seen: seen.destination is not None and tcp(seen.destination)
    if which == "http":
        return _http(match.http)
    if which == "destination_label":
        key, value = match.destination_label.key, match.destination_label.value
        return lambda seen: seen.destination_labels.get(key) == value
    key, value = match.route_label.key, match.route_label.value
    return lambda seen: seen.route_labels.get(key) == value


def _tcp(tcp: Any) -> Callable[[Addr], bool]:
    which = tcp.WhichOneof("match")
    if which == "ports":
        low = tcp.ports.min
        high = tcp.ports.max or low  # tap.proto: `max` 0 means `min` alone
        if low > high or high > 65535:
            raise InvalidMatch(f"port range {low}-{high} is not within 0-65535, low to high")
        return lambda addr: low <= addr.port <= high
    if which == "netmask":
        net = _network(tcp.netmask.ip, tcp.netmask.mask)
        return lambda addr: addr.ip.version == net.version and addr.ip in net
    return lambda addr: True


def _network(ip: Any, mask: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    which = ip.WhichOneof("ip")
    if which == "ipv4":
        address: IpAddr = ipaddress.IPv4Address(ip.ipv4)
    elif which == "ipv6":
        address = ipaddress.IPv6Address((ip.ipv6.first << 64) | ip.ipv6.last)
    else:
        raise InvalidMatch("a netmask needs an IP address")
    if mask > address.max_prefixlen:
        raise InvalidMatch(f"netmask /{mask} is longer than the address's {address.max_prefixlen}")
    return ipaddress.ip_network((address, mask), strict=False)


def _http(http: Any) -> Predicate:
    which = http.WhichOneof("match")
    if which == "scheme":
        scheme = _registered(http.scheme, SCHEMES).lower()
        return lambda seen: seen.scheme.lower() == scheme
    if which == "method":
        method = _registered(http.method, METHODS)
        return lambda seen: seen.method == method
    if which == "authority":
        test = _string(http.authority)
        return lambda seen: test(seen.authority)
    if which == "path":
        test = _string(http.path)
        return lambda seen: test(seen.path)
    return _all


def _registered(value: Any, names: tuple[str, ...]) -> str:
    if value.WhichOneof("type") == "unregistered":
        return str(value.unregistered)
    return names[value.registered] if value.registered < len(names) else ""


def _string(match: Any) -> Callable[[str], bool]:
    which = match.WhichOneof("match")
    if which == "exact":
        exact = match.exact
        return lambda text: text == exact
    if which == "prefix":
        prefix = match.prefix
        return lambda text: text.startswith(prefix)
    return lambda text: True


def parse_addr(host: str, port: int) -> Addr | None:
    """An address as a tap matches it (None: `host` is not an IP address)."""
    try:
        return Addr(ipaddress.ip_address(host.strip("[]")), port)
    except ValueError:
        return None
