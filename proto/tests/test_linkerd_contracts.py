"""The policy, discovery and tap contracts match linkerd2-proxy-api's, field by field.

The table lists, for every message the inbound and outbound policy services reach (with all of
`destination.proto`, `http_route.proto`, `grpc_route.proto`, `opaque_route.proto`,
`tls_route.proto`, `meta.proto`, `net.proto` and `http_types.proto`), each field's name, number,
whether it repeats, and its type, as in linkerd2-proxy-api v0.20.0; a second table lists each
message's oneofs. A linkerd2-proxy decodes by number and type only, and keeps one member of a
oneof, so these are what must not drift.
"""

from __future__ import annotations

import ipaddress

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from meshlet.api import (
    addr,
    destination_pb2,
    grpc_route_pb2,
    http_route_pb2,
    http_types_pb2,
    inbound_pb2,
    meta_pb2,
    net_pb2,
    opaque_route_pb2,
    outbound_pb2,
    tap_pb2,
    tls_route_pb2,
)

_PREFIX = "io.linkerd.proxy."
_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in vars(FieldDescriptor).items()
    if name.startswith("TYPE_")
}
_SERVICES = (
    (inbound_pb2, "InboundServerPolicies"),
    (outbound_pb2, "OutboundPolicies"),
)
_MODULES = (
    inbound_pb2,
    outbound_pb2,
    destination_pb2,
    http_route_pb2,
    grpc_route_pb2,
    opaque_route_pb2,
    tls_route_pb2,
    meta_pb2,
    net_pb2,
    http_types_pb2,
)

LINKERD = {
    "destination.AddrSet": ("addrs 1 repeated net.TcpAddress",),
    "destination.AuthorityOverride": ("authority_override 1 string",),
    "destination.DestinationProfile": (
        "routes 1 repeated destination.Route",
        "retry_budget 2 destination.RetryBudget",
        "dst_overrides 3 repeated destination.WeightedDst",
        "opaque_protocol 4 bool",
        "fully_qualified_name 5 string",
        "endpoint 6 destination.WeightedAddr",
        "parent_ref 7 meta.Metadata",
        "profile_ref 8 meta.Metadata",
    ),
    "destination.GetDestination": (
        "scheme 1 string",
        "path 2 string",
        "context_token 3 string",
    ),
    "destination.Http2ClientParams": (
        "flow_control 1 destination.Http2ClientParams.FlowControl",
        "keep_alive 2 destination.Http2ClientParams.KeepAlive",
        "internals 3 destination.Http2ClientParams.Internals",
    ),
    "destination.Http2ClientParams.FlowControl": (
        "initial_connection_window_size 1 uint32",
        "initial_stream_window_size 2 uint32",
        "adaptive_flow_control 3 bool",
    ),
    "destination.Http2ClientParams.Internals": (
        "max_concurrent_reset_streams 1 uint32",
        "max_frame_size 2 uint32",
        "max_send_buf_size 3 uint32",
    ),
    "destination.Http2ClientParams.KeepAlive": (
        "interval 1 google.protobuf.Duration",
        "timeout 2 google.protobuf.Duration",
        "while_idle 3 bool",
    ),
    "destination.HttpStatusRange": (
        "min 1 uint32",
        "max 2 uint32",
    ),
    "destination.NoEndpoints": ("exists 1 bool",),
    "destination.PathMatch": ("regex 1 string",),
    "destination.ProtocolHint": (
        "h2 1 destination.ProtocolHint.H2",
        "opaque_transport 2 destination.ProtocolHint.OpaqueTransport",
        "opaque 3 destination.ProtocolHint.Opaque",
    ),
    "destination.ProtocolHint.H2": (),
    "destination.ProtocolHint.Opaque": (),
    "destination.ProtocolHint.OpaqueTransport": ("inbound_port 1 uint32",),
    "destination.RequestMatch": (
        "all 1 destination.RequestMatch.Seq",
        "any 2 destination.RequestMatch.Seq",
        "not 3 destination.RequestMatch",
        "path 4 destination.PathMatch",
        "method 5 http_types.HttpMethod",
    ),
    "destination.RequestMatch.Seq": ("matches 1 repeated destination.RequestMatch",),
    "destination.ResponseClass": (
        "condition 1 destination.ResponseMatch",
        "is_failure 2 bool",
    ),
    "destination.ResponseMatch": (
        "all 1 destination.ResponseMatch.Seq",
        "any 2 destination.ResponseMatch.Seq",
        "not 3 destination.ResponseMatch",
        "status 4 destination.HttpStatusRange",
    ),
    "destination.ResponseMatch.Seq": ("matches 1 repeated destination.ResponseMatch",),
    "destination.RetryBudget": (
        "retry_ratio 1 float",
        "min_retries_per_second 2 uint32",
        "ttl 3 google.protobuf.Duration",
    ),
    "destination.Route": (
        "condition 1 destination.RequestMatch",
        "response_classes 2 repeated destination.ResponseClass",
        "metrics_labels 3 repeated destination.Route.MetricsLabelsEntry",
        "is_retryable 4 bool",
        "timeout 5 google.protobuf.Duration",
    ),
    "destination.TlsIdentity": (
        "dns_like_identity 1 destination.TlsIdentity.DnsLikeIdentity",
        "uri_like_identity 3 destination.TlsIdentity.UriLikeIdentity",
        "server_name 4 destination.TlsIdentity.DnsLikeIdentity",
    ),
    "destination.TlsIdentity.DnsLikeIdentity": ("name 1 string",),
    "destination.TlsIdentity.UriLikeIdentity": ("uri 1 string",),
    "destination.Update": (
        "add 1 destination.WeightedAddrSet",
        "remove 2 destination.AddrSet",
        "no_endpoints 3 destination.NoEndpoints",
    ),
    "destination.WeightedAddr": (
        "addr 1 net.TcpAddress",
        "weight 3 uint32",
        "metric_labels 4 repeated destination.WeightedAddr.MetricLabelsEntry",
        "tls_identity 5 destination.TlsIdentity",
        "protocol_hint 6 destination.ProtocolHint",
        "authority_override 7 destination.AuthorityOverride",
        "http2 8 destination.Http2ClientParams",
        "resource_ref 9 meta.Metadata",
    ),
    "destination.WeightedAddrSet": (
        "addrs 1 repeated destination.WeightedAddr",
        "metric_labels 2 repeated destination.WeightedAddrSet.MetricLabelsEntry",
    ),
    "destination.WeightedDst": (
        "authority 1 string",
        "weight 2 uint32",
        "backend_ref 3 meta.Metadata",
    ),
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
    "opaque_route.Forbidden": (),
    "opaque_route.Invalid": ("message 1 string",),
    "outbound.Backend": (
        "metadata 1 meta.Metadata",
        "forward 2 destination.WeightedAddr",
        "balancer 3 outbound.Backend.BalanceP2c",
        "queue 4 outbound.Queue",
    ),
    "outbound.Backend.BalanceP2c": (
        "discovery 1 outbound.Backend.EndpointDiscovery",
        "peak_ewma 2 outbound.Backend.BalanceP2c.PeakEwma",
        "penalty_peak_ewma 3 outbound.Backend.BalanceP2c.PenaltyPeakEwma",
    ),
    "outbound.Backend.BalanceP2c.PeakEwma": (
        "default_rtt 1 google.protobuf.Duration",
        "decay 2 google.protobuf.Duration",
    ),
    "outbound.Backend.BalanceP2c.PenaltyPeakEwma": (
        "default_rtt 1 google.protobuf.Duration",
        "decay 2 google.protobuf.Duration",
        "penalty 3 google.protobuf.Duration",
        "max_retry_after 4 google.protobuf.Duration",
        "penalty_decay 5 google.protobuf.Duration",
    ),
    "outbound.Backend.EndpointDiscovery": (
        "dst 1 outbound.Backend.EndpointDiscovery.DestinationGet",
    ),
    "outbound.Backend.EndpointDiscovery.DestinationGet": ("path 1 string",),
    "outbound.EjectionConfig": ("min_ready_endpoints 1 uint32",),
    "outbound.ExponentialBackoff": (
        "min_backoff 1 google.protobuf.Duration",
        "max_backoff 2 google.protobuf.Duration",
        "jitter_ratio 3 float",
        "respect_retry_after_hint 4 bool",
    ),
    "outbound.FailureAccrual": (
        "consecutive_failures 1 outbound.FailureAccrual.ConsecutiveFailures",
        "unified 2 outbound.FailureAccrual.Unified",
        "ejection 3 outbound.EjectionConfig",
    ),
    "outbound.FailureAccrual.ConsecutiveFailures": (
        "max_failures 1 uint32",
        "backoff 2 outbound.ExponentialBackoff",
    ),
    "outbound.FailureAccrual.Unified": (
        "success_rate_threshold 1 double",
        "decay 2 google.protobuf.Duration",
        "min_requests 3 uint32",
        "max_consecutive_failures 4 uint32",
        "backoff 5 outbound.ExponentialBackoff",
    ),
    "outbound.GrpcRoute": (
        "metadata 1 meta.Metadata",
        "hosts 2 repeated http_route.HostMatch",
        "rules 3 repeated outbound.GrpcRoute.Rule",
    ),
    "outbound.GrpcRoute.Distribution": (
        "empty 1 outbound.GrpcRoute.Distribution.Empty",
        "first_available 2 outbound.GrpcRoute.Distribution.FirstAvailable",
        "random_available 3 outbound.GrpcRoute.Distribution.RandomAvailable",
    ),
    "outbound.GrpcRoute.Distribution.Empty": (),
    "outbound.GrpcRoute.Distribution.FirstAvailable": (
        "backends 1 repeated outbound.GrpcRoute.RouteBackend",
    ),
    "outbound.GrpcRoute.Distribution.RandomAvailable": (
        "backends 1 repeated outbound.GrpcRoute.WeightedRouteBackend",
    ),
    "outbound.GrpcRoute.Filter": (
        "failure_injector 1 grpc_route.GrpcFailureInjector",
        "request_header_modifier 2 http_route.RequestHeaderModifier",
    ),
    "outbound.GrpcRoute.Retry": (
        "max_retries 1 uint32",
        "max_request_bytes 2 uint32",
        "conditions 3 outbound.GrpcRoute.Retry.Conditions",
        "timeout 4 google.protobuf.Duration",
        "backoff 5 outbound.ExponentialBackoff",
    ),
    "outbound.GrpcRoute.Retry.Conditions": (
        "cancelled 1 bool",
        "deadine_exceeded 4 bool",
        "resource_exhausted 8 bool",
        "internal 13 bool",
        "unavailable 14 bool",
    ),
    "outbound.GrpcRoute.RouteBackend": (
        "backend 1 outbound.Backend",
        "filters 3 repeated outbound.GrpcRoute.Filter",
        "requestTimeout 4 google.protobuf.Duration",
    ),
    "outbound.GrpcRoute.Rule": (
        "matches 1 repeated grpc_route.GrpcRouteMatch",
        "filters 2 repeated outbound.GrpcRoute.Filter",
        "backends 3 outbound.GrpcRoute.Distribution",
        "requestTimeout 4 google.protobuf.Duration",
        "timeouts 5 http_route.Timeouts",
        "retry 6 outbound.GrpcRoute.Retry",
        "allow_l5d_request_headers 7 bool",
    ),
    "outbound.GrpcRoute.WeightedRouteBackend": (
        "backend 1 outbound.GrpcRoute.RouteBackend",
        "weight 2 uint32",
    ),
    "outbound.HttpRoute": (
        "metadata 1 meta.Metadata",
        "hosts 2 repeated http_route.HostMatch",
        "rules 3 repeated outbound.HttpRoute.Rule",
    ),
    "outbound.HttpRoute.Distribution": (
        "empty 1 outbound.HttpRoute.Distribution.Empty",
        "first_available 2 outbound.HttpRoute.Distribution.FirstAvailable",
        "random_available 3 outbound.HttpRoute.Distribution.RandomAvailable",
    ),
    "outbound.HttpRoute.Distribution.Empty": (),
    "outbound.HttpRoute.Distribution.FirstAvailable": (
        "backends 1 repeated outbound.HttpRoute.RouteBackend",
    ),
    "outbound.HttpRoute.Distribution.RandomAvailable": (
        "backends 1 repeated outbound.HttpRoute.WeightedRouteBackend",
    ),
    "outbound.HttpRoute.Filter": (
        "failure_injector 1 http_route.HttpFailureInjector",
        "request_header_modifier 2 http_route.RequestHeaderModifier",
        "redirect 3 http_route.RequestRedirect",
        "response_header_modifier 4 http_route.ResponseHeaderModifier",
    ),
    "outbound.HttpRoute.Retry": (
        "max_retries 1 uint32",
        "max_request_bytes 2 uint32",
        "conditions 3 outbound.HttpRoute.Retry.Conditions",
        "timeout 4 google.protobuf.Duration",
        "backoff 5 outbound.ExponentialBackoff",
    ),
    "outbound.HttpRoute.Retry.Conditions": (
        "status_ranges 1 repeated outbound.HttpRoute.Retry.Conditions.StatusRange",
    ),
    "outbound.HttpRoute.Retry.Conditions.StatusRange": (
        "start 1 uint32",
        "end 2 uint32",
    ),
    "outbound.HttpRoute.RouteBackend": (
        "backend 1 outbound.Backend",
        "filters 3 repeated outbound.HttpRoute.Filter",
        "requestTimeout 4 google.protobuf.Duration",
    ),
    "outbound.HttpRoute.Rule": (
        "matches 1 repeated http_route.HttpRouteMatch",
        "filters 2 repeated outbound.HttpRoute.Filter",
        "backends 3 outbound.HttpRoute.Distribution",
        "requestTimeout 4 google.protobuf.Duration",
        "timeouts 5 http_route.Timeouts",
        "retry 6 outbound.HttpRoute.Retry",
        "allow_l5d_request_headers 7 bool",
    ),
    "outbound.HttpRoute.WeightedRouteBackend": (
        "backend 1 outbound.HttpRoute.RouteBackend",
        "weight 2 uint32",
    ),
    "outbound.OpaqueRoute": (
        "metadata 1 meta.Metadata",
        "rules 3 repeated outbound.OpaqueRoute.Rule",
    ),
    "outbound.OpaqueRoute.Distribution": (
        "empty 1 outbound.OpaqueRoute.Distribution.Empty",
        "first_available 2 outbound.OpaqueRoute.Distribution.FirstAvailable",
        "random_available 3 outbound.OpaqueRoute.Distribution.RandomAvailable",
    ),
    "outbound.OpaqueRoute.Distribution.Empty": (),
    "outbound.OpaqueRoute.Distribution.FirstAvailable": (
        "backends 1 repeated outbound.OpaqueRoute.RouteBackend",
    ),
    "outbound.OpaqueRoute.Distribution.RandomAvailable": (
        "backends 1 repeated outbound.OpaqueRoute.WeightedRouteBackend",
    ),
    "outbound.OpaqueRoute.Filter": (
        "invalid 1 opaque_route.Invalid",
        "forbidden 2 opaque_route.Forbidden",
    ),
    "outbound.OpaqueRoute.RouteBackend": (
        "backend 1 outbound.Backend",
        "filters 3 repeated outbound.OpaqueRoute.Filter",
    ),
    "outbound.OpaqueRoute.Rule": (
        "backends 1 outbound.OpaqueRoute.Distribution",
        "filters 2 repeated outbound.OpaqueRoute.Filter",
    ),
    "outbound.OpaqueRoute.WeightedRouteBackend": (
        "backend 1 outbound.OpaqueRoute.RouteBackend",
        "weight 2 uint32",
    ),
    "outbound.OutboundPolicy": (
        "protocol 1 outbound.ProxyProtocol",
        "metadata 2 meta.Metadata",
    ),
    "outbound.ProxyProtocol": (
        "detect 1 outbound.ProxyProtocol.Detect",
        "opaque 2 outbound.ProxyProtocol.Opaque",
        "http1 3 outbound.ProxyProtocol.Http1",
        "http2 4 outbound.ProxyProtocol.Http2",
        "grpc 5 outbound.ProxyProtocol.Grpc",
        "tls 6 outbound.ProxyProtocol.Tls",
    ),
    "outbound.ProxyProtocol.Detect": (
        "timeout 1 google.protobuf.Duration",
        "opaque 2 outbound.ProxyProtocol.Opaque",
        "http1 3 outbound.ProxyProtocol.Http1",
        "http2 4 outbound.ProxyProtocol.Http2",
    ),
    "outbound.ProxyProtocol.Grpc": (
        "routes 1 repeated outbound.GrpcRoute",
        "failure_accrual 2 outbound.FailureAccrual",
    ),
    "outbound.ProxyProtocol.Http1": (
        "routes 1 repeated outbound.HttpRoute",
        "failure_accrual 2 outbound.FailureAccrual",
    ),
    "outbound.ProxyProtocol.Http2": (
        "routes 1 repeated outbound.HttpRoute",
        "failure_accrual 2 outbound.FailureAccrual",
    ),
    "outbound.ProxyProtocol.Opaque": ("routes 1 repeated outbound.OpaqueRoute",),
    "outbound.ProxyProtocol.Tls": ("routes 1 repeated outbound.TlsRoute",),
    "outbound.Queue": (
        "capacity 1 uint32",
        "failfast_timeout 2 google.protobuf.Duration",
    ),
    "outbound.TlsRoute": (
        "metadata 1 meta.Metadata",
        "snis 2 repeated tls_route.SniMatch",
        "rules 3 repeated outbound.TlsRoute.Rule",
    ),
    "outbound.TlsRoute.Distribution": (
        "empty 1 outbound.TlsRoute.Distribution.Empty",
        "first_available 2 outbound.TlsRoute.Distribution.FirstAvailable",
        "random_available 3 outbound.TlsRoute.Distribution.RandomAvailable",
    ),
    "outbound.TlsRoute.Distribution.Empty": (),
    "outbound.TlsRoute.Distribution.FirstAvailable": (
        "backends 1 repeated outbound.TlsRoute.RouteBackend",
    ),
    "outbound.TlsRoute.Distribution.RandomAvailable": (
        "backends 1 repeated outbound.TlsRoute.WeightedRouteBackend",
    ),
    "outbound.TlsRoute.Filter": (
        "invalid 1 opaque_route.Invalid",
        "forbidden 2 opaque_route.Forbidden",
    ),
    "outbound.TlsRoute.RouteBackend": (
        "backend 1 outbound.Backend",
        "filters 3 repeated outbound.TlsRoute.Filter",
    ),
    "outbound.TlsRoute.Rule": (
        "backends 1 outbound.TlsRoute.Distribution",
        "filters 2 repeated outbound.TlsRoute.Filter",
    ),
    "outbound.TlsRoute.WeightedRouteBackend": (
        "backend 1 outbound.TlsRoute.RouteBackend",
        "weight 2 uint32",
    ),
    "outbound.TrafficSpec": (
        "source_workload 1 string",
        "addr 2 net.TcpAddress",
        "authority 3 string",
    ),
    "tls_route.SniMatch": (
        "exact 1 string",
        "suffix 2 tls_route.SniMatch.Suffix",
    ),
    "tls_route.SniMatch.Suffix": ("reverse_labels 1 repeated string",),
}

LINKERD_ONEOFS = {
    "destination.ProtocolHint": ("protocol: h2 opaque",),
    "destination.RequestMatch": ("match: all any not path method",),
    "destination.ResponseMatch": ("match: all any not status",),
    "destination.TlsIdentity": ("strategy: dns_like_identity uri_like_identity",),
    "destination.Update": ("update: add remove no_endpoints",),
    "http_route.HeaderMatch": ("value: exact regex",),
    "http_route.HostMatch": ("match: exact suffix",),
    "http_route.PathMatch": ("kind: exact prefix regex",),
    "http_route.PathModifier": ("replace: full prefix",),
    "http_route.QueryParamMatch": ("value: exact regex",),
    "http_types.HttpMethod": ("type: registered unregistered",),
    "http_types.Scheme": ("type: registered unregistered",),
    "inbound.Authn": ("permit: unauthenticated meshTLS",),
    "inbound.Authn.PermitMeshTLS": ("clients: unauthenticated identities",),
    "inbound.GrpcRoute.Filter": ("kind: failure_injector request_header_modifier",),
    "inbound.HttpRoute.Filter": ("kind: failure_injector request_header_modifier redirect",),
    "inbound.ProxyProtocol": ("kind: detect opaque tls http1 http2 grpc",),
    "meta.Metadata": ("kind: default resource",),
    "net.IPAddress": ("ip: ipv4 ipv6",),
    "outbound.Backend": ("kind: forward balancer",),
    "outbound.Backend.BalanceP2c": ("load: peak_ewma penalty_peak_ewma",),
    "outbound.Backend.EndpointDiscovery": ("kind: dst",),
    "outbound.FailureAccrual": ("kind: consecutive_failures unified",),
    "outbound.GrpcRoute.Distribution": ("kind: empty first_available random_available",),
    "outbound.GrpcRoute.Filter": ("kind: failure_injector request_header_modifier",),
    "outbound.HttpRoute.Distribution": ("kind: empty first_available random_available",),
    "outbound.HttpRoute.Filter": (
        "kind: failure_injector request_header_modifier redirect response_header_modifier",
    ),
    "outbound.OpaqueRoute.Distribution": ("kind: empty first_available random_available",),
    "outbound.OpaqueRoute.Filter": ("kind: invalid forbidden",),
    "outbound.ProxyProtocol": ("kind: detect opaque http1 http2 grpc tls",),
    "outbound.TlsRoute.Distribution": ("kind: empty first_available random_available",),
    "outbound.TlsRoute.Filter": ("kind: invalid forbidden",),
    "outbound.TrafficSpec": ("target: addr authority",),
    "tls_route.SniMatch": ("match: exact suffix",),
}


def _describe(field: FieldDescriptor) -> str:
    kind = field.message_type or field.enum_type
    type_name = kind.full_name.removeprefix(_PREFIX) if kind else _SCALARS[field.type]
    repeated = "repeated " if field.is_repeated else ""
    return f"{field.name} {field.number} {repeated}{type_name}"


def _messages(root: Descriptor, into: dict[str, Descriptor]) -> None:
    name = root.full_name.removeprefix(_PREFIX)
    if name in into or not root.full_name.startswith(_PREFIX):
        return
    into[name] = root
    for field in root.fields:
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            _messages(field.message_type, into)
    for nested in root.nested_types:
        if not nested.GetOptions().map_entry:
            _messages(nested, into)


def _fields(messages: dict[str, Descriptor]) -> dict[str, tuple[str, ...]]:
    return {
        name: tuple(_describe(f) for f in sorted(message.fields, key=lambda f: f.number))
        for name, message in messages.items()
    }


def _oneofs(messages: dict[str, Descriptor]) -> dict[str, tuple[str, ...]]:
    return {
        name: tuple(f"{o.name}: {' '.join(f.name for f in o.fields)}" for o in message.oneofs)
        for name, message in messages.items()
        if message.oneofs
    }


def _everything() -> dict[str, Descriptor]:
    ours: dict[str, Descriptor] = {}
    for module in _MODULES:
        for message in module.DESCRIPTOR.message_types_by_name.values():
            _messages(message, ours)
    return ours


def test_every_message_reached_from_the_services_matches_linkerd() -> None:
    for module, name in _SERVICES:
        reached: dict[str, Descriptor] = {}
        for method in module.DESCRIPTOR.services_by_name[name].methods:
            _messages(method.input_type, reached)
            _messages(method.output_type, reached)
        assert set(reached) <= set(LINKERD), name
        assert _fields(reached) == {message: LINKERD[message] for message in reached}
    assert _fields(_everything()) == LINKERD


def test_oneofs_match_linkerd() -> None:
    assert _oneofs(_everything()) == LINKERD_ONEOFS


def test_method_paths_match_linkerd() -> None:
    paths = {}
    for module, name in _SERVICES:
        service = module.DESCRIPTOR.services_by_name[name]
        for m in service.methods:
            paths[f"/{service.full_name}/{m.name}"] = (
                m.input_type.name,
                m.output_type.name,
                m.server_streaming,
            )
    assert paths == {
        "/io.linkerd.proxy.inbound.InboundServerPolicies/GetPort": ("PortSpec", "Server", False),
        "/io.linkerd.proxy.inbound.InboundServerPolicies/WatchPort": ("PortSpec", "Server", True),
        "/io.linkerd.proxy.outbound.OutboundPolicies/Get": (
            "TrafficSpec",
            "OutboundPolicy",
            False,
        ),
        "/io.linkerd.proxy.outbound.OutboundPolicies/Watch": (
            "TrafficSpec",
            "OutboundPolicy",
            True,
        ),
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


def test_outbound_policy_bytes() -> None:
    # written out by hand from the wire format: tag (number << 3 | wire type), then length
    out = outbound_pb2
    route = out.HttpRoute
    backend = out.Backend(
        balancer=out.Backend.BalanceP2c(
            discovery=out.Backend.EndpointDiscovery(
                dst=out.Backend.EndpointDiscovery.DestinationGet(path="web:80")
            )
        )
    )
    policy = out.OutboundPolicy(
        protocol=out.ProxyProtocol(
            http1=out.ProxyProtocol.Http1(
                routes=[
                    route(
                        metadata=meta_pb2.Metadata(default="http"),
                        rules=[
                            route.Rule(
                                matches=[
                                    http_route_pb2.HttpRouteMatch(
                                        path=http_route_pb2.PathMatch(prefix="/")
                                    )
                                ],
                                backends=route.Distribution(
                                    random_available=route.Distribution.RandomAvailable(
                                        backends=[
                                            route.WeightedRouteBackend(
                                                backend=route.RouteBackend(backend=backend),
                                                weight=9,
                                            )
                                        ]
                                    )
                                ),
                                retry=route.Retry(
                                    max_retries=2,
                                    conditions=route.Retry.Conditions(
                                        status_ranges=[
                                            route.Retry.Conditions.StatusRange(start=500, end=599)
                                        ]
                                    ),
                                ),
                            )
                        ],
                    )
                ],
                failure_accrual=out.FailureAccrual(
                    consecutive_failures=out.FailureAccrual.ConsecutiveFailures(
                        max_failures=7, backoff=out.ExponentialBackoff(jitter_ratio=0.5)
                    )
                ),
            )
        ),
        metadata=meta_pb2.Metadata(
            resource=meta_pb2.Resource(
                group="core", kind="Service", name="web", namespace="ns", port=80
            )
        ),
    )
    assert policy.SerializeToString().hex() == "".join(
        (
            "0a4a",  # protocol
            "1a48",  # .http1
            "0a39",  # .routes[0]
            "0a060a0468747470",  # .metadata.default "http"
            "1a2f",  # .rules[0]
            "0a050a0312012f",  # .matches[0].path.prefix "/"
            "1a181a160a14",  # .backends.random_available.backends[0]
            "0a100a0e",  # .backend.backend
            "1a0c0a0a0a08",  # .balancer.discovery.dst
            "0a067765623a3830",  # .path "web:80"
            "1009",  # .weight 9
            "320c0802",  # .retry, .max_retries 2
            "1a080a06",  # .conditions.status_ranges[0]
            "08f40310d704",  # .start 500, .end 599
            "120b0a090807",  # .failure_accrual.consecutive_failures, .max_failures 7
            "12051d0000003f",  # .backoff.jitter_ratio 0.5 (fixed32, little-endian float)
            "121c121a",  # metadata.resource
            "0a04636f7265",  # .group "core"
            "120753657276696365",  # .kind "Service"
            "1a03776562",  # .name "web"
            "22026e73",  # .namespace "ns"
            "3050",  # .port 80
        )
    )


def test_a_proxys_traffic_spec_decodes() -> None:
    # source_workload "ns:web-1", then addr 10.0.0.1:80
    spec = outbound_pb2.TrafficSpec.FromString(
        bytes.fromhex("0a086e733a7765622d3112090a050d0100000a1050")
    )
    assert spec.source_workload == "ns:web-1"
    assert spec.WhichOneof("target") == "addr"
    assert addr.ip_from_proto(spec.addr.ip) == ipaddress.IPv4Address("10.0.0.1")
    assert spec.addr.port == 80
    by_name = outbound_pb2.TrafficSpec.FromString(bytes.fromhex("1a067765623a3830"))
    assert (by_name.WhichOneof("target"), by_name.authority) == ("authority", "web:80")


def test_grpc_retry_conditions_are_numbered_by_status_code() -> None:
    conditions = outbound_pb2.GrpcRoute.Retry.Conditions(deadine_exceeded=True, unavailable=True)
    assert conditions.SerializeToString().hex() == "20017001"  # fields 4 and 14, varint 1


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
    ours: dict[str, Descriptor] = {}
    for message in tap_pb2.DESCRIPTOR.message_types_by_name.values():
        _messages(message, ours)
    assert {
        name: fields for name, fields in _fields(ours).items() if name.startswith("tap.")
    } == LINKERD_TAP
    service = tap_pb2.DESCRIPTOR.services_by_name["Tap"]
    [observe] = service.methods
    assert (f"/{service.full_name}/{observe.name}", observe.server_streaming) == (
        "/io.linkerd.proxy.tap.Tap/Observe",
        True,
    )
