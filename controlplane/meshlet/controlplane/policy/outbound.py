"""Owns the outbound model: Services and the routes whose parents are Services, and the
`OutboundPolicy` of each watched (namespace, service, port, client namespace), recomputed when
something it depends on changes and published only when its bytes change.

The translation is Linkerd's policy controller's (`k8s/index/src/outbound/index.rs`,
`grpc/src/outbound.rs` and its `http`/`grpc` modules): a Service port's policy is a protocol
(Opaque for an opaque port, gRPC when GRPCRoutes attach, else Detect with the HTTP routes), the
routes ordered oldest first (then by name), each rule's backends a random weighted choice, a
`default` route to the Service itself when no route attaches. Routes in the Service's namespace
serve every client; routes in another namespace that name it serve that namespace's clients
(Linkerd's producer and consumer routes). A Service's retry, timeout and
failure-accrual annotations apply to every route that sets none of its own; a bad annotation
value is logged and ignored, as Linkerd does (the validating webhook does not review Services).
A route whose own annotations are bad is ignored, named in the log.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from google.protobuf import duration_pb2

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    meta_pb2,
    net_pb2,
    outbound_pb2,
    wellknown,
)
from meshlet.api.ports import scan_ports
from meshlet.controlplane.k8s.events import Event, Kind, Object, Snapshot, Upsert
from meshlet.controlplane.policy import resources as r
from meshlet.controlplane.policy.index import (
    Mailbox,
    header_match,
    host_match,
    http_match,
    request_modifier,
)

log = logging.getLogger(__name__)

W = wellknown
OUTBOUND_ROUTE_KINDS: Final = (
    Kind.HTTP_ROUTE,
    Kind.GATEWAY_HTTP_ROUTE,
    Kind.GRPC_ROUTE,
    Kind.GATEWAY_GRPC_ROUTE,
)
DETECT_TIMEOUT: Final = 10.0
QUEUE_CAPACITY: Final = 100
QUEUE_FAILFAST: Final = 3.0
EWMA_DEFAULT_RTT: Final = 0.030
EWMA_DECAY: Final = 10.0
RETRY_MAX_REQUEST_BYTES: Final = 64 * 1024
RETRY_BACKOFF: Final = (0.025, 0.250, 1.0)  # min, max, jitter ratio
ACCRUAL_MAX_FAILURES: Final = 7
ACCRUAL_MIN_PENALTY: Final = 1.0
ACCRUAL_MAX_PENALTY: Final = 60.0
ACCRUAL_JITTER: Final = 0.5
DEFAULT_AUTHORITY_PORT: Final = 80
MAX_BACKENDS: Final = 16
# A Service port's appProtocol (Linkerd's names under meshlet's prefix); any other value is
# served as opaque, as Linkerd serves an unknown one. It wins over the opaque-ports annotation.
APP_PROTOCOLS: Final = {
    "http": "http",
    "kubernetes.io/h2c": "h2",
    "meshlet.io/tcp": "opaque",
    "meshlet.io/opaque": "opaque",
}
# A gRPC backend that cannot be used fails with UNKNOWN: Linkerd's controller sends code 500,
# which its proxy reads as the unknown status it is; meshlet's proxy refuses codes beyond 16.
GRPC_UNKNOWN: Final = 2
GRPC_RETRY_CONDITIONS: Final = (
    "cancelled",
    "deadline-exceeded",
    "internal",
    "resource-exhausted",
    "unavailable",
)

# -- annotations -----------------------------------------------------------------------------

T = TypeVar("T")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)?")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds of Linkerd's annotation durations: a whole number and ms, s, m, h or d (`0`
    alone allowed); ValueError saying what is wrong."""
    value = text.strip()
    if value.startswith("-"):
        raise ValueError(f"{value!r} is negative; a duration is at least 0")
    if "." in value:
        raise ValueError(f"{value!r} has a fraction; use a smaller unit such as 1500ms")
    found = _DURATION.fullmatch(value)
    if found is None:
        raise ValueError(f"{value!r} is not a duration such as 500ms, 10s, 5m, 1h or 1d")
    number, unit = int(found.group(1)), found.group(2)
    if unit is None and number != 0:
        raise ValueError(f"{value!r} has no unit; did you mean {number}s or {number}ms?")
    return number * _UNITS[unit or "s"]


_GATEWAY_DURATION = re.compile(r"([0-9]{1,5}(h|ms|m|s)){1,4}")
_GATEWAY_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")


def parse_gateway_duration(text: str) -> float:
    """Seconds of a Gateway API duration (GEP-2257: up to four number-unit parts in h, m, s
    or ms, such as 1h30m or 500ms); ValueError saying what is wrong."""
    if not _GATEWAY_DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a Gateway API duration such as 10s, 500ms or 1h30m")
    return sum(int(n) * _UNITS[u] for n, u in _GATEWAY_PART.findall(text))


@dataclass(frozen=True, slots=True)
class Timeouts:
    request: float | None = None
    response: float | None = None
    idle: float | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """The retry annotations of a Service or route; HTTP and gRPC routes each read theirs."""

    limit: int | None  # None: 1
    timeout: float | None
    http: tuple[tuple[int, int], ...] | None  # status ranges
    grpc: tuple[str, ...] | None  # GRPC_RETRY_CONDITIONS

    def of(self, protocol: str) -> Retry | None:
        """Itself when it says anything to `protocol` (http or grpc), as Linkerd's separate
        `parse_http_retry` and `parse_grpc_retry` would; else None."""
        conditions = self.http if protocol == "http" else self.grpc
        if self.limit is None and self.timeout is None and conditions is None:
            return None
        return self


@dataclass(frozen=True, slots=True)
class Accrual:
    max_failures: int
    min_penalty: float
    max_penalty: float
    jitter: float


def timeouts_of(notes: Mapping[str, str]) -> Timeouts:
    def get(key: str) -> float | None:
        return parse_duration(notes[key]) if key in notes else None

    return Timeouts(
        request=get(W.TIMEOUT_REQUEST_ANNOTATION),
        response=get(W.TIMEOUT_RESPONSE_ANNOTATION),
        idle=get(W.TIMEOUT_IDLE_ANNOTATION),
    )


def _status(text: str) -> int | None:
    return int(text) if text.isdigit() and 100 <= int(text) < 600 else None


def _http_condition(item: str) -> tuple[int, int]:
    if item.lower() == "5xx":
        return 500, 599
    if item.lower() == "gateway-error":
        return 502, 504
    code = _status(item)
    if code is not None:
        return code, code
    start, sep, end = item.partition("-")
    low, high = _status(start), _status(end)
    if sep and low is not None and high is not None and low <= high:
        return low, high
    raise ValueError(
        f"{item!r} is not a retry condition: use 5xx, gateway-error, a status (503) or a"
        " range (500-504) of statuses 100..599"
    )


def _grpc_condition(item: str) -> str:
    if item.lower() in GRPC_RETRY_CONDITIONS:
        return item.lower()
    raise ValueError(f"{item!r} is not one of {', '.join(GRPC_RETRY_CONDITIONS)}")


def _conditions(
    notes: Mapping[str, str], key: str, read: Callable[[str], T]
) -> tuple[T, ...] | None:
    if key not in notes:
        return None
    try:
        return tuple(read(item.strip()) for item in notes[key].split(","))
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def retry_of(notes: Mapping[str, str]) -> Retry | None:
    """Linkerd's `parse_http_retry` and `parse_grpc_retry` read together: None when no retry
    annotation is set; a limit of 0 or a timeout of 0 counts as unset; the limit defaults to 1."""
    limit = None
    if W.RETRY_LIMIT_ANNOTATION in notes:
        text = notes[W.RETRY_LIMIT_ANNOTATION].strip()
        if not text.isdigit() or int(text) > 65535:
            raise ValueError(f"{W.RETRY_LIMIT_ANNOTATION}: {text!r} is not a number in 0..65535")
        limit = int(text) or None
    timeout = None
    if W.RETRY_TIMEOUT_ANNOTATION in notes:
        try:
            timeout = parse_duration(notes[W.RETRY_TIMEOUT_ANNOTATION]) or None
        except ValueError as exc:
            raise ValueError(f"{W.RETRY_TIMEOUT_ANNOTATION}: {exc}") from None
    http = _conditions(notes, W.RETRY_HTTP_ANNOTATION, _http_condition)
    grpc = _conditions(notes, W.RETRY_GRPC_ANNOTATION, _grpc_condition)
    if limit is None and timeout is None and http is None and grpc is None:
        return None
    return Retry(limit, timeout, http, grpc)


def accrual_of(notes: Mapping[str, str]) -> Accrual | None:
    """Linkerd's `parse_accrual_config` for the `consecutive` mode."""
    mode = notes.get(W.FAILURE_ACCRUAL_ANNOTATION)
    if mode is None:
        return None
    if mode != "consecutive":
        raise ValueError(f"{W.FAILURE_ACCRUAL_ANNOTATION}: {mode!r} is not a mode; use consecutive")

    def value(key: str, read: Callable[[str], float], default: float) -> float:
        if key not in notes:
            return default
        try:
            return read(notes[key])
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None

    def count(text: str) -> float:
        if not text.strip().isdigit() or int(text) >= 2**32:
            raise ValueError(f"{text!r} is not a whole number in 0..4294967295")
        return int(text)

    def ratio(text: str) -> float:
        try:
            number = float(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not 0.0 <= number <= 100.0:
            raise ValueError(f"{text!r} is not within 0..100")
        return number

    max_failures = int(
        value(W.FAILURE_ACCRUAL_MAX_FAILURES_ANNOTATION, count, ACCRUAL_MAX_FAILURES)
    )
    low = value(W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION, parse_duration, ACCRUAL_MIN_PENALTY)
    high = value(W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION, parse_duration, ACCRUAL_MAX_PENALTY)
    jitter = value(W.FAILURE_ACCRUAL_JITTER_RATIO_ANNOTATION, ratio, ACCRUAL_JITTER)
    if high <= 0:
        raise ValueError(f"{W.FAILURE_ACCRUAL_MAX_PENALTY_ANNOTATION}: must be more than 0")
    if low > high:
        raise ValueError(
            f"{W.FAILURE_ACCRUAL_MIN_PENALTY_ANNOTATION}: {low:g}s exceeds the max penalty"
            f" ({high:g}s)"
        )
    return Accrual(max_failures, low, high, jitter)


def _timeouts_checked(notes: Mapping[str, str]) -> Timeouts:
    for key in (W.TIMEOUT_REQUEST_ANNOTATION, W.TIMEOUT_RESPONSE_ANNOTATION,
                W.TIMEOUT_IDLE_ANNOTATION):  # fmt: skip
        if key in notes:
            try:
                parse_duration(notes[key])
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
    return timeouts_of(notes)


def annotation_problems(notes: Mapping[str, str]) -> list[str]:
    """Every bad outbound annotation value, each as `annotation: what is wrong`."""
    out = []
    for read in (accrual_of, _timeouts_checked, retry_of):
        try:
            read(notes)
        except ValueError as exc:
            out.append(str(exc))
    return out


# -- the model -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    cluster_ips: tuple[str, ...]
    opaque_ports: Container[int]
    app_protocols: tuple[tuple[int, str], ...]  # port → http, h2, opaque (spec.ports' appProtocol)
    accrual: Accrual | None
    timeouts: Timeouts
    retry: Retry | None
    problems: tuple[str, ...]  # its bad annotation values (each ignored)


def service_of(obj: Mapping[str, Any]) -> Service | None:
    """The parts of a Service outbound policy reads; None without a name. Lenient as Linkerd:
    a bad annotation value is reported in `problems` and read as absent."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    assert isinstance(meta, dict) and isinstance(spec, dict)
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    raw = meta.get("annotations")
    notes = {k: v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}
    problems = []
    ips = [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if isinstance(ip, str)]
    apps = tuple(
        (p["port"], APP_PROTOCOLS.get(p["appProtocol"].lower(), "opaque"))
        for p in spec.get("ports") or []
        if isinstance(p, dict) and isinstance(p.get("port"), int)
        and isinstance(p.get("appProtocol"), str)
    )  # fmt: skip
    opaque: Container[int] = W.DEFAULT_OPAQUE_PORTS
    if W.OPAQUE_PORTS_ANNOTATION in notes:
        opaque, bad = scan_ports(notes[W.OPAQUE_PORTS_ANNOTATION])
        problems += [f"{W.OPAQUE_PORTS_ANNOTATION}: {b}" for b in bad]

    def read(fn: Callable[[Mapping[str, str]], Any], default: Any) -> Any:
        try:
            return fn(notes)
        except ValueError as exc:
            problems.append(str(exc))
            return default

    return Service(
        namespace=str(meta.get("namespace") or "default"),
        name=name,
        cluster_ips=tuple(ip for ip in ips if ip and ip != "None"),
        opaque_ports=opaque,
        app_protocols=apps,
        accrual=read(accrual_of, None),
        timeouts=read(_timeouts_checked, Timeouts()),
        retry=read(retry_of, None),
        problems=tuple(problems),
    )


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
    modifier: r.HeaderModifier | None = None
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
    matches: tuple[r.HttpMatch | r.GrpcMatch, ...]
    filters: tuple[Filter, ...]
    backends: tuple[Backend, ...]
    request_timeout: float | None  # Gateway API `timeouts.request`


@dataclass(frozen=True, slots=True)
class Route:
    meta: r.Meta
    group: str
    kind: str  # HTTPRoute or GRPCRoute
    parents: tuple[tuple[str, str, int | None], ...]  # (namespace, Service, port or every port)
    hostnames: tuple[str, ...]
    rules: tuple[Rule, ...]
    timeouts: Timeouts
    retry: Retry | None


def _redirect(c: r.Check, value: Any, path: str) -> Redirect:
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


HTTP_FILTERS: Final = ("RequestHeaderModifier", "ResponseHeaderModifier", "RequestRedirect")
BACKEND_FILTERS: Final = ("RequestHeaderModifier", "ResponseHeaderModifier")
GRPC_FILTERS: Final = ("RequestHeaderModifier",)  # what outbound GrpcRoute.Filter can carry


def _filters(c: r.Check, value: Any, path: str, kinds: tuple[str, ...]) -> tuple[Filter, ...]:
    out = []
    for i, item in enumerate(c.array(value, path, limit=r.MAX_FILTERS)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        kind = c.string(entry.get("type"), f"{at}.type", required=True)
        if kind in kinds and kind in ("RequestHeaderModifier", "ResponseHeaderModifier"):
            key = kind[0].lower() + kind[1:]
            out.append(
                Filter(kind, modifier=r.read_header_modifier(c, entry.get(key), f"{at}.{key}"))
            )
        elif kind in kinds and kind == "RequestRedirect":
            redirect = _redirect(c, entry.get("requestRedirect"), f"{at}.requestRedirect")
            out.append(Filter(kind, redirect=redirect))
        elif kind is not None:
            c.fail(f"{at}.type", f"{kind!r} is not supported; use one of {', '.join(kinds)}")
    return tuple(out)


def _backends(c: r.Check, value: Any, path: str, namespace: str) -> tuple[Backend, ...]:
    """backendRefs as Linkerd reads them: a kind other than Service and a Service without a
    port become invalid backends (requests to them fail), not a refused route."""
    out = []
    for i, item in enumerate(c.array(value, path, limit=MAX_BACKENDS)):
        at = f"{path}[{i}]"
        entry = c.mapping(item, at, required=True) or {}
        ref = r.read_ref(c, {"kind": "Service", **entry}, at, namespaced=True)  # the API's default
        weight = c.integer(entry.get("weight"), f"{at}.weight", low=0, high=1_000_000)
        weight = 1 if weight is None else weight
        port = c.integer(entry.get("port"), f"{at}.port", low=1, high=65535)
        filters = _filters(c, entry.get("filters"), f"{at}.filters", BACKEND_FILTERS)
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


def _service_parents(
    c: r.Check, spec: Mapping[str, Any], meta: r.Meta
) -> tuple[tuple[str, str, int | None], ...]:
    out = []
    path = "spec.parentRefs"
    for i, item in enumerate(c.array(spec.get("parentRefs"), path, limit=r.MAX_PARENT_REFS)):
        if not isinstance(item, Mapping) or str(item.get("kind", "")).lower() != "service":
            continue
        if item.get("group", "core") not in ("", "core"):
            continue
        at = f"{path}[{i}]"
        ref = r.read_ref(c, item, at, namespaced=True)
        port = c.integer(item.get("port"), f"{at}.port", low=1, high=65535)
        if ref is not None:
            out.append((ref.namespace or meta.namespace, ref.name, port))
    return tuple(out)


def _grpc_matches(c: r.Check, value: Any, path: str) -> tuple[r.GrpcMatch, ...]:
    out = []
    for j, m in enumerate(c.array(value, path, limit=r.MAX_MATCHES)):
        at = f"{path}[{j}]"
        entry = c.mapping(m, at, required=True) or {}
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
        headers = r.read_value_matches(
            c, entry.get("headers"), f"{at}.headers", r.MAX_HEADER_MATCHES, True
        )
        out.append(r.GrpcMatch(service or None, method or None, headers))
    return tuple(out)


def route_of(obj: Mapping[str, Any]) -> Route:
    """The outbound reading of an HTTPRoute or GRPCRoute; r.Invalid naming every problem."""
    c = r.Check()
    meta = r.read_meta(c, obj)
    kind = str(obj.get("kind"))
    spec = c.mapping(obj.get("spec"), "spec", required=True) or {}
    parents = _service_parents(c, spec, meta)
    hostnames = r.read_hostnames(c, spec)
    rules = []
    for i, item in enumerate(c.array(spec.get("rules"), "spec.rules", limit=r.MAX_RULES)):
        at = f"spec.rules[{i}]"
        rule = c.mapping(item, at, required=True) or {}
        matches: tuple[r.HttpMatch | r.GrpcMatch, ...]
        timeout = None
        if kind == "GRPCRoute":
            matches = _grpc_matches(c, rule.get("matches"), f"{at}.matches")
        else:
            matches = tuple(
                r.read_http_match(c, m, f"{at}.matches[{j}]")
                for j, m in enumerate(
                    c.array(rule.get("matches"), f"{at}.matches", limit=r.MAX_MATCHES)
                )
            )
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
        kinds = GRPC_FILTERS if kind == "GRPCRoute" else HTTP_FILTERS
        filters = _filters(c, rule.get("filters"), f"{at}.filters", kinds)
        backends = _backends(c, rule.get("backendRefs"), f"{at}.backendRefs", meta.namespace)
        rules.append(Rule(matches, filters, backends, timeout))
    raw = (
        obj.get("metadata", {}).get("annotations")
        if isinstance(obj.get("metadata"), dict)
        else None
    )
    notes = {k: v for k, v in raw.items() if isinstance(v, str)} if isinstance(raw, dict) else {}
    timeouts, retry = Timeouts(), None
    try:
        timeouts = _timeouts_checked(notes)
    except ValueError as exc:
        c.fail("metadata.annotations", str(exc))
    try:
        retry = retry_of(notes)
    except ValueError as exc:
        c.fail("metadata.annotations", str(exc))
    if c.problems:
        raise r.Invalid(c.problems)
    group = str(obj.get("apiVersion", "")).split("/")[0]
    return Route(meta, group, kind, parents, hostnames, tuple(rules), timeouts, retry)


# -- the translation (pure) ------------------------------------------------------------------


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def authority(name: str, namespace: str, port: int, cluster_domain: str) -> str:
    return f"{name}.{namespace}.svc.{cluster_domain}:{port}"


def _service_meta(name: str, namespace: str, port: int) -> meta_pb2.Metadata:
    return meta_pb2.Metadata(
        resource=meta_pb2.Resource(
            group="core", kind="Service", name=name, namespace=namespace, port=port
        )
    )


def _queue() -> outbound_pb2.Queue:
    return outbound_pb2.Queue(capacity=QUEUE_CAPACITY, failfast_timeout=_duration(QUEUE_FAILFAST))


def _balancer(name: str, namespace: str, port: int, cluster_domain: str) -> outbound_pb2.Backend:
    B = outbound_pb2.Backend
    return B(
        metadata=_service_meta(name, namespace, port),
        queue=_queue(),
        balancer=B.BalanceP2c(
            discovery=B.EndpointDiscovery(
                dst=B.EndpointDiscovery.DestinationGet(
                    path=authority(name, namespace, port, cluster_domain)
                )
            ),
            peak_ewma=B.BalanceP2c.PeakEwma(
                default_rtt=_duration(EWMA_DEFAULT_RTT), decay=_duration(EWMA_DECAY)
            ),
        ),
    )


def _backoff(low: float, high: float, jitter: float) -> outbound_pb2.ExponentialBackoff:
    return outbound_pb2.ExponentialBackoff(
        min_backoff=_duration(low), max_backoff=_duration(high), jitter_ratio=jitter
    )


def _accrual(accrual: Accrual | None) -> outbound_pb2.FailureAccrual | None:
    if accrual is None:
        return None
    F = outbound_pb2.FailureAccrual
    return F(
        consecutive_failures=F.ConsecutiveFailures(
            max_failures=accrual.max_failures,
            backoff=_backoff(accrual.min_penalty, accrual.max_penalty, accrual.jitter),
        )
    )


def _timeouts(t: Timeouts) -> http_route_pb2.Timeouts:
    out = http_route_pb2.Timeouts()
    for name in ("request", "response", "idle"):
        value = getattr(t, name)
        if value is not None:
            getattr(out, name).CopyFrom(_duration(value))
    return out


def _http_retry(retry: Retry) -> outbound_pb2.HttpRoute.Retry:
    R = outbound_pb2.HttpRoute.Retry
    return R(
        max_retries=retry.limit or 1,
        max_request_bytes=RETRY_MAX_REQUEST_BYTES,
        backoff=_backoff(*RETRY_BACKOFF),
        conditions=R.Conditions(
            status_ranges=[R.Conditions.StatusRange(start=a, end=b) for a, b in retry.http or ()]
        ),
        timeout=_duration(retry.timeout) if retry.timeout is not None else None,
    )


def _grpc_retry(retry: Retry) -> outbound_pb2.GrpcRoute.Retry:
    R = outbound_pb2.GrpcRoute.Retry
    chosen = set(retry.grpc or ())
    return R(
        max_retries=retry.limit or 1,
        max_request_bytes=RETRY_MAX_REQUEST_BYTES,
        backoff=_backoff(*RETRY_BACKOFF),
        conditions=R.Conditions(
            cancelled="cancelled" in chosen,
            deadine_exceeded="deadline-exceeded" in chosen,
            internal="internal" in chosen,
            resource_exhausted="resource-exhausted" in chosen,
            unavailable="unavailable" in chosen,
        ),
        timeout=_duration(retry.timeout) if retry.timeout is not None else None,
    )


def _redirect_pb(d: Redirect) -> http_route_pb2.RequestRedirect:
    out = http_route_pb2.RequestRedirect(host=d.host or "", port=d.port or 0, status=d.status)
    if d.scheme is not None:
        out.scheme.registered = (
            http_types_pb2.Scheme.HTTPS if d.scheme == "https" else http_types_pb2.Scheme.HTTP
        )
    if d.path is not None:
        kind, value = d.path
        out.path.CopyFrom(
            http_route_pb2.PathModifier(full=value)
            if kind == "ReplaceFullPath"
            else http_route_pb2.PathModifier(prefix=value)
        )
    return out


def _response_modifier(m: r.HeaderModifier) -> http_route_pb2.ResponseHeaderModifier:
    req = request_modifier(m)
    return http_route_pb2.ResponseHeaderModifier(add=req.add, set=req.set, remove=req.remove)


def _filter(f: Filter, message: Any) -> Any:
    """`message` is outbound_pb2.HttpRoute.Filter or GrpcRoute.Filter."""
    if f.kind == "RequestHeaderModifier" and f.modifier is not None:
        return message(request_header_modifier=request_modifier(f.modifier))
    if f.kind == "ResponseHeaderModifier" and f.modifier is not None:
        return message(response_header_modifier=_response_modifier(f.modifier))
    assert f.redirect is not None
    return message(redirect=_redirect_pb(f.redirect))


def _ordered(routes: list[Route]) -> list[Route]:
    """Linkerd's `timestamp_then_name`: the oldest first, those without a timestamp last."""
    return sorted(routes, key=lambda rt: (rt.meta.created == "", rt.meta.created, rt.meta.name))


@dataclass(slots=True)
class Space:
    """One namespace's Services and Service-parented routes, the routes also by the Services
    they name (namespace, name)."""

    services: dict[str, Service] = field(default_factory=dict)
    routes: dict[tuple[Kind, str], Route] = field(default_factory=dict)
    by_parent: dict[tuple[str, str], dict[tuple[Kind, str], Route]] = field(default_factory=dict)

    def put(self, key: tuple[Kind, str], route: Route) -> None:
        self.drop(key)
        self.routes[key] = route
        for namespace, name, _ in route.parents:
            self.by_parent.setdefault((namespace, name), {})[key] = route

    def drop(self, key: tuple[Kind, str]) -> None:
        route = self.routes.pop(key, None)
        for namespace, name, _ in route.parents if route is not None else ():
            named = self.by_parent.get((namespace, name), {})
            named.pop(key, None)
            if not named:
                self.by_parent.pop((namespace, name), None)


class Translator:
    """Computes the OutboundPolicy of a Service port from the index's namespaces."""

    def __init__(self, cluster_domain: str, spaces: Mapping[str, Space]) -> None:
        self.cluster_domain = cluster_domain
        self.spaces = spaces

    def policy(self, svc: Service, port: int, client_ns: str = "") -> outbound_pb2.OutboundPolicy:
        """The policy of `svc`'s `port` for clients in `client_ns`: the routes of the Service's
        namespace (producer routes) and those of the client's namespace that name it
        (consumer routes), together, as Linkerd's index joins them."""
        P = outbound_pb2.ProxyProtocol
        backend = _balancer(svc.name, svc.namespace, port, self.cluster_domain)
        attached = self.attached(svc, port, client_ns)
        opaque = P.Opaque(routes=[self._opaque_route(backend)])
        accrual = _accrual(svc.accrual)
        grpc = [rt for rt in attached if rt.kind == "GRPCRoute"]
        http = [rt for rt in attached if rt.kind == "HTTPRoute"]
        app = dict(svc.app_protocols).get(port)
        if app is None and port in svc.opaque_ports:
            app = "opaque"
        routes = [self._http_route(svc, rt, backend) for rt in http] or [
            self._default_route(svc, backend)
        ]
        if app == "opaque":
            protocol = P(opaque=opaque)
        elif grpc and app != "http":
            protocol = P(grpc=P.Grpc(routes=[self._grpc_route(svc, rt, backend) for rt in grpc],
                                     failure_accrual=accrual))  # fmt: skip
        elif app == "http":
            protocol = P(http1=P.Http1(routes=routes, failure_accrual=accrual))
        elif app == "h2":
            protocol = P(http2=P.Http2(routes=routes, failure_accrual=accrual))
        else:
            protocol = P(
                detect=P.Detect(
                    timeout=_duration(DETECT_TIMEOUT),
                    opaque=opaque,
                    http1=P.Http1(routes=routes, failure_accrual=accrual),
                    http2=P.Http2(routes=routes, failure_accrual=accrual),
                )
            )
        return outbound_pb2.OutboundPolicy(
            protocol=protocol, metadata=_service_meta(svc.name, svc.namespace, port)
        )

    def attached(self, svc: Service, port: int, client_ns: str = "") -> list[Route]:
        """The routes serving `svc`'s `port` to clients in `client_ns`, in Linkerd's order."""
        target = (svc.namespace, svc.name)
        return _ordered(
            [
                rt
                for ns in dict.fromkeys((svc.namespace, client_ns or svc.namespace))
                for rt in (self.spaces.get(ns) or Space()).by_parent.get(target, {}).values()
                if any((n, s) == target and p in (None, port) for n, s, p in rt.parents)
            ]
        )

    def backends(self, svc: Service, port: int, client_ns: str = "") -> frozenset[Key]:
        """The Services the policy names as backends besides `svc` itself (their existence
        changes it)."""
        return frozenset(
            (b.namespace, b.name)
            for rt in self.attached(svc, port, client_ns)
            for rule in rt.rules
            for b in rule.backends
            if b.invalid is None
        )

    def _opaque_route(self, backend: outbound_pb2.Backend) -> outbound_pb2.OpaqueRoute:
        Op = outbound_pb2.OpaqueRoute
        return Op(
            metadata=meta_pb2.Metadata(default="opaq"),
            rules=[
                Op.Rule(
                    backends=Op.Distribution(
                        first_available=Op.Distribution.FirstAvailable(
                            backends=[Op.RouteBackend(backend=backend)]
                        )
                    )
                )
            ],
        )

    def _default_route(self, svc: Service, backend: outbound_pb2.Backend) -> outbound_pb2.HttpRoute:
        H = outbound_pb2.HttpRoute
        rule = H.Rule(
            matches=[http_route_pb2.HttpRouteMatch(path=http_route_pb2.PathMatch(prefix="/"))],
            backends=H.Distribution(
                first_available=H.Distribution.FirstAvailable(
                    backends=[H.RouteBackend(backend=backend)]
                )
            ),
            timeouts=_timeouts(svc.timeouts),
            retry=_http_retry(svc.retry) if svc.retry and svc.retry.of("http") else None,
        )
        if svc.timeouts.request is not None:
            rule.requestTimeout.CopyFrom(_duration(svc.timeouts.request))
        return H(metadata=meta_pb2.Metadata(default="http"), rules=[rule])

    def _exists(self, namespace: str, name: str) -> bool:
        return name in (self.spaces.get(namespace) or Space()).services

    def _weighted(self, b: Backend, route_cls: Any) -> Any:
        """A WeightedRouteBackend of `route_cls` (outbound_pb2.HttpRoute or GrpcRoute): an
        invalid or missing backend fails its requests with a 500, as Linkerd's does."""
        if b.invalid is None and self._exists(b.namespace, b.name):
            assert b.port is not None
            backend = _balancer(b.name, b.namespace, b.port, self.cluster_domain)
            filters = [_filter(f, route_cls.Filter) for f in b.filters]
            return route_cls.WeightedRouteBackend(
                weight=b.weight, backend=route_cls.RouteBackend(backend=backend, filters=filters)
            )
        if b.invalid is None:
            assert b.port is not None
            metadata = _service_meta(b.name, b.namespace, b.port)
            message = f"Service not found {b.name}"
        else:
            metadata, message = meta_pb2.Metadata(default="invalid"), b.invalid
        injector = http_route_pb2.HttpFailureInjector(status=500, message=message)
        if route_cls is outbound_pb2.GrpcRoute:
            fault = route_cls.Filter(
                failure_injector=grpc_route_pb2.GrpcFailureInjector(
                    code=GRPC_UNKNOWN, message=message
                )
            )
        else:
            fault = route_cls.Filter(failure_injector=injector)
        return route_cls.WeightedRouteBackend(
            weight=b.weight,
            backend=route_cls.RouteBackend(
                backend=outbound_pb2.Backend(metadata=metadata, queue=_queue()), filters=[fault]
            ),
        )

    def _distribution(self, rule: Rule, backend: outbound_pb2.Backend, route_cls: Any) -> Any:
        D = route_cls.Distribution
        if not rule.backends:
            return D(
                first_available=D.FirstAvailable(backends=[route_cls.RouteBackend(backend=backend)])
            )
        backends = rule.backends
        if not any(b.weight for b in backends):  # the Gateway API: no traffic anywhere, 500s
            backends = (Backend(1, invalid="every backendRef of the rule has weight 0"),)
        return D(
            random_available=D.RandomAvailable(
                backends=[self._weighted(b, route_cls) for b in backends]
            )
        )

    def _effective(
        self, svc: Service, rt: Route, rule: Rule, protocol: str
    ) -> tuple[Timeouts, Retry | None]:
        """Linkerd's precedence: the route's annotations, then the rule's `timeouts.request`,
        and a route with no timeouts at all takes the Service's (the same for retries)."""
        t = rt.timeouts
        if t.request is None and rule.request_timeout is not None:
            t = Timeouts(rule.request_timeout, t.response, t.idle)
        if t == Timeouts():
            t = svc.timeouts
        own = rt.retry.of(protocol) if rt.retry is not None else None
        return t, own or (svc.retry.of(protocol) if svc.retry is not None else None)

    def _route_meta(self, rt: Route) -> meta_pb2.Metadata:
        return meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group=rt.group, kind=rt.kind, name=rt.meta.name, namespace=rt.meta.namespace
            )
        )

    def _http_route(
        self, svc: Service, rt: Route, backend: outbound_pb2.Backend
    ) -> outbound_pb2.HttpRoute:
        H = outbound_pb2.HttpRoute
        rules = []
        for rule in rt.rules:
            timeouts, retry = self._effective(svc, rt, rule, "http")
            out = H.Rule(
                matches=[http_match(m) for m in rule.matches if isinstance(m, r.HttpMatch)],
                filters=[_filter(f, H.Filter) for f in rule.filters],
                backends=self._distribution(rule, backend, H),
                timeouts=_timeouts(timeouts),
                retry=_http_retry(retry) if retry is not None else None,
            )
            if timeouts.request is not None:
                out.requestTimeout.CopyFrom(_duration(timeouts.request))
            rules.append(out)
        return H(
            metadata=self._route_meta(rt), hosts=[host_match(h) for h in rt.hostnames], rules=rules
        )

    def _grpc_route(
        self, svc: Service, rt: Route, backend: outbound_pb2.Backend
    ) -> outbound_pb2.GrpcRoute:
        G = outbound_pb2.GrpcRoute
        rules = []
        for rule in rt.rules:
            timeouts, retry = self._effective(svc, rt, rule, "grpc")
            out = G.Rule(
                matches=[
                    grpc_route_pb2.GrpcRouteMatch(
                        rpc=grpc_route_pb2.GrpcRpcMatch(
                            service=m.service or "", method=m.method or ""
                        ),
                        headers=[header_match(h) for h in m.headers],
                    )
                    for m in rule.matches
                    if isinstance(m, r.GrpcMatch)
                ],
                filters=[_filter(f, G.Filter) for f in rule.filters],
                backends=self._distribution(rule, backend, G),
                timeouts=_timeouts(timeouts),
                retry=_grpc_retry(retry) if retry is not None else None,
            )
            if timeouts.request is not None:
                out.requestTimeout.CopyFrom(_duration(timeouts.request))
            rules.append(out)
        return G(
            metadata=self._route_meta(rt), hosts=[host_match(h) for h in rt.hostnames], rules=rules
        )


# -- targets ---------------------------------------------------------------------------------


class TargetError(ValueError):
    """A TrafficSpec target that is malformed (INVALID_ARGUMENT)."""


def parse_authority(text: str, cluster_domain: str) -> tuple[str, str, int] | None:
    """(namespace, service, port) of `name.ns.svc[.cluster-domain][:port]` (port 80 when
    absent); None when the host is not a Service's name (Linkerd: NOT_FOUND); TargetError
    when it is not an authority at all."""
    if not text or len(text) > 512 or any(ch in text for ch in "/?#@ \t"):
        raise TargetError(f"invalid authority: {text[:80]!r}")
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    port = DEFAULT_AUTHORITY_PORT
    if sep:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise TargetError(f"invalid authority: {text!r} has no port in 1..65535")
        port = int(port_text)
    host = host.rstrip(".").lower()
    suffix = "." + cluster_domain
    if host.endswith(suffix):
        host = host[: -len(suffix)]
    parts = host.split(".")
    if len(parts) != 3 or parts[2] != "svc" or not parts[0] or not parts[1]:
        return None
    return parts[1], parts[0], port


def parse_addr(addr: net_pb2.TcpAddress) -> tuple[str, int]:
    """(IP text, port) of a TcpAddress; TargetError when it has no IP or a bad port."""
    if not 1 <= addr.port <= 65535:
        raise TargetError(f"invalid port: {addr.port}; expected 1..65535")
    which = addr.ip.WhichOneof("ip") if addr.HasField("ip") else None
    if which == "ipv4":
        return str(ipaddress.IPv4Address(addr.ip.ipv4)), addr.port
    if which == "ipv6":
        value = (addr.ip.ipv6.first << 64) | addr.ip.ipv6.last
        return str(ipaddress.IPv6Address(value)), addr.port
    raise TargetError("invalid target: the address has no IP")


# -- the index (state and watches) -----------------------------------------------------------

Key = tuple[str, str]  # (namespace, name)
WatchKey = tuple[str, str, int, str]  # (namespace, service, port, client namespace)


@dataclass(slots=True)
class _Watch:
    message: bytes
    backends: frozenset[Key]  # the other Services its policy depends on
    mailboxes: set[Mailbox] = field(default_factory=set)


class OutboundIndex:
    """Applies source events (Services and routes; other kinds are ignored); answers `get`
    and keeps `subscribe`d mailboxes current."""

    def __init__(self, cluster_domain: str = W.CLUSTER_DOMAIN) -> None:
        self.cluster_domain = cluster_domain
        self.spaces: dict[str, Space] = {}
        self.translator = Translator(cluster_domain, self.spaces)
        self._watches: dict[WatchKey, _Watch] = {}
        self._by_ip: dict[str, Key] = {}
        self.recomputed = 0  # watches recomputed (for tests and metrics)
        self._reported: dict[tuple[Kind, str, str], tuple[str, ...]] = {}
        self.invalid = 0

    # -- questions --

    def service(self, namespace: str, name: str) -> Service | None:
        space = self.spaces.get(namespace)
        return space.services.get(name) if space is not None else None

    def by_ip(self, ip: str) -> Service | None:
        key = self._by_ip.get(ip)
        return self.service(*key) if key is not None else None

    def get(
        self, namespace: str, name: str, port: int, client_ns: str = ""
    ) -> outbound_pb2.OutboundPolicy | None:
        """The policy of a Service port for clients in `client_ns` (default: its own)."""
        svc = self.service(namespace, name)
        return self.translator.policy(svc, port, client_ns) if svc is not None else None

    def subscribe(
        self, namespace: str, name: str, port: int, mailbox: Mailbox, client_ns: str = ""
    ) -> bool:
        """Puts the port's policy in `mailbox` now and at each change; False: no such Service."""
        svc = self.service(namespace, name)
        if svc is None:
            return False
        key = (namespace, name, port, client_ns or namespace)
        watch = self._watches.get(key)
        if watch is None:
            policy = self.translator.policy(svc, port, key[3])
            backends = self.translator.backends(svc, port, key[3])
            watch = _Watch(policy.SerializeToString(deterministic=True), backends)
            self._watches[key] = watch
        watch.mailboxes.add(mailbox)
        mailbox.put(watch.message)
        return True

    def unsubscribe(
        self, namespace: str, name: str, port: int, mailbox: Mailbox, client_ns: str = ""
    ) -> None:
        key = (namespace, name, port, client_ns or namespace)
        watch = self._watches.get(key)
        if watch is None:
            return
        watch.mailboxes.discard(mailbox)
        if not watch.mailboxes:
            del self._watches[key]

    @property
    def watched(self) -> int:
        return len(self._watches)

    # -- changes --

    def apply(self, event: Event) -> int:
        """Applies a source event; the number of watches whose policy changed."""
        if event.kind is not Kind.SERVICE and event.kind not in OUTBOUND_ROUTE_KINDS:
            return 0
        affects: Callable[[WatchKey, _Watch], bool] | None = None  # None: every watch
        if isinstance(event, Snapshot):
            self._replace(event.kind, event.objects)
        else:
            key = _key(event.obj)
            if key is None:
                return 0
            if event.kind is Kind.SERVICE:  # its own watches, and those routing to it
                affects = lambda w, watch: w[:2] == key or key in watch.backends  # noqa: E731
            else:  # a route: its namespace's Services, and clients there
                affects = lambda w, _: key[0] in (w[0], w[3])  # noqa: E731
            if isinstance(event, Upsert):
                if not self._upsert(event.kind, event.obj):
                    return 0  # a route read the same (its status written, say): nothing to do
            else:
                self._remove(event.kind, *key)
        return self._refresh(affects)

    def _replace(self, kind: Kind, objects: tuple[Object, ...]) -> None:
        seen = set()
        for obj in objects:
            self._upsert(kind, obj)
            key = _key(obj)
            if key is not None:
                seen.add(key)
        for namespace, space in list(self.spaces.items()):
            names = (
                list(space.services)
                if kind is Kind.SERVICE
                else [n for k, n in space.routes if k is kind]
            )
            for name in names:
                if (namespace, name) not in seen:
                    self._remove(kind, namespace, name)

    def _upsert(self, kind: Kind, obj: Object) -> bool:
        """False when `obj` is a route that reads as it did (so no watch can change)."""
        key = _key(obj)
        if key is None:
            return False
        namespace, name = key
        space = self.spaces.setdefault(namespace, Space())
        if kind is Kind.SERVICE:
            svc = service_of(obj)
            if svc is None:
                return False
            if svc.problems:
                self._report(kind, namespace, name, list(svc.problems), "ignored annotations of")
            else:
                self._reported.pop((kind, namespace, name), None)
            self._forget_ips(space.services.get(name))
            space.services[name] = svc
            self._by_ip.update((ip, key) for ip in svc.cluster_ips)
            return True
        if not _names_a_service(obj):
            space.drop((kind, name))
            return True
        try:
            route = route_of(obj)
        except r.Invalid as exc:
            self._report(kind, namespace, name, exc.problems, "ignored")
            space.drop((kind, name))
            return True
        self._reported.pop((kind, namespace, name), None)
        if route.parents and space.routes.get((kind, name)) == route:
            return False
        if route.parents:
            space.put((kind, name), route)
        else:
            space.drop((kind, name))
        return True

    def _remove(self, kind: Kind, namespace: str, name: str) -> None:
        space = self.spaces.get(namespace)
        if space is None:
            return
        if kind is Kind.SERVICE:
            gone = space.services.pop(name, None)
            self._forget_ips(gone)
            if gone is not None:
                for key in [k for k in self._watches if k[:2] == (namespace, name)]:
                    for mailbox in self._watches.pop(key).mailboxes:
                        mailbox.close()
            return
        space.drop((kind, name))

    def _forget_ips(self, svc: Service | None) -> None:
        if svc is None:
            return
        for ip in svc.cluster_ips:
            if self._by_ip.get(ip) == (svc.namespace, svc.name):
                del self._by_ip[ip]

    def _refresh(self, affects: Callable[[WatchKey, _Watch], bool] | None) -> int:
        """Recomputes the watches `affects` names (None: all); publishes the changed ones."""
        changed = 0
        for key, watch in self._watches.items():
            if affects is not None and not affects(key, watch):
                continue
            namespace, name, port, client_ns = key
            svc = self.service(namespace, name)
            if svc is None:
                continue
            self.recomputed += 1
            watch.backends = self.translator.backends(svc, port, client_ns)
            policy = self.translator.policy(svc, port, client_ns)
            message = policy.SerializeToString(deterministic=True)
            if message == watch.message:
                continue
            watch.message = message
            changed += 1
            for mailbox in watch.mailboxes:
                mailbox.put(message)
        return changed

    def _report(
        self, kind: Kind, namespace: str, name: str, problems: list[str], what: str
    ) -> None:
        key = (kind, namespace, name)
        if self._reported.get(key) == tuple(problems):
            return
        self._reported[key] = tuple(problems)
        self.invalid += 1
        log.warning("%s %s %s/%s: %s", what, kind.kind, namespace, name, "; ".join(problems))


def _key(obj: Object) -> tuple[str, str] | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    namespace = meta.get("namespace")
    return (namespace if isinstance(namespace, str) and namespace else "default"), meta["name"]


def route_problems(obj: Mapping[str, Any]) -> list[str]:
    """The outbound problems of a route with a Service parent (resources.problems adds them
    to the inbound ones, so the validating webhook refuses what outbound would ignore)."""
    if not _names_a_service(obj):
        return []
    try:
        route_of(obj)
    except r.Invalid as exc:
        return exc.problems
    return []


def _names_a_service(obj: Mapping[str, Any]) -> bool:
    """Whether a route has a Service parent (routes of Servers only are inbound's)."""
    spec = obj.get("spec")
    refs = spec.get("parentRefs") if isinstance(spec, dict) else None
    return isinstance(refs, list) and any(
        isinstance(ref, dict)
        and str(ref.get("kind", "")).lower() == "service"
        and ref.get("group", "core") in ("", "core")
        for ref in refs
    )
