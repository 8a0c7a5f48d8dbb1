"""The pairs' counters judged: enough traffic over mutual TLS passes, anything less fails."""

from __future__ import annotations

from bench import proxy_evidence

SERVER_ID = "server.bench.serviceaccount.identity.meshlet.cluster.local"
CLIENT_ID = "client.bench.serviceaccount.identity.meshlet.cluster.local"


def _meshlet_request_total(tls: str, value: int) -> str:
    labels = (
        f'direction="outbound",target_addr="127.0.0.3:4143",tls="{tls}",no_tls_reason="",'
        f'client_id="",server_id="{SERVER_ID if tls == "true" else ""}",authority="a"'
    )
    return f"# TYPE request counter\nrequest_total{{{labels}}} {value}.0\n"


SERVER_METRICS = (
    "# TYPE tcp_open counter\n"
    'tcp_open_total{direction="inbound",target_addr="127.0.0.3:80",tls="true",no_tls_reason="",'
    f'client_id="{CLIENT_ID}",server_id=""}} 3.0\n'
)


def test_meshlet_requests_over_mtls_are_counted() -> None:
    metrics = _meshlet_request_total("true", 100)
    verdict = proxy_evidence.meshlet_requests(metrics, SERVER_METRICS, SERVER_ID, 100)
    assert verdict == proxy_evidence.Verdict("", 3)
    verdict = proxy_evidence.meshlet_requests(metrics, SERVER_METRICS, SERVER_ID, 101)
    assert "sent 100 requests" in verdict.why


def test_meshlet_requests_without_tls_do_not_count() -> None:
    metrics = _meshlet_request_total("no_identity", 100)
    verdict = proxy_evidence.meshlet_requests(metrics, SERVER_METRICS, SERVER_ID, 1)
    assert "bypassed the mesh" in verdict.why


def test_meshlet_tcp_bytes_are_the_server_sides_inbound_mtls_bytes() -> None:
    labels = (
        'direction="inbound",target_addr="127.0.0.3:5201",tls="true",no_tls_reason="",'
        f'client_id="{CLIENT_ID}",server_id=""'
    )
    metrics = (
        f"# TYPE tcp_read_bytes counter\ntcp_read_bytes_total{{{labels}}} 900.0\n"
        f"# TYPE tcp_write_bytes counter\ntcp_write_bytes_total{{{labels}}} 100.0\n"
    )
    assert proxy_evidence.meshlet_bytes(metrics, CLIENT_ID, 1000).why == ""
    assert proxy_evidence.meshlet_bytes(metrics, "someone.else", 1).why != ""


def test_envoy_pair_needs_handshakes_on_both_sides_and_the_requests() -> None:
    client = {"cluster.h2.ssl.handshake": 1}
    server = {
        "listener.h2.ssl.versions.TLSv1.3": 1,
        "listener.h2.ssl.handshake": 1,
        "http.h2.downstream_rq_2xx": 50,
    }
    assert proxy_evidence.envoy_pair(client, server, "h2", 50) == proxy_evidence.Verdict("", 1)
    assert "51" in proxy_evidence.envoy_pair(client, server, "h2", 51).why
    assert "no TLS handshake" in proxy_evidence.envoy_pair({}, server, "h2", 1).why
    assert "TLS 1.3" in proxy_evidence.envoy_pair(client, {}, "h2", 1).why
    tcp_server = {
        "listener.tcp.ssl.versions.TLSv1.3": 2,
        "tcp.tcp.downstream_cx_rx_bytes_total": 700,
        "tcp.tcp.downstream_cx_tx_bytes_total": 300,
    }
    verdict = proxy_evidence.envoy_pair({"cluster.tcp.ssl.handshake": 2}, tcp_server, "tcp", 1000)
    assert verdict.why == ""


def test_nginx_stub_status_requests() -> None:
    status = "Active connections: 2 \nserver accepts handled requests\n 4 4 120 \nReading: 0\n"
    assert proxy_evidence.nginx_requests(status, 120) == proxy_evidence.Verdict("", 4)
    assert "served 120" in proxy_evidence.nginx_requests(status, 121).why
    assert "unreadable" in proxy_evidence.nginx_requests("", 1).why


def test_nginx_stream_log_needs_tls_13_and_a_verified_client_on_every_session() -> None:
    good = "TLSv1.3 SUCCESS 1000 10\nTLSv1.3 SUCCESS 37 4\n"
    assert proxy_evidence.nginx_stream(good, 1051) == proxy_evidence.Verdict("", 2)
    assert "bypassed" in proxy_evidence.nginx_stream(good, 1052).why
    assert "- NONE" in proxy_evidence.nginx_stream(good + "- NONE 5 0\n", 1).why


def test_haproxy_frontend_counts_on_a_tls_bind() -> None:
    info = "Name: HAProxy\nCumSslConns: 3\n"
    stat = (
        "# pxname,svname,bin,bout,req_tot\n"
        "h1,FRONTEND,100,200,42\nh1,upstream,1,2,\ntcp,FRONTEND,5000,10,\n"
    )
    assert proxy_evidence.haproxy_pair(info, stat, "h1", 42) == proxy_evidence.Verdict("", 3)
    assert "42 requests" in proxy_evidence.haproxy_pair(info, stat, "h1", 43).why
    assert proxy_evidence.haproxy_pair(info, stat, "tcp", 5010).why == ""
    assert "no TLS" in proxy_evidence.haproxy_pair("CumSslConns: 0\n", stat, "h1", 1).why
