"""The validating webhook's decision: a kind in the table is judged on CREATE and UPDATE and
refused with every problem named; other kinds and operations pass unjudged; the answer stays
bounded whatever the object holds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from meshlet.controlplane.injector import review, validation
from meshlet.controlplane.injector.validators import VALIDATORS
from meshlet_testing.workloads import review as review_of

FQN = "web.emojivoto.svc.cluster.local"


def profile(spec: Any, name: str = FQN) -> dict[str, Any]:
    return {
        "apiVersion": "meshlet.io/v1alpha1",
        "kind": "ServiceProfile",
        "metadata": {"name": name, "namespace": "emojivoto"},
        "spec": spec,
    }


def request(obj: dict[str, Any], operation: str = "CREATE") -> review.Request:
    return review.parse(json.dumps(review_of(obj, operation=operation)).encode())


def test_the_review_carries_the_group_of_the_kind() -> None:
    parsed = request(profile({}))
    assert (parsed.group, parsed.kind) == ("meshlet.io", "ServiceProfile")
    assert (parsed.group, parsed.kind) in VALIDATORS


def test_a_valid_profile_is_allowed() -> None:
    spec = {"routes": [{"name": "GET /", "condition": {"method": "GET", "pathRegex": "/"}}]}
    assert validation.judge(request(profile(spec)), VALIDATORS) == validation.Verdict(
        allowed=True, judged=True, message=""
    )


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_an_invalid_profile_is_refused_naming_every_problem(operation: str) -> None:
    spec = {
        "routes": [{"name": "r", "condition": {"pathRegex": "("}, "timeout": "1x"}],
        "retryBudget": {"ttl": "0s"},
    }
    verdict = validation.judge(request(profile(spec), operation), VALIDATORS)
    assert not verdict.allowed and verdict.judged
    assert verdict.message.startswith(
        f"ServiceProfile emojivoto/{FQN} is invalid (3 problems; fix each and apply it again): "
        "spec.routes[0].condition.pathRegex: invalid regex '('"
    )
    assert "; spec.routes[0].timeout: invalid duration '1x'" in verdict.message
    assert "; spec.retryBudget.ttl: must be from 1s to 60s" in verdict.message


@pytest.mark.parametrize(
    "obj",
    [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}},
        # same kind name, another group: not ours
        {"apiVersion": "linkerd.io/v1alpha2", "kind": "ServiceProfile", "metadata": {}},
    ],
)
def test_kinds_without_a_validator_are_allowed_unjudged(obj: dict[str, Any]) -> None:
    verdict = validation.judge(request(obj), VALIDATORS)
    assert verdict == validation.Verdict(allowed=True, judged=False, message="")


def test_only_create_and_update_are_judged() -> None:
    verdict = validation.judge(request(profile("junk"), "DELETE"), VALIDATORS)
    assert verdict.allowed and not verdict.judged


def test_a_table_entry_is_all_it_takes_to_judge_a_kind() -> None:
    def no_x(obj: Mapping[str, Any]) -> list[str]:
        return ["spec.x: not allowed"] if "x" in (obj.get("spec") or {}) else []

    table = {**VALIDATORS, ("example.meshlet.io", "Widget"): no_x}
    server = {"apiVersion": "example.meshlet.io/v1", "kind": "Widget",
              "metadata": {"name": "web"}, "spec": {"x": 1}}  # fmt: skip
    assert validation.judge(request(server), VALIDATORS).judged is False
    verdict = validation.judge(request(server), table)
    assert verdict.message == (
        "Widget emojivoto/web is invalid (1 problem; fix each and apply it again): "
        "spec.x: not allowed"
    )


def test_the_refusal_is_bounded() -> None:
    many = [f"spec.routes[{i}].name: missing" for i in range(500)] + ["x" * 10_000]
    message = validation.refusal("ServiceProfile a/b", many)
    assert message.startswith("ServiceProfile a/b is invalid (501 problems;")
    assert message.endswith("spec.routes[49].name: missing; and 451 more")
    assert len(validation.refusal("k", ["y" * 10_000])) < 600


def test_the_answer_is_an_admission_review() -> None:
    refused = json.loads(validation.answer("u-1", validation.Verdict(False, True, "bad")))
    assert refused == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": "u-1",
            "allowed": False,
            "status": {"code": 400, "reason": "Invalid", "message": "bad"},
        },
    }
    allowed = json.loads(validation.answer("u-2", validation.Verdict(True, False, "")))
    assert allowed["response"] == {"uid": "u-2", "allowed": True}


def test_a_name_that_cannot_be_shown_is_not_echoed() -> None:
    obj = profile({}, name="a\x1b[31mb")
    assert validation.subject(request(obj)) == "ServiceProfile emojivoto/?"


def test_a_route_filter_that_would_forge_the_client_identity_is_refused_at_apply() -> None:
    """The proxy refuses such a policy too (it keeps the one it had); the user learns here."""
    route = {
        "apiVersion": "policy.meshlet.io/v1beta3",
        "kind": "HTTPRoute",
        "metadata": {"name": "admin", "namespace": "emojivoto"},
        "spec": {
            "parentRefs": [{"group": "policy.meshlet.io", "kind": "Server", "name": "web"}],
            "rules": [{"filters": [{
                "type": "RequestHeaderModifier",
                "requestHeaderModifier": {"set": [{"name": "meshlet-client-id", "value": "x"}]},
            }]}],
        },
    }  # fmt: skip
    verdict = validation.judge(request(route), VALIDATORS)
    assert not verdict.allowed and verdict.judged
    assert verdict.message.startswith("HTTPRoute emojivoto/admin is invalid (1 problem")
    assert "requestHeaderModifier.set[0].name: 'meshlet-client-id' is reserved for the proxy" in (
        verdict.message
    )
    allowed = {**route, "spec": {**route["spec"], "rules": [{"filters": [{  # type: ignore[dict-item]
        "type": "RequestHeaderModifier",
        "requestHeaderModifier": {"set": [{"name": "x-tenant", "value": "blue"}]},
    }]}]}}  # fmt: skip
    assert validation.judge(request(allowed), VALIDATORS).allowed
