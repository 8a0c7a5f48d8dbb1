"""Outbound route selection (the Gateway API's precedence, one table row per rule of it) and
the weighted pick of a backend."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshlet.api.pathregex import compile_path_regex
from meshlet.proxy.core.authz import (
    GrpcMatch,
    HostKind,
    HostMatch,
    HttpMatch,
    PathKind,
    PathMatch,
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
from meshlet.proxy.core.route_select import pick, select_grpc, select_http


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
