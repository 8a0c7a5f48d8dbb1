"""Route matching and per-route classification, as Linkerd's ServiceProfiles define them."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.pathregex import Budget, Meter
from meshlet.proxy.core.routes import (
    DEFAULT_ROUTE,
    BadRoute,
    RoutePolicy,
    classify_response,
    compiled,
    matches,
    policy,
    route_for,
)
from meshlet.proxy.discovery.profile import (
    AllOf,
    AnyOf,
    Method,
    Not,
    PathRegex,
    ResponseClass,
    Route,
    StatusRange,
)


def route(name: str, condition: object, *, retryable: bool = False, timeout: float | None = None,
          classes: tuple[ResponseClass, ...] = ()) -> Route:  # fmt: skip
    return Route(condition, classes, (("route", name),), retryable, timeout)  # type: ignore[arg-type]


ROUTES = (
    route("GET /books/{id}", AllOf((Method("GET"), PathRegex(r"/books/[0-9]+"))), retryable=True),
    route("POST /books", AllOf((Method("POST"), PathRegex(r"/books"))), timeout=0.2),
    route("not admin", Not(PathRegex(r"/admin(/.*)?"))),
)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/books/42", "GET /books/{id}"),
        ("GET", "/books/42?fields=title", "GET /books/{id}"),  # the query is not the path
        ("GET", "/books/42/extra", "not admin"),  # anchored: the whole path must match
        ("POST", "/books", "POST /books"),
        ("PUT", "/books", "not admin"),
        ("GET", "/admin/users", None),  # the default route
        ("get", "/books/42", "not admin"),  # methods are case-sensitive
    ],
)
def test_the_first_matching_route_wins(method: str, path: str, expected: str | None) -> None:
    found = route_for(ROUTES, method, path)
    assert (dict(found.labels)["route"] if found else None) == expected


def test_any_all_not_compose() -> None:
    cond = AnyOf((Method("DELETE"), AllOf((Method("GET"), Not(PathRegex("/health"))))))
    assert matches(cond, "DELETE", "/x", Meter())
    assert matches(cond, "GET", "/x", Meter())
    assert not matches(cond, "GET", "/health", Meter())
    assert not matches(cond, "POST", "/x", Meter())


def test_a_policy_carries_what_the_route_asks() -> None:
    assert policy(ROUTES[1]) == RoutePolicy("POST /books", 0.2, False, ())
    assert RoutePolicy("", None, False, ()) == DEFAULT_ROUTE


def test_regexes_rre2_refuses_are_bad_routes() -> None:
    with pytest.raises(BadRoute, match="invalid perl operator"):
        compiled(AllOf((Method("GET"), PathRegex("/api/(?!internal).*"))), Budget())
    assert not matches(PathRegex("(?<=x)y"), "GET", "xy", Meter())  # a bad one never matches


def test_a_client_path_cannot_make_a_pattern_backtrack() -> None:
    """`(a+)+$` takes seconds on a 30-character path with a backtracking engine; RE2 is
    linear in the path, so even a 64 KiB path costs microseconds (given the budget to pay
    for it: a request has less, see the next test)."""
    evil = PathRegex("/(a+)+$")
    started = time.perf_counter()
    assert not matches(evil, "GET", "/" + "a" * 65536 + "!", Meter(10**12))
    assert time.perf_counter() - started < 0.5


def test_a_path_too_long_for_the_profile_s_regexes_takes_the_default_route() -> None:
    """A profile grants no access: a request its regexes cannot afford is served as one no
    route matches (the default route), never refused and never given a later route."""
    everything = route("everything", PathRegex("/.*"))
    assert route_for((everything,), "GET", "/" + "a" * 4000) is everything
    assert route_for((everything,), "GET", "/" + "a" * 20_000) is None
    negated = route("not admin", Not(PathRegex("/.*admin")))
    assert route_for((negated,), "GET", "/" + "b" * 20_000) is None
    # a path outside what the regex can match costs nothing to match: /admin.* cannot match /b…
    assert route_for((route("not /admin", Not(PathRegex("/admin.*"))),), "GET",
                     "/" + "b" * 20_000) is not None  # fmt: skip


@pytest.mark.parametrize(
    ("classes", "status", "grpc", "expected"),
    [
        ((), 500, None, "failure"),
        ((), 404, None, "success"),
        ((), 200, "14", "failure"),  # gRPC UNAVAILABLE
        ((ResponseClass(StatusRange(500, 599), False),), 503, None, "success"),
        ((ResponseClass(StatusRange(404, 404), True),), 404, None, "failure"),
        ((ResponseClass(AnyOf((StatusRange(429, 429), StatusRange(500, 599))), True),), 429,
         None, "failure"),
        ((ResponseClass(Not(StatusRange(200, 299)), True),), 302, None, "failure"),
        ((ResponseClass(StatusRange(404, 404), True),), 500, None, "failure"),  # no class: default
    ],
)  # fmt: skip
def test_the_first_matching_class_decides_else_the_default(
    classes: tuple[ResponseClass, ...], status: int, grpc: str | None, expected: str
) -> None:
    assert classify_response(RoutePolicy(classes=classes), status, grpc) == expected


@given(st.text(max_size=200), st.sampled_from(["GET", "POST", "PUT"]))
def test_matching_any_path_never_fails(path: str, method: str) -> None:
    found = route_for(ROUTES, method, path)
    assert found is None or found in ROUTES
