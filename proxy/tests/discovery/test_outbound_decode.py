"""`OutboundPolicy` messages decoded into `ClientPolicy`: the fields the router reads, and the
policies refused whole with every problem named (hostile sizes, a catastrophic regex, weights,
missing fields)."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import pytest
from google.protobuf import duration_pb2

from meshlet.api import (
    destination_pb2,
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    meta_pb2,
    net_pb2,
    outbound_pb2,
)
from meshlet.proxy.core.authz import GrpcMatch, HostKind, PathKind
from meshlet.proxy.core.client_policy import (
    Balance,
    ConsecutiveFailures,
    Dispatch,
    ExponentialBackoff,
    Fail,
    FailureInjector,
    Forbidden,
    Forward,
    PeakEwma,
    Penalty,
    PolicyRef,
    Protocol,
    Redirect,
    RequestHeaders,
    Timeouts,
)
from meshlet.proxy.discovery.decode import DecodeError
from meshlet.proxy.discovery.outbound_decode import MAX_ROUTES, decode_outbound

OB = outbound_pb2
HR = OB.HttpRoute
SVC = "web.shop.svc.cluster.local:80"


def dur(seconds: float) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=int(seconds), nanos=round(seconds % 1 * 1e9))


def resource(kind: str, name: str, group: str = "gateway.networking.k8s.io") -> meta_pb2.Metadata:
    return meta_pb2.Metadata(
        resource=meta_pb2.Resource(group=group, kind=kind, name=name, namespace="shop")
    )


def backend(name: str = "web", path: str = SVC) -> OB.Backend:
    return OB.Backend(
        metadata=resource("Service", name, group="core"),
        balancer=OB.Backend.BalanceP2c(
            discovery=OB.Backend.EndpointDiscovery(
                dst=OB.Backend.EndpointDiscovery.DestinationGet(path=path)
            ),
            peak_ewma=OB.Backend.BalanceP2c.PeakEwma(default_rtt=dur(0.03), decay=dur(10)),
        ),
        queue=OB.Queue(capacity=100, failfast_timeout=dur(3)),
    )


def weighted(*pairs: tuple[str, int]) -> HR.Distribution:
    return HR.Distribution(random_available=HR.Distribution.RandomAvailable(backends=[
        HR.WeightedRouteBackend(backend=HR.RouteBackend(backend=backend(n)), weight=w)
        for n, w in pairs
    ]))  # fmt: skip


def path(kind: str, value: str) -> http_route_pb2.HttpRouteMatch:
    return http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(**{kind: value}))


def http_route(name: str, *rules: HR.Rule, hosts: tuple[str, ...] = ()) -> OB.HttpRoute:
    return OB.HttpRoute(
        metadata=resource("HTTPRoute", name),
        hosts=[http_route_pb2.HostMatch(exact=h) for h in hosts],
        rules=list(rules),
    )


def rule(*matches: http_route_pb2.HttpRouteMatch, **fields: Any) -> HR.Rule:
    fields.setdefault("backends", weighted(("web", 1)))
    return HR.Rule(matches=list(matches), **fields)


def accrual(max_failures: int = 7) -> OB.FailureAccrual:
    return OB.FailureAccrual(consecutive_failures=OB.FailureAccrual.ConsecutiveFailures(
        max_failures=max_failures,
        backoff=OB.ExponentialBackoff(min_backoff=dur(1), max_backoff=dur(60), jitter_ratio=0.5),
    ))  # fmt: skip


def http1(*routes: OB.HttpRoute, failure_accrual: OB.FailureAccrual | None = None) -> Any:
    return OB.OutboundPolicy(
        metadata=resource("Service", "web", group="core"),
        protocol=OB.ProxyProtocol(http1=OB.ProxyProtocol.Http1(
            routes=list(routes), failure_accrual=failure_accrual)),
    )  # fmt: skip


def refused(msg: OB.OutboundPolicy) -> str:
    with pytest.raises(DecodeError) as caught:
        decode_outbound(msg)
    return str(caught.value)


# --- what the router reads ---------------------------------------------------------------------


def test_an_http_route_decodes_into_matches_backends_retry_timeouts_and_accrual() -> None:
    retry = HR.Retry(
        max_retries=3,
        max_request_bytes=64_000,
        conditions=HR.Retry.Conditions(status_ranges=[HR.Retry.Conditions.StatusRange(
            start=500, end=599)]),
        timeout=dur(0.5),
        backoff=OB.ExponentialBackoff(min_backoff=dur(0.025), max_backoff=dur(0.25)),
    )  # fmt: skip
    match = http_route_pb2.HttpRouteMatch(
        path=http_route_pb2.PathMatch(prefix="/api"),
        method=http_types_pb2.HttpMethod(registered=http_types_pb2.HttpMethod.POST),
        headers=[http_route_pb2.HeaderMatch(name="X-Tenant", exact=b"blue")],
    )
    timeouts = http_route_pb2.Timeouts(request=dur(10), response=dur(2), idle=dur(30))
    msg = http1(
        http_route("api", rule(match, backends=weighted(("v1", 90), ("v2", 10)), retry=retry,
                               timeouts=timeouts), hosts=("web.shop",)),
        failure_accrual=accrual(),
    )  # fmt: skip
    policy = decode_outbound(msg)
    assert policy.protocol is Protocol.HTTP1
    assert policy.meta == PolicyRef("Service", "web", "core", "shop")
    (route,) = policy.http1
    assert route.meta == PolicyRef("HTTPRoute", "api", "gateway.networking.k8s.io", "shop")
    assert [(h.kind, h.value) for h in route.hosts] == [(HostKind.EXACT, "web.shop")]
    (r,) = route.rules
    (m,) = r.matches
    assert m.path is not None and (m.path.kind, m.path.value) == (PathKind.PREFIX, "/api")
    assert m.method == "POST" and m.headers[0].name == "x-tenant"
    assert r.timeouts == Timeouts(request=10.0, response=2.0, idle=30.0)
    assert r.retry is not None and (r.retry.limit, r.retry.statuses) == (3, ((500, 599),))
    assert r.retry.timeout == 0.5 and r.retry.backoff == ExponentialBackoff(0.025, 0.25, 0.0)
    assert r.distribution.kind is Dispatch.RANDOM_AVAILABLE
    assert [(b.backend.meta.name, b.weight) for b in r.distribution.backends] == [
        ("v1", 90), ("v2", 10)]  # fmt: skip
    assert r.distribution.cumulative == (90, 100)
    accrued = ConsecutiveFailures(7, ExponentialBackoff(1.0, 60.0, 0.5))
    for rb in r.distribution.backends:
        assert rb.backend.dispatch == Balance(SVC, PeakEwma(0.03, 10.0), accrued)
    assert [b.meta.name for b in policy.backends] == ["v1", "v2"]


def test_filters_decode_into_what_the_router_applies() -> None:
    filters = [
        HR.Filter(request_header_modifier=http_route_pb2.RequestHeaderModifier(
            set=http_types_pb2.Headers(headers=[http_types_pb2.Headers.Header(
                name="x-canary", value=b"1")]))),
        HR.Filter(redirect=http_route_pb2.RequestRedirect(
            host="new.shop", path=http_route_pb2.PathModifier(prefix="/v2"), status=302)),
        HR.Filter(failure_injector=http_route_pb2.HttpFailureInjector(
            status=503, message="drill", ratio=http_route_pb2.Ratio(numerator=1, denominator=10))),
    ]  # fmt: skip
    (route,) = decode_outbound(http1(http_route("f", rule(filters=filters)))).http1
    header, redirect, injector = route.rules[0].filters
    assert isinstance(header, RequestHeaders)
    assert redirect == Redirect(302, host="new.shop", prefix="/v2")
    assert injector == FailureInjector(503, "drill", 1, 10)


def test_a_grpc_route_with_codes_to_retry_and_an_opaque_route_forbidden() -> None:
    GR = OB.GrpcRoute
    grpc_rule = GR.Rule(
        matches=[grpc_route_pb2.GrpcRouteMatch(rpc=grpc_route_pb2.GrpcRpcMatch(
            service="shop.Cart", method="Add"))],
        backends=GR.Distribution(first_available=GR.Distribution.FirstAvailable(
            backends=[GR.RouteBackend(backend=backend())])),
        retry=GR.Retry(max_retries=2, conditions=GR.Retry.Conditions(
            unavailable=True, deadine_exceeded=True)),
    )  # fmt: skip
    grpc = OB.OutboundPolicy(
        metadata=resource("Service", "cart", group="core"),
        protocol=OB.ProxyProtocol(grpc=OB.ProxyProtocol.Grpc(routes=[
            GR(metadata=resource("GRPCRoute", "cart"), rules=[grpc_rule])])),
    )  # fmt: skip
    (route,) = decode_outbound(grpc).grpc
    r = route.rules[0]
    assert r.matches == (GrpcMatch("shop.Cart", "Add"),)
    assert r.retry is not None and r.retry.grpc_codes == frozenset({4, 14})
    assert r.distribution.kind is Dispatch.FIRST_AVAILABLE

    OR = OB.OpaqueRoute
    opaque = OB.OutboundPolicy(
        metadata=meta_pb2.Metadata(default="db"),
        protocol=OB.ProxyProtocol(opaque=OB.ProxyProtocol.Opaque(routes=[OR(
            metadata=meta_pb2.Metadata(default="db"),
            rules=[OR.Rule(filters=[OR.Filter(forbidden=opaque_route_forbidden())])])])),
    )  # fmt: skip
    policy = decode_outbound(opaque)
    assert policy.meta == PolicyRef.default("db")
    assert policy.opaque[0].rules[0].filters == (Forbidden(),)
    assert policy.opaque[0].rules[0].distribution.kind is Dispatch.EMPTY


def opaque_route_forbidden() -> Any:
    from meshlet.api import opaque_route_pb2

    return opaque_route_pb2.Forbidden()


def test_detect_needs_its_timeout_and_all_three_protocols_each_with_its_accrual() -> None:
    detect = OB.ProxyProtocol.Detect(
        timeout=dur(10),
        http1=OB.ProxyProtocol.Http1(routes=[http_route("r", rule())], failure_accrual=accrual(3)),
        http2=OB.ProxyProtocol.Http2(routes=[http_route("r", rule())], failure_accrual=accrual(9)),
        opaque=OB.ProxyProtocol.Opaque(),
    )
    msg = OB.OutboundPolicy(metadata=meta_pb2.Metadata(default="web"),
                            protocol=OB.ProxyProtocol(detect=detect))  # fmt: skip
    policy = decode_outbound(msg)
    assert (policy.protocol, policy.detect_timeout) == (Protocol.DETECT, 10)
    balancers = [
        route.rules[0].distribution.backends[0].backend.dispatch
        for route in (*policy.http1, *policy.http2)
    ]
    assert [b.accrual.max_failures for b in balancers if isinstance(b, Balance) and b.accrual
            ] == [3, 9]  # fmt: skip
    msg.protocol.detect.ClearField("timeout")
    msg.protocol.detect.ClearField("opaque")
    assert refused(msg) == "2 problems: detect without timeout; detect without opaque"


def test_a_penalty_peak_ewma_takes_linkerds_defaults_for_what_is_unset() -> None:
    b = backend()
    b.balancer.penalty_peak_ewma.CopyFrom(OB.Backend.BalanceP2c.PenaltyPeakEwma(penalty=dur(2)))
    dist = HR.Distribution(first_available=HR.Distribution.FirstAvailable(
        backends=[HR.RouteBackend(backend=b)]))  # fmt: skip
    (route,) = decode_outbound(http1(http_route("r", rule(backends=dist)))).http1
    balance = route.rules[0].distribution.backends[0].backend.dispatch
    assert balance == Balance(SVC, PeakEwma(0.03, 10.0, Penalty(2.0, 10.0, 300.0)))


def test_backends_forward_or_fail_when_the_controller_says_so() -> None:
    forward = OB.Backend(
        metadata=resource("Service", "ext", group="core"),
        forward=destination_pb2.WeightedAddr(addr=net_pb2.TcpAddress(
            ip=net_pb2.IPAddress(ipv4=0x0A000001), port=8080), weight=1),
        queue=OB.Queue(capacity=10, failfast_timeout=dur(3)),
    )  # fmt: skip
    nothing = OB.Backend(metadata=resource("Service", "gone", group="core"),
                         queue=OB.Queue(capacity=10, failfast_timeout=dur(3)))  # fmt: skip
    dist = HR.Distribution(first_available=HR.Distribution.FirstAvailable(backends=[
        HR.RouteBackend(backend=forward), HR.RouteBackend(backend=nothing)]))  # fmt: skip
    (route,) = decode_outbound(http1(http_route("r", rule(backends=dist)))).http1
    first, second = (b.backend.dispatch for b in route.rules[0].distribution.backends)
    assert isinstance(first, Forward) and str(first.endpoint.addr) == "10.0.0.1:8080"
    assert isinstance(second, Fail) and "gone" in second.message


# --- refused whole, every problem named ---------------------------------------------------------


def test_every_problem_is_named_at_once_with_where_it_is() -> None:
    no_queue = backend("slow")
    no_queue.ClearField("queue")
    bad = http1(
        http_route("a", rule(path("regex", "/(unclosed"))),
        http_route("b", rule(backends=HR.Distribution(
            random_available=HR.Distribution.RandomAvailable(backends=[
                HR.WeightedRouteBackend(backend=HR.RouteBackend(backend=no_queue), weight=1)])))),
        OB.HttpRoute(rules=[rule()]),
    )  # fmt: skip
    problem = refused(bad)
    assert problem.startswith("3 problems: ")
    route_a = "http1 route 0 (HTTPRoute.gateway.networking.k8s.io/shop/a) rule 0: path regex"
    assert route_a in problem
    assert ("http1 route 1 (HTTPRoute.gateway.networking.k8s.io/shop/b) rule 0 backend 0: "
            "backend Service.core/shop/slow without a queue") in problem  # fmt: skip
    assert "http1 route 2: no metadata" in problem


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m: m.ClearField("protocol"), "no protocol"),
        (lambda m: m.ClearField("metadata"), "metadata: no metadata"),
        (lambda m: m.protocol.http1.routes[0].rules[0].ClearField("backends") or
         m.protocol.http1.routes[0].rules[0].backends.SetInParent(),
         "a distribution without a kind"),
        (lambda m: m.protocol.http1.routes[0].rules[0].backends.random_available.backends[0]
         .backend.backend.balancer.ClearField("discovery"), "balancer without discovery"),
        (lambda m: m.protocol.http1.routes[0].rules[0].backends.random_available.backends[0]
         .backend.backend.ClearField("metadata"), "no backend metadata"),
        (lambda m: m.protocol.http1.routes[0].rules[0].filters.add(), "a filter without a kind"),
        (lambda m: m.protocol.http1.routes[0].rules[0].retry.SetInParent(), "retry: no conditions"),
        (lambda m: m.protocol.http1.failure_accrual.SetInParent(), "no kind; the proxy implements"),
        (lambda m: m.protocol.http1.routes[0].rules[0].timeouts.request.CopyFrom(
            duration_pb2.Duration(seconds=-1)), "a negative duration"),
        (lambda m: m.protocol.http1.routes[0].rules[0].retry.CopyFrom(HR.Retry(
            max_retries=70_000, conditions=HR.Retry.Conditions())), "max_retries 70000"),
        (lambda m: m.protocol.http1.routes[0].rules[0].retry.CopyFrom(HR.Retry(
            conditions=HR.Retry.Conditions(status_ranges=[HR.Retry.Conditions.StatusRange(
                start=503, end=500)]))), "status range 503-500"),
        (lambda m: m.protocol.http1.failure_accrual.CopyFrom(accrual()) or
         setattr(m.protocol.http1.failure_accrual.consecutive_failures.backoff, "jitter_ratio",
                 float("nan")), "jitter nan"),
    ],
)  # fmt: skip
def test_a_missing_or_impossible_field_refuses_the_policy(change: Any, named: str) -> None:
    msg = http1(http_route("r", rule()))
    decode_outbound(msg)
    change(msg)
    assert named in refused(msg)


def test_weights_zero_is_never_picked_all_zero_or_too_large_refused() -> None:
    (route,) = decode_outbound(http1(http_route("r", rule(backends=weighted(
        ("a", 0), ("b", 3)))))).http1  # fmt: skip
    assert route.rules[0].distribution.cumulative == (0, 3)
    assert "every backend has weight 0" in refused(
        http1(http_route("r", rule(backends=weighted(("a", 0), ("b", 0)))))
    )
    assert "weight 1000001 is more than 1000000" in refused(
        http1(http_route("r", rule(backends=weighted(("a", 1_000_001)))))
    )
    empty = HR.Distribution(random_available=HR.Distribution.RandomAvailable())
    assert "random_available distribution without backends" in refused(
        http1(http_route("r", rule(backends=empty)))
    )


def test_a_negative_weight_on_the_wire_is_a_huge_uint32_and_refused() -> None:
    """uint32 has no sign: a sender writing -1 (as int32 would) puts 2**32-1 on the wire."""
    one = HR.RouteBackend(backend=backend("a")).SerializeToString()
    field_1 = b"\x0a" + bytes([len(one)]) + one  # backend, length-delimited (< 128 bytes)
    negative = b"\x10" + b"\xff" * 9 + b"\x01"  # weight: varint of -1 in 64-bit two's complement
    item = HR.WeightedRouteBackend.FromString(field_1 + negative)
    assert item.weight == 2**32 - 1
    dist = HR.Distribution(random_available=HR.Distribution.RandomAvailable(backends=[item]))
    assert "weight 4294967295 is more than 1000000" in refused(
        http1(http_route("r", rule(backends=dist)))
    )


def test_a_catastrophic_regex_is_matched_in_linear_time() -> None:
    """(a+)+$ backtracks for ever in Python's re on 'aaaa…!'; RE2 answers at once (and a
    request's own budget refuses a path that long before it is matched at all)."""
    from meshlet.api.pathregex import Meter, RegexBudgetExceeded
    from meshlet.proxy.core.authz import request
    from meshlet.proxy.core.route_select import select_http

    (route,) = decode_outbound(http1(http_route("evil", rule(path("regex", "/(a+)+$"))))).http1
    hostile = "/" + "a" * 50_000 + "!"
    started = time.perf_counter()
    assert select_http([route], request("web", "GET", hostile, [], Meter(10**12))) is None
    assert time.perf_counter() - started < 0.5
    with pytest.raises(RegexBudgetExceeded):
        select_http([route], request("web", "GET", hostile, []))
    started = time.perf_counter()
    huge = refused(http1(http_route("r", rule(path("regex", r"\pL{1000}" * 5)))))
    assert "path regex '\\\\pL{1000}" in huge and "pattern too large" in huge
    assert time.perf_counter() - started < 0.5


def retained(value: object) -> int:
    """The bytes of every object reachable from `value` (classes excluded)."""
    seen, stack, total = set(), [value], 0
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, type):
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        stack.extend(gc.get_referents(item))
    return total


def test_ten_thousand_routes_decode_within_bounds_and_one_more_is_refused() -> None:
    """10,000 routes of one rule each (an exact path, one weighted backend; 1.6 MiB on the
    wire) decode in ~0.9s on this 2-core machine under load and hold ~16 MiB; MAX_ROUTES + 1
    is refused before anything is decoded."""
    msg = http1(*[http_route(f"r{i}", rule(path("exact", f"/p/{i}"))) for i in range(MAX_ROUTES)])
    started = time.perf_counter()
    policy = decode_outbound(msg)
    took = time.perf_counter() - started
    assert len(policy.http1) == MAX_ROUTES
    assert took < 4.0, f"{took:.2f}s"
    size = retained(policy)
    assert 2**20 < size < 32 * 2**20, f"{size / 2**20:.1f} MiB"
    msg.protocol.http1.routes.append(http_route("one-more", rule()))
    started = time.perf_counter()
    why = f"{MAX_ROUTES + 1} routes, more than the {MAX_ROUTES} a protocol may have"
    assert refused(msg) == why
    assert time.perf_counter() - started < 0.1


def test_thousands_of_problems_are_summed_up_in_one_bounded_message() -> None:
    msg = http1(*[OB.HttpRoute() for _ in range(5000)])
    problem = refused(msg)
    assert problem.startswith("5000 problems: ") and problem.endswith("; and 4980 more")
    assert len(problem) < 2000


def test_a_policy_over_the_regex_budget_is_refused_whole_and_a_pattern_counts_once() -> None:
    from meshlet.api.pathregex import MAX_REGEXES

    many = [http_route(f"r{n}", rule(path("regex", f"/r{n}/.*"))) for n in range(MAX_REGEXES + 1)]
    why = refused(http1(*many))
    assert f"more than {MAX_REGEXES} distinct regexes" in why
    assert why.startswith(
        "1 problem: http1 route 128 (HTTPRoute.gateway.networking.k8s.io/shop/r128)"
    )
    # a detect port's HTTP/1 and HTTP/2 lists hold the same routes: their patterns count once
    same = [http_route(f"r{n}", rule(path("regex", f"/r{n}/.*"))) for n in range(MAX_REGEXES)]
    detect = OB.OutboundPolicy(
        metadata=resource("Service", "web", group="core"),
        protocol=OB.ProxyProtocol(detect=OB.ProxyProtocol.Detect(
            timeout=dur(10), http1=OB.ProxyProtocol.Http1(routes=same),
            http2=OB.ProxyProtocol.Http2(routes=same),
            opaque=OB.ProxyProtocol.Opaque())),
    )  # fmt: skip
    policy = decode_outbound(detect)
    assert len(policy.http1) == len(policy.http2) == MAX_REGEXES
