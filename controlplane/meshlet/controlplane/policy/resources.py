"""Owns the policy resources' shapes: each kind read from its Kubernetes object into one frozen
value, with every problem named.

The shapes are Linkerd's (Server v1beta3, AuthorizationPolicy, MeshTLSAuthentication,
NetworkAuthentication, HTTPLocalRateLimitPolicy v1alpha1, HTTPRoute v1beta3) under the group
`policy.meshlet.io`, plus the Gateway API's `HTTPRoute` and `GRPCRoute` (v1), whose model is
meshlet.controlplane.policy.routes'. `problems` is what the validating webhook asks: it takes any
mapping and answers a list of sentences, each naming a field path and what to fix, never raising.
`parse` is what the controller reads each object with, once (meshlet.controlplane.policy.catalog):
the same checks, and the value when there is no problem. The checks are the admission webhook's
and the index's of Linkerd's policy controller, so an object that passes here is one both the
inbound and the outbound answers can use whole.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from meshlet.api import wellknown
from meshlet.controlplane.policy import routes
from meshlet.controlplane.policy.reading import (
    GATEWAY_GROUP,
    GROUP,
    SUBDOMAIN,
    Check,
    Invalid,
    Meta,
    Ref,
    kind_of,
    read_meta,
    read_ref,
    show,
    type_of,
)

PROXY_PROTOCOLS: Final = ("unknown", "HTTP/1", "HTTP/2", "gRPC", "opaque", "TLS")
_SELECTOR_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")

_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

__all__ = ["GATEWAY_GROUP", "GROUP", "Invalid", "Meta", "Ref", "Resource", "parse", "problems"]


# -- values ----------------------------------------------------------------------------------


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
    | routes.Route
    | HTTPLocalRateLimitPolicy
)


# -- the kinds -------------------------------------------------------------------------------


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
                f"{kind_of(target)} is not a target; target a Server, an"
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
                f"{kind_of(ref)} is not an authentication; refer to a"
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
    if not SUBDOMAIN.fullmatch(name) or len(name) > 253:
        return "is not an identity: a DNS-like name, '*', or '*.' and a DNS-like suffix"
    return None


def _meshtls(c: Check, obj: Mapping[str, Any]) -> MeshTLSAuthentication:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    identities = []
    for i, item in enumerate(c.array(spec.get("identities"), "spec.identities")):
        value = c.string(item, f"spec.identities[{i}]", required=True)
        if value is not None and (problem := identity_problem(value)) is not None:
            c.fail(f"spec.identities[{i}]", f"{show(value)} {problem}")
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
            c.fail(
                at, f"{kind_of(ref)} is not an identity; refer to a ServiceAccount or a Namespace"
            )
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
        c.fail(path, f"{show(text)} is not a CIDR such as 10.0.0.0/8 or fd00::/8")
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


def _rate_limit(c: Check, obj: Mapping[str, Any]) -> HTTPLocalRateLimitPolicy:
    meta = read_meta(c, obj)
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    target = read_ref(c, spec.get("targetRef"), "spec.targetRef", namespaced=False)
    if target is not None and not target.targets(GROUP, "Server"):
        c.fail("spec.targetRef", f"{kind_of(target)} is not a target; target a Server ({GROUP})")

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
                    f"{kind_of(ref)} is not a client; refer to a ServiceAccount",
                )
            elif ref is not None:
                clients.append(ref)
        if limit is not None:
            overrides.append(Override(limit, tuple(clients)))
    name = target.name if target is not None else ""
    return HTTPLocalRateLimitPolicy(meta, name, total, identity, tuple(overrides))


_PARSERS: Final[dict[tuple[str, str], Callable[[Check, Mapping[str, Any]], Resource]]] = {
    (f"{GROUP}/v1beta3", "Server"): _server,
    (f"{GROUP}/v1alpha1", "AuthorizationPolicy"): _authorization_policy,
    (f"{GROUP}/v1alpha1", "MeshTLSAuthentication"): _meshtls,
    (f"{GROUP}/v1alpha1", "NetworkAuthentication"): _network_auth,
    (f"{GROUP}/v1beta3", "HTTPRoute"): routes.read,
    (f"{GATEWAY_GROUP}/v1", "HTTPRoute"): routes.read,
    (f"{GROUP}/v1", "GRPCRoute"): routes.read,
    (f"{GATEWAY_GROUP}/v1", "GRPCRoute"): routes.read,
    (f"{GROUP}/v1alpha1", "HTTPLocalRateLimitPolicy"): _rate_limit,
}
KINDS: Final = tuple(_PARSERS)  # (apiVersion, kind) of every resource read here


def parse(obj: Mapping[str, Any]) -> Resource:
    """The resource `obj` describes; Invalid naming every problem otherwise."""
    if not isinstance(obj, Mapping):
        raise Invalid([f"(object): must be an object, not {type_of(obj)}"])
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
        parse(obj)
    except Invalid as exc:
        return exc.problems
    except Exception as exc:  # a shape no check foresaw: still an answer, never a crash
        return [f"(object): cannot be read ({type(exc).__name__}: {exc})"]
    return []
