"""ServiceProfile specs become DestinationProfile messages, or a ProfileError naming problems."""

from __future__ import annotations

import struct
from fractions import Fraction
from typing import Any

import pytest
from google.protobuf import duration_pb2
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api import destination_pb2 as pb
from meshlet.api import http_types_pb2
from meshlet.controlplane.destination.profiles import (
    ProfileError,
    default_profile,
    parse_duration,
    parse_duration_ns,
    parse_quantity,
    problems,
    profile_from_spec,
    profile_or_default,
)

FQN = "web.emojivoto.svc.cluster.local"
Method = http_types_pb2.HttpMethod


# --- building expected messages by hand ----------------------------------------------------------


def method(name: str) -> pb.RequestMatch:
    registered = getattr(Method, name, None)
    if registered is not None:
        return pb.RequestMatch(method=Method(registered=registered))
    return pb.RequestMatch(method=Method(unregistered=name))


def path(regex: str) -> pb.RequestMatch:
    return pb.RequestMatch(path=pb.PathMatch(regex=regex))


def req_all(*matches: pb.RequestMatch) -> pb.RequestMatch:
    return pb.RequestMatch(all=pb.RequestMatch.Seq(matches=matches))


def req_any(*matches: pb.RequestMatch) -> pb.RequestMatch:
    return pb.RequestMatch(any=pb.RequestMatch.Seq(matches=matches))


def req_not(inner: pb.RequestMatch) -> pb.RequestMatch:
    match = pb.RequestMatch()
    getattr(match, "not").CopyFrom(inner)  # `not` is a Python keyword
    return match


def status(low: int, high: int) -> pb.ResponseMatch:
    return pb.ResponseMatch(status=pb.HttpStatusRange(min=low, max=high))


def rsp_all(*matches: pb.ResponseMatch) -> pb.ResponseMatch:
    return pb.ResponseMatch(all=pb.ResponseMatch.Seq(matches=matches))


def rsp_any(*matches: pb.ResponseMatch) -> pb.ResponseMatch:
    return pb.ResponseMatch(any=pb.ResponseMatch.Seq(matches=matches))


def rsp_not(inner: pb.ResponseMatch) -> pb.ResponseMatch:
    match = pb.ResponseMatch()
    getattr(match, "not").CopyFrom(inner)
    return match


def seconds(value: int, nanos: int = 0) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=value, nanos=nanos)


def route_spec(**fields: Any) -> dict[str, Any]:
    return {"name": "r", "condition": {"method": "GET"}, **fields}


def one_route(spec_route: dict[str, Any]) -> pb.Route:
    profile = profile_from_spec({"routes": [spec_route]}, fqn=FQN)
    assert len(profile.routes) == 1
    return profile.routes[0]


EXAMPLE: dict[str, Any] = {
    "routes": [
        {
            "name": "GET /api/list",
            "condition": {"method": "GET", "pathRegex": "/api/list"},
            "responseClasses": [
                {"condition": {"status": {"min": 500, "max": 599}}, "isFailure": True}
            ],
            "isRetryable": True,
            "timeout": "300ms",
        },
        {
            "name": "vote",
            "condition": {
                "any": [
                    {"all": [{"method": "POST"}, {"pathRegex": "/api/vote/[^/]+"}]},
                    {"not": {"method": "PURGE"}},
                ]
            },
            "responseClasses": [
                {"condition": {"not": {"status": {"min": 200, "max": 399}}}, "isFailure": True},
                {"condition": {"any": [{"status": {"min": 429}}, {"status": {"max": 503}}]}},
            ],
            "timeout": "1m30s",
        },
    ],
    "retryBudget": {"retryRatio": 0.5, "minRetriesPerSecond": 3, "ttl": "1.5s"},
    "dstOverrides": [
        {"authority": "web-v2.emojivoto.svc.cluster.local:80", "weight": "500m"},
        {"authority": "web-v1.emojivoto.svc.cluster.local:80", "weight": 1},
    ],
}

EXPECTED = pb.DestinationProfile(
    fully_qualified_name=FQN,
    routes=[
        pb.Route(
            condition=req_all(method("GET"), path("/api/list")),
            response_classes=[pb.ResponseClass(condition=status(500, 599), is_failure=True)],
            metrics_labels={"route": "GET /api/list"},
            is_retryable=True,
            timeout=seconds(0, 300_000_000),
        ),
        pb.Route(
            condition=req_any(
                req_all(method("POST"), path("/api/vote/[^/]+")),
                req_not(method("PURGE")),
            ),
            response_classes=[
                pb.ResponseClass(condition=rsp_not(status(200, 399)), is_failure=True),
                pb.ResponseClass(condition=rsp_any(status(429, 429), status(503, 503))),
            ],
            metrics_labels={"route": "vote"},
            timeout=seconds(90),
        ),
    ],
    retry_budget=pb.RetryBudget(
        retry_ratio=0.5, min_retries_per_second=3, ttl=seconds(1, 500_000_000)
    ),
    dst_overrides=[
        pb.WeightedDst(authority="web-v2.emojivoto.svc.cluster.local:80", weight=5000),
        pb.WeightedDst(authority="web-v1.emojivoto.svc.cluster.local:80", weight=10000),
    ],
)


# --- whole profiles ------------------------------------------------------------------------------


def test_the_example_spec_becomes_the_hand_built_profile() -> None:
    assert profile_from_spec(EXAMPLE, fqn=FQN) == EXPECTED


def test_the_example_profile_survives_the_wire() -> None:
    wire = profile_from_spec(EXAMPLE, fqn=FQN).SerializeToString(deterministic=True)
    parsed = pb.DestinationProfile()
    parsed.ParseFromString(wire)
    assert parsed == EXPECTED
    assert parsed.routes[0].condition.all.matches[0].method.WhichOneof("type") == "registered"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: bytes | int, *, fixed32: bool = False) -> bytes:
    """One protobuf field, written from Linkerd's field numbers (not from our descriptors)."""
    if fixed32:
        assert isinstance(value, bytes)
        return _varint(number << 3 | 5) + value
    if isinstance(value, int):
        return _varint(number << 3 | 0) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def test_wire_bytes_match_linkerds_field_numbers() -> None:
    spec = {
        "routes": [
            {"name": "r", "condition": {"method": "GET"}, "isRetryable": True, "timeout": "1.5s"}
        ],
        "retryBudget": {"retryRatio": 0.25},
        "dstOverrides": [{"authority": "a:80", "weight": "500m"}],
    }
    profile = profile_from_spec(spec, fqn="a.ns.svc.cluster.local", opaque=True)

    get = _field(5, _field(1, 0))  # RequestMatch.method = HttpMethod{registered: GET (0)}
    route = (
        _field(1, get)
        + _field(3, _field(1, b"route") + _field(2, b"r"))  # metrics_labels entry
        + _field(4, 1)
        + _field(5, _field(1, 1) + _field(2, 500_000_000))
    )
    budget = (
        _field(1, struct.pack("<f", 0.25), fixed32=True) + _field(2, 10) + _field(3, _field(1, 10))
    )
    expected = (
        _field(1, route)
        + _field(2, budget)
        + _field(3, _field(1, b"a:80") + _field(2, 5000))
        + _field(4, 1)
        + _field(5, b"a.ns.svc.cluster.local")
    )
    assert profile.SerializeToString(deterministic=True) == expected


def test_the_default_profile_has_linkerds_retry_budget() -> None:
    assert default_profile(FQN) == pb.DestinationProfile(
        fully_qualified_name=FQN,
        retry_budget=pb.RetryBudget(retry_ratio=0.2, min_retries_per_second=10, ttl=seconds(10)),
    )
    assert default_profile().fully_qualified_name == ""
    assert default_profile(FQN, opaque=True).opaque_protocol


@pytest.mark.parametrize("spec", [{}, {"routes": None, "retryBudget": None, "dstOverrides": None}])
def test_an_empty_spec_is_the_default_profile(spec: dict[str, Any]) -> None:
    assert profile_from_spec(spec, fqn=FQN) == default_profile(FQN)


@pytest.mark.parametrize("opaque", [True, False])
def test_opaque_and_name_are_carried(opaque: bool) -> None:
    profile = profile_from_spec(EXAMPLE, fqn="x.y.svc.cluster.local", opaque=opaque)
    assert profile.opaque_protocol is opaque
    assert profile.fully_qualified_name == "x.y.svc.cluster.local"


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ({}, pb.RetryBudget(retry_ratio=0.2, min_retries_per_second=10, ttl=seconds(10))),
        (
            {"retryRatio": 1},
            pb.RetryBudget(retry_ratio=1.0, min_retries_per_second=10, ttl=seconds(10)),
        ),
        ({"minRetriesPerSecond": 0}, pb.RetryBudget(retry_ratio=0.2, ttl=seconds(10))),
        (
            {"ttl": "1m"},
            pb.RetryBudget(retry_ratio=0.2, min_retries_per_second=10, ttl=seconds(60)),
        ),
        (
            {"retryRatio": 0, "minRetriesPerSecond": 4294967295, "ttl": "1s"},
            pb.RetryBudget(retry_ratio=0.0, min_retries_per_second=4294967295, ttl=seconds(1)),
        ),
    ],
)
def test_missing_budget_fields_take_the_defaults(
    budget: dict[str, Any], expected: pb.RetryBudget
) -> None:
    assert profile_from_spec({"retryBudget": budget}, fqn=FQN).retry_budget == expected


# --- conditions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        *[
            ({"method": name}, pb.RequestMatch(method=Method(registered=getattr(Method, name))))
            for name in (
                "GET",
                "POST",
                "PUT",
                "DELETE",
                "PATCH",
                "OPTIONS",
                "CONNECT",
                "HEAD",
                "TRACE",
            )
        ],
        ({"method": "PURGE"}, pb.RequestMatch(method=Method(unregistered="PURGE"))),
        ({"method": "get"}, pb.RequestMatch(method=Method(unregistered="get"))),
        ({"pathRegex": "/books/\\d+"}, path("/books/\\d+")),
        # several fields at once: all of them, in Linkerd's order whatever the order in the spec
        ({"pathRegex": "/x", "method": "PUT"}, req_all(method("PUT"), path("/x"))),
        (
            {"pathRegex": "/x", "not": {"method": "GET"}, "any": [{"method": "HEAD"}]},
            req_all(req_any(method("HEAD")), req_not(method("GET")), path("/x")),
        ),
        ({"all": [{"method": "GET"}, {"pathRegex": "/a"}]}, req_all(method("GET"), path("/a"))),
        ({"any": [{"method": "GET"}, {"method": "HEAD"}]}, req_any(method("GET"), method("HEAD"))),
        ({"not": {"pathRegex": "/health"}}, req_not(path("/health"))),
        ({"not": {"not": {"method": "GET"}}}, req_not(req_not(method("GET")))),
        (
            {"any": [{"all": [{"not": {"any": [{"pathRegex": "/a"}, {"pathRegex": "/b"}]}}]}]},
            req_any(req_all(req_not(req_any(path("/a"), path("/b"))))),
        ),
        ({"all": []}, pb.RequestMatch(all=pb.RequestMatch.Seq())),
        ({"any": []}, pb.RequestMatch(any=pb.RequestMatch.Seq())),
        ({"method": "GET", "pathRegex": None}, method("GET")),
    ],
)
def test_request_conditions(condition: dict[str, Any], expected: pb.RequestMatch) -> None:
    route = one_route(route_spec(condition=condition))
    assert route.condition == expected
    assert route.condition.WhichOneof("match") == expected.WhichOneof("match")


@pytest.mark.parametrize(
    ("condition", "expected"),
    [
        ({"status": {"min": 500, "max": 599}}, status(500, 599)),
        ({"status": {"min": 404}}, status(404, 404)),
        ({"status": {"max": 503}}, status(503, 503)),
        ({"status": {"min": 100, "max": 100}}, status(100, 100)),
        ({"not": {"status": {"min": 200, "max": 299}}}, rsp_not(status(200, 299))),
        (
            {"all": [{"status": {"min": 500}}, {"not": {"any": [{"status": {"max": 599}}]}}]},
            rsp_all(status(500, 500), rsp_not(rsp_any(status(599, 599)))),
        ),
        ({"any": []}, pb.ResponseMatch(any=pb.ResponseMatch.Seq())),
    ],
)
def test_response_conditions(condition: dict[str, Any], expected: pb.ResponseMatch) -> None:
    route = one_route(route_spec(responseClasses=[{"condition": condition}]))
    assert list(route.response_classes) == [pb.ResponseClass(condition=expected)]


def test_response_classes_keep_their_order_and_failure_flag() -> None:
    classes = [
        {"condition": {"status": {"min": 500}}, "isFailure": True},
        {"condition": {"status": {"min": 200}}, "isFailure": False},
        {"condition": {"status": {"min": 404}}},
    ]
    route = one_route(route_spec(responseClasses=classes))
    assert [(c.condition.status.min, c.is_failure) for c in route.response_classes] == [
        (500, True),
        (200, False),
        (404, False),
    ]


@pytest.mark.parametrize(
    ("fields", "retryable", "timeout"),
    [
        ({}, False, None),
        ({"isRetryable": True, "timeout": "300ms"}, True, seconds(0, 300_000_000)),
        ({"isRetryable": False, "timeout": "1s"}, False, seconds(1)),
        ({"timeout": "1m30s"}, False, seconds(90)),
        ({"timeout": "1.5s"}, False, seconds(1, 500_000_000)),
        ({"timeout": "1h2m3.5s"}, False, seconds(3723, 500_000_000)),
        ({"timeout": "0s"}, False, None),  # zero is no timeout: the field stays unset
        ({"timeout": None, "isRetryable": None}, False, None),
    ],
)
def test_route_retries_and_timeouts(
    fields: dict[str, Any], retryable: bool, timeout: duration_pb2.Duration | None
) -> None:
    route = one_route(route_spec(**fields))
    assert route.is_retryable is retryable
    assert route.metrics_labels == {"route": "r"}
    if timeout is None:
        assert not route.HasField("timeout")
    else:
        assert route.timeout == timeout


def test_routes_keep_their_order() -> None:
    spec = {"routes": [route_spec(name=name) for name in ("b", "a", "c")]}
    labels = [r.metrics_labels["route"] for r in profile_from_spec(spec, fqn=FQN).routes]
    assert labels == ["b", "a", "c"]


# --- dst overrides -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (1, 10000),
        ("1", 10000),
        ("1000m", 10000),
        ("500m", 5000),
        (0.5, 5000),
        ("0.5", 5000),
        ("+.25", 2500),
        ("2.", 20000),
        (0, 0),
        ("0m", 0),
        ("1m", 10),
        ("0.00001", 1),  # rounded up, as Kubernetes rounds MilliValue()
        ("429496.7295", 4294967295),
    ],
)
def test_weights_scale_so_that_one_is_10000(weight: object, expected: int) -> None:
    spec = {"dstOverrides": [{"authority": "web.ns.svc.cluster.local:80", "weight": weight}]}
    assert list(profile_from_spec(spec, fqn=FQN).dst_overrides) == [
        pb.WeightedDst(authority="web.ns.svc.cluster.local:80", weight=expected)
    ]


@pytest.mark.parametrize(
    ("authority", "port", "expected"),
    [
        ("web-v2.ns.svc.cluster.local", 8080, "web-v2.ns.svc.cluster.local:8080"),
        ("web-v2.ns.svc.cluster.local:80", 8080, "web-v2.ns.svc.cluster.local:80"),
        ("web-v2.ns.svc.cluster.local", None, "web-v2.ns.svc.cluster.local"),
        ("[fd00::1]:80", 8080, "[fd00::1]:80"),
        ("fd00::1", 8080, "[fd00::1]:8080"),
        ("10.1.2.3", 8080, "10.1.2.3:8080"),
    ],
)
def test_an_authority_without_port_gets_the_lookups_port(
    authority: str, port: int | None, expected: str
) -> None:
    spec = {"dstOverrides": [{"authority": authority, "weight": 1}]}
    profile = profile_from_spec(spec, fqn=FQN, port=port)
    assert [d.authority for d in profile.dst_overrides] == [expected]


# --- validation ----------------------------------------------------------------------------------

R0 = "spec.routes[0]"
COND_KEYS = "all, any, method, not, pathRegex"


@pytest.mark.parametrize(
    ("spec", "problems"),
    [
        # shapes
        ([], ["spec: expected a mapping, got a list"]),
        (None, ["spec: expected a mapping, got null"]),
        (
            {"route": []},
            ["spec.route: unknown field (expected one of routes, retryBudget, dstOverrides)"],
        ),
        ({"routes": {"name": "r"}}, ["spec.routes: expected a list, got a mapping"]),
        ({"routes": ["GET /"]}, [f"{R0}: expected a mapping, got a string"]),
        (
            {"routes": [route_spec(condition=["GET"])]},
            [f"{R0}.condition: expected a mapping, got a list"],
        ),
        ({"retryBudget": "10%"}, ["spec.retryBudget: expected a mapping, got a string"]),
        (
            {"dstOverrides": {"authority": "a"}},
            ["spec.dstOverrides: expected a list, got a mapping"],
        ),
        ({"dstOverrides": [3]}, ["spec.dstOverrides[0]: expected a mapping, got a number"]),
        (
            {"routes": [route_spec(isRetriable=True)]},
            [
                f"{R0}.isRetriable: unknown field (expected one of name, condition, "
                "responseClasses, isRetryable, timeout)"
            ],
        ),
        # routes
        ({"routes": [{"name": "r"}]}, [f"{R0}.condition: missing (set one of {COND_KEYS})"]),
        (
            {"routes": [route_spec(condition=None)]},
            [f"{R0}.condition: missing (set one of {COND_KEYS})"],
        ),
        (
            {"routes": [{"condition": {"method": "GET"}}]},
            [f"{R0}.name: missing (every route needs a name, its metrics label)"],
        ),
        ({"routes": [route_spec(name="")]}, [f"{R0}.name: expected a non-empty string, got ''"]),
        ({"routes": [route_spec(name=7)]}, [f"{R0}.name: expected a non-empty string, got 7"]),
        (
            {"routes": [route_spec(isRetryable="yes")]},
            [f"{R0}.isRetryable: expected true or false, got 'yes'"],
        ),
        (
            {"routes": [route_spec(responseClasses={})]},
            [f"{R0}.responseClasses: expected a list, got a mapping"],
        ),
        # durations
        (
            {"routes": [route_spec(timeout="300")]},
            [f"{R0}.timeout: invalid duration '300': missing unit (ns, us, ms, s, m, h)"],
        ),
        (
            {"routes": [route_spec(timeout="3 s")]},
            [f"{R0}.timeout: invalid duration '3 s': unknown unit ' s' (use ns, us, ms, s, m, h)"],
        ),
        (
            {"routes": [route_spec(timeout="-1s")]},
            [f"{R0}.timeout: must not be negative, got '-1s'"],
        ),
        (
            {"routes": [route_spec(timeout=300)]},
            [f"{R0}.timeout: expected a duration string like '300ms', got a number"],
        ),
        # request conditions
        (
            {"routes": [route_spec(condition={"path": "/x"})]},
            [f"{R0}.condition.path: unknown field (expected one of {COND_KEYS})"],
        ),
        (
            {"routes": [route_spec(condition={})]},
            [f"{R0}.condition: empty condition (set one of {COND_KEYS})"],
        ),
        (
            {"routes": [route_spec(condition={"all": [{"method": "GET"}, {"not": {}}]})]},
            [f"{R0}.condition.all[1].not: empty condition (set one of {COND_KEYS})"],
        ),
        (
            {"routes": [route_spec(condition={"any": {"method": "GET"}})]},
            [f"{R0}.condition.any: expected a list, got a mapping"],
        ),
        (
            {"routes": [route_spec(condition={"method": "GE T"})]},
            [f"{R0}.condition.method: expected an HTTP method like GET, got 'GE T'"],
        ),
        (
            {"routes": [route_spec(condition={"method": ""})]},
            [f"{R0}.condition.method: expected an HTTP method like GET, got ''"],
        ),
        (
            {"routes": [route_spec(condition={"pathRegex": 5})]},
            [f"{R0}.condition.pathRegex: expected a regular expression string, got 5"],
        ),
        (
            {"routes": [route_spec(condition={"pathRegex": "/api/(list"})]},
            [
                f"{R0}.condition.pathRegex: invalid regex '/api/(list' (RE2 syntax): "
                "missing ): /api/(list"
            ],
        ),
        (  # look-around: Python's re takes it, RE2 and linkerd2-proxy's engine do not
            {"routes": [route_spec(condition={"pathRegex": "/api/(?!internal).*"})]},
            [
                f"{R0}.condition.pathRegex: invalid regex '/api/(?!internal).*' (RE2 syntax): "
                "invalid perl operator: (?!"
            ],
        ),
        (
            {
                "routes": [
                    route_spec(condition={"all": [{"method": "GET"}, {"not": {"pathRegex": "*x"}}]})
                ]
            },
            [
                f"{R0}.condition.all[1].not.pathRegex: invalid regex '*x' (RE2 syntax): "
                "no argument for repetition operator: *"
            ],
        ),
        # response conditions
        (
            {"routes": [route_spec(responseClasses=[{"isFailure": True}])]},
            [f"{R0}.responseClasses[0].condition: missing (set one of all, any, not, status)"],
        ),
        (
            {
                "routes": [
                    route_spec(
                        responseClasses=[{"condition": {"status": {"min": 599, "max": 500}}}]
                    )
                ]
            },
            [f"{R0}.responseClasses[0].condition.status: min 599 is greater than max 500"],
        ),
        (
            {"routes": [route_spec(responseClasses=[{"condition": {"status": {"min": 99}}}])]},
            [
                f"{R0}.responseClasses[0].condition.status.min: "
                "expected a status code from 100 to 599, got 99"
            ],
        ),
        (
            {
                "routes": [
                    route_spec(
                        responseClasses=[{"condition": {"status": {"min": 500, "max": 600}}}]
                    )
                ]
            },
            [
                f"{R0}.responseClasses[0].condition.status.max: "
                "expected a status code from 100 to 599, got 600"
            ],
        ),
        (
            {"routes": [route_spec(responseClasses=[{"condition": {"status": {"min": "500"}}}])]},
            [
                f"{R0}.responseClasses[0].condition.status.min: "
                "expected a status code from 100 to 599, got '500'"
            ],
        ),
        (
            {"routes": [route_spec(responseClasses=[{"condition": {"status": {}}}])]},
            [f"{R0}.responseClasses[0].condition.status: set min, max or both"],
        ),
        (
            {"routes": [route_spec(responseClasses=[{"condition": {"method": "GET"}}])]},
            [
                f"{R0}.responseClasses[0].condition.method: "
                "unknown field (expected one of all, any, not, status)"
            ],
        ),
        (
            {
                "routes": [
                    route_spec(
                        responseClasses=[{"condition": {"status": {"min": 500}}, "isFailure": 1}]
                    )
                ]
            },
            [f"{R0}.responseClasses[0].isFailure: expected true or false, got 1"],
        ),
        # retry budget
        (
            {"retryBudget": {"retryRatio": -0.1}},
            ["spec.retryBudget.retryRatio: expected a number from 0 to 1000, got -0.1"],
        ),
        (
            {"retryBudget": {"retryRatio": 1001}},
            ["spec.retryBudget.retryRatio: expected a number from 0 to 1000, got 1001"],
        ),
        (
            {"retryBudget": {"retryRatio": "0.2"}},
            ["spec.retryBudget.retryRatio: expected a number from 0 to 1000, got '0.2'"],
        ),
        (
            {"retryBudget": {"retryRatio": float("nan")}},
            ["spec.retryBudget.retryRatio: expected a number from 0 to 1000, got nan"],
        ),
        (
            {"retryBudget": {"minRetriesPerSecond": -1}},
            [
                "spec.retryBudget.minRetriesPerSecond: "
                "expected an integer from 0 to 4294967295, got -1"
            ],
        ),
        (
            {"retryBudget": {"minRetriesPerSecond": 2.5}},
            [
                "spec.retryBudget.minRetriesPerSecond: "
                "expected an integer from 0 to 4294967295, got 2.5"
            ],
        ),
        (
            {"retryBudget": {"ttl": "500ms"}},
            ["spec.retryBudget.ttl: must be from 1s to 60s, got '500ms'"],
        ),
        (
            {"retryBudget": {"ttl": "61s"}},
            ["spec.retryBudget.ttl: must be from 1s to 60s, got '61s'"],
        ),
        (
            {"retryBudget": {"ttl": "ten seconds"}},
            [
                "spec.retryBudget.ttl: invalid duration 'ten seconds': "
                "expected a number at 'ten seconds'"
            ],
        ),
        # dst overrides
        (
            {"dstOverrides": [{"authority": "a:80", "weight": -1}]},
            ["spec.dstOverrides[0].weight: must not be negative, got -1"],
        ),
        (
            {"dstOverrides": [{"authority": "a:80", "weight": "-500m"}]},
            ["spec.dstOverrides[0].weight: must not be negative, got '-500m'"],
        ),
        (
            {"dstOverrides": [{"authority": "a:80", "weight": "1k"}]},
            [
                "spec.dstOverrides[0].weight: invalid quantity '1k': expected a decimal number "
                "with an optional 'm' (milli) suffix, like 1, 0.5 or 500m"
            ],
        ),
        (
            {"dstOverrides": [{"authority": "a:80", "weight": True}]},
            ["spec.dstOverrides[0].weight: expected a quantity like 1 or '500m', got a boolean"],
        ),
        (
            {"dstOverrides": [{"authority": "a:80", "weight": "429496.7296"}]},
            ["spec.dstOverrides[0].weight: too large, got '429496.7296' (at most 429496.7295)"],
        ),
        (
            {"dstOverrides": [{"authority": "a:80"}]},
            ["spec.dstOverrides[0].weight: missing (give a relative weight such as 1 or '500m')"],
        ),
        (
            {"dstOverrides": [{"weight": 1}]},
            ["spec.dstOverrides[0].authority: missing (name the service to send traffic to)"],
        ),
        (
            {"dstOverrides": [{"authority": "a b:80", "weight": 1}]},
            [
                "spec.dstOverrides[0].authority: expected a host[:port] without spaces, "
                "at most 259 characters, got 'a b:80'"
            ],
        ),
    ],
)
def test_each_problem_is_reported_with_its_path(spec: object, problems: list[str]) -> None:
    with pytest.raises(ProfileError) as caught:
        profile_from_spec(spec, fqn=FQN)
    assert len(caught.value.problems) == len(problems), caught.value.problems
    for got, want in zip(caught.value.problems, problems, strict=True):
        assert got.startswith(want), (got, want)
    if len(problems) == 1:
        assert (
            str(caught.value)
            == f"invalid ServiceProfile for {FQN} (1 problem): {caught.value.problems[0]}"
        )


def test_every_problem_is_reported_at_once() -> None:
    spec = {
        "routes": [
            route_spec(),
            {"name": "b", "condition": {"pathRegex": "("}, "timeout": "1x"},
            {"name": "c"},
        ],
        "retryBudget": {"ttl": "0s"},
        "dstOverrides": [{"authority": "a:80", "weight": "-1"}],
        "opaquePorts": ["3306"],
    }
    with pytest.raises(ProfileError) as caught:
        profile_from_spec(spec, fqn=FQN)
    assert [p.split(":")[0] for p in caught.value.problems] == [
        "spec.opaquePorts",
        "spec.routes[1].condition.pathRegex",
        "spec.routes[1].timeout",
        "spec.routes[2].condition",
        "spec.retryBudget.ttl",
        "spec.dstOverrides[0].weight",
    ]
    message = str(caught.value)
    assert message.startswith(f"invalid ServiceProfile for {FQN} (6 problems): spec.opaquePorts: ")
    assert all(problem in message for problem in caught.value.problems)


def test_conditions_nested_too_deep_are_refused() -> None:
    condition: dict[str, Any] = {"method": "GET"}
    for _ in range(17):
        condition = {"not": condition}
    with pytest.raises(ProfileError) as caught:
        profile_from_spec({"routes": [route_spec(condition=condition)]}, fqn=FQN)
    assert caught.value.problems == (
        f"{R0}.condition" + ".not" * 17 + ": conditions nested deeper than 16 levels",
    )
    one_route(route_spec(condition=condition["not"]))  # 16 levels are fine


def test_profile_or_default_falls_back_with_the_error() -> None:
    assert profile_or_default(EXAMPLE, fqn=FQN) == (EXPECTED, None)
    bad = {"routes": [{"name": "r", "condition": {"pathRegex": "("}}]}
    profile, error = profile_or_default(bad, fqn=FQN, opaque=True)
    assert profile == default_profile(FQN, opaque=True)
    assert error is not None
    assert error.startswith(
        f"invalid ServiceProfile for {FQN} (1 problem): {R0}.condition.pathRegex"
    )


def test_control_characters_in_values_are_escaped_in_messages() -> None:
    with pytest.raises(ProfileError) as caught:
        profile_from_spec({"routes": [route_spec(condition={"method": "GET\r\nX: y"})]}, fqn=FQN)
    assert "\r" not in str(caught.value)
    assert "\n" not in str(caught.value)
    assert "'GET\\r\\nX: y'" in str(caught.value)


# --- Go durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("0", 0),
        ("-0", 0),
        ("0s", 0),
        ("1ns", 1),
        ("1us", 1_000),
        ("1\u00b5s", 1_000),  # micro sign
        ("1\u03bcs", 1_000),  # Greek mu
        ("300ms", 300_000_000),
        ("1s", 1_000_000_000),
        ("1.5s", 1_500_000_000),
        (".5s", 500_000_000),
        ("5.s", 5_000_000_000),
        ("1m30s", 90_000_000_000),
        ("1h2m3.5s", 3_723_500_000_000),
        ("1s1s", 2_000_000_000),  # Go adds repeated units
        ("+2m", 120_000_000_000),
        ("-1.5s", -1_500_000_000),
        ("1.0000000019s", 1_000_000_001),  # truncated to the nanosecond
        ("2562047h47m16.854775807s", 2**63 - 1),
    ],
)
def test_go_durations(text: str, ns: int) -> None:
    assert parse_duration_ns(text) == ns
    assert parse_duration(text) == ns / 1_000_000_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a number and a unit"),
        ("-", "expected a number and a unit"),
        ("1", "missing unit"),
        ("00", "missing unit"),
        ("s", "expected a number at 's'"),
        (".s", "expected a number at '.s'"),
        ("1x", "unknown unit 'x'"),
        ("1S", "unknown unit 'S'"),
        (" 1s", "expected a number at ' 1s'"),
        ("1.2.3s", "missing unit"),
        ("1d", "unknown unit 'd'"),
        ("2562047h47m16.854775808s", "longer than Go's maximum"),
        ("1" * 65 + "s", "longer than 64 characters"),
    ],
)
def test_bad_go_durations(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_duration_ns(text)


def go_string(ns: int) -> str:
    """Go's `time.Duration.String()` for a non-negative duration."""

    def decimal(value: int, digits: int) -> str:
        whole, frac = divmod(value, 10**digits)
        tail = f"{frac:0{digits}d}".rstrip("0")
        return f"{whole}.{tail}" if tail else str(whole)

    if ns == 0:
        return "0s"
    if ns < 1_000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return decimal(ns, 3) + "\u00b5s"
    if ns < 1_000_000_000:
        return decimal(ns, 6) + "ms"
    hours, rest = divmod(ns, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    text = f"{hours}h" if hours else ""
    if hours or minutes:
        text += f"{minutes}m"
    return text + decimal(rest, 9) + "s"


@given(st.integers(min_value=0, max_value=2**63 - 1), st.booleans())
def test_go_formatted_durations_read_back(ns: int, negative: bool) -> None:
    text = ("-" if negative and ns else "") + go_string(ns)
    expected = -ns if negative else ns
    assert parse_duration_ns(text) == expected
    assert parse_duration(text) == expected / 1_000_000_000


UNITS_NS = {
    "ns": 1,
    "us": 10**3,
    "\u00b5s": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}


@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from(sorted(UNITS_NS))), min_size=1, max_size=5
    )
)
def test_durations_are_the_sum_of_their_parts(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{value}{unit}" for value, unit in parts)
    total = sum(value * UNITS_NS[unit] for value, unit in parts)
    if total <= 2**63 - 1:
        assert parse_duration_ns(text) == total
    else:
        with pytest.raises(ValueError, match="longer than Go's maximum"):
            parse_duration_ns(text)


# --- quantities ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, Fraction(1)),
        ("1", Fraction(1)),
        ("500m", Fraction(1, 2)),
        ("1000m", Fraction(1)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("1.", Fraction(1)),
        ("1.5m", Fraction(3, 2000)),
        ("-2", Fraction(-2)),
        ("+2", Fraction(2)),
        (0.1, Fraction(1, 10)),
        (1e-05, Fraction(1, 100000)),
    ],
)
def test_quantities(value: object, expected: Fraction) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "m",
        "1k",
        "1Ki",
        "1M",
        "1u",
        "1n",
        "1e3",
        "1E3",
        "0x10",
        " 1",
        "1 ",
        "1mm",
        "--1",
        "½",
        "\u0661",  # an Arabic-Indic digit
        "1" * 65,
        True,
        None,
        [1],
        float("inf"),
        float("nan"),
    ],
)
def test_quantities_a_weight_cannot_be(value: object) -> None:
    with pytest.raises(ValueError):
        parse_quantity(value)


@given(st.integers(min_value=0, max_value=10**30))
def test_integer_quantities(n: int) -> None:
    assert parse_quantity(n) == n
    assert parse_quantity(str(n)) == n
    assert parse_quantity(f"{n}m") == Fraction(n, 1000)


@given(st.integers(min_value=0, max_value=10**12), st.text(alphabet="0123456789", max_size=12))
def test_decimal_quantities(whole: int, digits: str) -> None:
    expected = whole + Fraction(int(digits or "0"), 10 ** len(digits))
    assert parse_quantity(f"{whole}.{digits}") == expected
    assert parse_quantity(f"{whole}.{digits}m") == expected / 1000


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_float_quantities_keep_their_value(value: float) -> None:
    assert float(parse_quantity(value)) == value


@given(st.integers(min_value=0, max_value=429_496_729))
def test_milli_weights_are_tenfold(milli: int) -> None:
    spec = {"dstOverrides": [{"authority": "a:80", "weight": f"{milli}m"}]}
    assert profile_from_spec(spec, fqn=FQN).dst_overrides[0].weight == milli * 10


def test_problems_of_an_object_judge_its_name_and_its_spec_together() -> None:
    valid = {"metadata": {"name": FQN, "namespace": "emojivoto"}, "spec": EXAMPLE}
    assert problems(valid) == []
    bad = {"metadata": {"name": "Web_Svc"}, "spec": {"routes": [{"name": "r"}], "x": 1}}
    found = problems(bad)
    assert [p.split(":")[0] for p in found] == [
        "metadata.name",
        "spec.x",
        "spec.routes[0].condition",
    ]
    assert "'Web_Svc' is not a DNS-1123 subdomain" in found[0]
    assert problems({"spec": {}}) == [
        "metadata.name: missing (name the profile after its service's FQDN)"
    ]
    assert problems({"metadata": {"name": "a" * 254}, "spec": {}})[0].startswith("metadata.name:")
    assert problems({"metadata": {"name": FQN}}) == ["spec: expected a mapping, got null"]
