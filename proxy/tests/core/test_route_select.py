"""Outbound route selection (the Gateway API's precedence, one table row per rule of it), the
index that selects as a scan of every rule would (hypothesis, against that scan kept here), and
the weighted pick of a backend."""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshlet.api.pathregex import compile_path_regex
from meshlet.proxy.core.authz import (
    GrpcMatch,
    HostKind,
    HostMatch,
    HttpMatch,
    PathKind,
    PathMatch,
    Request,
    ValueMatch,
    request,
)
from meshlet.proxy.core.client_policy import (
    EMPTY,
    Backend,
    Balance,
    Dispatch,
    Distribution,
    PeakEwma,
    PolicyRef,
    Queue,
    Route,
    RouteBackend,
    Rule,
)
from meshlet.proxy.core.route_index import first_segment
from meshlet.proxy.core.route_select import (
    RouteTable,
    Selected,
    grpc_key,
    http_key,
    pick,
    select_grpc,
    select_http,
)


def backend(name: str, weight: int = 1) -> RouteBackend:
    b = Backend(PolicyRef("Service", name, "core", "shop"), Queue(100, 3.0),
                Balance(f"{name}.shop.svc.cluster.local:80", PeakEwma(0.03, 10.0)))  # fmt: skip
    return RouteBackend(b, weight=weight)


def exact(value: str, **kw: object) -> HttpMatch:
    return HttpMatch(PathMatch(PathKind.EXACT, value), **kw)  # type: ignore[arg-type]


def prefix(value: str, **kw: object) -> HttpMatch:
    return HttpMatch(PathMatch(PathKind.PREFIX, value), **kw)  # type: ignore[arg-type]


def regex(value: str) -> HttpMatch:
    return HttpMatch(PathMatch(PathKind.REGEX, value, compile_path_regex(value)))


def header(name: str, value: bytes) -> tuple[ValueMatch, ...]:
    return (ValueMatch(name, exact=value),)


def query(name: str, value: str) -> tuple[ValueMatch, ...]:
    return (ValueMatch(name, exact=value),)


def route(name: str, *rules: tuple[HttpMatch | GrpcMatch, ...], hosts: tuple[HostMatch, ...] = ()
          ) -> Route:  # fmt: skip
    return Route(PolicyRef("HTTPRoute", name, "gateway.networking.k8s.io", "shop"), hosts,
                 tuple(Rule(m, (), EMPTY) for m in rules))  # type: ignore[arg-type]  # fmt: skip


def chosen(routes: list[Route], method: str, path: str, headers: list[tuple[bytes, bytes]] = (),
           host: str = "web.shop") -> str | None:  # type: ignore[assignment]  # fmt: skip
    found = select_http(routes, request(host, method, path, headers))
    return None if found is None else f"{routes[found.route].meta.name}/{found.rule}"


# (routes, method, path, headers, the route/rule chosen): each row one step of the precedence
PRECEDENCE = [
    ("exact path over a prefix of the same length",
     [route("p", (prefix("/api"),)), route("e", (exact("/api"),))], "GET", "/api", [], "e/0"),
    ("exact path over a longer-matching prefix route sent first",
     [route("p", (prefix("/api/v1"),)), route("e", (exact("/api/v1"),))], "GET", "/api/v1", [],
     "e/0"),
    ("the longer prefix first",
     [route("short", (prefix("/api"),)), route("long", (prefix("/api/v1"),))], "GET",
     "/api/v1/x", [], "long/0"),
    ("a prefix matches whole segments only",
     [route("api", (prefix("/api"),)), route("all", (prefix("/"),))], "GET", "/apis", [],
     "all/0"),
    ("a method over more headers",
     [route("h", (prefix("/", headers=header("x-a", b"1") + header("x-b", b"2")),)),
      route("m", (prefix("/", method="GET"),))], "GET", "/", [(b"x-a", b"1"), (b"x-b", b"2")],
     "m/0"),
    ("more headers over more query parameters",
     [route("q", (prefix("/", query=query("a", "1") + query("b", "2")),)),
      route("h", (prefix("/", headers=header("x-a", b"1")),))], "GET", "/?a=1&b=2",
     [(b"X-A", b"1")], "h/0"),
    ("more query parameters over fewer",
     [route("one", (prefix("/", query=query("a", "1")),)),
      route("two", (prefix("/", query=query("a", "1") + query("b", "2")),))], "GET",
     "/?b=2&a=1", [], "two/0"),
    ("a tie goes to the route sent first (oldest, then by name)",
     [route("older", (prefix("/x"),)), route("newer", (prefix("/x"),))], "GET", "/x", [],
     "older/0"),
    ("within a route, the best rule, not the first",
     [route("r", (prefix("/"),), (exact("/login"),))], "POST", "/login", [], "r/1"),
    ("a rule without matches matches everything, as the prefix /",
     [route("any", ()), route("api", (prefix("/api"),))], "GET", "/api/x", [], "api/0"),
    ("a method that differs does not match",
     [route("post", (exact("/a", method="POST"),))], "GET", "/a", [], None),
    ("a header value that differs does not match",
     [route("h", (prefix("/", headers=header("x-a", b"1")),))], "GET", "/", [(b"x-a", b"2")],
     None),
    ("a regex matches the whole path",
     [route("re", (regex("/users/[0-9]+"),))], "GET", "/users/42/x", [], None),
    ("a regex ties with a prefix of the whole path: the route sent first",
     [route("re", (regex("/users/[0-9]+"),)), route("p", (prefix("/users/42"),))], "GET",
     "/users/42", [], "re/0"),
    ("a regex over a shorter prefix",
     [route("p", (prefix("/users"),)), route("re", (regex("/users/[0-9]+"),))], "GET",
     "/users/42", [], "re/0"),
]  # fmt: skip


@pytest.mark.parametrize(("why", "routes", "method", "path", "headers", "expected"), PRECEDENCE,
                         ids=[row[0] for row in PRECEDENCE])  # fmt: skip
def test_precedence(
    why: str,
    routes: list[Route],
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    expected: str | None,
) -> None:
    assert chosen(routes, method, path, headers) == expected
    if expected is not None:
        assert chosen(list(reversed(routes)), method, path, headers) == expected or (
            "tie" in why), "the order of the routes decides only ties"  # fmt: skip


def test_hosts_come_before_rules_exact_over_wildcard_longer_wildcard_first() -> None:
    exact_host = route("exact", (prefix("/"),), hosts=(HostMatch(HostKind.EXACT, "a.b.shop"),))
    short = route("short", (exact("/x"),), hosts=(HostMatch(HostKind.SUFFIX, ".shop"),))
    long = route("long", (prefix("/"),), hosts=(HostMatch(HostKind.SUFFIX, ".b.shop"),))
    routes = [short, long, exact_host]
    assert chosen(routes, "GET", "/x", host="a.b.shop:8080") == "exact/0"
    assert chosen(routes, "GET", "/x", host="c.b.shop") == "long/0"
    assert chosen(routes, "GET", "/x", host="c.shop") == "short/0"
    assert chosen(routes, "GET", "/x", host="other") is None


def test_grpc_longer_service_then_method_then_headers() -> None:
    any_rpc = route("any", (GrpcMatch(),))
    service = route("service", (GrpcMatch("shop.Cart"),))
    method = route("method", (GrpcMatch("shop.Cart", "Add"),))
    tenant = route("tenant", (GrpcMatch("shop.Cart", "", header("x-tenant", b"blue")),))
    routes = [any_rpc, tenant, service, method]

    def pick_route(path: str, headers: list[tuple[bytes, bytes]] = ()) -> str | None:  # type: ignore[assignment]
        found = select_grpc(routes, request("cart", "POST", path, headers))
        return None if found is None else routes[found.route].meta.name

    assert pick_route("/shop.Cart/Add", [(b"x-tenant", b"blue")]) == "method"
    assert pick_route("/shop.Cart/Remove", [(b"x-tenant", b"blue")]) == "tenant"
    assert pick_route("/shop.Cart/Remove") == "service"
    assert pick_route("/shop.Other/Get") == "any"


def test_a_weighted_pick_over_ten_thousand_draws_is_within_two_percent() -> None:
    dist = Distribution.weighted((backend("a", 70), backend("b", 20), backend("c", 10),
                                  backend("never", 0)))  # fmt: skip
    rng = random.Random(25)
    draws = 10_000
    counts = Counter(rb.backend.meta.name for _ in range(draws) if (rb := pick(dist, rng)))
    assert counts["never"] == 0
    for name, share in (("a", 0.70), ("b", 0.20), ("c", 0.10)):
        assert abs(counts[name] / draws - share) <= 0.02, counts


def test_the_pick_is_the_injected_sources_and_bisects_the_cumulative_weights() -> None:
    dist = Distribution.weighted((backend("a", 1), backend("b", 0), backend("c", 2)))
    assert dist.cumulative == (1, 1, 3)

    class Fixed(random.Random):
        def __init__(self, value: int) -> None:
            super().__init__(0)
            self.value = value

        def randrange(self, stop: int) -> int:  # type: ignore[override]
            assert stop == 3
            return self.value

    assert [pick(dist, Fixed(v)).backend.meta.name for v in (0, 1, 2)] == ["a", "c", "c"]  # type: ignore[union-attr]


def test_first_available_and_empty() -> None:
    first = Distribution(Dispatch.FIRST_AVAILABLE, (backend("primary"), backend("standby")))
    rng = random.Random(1)
    assert pick(first, rng).backend.meta.name == "primary"  # type: ignore[union-attr]
    down = lambda b: b.meta.name != "primary"  # noqa: E731
    assert pick(first, rng, down).backend.meta.name == "standby"  # type: ignore[union-attr]
    assert pick(EMPTY, rng) is None


@pytest.mark.parametrize("weights", [(), (0,), (0, 0), (1, -1, 0)])
def test_a_weighted_distribution_needs_a_positive_total(weights: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="one positive"):
        Distribution.weighted(tuple(backend(f"b{i}", w) for i, w in enumerate(weights)))


# -- the index against the scan -------------------------------------------------------------


def scan(routes: Sequence[Route], req: Request, grpc: bool) -> Selected | None:
    """The reference: every rule of every route, in order, as the Gateway API ranks them."""
    match_all: tuple[object, ...] = (0, 0, 0) if grpc else (False, 1, False, 0, 0)

    def key(m: HttpMatch | GrpcMatch) -> tuple[object, ...] | None:
        if grpc:
            return grpc_key(m, req) if isinstance(m, GrpcMatch) else None
        return http_key(m, req) if isinstance(m, HttpMatch) else None

    best: tuple[object, ...] | None = None
    found = None
    for index, r in enumerate(routes):
        host: tuple[int, int] | tuple[()] = ()
        if r.hosts:
            hosts = [hs for h in r.hosts if (hs := h.summary(req.host)) is not None]
            if not hosts:
                continue
            host = max(hosts)
        for at, rule in enumerate(r.rules):
            if not rule.matches:
                rule_key: tuple[object, ...] | None = match_all
            else:
                keys = [k for m in rule.matches if (k := key(m)) is not None]
                rule_key = max(keys) if keys else None  # type: ignore[type-var]
            if rule_key is None:
                continue
            candidate = (host, rule_key)
            if best is None or candidate > best:  # type: ignore[operator]
                best, found = candidate, Selected(index, at, rule)
    return found


SEGMENTS = ("a", "b", "ab", "")
REGEXES = ("/a/.*", "/[ab]+", "/a/b", ".*", "/b/[0-9]+", "/a/*b", "/b/a|/a", "/ab?/a")
COMPILED = {r: compile_path_regex(r) for r in REGEXES}
HOSTS = ("web.shop", "a.web.shop", "other", "")
SERVICES = ("", "shop.Cart", "shop.Cart.V2", "shop")


def paths(leading: bool = True) -> st.SearchStrategy[str]:
    body = st.lists(st.sampled_from(SEGMENTS), max_size=4).map("/".join)
    return st.tuples(st.booleans() if not leading else st.just(True), body,
                     st.sampled_from(("", "/", "//"))).map(
        lambda t: ("/" if t[0] else "") + t[1] + t[2])  # fmt: skip


values = st.sampled_from((b"1", b"2"))
http_matches = st.builds(
    HttpMatch,
    path=st.one_of(
        st.none(),
        st.builds(PathMatch, st.just(PathKind.EXACT), paths()),
        st.builds(PathMatch, st.just(PathKind.PREFIX), paths() | st.sampled_from(("", "/", "//"))),
        st.sampled_from(REGEXES).map(lambda r: PathMatch(PathKind.REGEX, r, COMPILED[r])),
    ),
    headers=st.lists(st.builds(ValueMatch, st.sampled_from(("x-a", "x-b")), values), max_size=2)
    .map(tuple),
    query=st.lists(st.builds(ValueMatch, st.sampled_from(("q", "r")), st.sampled_from(("1", "2"))),
                   max_size=2).map(tuple),
    method=st.sampled_from((None, None, "GET", "POST")),
)  # fmt: skip
grpc_matches = st.builds(
    GrpcMatch, st.sampled_from(SERVICES), st.sampled_from(("", "Add", "Get")),
    st.lists(st.builds(ValueMatch, st.sampled_from(("x-a",)), values), max_size=1).map(tuple),
)  # fmt: skip
host_matches = st.one_of(
    st.sampled_from(HOSTS).map(lambda h: HostMatch(HostKind.EXACT, h)),
    st.sampled_from(("", ".shop", ".web.shop", "shop", "b.shop")).map(
        lambda h: HostMatch(HostKind.SUFFIX, h)),
)  # fmt: skip


def tables(matches: st.SearchStrategy[HttpMatch | GrpcMatch]) -> st.SearchStrategy[list[Route]]:
    rule = st.lists(matches, max_size=3).map(tuple)
    hosts = st.just(()) | st.lists(host_matches, max_size=2).map(tuple)
    one = st.tuples(st.lists(rule, min_size=1, max_size=3), hosts)
    return st.lists(one, max_size=8).map(
        lambda rs: [route(f"r{i}", *rules, hosts=hosts) for i, (rules, hosts) in enumerate(rs)]
    )


headers = st.lists(st.tuples(st.sampled_from((b"x-a", b"X-B", b"x-c")), values), max_size=3)
Parts = tuple[str | None, str, str, list[tuple[bytes, bytes]]]  # what a request's head gives
requests = st.tuples(
    st.sampled_from(("web.shop", "a.web.shop:80", "Web.Shop", "other", "b.shop", "x.b.shop",
                     "[::1]:80", None)),
    st.sampled_from(("GET", "POST")),
    st.tuples(paths(leading=False), st.sampled_from(("", "?", "?q=1", "?q=1&r=2", "?r=1"))
              ).map("".join),
    headers,
)  # fmt: skip
grpc_requests = st.tuples(
    st.sampled_from(("web.shop", "other", "x.b.shop")), st.just("POST"),
    st.tuples(st.sampled_from((*SERVICES, "shop.Other")), st.sampled_from(("Add", "Get", ""))
              ).map(lambda t: f"/{t[0]}/{t[1]}"),
    headers,
)  # fmt: skip


def same(routes: list[Route], asks: list[Parts], grpc: bool) -> None:
    """The index, from a request's parts or from its Request, selects what the scan does."""
    table = RouteTable(tuple(routes), grpc)
    for parts in asks:
        req = request(*parts)
        expected = scan(routes, req, grpc)
        assert table.select_parts(*parts) == expected, parts
        assert table.select(req) == expected, req


@settings(max_examples=200, deadline=None)
@given(tables(http_matches | grpc_matches), st.lists(requests, min_size=1, max_size=6))
def test_the_http_index_selects_what_the_scan_selects(routes: list[Route], asks: list[Parts]
                                                      ) -> None:  # fmt: skip
    same(routes, asks, grpc=False)


@settings(max_examples=100, deadline=None)
@given(tables(grpc_matches | http_matches), st.lists(grpc_requests, min_size=1, max_size=6))
def test_the_grpc_index_selects_what_the_scan_selects(routes: list[Route], asks: list[Parts]
                                                      ) -> None:  # fmt: skip
    same(routes, asks, grpc=True)


@pytest.mark.parametrize(
    ("regex", "segment"),
    [("/users/[0-9]+", "/users"), ("/a/b", "/a"), ("/a/b*", "/a"), ("/a/*b", ""),
     ("/a/?b", ""), ("/b/a|/a", ""), ("(?i)/a/b", ""), ("/a", ""), ("/[ab]+/c", ""),
     (".*", ""), ("/a\\/b/c", ""), ("//a/b", "")],
)  # fmt: skip
def test_a_regex_is_filed_by_the_first_segment_only_when_every_match_has_it(
    regex: str, segment: str
) -> None:
    assert first_segment(regex) == segment
    if not segment:  # a path the regex matches whose first segment is not the literal one
        routes = [route("re", (regex_match := HttpMatch(PathMatch(
            PathKind.REGEX, regex, compile_path_regex(regex))),))]  # fmt: skip
        for path in ("/ab", "/a", "/A/b", "/a/b", "/c", "/x/c"):
            req = request("web", "GET", path, [])
            assert RouteTable(tuple(routes), grpc=False).select(req) == scan(routes, req, False)
            assert (select_http(routes, req) is not None) == (
                http_key(regex_match, req) is not None
            )


# -- ten thousand routes --------------------------------------------------------------------

MANY = 10_000  # the most a policy may have (discovery.outbound_decode.MAX_ROUTES)
BUILD_LIMIT = 2.0  # seconds to index them (about 0.1 s here); a clear regression fails
SELECT_LIMIT = 200e-6  # median seconds per selection (a few µs here; a scan took milliseconds)


def many_routes(n: int) -> tuple[Route, ...]:
    """A service's routes of the usual kinds: prefixes, exact paths with a method, header
    matches (a canary), and one regex in 500."""
    routes = []
    for i in range(n):
        if i % 500 == 7:
            match = regex(f"/svc{i}/items/[0-9]+")
        elif i % 10 == 3:
            match = prefix(f"/svc{i}", headers=header("x-canary", b"1"))
        elif i % 4 == 1:
            match = exact(f"/svc{i}/login", method="POST")
        else:
            match = prefix(f"/svc{i}/api")
        routes.append(route(f"r{i}", (match,)))
    return tuple(routes)


def test_ten_thousand_routes_index_in_bounded_time_and_select_in_bounded_time() -> None:
    routes = many_routes(MANY)
    started = time.perf_counter()
    table = RouteTable(routes, grpc=False)
    built = time.perf_counter() - started
    assert built <= BUILD_LIMIT, f"indexing {MANY} routes took {built:.2f} s"
    asks = [
        (request("web", "GET", "/svc5000/api/orders/17?page=2", [(b"accept", b"*/*")]), 5000),
        (request("web", "POST", "/svc9997/login", []), 9997),
        (request("web", "GET", "/svc4003/x", [(b"x-canary", b"1")]), 4003),
        (request("web", "GET", "/svc4507/items/12", []), 4507),
        (request("web", "GET", "/svc4507/items/x", []), None),
    ]
    for req, expected in asks:
        found = table.select(req)
        assert (found and found.route) == expected
        spent = []
        for _ in range(300):
            started = time.perf_counter()
            table.select(req)
            spent.append(time.perf_counter() - started)
        median = statistics.median(spent)
        assert median <= SELECT_LIMIT, f"{req.path_only}: {median * 1e6:.0f} µs per selection"


def test_a_path_too_long_for_a_regex_takes_no_route_rather_than_a_less_specific_one() -> None:
    """`/admin/...` goes to a route of its own (one that refuses, say); `/` to the service.
    Were an unaffordable regex skipped, a long `/admin/...` path would take `/`: the request
    is refused instead (RegexBudgetExceeded: the proxy answers 414), for every host tier and
    list the index reads it from, since one meter pays the whole request."""
    from meshlet.api.pathregex import RegexBudgetExceeded

    hosts = (HostMatch(HostKind.EXACT, "web.shop"),)
    for admin in ("/admin/.*", ".*/admin/.*"):
        routes = [route("admin", (regex(admin),)), route("all", (prefix("/"),)),
                  route("host", (regex(admin),), hosts=hosts)]  # fmt: skip
        assert chosen(routes, "GET", "/admin/x") == "host/0"
        assert chosen(routes, "GET", "/admin/x", host="other") == "admin/0"
        for host in ("web.shop", "other"):
            with pytest.raises(RegexBudgetExceeded):
                chosen(routes, "GET", "/admin/" + "x" * 20_000, host=host)
    # a path outside the regex's possible matches costs nothing to rule out
    routes = [route("admin", (regex("/admin/.*"),)), route("all", (prefix("/"),))]
    assert chosen(routes, "GET", "/public/" + "x" * 20_000) == "all/0"
