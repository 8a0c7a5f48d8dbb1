"""Owns the route model: an HTTPRoute or a GRPCRoute (`policy.meshlet.io` and the Gateway API's)
read once, with every problem named, into one frozen `Route` from which both answers are built:
the inbound one of each Server it names (its `servers`), the outbound one of each Service port
(its `services`).

A route is checked for what each of its parents needs: its matches and hostnames always; with a
Server parent, filters the inbound proxy applies (RequestHeaderModifier only, as Linkerd's
inbound policy); with a Service parent, Linkerd's outbound filters (a GRPCRoute's: the request
header modifier), its backendRefs, the rule's `timeouts` and the route's retry and timeout
annotations (meshlet.controlplane.policy.annotations). A route's regexes share a policy's budget
(meshlet.api.pathregex): one over it alone could never be served. `read` is the one reading; the
validating webhook answers its problems, the indexes keep its value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import headers
from meshlet.api.pathregex import NotCompiled, PolicyTooCostly
from meshlet.api.target import Refused, normal_path_match
from meshlet.controlplane.policy.annotations import Retry, Timeouts, checked_timeouts, retry_of
from meshlet.controlplane.policy.reading import (
    DNS_LABEL,
    GATEWAY_GROUP,
    GROUP,
    Check,
    Meta,
    read_meta,
    read_ref,
    show,
)

# Limits, as the Gateway API's CRDs set them.
MAX_PARENT_REFS: Final = 32
MAX_HOSTNAMES: Final = 16
MAX_RULES: Final = 16
MAX_MATCHES: Final = 64
MAX_HEADER_MATCHES: Final = 16
MAX_QUERY_MATCHES: Final = 16
MAX_FILTERS: Final = 16
MAX_BACKENDS: Final = 16

HTTP_METHODS: Final = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                       "PATCH")  # fmt: skip
INBOUND_FILTERS: Final = ("RequestHeaderModifier",)  # what a Server's routes may carry
HTTP_FILTERS: Final = ("RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect")
BACKEND_FILTERS: Final = ("RequestHeaderModifier", "ResponseHeaderModifier")
GRPC_FILTERS: Final = ("RequestHeaderModifier",)  # what outbound GrpcRoute.Filter can carry

_HEADER_NAME: Final = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_HOSTNAME: Final = re.compile(rf"(\*\.)?{DNS_LABEL}(\.{DNS_LABEL})*")
_GATEWAY_DURATION: Final = re.compile(r"([0-9]{1,5}(h|ms|m|s)){1,4}")
_GATEWAY_PART: Final = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_NO_TIMEOUTS: Final = Timeouts()


# -- the model -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValueMatch:
    """A header or query parameter match: `Exact` or `RegularExpression`."""

    name: str
    regex: bool
    value: str


@dataclass(frozen=True, slots=True)
class HttpMatch:
    path: tuple[str, str] | None  # (Exact | PathPrefix | RegularExpression, value)
    headers: tuple[ValueMatch, ...]
    query_params: tuple[ValueMatch, ...]
    method: str | None


@dataclass(frozen=True, slots=True)
class GrpcMatch:
    service: str | None
    method: str | None
    headers: tuple[ValueMatch, ...]


@dataclass(frozen=True, slots=True)
class HeaderModifier:
    add: tuple[tuple[str, str], ...]
    set: tuple[tuple[str, str], ...]
    remove: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Redirect:
    scheme: str | None
    host: str | None
    path: tuple[str, str] | None  # (ReplaceFullPath | ReplacePrefixMatch, value)
    port: int | None
    status: int


@dataclass(frozen=True, slots=True)
class Filter:
    kind: str  # RequestHeaderModifier, ResponseHeaderModifier, RequestRedirect
    modifier: HeaderModifier | None = None
    redirect: Redirect | None = None


@dataclass(frozen=True, slots=True)
class Backend:
    weight: int
    name: str = ""
    namespace: str = ""
    port: int | None = None
    filters: tuple[Filter, ...] = ()
    invalid: str | None = None  # why the backend cannot be used


@dataclass(frozen=True, slots=True)
class Rule:
    matches: tuple[HttpMatch | GrpcMatch, ...]
    filters: tuple[Filter, ...]
    backends: tuple[Backend, ...] = ()  # read for a Service parent only
    request_timeout: float | None = None  # Gateway API `timeouts.request`

    @property
    def request_modifiers(self) -> tuple[HeaderModifier, ...]:
        """The rule's RequestHeaderModifiers, in order (all a Server's route may carry)."""
        return tuple(
            f.modifier
            for f in self.filters
            if f.kind == "RequestHeaderModifier" and f.modifier is not None
        )


@dataclass(frozen=True, slots=True)
class Route:
    meta: Meta
    group: str  # policy.meshlet.io or gateway.networking.k8s.io
    kind: str  # HTTPRoute or GRPCRoute
    servers: tuple[str, ...]  # the parent Servers (in the route's namespace): inbound
    services: tuple[tuple[str, str, int | None], ...]  # (namespace, Service, port or all): outbound
    hostnames: tuple[str, ...]
    rules: tuple[Rule, ...]
    timeouts: Timeouts = _NO_TIMEOUTS  # its annotations (read for a Service parent only)
    retry: Retry | None = None


# -- reading ---------------------------------------------------------------------------------


def parse_gateway_duration(text: str) -> float:
    """Seconds of a Gateway API duration (GEP-2257: up to four number-unit parts in h, m, s
    or ms, such as 1h30m or 500ms); ValueError saying what is wrong."""
    if not _GATEWAY_DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a Gateway API duration such as 10s, 500ms or 1h30m")
    return sum(int(n) * _UNITS[u] for n, u in _GATEWAY_PART.findall(text))


def names_a_service(obj: Mapping[str, Any]) -> bool:
    """Whether a route has a Service parent (routes of Servers only are inbound's)."""
    return any(
        str(ref.get("kind", "")).lower() == "service" and ref.get("group", "core") in ("", "core")
        for ref in _parent_refs(obj)
    )


def _names_a_server(obj: Mapping[str, Any]) -> bool:
    return any(str(ref.get("kind", "")).lower() == "server" for ref in _parent_refs(obj))


def _parent_refs(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = obj.get("spec")
    refs = spec.get("parentRefs") if isinstance(spec, Mapping) else None
    return [r for r in refs if isinstance(r, Mapping)] if isinstance(refs, list) else []


def _parents(
    c: Check, spec: Mapping[str, Any], meta: Meta
) -> tuple[tuple[str, ...], tuple[tuple[str, str, int | None], ...]]:
    """The Servers (inbound) and the Service ports (outbound) a route attaches to; other
    parents (a Gateway) are another controller's."""
    servers, services = [], []
    path = "spec.parentRefs"
    for i, item in enumerate(c.array(spec.get("parentRefs"), path, limit=MAX_PARENT_REFS)):
        at = f"{path}[{i}]"
        ref = read_ref(c, item, at, namespaced=True, default_group=GATEWAY_GROUP)
        entry = item if isinstance(item, Mapping) else {}
        if str(entry.get("kind", "")).lower() == "service" and entry.get("group", "core") in (
            "",
            "core",
        ):
            port = c.integer(entry.get("port"), f"{at}.port", low=1, high=65535)
            if ref is not None:
                services.append((ref.namespace or meta.namespace, ref.name, port))
            continue
        if ref is None or not ref.targets(GROUP, "Server"):
            continue
        if ref.namespace not in (None, meta.namespace):
            c.fail(f"{at}.namespace", "a route may attach only to a Server in its own namespace")
        elif entry.get("port") is not None:
            c.fail(f"{at}.port", "must not be set for a Server parent")
        elif entry.get("sectionName") is not None:
            c.fail(f"{at}.sectionName", "must not be set for a Server parent")
        else:
            servers.append(ref.name)
    return tuple(servers), tuple(services)


def read_hostnames(c: Check, spec: Mapping[str, Any]) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(c.array(spec.get("hostnames"), "spec.hostnames", limit=MAX_HOSTNAMES)):
        host = c.string(
            item,
            f"spec.hostnames[{i}]",
            required=True,
            pattern=_HOSTNAME,
            what="a hostname (optionally starting with '*.')",
            limit=253,
        )
        if host is not None:
            out.append(host)
    return tuple(out)


def _regex(c: Check, value: str, path: str) -> None:
    try:
        c.regexes.compile(value)
    except NotCompiled:  # refused for an earlier regex already, which says why
        pass
    except PolicyTooCostly as exc:
        c.fail(path, f"{show(value)} is over the regex budget: {exc}; see docs/policy.md")
    except ValueError as exc:
        c.fail(path, f"{show(value)} is not an RE2 regular expression ({exc})")


def read_value_matches(
    c: Check, value: Any, path: str, limit: int, header: bool
) -> tuple[ValueMatch, ...]:
    out = []
    for i, item in enumerate(c.array(value, path, limit=limit)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        name = c.string(
            entry.get("name"),
            f"{at}.name",
            required=True,
            limit=256,
            pattern=_HEADER_NAME if header else None,
            what="a header name",
        )
        kind = c.string(entry.get("type"), f"{at}.type", choices=("Exact", "RegularExpression"))
        val = c.string(entry.get("value"), f"{at}.value", required=True)
        if val is not None and kind == "RegularExpression":
            _regex(c, val, f"{at}.value")
        if name is not None and val is not None:
            out.append(ValueMatch(name, kind == "RegularExpression", val))
    return tuple(out)


def read_header_modifier(c: Check, value: Any, path: str) -> HeaderModifier:
    """A Request- or ResponseHeaderModifier: names as the proxy accepts them (meshlet.api.headers:
    never the proxy's own, a pseudo-header, Host or a framing or hop-by-hop header), each named
    once per list whatever its case (the Gateway API's list key), values without control
    characters."""
    mod = c.mapping(value, path, required=True) or {}
    pairs: dict[str, list[tuple[str, str]]] = {"add": [], "set": []}
    for field in ("add", "set"):
        seen: set[str] = set()
        for i, item in enumerate(c.array(mod.get(field), f"{path}.{field}", limit=16)):
            at = f"{path}.{field}[{i}]"
            entry = c.mapping(item, at, required=True) or {}
            name = _modified_name(c, entry.get("name"), f"{at}.name", seen)
            val = c.string(entry.get("value"), f"{at}.value", required=True,
                           limit=headers.MAX_VALUE_LENGTH)  # fmt: skip
            if val is not None and (problem := headers.value_problem(val.encode())) is not None:
                c.fail(f"{at}.value", problem)
                val = None
            if name is not None and val is not None:
                pairs[field].append((name, val))
    seen = set()
    remove = [
        r
        for i, item in enumerate(c.array(mod.get("remove"), f"{path}.remove", limit=16))
        if (r := _modified_name(c, item, f"{path}.remove[{i}]", seen)) is not None
    ]
    return HeaderModifier(tuple(pairs["add"]), tuple(pairs["set"]), tuple(remove))


def _modified_name(c: Check, value: Any, path: str, seen: set[str]) -> str | None:
    name = c.string(value, path, required=True, limit=headers.MAX_NAME_LENGTH)
    if name is None:
        return None
    problem = headers.name_problem(name)
    if problem is not None:
        c.fail(path, problem)
        return None
    if name.lower() in seen:
        c.fail(path, f"{show(name)} is listed twice; name each header once")
        return None
    seen.add(name.lower())
    return name


def _redirect(c: Check, value: Any, path: str) -> Redirect:
    raw = c.mapping(value, path, required=True) or {}
    scheme = c.string(raw.get("scheme"), f"{path}.scheme", choices=("http", "https"))
    host = c.string(raw.get("hostname"), f"{path}.hostname", limit=253)
    port = c.integer(raw.get("port"), f"{path}.port", low=1, high=65535)
    status = c.integer(raw.get("statusCode"), f"{path}.statusCode", low=301, high=302) or 302
    modifier = c.mapping(raw.get("path"), f"{path}.path")
    replaced = None
    if modifier is not None:
        kind = c.string(modifier.get("type"), f"{path}.path.type", required=True,
                        choices=("ReplaceFullPath", "ReplacePrefixMatch"))  # fmt: skip
        field_name = "replaceFullPath" if kind == "ReplaceFullPath" else "replacePrefixMatch"
        text = c.string(modifier.get(field_name), f"{path}.path.{field_name}", required=True)
        if kind is not None and text is not None:
            replaced = (kind, text)
    return Redirect(scheme, host, replaced, port, status)


@dataclass(frozen=True, slots=True)
class _Allowed:
    """The filters a rule (or a backend) may carry: the others are named as problems, with
    `inbound`'s words for a Server's route, or not checked at all (`kinds` None: a route of
    neither a Server nor a Service, whose parents are another controller's)."""

    kinds: tuple[str, ...] | None
    inbound: bool = False


def _filters(c: Check, value: Any, path: str, allowed: _Allowed) -> tuple[Filter, ...]:
    out = []
    for i, item in enumerate(c.array(value, path, limit=MAX_FILTERS)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        kind = c.string(entry.get("type"), f"{at}.type", required=True)
        kinds = allowed.kinds if allowed.kinds is not None else INBOUND_FILTERS
        if kind in kinds and kind in ("RequestHeaderModifier", "ResponseHeaderModifier"):
            key = kind[0].lower() + kind[1:]
            modifier = read_header_modifier(c, entry.get(key), f"{at}.{key}")
            out.append(Filter(kind, modifier=modifier))
        elif kind in kinds and kind == "RequestRedirect":
            redirect = _redirect(c, entry.get("requestRedirect"), f"{at}.requestRedirect")
            out.append(Filter(kind, redirect=redirect))
        elif kind is None or allowed.kinds is None:
            continue
        elif allowed.inbound:
            c.fail(
                f"{at}.type",
                f"{kind!r} is not supported on inbound routes; use RequestHeaderModifier",
            )
        else:
            c.fail(f"{at}.type", f"{kind!r} is not supported; use one of {', '.join(kinds)}")
    return tuple(out)


def _backends(c: Check, value: Any, path: str, namespace: str) -> tuple[Backend, ...]:
    """backendRefs as Linkerd reads them: a kind other than Service and a Service without a
    port become invalid backends (requests to them fail), not a refused route."""
    out = []
    for i, item in enumerate(c.array(value, path, limit=MAX_BACKENDS)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        ref = read_ref(c, {"kind": "Service", **entry}, at, namespaced=True)  # the API's default
        weight = c.integer(entry.get("weight"), f"{at}.weight", low=0, high=1_000_000)
        weight = 1 if weight is None else weight
        port = c.integer(entry.get("port"), f"{at}.port", low=1, high=65535)
        filters = _filters(c, entry.get("filters"), f"{at}.filters", _Allowed(BACKEND_FILTERS))
        if ref is None:
            continue
        if not ref.targets("", "Service"):
            why = f"unsupported backend type {ref.group or 'core'} {ref.kind}"
            out.append(Backend(weight, ref.name, invalid=why))
        elif port is None:
            out.append(
                Backend(weight, ref.name, invalid=f"missing port for backend Service {ref.name}")
            )
        else:
            out.append(Backend(weight, ref.name, ref.namespace or namespace, port, filters))
    return tuple(out)


def _normal_path(c: Check, value: str, at: str) -> None:
    """An Exact or PathPrefix value names a path in the one form proxies route requests on
    (meshlet.api.target): `/x/../admin` or `/%61dmin` would never match a request, so the
    authorization on it would protect nothing."""
    normal = normal_path_match(value)
    if isinstance(normal, Refused):
        c.fail(at, f"{show(value)} can match no request: {normal.reason}")
    elif normal != value:
        c.fail(at, f"{show(value)} is not in the form requests are routed on; write {show(normal)}")


def read_http_match(c: Check, item: Any, at: str) -> HttpMatch:
    entry = c.mapping(item, at, required=True) or {}
    path: tuple[str, str] | None = None
    raw = c.mapping(entry.get("path"), f"{at}.path")
    if raw is not None:
        kind = (
            c.string(
                raw.get("type"),
                f"{at}.path.type",
                choices=("Exact", "PathPrefix", "RegularExpression"),
            )
            or "PathPrefix"
        )
        value = c.string(raw.get("value"), f"{at}.path.value", limit=1024)
        value = "/" if value is None else value
        if kind == "RegularExpression":
            _regex(c, value, f"{at}.path.value")
        elif not value.startswith("/"):
            c.fail(f"{at}.path.value", f"{show(value)} is not an absolute path; start it with '/'")
        else:
            _normal_path(c, value, f"{at}.path.value")
        path = (kind, value)
    headers = read_value_matches(c, entry.get("headers"), f"{at}.headers", MAX_HEADER_MATCHES, True)
    query = read_value_matches(
        c, entry.get("queryParams"), f"{at}.queryParams", MAX_QUERY_MATCHES, False
    )
    method = c.string(entry.get("method"), f"{at}.method", choices=HTTP_METHODS)
    return HttpMatch(path, headers, query, method)


def _grpc_match(c: Check, item: Any, at: str) -> GrpcMatch:
    entry = c.mapping(item, at, required=True) or {}
    service = method = None
    raw = c.mapping(entry.get("method"), f"{at}.method")
    if raw is not None:
        kind = c.string(
            raw.get("type"), f"{at}.method.type", choices=("Exact", "RegularExpression")
        )
        if kind == "RegularExpression":
            c.fail(f"{at}.method.type", "RegularExpression is not supported; use Exact")
        service = c.string(raw.get("service"), f"{at}.method.service", limit=1024)
        method = c.string(raw.get("method"), f"{at}.method.method", limit=1024)
        if not service and not method:
            c.fail(f"{at}.method", "names neither a service nor a method; give one")
    headers = read_value_matches(c, entry.get("headers"), f"{at}.headers", MAX_HEADER_MATCHES, True)
    return GrpcMatch(service or None, method or None, headers)


def _request_timeout(c: Check, rule: Mapping[str, Any], at: str) -> float | None:
    """A rule's `timeouts.request` (its `backendRequest` is checked, not used: Linkerd's)."""
    timeout = None
    limits = c.mapping(rule.get("timeouts"), f"{at}.timeouts") or {}
    for key in ("request", "backendRequest"):
        text = c.string(limits.get(key), f"{at}.timeouts.{key}", limit=32)
        if text is None:
            continue
        try:
            seconds = parse_gateway_duration(text)
        except ValueError as exc:
            c.fail(f"{at}.timeouts.{key}", str(exc))
            continue
        if key == "request":
            timeout = seconds or None
    return timeout


def _annotations(c: Check, obj: Mapping[str, Any]) -> tuple[Timeouts, Retry | None]:
    meta = obj.get("metadata")
    raw = meta.get("annotations") if isinstance(meta, Mapping) else None
    notes = {k: v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}
    timeouts, retry = Timeouts(), None
    try:
        timeouts = checked_timeouts(notes)
    except ValueError as exc:
        c.fail("metadata.annotations", str(exc))
    try:
        retry = retry_of(notes)
    except ValueError as exc:
        c.fail("metadata.annotations", str(exc))
    return timeouts, retry


def read(c: Check, obj: Mapping[str, Any]) -> Route:
    """An HTTPRoute or GRPCRoute (by its `kind`), its problems in `c`."""
    meta = read_meta(c, obj)
    kind = "GRPCRoute" if obj.get("kind") == "GRPCRoute" else "HTTPRoute"
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    servers, services = _parents(c, spec, meta)
    outbound = names_a_service(obj)
    if kind == "GRPCRoute":
        on_server = not outbound or _names_a_server(obj)
        allowed = _Allowed(INBOUND_FILTERS if on_server else GRPC_FILTERS, on_server)
    elif _names_a_server(obj):
        allowed = _Allowed(INBOUND_FILTERS, inbound=True)
    else:
        allowed = _Allowed(HTTP_FILTERS if outbound else None)
    hostnames = read_hostnames(c, spec)
    rules = []
    for i, item in enumerate(c.array(spec.get("rules"), "spec.rules", limit=MAX_RULES)):
        at = f"spec.rules[{i}]"
        rule = c.mapping(item, at, required=True) or {}
        read_match = _grpc_match if kind == "GRPCRoute" else read_http_match
        matches = tuple(
            read_match(c, m, f"{at}.matches[{j}]")
            for j, m in enumerate(c.array(rule.get("matches"), f"{at}.matches", limit=MAX_MATCHES))
        )
        filters = _filters(c, rule.get("filters"), f"{at}.filters", allowed)
        backends: tuple[Backend, ...] = ()
        timeout = None
        if outbound:
            if kind == "HTTPRoute":
                timeout = _request_timeout(c, rule, at)
            backends = _backends(c, rule.get("backendRefs"), f"{at}.backendRefs", meta.namespace)
        rules.append(Rule(matches, filters, backends, timeout))
    timeouts, retry = _annotations(c, obj) if outbound else (Timeouts(), None)
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return Route(meta, group, kind, servers, services, hostnames, tuple(rules), timeouts, retry)
