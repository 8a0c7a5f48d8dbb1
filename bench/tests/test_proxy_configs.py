"""nginx and haproxy configs: the mTLS pairs say what the row claims, and the tools accept them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench import proxy_configs
from bench.proxy_configs import Ports
from bench.proxy_pki import Pki, client_tls, server_tls

LISTEN = Ports(20001, 20002, 20003, 20004)
SERVER = Ports(21001, 21002, 21003, 21004)
UPSTREAM = Ports(30001, 30002, 30003, 30004)


def _nginx_pair(pki: Pki, scratch: Path, stream: bool) -> tuple[str, str]:
    client = proxy_configs.nginx_client_side(
        scratch, LISTEN, "127.0.0.3", SERVER, client_tls(pki), stream
    )
    server = proxy_configs.nginx_server_side(
        scratch, "127.0.0.3", SERVER, "127.0.0.3", UPSTREAM, server_tls(pki), stream, 20999
    )
    return client, server


def test_the_nginx_client_side_presents_its_certificate_and_checks_the_servers(
    pki: Pki, tmp_path: Path
) -> None:
    client, _ = _nginx_pair(pki, tmp_path, stream=True)
    for prefix in ("proxy_ssl", "grpc_ssl"):
        assert f"{prefix}_certificate {pki.client.chain};" in client
        assert f"{prefix}_verify on;" in client
        assert f"{prefix}_name {pki.server.name};" in client
        assert f"{prefix}_protocols TLSv1.3;" in client
    assert "proxy_pass https://h1;" in client
    assert "grpc_pass grpcs://grpc;" in client
    assert f"proxy_pass 127.0.0.3:{SERVER.tcp};\n    proxy_ssl on;" in client


def test_the_nginx_server_side_takes_only_verified_client_certificates(
    pki: Pki, tmp_path: Path
) -> None:
    _, server = _nginx_pair(pki, tmp_path, stream=True)
    assert server.count("ssl_verify_client on;") == 2  # http and stream
    assert server.count("ssl_protocols TLSv1.3;") == 2
    for port in (SERVER.h1, SERVER.h2, SERVER.grpc, SERVER.tcp):
        assert f"listen 127.0.0.3:{port} ssl" in server
    assert server.count(proxy_configs.TLS_PROBE_PATH) == 3
    assert "stub_status;" in server


def test_haproxy_pair_checks_certificates_both_ways(pki: Pki) -> None:
    client = proxy_configs.haproxy_client_side(LISTEN, "127.0.0.3", SERVER, client_tls(pki))
    server = proxy_configs.haproxy_server_side(
        "127.0.0.3", SERVER, "127.0.0.3", UPSTREAM, server_tls(pki), Path("/run/h.sock")
    )
    assert client.count(f"crt {pki.client.combined} ca-file {pki.anchors} verify required") == 4
    assert client.count(f"verifyhost {pki.server.name}") == 4
    assert client.count("alpn h2") == 2 and client.count("alpn http/1.1") == 1
    assert server.count(f"crt {pki.server.combined} ca-file {pki.anchors} verify required") == 4
    assert server.count("ssl-min-ver TLSv1.3") == 4
    assert "stats socket /run/h.sock" in server


def _accepted(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed (make bench installs it)")
    result = subprocess.run(argv, capture_output=True, text=True)
    return "" if result.returncode == 0 else result.stderr[-300:]


def test_nginx_accepts_the_pair(pki: Pki, tmp_path: Path) -> None:
    stream = proxy_configs.NGINX_STREAM_MODULE.exists()
    for side, text in zip(("client", "server"), _nginx_pair(pki, tmp_path, stream), strict=True):
        conf = tmp_path / f"{side}.conf"
        conf.write_text(text)
        error_log = str(tmp_path / f"{side}-error.log")
        assert _accepted(["nginx", "-t", "-c", str(conf), "-e", error_log]) == "", side


def test_haproxy_accepts_the_pair(pki: Pki, tmp_path: Path) -> None:
    sides = {
        "client": proxy_configs.haproxy_client_side(LISTEN, "127.0.0.3", SERVER, client_tls(pki)),
        "server": proxy_configs.haproxy_server_side(
            "127.0.0.3", SERVER, "127.0.0.3", UPSTREAM, server_tls(pki), tmp_path / "h.sock"
        ),
        "one hop": proxy_configs.haproxy(LISTEN, UPSTREAM),
    }
    for side, text in sides.items():
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(text)
        assert _accepted(["haproxy", "-c", "-f", str(cfg)]) == "", side
