"""AdmissionReview in and out, hostile input included: malformed reviews are ReviewErrors
(400), anything understood is allowed, with a patch only when a pod is meshed."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector import review
from meshlet.controlplane.injector.config import InjectConfig
from meshlet_testing import schema
from meshlet_testing.workloads import deployment, pod
from meshlet_testing.workloads import review as review_of

ENABLED = {wk.INJECT_ANNOTATION: wk.INJECT_ENABLED}


def answer(doc: Any, config: InjectConfig, ns: dict[str, str] | None = None) -> review.Outcome:
    request = review.parse(json.dumps(doc).encode())
    return review.admit(request, ns or {}, config)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"\x16\x03\x01 not json", "the body is not JSON"),
        (b"[1, 2]", "the body is not a JSON object"),
        (b'{"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}', "expected an"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "has no request"),
        (
            b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": "x"}',
            "has no request",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b" " * (review.MAX_BODY + 1), "larger than 1048576 bytes"),
    ],
)
def test_malformed_reviews(body: bytes, reason: str) -> None:
    with pytest.raises(review.ReviewError, match=reason):
        review.parse(body)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("uid", 5, "request.uid"),
        ("uid", "", "request.uid"),
        ("kind", "Pod", "request.kind"),
        ("operation", None, "request.operation"),
        ("namespace", ["a"], "request.namespace"),
        ("object", "pod", "request.object"),
    ],
)
def test_wrong_types_in_the_request(field: str, value: Any, reason: str) -> None:
    doc = review_of(pod(ENABLED))
    doc["request"][field] = value
    with pytest.raises(review.ReviewError, match=reason):
        review.parse(json.dumps(doc).encode())


def test_a_pod_is_meshed(config: InjectConfig) -> None:
    outcome = answer(review_of(pod(ENABLED)), config)
    assert outcome.skip_reason == "" and outcome.patch
    assert (outcome.annotation_at, outcome.owner_kind) == ("workload", "deployment")


def test_namespace_annotation(config: InjectConfig) -> None:
    outcome = answer(review_of(pod()), config, ENABLED)
    assert outcome.skip_reason == "" and outcome.annotation_at == "namespace"
    assert answer(review_of(pod()), config).skip_reason == "injection_not_enabled"


def test_deployment_pod_template(config: InjectConfig) -> None:
    doc = review_of(deployment(ENABLED))
    outcome = answer(doc, config)
    assert all(op["path"].startswith("/spec/template/") for op in outcome.patch)
    schema.validate(jsonpatch.apply_patch(doc["request"]["object"], list(outcome.patch)))


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (pod(ENABLED, host_network=True), "host_network"),
        ({**pod(ENABLED), "kind": "Service", "apiVersion": "v1"}, "unsupported_kind"),
        (
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {}},
            "unsupported_kind",
        ),
    ],
)
def test_skipped_without_a_patch(obj: dict[str, Any], reason: str, config: InjectConfig) -> None:
    outcome = answer(review_of(obj), config)
    assert (outcome.patch, outcome.skip_reason) == ((), reason)


def test_already_injected_pods_are_never_injected_twice(config: InjectConfig) -> None:
    first = review_of(pod(ENABLED))
    meshed = jsonpatch.apply_patch(first["request"]["object"], list(answer(first, config).patch))
    again = answer(review_of(meshed), config)
    assert (again.patch, again.skip_reason) == ((), "already_injected")


def test_updates_are_not_patched(config: InjectConfig) -> None:
    outcome = answer(review_of(pod(ENABLED), operation="UPDATE"), config)
    assert (outcome.patch, outcome.skip_reason) == ((), "not_create")


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("spec",), "a pod", "the pod template needs metadata and spec objects"),
        (("spec", "containers"), 5, "spec.containers must be a list"),
        (("spec", "containers"), ["web"], "spec.containers must be a list"),
        (("spec", "initContainers"), {"a": 1}, "spec.initContainers must be a list"),
        (("metadata", "annotations"), {wk.INJECT_ANNOTATION: True}, "metadata.annotations"),
        (("metadata", "labels"), ["a"], "metadata.labels"),
    ],
)
def test_malformed_pods_are_allowed_with_a_warning(
    path: tuple[str, ...], value: Any, message: str, config: InjectConfig
) -> None:
    obj = pod(ENABLED)
    node = obj
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    outcome = answer(review_of(obj), config)
    assert (outcome.patch, outcome.skip_reason) == ((), "malformed_object")
    assert message in outcome.warnings[0]


def test_a_thousand_containers(config: InjectConfig) -> None:
    obj = pod(ENABLED)
    obj["spec"]["containers"] = [
        {"name": f"c{i}", "image": "ghcr.io/example/web:1.0"} for i in range(1000)
    ]
    outcome = answer(review_of(obj), config)
    assert len(outcome.patch) < 20  # the patch does not grow with the pod
    meshed = jsonpatch.apply_patch(obj, list(outcome.patch))
    assert len(meshed["spec"]["containers"]) == 1000


def test_junk_port_annotations_are_allowed_with_a_message(config: InjectConfig) -> None:
    obj = pod(
        {
            **ENABLED,
            wk.OPAQUE_PORTS_ANNOTATION: "mysql,-1",
            wk.SKIP_INBOUND_PORTS_ANNOTATION: "1-2-3",
        }
    )
    outcome = answer(review_of(obj), config)
    assert outcome.patch and len(outcome.warnings) == 2
    body = json.loads(review.allowed("uid-1", outcome.patch, outcome.warnings))
    assert body["response"]["warnings"][0].startswith(
        "pod annotation config.meshlet.io/opaque-ports='mysql,-1' ignored"
    )


def test_allowed_response_carries_the_patch() -> None:
    ops = ({"op": "add", "path": "/metadata/labels", "value": {"a": "b"}},)
    body = json.loads(review.allowed("uid-9", ops, ("w",) * 50))  # type: ignore[arg-type]
    response = body["response"]
    assert (body["apiVersion"], body["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    assert (response["uid"], response["allowed"], response["patchType"]) == (
        "uid-9",
        True,
        "JSONPatch",
    )
    assert json.loads(base64.b64decode(response["patch"])) == list(ops)
    assert len(response["warnings"]) == review.MAX_WARNINGS
    plain = json.loads(review.allowed("uid-9"))["response"]
    assert plain == {"uid": "uid-9", "allowed": True}


def test_the_review_is_not_modified(config: InjectConfig) -> None:
    doc = review_of(pod(ENABLED))
    before = copy.deepcopy(doc)
    answer(doc, config)
    assert doc == before
