"""Configuration files for the proxy benchmark's nginx upstream and its nginx and haproxy proxies.

Pure text from ports and a scratch directory. Every proxy gets one core's worth of workers
(nginx `worker_processes 1`, haproxy `nbthread 1`), no access log, and keep-alive to its
upstream, so the comparison with meshlet (one asyncio loop) is one core against one core.

Each proxy comes as one hop (127.0.0.1, plaintext) and as a meshed pair like meshlet's and
Envoy's: a client side on 127.0.0.1 that sends every request over TLS 1.3 with its client
certificate (verifying the server's certificate and its name) to a server side on the server
pod's address, which requires and verifies a client certificate and forwards to the upstream.
The server sides answer `TLS_PROBE_PATH` themselves with the TLS version and the client
certificate's verification result, which the benchmark's probe checks through the pair, and
count what they served (nginx `stub_status` on a plaintext status listener and a per-session
log of the TCP stream; haproxy its stats socket).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bench.proxy_pki import Tls

NGINX_STREAM_MODULE: Final = Path("/usr/lib/nginx/modules/ngx_stream_module.so")
TLS_PROBE_PATH: Final = "/meshlet-bench/tls"
# what the server sides answer on TLS_PROBE_PATH for TLS 1.3 with a verified client certificate
NGINX_TLS_OK: Final = "TLSv1.3 SUCCESS"
HAPROXY_TLS_OK: Final = "TLSv1.3 0"
NGINX_STREAM_LOG: Final = "nginx-server-stream.log"  # in the scratch dir


@dataclass(frozen=True, slots=True)
class Ports:
    """One port per scenario: HTTP/1.1, h2c (prior knowledge), gRPC (h2c), opaque TCP."""

    h1: int
    h2: int
    grpc: int
    tcp: int


def _nginx_main(scratch: Path, name: str) -> str:
    return f"""\
worker_processes 1;
daemon off;
pid {scratch}/{name}.pid;
error_log {scratch}/{name}-error.log warn;
events {{ worker_connections 8192; }}
"""


def _nginx_http_common(scratch: Path, name: str) -> str:
    temp = ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"]
    paths = "\n".join(f"  {kind}_temp_path {scratch}/{name}-{kind};" for kind in temp)
    return f"""\
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 120s;
{paths}
"""


def nginx_upstream(scratch: Path, upstream: Ports, hosts: Sequence[str]) -> str:
    """The HTTP/1.1 and h2c upstream: `200 ok` on every path, on each of `hosts` (127.0.0.1
    for the unmeshed rows, the server pod's address for the meshed hop)."""
    h1 = " ".join(f"listen {host}:{upstream.h1};" for host in hosts)
    h2 = " ".join(f"listen {host}:{upstream.h2} http2;" for host in hosts)
    return f"""\
{_nginx_main(scratch, "upstream")}
http {{
{_nginx_http_common(scratch, "upstream")}
  server {{ {h1} location / {{ return 200 "ok"; }} }}
  server {{ {h2} location / {{ return 200 "ok"; }} }}
}}
"""


def nginx_proxy(scratch: Path, listen: Ports, upstream: Ports, stream: bool) -> str:
    """nginx as the proxy under test. `proxy_pass` speaks HTTP/1.x only, so h2 clients are
    relayed to the HTTP/1.1 upstream; gRPC goes through `grpc_pass`; TCP through the stream
    module when it is installed (`stream`)."""
    keepalive = 'proxy_http_version 1.1; proxy_set_header Connection "";'
    load_stream = f"load_module {NGINX_STREAM_MODULE};\n" if stream else ""
    tcp = f"proxy_pass 127.0.0.1:{upstream.tcp};"
    tcp_server = f"stream {{ server {{ listen 127.0.0.1:{listen.tcp}; {tcp} }} }}\n"
    return f"""\
{load_stream}{_nginx_main(scratch, "proxy")}
http {{
{_nginx_http_common(scratch, "proxy")}
  upstream h1 {{ server 127.0.0.1:{upstream.h1}; keepalive 128; keepalive_requests 1000000; }}
  upstream grpc {{ server 127.0.0.1:{upstream.grpc}; keepalive 128; }}
  server {{ listen 127.0.0.1:{listen.h1}; location / {{ proxy_pass http://h1; {keepalive} }} }}
  server {{
    listen 127.0.0.1:{listen.h2} http2;
    location / {{ proxy_pass http://h1; {keepalive} }}
  }}
  server {{ listen 127.0.0.1:{listen.grpc} http2; location / {{ grpc_pass grpc://grpc; }} }}
}}
{tcp_server if stream else ""}"""


def haproxy(listen: Ports, upstream: Ports) -> str:
    """haproxy as the proxy under test: h2 and gRPC relayed over h2 to the upstream."""
    sections = [_haproxy_global()]
    for name in ("h1", "h2", "grpc", "tcp"):
        h2 = name in ("h2", "grpc")
        bind = f"127.0.0.1:{getattr(listen, name)}"
        server = f"upstream 127.0.0.1:{getattr(upstream, name)}"
        sections.append(_haproxy_pair(name, bind, server, h2_in=h2, h2_out=h2))
    return "\n".join(sections)


# -- meshed pairs: client side → mutual TLS 1.3 → server side → upstream ---------------------


def _nginx_ssl_client(prefix: str, tls: Tls) -> str:
    """`proxy_ssl_*` (or `grpc_ssl_*`) directives: our certificate, the server's checked."""
    return f"""\
  {prefix}_certificate {tls.own.chain};
  {prefix}_certificate_key {tls.own.key};
  {prefix}_trusted_certificate {tls.anchors};
  {prefix}_verify on;
  {prefix}_verify_depth 3;
  {prefix}_name {tls.peer_id};
  {prefix}_server_name on;
  {prefix}_protocols TLSv1.3;
"""


def _nginx_ssl_server(tls: Tls) -> str:
    return f"""\
  ssl_certificate {tls.own.chain};
  ssl_certificate_key {tls.own.key};
  ssl_protocols TLSv1.3;
  ssl_client_certificate {tls.anchors};
  ssl_verify_client on;
  ssl_verify_depth 3;
"""


def nginx_client_side(
    scratch: Path, listen: Ports, server_host: str, server: Ports, tls: Tls, stream: bool
) -> str:
    """nginx as the client pod's proxy on 127.0.0.1: `proxy_pass https://` (HTTP/1.1, also
    for h2 clients: proxy_pass speaks HTTP/1.x only), `grpc_pass grpcs://` (HTTP/2) and the
    stream module's `proxy_ssl`, each with a client certificate."""
    keepalive = 'proxy_http_version 1.1; proxy_set_header Connection "";'
    load_stream = f"load_module {NGINX_STREAM_MODULE};\n" if stream else ""
    pools = "\n".join(
        f"  upstream {name} {{ server {server_host}:{getattr(server, name)}; keepalive 128; "
        "keepalive_requests 1000000; }"
        for name in ("h1", "h2", "grpc")
    )
    stream_block = f"""\
stream {{
  server {{
    listen 127.0.0.1:{listen.tcp};
    proxy_pass {server_host}:{server.tcp};
    proxy_ssl on;
{_nginx_ssl_client("proxy_ssl", tls)}  }}
}}
"""
    return f"""\
{load_stream}{_nginx_main(scratch, "client-side")}
http {{
{_nginx_http_common(scratch, "client-side")}
{_nginx_ssl_client("proxy_ssl", tls)}{_nginx_ssl_client("grpc_ssl", tls)}
{pools}
  server {{ listen 127.0.0.1:{listen.h1}; location / {{ proxy_pass https://h1; {keepalive} }} }}
  server {{
    listen 127.0.0.1:{listen.h2} http2;
    location / {{ proxy_pass https://h2; {keepalive} }}
  }}
  server {{ listen 127.0.0.1:{listen.grpc} http2; location / {{ grpc_pass grpcs://grpc; }} }}
}}
{stream_block if stream else ""}"""


def nginx_server_side(
    scratch: Path,
    host: str,
    listen: Ports,
    upstream_host: str,
    upstream: Ports,
    tls: Tls,
    stream: bool,
    status_port: int,
) -> str:
    """nginx as the server pod's proxy on `host`: TLS 1.3 listeners requiring a verified client
    certificate, HTTP/1.1 to the upstream (h2 clients too), gRPC over h2c; `stub_status` on
    `host`:`status_port` in plaintext; the TCP stream logs each session's TLS facts."""
    keepalive = 'proxy_http_version 1.1; proxy_set_header Connection "";'
    load_stream = f"load_module {NGINX_STREAM_MODULE};\n" if stream else ""
    probe = f'location = {TLS_PROBE_PATH} {{ return 200 "$ssl_protocol $ssl_client_verify"; }}'
    stream_block = f"""\
stream {{
  log_format tls "$ssl_protocol $ssl_client_verify $bytes_received $bytes_sent";
  server {{
    listen {host}:{listen.tcp} ssl;
{_nginx_ssl_server(tls)}    access_log {scratch}/{NGINX_STREAM_LOG} tls;
    proxy_pass {upstream_host}:{upstream.tcp};
  }}
}}
"""
    return f"""\
{load_stream}{_nginx_main(scratch, "server-side")}
http {{
{_nginx_http_common(scratch, "server-side")}
{_nginx_ssl_server(tls)}
  upstream h1 {{ server {upstream_host}:{upstream.h1}; keepalive 128; keepalive_requests 1000000; }}
  upstream grpc {{ server {upstream_host}:{upstream.grpc}; keepalive 128; }}
  server {{
    listen {host}:{listen.h1} ssl;
    location / {{ proxy_pass http://h1; {keepalive} }}
    {probe}
  }}
  server {{
    listen {host}:{listen.h2} ssl http2;
    location / {{ proxy_pass http://h1; {keepalive} }}
    {probe}
  }}
  server {{
    listen {host}:{listen.grpc} ssl http2;
    location / {{ grpc_pass grpc://grpc; }}
    {probe}
  }}
  server {{ listen {host}:{status_port}; ssl_verify_client off; location / {{ stub_status; }} }}
}}
{stream_block if stream else ""}"""


def _haproxy_global(stats_socket: Path | None = None) -> str:
    stats = f"  stats socket {stats_socket} mode 600 level user\n" if stats_socket else ""
    return f"""\
global
  nbthread 1
  maxconn 4096
{stats}
defaults
  timeout connect 5s
  timeout client 120s
  timeout server 120s
"""


def _haproxy_pair(
    name: str, bind: str, server: str, *, h2_in: bool, h2_out: bool, frontend_extra: str = ""
) -> str:
    mode = "http" if name != "tcp" else "tcp"
    reuse = "  http-reuse always\n" if mode == "http" else ""
    return f"""\
frontend {name}
  mode {mode}
  bind {bind}{" proto h2" if h2_in else ""}
{frontend_extra}  default_backend {name}

backend {name}
  mode {mode}
{reuse}  server {server}{" proto h2" if h2_out else ""}
"""


def haproxy_client_side(listen: Ports, server_host: str, server: Ports, tls: Tls) -> str:
    """haproxy as the client pod's proxy on 127.0.0.1: every backend server is the server
    side over TLS 1.3 with a client certificate, its certificate verified and its name
    checked; ALPN h2 for h2 and gRPC, http/1.1 for HTTP/1.1."""
    ssl = (
        f"ssl crt {tls.own.combined} ca-file {tls.anchors} verify required "
        f"verifyhost {tls.peer_id} sni str({tls.peer_id}) ssl-min-ver TLSv1.3"
    )
    sections = [_haproxy_global()]
    for name in ("h1", "h2", "grpc", "tcp"):
        h2 = name in ("h2", "grpc")
        alpn = {"h1": " alpn http/1.1", "tcp": ""}.get(name, " alpn h2")
        server_line = f"server {server_host}:{getattr(server, name)} {ssl}{alpn}"
        bind = f"127.0.0.1:{getattr(listen, name)}"
        sections.append(_haproxy_pair(name, bind, server_line, h2_in=h2, h2_out=False))
    return "\n".join(sections)


def haproxy_server_side(
    host: str, listen: Ports, upstream_host: str, upstream: Ports, tls: Tls, stats_socket: Path
) -> str:
    """haproxy as the server pod's proxy on `host`: TLS 1.3 binds requiring a verified client
    certificate (ALPN h2 and http/1.1), plaintext to the upstream (h2 for h2 and gRPC)."""
    ssl = f"ssl crt {tls.own.combined} ca-file {tls.anchors} verify required ssl-min-ver TLSv1.3"
    probe = (
        "  http-request return status 200 content-type text/plain lf-string "
        f'"%[ssl_fc_protocol] %[ssl_c_verify]" if {{ path {TLS_PROBE_PATH} }}\n'
    )
    sections = [_haproxy_global(stats_socket)]
    for name in ("h1", "h2", "grpc", "tcp"):
        alpn = "" if name == "tcp" else " alpn h2,http/1.1"
        bind = f"{host}:{getattr(listen, name)} {ssl}{alpn}"
        server_line = f"upstream {upstream_host}:{getattr(upstream, name)}"
        extra = "" if name == "tcp" else probe
        h2 = name in ("h2", "grpc")
        sections.append(
            _haproxy_pair(name, bind, server_line, h2_in=False, h2_out=h2, frontend_extra=extra)
        )
    return "\n".join(sections)
