"""Configuration files for the proxy benchmark's nginx upstream and its nginx and haproxy proxies.

Pure text from ports and a scratch directory. Every proxy gets one core's worth of workers
(nginx `worker_processes 1`, haproxy `nbthread 1`), no access log, and keep-alive to its
upstream, so the comparison with meshlet (one asyncio loop) is one core against one core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

NGINX_STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")


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
    sections = [
        """\
global
  nbthread 1
  maxconn 4096

defaults
  timeout connect 5s
  timeout client 120s
  timeout server 120s
"""
    ]
    for name, mode, bind_proto, server_proto in (
        ("h1", "http", "", ""),
        ("h2", "http", " proto h2", " proto h2"),
        ("grpc", "http", " proto h2", " proto h2"),
        ("tcp", "tcp", "", ""),
    ):
        reuse = "  http-reuse always\n" if mode == "http" else ""
        sections.append(f"""\
frontend {name}
  mode {mode}
  bind 127.0.0.1:{getattr(listen, name)}{bind_proto}
  default_backend {name}

backend {name}
  mode {mode}
{reuse}  server upstream 127.0.0.1:{getattr(upstream, name)}{server_proto}
""")
    return "\n".join(sections)
