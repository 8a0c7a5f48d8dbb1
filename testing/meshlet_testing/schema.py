"""Validates Kubernetes documents against the 1.33 OpenAPI schemas (strict: unknown fields are
errors), as `kubectl apply --validate=strict` would on the clusters meshlet supports."""

from __future__ import annotations

from typing import Any, Final

import kubernetes_validate

KUBERNETES_VERSION: Final = "1.33"
# Instances of our own CRDs have no schema in the Kubernetes set.
CUSTOM_GROUPS: Final = ("meshlet.io/",)


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
