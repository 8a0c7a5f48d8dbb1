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
