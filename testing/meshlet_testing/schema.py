"""Validates Kubernetes documents against the 1.33 OpenAPI schemas (strict: unknown fields are
errors), as `kubectl apply --validate=strict` would on the clusters meshlet supports."""

from __future__ import annotations

from typing import Any, Final

import jsonschema  # type: ignore[import-untyped]  # kubernetes-validate's own validator
import kubernetes_validate

KUBERNETES_VERSION: Final = "1.33"
# Instances of our own CRDs have no schema in the Kubernetes set.
CUSTOM_GROUPS: Final = ("meshlet.io/", "policy.meshlet.io/")


def validate(doc: dict[str, Any]) -> None:
    """Raises AssertionError naming the document, the field and the problem."""
    if str(doc.get("apiVersion", "")).startswith(CUSTOM_GROUPS):
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        raise AssertionError(f"{name}: {where}: {exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise AssertionError(exc.message) from None


# --- our own kinds: their CRDs' schemas ---------------------------------------------------------

_JUNCTORS: Final = ("allOf", "anyOf", "oneOf", "not")
_NOT_IN_JUNCTORS: Final = ("description", "type", "default", "additionalProperties", "nullable")
_INT_OR_STRING: Final = [{"type": "integer"}, {"type": "string"}]


def structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """Why an openAPIV3Schema is not structural, as the API server's rules say: every node has a
    type (or is int-or-string or preserves unknown fields), arrays have items, junctors only
    restrict fields declared outside them and set no type, description, default, nullable or
    additionalProperties (save int-or-string's `anyOf: [integer, string]`)."""
    found: list[str] = []
    where = path or "<root>"
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if int_or_string and "type" in node:
        found.append(f"{where}: x-kubernetes-int-or-string with a type")
    if (
        not node.get("type")
        and not int_or_string
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        found.append(f"{where}: no type")
    if node.get("type") == "array" and not isinstance(node.get("items"), dict):
        found.append(f"{where}: an array without items")
    if "properties" in node and "additionalProperties" in node:
        found.append(f"{where}: both properties and additionalProperties")
    for name, sub in (node.get("properties") or {}).items():
        found += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found += structural_problems(node[key], f"{path}.{key}")
    for junctor in _JUNCTORS:
        branches = node.get(junctor)
        if branches is None:
            continue
        if junctor == "anyOf" and int_or_string and branches == _INT_OR_STRING:
            continue
        for i, branch in enumerate(branches if isinstance(branches, list) else [branches]):
            found += _junctor_problems(node, branch, f"{where}.{junctor}[{i}]")
    return found


def _junctor_problems(outside: dict[str, Any], branch: dict[str, Any], where: str) -> list[str]:
    found = [f"{where}: sets {key}" for key in _NOT_IN_JUNCTORS if key in branch]
    declared = outside.get("properties") or {}
    for name, sub in (branch.get("properties") or {}).items():
        if name not in declared:
            found.append(f"{where}: {name} is not declared outside the junctor")
        else:
            found += _junctor_problems(declared[name], sub, f"{where}.{name}")
    if isinstance(branch.get("items"), dict):
        found += _junctor_problems(outside.get("items") or {}, branch["items"], f"{where}.items")
    return found


def crd_errors(crd: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """Where `doc` breaks the openAPIV3Schema of its version in `crd` ([] when it is valid).

    The JSON-schema rules only: x-kubernetes-validations (CEL) are not evaluated."""
    version = str(doc.get("apiVersion", "")).rpartition("/")[2]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    validator = jsonschema.Draft4Validator(served["schema"]["openAPIV3Schema"])
    return sorted(
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(doc)
    )
