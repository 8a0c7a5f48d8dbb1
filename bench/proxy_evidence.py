"""Proof that a meshed pair's row crossed mutual TLS: each pair's own counters, judged.

A meshed row's figures stand only if the pair says, after the runs, that it carried at least
what the load generator counted (the probes and every request that succeeded, or every byte the
TCP server received) over TLS from the client side to the server side:

- meshlet: the client proxy's `request_total` (outbound, tls="true", the server's identity);
  for opaque TCP the server proxy's `tcp_read_bytes_total` + `tcp_write_bytes_total` (inbound,
  tls="true", the client's identity), since the outbound TCP counters carry no TLS label.
- Envoy: the client side's cluster completed TLS handshakes; the server side's listener
  completed TLS 1.3 handshakes (it requires a client certificate) and answered the requests
  with 2xx (or relayed the bytes, tcp_proxy).
- nginx: the server side's `stub_status` request count (its HTTP listeners take only TLS 1.3
  with a verified client certificate); for TCP its per-session log (`$ssl_protocol
  $ssl_client_verify $bytes_received $bytes_sent`).
- meshlet with an AuthorizationPolicy in force (`meshlet-policy-mesh`, bench/proxy_policy.py):
  besides the above, the server proxy's `inbound_http_authz_allow_total` for the client's
  identity with `authz_kind="authorizationpolicy"`, and none allowed by the loopback exception
  every controller-sent policy carries (`authz_kind="default"`, `authz_name="localhost"`), so
  that the row measures the policy's own authorization, not the exception.
- haproxy: the server side's stats socket: cumulated TLS connections, and the frontend's
  requests (or bytes in and out) on a bind that takes only TLS 1.3 with a verified client
  certificate.

The judges are pure: text in, a `Verdict` out: "" (proven) or why not, and how many TLS
connections the server side accepted (pooled connections keep it small; a handshake per request
would show). Fetching is the caller's.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

LOOPBACK_AUTHZ: Final = {"authz_kind": "default", "authz_name": "localhost"}


@dataclass(frozen=True, slots=True)
class Verdict:
    why: str = ""  # "" when proven
    tls_connections: int | None = None  # accepted by the server side, when it counts them


def metric_sum(text: str, name: str, labels: Mapping[str, str]) -> float:
    wanted = labels.items()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and wanted <= sample.labels.items()
    )


def _meshlet_connections(server_metrics: str) -> int:
    opened = {"direction": "inbound", "tls": "true"}
    return int(metric_sum(server_metrics, "tcp_open_total", opened))


def meshlet_requests(
    client_metrics: str, server_metrics: str, server_id: str, at_least: int
) -> Verdict:
    sent = metric_sum(
        client_metrics,
        "request_total",
        {"direction": "outbound", "tls": "true", "server_id": server_id},
    )
    connections = _meshlet_connections(server_metrics)
    if sent >= at_least:
        return Verdict("", connections)
    return Verdict(
        f"the client proxy sent {sent:.0f} requests over mTLS to {server_id} (request_total, "
        f"outbound, tls=true), expected at least {at_least}: traffic bypassed the mesh",
        connections,
    )


def meshlet_bytes(server_metrics: str, client_id: str, at_least: int) -> Verdict:
    labels = {"direction": "inbound", "tls": "true", "client_id": client_id}
    relayed = sum(
        metric_sum(server_metrics, name, labels)
        for name in ("tcp_read_bytes_total", "tcp_write_bytes_total")
    )
    connections = _meshlet_connections(server_metrics)
    if relayed >= at_least:
        return Verdict("", connections)
    return Verdict(
        f"the server proxy relayed {relayed:.0f} bytes for {client_id} over mTLS (tcp_*_bytes, "
        f"inbound, tls=true), expected at least {at_least}: traffic bypassed the mesh",
        connections,
    )


def meshlet_authorized(server_metrics: str, client_id: str, authz: str, at_least: int) -> str:
    """ "" when the server proxy allowed at least `at_least` HTTP requests of `client_id` by the
    AuthorizationPolicy named `authz` and none by the loopback exception, else why not."""
    family, client = "inbound_http_authz_allow_total", {"client_id": client_id, "tls": "true"}
    by_policy = metric_sum(
        server_metrics, family, {**client, "authz_kind": "authorizationpolicy", "authz_name": authz}
    )
    by_loopback = metric_sum(server_metrics, family, LOOPBACK_AUTHZ)
    if by_loopback:
        return (
            f"the server proxy allowed {by_loopback:.0f} requests by the loopback exception "
            "(authz_kind=default, authz_name=localhost), not by the AuthorizationPolicy"
        )
    if by_policy >= at_least:
        return ""
    return (
        f"the server proxy allowed {by_policy:.0f} requests of {client_id} by AuthorizationPolicy "
        f"{authz} ({family}, authz_kind=authorizationpolicy), expected at least {at_least}: the "
        "policy was not in force"
    )


def envoy_pair(
    client: Mapping[str, int], server: Mapping[str, int], scenario: str, at_least: int
) -> Verdict:
    """`scenario` is a listener and cluster name (h1, h2, grpc, tcp); `at_least` requests
    (bytes for tcp)."""
    handshakes = client.get(f"cluster.{scenario}.ssl.handshake", 0)
    if handshakes < 1:
        return Verdict(
            f"the client-side Envoy made no TLS handshake to the server side ({scenario})"
        )
    tls13 = server.get(f"listener.{scenario}.ssl.versions.TLSv1.3", 0)
    if tls13 < 1:
        return Verdict(f"the server-side Envoy accepted no TLS 1.3 connection ({scenario})")
    connections = server.get(f"listener.{scenario}.ssl.handshake", 0)
    if scenario == "tcp":
        carried = sum(server.get(f"tcp.tcp.downstream_cx_{d}_bytes_total", 0) for d in ("rx", "tx"))
        what = "bytes (tcp_proxy)"
    else:
        carried = server.get(f"http.{scenario}.downstream_rq_2xx", 0)
        what = "2xx responses"
    if carried >= at_least:
        return Verdict("", connections)
    return Verdict(
        f"the server-side Envoy counted {carried} {what} over mTLS, expected at least "
        f"{at_least}: traffic bypassed the pair",
        connections,
    )


def nginx_requests(stub_status: str, at_least: int) -> Verdict:
    """`stub_status` text: its third line holds accepts, handled, requests (the status
    requests' own connections among them)."""
    try:
        accepted, _, served = map(int, stub_status.splitlines()[2].split()[:3])
    except (IndexError, ValueError):
        return Verdict(f"the server-side nginx's stub_status was unreadable: {stub_status[:80]!r}")
    if served >= at_least:
        return Verdict("", accepted)
    return Verdict(
        f"the server-side nginx served {served} requests over mTLS, expected at least "
        f"{at_least}: traffic bypassed the pair",
        accepted,
    )


def nginx_stream(log: str, at_least: int) -> Verdict:
    """The server side's stream log: `protocol verify bytes_received bytes_sent` per session."""
    carried = sessions = 0
    for line in filter(None, (line.strip() for line in log.splitlines())):
        protocol, verify, received, sent = line.split()
        if (protocol, verify) != ("TLSv1.3", "SUCCESS"):
            return Verdict(f"the server-side nginx logged a TCP session with {protocol} {verify}")
        carried += int(received) + int(sent)
        sessions += 1
    if carried >= at_least:
        return Verdict("", sessions)
    return Verdict(
        f"the server-side nginx relayed {carried} bytes over mTLS, expected at least "
        f"{at_least}: traffic bypassed the pair",
        sessions,
    )


def haproxy_pair(show_info: str, show_stat: str, scenario: str, at_least: int) -> Verdict:
    """The server side's `show info` and `show stat` (CSV) answers."""
    info = dict(line.split(": ", 1) for line in show_info.splitlines() if ": " in line)
    connections = int(info.get("CumSslConns", "0"))
    if connections < 1:
        return Verdict("the server-side haproxy accepted no TLS connection")
    rows = csv.DictReader(io.StringIO(show_stat.removeprefix("# ")))
    frontend = next((r for r in rows if (r["pxname"], r["svname"]) == (scenario, "FRONTEND")), None)
    if frontend is None:
        return Verdict(f"the server-side haproxy has no frontend {scenario}")
    if scenario == "tcp":
        carried, what = int(frontend["bin"] or 0) + int(frontend["bout"] or 0), "bytes"
    else:
        carried, what = int(frontend["req_tot"] or 0), "requests"
    if carried >= at_least:
        return Verdict("", connections)
    return Verdict(
        f"the server-side haproxy counted {carried} {what} over mTLS, expected at least "
        f"{at_least}: traffic bypassed the pair",
        connections,
    )
