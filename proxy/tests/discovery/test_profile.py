"""Profiles as the control plane encodes them, decoded into typed values."""

from __future__ import annotations

import ipaddress

import pytest

from meshlet.api import addr, destination_pb2
from meshlet.controlplane.destination.profiles import default_profile, profile_from_spec
from meshlet.proxy.core.endpoints import Hint
from meshlet.proxy.discovery.decode import DecodeError
from meshlet.proxy.discovery.profile import (
    DEFAULT_RETRY_BUDGET,
    UNKNOWN,
    AllOf,
    AnyOf,
    DstOverride,
    Method,
    Not,
    PathRegex,
    Profile,
    ResponseClass,
    RetryBudgetSpec,
    Route,
    StatusRange,
    decode_profile,
)

FQN = "web.emojivoto.svc.cluster.local"
SPEC = {
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
            "condition": {"any": [{"pathRegex": "/api/vote"}, {"not": {"method": "PURGE"}}]},
            "responseClasses": [{"condition": {"status": {"min": 429}}}],
        },
    ],
    "retryBudget": {"retryRatio": 0.5, "minRetriesPerSecond": 3, "ttl": "1.5s"},
    "dstOverrides": [
        {"authority": "web-v2.emojivoto.svc.cluster.local:80", "weight": "500m"},
        {"authority": "web-v1.emojivoto.svc.cluster.local:80", "weight": 1},
    ],
}


def test_a_service_profile_decodes_route_by_route() -> None:
    profile = decode_profile(profile_from_spec(SPEC, fqn=FQN))
    assert profile == Profile(
        fqn=FQN,
        dst_overrides=(
            DstOverride("web-v2.emojivoto.svc.cluster.local:80", 5000),
            DstOverride("web-v1.emojivoto.svc.cluster.local:80", 10000),
        ),
        retry_budget=RetryBudgetSpec(0.5, 3, 1.5),
        routes=(
            Route(
                condition=AllOf((Method("GET"), PathRegex("/api/list"))),
                response_classes=(ResponseClass(StatusRange(500, 599), True),),
                labels=(("route", "GET /api/list"),),
                retryable=True,
                timeout=pytest.approx(0.3),  # type: ignore[arg-type]
            ),
            Route(
                condition=AnyOf((PathRegex("/api/vote"), Not(Method("PURGE")))),
                response_classes=(ResponseClass(StatusRange(429, 429), False),),
                labels=(("route", "vote"),),
                retryable=False,
                timeout=None,
            ),
        ),
    )
    [override, _] = profile.dst_overrides
    assert override.authority.startswith("web-v2") and override.weight == 5000  # a named pair


def test_the_default_profile() -> None:
    profile = decode_profile(default_profile(FQN, opaque=True))
    assert profile == Profile(fqn=FQN, opaque=True)
    assert profile.retry_budget == DEFAULT_RETRY_BUDGET
    assert decode_profile(destination_pb2.DestinationProfile()) == UNKNOWN


def test_a_pod_profile_carries_its_endpoint() -> None:
    msg = destination_pb2.DestinationProfile()
    msg.endpoint.addr.CopyFrom(addr.tcp_to_proto(ipaddress.ip_address("10.0.0.1"), 8080))
    msg.endpoint.tls_identity.dns_like_identity.name = "web.emojivoto.serviceaccount.identity.x"
    msg.endpoint.protocol_hint.h2.SetInParent()
    endpoint = decode_profile(msg).endpoint
    assert endpoint is not None
    assert endpoint.addr == ("10.0.0.1", 8080)
    assert endpoint.hint is Hint.H2
    assert endpoint.identity is not None


def test_a_broken_endpoint_rejects_the_profile() -> None:
    msg = destination_pb2.DestinationProfile()
    msg.endpoint.addr.CopyFrom(addr.tcp_to_proto(ipaddress.ip_address("10.0.0.1"), 8080))
    msg.endpoint.tls_identity.SetInParent()  # an identity naming nothing
    with pytest.raises(DecodeError, match="tls_identity"):
        decode_profile(msg)


def test_broken_routes_and_overrides_are_left_out_and_named() -> None:
    msg = profile_from_spec(SPEC, fqn=FQN)
    msg.routes.add(is_retryable=True)  # no condition
    msg.routes.add().condition.all.matches.add()  # an empty match inside
    msg.dst_overrides.add(weight=1)  # no authority
    profile = decode_profile(msg)
    assert len(profile.routes) == 2
    assert len(profile.dst_overrides) == 2
    assert profile.rejected == (
        "routes[2]: route without condition",
        "routes[3]: request match with no condition",
        "dst_overrides[2]: no authority",
    )


def test_deep_nesting_is_refused() -> None:
    msg = destination_pb2.DestinationProfile(fully_qualified_name=FQN)
    match = msg.routes.add().condition
    for _ in range(40):
        match = getattr(match, "not")
    match.path.regex = "/"
    [reason] = decode_profile(msg).rejected
    assert "deeper than 16" in reason


def test_routes_past_the_regex_budget_are_left_out_and_named() -> None:
    """The routes' regexes share a policy's budget (meshlet.api.pathregex): the routes within
    it are kept in order, the rest named; a method-only route needs none of it."""
    from meshlet.api.pathregex import MAX_REGEXES

    msg = destination_pb2.DestinationProfile(fully_qualified_name=FQN)
    for n in range(MAX_REGEXES + 2):
        msg.routes.add(metrics_labels={"route": f"r{n}"}).condition.path.regex = f"/r{n}/.*"
    msg.routes.add(metrics_labels={"route": "gets"}).condition.method.registered = 0
    profile = decode_profile(msg)
    assert [dict(r.labels)["route"] for r in profile.routes] == [
        *(f"r{n}" for n in range(MAX_REGEXES)), "gets"]  # fmt: skip
    assert profile.rejected[0].startswith(f"routes[{MAX_REGEXES}]: path regex '/r{MAX_REGEXES}/")
    assert f"more than {MAX_REGEXES} distinct regexes" in profile.rejected[0]
    assert "refused already" in profile.rejected[1]
