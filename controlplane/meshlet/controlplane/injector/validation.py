"""The validating webhook's decision (pure): judge the object of a review with its kind's
validator, and answer with every problem and what to do about it.

Only CREATE and UPDATE carry an object to judge; anything else, and any kind without a
validator, is allowed (the webhook's rules send only meshlet's kinds; judging others is not
ours). A refusal names the object and lists its problems, at most `MAX_PROBLEMS` of them, with
a count of the rest, so the answer stays small whatever the object holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from meshlet.controlplane.injector.review import (
    API_VERSION,
    AdmissionResponse,
    AdmissionReviewOut,
    Request,
)
from meshlet.controlplane.injector.validators import Validator

JUDGED_OPERATIONS: Final = frozenset({"CREATE", "UPDATE"})
MAX_PROBLEMS: Final = 50
MAX_PROBLEM_CHARS: Final = 400
REFUSED_CODE: Final = 400  # as Linkerd's validators answer


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    judged: bool  # False: no validator for this kind or nothing to judge
    message: str  # "" when allowed


def subject(request: Request) -> str:
    """`ServiceProfile emojivoto/web.emojivoto.svc.cluster.local`, as far as the review says."""
    metadata = request.obj.get("metadata") if request.obj is not None else None
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    where = f"{request.namespace}/" if request.namespace else ""
    shown = name if isinstance(name, str) and name.isprintable() and len(name) <= 253 else "?"
    return f"{request.kind} {where}{shown}"


def refusal(what: str, problems: list[str]) -> str:
    count = f"{len(problems)} problem" + ("" if len(problems) == 1 else "s")
    shown = [_bounded(p) for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        shown.append(f"and {len(problems) - MAX_PROBLEMS} more")
    return f"{what} is invalid ({count}; fix each and apply it again): " + "; ".join(shown)


def judge(request: Request, validators: Mapping[tuple[str, str], Validator]) -> Verdict:
    validator = validators.get((request.group, request.kind))
    if validator is None or request.obj is None or request.operation not in JUDGED_OPERATIONS:
        return Verdict(allowed=True, judged=False, message="")
    problems = validator(request.obj)
    if not problems:
        return Verdict(allowed=True, judged=True, message="")
    return Verdict(allowed=False, judged=True, message=refusal(subject(request), problems))


def answer(uid: str, verdict: Verdict, warnings: tuple[str, ...] = ()) -> bytes:
    """The AdmissionReview answering `uid` with `verdict`."""
    response: AdmissionResponse = {"uid": uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {"code": REFUSED_CODE, "reason": "Invalid", "message": verdict.message}
    if warnings:
        response["warnings"] = list(warnings)
    review: AdmissionReviewOut = {
        "apiVersion": API_VERSION,
        "kind": "AdmissionReview",
        "response": response,
    }
    return json.dumps(review).encode()


def _bounded(problem: str) -> str:
    return problem if len(problem) <= MAX_PROBLEM_CHARS else problem[: MAX_PROBLEM_CHARS - 1] + "…"
