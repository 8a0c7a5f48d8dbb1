"""The inbound policy and tap contracts match linkerd2-proxy-api's, field by field.

The table lists, for every message `inbound.proto` uses (with those of `http_route.proto`,
`grpc_route.proto`, `meta.proto`, `net.proto` and `http_types.proto` it reaches), each field's
name, number, whether it repeats, and its type, as in linkerd2-proxy-api. A linkerd2-proxy
decodes by number and type only, so these are what must not drift.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from meshlet.api import (
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
    tap_pb2,
)

_PREFIX = "io.linkerd.proxy."
_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in vars(FieldDescriptor).items()
    if name.startswith("TYPE_")
}

LINKERD = {
    "grpc_route.GrpcFailureInjector": (
        "code 1 uint32",
        "message 2 string",
        "ratio 3 http_route.Ratio",
    ),
    "grpc_route.GrpcRouteMatch": (
        "rpc 1 grpc_route.GrpcRpcMatch",
        "headers 2 repeated http_route.HeaderMatch",
    ),
    "grpc_route.GrpcRpcMatch": (
        "service 1 string",
        "method 2 string",
    ),
    "http_route.HeaderMatch": (
        "name 1 string",
        "exact 2 bytes",
        "regex 3 string",
    ),
    "http_route.HostMatch": (
        "exact 1 string",
        "suffix 2 http_route.HostMatch.Suffix",
    ),
    "http_route.HostMatch.Suffix": ("reverse_labels 1 repeated string",),
    "http_route.HttpFailureInjector": (
        "status 1 uint32",
        "message 2 string",
        "ratio 3 http_route.Ratio",
    ),
    "http_route.HttpRouteMatch": (
        "path 1 http_route.PathMatch",
        "headers 2 repeated http_route.HeaderMatch",
        "query_params 3 repeated http_route.QueryParamMatch",
        "method 4 http_types.HttpMethod",
    ),
    "http_route.PathMatch": (
        "exact 1 string",
        "prefix 2 string",
        "regex 3 string",
    ),
    "http_route.PathModifier": (
        "full 1 string",
        "prefix 2 string",
    ),
    "http_route.QueryParamMatch": (
        "name 1 string",
        "exact 2 string",
        "regex 3 string",
    ),
    "http_route.Ratio": (
        "numerator 1 uint32",
        "denominator 2 uint32",
    ),
    "http_route.RequestHeaderModifier": (
        "add 1 http_types.Headers",
        "set 2 http_types.Headers",
        "remove 3 repeated string",
    ),
    "http_route.RequestRedirect": (
        "scheme 1 http_types.Scheme",
        "host 2 string",
        "path 3 http_route.PathModifier",
        "port 4 uint32",
        "status 5 uint32",
    ),
    "http_route.ResponseHeaderModifier": (
        "add 1 http_types.Headers",
        "set 2 http_types.Headers",
        "remove 3 repeated string",
    ),
    "http_route.Timeouts": (
        "response 1 google.protobuf.Duration",
        "request 2 google.protobuf.Duration",
        "idle 3 google.protobuf.Duration",
    ),
    "http_types.Headers": ("headers 1 repeated http_types.Headers.Header",),
    "http_types.Headers.Header": (
        "name 1 string",
        "value 2 bytes",
    ),
    "http_types.HttpMethod": (
        "registered 1 http_types.HttpMethod.Registered",
        "unregistered 2 string",
    ),
    "http_types.Scheme": (
        "registered 1 http_types.Scheme.Registered",
        "unregistered 2 string",
    ),
    "inbound.Authn": (
        "unauthenticated 1 inbound.Authn.PermitUnauthenticated",
        "meshTLS 2 inbound.Authn.PermitMeshTLS",
    ),
    "inbound.Authn.PermitMeshTLS": (
        "unauthenticated 1 inbound.Authn.PermitUnauthenticated",
        "identities 2 inbound.Authn.PermitMeshTLS.PermitClientIdentities",
    ),
    "inbound.Authn.PermitMeshTLS.PermitClientIdentities": (
        "identities 1 repeated inbound.Identity",
        "suffixes 2 repeated inbound.IdentitySuffix",
    ),
    "inbound.Authn.PermitUnauthenticated": (),
    "inbound.Authz": (
        "networks 1 repeated inbound.Network",
        "authentication 2 inbound.Authn",
        "labels 3 repeated inbound.Authz.LabelsEntry",
        "metadata 4 meta.Metadata",
    ),
    "inbound.GrpcRoute": (
        "metadata 1 meta.Metadata",
        "hosts 2 repeated http_route.HostMatch",
        "authorizations 3 repeated inbound.Authz",
        "rules 4 repeated inbound.GrpcRoute.Rule",
    ),
    "inbound.GrpcRoute.Filter": (
        "failure_injector 1 grpc_route.GrpcFailureInjector",
        "request_header_modifier 2 http_route.RequestHeaderModifier",
    ),
    "inbound.GrpcRoute.Rule": (
        "matches 1 repeated grpc_route.GrpcRouteMatch",
        "filters 2 repeated inbound.GrpcRoute.Filter",
    ),
    "inbound.HttpLocalRateLimit": (
        "metadata 1 meta.Metadata",
        "total 2 inbound.HttpLocalRateLimit.Limit",
        "identity 3 inbound.HttpLocalRateLimit.Limit",
        "overrides 4 repeated inbound.HttpLocalRateLimit.Override",
    ),
    "inbound.HttpLocalRateLimit.Limit": ("requestsPerSecond 1 uint32",),
    "inbound.HttpLocalRateLimit.Override": (
        "limit 1 inbound.HttpLocalRateLimit.Limit",
        "clients 2 inbound.HttpLocalRateLimit.Override.ClientIdentities",
    ),
    "inbound.HttpLocalRateLimit.Override.ClientIdentities": (
        "identities 1 repeated inbound.Identity",
    ),
    "inbound.HttpRoute": (
        "metadata 1 meta.Metadata",
        "hosts 2 repeated http_route.HostMatch",
        "authorizations 3 repeated inbound.Authz",
        "rules 4 repeated inbound.HttpRoute.Rule",
    ),
    "inbound.HttpRoute.Filter": (
        "failure_injector 1 http_route.HttpFailureInjector",
        "request_header_modifier 2 http_route.RequestHeaderModifier",
        "redirect 3 http_route.RequestRedirect",
    ),
    "inbound.HttpRoute.Rule": (
        "matches 1 repeated http_route.HttpRouteMatch",
        "filters 2 repeated inbound.HttpRoute.Filter",
    ),
    "inbound.Identity": ("name 1 string",),
    "inbound.IdentitySuffix": ("parts 1 repeated string",),
    "inbound.Network": (
        "net 1 net.IPNetwork",
        "except 2 repeated net.IPNetwork",
    ),
    "inbound.PortSpec": (
        "workload 1 string",
        "port 2 uint32",
    ),
    "inbound.ProxyProtocol": (
        "detect 1 inbound.ProxyProtocol.Detect",
        "opaque 2 inbound.ProxyProtocol.Opaque",
        "tls 3 inbound.ProxyProtocol.Tls",
        "http1 4 inbound.ProxyProtocol.Http1",
        "http2 5 inbound.ProxyProtocol.Http2",
        "grpc 6 inbound.ProxyProtocol.Grpc",
    ),
    "inbound.ProxyProtocol.Detect": (
        "timeout 1 google.protobuf.Duration",
        "http_routes 3 repeated inbound.HttpRoute",
        "http_local_rate_limit 4 inbound.HttpLocalRateLimit",
    ),
    "inbound.ProxyProtocol.Grpc": ("routes 2 repeated inbound.GrpcRoute",),
    "inbound.ProxyProtocol.Http1": (
        "routes 2 repeated inbound.HttpRoute",
        "local_rate_limit 3 inbound.HttpLocalRateLimit",
    ),
    "inbound.ProxyProtocol.Http2": (
        "routes 2 repeated inbound.HttpRoute",
        "local_rate_limit 3 inbound.HttpLocalRateLimit",
    ),
    "inbound.ProxyProtocol.Opaque": (),
    "inbound.ProxyProtocol.Tls": (),
    "inbound.Server": (
        "protocol 1 inbound.ProxyProtocol",
        "server_ips 2 repeated net.IPAddress",
        "authorizations 3 repeated inbound.Authz",
        "labels 4 repeated inbound.Server.LabelsEntry",
    ),
    "meta.Metadata": (
        "default 1 string",
        "resource 2 meta.Resource",
    ),
    "meta.Resource": (
        "group 1 string",
        "kind 2 string",
        "name 3 string",
        "namespace 4 string",
        "section 5 string",
        "port 6 uint32",
    ),
    "net.IPAddress": (
        "ipv4 1 fixed32",
        "ipv6 2 net.IPv6",
    ),
    "net.IPNetwork": (
        "ip 1 net.IPAddress",
        "prefix_len 2 uint32",
    ),
    "net.IPv6": (
        "first 1 fixed64",
        "last 2 fixed64",
    ),
    "net.TcpAddress": (
        "ip 1 net.IPAddress",
        "port 2 uint32",
    ),
}


def _describe(field: FieldDescriptor) -> str:
    kind = field.message_type or field.enum_type
    type_name = kind.full_name.removeprefix(_PREFIX) if kind else _SCALARS[field.type]
    repeated = "repeated " if field.is_repeated else ""
    return f"{field.name} {field.number} {repeated}{type_name}"


def _messages(root: Descriptor, into: dict[str, tuple[str, ...]]) -> None:
    name = root.full_name.removeprefix(_PREFIX)
    if name in into or not root.full_name.startswith(_PREFIX):
        return
    into[name] = tuple(_describe(f) for f in sorted(root.fields, key=lambda f: f.number))
    for field in root.fields:
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            _messages(field.message_type, into)
    for nested in root.nested_types:
        if not nested.GetOptions().map_entry:
            _messages(nested, into)


def test_every_message_reached_from_the_service_matches_linkerd() -> None:
    ours: dict[str, tuple[str, ...]] = {}
    service = inbound_pb2.DESCRIPTOR.services_by_name["InboundServerPolicies"]
    for method in service.methods:
        _messages(method.input_type, ours)
        _messages(method.output_type, ours)
    reached = {name: ours[name] for name in LINKERD if name in ours}
    assert reached == {name: LINKERD[name] for name in reached}
    for module in (inbound_pb2, http_route_pb2, grpc_route_pb2, meta_pb2, net_pb2, http_types_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            _messages(message, ours)
    assert ours == LINKERD


def test_method_paths_match_linkerd() -> None:
    service = inbound_pb2.DESCRIPTOR.services_by_name["InboundServerPolicies"]
    paths = {
        f"/{service.full_name}/{m.name}": (
            m.input_type.name,
            m.output_type.name,
            m.server_streaming,
        )
        for m in service.methods
    }
    assert paths == {
        "/io.linkerd.proxy.inbound.InboundServerPolicies/GetPort": ("PortSpec", "Server", False),
        "/io.linkerd.proxy.inbound.InboundServerPolicies/WatchPort": ("PortSpec", "Server", True),
    }


def test_server_bytes() -> None:
    # the bytes linkerd2-proxy-api's own generated code writes for this message
    server = inbound_pb2.Server(
        protocol=inbound_pb2.ProxyProtocol(opaque=inbound_pb2.ProxyProtocol.Opaque()),
        authorizations=[
            inbound_pb2.Authz(
                networks=[
                    inbound_pb2.Network(
                        net=net_pb2.IPNetwork(ip=net_pb2.IPAddress(ipv4=0), prefix_len=0)
                    )
                ],
                authentication=inbound_pb2.Authn(
                    unauthenticated=inbound_pb2.Authn.PermitUnauthenticated()
                ),
                metadata=meta_pb2.Metadata(default="all-unauthenticated"),
            )
        ],
    )
    assert server.SerializeToString().hex() == (
        "0a0212001a260a090a070a050d0000000012020a0022150a13616c6c2d756e61757468656e74696361746564"
    )


# tap.proto's own messages (those of net.proto and http_types.proto it uses are above).
LINKERD_TAP = {
    "tap.Eos": (
        "grpc_status_code 1 uint32",
        "reset_error_code 2 uint32",
    ),
    "tap.ObserveRequest": (
        "limit 1 uint32",
        "match 2 tap.ObserveRequest.Match",
        "extract 3 tap.ObserveRequest.Extract",
    ),
    "tap.ObserveRequest.Extract": ("http 1 tap.ObserveRequest.Extract.Http",),
    "tap.ObserveRequest.Extract.Http": ("headers 1 tap.ObserveRequest.Extract.Http.Headers",),
    "tap.ObserveRequest.Extract.Http.Headers": (),
    "tap.ObserveRequest.Match": (
        "all 1 tap.ObserveRequest.Match.Seq",
        "any 2 tap.ObserveRequest.Match.Seq",
        "not 3 tap.ObserveRequest.Match",
        "source 4 tap.ObserveRequest.Match.Tcp",
        "destination 5 tap.ObserveRequest.Match.Tcp",
        "http 6 tap.ObserveRequest.Match.Http",
        "destination_label 7 tap.ObserveRequest.Match.Label",
        "route_label 8 tap.ObserveRequest.Match.Label",
    ),
    "tap.ObserveRequest.Match.Http": (
        "scheme 1 http_types.Scheme",
        "authority 2 tap.ObserveRequest.Match.Http.StringMatch",
        "method 3 http_types.HttpMethod",
        "path 4 tap.ObserveRequest.Match.Http.StringMatch",
    ),
    "tap.ObserveRequest.Match.Http.StringMatch": (
        "exact 1 string",
        "prefix 2 string",
    ),
    "tap.ObserveRequest.Match.Label": (
        "key 1 string",
        "value 2 string",
    ),
    "tap.ObserveRequest.Match.Seq": ("matches 1 repeated tap.ObserveRequest.Match",),
    "tap.ObserveRequest.Match.Tcp": (
        "netmask 1 tap.ObserveRequest.Match.Tcp.Netmask",
        "ports 3 tap.ObserveRequest.Match.Tcp.PortRange",
    ),
    "tap.ObserveRequest.Match.Tcp.Netmask": (
        "ip 1 net.IPAddress",
        "mask 2 uint32",
    ),
    "tap.ObserveRequest.Match.Tcp.PortRange": (
        "min 1 uint32",
        "max 2 uint32",
    ),
    "tap.TapEvent": (
        "source 1 net.TcpAddress",
        "destination 2 net.TcpAddress",
        "http 3 tap.TapEvent.Http",
        "destination_meta 4 tap.TapEvent.EndpointMeta",
        "source_meta 5 tap.TapEvent.EndpointMeta",
        "proxy_direction 6 tap.TapEvent.ProxyDirection",
        "route_meta 7 tap.TapEvent.RouteMeta",
    ),
    "tap.TapEvent.EndpointMeta": ("labels 1 repeated tap.TapEvent.EndpointMeta.LabelsEntry",),
    "tap.TapEvent.Http": (
        "request_init 1 tap.TapEvent.Http.RequestInit",
        "response_init 2 tap.TapEvent.Http.ResponseInit",
        "response_end 3 tap.TapEvent.Http.ResponseEnd",
    ),
    "tap.TapEvent.Http.RequestInit": (
        "id 1 tap.TapEvent.Http.StreamId",
        "method 2 http_types.HttpMethod",
        "scheme 3 http_types.Scheme",
        "authority 4 string",
        "path 5 string",
        "headers 6 http_types.Headers",
    ),
    "tap.TapEvent.Http.ResponseEnd": (
        "id 1 tap.TapEvent.Http.StreamId",
        "since_request_init 2 google.protobuf.Duration",
        "since_response_init 3 google.protobuf.Duration",
        "response_bytes 4 uint64",
        "eos 5 tap.Eos",
        "trailers 6 http_types.Headers",
    ),
    "tap.TapEvent.Http.ResponseInit": (
        "id 1 tap.TapEvent.Http.StreamId",
        "since_request_init 2 google.protobuf.Duration",
        "http_status 3 uint32",
        "headers 4 http_types.Headers",
    ),
    "tap.TapEvent.Http.StreamId": (
        "base 1 uint32",
        "stream 2 uint64",
    ),
    "tap.TapEvent.RouteMeta": ("labels 1 repeated tap.TapEvent.RouteMeta.LabelsEntry",),
}


def test_the_tap_contract_matches_linkerd() -> None:
    ours: dict[str, tuple[str, ...]] = {}
    for message in tap_pb2.DESCRIPTOR.message_types_by_name.values():
        _messages(message, ours)
    assert {name: fields for name, fields in ours.items() if name.startswith("tap.")} == (
        LINKERD_TAP
    )
    service = tap_pb2.DESCRIPTOR.services_by_name["Tap"]
    [observe] = service.methods
    assert (f"/{service.full_name}/{observe.name}", observe.server_streaming) == (
        "/io.linkerd.proxy.tap.Tap/Observe",
        True,
    )
