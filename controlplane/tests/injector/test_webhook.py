"""The webhook's promise to the API server: an answer in time, whatever the namespace lookup
does (a pod allowed unmeshed, with the reason, rather than a webhook timeout)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.webhook import InjectorMetrics, Webhook
from meshlet_testing.workloads import pod, review


async def answer(webhook: Webhook) -> tuple[dict[str, Any], float]:
    async with TestClient(TestServer(webhook.app())) as client:
        started = time.monotonic()
        response = await client.post("/inject", data=json.dumps(review(pod())))
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body["response"], time.monotonic() - started


async def test_a_namespace_lookup_that_hangs_is_answered_in_time(config: InjectConfig) -> None:
    async def hangs(namespace: str) -> Mapping[str, str]:
        await asyncio.sleep(60)
        return {}

    registry = CollectorRegistry()
    webhook = Webhook(config, hangs, InjectorMetrics(registry), answer_within=0.3)
    got, took = await answer(webhook)
    assert took < 2.0
    assert got["allowed"] is True and "patch" not in got
    assert got["warnings"] == ["not meshed: the injector timed out"]
    assert (
        registry.get_sample_value(
            "proxy_inject_admission_responses_total",
            {"skip": "true", "skip_reason": "timeout", "annotation_at": "none", "owner_kind": ""},
        )
        == 1.0
    )


async def test_an_unexpected_failure_is_allowed_unmeshed_with_the_reason(
    config: InjectConfig,
) -> None:
    async def breaks(namespace: str) -> Mapping[str, str]:
        raise RuntimeError("a bug")

    registry = CollectorRegistry()
    got, _ = await answer(Webhook(config, breaks, InjectorMetrics(registry)))
    assert got["allowed"] is True and "patch" not in got
    assert got["warnings"] == ["not meshed: injector error"]


async def test_a_validator_that_hangs_is_answered_in_time(config: InjectConfig) -> None:
    release = threading.Event()

    def hangs(obj: Mapping[str, Any]) -> list[str]:
        release.wait(10)
        return ["never seen"]

    table = {("meshlet.io", "ServiceProfile"): hangs}
    registry = CollectorRegistry()
    webhook = Webhook(config, None, InjectorMetrics(registry), 0.3, validators=table)
    obj = {"apiVersion": "meshlet.io/v1alpha1", "kind": "ServiceProfile", "metadata": {}}
    try:
        async with TestClient(TestServer(webhook.app())) as client:
            started = time.monotonic()
            response = await client.post("/validate", data=json.dumps(review(obj)))
            took = time.monotonic() - started
            got = (await response.json())["response"]
    finally:
        release.set()
    assert took < 2.0
    assert got["allowed"] is True
    assert got["warnings"] == ["not validated: the validator timed out"]


async def test_a_route_over_the_regex_budget_is_refused_at_once_naming_the_budget(
    config: InjectConfig,
) -> None:
    """One more distinct regex than a policy may hold (meshlet.api.pathregex), each as costly a
    pattern as RE2 takes, in rules the Gateway API allows: refused with the budget named, and
    answered well within the webhook's time (compiling stops at the first refusal)."""
    from meshlet.api.pathregex import MAX_PROGRAM, MAX_REGEXES

    def rule(patterns: list[str]) -> dict[str, Any]:
        return {"matches": [{"path": {"type": "RegularExpression", "value": p}}
                            for p in patterns]}  # fmt: skip

    def httproute(patterns: list[str]) -> dict[str, Any]:
        rules = [rule(patterns[i : i + 64]) for i in range(0, len(patterns), 64)]
        return {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "api", "namespace": "emojivoto"},
            "spec": {"parentRefs": [{"group": "core", "kind": "Service", "name": "api"}],
                     "rules": rules},
        }  # fmt: skip

    webhook = Webhook(config, None, InjectorMetrics(CollectorRegistry()))
    within = [f"/p{n}/[^/]*" for n in range(MAX_REGEXES)]
    many = [f"/[ab]*a[ab]{{40}}(?:z{n:03d})?" for n in range(MAX_REGEXES + 1)]
    large = [r"(?i)\pL\pL" + f"{n}" for n in range(16)]  # 2,400 instructions each
    async with TestClient(TestServer(webhook.app())) as client:
        answers = []
        for obj in (httproute(within), httproute(many), httproute(large)):
            started = time.monotonic()
            response = await client.post("/validate", data=json.dumps(review(obj)))
            answers.append(((await response.json())["response"], time.monotonic() - started))
    (fine, _), (past, took), (costly, _) = answers
    assert fine["allowed"] is True
    assert past["allowed"] is False and took < 2.0
    message = past["status"]["message"]
    assert message.startswith("HTTPRoute emojivoto/api is invalid (1 problem;")
    assert (
        f"spec.rules[2].matches[0].path.value: '/[ab]*a[ab]{{40}}(?:z128)?' is over the regex"
        f" budget: more than {MAX_REGEXES} distinct regexes" in message
    )
    message = costly["status"]["message"]
    assert "is over the regex budget: the regexes compile to" in message
    assert f"of {MAX_PROGRAM} RE2 instructions in all" in message
