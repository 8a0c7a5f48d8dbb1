"""Meshing documents outside the webhook (`meshlet inject`, `meshlet install`): the annotation
alone, or the injector's own patch applied in place."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from meshlet.api import wellknown as wk
from meshlet.controlplane.injector import review
from meshlet.controlplane.injector.config import InjectConfig
from meshlet.controlplane.injector.model import POD_TEMPLATE_PATHS


@dataclass(frozen=True, slots=True)
class Result:
    doc: dict[str, Any]
    changed: bool
    note: str  # what happened, for the summary on stderr


def _name(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f'{str(doc.get("kind", "object")).lower()} "{name or "?"}"'


def _template_metadata(doc: dict[str, Any]) -> dict[str, Any] | None:
    node: Any = doc
    for part in filter(None, POD_TEMPLATE_PATHS[str(doc["kind"])].split("/")):
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return None
    meta = node.setdefault("metadata", {})
    if not isinstance(meta, dict):
        return None
    if not isinstance(meta.get("annotations"), dict):
        meta["annotations"] = {}
    return meta


def injectable(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") in POD_TEMPLATE_PATHS


def annotate(doc: dict[str, Any]) -> Result:
    """Adds `meshlet.io/inject: enabled` to the pod template: the webhook does the rest."""
    out = copy.deepcopy(doc)
    meta = _template_metadata(out)
    if meta is None:
        return Result(doc, False, f"{_name(doc)} skipped: no pod template")
    current = meta["annotations"].get(wk.INJECT_ANNOTATION)
    if current == wk.INJECT_ENABLED:
        return Result(doc, False, f"{_name(doc)} already annotated")
    if current == wk.INJECT_DISABLED:
        return Result(doc, False, f"{_name(doc)} skipped: {wk.INJECT_ANNOTATION} is disabled")
    meta["annotations"][wk.INJECT_ANNOTATION] = wk.INJECT_ENABLED
    return Result(out, True, f"{_name(doc)} annotated")


def manual(doc: dict[str, Any], config: InjectConfig) -> Result:
    """Applies the injector's patch, as the webhook would for this template once annotated."""
    annotated = annotate(doc)
    source = annotated.doc if annotated.changed else doc
    if not annotated.changed and "already annotated" not in annotated.note:
        return annotated
    meta = source.get("metadata")
    namespace = meta.get("namespace") if isinstance(meta, dict) else None
    request = review.Request("manual", str(doc["kind"]), str(namespace or ""), "CREATE", source)
    outcome = review.admit(request, {}, config)
    if not outcome.patch:
        reason = outcome.warnings[0] if outcome.warnings else outcome.skip_reason
        return Result(doc, False, f"{_name(doc)} skipped: {reason}")
    import jsonpatch  # the cli extra's

    meshed: dict[str, Any] = jsonpatch.apply_patch(source, list(outcome.patch))
    return Result(meshed, True, f"{_name(doc)} injected")
