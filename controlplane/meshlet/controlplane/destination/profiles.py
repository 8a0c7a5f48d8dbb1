"""Translating a ServiceProfile spec into a `DestinationProfile` message (pure).

The spec (CRD `meshlet.io/v1alpha1`) is shaped exactly like Linkerd's `linkerd.io/v1alpha2`
ServiceProfile, and the translation follows linkerd2's `profile_translator.go`:

- A condition with several fields set is their conjunction, in Linkerd's order (`all`, `any`,
  `method`, `not`, `pathRegex`; for responses `all`, `any`, `not`, `status`).
- Methods are case-sensitive: `GET` is registered, `get` is sent as `unregistered`.
- Every route gets `metrics_labels = {"route": <name>}`.
- A dst override's weight is a Kubernetes quantity scaled so that 1 is 10000 (the contract's
  100 %): `1`, `"1"`, `"1000m"` → 10000, `"500m"`, `0.5` → 5000, rounded up to a whole unit as
  Kubernetes rounds `MilliValue()`. Linkerd sends the milli-value (1 → 1000); weights are
  relative, so the split is the same.
- An authority without a port gets the port of the lookup when `port` is given (Linkerd does
  the same); without it the proxy's `Get` applies its default, 80.
- A status range with one bound is sent with both bounds equal (what the contract says a missing
  bound means), so no consumer has to know that rule.
- An absent or zero timeout leaves `timeout` unset: no timeout.
- The retry budget is checked against the ranges linkerd2-proxy accepts (ratio 0-1000, ttl
  1s-60s); a missing field takes the default (0.2, 10/s, 10 s).

Nothing is partially accepted: any problem raises `ProfileError` naming every problem with its
path, and `profile_or_default` turns that into the default profile plus the error text. Regexes are
checked with RE2, the proxies' engine, whose syntax is linkerd2-proxy's (Rust `regex`): no
look-around and no back-references, so a pattern accepted here is one every proxy can use.

`problems` judges a whole ServiceProfile object with the same code (its name as Linkerd's
sp-validator checks it, a DNS-1123 subdomain, and its spec as served), so the validating webhook
refuses exactly what the destination would refuse to serve.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final, Generic, TypeVar

from google.protobuf import duration_pb2

from meshlet.api import destination_pb2, http_types_pb2
from meshlet.api.hostport import format_hostport
from meshlet.api.pathregex import Budget, NotCompiled, PolicyTooCostly

DEFAULT_RETRY_RATIO: Final = 0.2
DEFAULT_MIN_RETRIES_PER_SECOND: Final = 10
DEFAULT_TTL_NS: Final = 10 * 1_000_000_000
WEIGHT_OF_ONE: Final = 10_000  # the weight sent for a quantity of 1
MAX_WEIGHT: Final = 2**32 - 1
MAX_RETRY_RATIO: Final = 1000.0
TTL_RANGE_NS: Final = (1_000_000_000, 60 * 1_000_000_000)
MAX_NESTING: Final = 16  # all/any/not levels inside one condition
MAX_DURATION_TEXT: Final = 64
MAX_QUANTITY_TEXT: Final = 64
MAX_AUTHORITY: Final = 253 + 6  # a DNS name and ":65535"
MAX_NAME: Final = 253

_NS_PER_S: Final = 1_000_000_000
_MAX_DURATION_NS: Final = 2**63 - 1  # Go's time.Duration
_DURATION_UNITS_NS: Final[Mapping[str, int]] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek small letter mu
    "ms": 1_000_000,
    "s": _NS_PER_S,
    "m": 60 * _NS_PER_S,
    "h": 3600 * _NS_PER_S,
}
_DURATION_PART: Final = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")
_QUANTITY: Final = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(m?)")
_DNS_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN: Final = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 method token
_REGISTERED_METHODS: Final[Mapping[str, http_types_pb2.HttpMethod.Registered.ValueType]] = {
    "GET": http_types_pb2.HttpMethod.GET,
    "POST": http_types_pb2.HttpMethod.POST,
    "PUT": http_types_pb2.HttpMethod.PUT,
    "DELETE": http_types_pb2.HttpMethod.DELETE,
    "PATCH": http_types_pb2.HttpMethod.PATCH,
    "OPTIONS": http_types_pb2.HttpMethod.OPTIONS,
    "CONNECT": http_types_pb2.HttpMethod.CONNECT,
    "HEAD": http_types_pb2.HttpMethod.HEAD,
    "TRACE": http_types_pb2.HttpMethod.TRACE,
}

_SPEC_KEYS: Final = ("routes", "retryBudget", "dstOverrides")
_ROUTE_KEYS: Final = ("name", "condition", "responseClasses", "isRetryable", "timeout")
_RESPONSE_CLASS_KEYS: Final = ("condition", "isFailure")
_BUDGET_KEYS: Final = ("retryRatio", "minRetriesPerSecond", "ttl")
_DST_KEYS: Final = ("authority", "weight")
_STATUS_KEYS: Final = ("min", "max")

_M = TypeVar("_M", destination_pb2.RequestMatch, destination_pb2.ResponseMatch)


class ProfileError(ValueError):
    """A ServiceProfile spec that cannot be served; `problems` holds each `path: what is wrong`."""

    def __init__(self, fqn: str, problems: Sequence[str]) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        subject = f"ServiceProfile for {fqn}" if fqn else "ServiceProfile"
        count = f"{len(self.problems)} problem" + ("" if len(self.problems) == 1 else "s")
        super().__init__(f"invalid {subject} ({count}): " + "; ".join(self.problems))


# --- public API ----------------------------------------------------------------------------------


def default_profile(fqn: str = "", *, opaque: bool = False) -> destination_pb2.DestinationProfile:
    """The profile of a destination without a (valid) ServiceProfile: no routes, default budget."""
    return destination_pb2.DestinationProfile(
        fully_qualified_name=fqn, opaque_protocol=opaque, retry_budget=_default_retry_budget()
    )


def profile_from_spec(
    spec: object, *, fqn: str, opaque: bool = False, port: int | None = None
) -> destination_pb2.DestinationProfile:
    """The profile for a ServiceProfile `spec`; raises `ProfileError` listing every problem.

    `port` is the port of the lookup, appended to dst override authorities that have none.
    """
    problems: list[str] = []
    profile = default_profile(fqn, opaque=opaque)
    fields = _fields(spec, "spec", _SPEC_KEYS, problems)
    if fields is not None:
        # the routes' regexes share one budget, as the proxy counts them (meshlet.api.pathregex)
        regexes = Budget()
        request = _Grammar(
            destination_pb2.RequestMatch,
            {"method": _method, "pathRegex": functools.partial(_path_regex, regexes=regexes)},
        )
        for i, item in enumerate(_list(fields.get("routes"), "spec.routes", problems)):
            route = _route(item, f"spec.routes[{i}]", request, problems)
            if route is not None:
                profile.routes.append(route)
        budget = fields.get("retryBudget")
        if budget is not None:
            profile.retry_budget.CopyFrom(_retry_budget(budget, "spec.retryBudget", problems))
        for i, item in enumerate(_list(fields.get("dstOverrides"), "spec.dstOverrides", problems)):
            dst = _dst_override(item, f"spec.dstOverrides[{i}]", port, problems)
            if dst is not None:
                profile.dst_overrides.append(dst)
    if problems:
        raise ProfileError(fqn, problems)
    return profile


def profile_or_default(
    spec: object, *, fqn: str, opaque: bool = False, port: int | None = None
) -> tuple[destination_pb2.DestinationProfile, str | None]:
    """`profile_from_spec`, or the default profile and the error text when the spec is invalid."""
    try:
        return profile_from_spec(spec, fqn=fqn, opaque=opaque, port=port), None
    except ProfileError as e:
        return default_profile(fqn, opaque=opaque), str(e)


def problems(obj: Mapping[str, object]) -> list[str]:
    """Every problem of a ServiceProfile object (`path: what is wrong`); [] when it can be served.

    The name must be the FQDN of the service it describes, so a DNS-1123 subdomain
    (`web.emojivoto.svc.cluster.local`); the spec is read by `profile_from_spec`. Never raises.
    """
    found: list[str] = []
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        found.append("metadata.name: missing (name the profile after its service's FQDN)")
    elif len(name) > MAX_NAME or _DNS1123_SUBDOMAIN.fullmatch(name) is None:
        found.append(
            f"metadata.name: {_show(name)} is not a DNS-1123 subdomain (lower-case letters, digits,"
            f" '-' and '.', at most {MAX_NAME} characters), such as web.emojivoto.svc.cluster.local"
        )
    fqn = name if isinstance(name, str) else ""
    try:
        profile_from_spec(obj.get("spec"), fqn=fqn)
    except ProfileError as e:
        found.extend(e.problems)
    return found


def parse_duration_ns(text: str) -> int:
    """A Go duration string (`300ms`, `1h2m3.5s`, `-1.5s`, `0`) in whole nanoseconds.

    Follows Go's `time.ParseDuration`: decimal numbers each with a unit (ns, us, µs, ms, s, m, h),
    an optional sign, fractions truncated to the nanosecond, at most about 292 years.
    """
    if len(text) > MAX_DURATION_TEXT:
        raise ValueError(f"duration is longer than {MAX_DURATION_TEXT} characters")
    rest = text
    negative = rest[:1] == "-"
    if rest[:1] in ("-", "+"):
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"invalid duration {text!r}: expected a number and a unit, like '300ms'")
    total = Fraction(0)
    while rest:
        match = _DURATION_PART.match(rest)
        assert match is not None  # every group is optional
        whole, frac, unit = match.groups()
        if not whole and not frac:
            raise ValueError(f"invalid duration {text!r}: expected a number at {rest!r}")
        if not unit:
            raise ValueError(f"invalid duration {text!r}: missing unit (ns, us, ms, s, m, h)")
        if unit not in _DURATION_UNITS_NS:
            raise ValueError(
                f"invalid duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s, m, h)"
            )
        total += Fraction(f"{whole or '0'}.{frac or '0'}") * _DURATION_UNITS_NS[unit]
        rest = rest[match.end() :]
    ns = math.floor(total)
    if ns > _MAX_DURATION_NS:
        raise ValueError(f"invalid duration {text!r}: longer than Go's maximum (about 292 years)")
    return -ns if negative else ns


def parse_duration(text: str) -> float:
    """A Go duration string in seconds; see `parse_duration_ns`."""
    return parse_duration_ns(text) / _NS_PER_S


def parse_quantity(value: object) -> Fraction:
    """A Kubernetes quantity limited to what a weight needs: `1`, `"0.5"`, `"500m"`, `2.5`.

    Other suffixes (`k`, `Ki`, `u`, exponents) are rejected: they make no sense for a weight.
    """
    if isinstance(value, bool):
        raise ValueError("expected a quantity like 1 or '500m', got a boolean")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return Fraction(repr(value))  # the shortest decimal that reads back as `value`
    if not isinstance(value, str):
        raise ValueError(f"expected a quantity like 1 or '500m', got {_kind(value)}")
    if len(value) > MAX_QUANTITY_TEXT:
        raise ValueError(f"quantity is longer than {MAX_QUANTITY_TEXT} characters")
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(
            f"invalid quantity {_show(value)}: expected a decimal number with an optional 'm' "
            "(milli) suffix, like 1, 0.5 or 500m"
        )
    sign, number, milli = match.groups()
    quantity = Fraction(number if not number.endswith(".") else number + "0")
    if milli:
        quantity /= 1000
    return -quantity if sign == "-" else quantity


# --- spec sections -------------------------------------------------------------------------------


def _route(
    value: object,
    path: str,
    request: _Grammar[destination_pb2.RequestMatch],
    problems: list[str],
) -> destination_pb2.Route | None:
    fields = _fields(value, path, _ROUTE_KEYS, problems)
    if fields is None:
        return None
    before = len(problems)
    name = fields.get("name")
    if name is None:
        problems.append(f"{path}.name: missing (every route needs a name, its metrics label)")
    elif not isinstance(name, str) or not name:
        problems.append(f"{path}.name: expected a non-empty string, got {_show(name)}")
    condition = _required_match(fields, path, request, problems)
    classes: list[destination_pb2.ResponseClass] = []
    for i, item in enumerate(
        _list(fields.get("responseClasses"), f"{path}.responseClasses", problems)
    ):
        response_class = _response_class(item, f"{path}.responseClasses[{i}]", problems)
        if response_class is not None:
            classes.append(response_class)
    retryable = _bool(fields.get("isRetryable"), f"{path}.isRetryable", problems)
    timeout = _duration_field(fields.get("timeout"), f"{path}.timeout", problems)
    if len(problems) > before or condition is None or not isinstance(name, str):
        return None
    route = destination_pb2.Route(
        condition=condition,
        response_classes=classes,
        metrics_labels={"route": name},
        is_retryable=retryable,
    )
    if timeout:
        route.timeout.CopyFrom(_duration(timeout))
    return route


def _response_class(
    value: object, path: str, problems: list[str]
) -> destination_pb2.ResponseClass | None:
    fields = _fields(value, path, _RESPONSE_CLASS_KEYS, problems)
    if fields is None:
        return None
    condition = _required_match(fields, path, _RESPONSE, problems)
    failure = _bool(fields.get("isFailure"), f"{path}.isFailure", problems)
    if condition is None:
        return None
    return destination_pb2.ResponseClass(condition=condition, is_failure=failure)


def _retry_budget(value: object, path: str, problems: list[str]) -> destination_pb2.RetryBudget:
    budget = _default_retry_budget()
    fields = _fields(value, path, _BUDGET_KEYS, problems)
    if fields is None:
        return budget
    ratio = fields.get("retryRatio")
    if ratio is not None:
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, int | float)
            or not 0 <= ratio <= MAX_RETRY_RATIO
        ):
            problems.append(
                f"{path}.retryRatio: expected a number from 0 to {MAX_RETRY_RATIO:g}, "
                f"got {_show(ratio)}"
            )
        else:
            budget.retry_ratio = float(ratio)
    minimum = fields.get("minRetriesPerSecond")
    if minimum is not None:
        if (
            isinstance(minimum, bool)
            or not isinstance(minimum, int)
            or not 0 <= minimum <= 2**32 - 1
        ):
            problems.append(
                f"{path}.minRetriesPerSecond: expected an integer from 0 to {2**32 - 1}, "
                f"got {_show(minimum)}"
            )
        else:
            budget.min_retries_per_second = minimum
    ttl = _duration_field(fields.get("ttl"), f"{path}.ttl", problems)
    if ttl is not None:
        low, high = TTL_RANGE_NS
        if not low <= ttl <= high:
            problems.append(f"{path}.ttl: must be from 1s to 60s, got {_show(fields['ttl'])}")
        else:
            budget.ttl.CopyFrom(_duration(ttl))
    return budget


def _default_retry_budget() -> destination_pb2.RetryBudget:
    return destination_pb2.RetryBudget(
        retry_ratio=DEFAULT_RETRY_RATIO,
        min_retries_per_second=DEFAULT_MIN_RETRIES_PER_SECOND,
        ttl=_duration(DEFAULT_TTL_NS),
    )


def _dst_override(
    value: object, path: str, port: int | None, problems: list[str]
) -> destination_pb2.WeightedDst | None:
    fields = _fields(value, path, _DST_KEYS, problems)
    if fields is None:
        return None
    authority = fields.get("authority")
    if authority is None:
        problems.append(f"{path}.authority: missing (name the service to send traffic to)")
    elif (
        not isinstance(authority, str)
        or not authority
        or len(authority) > MAX_AUTHORITY
        or not authority.isprintable()
        or any(c.isspace() for c in authority)
    ):
        problems.append(
            f"{path}.authority: expected a host[:port] without spaces, at most {MAX_AUTHORITY} "
            f"characters, got {_show(authority)}"
        )
        authority = None
    weight = _weight(fields.get("weight"), f"{path}.weight", problems)
    if not isinstance(authority, str) or weight is None:
        return None
    if port is not None and not _has_port(authority):
        authority = format_hostport(authority, port)  # a bare IPv6 address is bracketed
    return destination_pb2.WeightedDst(authority=authority, weight=weight)


def _weight(value: object, path: str, problems: list[str]) -> int | None:
    if value is None:
        problems.append(f"{path}: missing (give a relative weight such as 1 or '500m')")
        return None
    try:
        quantity = parse_quantity(value)
    except ValueError as e:
        problems.append(f"{path}: {e}")
        return None
    if quantity < 0:
        problems.append(f"{path}: must not be negative, got {_show(value)}")
        return None
    weight = math.ceil(quantity * WEIGHT_OF_ONE)
    if weight > MAX_WEIGHT:
        problems.append(
            f"{path}: too large, got {_show(value)} (at most {MAX_WEIGHT / WEIGHT_OF_ONE})"
        )
        return None
    return weight


# --- conditions ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Grammar(Generic[_M]):
    """What a condition may hold: `all`, `any`, `not` of itself, and these leaves."""

    kind: type[_M]
    leaves: Mapping[str, Callable[[object, str, list[str]], _M | None]]

    @property
    def keys(self) -> tuple[str, ...]:
        return ("all", "any", *sorted([*self.leaves, "not"]))  # Linkerd's order


def _required_match(
    fields: Mapping[str, object], path: str, grammar: _Grammar[_M], problems: list[str]
) -> _M | None:
    value = fields.get("condition")
    if value is None:
        problems.append(f"{path}.condition: missing (set one of {', '.join(grammar.keys)})")
        return None
    return _match(value, f"{path}.condition", grammar, problems, depth=0)


def _match(
    value: object, path: str, grammar: _Grammar[_M], problems: list[str], depth: int
) -> _M | None:
    """A condition: several fields at once mean all of them, as in Linkerd."""
    if depth > MAX_NESTING:
        problems.append(f"{path}: conditions nested deeper than {MAX_NESTING} levels")
        return None
    fields = _fields(value, path, grammar.keys, problems)
    if fields is None:
        return None
    present = [key for key in grammar.keys if fields.get(key) is not None]
    if not present:
        if all(key in grammar.keys for key in fields):  # else reported as unknown fields
            problems.append(f"{path}: empty condition (set one of {', '.join(grammar.keys)})")
        return None
    parts: list[_M | None] = []
    for key in present:
        sub = f"{path}.{key}"
        if key in ("all", "any"):
            items = [
                _match(item, f"{sub}[{i}]", grammar, problems, depth + 1)
                for i, item in enumerate(_list(fields[key], sub, problems))
            ]
            parts.append(_seq(grammar.kind, key, items))
        elif key == "not":
            inner = _match(fields[key], sub, grammar, problems, depth + 1)
            parts.append(None if inner is None else _not(grammar.kind, inner))
        else:
            parts.append(grammar.leaves[key](fields[key], sub, problems))
    if len(parts) == 1:
        return parts[0]
    return _seq(grammar.kind, "all", parts)


def _seq(kind: type[_M], key: str, items: Sequence[_M | None]) -> _M | None:
    """`all` or `any` of `items`, None if one of them is invalid. An empty `all` matches every
    request and an empty `any` none, as in Linkerd."""
    matches = [item for item in items if item is not None]
    if len(matches) < len(items):
        return None
    match = kind()
    seq = match.all if key == "all" else match.any
    seq.SetInParent()
    seq.matches.extend(matches)
    return match


def _not(kind: type[_M], inner: _M) -> _M:
    match = kind()
    getattr(match, "not").CopyFrom(inner)  # `not` is a Python keyword
    return match


def _method(value: object, path: str, problems: list[str]) -> destination_pb2.RequestMatch | None:
    if not isinstance(value, str) or _TOKEN.fullmatch(value) is None:
        problems.append(f"{path}: expected an HTTP method like GET, got {_show(value)}")
        return None
    registered = _REGISTERED_METHODS.get(value)
    method = (
        http_types_pb2.HttpMethod(registered=registered)
        if registered is not None
        else http_types_pb2.HttpMethod(unregistered=value)
    )
    return destination_pb2.RequestMatch(method=method)


def _path_regex(
    value: object, path: str, problems: list[str], regexes: Budget
) -> destination_pb2.RequestMatch | None:
    if not isinstance(value, str):
        problems.append(f"{path}: expected a regular expression string, got {_show(value)}")
        return None
    try:
        regexes.compile(value)
    except NotCompiled:  # the profile is refused for an earlier regex already
        return None
    except PolicyTooCostly as e:
        problems.append(f"{path}: {_show(value)} is over the routes' regex budget: {e}")
        return None
    except ValueError as e:
        problems.append(f"{path}: invalid regex {_show(value)} (RE2 syntax): {e}")
        return None
    return destination_pb2.RequestMatch(path=destination_pb2.PathMatch(regex=value))


def _status(value: object, path: str, problems: list[str]) -> destination_pb2.ResponseMatch | None:
    fields = _fields(value, path, _STATUS_KEYS, problems)
    if fields is None:
        return None
    bounds: dict[str, int] = {}
    for key in _STATUS_KEYS:
        bound = fields.get(key)
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int) or not 100 <= bound <= 599:
            problems.append(
                f"{path}.{key}: expected a status code from 100 to 599, got {_show(bound)}"
            )
        else:
            bounds[key] = bound
    if not any(fields.get(key) is not None for key in _STATUS_KEYS):
        problems.append(f"{path}: set min, max or both")
        return None
    if len(bounds) < sum(fields.get(key) is not None for key in _STATUS_KEYS):
        return None
    low = bounds.get("min", bounds.get("max"))
    high = bounds.get("max", low)
    assert low is not None and high is not None
    if low > high:
        problems.append(f"{path}: min {low} is greater than max {high}")
        return None
    return destination_pb2.ResponseMatch(status=destination_pb2.HttpStatusRange(min=low, max=high))


_RESPONSE: Final = _Grammar(destination_pb2.ResponseMatch, {"status": _status})


# --- JSON helpers --------------------------------------------------------------------------------


def _fields(
    value: object, path: str, keys: Sequence[str], problems: list[str]
) -> Mapping[str, object] | None:
    """`value` as a mapping, each unknown key reported as a problem (typos must not pass)."""
    if not isinstance(value, Mapping):
        problems.append(f"{path}: expected a mapping, got {_kind(value)}")
        return None
    for key in value:
        if key not in keys:
            problems.append(
                f"{path}.{_key(key)}: unknown field (expected one of {', '.join(keys)})"
            )
    return value


def _list(value: object, path: str, problems: list[str]) -> list[object]:
    """`value` as a list; absent (None) is an empty list."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        problems.append(f"{path}: expected a list, got {_kind(value)}")
        return []
    return list(value)


def _bool(value: object, path: str, problems: list[str]) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        problems.append(f"{path}: expected true or false, got {_show(value)}")
        return False
    return value


def _duration_field(value: object, path: str, problems: list[str]) -> int | None:
    if value is None:
        return None
    if not isinstance(value, str):
        problems.append(f"{path}: expected a duration string like '300ms', got {_kind(value)}")
        return None
    try:
        ns = parse_duration_ns(value)
    except ValueError as e:
        problems.append(f"{path}: {e}")
        return None
    if ns < 0:
        problems.append(f"{path}: must not be negative, got {_show(value)}")
        return None
    return ns


def _duration(ns: int) -> duration_pb2.Duration:
    seconds, nanos = divmod(ns, _NS_PER_S)
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


def _has_port(authority: str) -> bool:
    host, sep, port = authority.rpartition(":")
    return bool(sep) and port.isdigit() and (":" not in host or host.endswith("]"))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return type(value).__name__


def _key(key: object) -> str:
    return key if isinstance(key, str) and key.isprintable() and len(key) <= 64 else _show(key)


def _show(value: object) -> str:
    """A value for an error message: repr'd (so control characters are escaped), bounded."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
