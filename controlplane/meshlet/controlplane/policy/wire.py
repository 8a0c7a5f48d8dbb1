"""Owns the protobuf forms of the route model's parts that both answers carry, the inbound
(`Server`) and the outbound (`OutboundPolicy`): host, header, path, query parameter and method
matches, and request header modifiers, each as Linkerd's policy controller encodes them."""

from __future__ import annotations

from meshlet.api import http_route_pb2, http_types_pb2
from meshlet.controlplane.policy.routes import HeaderModifier, HttpMatch, ValueMatch


def host_match(host: str) -> http_route_pb2.HostMatch:
    if host.startswith("*."):
        labels = list(reversed(host[2:].split(".")))
        return http_route_pb2.HostMatch(
            suffix=http_route_pb2.HostMatch.Suffix(reverse_labels=labels)
        )
    return http_route_pb2.HostMatch(exact=host)


def header_match(m: ValueMatch) -> http_route_pb2.HeaderMatch:
    if m.regex:
        return http_route_pb2.HeaderMatch(name=m.name, regex=m.value)
    return http_route_pb2.HeaderMatch(name=m.name, exact=m.value.encode())


def http_match(m: HttpMatch) -> http_route_pb2.HttpRouteMatch:
    out = http_route_pb2.HttpRouteMatch(headers=[header_match(h) for h in m.headers])
    if m.path is not None:
        kind, value = m.path
        field_name = {"Exact": "exact", "PathPrefix": "prefix"}.get(kind, "regex")
        out.path.CopyFrom(http_route_pb2.PathMatch(**{field_name: value}))
    for q in m.query_params:
        out.query_params.append(
            http_route_pb2.QueryParamMatch(name=q.name, regex=q.value)
            if q.regex
            else http_route_pb2.QueryParamMatch(name=q.name, exact=q.value)
        )
    if m.method is not None:
        out.method.registered = http_types_pb2.HttpMethod.Registered.Value(m.method)
    return out


def request_modifier(f: HeaderModifier) -> http_route_pb2.RequestHeaderModifier:
    def headers(pairs: tuple[tuple[str, str], ...]) -> http_types_pb2.Headers:
        return http_types_pb2.Headers(
            headers=[http_types_pb2.Headers.Header(name=n, value=v.encode()) for n, v in pairs]
        )

    return http_route_pb2.RequestHeaderModifier(
        add=headers(f.add), set=headers(f.set), remove=list(f.remove)
    )
