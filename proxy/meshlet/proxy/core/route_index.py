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
winner. Each list is sorted once by the rest of the order (a method, then more headers, then
more query parameters; then the route and the rule sent first), so the first entry of it that
fits the request is its best: a match that asks nothing beyond its path fits without a check,
one that asks for a method, headers or query parameters is checked (`HttpMatch.summary`) only
when a request reaches its path. A gRPC match is filed by its service (a dict), the longer
service first, then what names no service; its lists are sorted by method, then headers.

What the inbound side shares is the reading of one match (`authz.HttpMatch.summary`,
`prefix_length`); its `path_table` is a flat list read in full, in Linkerd's order (an exact path
ties with a prefix of its length), for the few routes a Server has.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from meshlet.api.pathregex import Meter
from meshlet.proxy.core.authz import (
    GrpcMatch,
    Header,
    HostKind,
    HttpMatch,
    PathKind,
    Request,
    request,
)

if TYPE_CHECKING:
    from meshlet.proxy.core.client_policy import Route, Rule

# What a match asks beyond its path (HTTP: a method?, headers, query parameters; gRPC: the
# method's length, headers), where it leads, the match (None: a rule without matches, which
# matches every request), and whether it fits every request that reaches it (asks nothing more).
_Entry = tuple[tuple[int, ...], "Selected", HttpMatch | GrpcMatch | None, bool]
# A request's parts, from which `authz.request` makes the Request a match reads, and the meter
# that pays its regexes (one per request, whichever lists it is read from).
_Ask = tuple[str | None, str, str, Sequence[Header], Meter]


class Selected(NamedTuple):
    route: int  # the index of the route in the policy's list
    rule: int  # the index of the rule in the route
    target: Rule


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
    """The HTTP matches of the routes that share one host tier, each list best first."""

    __slots__ = ("every", "exact", "prefix", "regex", "regex_by_segment")

    def __init__(self) -> None:
        self.exact: dict[str, list[_Entry]] = {}
        self.prefix: dict[str, list[_Entry]] = {}  # by the prefix less its trailing slashes
        self.regex: list[_Entry] = []
        self.regex_by_segment: dict[str, list[_Entry]] = {}  # by the first segment they fix
        self.every: list[_Entry] = []  # length 1 whatever the path

    def add(self, selected: Selected, match: HttpMatch | GrpcMatch | None) -> None:
        if match is None:
            self.every.append(((False, 0, 0), selected, None, True))
            return
        if not isinstance(match, HttpMatch):
            return  # a gRPC match never fits an HTTP request
        path = match.path
        tail = (match.method is not None, len(match.headers), len(match.query))
        regex = path is not None and path.kind is PathKind.REGEX
        entry = (tail, selected, match, not regex and tail == (False, 0, 0))
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

    def lists(self) -> Iterator[list[_Entry]]:
        yield from (self.regex, self.every)
        for by in (self.exact, self.prefix, self.regex_by_segment):
            yield from by.values()

    def select(self, path: str, ask: _Ask) -> _Entry | None:
        hits = self.exact.get(path)
        if hits is not None and (found := _first_fit(hits, ask)) is not None:
            return found
        found = None
        if self.regex:
            found = _first_fit(self.regex, ask)
        if self.regex_by_segment:
            end = path.find("/", 1)
            hits = self.regex_by_segment.get(path[:end]) if end > 0 else None
            if hits is not None:
                found = _better(found, _first_fit(hits, ask))
        length = len(path) if found is not None else -1  # a regex matches the whole path
        rest = path.rstrip("/")
        cut = len(rest)
        while cut > 1 and self.prefix:  # the longest prefix that fits wins, or ties with a regex
            if cut < length:
                return found
            hits = self.prefix.get(rest[:cut])
            if hits is not None and (fit := _first_fit(hits, ask)) is not None:
                return _better(found, fit) if cut == length else fit
            cut = rest.rfind("/", 0, cut)
        if length > 1:
            return found
        short: list[tuple[int, list[_Entry]]] = [(1, self.every)]  # what is left: lengths 1, 0
        while cut >= 0 and self.prefix:
            if (hits := self.prefix.get(rest[:cut])) is not None:
                short.append((cut, hits))
            cut = rest.rfind("/", 0, cut) if cut else -1
        for at, hits in short:
            fit = _first_fit(hits, ask)
            if fit is None or at < length:
                continue
            found, length = (fit, at) if at > length else (_better(found, fit), at)
        return found


class _GrpcTier:
    """The gRPC matches of the routes that share one host tier, each list best first."""

    __slots__ = ("every", "service")

    def __init__(self) -> None:
        self.service: dict[str, list[_Entry]] = {}
        self.every: list[_Entry] = []  # no service named

    def add(self, selected: Selected, match: HttpMatch | GrpcMatch | None) -> None:
        if match is None:
            self.every.append(((0, 0), selected, None, True))
        elif isinstance(match, GrpcMatch):
            tail = (len(match.method), len(match.headers))
            entry = (tail, selected, match, tail == (0, 0))
            if match.service:
                self.service.setdefault(match.service, []).append(entry)
            else:
                self.every.append(entry)

    def lists(self) -> Iterator[list[_Entry]]:
        yield self.every
        yield from self.service.values()

    def select(self, path: str, ask: _Ask) -> _Entry | None:
        service = path[1:].partition("/")[0]
        hits = self.service.get(service) if service else None
        if hits is not None and (found := _first_fit(hits, ask)) is not None:
            return found
        return _first_fit(self.every, ask)


def _rank(entry: _Entry) -> tuple[object, ...]:
    """Sorts a list best first: more asked of the request (method, headers, query parameters),
    then the route and rule sent first."""
    return (*(-int(x) for x in entry[0]), entry[1].route, entry[1].rule)


def _first_fit(entries: list[_Entry], ask: _Ask) -> _Entry | None:
    """The best entry of a list (sorted by `_rank`, one path match length) that fits the
    request: the first that asks nothing beyond its path, or whose match reads the request (then
    built from its parts) and fits."""
    req = None
    for entry in entries:
        if entry[3]:
            return entry
        if req is None:
            req = request(*ask)
        if entry[2].summary(req) is not None:  # type: ignore[union-attr]
            return entry
    return None


def _better(a: _Entry | None, b: _Entry | None) -> _Entry | None:
    """Of two entries of one path match length, the one ranked first."""
    if a is None or b is None:
        return a or b
    return b if _rank(b) < _rank(a) else a


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
                    selected = Selected(index, at, rule)
                    for match in rule.matches or (None,):
                        into.add(selected, match)
        for each in (self._none, *self._exact.values(), *self._suffix.values()):
            for entries in each.lists():
                entries.sort(key=_rank)
        self._suffix_lengths = sorted({len(s) for s in self._suffix}, reverse=True)

    def select(self, req: Request) -> Selected | None:
        """The route and rule `req` takes; None when no route matches. RegexBudgetExceeded
        (meshlet.api.pathregex) when its regexes would cost the request more than it may
        spend: the request takes no route."""
        path = f"{req.path_only}?{req.query}" if req.query else req.path_only
        return self.select_parts(req.host, req.method, path, req.headers, req.meter)

    def select_parts(
        self,
        authority: str | None,
        method: str,
        path: str,
        headers: Sequence[Header],
        meter: Meter | None = None,
    ) -> Selected | None:
        """`select` for a request's parts, as `authz.request` reads them: the Request is made
        only when a match reads more than the path (or the routes name hosts)."""
        ask = (authority, method, path, headers, meter or Meter())
        path = path.partition("?")[0]
        if self._exact or self._suffix:
            host = request(*ask).host
            tier = self._exact.get(host)
            if tier is not None and (found := tier.select(path, ask)) is not None:
                return found[1]
            for length in self._suffix_lengths:
                if length <= len(host):
                    tier = self._suffix.get(host[len(host) - length :])
                    if tier is not None and (found := tier.select(path, ask)) is not None:
                        return found[1]
        found = self._none.select(path, ask)
        return None if found is None else found[1]
