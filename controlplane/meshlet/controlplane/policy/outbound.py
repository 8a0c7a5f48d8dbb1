"""Owns the outbound translation: the `OutboundPolicy` of a Service port for the clients of one
namespace, built from the Service and the routes that name it (their one model,
meshlet.controlplane.policy.routes); the state and the watches are outbound_index's.

The translation is Linkerd's policy controller's (`k8s/index/src/outbound/index.rs`,
`grpc/src/outbound.rs` and its `http`/`grpc` modules): a Service port's policy is a protocol
(Opaque for an opaque port, gRPC when GRPCRoutes attach, else Detect with the HTTP routes), the
routes ordered oldest first (then by name), each rule's backends a random weighted choice, a
`default` route to the Service itself when no route attaches. Routes in the Service's namespace
serve every client; routes in another namespace that name it serve that namespace's clients
(Linkerd's producer and consumer routes). A Service's retry, timeout and
failure-accrual annotations apply to every route that sets none of its own; a bad annotation
value is logged and ignored, as Linkerd does (the validating webhook does not review Services).
A route whose own annotations are bad is ignored, named in the log, as any invalid route is.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from google.protobuf import duration_pb2

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    meta_pb2,
    outbound_pb2,
    wellknown,
)
from meshlet.api.ports import scan_ports
from meshlet.controlplane.k8s.events import Kind
from meshlet.controlplane.policy.annotations import (
    Accrual,
    Retry,
    Timeouts,
    accrual_of,
    checked_timeouts,
    retry_of,
)
from meshlet.controlplane.policy.routes import (
    Backend,
    Filter,
    GrpcMatch,
    HeaderModifier,
    HttpMatch,
    Redirect,
    Route,
    Rule,
)
from meshlet.controlplane.policy.wire import header_match, host_match, http_match, request_modifier

W = wellknown
DETECT_TIMEOUT: Final = 10.0
QUEUE_CAPACITY: Final = 100
QUEUE_FAILFAST: Final = 3.0
EWMA_DEFAULT_RTT: Final = 0.030
EWMA_DECAY: Final = 10.0
RETRY_MAX_REQUEST_BYTES: Final = 64 * 1024
RETRY_BACKOFF: Final = (0.025, 0.250, 1.0)  # min, max, jitter ratio
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
        timeouts=read(checked_timeouts, Timeouts()),
        retry=read(retry_of, None),
        problems=tuple(problems),
    )


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


def _response_modifier(m: HeaderModifier) -> http_route_pb2.ResponseHeaderModifier:
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


Key = tuple[str, str]  # (namespace, name)


@dataclass(slots=True)
class Space:
    """One namespace's Services, and its Service-parented routes (the catalog's models) by the
    Services they name (namespace, name)."""

    services: dict[str, Service] = field(default_factory=dict)
    by_parent: dict[Key, dict[tuple[Kind, str], Route]] = field(default_factory=dict)

    def put(self, key: tuple[Kind, str], route: Route) -> None:
        for namespace, name, _ in route.services:
            self.by_parent.setdefault((namespace, name), {})[key] = route

    def drop(self, key: tuple[Kind, str], route: Route) -> None:
        for namespace, name, _ in route.services:
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
                if any((n, s) == target and p in (None, port) for n, s, p in rt.services)
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
                matches=[http_match(m) for m in rule.matches if isinstance(m, HttpMatch)],
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
                    if isinstance(m, GrpcMatch)
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
