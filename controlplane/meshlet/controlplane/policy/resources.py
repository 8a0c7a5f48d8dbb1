"""Owns the policy resources' shapes: each kind read from its Kubernetes object into frozen values,
with every problem named.

The shapes are Linkerd's (Server v1beta3, AuthorizationPolicy, MeshTLSAuthentication,
NetworkAuthentication, HTTPLocalRateLimitPolicy v1alpha1, HTTPRoute v1beta3) under the group
`policy.meshlet.io`, plus the Gateway API's `HTTPRoute` and `GRPCRoute` (v1). `problems` is what
the validating webhook asks: it takes any mapping and answers a list of sentences, each naming a
field path and what to fix, never raising. `parse` is what the index uses: the same checks, and
the value when there is no problem. The checks are the admission webhook's and the index's of
Linkerd's policy controller, so an object that passes here is one the index can use whole.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import headers, wellknown
from meshlet.api.pathregex import Budget, NotCompiled, PolicyTooCostly

GROUP: Final = wellknown.POLICY_API_GROUP
GATEWAY_GROUP: Final = "gateway.networking.k8s.io"

# Limits, as the Gateway API's CRDs set them (and, where it sets none, generous ones).
MAX_PARENT_REFS: Final = 32
MAX_HOSTNAMES: Final = 16
MAX_RULES: Final = 16
MAX_MATCHES: Final = 64
MAX_HEADER_MATCHES: Final = 16
MAX_QUERY_MATCHES: Final = 16
MAX_FILTERS: Final = 16
MAX_LIST: Final = 1024  # identities, networks, refs, overrides, selector terms
MAX_STRING: Final = 4096

PROXY_PROTOCOLS: Final = ("unknown", "HTTP/1", "HTTP/2", "gRPC", "opaque", "TLS")
HTTP_METHODS: Final = (
    "GET",
    "HEAD",
    "POST",
    "PUT",
    "DELETE",
    "CONNECT",
    "OPTIONS",
    "TRACE",
    "PATCH",
)
_SELECTOR_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_LABEL_RE = re.compile(_DNS_LABEL)
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]+")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_HOSTNAME = re.compile(rf"(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


# -- values ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Meta:
    namespace: str
    name: str
    created: str  # metadata.creationTimestamp (RFC 3339, sorts as text); "" when unknown


@dataclass(frozen=True, slots=True)
class Expression:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Selector:
    """A label selector: matchLabels and matchExpressions ANDed; empty selects every pod."""

    labels: tuple[tuple[str, str], ...]
    expressions: tuple[Expression, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(key) != value for key, value in self.labels):
            return False
        for e in self.expressions:
            present = e.key in labels
            if e.operator == "In" and (not present or labels[e.key] not in e.values):
                return False
            if e.operator == "NotIn" and present and labels[e.key] in e.values:
                return False
            if e.operator == "Exists" and not present:
                return False
            if e.operator == "DoesNotExist" and present:
                return False
        return True


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to another object: group ("" for the core group), kind, name, namespace."""

    group: str
    kind: str
    name: str
    namespace: str | None = None

    def targets(self, group: str, kind: str) -> bool:
        return self.group == group and self.kind.lower() == kind.lower()


@dataclass(frozen=True, slots=True)
class Server:
    meta: Meta
    labels: tuple[tuple[str, str], ...]
    selector: Selector
    port: int | str  # a number, or a container port's name
    protocol: str  # one of PROXY_PROTOCOLS
    access_policy: str  # one of wellknown.DEFAULT_INBOUND_POLICIES


@dataclass(frozen=True, slots=True)
class AuthorizationPolicy:
    meta: Meta
    target: Ref
    authentications: tuple[Ref, ...]


@dataclass(frozen=True, slots=True)
class MeshTLSAuthentication:
    meta: Meta
    identities: tuple[str, ...]  # names, `*`, or `*.suffix`
    identity_refs: tuple[Ref, ...]  # ServiceAccounts, or Namespaces (every account in one)


@dataclass(frozen=True, slots=True)
class NetworkMatch:
    net: Network
    excepts: tuple[Network, ...]


@dataclass(frozen=True, slots=True)
class NetworkAuthentication:
    meta: Meta
    networks: tuple[NetworkMatch, ...]


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
class HeaderModifier:
    add: tuple[tuple[str, str], ...]
    set: tuple[tuple[str, str], ...]
    remove: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HttpRule:
    matches: tuple[HttpMatch, ...]
    filters: tuple[HeaderModifier, ...]


@dataclass(frozen=True, slots=True)
class GrpcMatch:
    service: str | None
    method: str | None
    headers: tuple[ValueMatch, ...]


@dataclass(frozen=True, slots=True)
class GrpcRule:
    matches: tuple[GrpcMatch, ...]
    filters: tuple[HeaderModifier, ...]


@dataclass(frozen=True, slots=True)
class HTTPRoute:
    meta: Meta
    group: str  # policy.meshlet.io or gateway.networking.k8s.io
    servers: tuple[str, ...]  # the parent Servers (same namespace)
    hostnames: tuple[str, ...]
    rules: tuple[HttpRule, ...]


@dataclass(frozen=True, slots=True)
class GRPCRoute:
    meta: Meta
    group: str
    servers: tuple[str, ...]
    hostnames: tuple[str, ...]
    rules: tuple[GrpcRule, ...]


@dataclass(frozen=True, slots=True)
class Override:
    requests_per_second: int
    clients: tuple[Ref, ...]  # ServiceAccounts


@dataclass(frozen=True, slots=True)
class HTTPLocalRateLimitPolicy:
    meta: Meta
    server: str
    total: int | None
    identity: int | None
    overrides: tuple[Override, ...]


Resource = (
    Server
    | AuthorizationPolicy
    | MeshTLSAuthentication
    | NetworkAuthentication
    | HTTPRoute
    | GRPCRoute
    | HTTPLocalRateLimitPolicy
)


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
            self.fail(path, f"must be an object, not {_type(value)}")
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
            self.fail(path, f"must be a list, not {_type(value)}")
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
            self.fail(path, f"must be a string, not {_type(value)}")
            return None
        if len(value) > limit:
            self.fail(path, f"is {len(value)} characters long; at most {limit} are allowed")
            return None
        if choices and value not in choices:
            self.fail(path, f"{value!r} is not one of {', '.join(choices)}")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(path, f"{_show(value)} is not {what}")
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
            self.fail(path, f"must be an integer, not {_type(value)}")
            return None
        if not low <= value <= high:
            self.fail(path, f"{value} is not within {low}..{high}")
            return None
        return value


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )


def _show(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


def read_meta(c: Check, obj: Mapping[str, Any]) -> Meta:
    metadata = c.mapping(obj.get("metadata"), "metadata", required=True) or {}
    name = c.string(
        metadata.get("name"),
        "metadata.name",
        required=True,
        pattern=_SUBDOMAIN,
        what="a DNS subdomain name (lower case letters, digits, '-' and '.')",
        limit=253,
    )
    namespace = c.string(
        metadata.get("namespace"),
        "metadata.namespace",
        pattern=_LABEL_RE,
        what="a namespace name",
        limit=63,
    )
    created = metadata.get("creationTimestamp")
    return Meta(namespace or "default", name or "", created if isinstance(created, str) else "")


def _labels(c: Check, value: Any, path: str) -> tuple[tuple[str, str], ...]:
    labels = c.mapping(value, path) or {}
    out = []
    for key, val in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            c.fail(f"{path}.{key}", "is not a label key")
        elif c.string(val, f"{path}.{key}", pattern=_LABEL_VALUE, what="a label value") is not None:
            out.append((key, val))
    return tuple(sorted(out))


def _selector(c: Check, value: Any, path: str) -> Selector:
    sel = c.mapping(value, path, required=True) or {}
    labels = _labels(c, sel.get("matchLabels"), f"{path}.matchLabels")
    expressions = []
    for i, item in enumerate(c.array(sel.get("matchExpressions"), f"{path}.matchExpressions")):
        at = f"{path}.matchExpressions[{i}]"
        expr = c.mapping(item, at) or {}
        key = c.string(
            expr.get("key"), f"{at}.key", required=True, pattern=_LABEL_KEY, what="a label key"
        )
        op = c.string(
            expr.get("operator"), f"{at}.operator", required=True, choices=_SELECTOR_OPERATORS
        )
        raw = c.array(expr.get("values"), f"{at}.values")
        values = tuple(v for j, v in enumerate(raw) if c.string(v, f"{at}.values[{j}]") is not None)
        if op in ("In", "NotIn") and not values:
            c.fail(f"{at}.values", f"must list at least one value for {op}")
        if op in ("Exists", "DoesNotExist") and raw:
            c.fail(f"{at}.values", f"must be empty for {op}")
        if key is not None and op is not None:
            expressions.append(Expression(key, op, values))
    return Selector(labels, tuple(expressions))


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
            pattern=_LABEL_RE,
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


def _server(c: Check, obj: Mapping[str, Any]) -> Server:
    meta = read_meta(c, obj)
    labels = _labels(c, (obj.get("metadata") or {}).get("labels"), "metadata.labels")
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    selector = Selector((), ())
    if spec.get("externalWorkloadSelector") is not None:
        c.fail("spec.externalWorkloadSelector", "is not supported; select pods with podSelector")
    else:
        selector = _selector(c, spec.get("podSelector"), "spec.podSelector")
    port: int | str | None = None
    raw = spec.get("port")
    if isinstance(raw, str) and not raw.isdigit():
        port = c.string(
            raw,
            "spec.port",
            required=True,
            pattern=_PORT_NAME,
            what="a container port name",
            limit=15,
        )
    else:
        port = c.integer(
            int(raw) if isinstance(raw, str) else raw, "spec.port", low=1, high=65535, required=True
        )
    protocol = c.string(spec.get("proxyProtocol"), "spec.proxyProtocol", choices=PROXY_PROTOCOLS)
    access = c.string(
        spec.get("accessPolicy"), "spec.accessPolicy", choices=wellknown.DEFAULT_INBOUND_POLICIES
    )
    return Server(meta, labels, selector, port or 0, protocol or "unknown", access or "deny")


def _authorization_policy(c: Check, obj: Mapping[str, Any]) -> AuthorizationPolicy:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    target = read_ref(c, spec.get("targetRef"), "spec.targetRef", namespaced=False)
    if target is not None:
        allowed = (
            target.targets(GROUP, "Server")
            or target.targets("", "Namespace")
            or target.targets(GROUP, "HTTPRoute")
            or target.targets(GATEWAY_GROUP, "HTTPRoute")
            or target.targets(GROUP, "GRPCRoute")
            or target.targets(GATEWAY_GROUP, "GRPCRoute")
        )
        if not allowed:
            c.fail(
                "spec.targetRef",
                f"{_kind(target)} is not a target; target a Server, an"
                f" HTTPRoute or a GRPCRoute ({GROUP} or {GATEWAY_GROUP}), or a Namespace",
            )
        elif target.targets("", "Namespace") and target.name != meta.namespace:
            c.fail(
                "spec.targetRef.name",
                f"{target.name!r} is another namespace; a policy can"
                f" only target its own namespace ({meta.namespace!r})",
            )
    path = "spec.requiredAuthenticationRefs"
    refs = []
    for i, item in enumerate(c.array(spec.get(path.split(".")[1]), path, required=True)):
        ref = read_ref(c, item, f"{path}[{i}]", namespaced=True)
        if ref is None:
            continue
        if not (
            ref.targets(GROUP, "MeshTLSAuthentication")
            or ref.targets(GROUP, "NetworkAuthentication")
            or ref.targets("", "ServiceAccount")
        ):
            c.fail(
                f"{path}[{i}]",
                f"{_kind(ref)} is not an authentication; refer to a"
                " MeshTLSAuthentication, a NetworkAuthentication or a ServiceAccount",
            )
            continue
        refs.append(ref)
    count = {
        k: sum(r.targets(g, k) for r in refs)
        for g, k in (
            (GROUP, "MeshTLSAuthentication"),
            (GROUP, "NetworkAuthentication"),
            ("", "ServiceAccount"),
        )
    }
    if count["MeshTLSAuthentication"] > 1:
        c.fail(path, "lists several MeshTLSAuthentications; list one")
    if count["ServiceAccount"] > 1:
        c.fail(path, "lists several ServiceAccounts; list one (or a MeshTLSAuthentication)")
    if count["MeshTLSAuthentication"] and count["ServiceAccount"]:
        c.fail(path, "lists a MeshTLSAuthentication and a ServiceAccount; list one of them")
    if count["NetworkAuthentication"] > 1:
        c.fail(path, "lists several NetworkAuthentications; list one")
    return AuthorizationPolicy(meta, target or Ref("", "", ""), tuple(refs))


def identity_problem(identity: str) -> str | None:
    """Why `identity` is no MeshTLSAuthentication identity (a DNS-like name, `*`, `*.suffix`)."""
    if identity == "*":
        return None
    name = identity[2:] if identity.startswith("*.") else identity
    if not _SUBDOMAIN.fullmatch(name) or len(name) > 253:
        return "is not an identity: a DNS-like name, '*', or '*.' and a DNS-like suffix"
    return None


def _meshtls(c: Check, obj: Mapping[str, Any]) -> MeshTLSAuthentication:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    identities = []
    for i, item in enumerate(c.array(spec.get("identities"), "spec.identities")):
        value = c.string(item, f"spec.identities[{i}]", required=True)
        if value is not None and (problem := identity_problem(value)) is not None:
            c.fail(f"spec.identities[{i}]", f"{_show(value)} {problem}")
        elif value is not None:
            identities.append(value)
    refs = []
    for i, item in enumerate(c.array(spec.get("identityRefs"), "spec.identityRefs")):
        at = f"spec.identityRefs[{i}]"
        ref = read_ref(c, item, at, namespaced=True)
        if ref is None:
            continue
        if ref.targets("", "Namespace"):
            if ref.namespace is not None:
                c.fail(f"{at}.namespace", "must not be set: a Namespace is cluster-scoped")
                continue
        elif not ref.targets("", "ServiceAccount"):
            c.fail(at, f"{_kind(ref)} is not an identity; refer to a ServiceAccount or a Namespace")
            continue
        refs.append(ref)
    if not spec.get("identities") and not spec.get("identityRefs"):
        c.fail("spec", "names no client; list identities or identityRefs")
    return MeshTLSAuthentication(meta, tuple(identities), tuple(refs))


def _cidr(c: Check, value: Any, path: str) -> Network | None:
    text = c.string(value, path, required=True, limit=64)
    if text is None:
        return None
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        c.fail(path, f"{_show(text)} is not a CIDR such as 10.0.0.0/8 or fd00::/8")
        return None


def _network_auth(c: Check, obj: Mapping[str, Any]) -> NetworkAuthentication:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    networks = []
    raw = c.array(spec.get("networks"), "spec.networks", required=True)
    if isinstance(spec.get("networks"), list) and not spec["networks"]:
        c.fail("spec.networks", "is empty; list at least one network")
    for i, item in enumerate(raw):
        at = f"spec.networks[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        net = _cidr(c, entry.get("cidr"), f"{at}.cidr")
        excepts = []
        for j, ex in enumerate(c.array(entry.get("except"), f"{at}.except")):
            out = _cidr(c, ex, f"{at}.except[{j}]")
            if out is None or net is None:
                continue
            if out.version != net.version or not out.subnet_of(net):  # type: ignore[arg-type]
                c.fail(
                    f"{at}.except[{j}]",
                    f"{out} is not within {net}; list only exceptions inside the cidr",
                )
            elif out == net:
                c.fail(f"{at}.except[{j}]", f"{out} negates all of {net}; remove the network")
            else:
                excepts.append(out)
        if net is not None:
            networks.append(NetworkMatch(net, tuple(excepts)))
    return NetworkAuthentication(meta, tuple(networks))


def _parents(c: Check, spec: Mapping[str, Any], meta: Meta) -> tuple[str, ...]:
    """The Servers a route attaches to; other parents (Services: outbound) are not inbound's."""
    servers = []
    path = "spec.parentRefs"
    for i, item in enumerate(c.array(spec.get("parentRefs"), path, limit=MAX_PARENT_REFS)):
        at = f"{path}[{i}]"
        ref = read_ref(c, item, at, namespaced=True, default_group=GATEWAY_GROUP)
        if ref is None or not ref.targets(GROUP, "Server"):
            continue
        entry = item if isinstance(item, Mapping) else {}
        if ref.namespace not in (None, meta.namespace):
            c.fail(f"{at}.namespace", "a route may attach only to a Server in its own namespace")
        elif entry.get("port") is not None:
            c.fail(f"{at}.port", "must not be set for a Server parent")
        elif entry.get("sectionName") is not None:
            c.fail(f"{at}.sectionName", "must not be set for a Server parent")
        else:
            servers.append(ref.name)
    return tuple(servers)


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
        c.fail(path, f"{_show(value)} is over the regex budget: {exc}; see docs/policy.md")
    except ValueError as exc:
        c.fail(path, f"{_show(value)} is not an RE2 regular expression ({exc})")


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
    """A RequestHeaderModifier: names as the proxy accepts them (meshlet.api.headers: never the
    proxy's own, a pseudo-header, Host or a framing or hop-by-hop header), each named once per
    list whatever its case (the Gateway API's list key), values without control characters."""
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
        c.fail(path, f"{_show(name)} is listed twice; name each header once")
        return None
    seen.add(name.lower())
    return name


def _filters(c: Check, value: Any, path: str, outbound: bool = False) -> tuple[HeaderModifier, ...]:
    """A rule's inbound filters. A route attached to no Server is the outbound policy's
    (meshlet.controlplane.policy.outbound reads and checks its filters): its other filter
    types are left to that check."""
    out = []
    for i, item in enumerate(c.array(value, path, limit=MAX_FILTERS)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        kind = c.string(entry.get("type"), f"{at}.type", required=True)
        if kind == "RequestHeaderModifier":
            out.append(
                read_header_modifier(
                    c, entry.get("requestHeaderModifier"), f"{at}.requestHeaderModifier"
                )
            )
        elif outbound:
            continue
        elif kind is not None:
            c.fail(
                f"{at}.type",
                f"{kind!r} is not supported on inbound routes; use RequestHeaderModifier",
            )
    return tuple(out)


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
            c.fail(f"{at}.path.value", f"{_show(value)} is not an absolute path; start it with '/'")
        path = (kind, value)
    headers = read_value_matches(c, entry.get("headers"), f"{at}.headers", MAX_HEADER_MATCHES, True)
    query = read_value_matches(
        c, entry.get("queryParams"), f"{at}.queryParams", MAX_QUERY_MATCHES, False
    )
    method = c.string(entry.get("method"), f"{at}.method", choices=HTTP_METHODS)
    return HttpMatch(path, headers, query, method)


def _http_route(c: Check, obj: Mapping[str, Any]) -> HTTPRoute:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    servers = _parents(c, spec, meta)
    refs = spec.get("parentRefs")
    outbound = not any(
        isinstance(ref, Mapping) and str(ref.get("kind", "")).lower() == "server"
        for ref in (refs if isinstance(refs, list) else ())
    )
    hostnames = read_hostnames(c, spec)
    rules = []
    for i, item in enumerate(c.array(spec.get("rules"), "spec.rules", limit=MAX_RULES)):
        at = f"spec.rules[{i}]"
        rule = c.mapping(item, at, required=True) or {}
        matches = tuple(
            read_http_match(c, m, f"{at}.matches[{j}]")
            for j, m in enumerate(c.array(rule.get("matches"), f"{at}.matches", limit=MAX_MATCHES))
        )
        filters = _filters(c, rule.get("filters"), f"{at}.filters", outbound=outbound)
        rules.append(HttpRule(matches, filters))
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return HTTPRoute(meta, group, servers, hostnames, tuple(rules))


def _grpc_route(c: Check, obj: Mapping[str, Any]) -> GRPCRoute:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    rules = []
    for i, item in enumerate(c.array(spec.get("rules"), "spec.rules", limit=MAX_RULES)):
        at = f"spec.rules[{i}]"
        rule = c.mapping(item, at, required=True) or {}
        matches = []
        for j, m in enumerate(c.array(rule.get("matches"), f"{at}.matches", limit=MAX_MATCHES)):
            mat = f"{at}.matches[{j}]"
            entry = c.mapping(m, mat, required=True) or {}
            service = method = None
            raw = c.mapping(entry.get("method"), f"{mat}.method")
            if raw is not None:
                kind = c.string(
                    raw.get("type"), f"{mat}.method.type", choices=("Exact", "RegularExpression")
                )
                if kind == "RegularExpression":
                    c.fail(f"{mat}.method.type", "RegularExpression is not supported; use Exact")
                service = c.string(raw.get("service"), f"{mat}.method.service", limit=1024)
                method = c.string(raw.get("method"), f"{mat}.method.method", limit=1024)
                if not service and not method:
                    c.fail(f"{mat}.method", "names neither a service nor a method; give one")
            headers = read_value_matches(
                c, entry.get("headers"), f"{mat}.headers", MAX_HEADER_MATCHES, True
            )
            matches.append(GrpcMatch(service or None, method or None, headers))
        rules.append(GrpcRule(tuple(matches), _filters(c, rule.get("filters"), f"{at}.filters")))
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return GRPCRoute(meta, group, _parents(c, spec, meta), read_hostnames(c, spec), tuple(rules))


def _rate_limit(c: Check, obj: Mapping[str, Any]) -> HTTPLocalRateLimitPolicy:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    target = read_ref(c, spec.get("targetRef"), "spec.targetRef", namespaced=False)
    if target is not None and not target.targets(GROUP, "Server"):
        c.fail("spec.targetRef", f"{_kind(target)} is not a target; target a Server ({GROUP})")

    def rps(value: Any, path: str) -> int | None:
        limit = c.mapping(value, path)
        if limit is None:
            return None
        return c.integer(
            limit.get("requestsPerSecond"),
            f"{path}.requestsPerSecond",
            low=1,
            high=2**32 - 1,
            required=True,
        )

    total = rps(spec.get("total"), "spec.total")
    identity = rps(spec.get("identity"), "spec.identity")
    if total is not None and identity is not None and identity > total:
        c.fail(
            "spec.identity.requestsPerSecond",
            f"{identity} exceeds total.requestsPerSecond ({total}); make it at most the total",
        )
    overrides = []
    for i, item in enumerate(c.array(spec.get("overrides"), "spec.overrides")):
        at = f"spec.overrides[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        limit = c.integer(
            entry.get("requestsPerSecond"),
            f"{at}.requestsPerSecond",
            low=1,
            high=2**32 - 1,
            required=True,
        )
        if limit is not None and total is not None and limit > total:
            c.fail(
                f"{at}.requestsPerSecond",
                f"{limit} exceeds total.requestsPerSecond ({total}); make it at most the total",
            )
        clients = []
        for j, ref_obj in enumerate(
            c.array(entry.get("clientRefs"), f"{at}.clientRefs", required=True)
        ):
            ref = read_ref(c, ref_obj, f"{at}.clientRefs[{j}]", namespaced=True)
            if ref is not None and not ref.targets("", "ServiceAccount"):
                c.fail(
                    f"{at}.clientRefs[{j}]",
                    f"{_kind(ref)} is not a client; refer to a ServiceAccount",
                )
            elif ref is not None:
                clients.append(ref)
        if limit is not None:
            overrides.append(Override(limit, tuple(clients)))
    name = target.name if target is not None else ""
    return HTTPLocalRateLimitPolicy(meta, name, total, identity, tuple(overrides))


def _kind(ref: Ref) -> str:
    return f"{ref.kind} ({ref.group or 'core'})"


_PARSERS: Final[dict[tuple[str, str], Callable[[Check, Mapping[str, Any]], Resource]]] = {
    (f"{GROUP}/v1beta3", "Server"): _server,
    (f"{GROUP}/v1alpha1", "AuthorizationPolicy"): _authorization_policy,
    (f"{GROUP}/v1alpha1", "MeshTLSAuthentication"): _meshtls,
    (f"{GROUP}/v1alpha1", "NetworkAuthentication"): _network_auth,
    (f"{GROUP}/v1beta3", "HTTPRoute"): _http_route,
    (f"{GATEWAY_GROUP}/v1", "HTTPRoute"): _http_route,
    (f"{GROUP}/v1", "GRPCRoute"): _grpc_route,
    (f"{GATEWAY_GROUP}/v1", "GRPCRoute"): _grpc_route,
    (f"{GROUP}/v1alpha1", "HTTPLocalRateLimitPolicy"): _rate_limit,
}
KINDS: Final = tuple(_PARSERS)  # (apiVersion, kind) of every resource read here


def parse(obj: Mapping[str, Any]) -> Resource:
    """The resource `obj` describes; Invalid naming every problem otherwise."""
    if not isinstance(obj, Mapping):
        raise Invalid([f"(object): must be an object, not {_type(obj)}"])
    key = (obj.get("apiVersion"), obj.get("kind"))
    parser = _PARSERS.get((str(key[0]), str(key[1])))
    if parser is None:
        known = ", ".join(f"{kind} {version}" for version, kind in KINDS)
        raise Invalid([f"apiVersion/kind: {key[0]!s} {key[1]!s} is not one of: {known}"])
    check = Check()
    resource = parser(check, obj)
    if check.problems:
        raise Invalid(check.problems)
    return resource


def problems(obj: Mapping[str, Any]) -> list[str]:
    """Every problem of `obj` (a policy resource as JSON), each as `field.path: what to fix`;
    empty when the object is valid. Never raises."""
    try:
        resource = parse(obj)
        if isinstance(resource, HTTPRoute | GRPCRoute):
            from meshlet.controlplane.policy.outbound import route_problems  # it imports this

            return route_problems(obj)
    except Invalid as exc:
        return exc.problems
    except Exception as exc:  # a shape no check foresaw: still an answer, never a crash
        return [f"(object): cannot be read ({type(exc).__name__}: {exc})"]
    return []
