"""An outbound policy's routes indexed once, so that choosing a request's route and rule costs
about the same with ten thousand routes as with one (pure; `core.route_select` states the
precedence, and this module returns exactly what a scan of every rule in that order would).

Every match of every rule is filed once, by what a request must have to meet it, under the host
tier it serves: the routes naming an exact host, those naming each host suffix, and those naming
no host. A request reads only the tiers its host selects, best first (exact, then the longer
suffix, then none): a route tried in a better tier and not matched cannot match in a worse one,
since its rules are the same there.

Within a tier an HTTP match is filed by its path: an exact path in a dict by the path; a prefix
in a dict by the prefix without its trailing slashes; a regex in a dict by the first path segment
its leading literal text fixes (`/users/[0-9]+` under `/users`), or else in a short list read in
full; what matches every path (the prefix `/`, no path, a rule without matches) in one list. A
request looks up its own path, then each of its segment boundaries from the longest down, as
`authz.prefix_length` reads a prefix. The Gateway API ranks an exact path first and then the
longer path match, before a method, headers or query parameters, so the candidates are read by
that length, longest first, and the first length where some match fits the request holds the
winner: only those candidates are checked in full (method, headers, query parameters, through
`route_select`'s keys). A match that asks for headers, a method or query parameters is filed by
its path like any other: it costs a check only when a request reaches its path. A gRPC match is
filed by its service (a dict), the longer service first, then what names no service. Ties go to
the lower route index, then the lower rule index.

What the inbound side shares is the reading of one match (`authz.HttpMatch.summary`,
`prefix_length`); its `path_table` is a flat list read in full, in Linkerd's order (an exact path
ties with a prefix of its length), for the few routes a Server has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from meshlet.proxy.core.authz import GrpcMatch, HostKind, HttpMatch, PathKind, Request

if TYPE_CHECKING:
    from meshlet.proxy.core.client_policy import Route, Rule

MATCH_ALL_HTTP = (False, 1, False, 0, 0)
MATCH_ALL_GRPC = (0, 0, 0)

# route index, rule index, the match (None: the rule has none and matches every request)
_Entry = tuple[int, int, HttpMatch | GrpcMatch | None]
_Key = tuple[object, ...]
_KeyOf = Callable[[HttpMatch | GrpcMatch | None, Request], _Key | None]


class Selected(NamedTuple):
    route: int  # the index of the route in the policy's list
    rule: int  # the index of the rule in the route
    target: Rule


def http_key(match: HttpMatch, req: Request) -> tuple[bool, int, bool, int, int] | None:
    """How well `match` fits `req` (higher is better), None when it does not."""
    summary = match.summary(req)
    if summary is None:
        return None
    exact = match.path is not None and match.path.kind is PathKind.EXACT
    return (exact, summary[0], match.method is not None, len(match.headers), len(match.query))


def grpc_key(match: GrpcMatch, req: Request) -> tuple[int, int, int] | None:
    summary = match.summary(req)
    return None if summary is None else summary[:3]


_REGEX_SYNTAX = frozenset("\\.[](){}*+?|^$")
_QUANTIFIERS = frozenset("*+?{")


def first_segment(regex: str) -> str:
    """The first path segment (`/users`) every path `regex` fully matches starts with, read
    from the regex's leading literal text; "" when the regex does not fix one (an alternation
    anywhere, or no `/` after the first segment's literal characters)."""
    if "|" in regex:
        return ""
    literal = 0
    while literal < len(regex) and regex[literal] not in _REGEX_SYNTAX:
        literal += 1
    if literal < len(regex) and regex[literal] in _QUANTIFIERS:
        literal -= 1  # the quantified character may be absent or repeated
    end = regex.find("/", 1, max(literal, 0))
    return regex[:end] if regex.startswith("/") and end > 1 else ""


class _HttpTier:
    """The HTTP matches of the routes that share one host tier."""

    __slots__ = ("every", "exact", "prefix", "regex", "regex_by_segment")

    def __init__(self) -> None:
        self.exact: dict[str, list[_Entry]] = {}
        self.prefix: dict[str, list[_Entry]] = {}  # by the prefix less its trailing slashes
        self.regex: list[_Entry] = []
        self.regex_by_segment: dict[str, list[_Entry]] = {}  # by the first segment they fix
        self.every: list[_Entry] = []  # length 1 whatever the path

    def add(self, entry: _Entry) -> None:
        match = entry[2]
        if match is None:
            self.every.append(entry)
            return
        if not isinstance(match, HttpMatch):
            return  # a gRPC match never fits an HTTP request
        path = match.path
        if path is None or path.matches_all:
            self.every.append(entry)
        elif path.kind is PathKind.EXACT:
            self.exact.setdefault(path.value, []).append(entry)
        elif path.kind is PathKind.PREFIX:
            self.prefix.setdefault(path.value.rstrip("/"), []).append(entry)
        elif segment := first_segment(path.value):
            self.regex_by_segment.setdefault(segment, []).append(entry)
        else:
            self.regex.append(entry)

    def select(self, req: Request) -> _Entry | None:
        path = req.path_only
        hits = self.exact.get(path)
        if hits is not None and (found := _best(hits, req, _http)) is not None:
            return found
        levels: list[tuple[int, list[_Entry]]] = []
        if self.regex:
            levels.append((len(path), self.regex))
        if self.regex_by_segment:
            end = path.find("/", 1)
            hit = self.regex_by_segment.get(path[:end]) if end > 0 else None
            if hit is not None:
                levels.append((len(path), hit))
        if self.prefix:
            rest = path.rstrip("/")
            cut = len(rest)
            while cut >= 0:
                hit = self.prefix.get(rest[:cut])
                if hit is not None:
                    levels.append((cut, hit))
                cut = rest.rfind("/", 0, cut) if cut else -1
        if self.every:
            levels.append((1, self.every))
        return _by_level(levels, req, _http)


class _GrpcTier:
    """The gRPC matches of the routes that share one host tier."""

    __slots__ = ("every", "service")

    def __init__(self) -> None:
        self.service: dict[str, list[_Entry]] = {}
        self.every: list[_Entry] = []  # no service named

    def add(self, entry: _Entry) -> None:
        match = entry[2]
        if match is None:
            self.every.append(entry)
        elif isinstance(match, GrpcMatch):
            if match.service:
                self.service.setdefault(match.service, []).append(entry)
            else:
                self.every.append(entry)

    def select(self, req: Request) -> _Entry | None:
        service = req.path_only[1:].partition("/")[0]
        hits = self.service.get(service) if service else None
        if hits is not None and (found := _best(hits, req, _grpc)) is not None:
            return found
        return _best(self.every, req, _grpc)


def _http(match: HttpMatch | GrpcMatch | None, req: Request) -> _Key | None:
    if match is None:
        return MATCH_ALL_HTTP
    return http_key(match, req) if isinstance(match, HttpMatch) else None


def _grpc(match: HttpMatch | GrpcMatch | None, req: Request) -> _Key | None:
    if match is None:
        return MATCH_ALL_GRPC
    return grpc_key(match, req) if isinstance(match, GrpcMatch) else None


def _best(entries: Sequence[_Entry], req: Request, key_of: _KeyOf) -> _Entry | None:
    """The entry whose match fits `req` best; of equals, the lowest route then rule."""
    best: _Key | None = None
    found: _Entry | None = None
    for entry in entries:
        key = key_of(entry[2], req)
        if key is None:
            continue
        if (
            found is None
            or key > best  # type: ignore[operator]
            or (key == best and entry[:2] < found[:2])
        ):
            best, found = key, entry
    return found


def _by_level(
    levels: list[tuple[int, list[_Entry]]], req: Request, key_of: _KeyOf
) -> _Entry | None:
    """The best fit among the candidates of the longest path match that has any fit."""
    if len(levels) > 1:
        levels.sort(key=lambda level: -level[0])
    at = 0
    while at < len(levels):
        length = levels[at][0]
        group: list[_Entry] = []
        while at < len(levels) and levels[at][0] == length:
            group += levels[at][1]
            at += 1
        if (found := _best(group, req, key_of)) is not None:
            return found
    return None


class RouteTable:
    """One list of routes (a policy's HTTP or its gRPC routes) indexed for `select`."""

    __slots__ = ("_exact", "_none", "_suffix", "_suffix_lengths", "routes")

    def __init__(self, routes: Sequence[Route], grpc: bool) -> None:
        tier = _GrpcTier if grpc else _HttpTier
        self.routes = routes
        self._none: _HttpTier | _GrpcTier = tier()
        self._exact: dict[str, _HttpTier | _GrpcTier] = {}
        self._suffix: dict[str, _HttpTier | _GrpcTier] = {}
        for index, route in enumerate(routes):
            tiers = {(h.kind, h.value): None for h in route.hosts} if route.hosts else {None: None}
            for host in tiers:
                if host is None:
                    into = self._none
                else:
                    kind, value = host
                    by = self._exact if kind is HostKind.EXACT else self._suffix
                    found = by.get(value)
                    if found is None:
                        found = by[value] = tier()
                    into = found
                for at, rule in enumerate(route.rules):
                    for match in rule.matches or (None,):
                        into.add((index, at, match))
        self._suffix_lengths = sorted({len(s) for s in self._suffix}, reverse=True)

    def select(self, req: Request) -> Selected | None:
        """The route and rule `req` takes; None when no route matches."""
        found = self._select(req)
        if found is None:
            return None
        return Selected(found[0], found[1], self.routes[found[0]].rules[found[1]])

    def _select(self, req: Request) -> _Entry | None:
        host = req.host
        tier = self._exact.get(host) if self._exact else None
        if tier is not None and (found := tier.select(req)) is not None:
            return found
        for length in self._suffix_lengths:
            if length <= len(host):
                tier = self._suffix.get(host[len(host) - length :])
                if tier is not None and (found := tier.select(req)) is not None:
                    return found
        return self._none.select(req)
