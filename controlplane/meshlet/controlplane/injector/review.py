"""AdmissionReview v1 in and out (pure): parse a review, decide, answer with a patch or none.

A review that cannot be understood is a `ReviewError` (the webhook answers 400 with its reason).
An understood review is always allowed: with the patch when the pod is meshed, without one when
it is skipped, with warnings for anything ignored. A mistake in a pod never blocks it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, NotRequired, TypedDict

from meshlet.controlplane.injector import overrides, owner, rules
from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.model import POD_TEMPLATE_PATHS, Obj, PatchOp
from meshlet.controlplane.injector.patch import Target, patch

API_VERSION: Final = "admission.k8s.io/v1"
MAX_BODY: Final = 1 << 20  # bytes; the API server's own limit on a review is larger
MAX_WARNINGS: Final = 10
MAX_WARNING_CHARS: Final = 240


class ReviewError(ValueError):
    """The body is not an AdmissionReview v1 with a request; the message says what is wrong."""


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class AdmissionRequest(TypedDict):
    uid: str
    kind: GroupVersionKind
    operation: str
    namespace: NotRequired[str]
    name: NotRequired[str]
    object: NotRequired[Obj | None]


class Status(TypedDict):
    """Why a request is refused: the API server shows `message` to whoever applied it."""

    code: int
    reason: str
    message: str


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    status: NotRequired[Status]
    patchType: NotRequired[Literal["JSONPatch"]]
    patch: NotRequired[str]
    warnings: NotRequired[list[str]]


class AdmissionReviewOut(TypedDict):
    apiVersion: str
    kind: Literal["AdmissionReview"]
    response: AdmissionResponse


@dataclass(frozen=True, slots=True)
class Request:
    uid: str
    kind: str
    namespace: str
    operation: str
    obj: Obj | None
    group: str = ""  # of the object's kind; "" is the core group
    dry_run: bool = False  # nothing may be written for it


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer and why, for the response, the metric and the log."""

    patch: tuple[PatchOp, ...]
    skip_reason: str  # "" when meshed; else a rules.Skip value or one of the reasons below
    annotation_at: str  # "workload", "namespace" or "none"
    owner_kind: str
    warnings: tuple[str, ...]


UNSUPPORTED_KIND: Final = "unsupported_kind"
NOT_CREATE: Final = "not_create"
MALFORMED_OBJECT: Final = "malformed_object"


def parse(body: bytes) -> Request:
    if len(body) > MAX_BODY:
        raise ReviewError(f"the review is larger than {MAX_BODY} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReviewError(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise ReviewError("the body is JSON nested too deeply") from None
    if not isinstance(doc, dict):
        raise ReviewError("the body is not a JSON object")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "AdmissionReview":
        raise ReviewError(f"expected an AdmissionReview of apiVersion {API_VERSION}")
    req = doc.get("request")
    if not isinstance(req, dict):
        raise ReviewError("the review has no request")
    uid, kind, operation = req.get("uid"), req.get("kind"), req.get("operation")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("request.uid must be a non-empty string")
    if (
        not isinstance(kind, dict)
        or not isinstance(kind.get("kind"), str)
        or not isinstance(kind.get("group", ""), str)
    ):
        raise ReviewError("request.kind must be a group/version/kind object")
    if not isinstance(operation, str):
        raise ReviewError("request.operation must be a string")
    namespace = req.get("namespace", "")
    if not isinstance(namespace, str):
        raise ReviewError("request.namespace must be a string")
    obj = req.get("object")
    if obj is not None and not isinstance(obj, dict):
        raise ReviewError("request.object must be an object")
    dry_run = req.get("dryRun", False)
    if not isinstance(dry_run, bool):
        raise ReviewError("request.dryRun must be a boolean")
    return Request(uid, kind["kind"], namespace, operation, obj, kind.get("group", ""), dry_run)


def _walk(obj: Obj, path: str) -> Any:
    node: Any = obj
    for part in filter(None, path.split("/")):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{where} must map strings to strings")
    return value


def target(kind: str, obj: Obj, namespace: str) -> Target:
    """The pod template of `obj`; ValueError naming what is malformed."""
    path = POD_TEMPLATE_PATHS[kind]
    template = _walk(obj, path) if path else obj
    if not isinstance(template, dict):
        raise ValueError(f"{path or 'the object'} is not an object")
    metadata = template.get("metadata") or {}
    spec = template.get("spec")
    if not isinstance(metadata, dict) or not isinstance(spec, dict):
        raise ValueError("the pod template needs metadata and spec objects")
    _string_map(metadata.get("annotations"), "metadata.annotations")
    _string_map(metadata.get("labels"), "metadata.labels")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise ValueError("spec.containers must be a list of containers")
    for key in ("initContainers", "volumes"):
        if spec.get(key) is not None and not isinstance(spec[key], list):
            raise ValueError(f"spec.{key} must be a list")
    top = obj.get("metadata")
    top = top if isinstance(top, dict) else {}
    who = owner.of_pod(metadata) if kind == "Pod" else owner.of_workload(kind, top)
    return Target(path, metadata, spec, namespace or str(top.get("namespace") or ""), who)


def admit(
    request: Request, namespace_annotations: Mapping[str, str], config: InjectConfig
) -> Outcome:
    """Decide and build the patch for an understood request."""
    if request.kind not in POD_TEMPLATE_PATHS or request.obj is None:
        return Outcome((), UNSUPPORTED_KIND, "none", "", ())
    if request.operation != "CREATE":
        return Outcome((), NOT_CREATE, "none", "", ())
    try:
        found = target(request.kind, request.obj, request.namespace)
    except ValueError as exc:
        return Outcome((), MALFORMED_OBJECT, "none", "", (f"not meshed: {exc}",))
    owner_kind = found.owner.kind if found.owner is not None else ""
    pod_annotations = found.metadata.get("annotations") or {}
    decision = rules.decide(pod_annotations, namespace_annotations, found.spec)
    at = decision.at.value if decision.at is not None else "none"
    if decision.skip is not None:
        return Outcome((), decision.skip.value, at, owner_kind, decision.messages)
    resolved = overrides.resolve(config.proxy, namespace_annotations, pod_annotations)
    ops, messages = patch(found, config, resolved)
    return Outcome(tuple(ops), "", at, owner_kind, (*decision.messages, *messages))


def allowed(uid: str, ops: tuple[PatchOp, ...] = (), warnings: tuple[str, ...] = ()) -> bytes:
    """The AdmissionReview answering `uid`: allowed, with the patch when there is one."""
    response: AdmissionResponse = {"uid": uid, "allowed": True}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(ops)).encode()).decode()
    if warnings:
        response["warnings"] = [
            w if len(w) <= MAX_WARNING_CHARS else w[: MAX_WARNING_CHARS - 1] + "…"
            for w in warnings[:MAX_WARNINGS]
        ]
    review: AdmissionReviewOut = {
        "apiVersion": API_VERSION,
        "kind": "AdmissionReview",
        "response": response,
    }
    return json.dumps(review).encode()
