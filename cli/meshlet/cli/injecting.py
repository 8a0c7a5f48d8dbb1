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
from meshlet.controlplane.injector.patch import volumes


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


def _template(doc: dict[str, Any]) -> dict[str, Any] | None:
    node: Any = doc
    for part in filter(None, POD_TEMPLATE_PATHS[str(doc["kind"])].split("/")):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


# What the injector adds to a pod template, by name
INJECTED_CONTAINERS = frozenset({wk.INIT_CONTAINER, wk.VALIDATOR_CONTAINER, wk.PROXY_CONTAINER})
INJECTED_VOLUMES = frozenset(volume["name"] for volume in volumes())  # what inject adds


def uninject(doc: dict[str, Any]) -> Result:
    """Takes out what `manual` (or the webhook) put in the pod template: the init and proxy
    containers, their volumes, the injector's labels and annotations, and the inject
    annotation, so that the workload runs unmeshed; the user's own settings stay."""
    out = copy.deepcopy(doc)
    template = _template(out)
    if template is None:
        return Result(doc, False, f"{_name(doc)} skipped: no pod template")
    removed = False
    spec = template.get("spec")
    if isinstance(spec, dict):
        for field, names in (("initContainers", INJECTED_CONTAINERS),
                             ("containers", INJECTED_CONTAINERS),
                             ("volumes", INJECTED_VOLUMES)):  # fmt: skip
            items = spec.get(field)
            if not isinstance(items, list):
                continue
            kept = [i for i in items if not (isinstance(i, dict) and i.get("name") in names)]
            if len(kept) != len(items):
                removed = True
                if kept or field == "containers":
                    spec[field] = kept
                else:
                    del spec[field]
    meta = template.get("metadata")
    if isinstance(meta, dict):
        for field, injected in (("annotations", _injected_annotation),
                                ("labels", _injected_label)):  # fmt: skip
            entries = meta.get(field)
            if isinstance(entries, dict) and any(injected(k, v) for k, v in entries.items()):
                meta[field] = {k: v for k, v in entries.items() if not injected(k, v)}
                if not meta[field]:
                    del meta[field]
                removed = True
    if not removed:
        return Result(doc, False, f"{_name(doc)} not meshed: left as it is")
    return Result(out, True, f"{_name(doc)} uninjected")


def _injected_annotation(key: str, value: Any) -> bool:
    """The injector's own annotations, and `meshlet.io/inject: enabled` (a `disabled` is the
    user's opt-out, kept)."""
    if key == wk.INJECT_ANNOTATION:
        return bool(value == wk.INJECT_ENABLED)
    return key in (wk.PROXY_VERSION_ANNOTATION, wk.TRUST_ROOT_SHA256_ANNOTATION)


def _injected_label(key: str, value: Any) -> bool:
    return key in (wk.CONTROL_PLANE_NS_LABEL, wk.WORKLOAD_NS_LABEL) or key.startswith(
        wk.PROXY_OWNER_LABEL_PREFIX
    )
