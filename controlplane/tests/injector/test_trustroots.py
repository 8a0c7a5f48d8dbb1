"""The injector's copies of the trust-roots bundle, against the fake API server."""

from __future__ import annotations

from typing import Any

import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector.trustroots import CACHE_SECONDS, CopyError, TrustRootsCopies
from meshlet_testing.fakeapi import FakeKubeAPI

OLD, NEW = "-----BEGIN CERTIFICATE-----\nold\n", "-----BEGIN CERTIFICATE-----\nnew\n"


def bundle_in(api: FakeKubeAPI, namespace: str) -> str | None:
    copy = api.get("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, namespace)
    return None if copy is None else str(copy["data"][wk.TRUST_ROOTS_KEY])


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_copy_is_made_once_per_burst_and_again_after_its_namespace_is_made_again(
    api: FakeKubeAPI, api_client: Any
) -> None:
    clock = Clock()
    copies = TrustRootsCopies(api_client, clock)
    assert copies.ensure("shop", OLD) and bundle_in(api, "shop") == OLD
    asked = len(api.requests)
    assert not copies.ensure("shop", OLD)  # a burst of pods: remembered, nothing asked
    assert len(api.requests) == asked
    # the namespace deleted and made again: its copy went with it
    api.delete("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, "shop")
    clock.now += CACHE_SECONDS
    assert copies.ensure("shop", OLD) and bundle_in(api, "shop") == OLD


def test_a_new_bundle_reaches_every_copy_and_someone_else_s_configmap_is_left_alone(
    api: FakeKubeAPI, api_client: Any
) -> None:
    copies = TrustRootsCopies(api_client, Clock())
    for namespace in ("shop", "cart"):
        copies.ensure(namespace, OLD)
    assert copies.refresh(OLD + NEW) == 2
    assert bundle_in(api, "shop") == bundle_in(api, "cart") == OLD + NEW
    assert copies.refresh(OLD + NEW) == 0  # nothing to change
    api.apply({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": wk.TRUST_ROOTS_COPY, "namespace": "mine"},
               "data": {"mine": "yes"}})  # fmt: skip
    with pytest.raises(CopyError, match="not meshlet's copy: left alone"):
        copies.ensure("mine", NEW)
    mine = api.get("v1", "ConfigMap", wk.TRUST_ROOTS_COPY, "mine")
    assert mine is not None and mine["data"] == {"mine": "yes"}
