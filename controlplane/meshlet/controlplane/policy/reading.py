"""The reading every policy resource shares: `Check` collects the problems of one object while
its fields are read (each reader answers None on a problem, naming it with its field path and what
to fix), and the parts every kind has: its metadata and references to other objects."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.api.pathregex import Budget

GROUP: Final = wellknown.POLICY_API_GROUP
GATEWAY_GROUP: Final = "gateway.networking.k8s.io"
MAX_LIST: Final = 1024  # identities, networks, refs, overrides, selector terms
MAX_STRING: Final = 4096

DNS_LABEL: Final = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
SUBDOMAIN: Final = re.compile(rf"{DNS_LABEL}(\.{DNS_LABEL})*")
LABEL: Final = re.compile(DNS_LABEL)


@dataclass(frozen=True, slots=True)
class Meta:
    namespace: str
    name: str
    created: str  # metadata.creationTimestamp (RFC 3339, sorts as text); "" when unknown


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to another object: group ("" for the core group), kind, name, namespace."""

    group: str
    kind: str
    name: str
    namespace: str | None = None

    def targets(self, group: str, kind: str) -> bool:
        return self.group == group and self.kind.lower() == kind.lower()


class Invalid(ValueError):
    """An object with problems; `problems` names each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# -- checking --------------------------------------------------------------------------------


class Check:
    """Collects problems while reading an object; each reader returns None on a problem. The
    object's regexes share one budget, as a proxy counts those of a policy (a route alone
    over it could never be served)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.regexes = Budget()

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def mapping(self, value: Any, path: str, *, required: bool = False) -> Mapping[str, Any] | None:
        if value is None:
            if required:
                self.fail(path, "is required")
            return None
        if not isinstance(value, Mapping):
            self.fail(path, f"must be an object, not {type_of(value)}")
            return None
        return value

    def array(
        self, value: Any, path: str, *, required: bool = False, limit: int = MAX_LIST
    ) -> Sequence[Any]:
        if value is None:
            if required:
                self.fail(path, "is required")
            return ()
        if not isinstance(value, list):
            self.fail(path, f"must be a list, not {type_of(value)}")
            return ()
        if len(value) > limit:
            self.fail(path, f"has {len(value)} items; at most {limit} are allowed")
            return ()
        return value

    def string(
        self,
        value: Any,
        path: str,
        *,
        required: bool = False,
        pattern: re.Pattern[str] | None = None,
        what: str = "",
        choices: Sequence[str] = (),
        limit: int = MAX_STRING,
    ) -> str | None:
        if value is None or (required and value == ""):
            if required:
                self.fail(path, "is required")
            return None
        if not isinstance(value, str):
            self.fail(path, f"must be a string, not {type_of(value)}")
            return None
        if len(value) > limit:
            self.fail(path, f"is {len(value)} characters long; at most {limit} are allowed")
            return None
        if choices and value not in choices:
            self.fail(path, f"{value!r} is not one of {', '.join(choices)}")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(path, f"{show(value)} is not {what}")
            return None
        return value

    def integer(
        self, value: Any, path: str, *, low: int, high: int, required: bool = False
    ) -> int | None:
        if value is None:
            if required:
                self.fail(path, "is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, not {type_of(value)}")
            return None
        if not low <= value <= high:
            self.fail(path, f"{value} is not within {low}..{high}")
            return None
        return value


def type_of(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )


def show(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


def read_meta(c: Check, obj: Mapping[str, Any]) -> Meta:
    metadata = c.mapping(obj.get("metadata"), "metadata", required=True) or {}
    name = c.string(
        metadata.get("name"),
        "metadata.name",
        required=True,
        pattern=SUBDOMAIN,
        what="a DNS subdomain name (lower case letters, digits, '-' and '.')",
        limit=253,
    )
    namespace = c.string(
        metadata.get("namespace"),
        "metadata.namespace",
        pattern=LABEL,
        what="a namespace name",
        limit=63,
    )
    created = metadata.get("creationTimestamp")
    return Meta(namespace or "default", name or "", created if isinstance(created, str) else "")


def read_ref(
    c: Check, value: Any, path: str, *, namespaced: bool, default_group: str = ""
) -> Ref | None:
    ref = c.mapping(value, path, required=True)
    if ref is None:
        return None
    group = c.string(ref.get("group"), f"{path}.group", limit=253)
    kind = c.string(ref.get("kind"), f"{path}.kind", required=True, limit=63)
    name = c.string(ref.get("name"), f"{path}.name", required=True, limit=253)
    namespace = None
    if namespaced:
        namespace = c.string(
            ref.get("namespace"),
            f"{path}.namespace",
            pattern=LABEL,
            what="a namespace name",
            limit=63,
        )
    elif ref.get("namespace") is not None:
        c.fail(f"{path}.namespace", "must not be set: the reference is local")
    if kind is None or name is None:
        return None
    group = default_group if group is None else group
    return Ref("" if group == "core" else group, kind, name, namespace)


# -- the kinds -------------------------------------------------------------------------------


def kind_of(ref: Ref) -> str:
    return f"{ref.kind} ({ref.group or 'core'})"
