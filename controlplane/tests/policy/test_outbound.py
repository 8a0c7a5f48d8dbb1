"""The outbound index's translation, table by table: annotations, matches, backends, filters,
timeouts and route order as Linkerd's policy controller encodes them."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.api import outbound_pb2
from meshlet.api import wellknown as W
from meshlet.controlplane.injector.validators import VALIDATORS
from meshlet.controlplane.k8s.events import Delete, Kind, Snapshot, Upsert
from meshlet.controlplane.policy.annotations import (
    Accrual,
    Retry,
    Timeouts,
    accrual_of,
    annotation_problems,
    parse_duration,
    retry_of,
    timeouts_of,
)
from meshlet.controlplane.policy.mailbox import Mailbox
from meshlet.controlplane.policy.outbound_index import OutboundIndex, TargetError, parse_authority
from meshlet.controlplane.policy.routes import parse_gateway_duration

GW = "gateway.networking.k8s.io"


def service(name: str = "web", notes: dict[str, str] | None = None, ports: tuple[int, ...] = (80,),
            ) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns", "annotations": notes or {}},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": p} for p in ports]},
    }


def http_route(name: str = "r", rules: list[dict[str, Any]] | None = None, *,
               created: str = "", port: int | None = None, notes: dict[str, str] | None = None,
               group: str = GW, kind: str = "HTTPRoute") -> dict[str, Any]:  # fmt: skip
    parent: dict[str, Any] = {"group": "core", "kind": "Service", "name": "web"}
    if port is not None:
        parent["port"] = port
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "annotations": notes or {}}
    if created:
        meta["creationTimestamp"] = created
    version = "v1" if group == GW or kind == "GRPCRoute" else "v1beta3"
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": meta,
        "spec": {"parentRefs": [parent], "rules": rules if rules is not None else [{}]},
    }


def index(*objects: dict[str, Any]) -> OutboundIndex:
    ix = OutboundIndex()
    for obj in objects:
        kind = {
            ("v1", "Service"): Kind.SERVICE,
            (f"{GW}/v1", "HTTPRoute"): Kind.GATEWAY_HTTP_ROUTE,
            ("policy.meshlet.io/v1beta3", "HTTPRoute"): Kind.HTTP_ROUTE,
            (f"{GW}/v1", "GRPCRoute"): Kind.GATEWAY_GRPC_ROUTE,
        }[(obj["apiVersion"], obj["kind"])]
        ix.apply(Upsert(kind, obj))
    return ix


def policy(*objects: dict[str, Any], port: int = 80) -> outbound_pb2.OutboundPolicy:
    found = index(*objects).get("ns", "web", port)
    assert found is not None
    return found


def http_routes(p: outbound_pb2.OutboundPolicy) -> Any:
    assert p.protocol.detect.http1.routes == p.protocol.detect.http2.routes
    return p.protocol.detect.http1.routes


# -- annotations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,seconds",
    [("0", 0.0), ("500ms", 0.5), ("10s", 10.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0),
     (" 3s ", 3.0)],
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text,problem",
    [("-1s", "negative"), ("1.5s", "fraction"), ("10", "no unit"), ("10x", "not a duration"),
     ("", "not a duration"), ("s", "not a duration")],
)  # fmt: skip
def test_bad_durations_say_why(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_duration(text)


@pytest.mark.parametrize(
    "notes,expected",
    [
        ({}, None),
        ({W.RETRY_HTTP_ANNOTATION: "5xx"}, Retry(None, None, ((500, 599),), None)),
        ({W.RETRY_HTTP_ANNOTATION: "gateway-error,429,500-504"},
         Retry(None, None, ((502, 504), (429, 429), (500, 504)), None)),
        ({W.RETRY_GRPC_ANNOTATION: "Cancelled,unavailable"},
         Retry(None, None, None, ("cancelled", "unavailable"))),
        ({W.RETRY_LIMIT_ANNOTATION: "3"}, Retry(3, None, None, None)),
        ({W.RETRY_LIMIT_ANNOTATION: "0"}, None),  # 0 is unset, as in Linkerd
        ({W.RETRY_TIMEOUT_ANNOTATION: "250ms"}, Retry(None, 0.25, None, None)),
        ({W.RETRY_TIMEOUT_ANNOTATION: "0", W.RETRY_LIMIT_ANNOTATION: "2"},
         Retry(2, None, None, None)),
    ],
)  # fmt: skip
def test_retry_annotations(notes: dict[str, str], expected: Retry | None) -> None:
    assert retry_of(notes) == expected


@pytest.mark.parametrize(
    "notes,problem",
    [
        ({W.RETRY_HTTP_ANNOTATION: "4xx"}, "retry.meshlet.io/http: '4xx' is not a retry condition"),
        ({W.RETRY_HTTP_ANNOTATION: "504-500"}, "'504-500' is not a retry condition"),
        ({W.RETRY_HTTP_ANNOTATION: "600"}, "'600' is not a retry condition"),
        ({W.RETRY_GRPC_ANNOTATION: "aborted"}, "retry.meshlet.io/grpc: 'aborted' is not one of"),
        ({W.RETRY_LIMIT_ANNOTATION: "-1"}, "retry.meshlet.io/limit: '-1' is not a number"),
        ({W.RETRY_LIMIT_ANNOTATION: "70000"}, "is not a number in 0..65535"),
        ({W.RETRY_TIMEOUT_ANNOTATION: "soon"}, "retry.meshlet.io/timeout: 'soon' is not"),
    ],
)  # fmt: skip
def test_bad_retry_annotations_are_named(notes: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError) as err:
        retry_of(notes)
    assert problem in str(err.value)


def test_timeout_annotations() -> None:
    notes = {W.TIMEOUT_REQUEST_ANNOTATION: "10s", W.TIMEOUT_RESPONSE_ANNOTATION: "2s",
             W.TIMEOUT_IDLE_ANNOTATION: "1m"}  # fmt: skip
    assert timeouts_of(notes) == Timeouts(10.0, 2.0, 60.0)
    assert timeouts_of({}) == Timeouts()


def test_failure_accrual_defaults_and_overrides() -> None:
    mode = {W.FAILURE_ACCRUAL_ANNOTATION: "consecutive"}
    assert accrual_of({}) is None
    assert accrual_of(mode) == Accrual(7, 1.0, 60.0, 0.5)  # Linkerd's defaults
    assert accrual_of({**mode, W.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION: "3",
                       W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION: "100ms",
                       W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION: "10s",
                       W.FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION: "0.25"},
                      ) == Accrual(3, 0.1, 10.0, 0.25)  # fmt: skip
    assert accrual_of({W.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION: "3"}) is None  # no mode


@pytest.mark.parametrize(
    "extra,problem",
    [
        ({W.FAILURE_ACCRUAL_ANNOTATION: "unified"}, "'unified' is not a mode; use consecutive"),
        ({W.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION: "many"}, "max-failures: 'many' is not"),
        ({W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION: "1"}, "min-penalty: '1' has no unit"),
        ({W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION: "0"}, "max-penalty: must be more than 0"),
        ({W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION: "2m"}, "120s exceeds the max penalty (60s)"),
        ({W.FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION: "101"}, "jitter-ratio: '101' is not within"),
        ({W.FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION: "x"}, "jitter-ratio: 'x' is not a number"),
    ],
)  # fmt: skip
def test_bad_failure_accrual_is_named(extra: dict[str, str], problem: str) -> None:
    notes = {W.FAILURE_ACCRUAL_ANNOTATION: "consecutive", **extra}
    problems = annotation_problems(notes)
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_service_with_bad_values_is_served_without_them_and_each_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    notes = {W.FAILURE_ACCRUAL_ANNOTATION: "sometimes", W.TIMEOUT_REQUEST_ANNOTATION: "5",
             W.RETRY_HTTP_ANNOTATION: "5xx"}  # fmt: skip
    ix = index(service(notes=notes))
    assert ix.invalid == 1
    assert "'sometimes' is not a mode" in caplog.text and "'5' has no unit" in caplog.text
    got = ix.get("ns", "web", 80)
    assert got is not None
    assert not got.protocol.detect.http1.HasField("failure_accrual")
    rule = got.protocol.detect.http1.routes[0].rules[0]
    assert not rule.timeouts.HasField("request")
    assert rule.retry.conditions.status_ranges[0].start == 500  # the good value still applies


# -- the default policy ----------------------------------------------------------------------


def test_the_default_route_to_the_service_itself() -> None:
    p = policy(service(notes={W.FAILURE_ACCRUAL_ANNOTATION: "consecutive"}))
    res = p.metadata.resource
    assert (res.group, res.kind, res.namespace, res.name, res.port) == ("core", "Service", "ns",
                                                                        "web", 80)  # fmt: skip
    assert p.protocol.detect.timeout.seconds == 10
    (route,) = http_routes(p)
    assert route.metadata.default == "http"
    (rule,) = route.rules
    assert rule.matches[0].path.prefix == "/"
    (backend,) = rule.backends.first_available.backends
    b = backend.backend
    assert b.balancer.discovery.dst.path == "web.ns.svc.cluster.local:80"
    assert b.balancer.peak_ewma.default_rtt.ToMilliseconds() == 30
    assert b.balancer.peak_ewma.decay.seconds == 10
    assert (b.queue.capacity, b.queue.failfast_timeout.seconds) == (100, 3)
    assert b.metadata.resource.name == "web" and b.metadata.resource.port == 80
    opaque = p.protocol.detect.opaque.routes[0]
    assert opaque.metadata.default == "opaq"
    assert opaque.rules[0].backends.first_available.backends[0].backend == b
    accrual = p.protocol.detect.http2.failure_accrual.consecutive_failures
    assert accrual.max_failures == 7 and accrual.backoff.jitter_ratio == 0.5
    assert accrual.backoff.min_backoff.seconds == 1 and accrual.backoff.max_backoff.seconds == 60


@pytest.mark.parametrize(
    "notes,port,opaque",
    [
        ({W.OPAQUE_PORTS_ANNOTATION: "80"}, 80, True),
        ({W.OPAQUE_PORTS_ANNOTATION: "3000-4000"}, 80, False),
        ({}, 3306, True),  # a default opaque port
        ({W.OPAQUE_PORTS_ANNOTATION: ""}, 3306, False),  # the annotation replaces the default
        ({W.OPAQUE_PORTS_ANNOTATION: "9000-9100"}, 9042, True),
    ],
)  # fmt: skip
def test_opaque_ports(notes: dict[str, str], port: int, opaque: bool) -> None:
    p = policy(service(notes=notes, ports=(port,)), http_route(), port=port)
    assert p.protocol.HasField("opaque") is opaque
    if opaque:
        assert p.protocol.opaque.routes[0].metadata.default == "opaq"


# -- routes ----------------------------------------------------------------------------------


def test_each_http_match_kind() -> None:
    matches = [
        {"path": {"type": "Exact", "value": "/a"}},
        {"path": {"type": "PathPrefix", "value": "/b"}},
        {"path": {"type": "RegularExpression", "value": "/c/[0-9]+"}},
        {"headers": [{"name": "x-a", "value": "1"},
                     {"name": "x-b", "type": "RegularExpression", "value": "v.*"}]},
        {"queryParams": [{"name": "q", "value": "1"}]},
        {"method": "POST"},
    ]  # fmt: skip
    (route,) = http_routes(policy(service(), http_route(rules=[{"matches": matches}])))
    got = route.rules[0].matches
    assert got[0].path.exact == "/a" and got[1].path.prefix == "/b"
    assert got[2].path.regex == "/c/[0-9]+"
    assert got[3].headers[0].exact == b"1" and got[3].headers[1].regex == "v.*"
    assert got[4].query_params[0].name == "q" and got[4].query_params[0].exact == "1"
    assert got[5].method.registered == 1  # POST
    assert route.metadata.resource.kind == "HTTPRoute" and route.metadata.resource.group == GW


def test_grpc_routes_make_a_grpc_protocol() -> None:
    rules = [{"matches": [{"method": {"service": "pkg.Svc", "method": "Get"}}]}]
    route = http_route(rules=rules, kind="GRPCRoute")
    notes = {W.RETRY_GRPC_ANNOTATION: "unavailable", W.FAILURE_ACCRUAL_ANNOTATION: "consecutive"}
    p = policy(service(notes=notes), route)
    assert p.protocol.HasField("grpc")
    (got,) = p.protocol.grpc.routes
    rpc = got.rules[0].matches[0].rpc
    assert (rpc.service, rpc.method) == ("pkg.Svc", "Get")
    assert got.rules[0].retry.conditions.unavailable and not got.rules[0].retry.conditions.internal
    assert p.protocol.grpc.failure_accrual.consecutive_failures.max_failures == 7


def test_weights_and_backends_linkerd_cannot_use() -> None:
    refs = [
        {"name": "web", "port": 80, "weight": 3},
        {"name": "other", "port": 8080},
        {"name": "gone", "port": 80, "weight": 2},
        {"name": "web"},
        {"name": "pool", "group": "example.com", "kind": "Pool", "port": 80},
    ]
    p = policy(
        service(), service("other", ports=(8080,)), http_route(rules=[{"backendRefs": refs}])
    )
    backends = http_routes(p)[0].rules[0].backends.random_available.backends
    assert [b.weight for b in backends] == [3, 1, 2, 1, 1]
    assert backends[1].backend.backend.balancer.discovery.dst.path == (
        "other.ns.svc.cluster.local:8080"
    )
    faults = [
        (b.backend.backend.WhichOneof("kind"), b.backend.filters[0].failure_injector)
        for b in backends[2:]
    ]
    assert all(kind is None and f.status == 500 for kind, f in faults)
    assert [f.message for _, f in faults] == [
        "Service not found gone",
        "missing port for backend Service web",
        "unsupported backend type example.com Pool",
    ]
    assert backends[2].backend.backend.metadata.resource.name == "gone"
    assert backends[3].backend.backend.metadata.default == "invalid"


def test_a_backend_created_later_reaches_the_watch() -> None:
    ix = index(service(), http_route(rules=[{"backendRefs": [{"name": "late", "port": 80}]}]))
    box = Mailbox()
    assert ix.subscribe("ns", "web", 80, box)
    before = outbound_pb2.OutboundPolicy.FromString(box.take() or b"")
    assert http_routes(before)[0].rules[0].backends.random_available.backends[0].backend.filters
    assert ix.apply(Upsert(Kind.SERVICE, service("late"))) == 1
    after = outbound_pb2.OutboundPolicy.FromString(box.take() or b"")
    got = http_routes(after)[0].rules[0].backends.random_available.backends[0].backend
    assert not got.filters and got.backend.HasField("balancer")
    ix.apply(Delete(Kind.SERVICE, service()))
    assert box.closed and ix.watched == 0  # the stream ends; the proxy asks again


def test_route_order_is_oldest_first_then_by_name_then_untimed() -> None:
    routes = [
        http_route("d"),
        http_route("c", created="2024-02-01T00:00:00Z"),
        http_route("b", created="2024-01-01T00:00:00Z"),
        http_route("a", created="2024-02-01T00:00:00Z"),
        http_route("e", group="policy.meshlet.io"),
    ]
    names = [rt.metadata.resource.name for rt in http_routes(policy(service(), *routes))]
    assert names == ["b", "a", "c", "d", "e"]


def test_a_parent_port_limits_the_route_to_that_port() -> None:
    objs = (service(ports=(80, 8080)), http_route(port=8080))
    assert http_routes(policy(*objs, port=80))[0].metadata.default == "http"
    assert http_routes(policy(*objs, port=8080))[0].metadata.resource.name == "r"


def test_filters() -> None:
    filters = [
        {"type": "RequestHeaderModifier",
         "requestHeaderModifier": {"set": [{"name": "x-a", "value": "1"}], "remove": ["x-b"]}},
        {"type": "ResponseHeaderModifier",
         "responseHeaderModifier": {"add": [{"name": "x-c", "value": "2"}]}},
        {"type": "RequestRedirect",
         "requestRedirect": {"scheme": "https", "hostname": "example.com", "port": 8443,
                             "statusCode": 301,
                             "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/v2"}}},
    ]  # fmt: skip
    got = http_routes(policy(service(), http_route(rules=[{"filters": filters}])))[0].rules[0]
    req, resp, redirect = (f.WhichOneof("kind") for f in got.filters)
    assert (req, resp, redirect) == ("request_header_modifier", "response_header_modifier",
                                     "redirect")  # fmt: skip
    assert got.filters[0].request_header_modifier.remove == ["x-b"]
    assert got.filters[1].response_header_modifier.add.headers[0].value == b"2"
    r = got.filters[2].redirect
    assert (r.scheme.registered, r.host, r.port, r.status, r.path.prefix) == (
        1, "example.com", 8443, 301, "/v2")  # fmt: skip


def test_timeouts_and_retries_route_before_service() -> None:
    svc = service(notes={W.TIMEOUT_RESPONSE_ANNOTATION: "3s", W.RETRY_LIMIT_ANNOTATION: "5"})
    rules = [{"timeouts": {"request": "7s", "backendRequest": "1s"}}, {}]
    plain = http_route("a", rules=rules, created="2024-01-01T00:00:00Z")
    notes = {W.TIMEOUT_REQUEST_ANNOTATION: "2s", W.RETRY_HTTP_ANNOTATION: "503"}
    own = http_route("b", created="2024-01-02T00:00:00Z", notes=notes)
    a, b = http_routes(policy(svc, plain, own))
    with_rule, without = a.rules
    assert with_rule.timeouts.request.seconds == 7 and not with_rule.timeouts.HasField("response")
    assert with_rule.requestTimeout.seconds == 7
    assert without.timeouts.response.seconds == 3  # none of its own: the Service's
    assert with_rule.retry.max_retries == 5 and without.retry.max_retries == 5
    assert b.rules[0].timeouts.request.seconds == 2 and not b.rules[0].timeouts.HasField("response")
    assert b.rules[0].retry.max_retries == 1
    assert b.rules[0].retry.conditions.status_ranges[0].start == 503
    backoff = b.rules[0].retry.backoff
    assert (backoff.min_backoff.ToMilliseconds(), backoff.max_backoff.ToMilliseconds(),
            backoff.jitter_ratio) == (25, 250, 1.0)  # fmt: skip
    assert b.rules[0].retry.max_request_bytes == 65536


@pytest.mark.parametrize(
    "route,problem",
    [
        (http_route(notes={W.RETRY_HTTP_ANNOTATION: "often"}), "'often' is not a retry condition"),
        (http_route(rules=[{"timeouts": {"request": "1"}}]),
         "timeouts.request: '1' is not a Gateway API duration"),
        (http_route(rules=[{"filters": [{"type": "RequestMirror"}]}]),
         "'RequestMirror' is not supported"),
        (http_route(kind="GRPCRoute", rules=[{"filters": [{"type": "ResponseHeaderModifier",
                                                          "responseHeaderModifier": {}}]}]),
         "'ResponseHeaderModifier' is not supported; use one of RequestHeaderModifier"),
        (http_route(rules=[{"backendRefs": [{"name": "web", "port": 80, "weight": -1}]}]),
         "weight: -1 is not within 0..1000000"),
    ],
)  # fmt: skip
def test_an_invalid_route_is_ignored_and_named(
    route: dict[str, Any], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    ix = index(service(), route)
    assert ix.invalid == 1 and problem in caplog.text
    p = ix.get("ns", "web", 80)
    assert p is not None and not p.protocol.HasField("grpc")
    assert http_routes(p)[0].metadata.default == "http"


def test_routes_of_servers_only_are_not_outbound() -> None:
    inbound = http_route(group="policy.meshlet.io")
    inbound["spec"]["parentRefs"] = [{"group": "policy.meshlet.io", "kind": "Server", "name": "s"}]
    ix = index(service(), inbound)
    assert ix.invalid == 0
    assert http_routes(ix.get("ns", "web", 80))[0].metadata.default == "http"  # type: ignore[arg-type]


def test_a_snapshot_removes_what_it_no_longer_holds() -> None:
    ix = index(service(), service("other"), http_route())
    ix.apply(Snapshot(Kind.GATEWAY_HTTP_ROUTE, ()))
    ix.apply(Snapshot(Kind.SERVICE, (service(),)))
    assert ix.service("ns", "other") is None
    assert http_routes(ix.get("ns", "web", 80))[0].metadata.default == "http"  # type: ignore[arg-type]
    assert ix.by_ip("10.96.0.1") is not None and ix.by_ip("10.96.0.2") is None


# -- targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("web.ns.svc.cluster.local:8080", ("ns", "web", 8080)),
        ("web.ns.svc.cluster.local.:8080", ("ns", "web", 8080)),
        ("web.ns.svc.cluster.local", ("ns", "web", 80)),
        ("web.ns.svc:9", ("ns", "web", 9)),
        ("web.ns:80", None),
        ("example.com:443", None),
        ("web.ns.svc.other.domain:80", None),
        ("x" * 300 + ".ns.svc.cluster.local:80", ("ns", "x" * 300, 80)),  # then NOT_FOUND
        ("wéb.ns.svc.cluster.local:80", ("ns", "wéb", 80)),
        ("[::1]:80", None),
    ],
)  # fmt: skip
def test_authorities(text: str, expected: tuple[str, str, int] | None) -> None:
    assert parse_authority(text, "cluster.local") == expected


@pytest.mark.parametrize("text", ["", "web.ns.svc.cluster.local:0", "web:99999", "a/b", "u@h:1",
                                  "web.ns.svc.cluster.local:http", "web:", "x" * 513])  # fmt: skip
def test_malformed_authorities(text: str) -> None:
    with pytest.raises(TargetError, match="invalid authority"):
        parse_authority(text, "cluster.local")


@pytest.mark.parametrize("text,seconds", [("1h30m", 5400.0), ("500ms", 0.5), ("0s", 0.0),
                                          ("1m1s1ms", 61.001)])  # fmt: skip
def test_gateway_api_durations(text: str, seconds: float) -> None:
    assert parse_gateway_duration(text) == seconds


@pytest.mark.parametrize("text", ["1", "1.5s", "1d", "", "123456s", "1h1h1h1h1h", "-1s"])
def test_bad_gateway_api_durations(text: str) -> None:
    with pytest.raises(ValueError, match="is not a Gateway API duration"):
        parse_gateway_duration(text)


def test_retries_are_read_per_protocol_as_linkerd_reads_them() -> None:
    svc = service(notes={W.RETRY_GRPC_ANNOTATION: "internal"})
    assert not http_routes(policy(svc))[0].rules[0].HasField("retry")
    grpc = policy(svc, http_route(kind="GRPCRoute")).protocol.grpc.routes[0].rules[0]
    assert grpc.retry.conditions.internal and grpc.retry.max_retries == 1
    # A route's HTTP-only annotation leaves its gRPC rules to the Service's.
    own = http_route(kind="GRPCRoute", notes={W.RETRY_HTTP_ANNOTATION: "5xx"})
    assert policy(svc, own).protocol.grpc.routes[0].rules[0].retry.conditions.internal


def test_the_webhook_refuses_what_outbound_would_ignore() -> None:
    validate = VALIDATORS[(GW, "HTTPRoute")]
    bad = http_route(notes={W.TIMEOUT_REQUEST_ANNOTATION: "soon"},
                     rules=[{"backendRefs": [{"name": "b", "port": 80, "weight": -2}],
                             "filters": [{"type": "URLRewrite"}]}])  # fmt: skip
    problems = validate(bad)
    assert any(p.startswith("metadata.annotations: timeout.meshlet.io/request") for p in problems)
    assert any(p.startswith("spec.rules[0].backendRefs[0].weight") for p in problems)
    assert any(p.startswith("spec.rules[0].filters[0].type: 'URLRewrite'") for p in problems)
    good = http_route(rules=[{"filters": [{"type": "RequestRedirect",
                                           "requestRedirect": {"statusCode": 301}}]}])  # fmt: skip
    assert validate(good) == []
    inbound = http_route(rules=[{"filters": [{"type": "RequestRedirect", "requestRedirect": {}}]}])
    inbound["spec"]["parentRefs"] = [{"group": "policy.meshlet.io", "kind": "Server", "name": "s"}]
    assert "not supported on inbound routes" in validate(inbound)[0]


@pytest.mark.parametrize(
    "app,kind",
    [("http", "http1"), ("HTTP", "http1"), ("kubernetes.io/h2c", "http2"),
     ("meshlet.io/opaque", "opaque"), ("meshlet.io/tcp", "opaque"), ("example.com/x", "opaque")],
)  # fmt: skip
def test_app_protocols(app: str, kind: str) -> None:
    svc = service(notes={W.OPAQUE_PORTS_ANNOTATION: "80"})  # appProtocol wins over the annotation
    svc["spec"]["ports"][0]["appProtocol"] = app
    p = policy(svc, http_route())
    assert p.protocol.WhichOneof("kind") == kind
    if kind != "opaque":
        assert getattr(p.protocol, kind).routes[0].metadata.resource.name == "r"


def test_grpc_routes_win_on_h2c_but_not_on_http() -> None:
    svc = service()
    svc["spec"]["ports"][0]["appProtocol"] = "kubernetes.io/h2c"
    assert policy(svc, http_route(kind="GRPCRoute")).protocol.HasField("grpc")
    svc["spec"]["ports"][0]["appProtocol"] = "http"
    p = policy(svc, http_route(kind="GRPCRoute"))
    assert p.protocol.http1.routes[0].metadata.default == "http"


def test_consumer_routes_apply_to_their_namespace_s_clients_only() -> None:
    producer = http_route("producer", created="2024-01-02T00:00:00Z")
    consumer = http_route("consumer", created="2024-01-01T00:00:00Z",
                          rules=[{"backendRefs": [{"name": "canary", "port": 80}]}])  # fmt: skip
    consumer["metadata"]["namespace"] = "client"
    consumer["spec"]["parentRefs"][0]["namespace"] = "ns"
    ix = index(service(), producer, consumer)

    def names(client_ns: str) -> list[str]:
        got = ix.get("ns", "web", 80, client_ns)
        assert got is not None
        return [rt.metadata.resource.name for rt in http_routes(got)]

    assert names("client") == ["consumer", "producer"]  # joined, oldest first
    assert names("other") == names("ns") == names("") == ["producer"]
    got = ix.get("ns", "web", 80, "client")
    assert got is not None
    backend = http_routes(got)[0].rules[0].backends.random_available.backends[0].backend
    assert backend.backend.metadata.resource.namespace == "client"  # the route's namespace
    assert backend.filters[0].failure_injector.message == "Service not found canary"
    client, other = Mailbox(), Mailbox()
    assert ix.subscribe("ns", "web", 80, client, "client")
    assert ix.subscribe("ns", "web", 80, other, "other")
    client.take(), other.take()
    ix.apply(Delete(Kind.GATEWAY_HTTP_ROUTE, consumer))
    assert client.take() is not None and other.take() is None


def test_an_event_recomputes_only_the_watches_it_can_change() -> None:
    routed = http_route(rules=[{"backendRefs": [{"name": "b", "port": 80}]}])
    ix = index(service(), service("b"), service("c"), routed)
    for name in ("web", "b", "c"):
        assert ix.subscribe("ns", name, 80, Mailbox())
    assert ix.subscribe("ns", "c", 80, Mailbox(), "client")
    before = ix.recomputed
    ix.apply(Upsert(Kind.SERVICE, service("b", notes={W.RETRY_LIMIT_ANNOTATION: "2"})))
    assert ix.recomputed - before == 2  # b's own watch and web's, which routes to b
    before = ix.recomputed
    ix.apply(Upsert(Kind.SERVICE, service("unrelated")))
    assert ix.recomputed == before
    other = http_route("elsewhere")
    other["metadata"]["namespace"] = "client"
    ix.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, other))
    assert ix.recomputed - before == 1  # only the watch of clients in that namespace
    before = ix.recomputed
    written = {**routed, "status": {"parents": [{"controllerName": W.POLICY_CONTROLLER_NAME}]}}
    written["metadata"] = {**routed["metadata"], "resourceVersion": "9", "generation": 1}
    assert ix.apply(Upsert(Kind.GATEWAY_HTTP_ROUTE, written)) == 0
    assert ix.recomputed == before  # its status written back: it reads the same, nothing to do


def test_cluster_ips_follow_their_service() -> None:
    moved = service()
    moved["spec"]["clusterIP"] = "10.96.0.9"
    ix = index(service())
    ix.apply(Upsert(Kind.SERVICE, moved))
    assert ix.by_ip("10.96.0.1") is None and ix.by_ip("10.96.0.9") is not None
    ix.apply(Delete(Kind.SERVICE, moved))
    assert ix.by_ip("10.96.0.9") is None


def test_the_proxy_s_decoder_takes_every_policy_sent() -> None:
    from meshlet.proxy.discovery.outbound_decode import decode_outbound

    everything = [
        {"matches": [{"path": {"type": "RegularExpression", "value": "/c/[0-9]+"},
                      "headers": [{"name": "x-a", "value": "1"}], "method": "GET",
                      "queryParams": [{"name": "q", "type": "RegularExpression", "value": "a.*"}]}],
         "filters": [
             {"type": "RequestHeaderModifier",
              "requestHeaderModifier": {"set": [{"name": "x-a", "value": "1"}]}},
             {"type": "ResponseHeaderModifier",
              "responseHeaderModifier": {"remove": ["x-b"]}}],
         "backendRefs": [{"name": "web", "port": 80, "weight": 9}, {"name": "gone", "port": 80},
                         {"name": "web"}],
         "timeouts": {"request": "1h30m"}},
        {"filters": [{"type": "RequestRedirect", "requestRedirect": {
            "scheme": "https", "path": {"type": "ReplaceFullPath", "replaceFullPath": "/x"}}}]},
    ]  # fmt: skip
    notes = {W.RETRY_HTTP_ANNOTATION: "5xx,429", W.RETRY_GRPC_ANNOTATION: "unavailable",
             W.RETRY_TIMEOUT_ANNOTATION: "1s", W.TIMEOUT_RESPONSE_ANNOTATION: "5s",
             W.FAILURE_ACCRUAL_ANNOTATION: "consecutive"}  # fmt: skip
    grpc_rules = [{"matches": [{"method": {"service": "a.B", "method": "C"}}],
                   "backendRefs": [{"name": "gone", "port": 80}]}]  # fmt: skip
    h2c = service(notes=notes)
    h2c["spec"]["ports"][0]["appProtocol"] = "kubernetes.io/h2c"
    policies = [
        policy(service()),
        policy(service(notes=notes), http_route(rules=everything)),
        policy(service(notes=notes), http_route(rules=grpc_rules, kind="GRPCRoute")),
        policy(h2c, http_route(rules=everything)),
        policy(service(notes={W.OPAQUE_PORTS_ANNOTATION: "80"})),
    ]
    decoded = [decode_outbound(p) for p in policies]  # raises DecodeError on any problem
    counts = [(len(d.http1), len(d.http2), len(d.grpc), len(d.opaque)) for d in decoded]
    assert counts == [(1, 1, 0, 1), (1, 1, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (0, 0, 0, 1)]
    assert [len(d.backends) for d in decoded] == [1, 4, 1, 3, 1]


def test_a_rule_whose_backends_all_weigh_0_fails_its_requests() -> None:
    from meshlet.proxy.discovery.outbound_decode import decode_outbound

    zero = [{"name": "web", "port": 80, "weight": 0}, {"name": "b", "port": 80, "weight": 0}]
    p = policy(service(), http_route(rules=[{"backendRefs": zero}]))
    (only,) = http_routes(p)[0].rules[0].backends.random_available.backends
    assert only.weight == 1 and only.backend.filters[0].failure_injector.status == 500
    assert "weight 0" in only.backend.filters[0].failure_injector.message
    decode_outbound(p)  # a positive total: the proxy takes it
    some = [{"name": "web", "port": 80, "weight": 0}, {"name": "web", "port": 80}]
    kept = policy(service(), http_route(rules=[{"backendRefs": some}]))
    weights = [b.weight for b in http_routes(kept)[0].rules[0].backends.random_available.backends]
    assert weights == [0, 1]
