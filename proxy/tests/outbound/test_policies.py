"""The followed outbound policies: one stream per target, shared; at most `max_followed`; a
target unused for the idle timeout closed on a later lookup; and where a redirect sends a
request. The streams go to a real (closed) port: each retries in the background until closed."""

from __future__ import annotations

import asyncio

import pytest

from meshlet.api.hostport import HostPort
from meshlet.proxy.core.authz import HttpMatch, PathKind, PathMatch
from meshlet.proxy.core.client_policy import EMPTY, Redirect, Rule
from meshlet.proxy.discovery.outbound_policy import WatchOutbound
from meshlet.proxy.http.contract import Target
from meshlet.proxy.outbound.policies import OutboundPolicies
from meshlet.proxy.outbound.policy_router import location


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def client() -> WatchOutbound:
    return WatchOutbound(HostPort("127.0.0.1", 1), None, None, '{"ns":"shop","pod":"a"}',
                         backoff=(5.0, 5.0))  # fmt: skip


def target(n: int) -> HostPort:
    return HostPort(f"svc-{n}.shop.svc.cluster.local", 80)


async def test_a_target_is_followed_once_and_shared() -> None:
    policies = OutboundPolicies(client(), Clock())
    try:
        first = policies.follow(target(1))
        assert first is not None and first.policy is None  # not answered: routed without it
        assert policies.follow(target(1)) is first
        assert len(policies) == 1
    finally:
        await policies.aclose()
    assert policies.follow(target(2)) is None  # closed: nothing new is followed


async def test_past_the_limit_a_new_target_is_not_followed_until_one_is_idle() -> None:
    clock = Clock()
    policies = OutboundPolicies(client(), clock, max_followed=2, idle_timeout=10.0)
    try:
        assert policies.follow(target(1)) is not None
        clock.now = 4.0
        assert policies.follow(target(2)) is not None
        assert policies.follow(target(3)) is None  # full
        clock.now = 12.0  # target 1 unused for 12 s, target 2 for 8 s
        assert policies.follow(target(3)) is not None
        assert target(1) not in policies and target(2) in policies
    finally:
        await policies.aclose()


async def test_an_idle_target_s_stream_is_closed_on_a_later_lookup() -> None:
    clock = Clock()
    policies = OutboundPolicies(client(), clock, idle_timeout=10.0)
    try:
        policies.follow(target(1))
        task = policies._entries[target(1)].task
        clock.now = 6.0
        policies.follow(target(2))
        assert target(1) in policies  # 6 s: not idle yet
        clock.now = 11.0
        policies.follow(target(2))
        assert target(1) not in policies and target(2) in policies
        await asyncio.sleep(0)
        assert task.cancelled() or task.done()
    finally:
        await policies.aclose()


def test_the_limit_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        OutboundPolicies(client(), Clock(), max_followed=0)


def rule(prefix: str | None = None) -> Rule:
    path = PathMatch(PathKind.PREFIX, prefix) if prefix else None
    return Rule((HttpMatch(path),), (), EMPTY)


@pytest.mark.parametrize(
    ("redirect", "matched", "path", "expected"),
    [
        (Redirect(301, full_path="/new"), None, "/old/a?q=1", "http://api:8080/new?q=1"),
        (Redirect(302, prefix="/v2"), "/v1", "/v1/items", "http://api:8080/v2/items"),
        (Redirect(302, prefix="/"), "/v1", "/v1/items", "http://api:8080/items"),
        (Redirect(301, scheme="https"), None, "/a", "https://api/a"),
        (Redirect(301, host="other", port=9000), None, "/a", "http://other:9000/a"),
    ],
)
def test_where_a_redirect_sends_the_request(
    redirect: Redirect, matched: str | None, path: str, expected: str
) -> None:
    assert location(redirect, rule(matched), Target("api:8080", "GET", path)) == expected


async def test_a_stream_that_fails_settles_the_target_so_no_request_waits_for_a_retry() -> None:
    """The controller unreachable (a closed port): the first failure settles the target (its
    requests stop waiting for a policy and are routed without one) while the stream retries."""
    policies = OutboundPolicies(client(), Clock())
    try:
        followed = policies.follow(target(1))
        assert followed is not None and not followed.settled.is_set()
        await asyncio.wait_for(followed.settled.wait(), timeout=10)
        assert followed.policy is None
    finally:
        await policies.aclose()
