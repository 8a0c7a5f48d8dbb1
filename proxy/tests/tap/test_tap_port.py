"""The tap port under attack, on a real `meshlet-proxy` process certified by a real identity
service, with real TLS from the test CA: who is refused and when, what a hostile message or
match costs the proxy (its resident memory, read from /proc), and whether the proxy's data
plane keeps flowing meanwhile (`stallprobe`, timing requests through its outbound listener
from a process of its own). Any pod can reach this port."""

from __future__ import annotations

import contextlib
import itertools
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshlet.api import tap_pb2
from meshlet.proxy.tap.conn import TapLimits
from meshlet.proxy.tap.match import MAX_LEAVES
from meshlet_testing import tapproc
from meshlet_testing.tapproc import (
    DATA,
    GOAWAY,
    HEADERS,
    OTHER_ID,
    PROXY_ID,
    RST_STREAM,
    TAP_ID,
    Frame,
    Probe,
    RawH2,
    TapProxy,
    any_of,
    call_head,
    frame,
    goaway_code,
    grpc_prefix,
    rapid_reset,
)

LIMITS = TapLimits()
MiB = 1 << 20
ENHANCE_YOUR_CALM = 0xB
PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT = b"7", b"8", b"3"


@pytest.fixture
def proxy(test_ca: Any, tmp_path: Path) -> Iterator[tuple[TapProxy, Any, Path]]:
    with contextlib.ExitStack() as stack:
        yield tapproc.start(stack, tmp_path / "run", test_ca), test_ca, tmp_path


def context(proxy: tuple[TapProxy, Any, Path], identity: str | None) -> ssl.SSLContext:
    _, test_ca, root = proxy
    return tapproc.client_context(test_ca, identity, root)


def data(sid: int, total: int) -> Iterator[bytes]:
    """`total` bytes of DATA on `sid`, in 16 KiB frames."""
    chunk = frame(DATA, 0, sid, b"\0" * 16384)
    for _ in range(total // 16384):
        yield chunk


def grpc_status(frames: list[Frame], sid: int) -> bytes | None:
    for kind, _, stream, payload in frames:
        if kind == HEADERS and stream == sid and b"grpc-status" in payload:
            status: bytes = payload[b"grpc-status"]
            return status
    return None


def test_a_client_without_a_certificate_fails_the_handshake(proxy: Any) -> None:
    tap, _, _ = proxy
    raw = RawH2(tap.control, context(proxy, None))  # TLS 1.3: the client's side completes first
    raw.sock.setblocking(True)
    raw.sock.settimeout(5)
    with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
        raw.sock.recv(1024)
    raw.close()
    assert tap.metric("tap_refused_total", reason="handshake") == 1


def test_a_certificate_from_another_ca_fails_the_handshake(proxy: Any, tmp_path: Path) -> None:
    tap, test_ca, _ = proxy
    ctx = tapproc.stranger_context(TAP_ID, tmp_path / "stranger")
    ctx.load_verify_locations(cadata=test_ca.anchors_pem)  # it trusts the proxy, not back
    raw = RawH2(tap.control, ctx)
    raw.sock.setblocking(True)
    raw.sock.settimeout(5)
    with pytest.raises(ssl.SSLError, match="UNKNOWN_CA"):
        raw.sock.recv(1024)
    raw.close()
    assert tap.metric("tap_refused_total", reason="handshake") == 1


def test_another_identity_is_refused_before_its_message_is_read(proxy: Any) -> None:
    """A valid certificate of another workload, a call declaring 300 MiB and sending them as
    fast as the proxy lets it: the call is answered PERMISSION_DENIED from its head, the proxy
    grants no window, stops reading, and closes; its memory does not move."""
    tap = proxy[0]
    before = tap.rss_mib()
    client = RawH2(tap.control, context(proxy, OTHER_ID))
    started = time.monotonic()
    client.send(call_head(1))
    client.upload(1, grpc_prefix(300 * MiB), 300 * MiB, within=30)
    client.exchange(within=10)  # what else comes, until the proxy closes
    client.close()
    grown = tap.rss_mib() - before
    assert client.sent < 1 * MiB, f"the proxy took {client.sent / MiB:.0f} MiB, grew {grown:.0f}"
    assert grown < 16, f"the proxy grew by {grown:.0f} MiB"
    received = client.received
    assert grpc_status(received, 1) == PERMISSION_DENIED
    headers = next(p for k, _, s, p in received if k == HEADERS and s == 1)
    assert headers[b"grpc-message"] == f"{OTHER_ID} may not tap this proxy".encode()
    assert [goaway_code(p) for k, _, _, p in received if k == GOAWAY] == [0]
    assert client.closed and time.monotonic() - started < LIMITS.refused_linger + 5
    assert tap.metric("tap_refused_total", reason="identity") == 1


def test_a_refused_client_ignoring_flow_control_is_not_read_either(proxy: Any) -> None:
    tap = proxy[0]
    before = tap.rss_mib()
    client = RawH2(tap.control, context(proxy, OTHER_ID))
    head = [call_head(1), frame(DATA, 0, 1, grpc_prefix(300 * MiB))]
    client.exchange(itertools.chain(head, data(1, 300 * MiB)), within=20)
    client.close()
    assert grpc_status(client.received, 1) == PERMISSION_DENIED
    assert client.closed and client.sent < 32 * MiB  # what the sockets' buffers took
    assert tap.rss_mib() - before < 16


def test_an_oversized_request_from_the_tap_controller_is_refused_unread(proxy: Any) -> None:
    """The allowed identity declaring 300 MiB: RESOURCE_EXHAUSTED on the first DATA frame and
    the stream reset, the connection living on; a client that goes on sending regardless of
    the reset is cut off (GOAWAY ENHANCE_YOUR_CALM); memory stays put."""
    tap = proxy[0]
    before = tap.rss_mib()
    client = RawH2(tap.control, context(proxy, TAP_ID))
    client.send(call_head(1))
    client.upload(1, grpc_prefix(300 * MiB), 300 * MiB, within=30)
    client.exchange(within=0.5)
    received = client.received
    assert client.sent < 1 * MiB, f"the proxy took {client.sent / MiB:.0f} MiB"
    assert grpc_status(received, 1) == RESOURCE_EXHAUSTED
    message = next(p for k, _, s, p in received if k == HEADERS and s == 1)[b"grpc-message"]
    assert message == (
        b"a request message of 314572800 bytes is over the %d-byte limit" % LIMITS.max_message
    )
    assert (RST_STREAM, 1) in [(k, s) for k, _, s, _ in received]
    assert not client.closed
    assert GOAWAY not in [k for k, *_ in received]
    client.exchange(data(1, 300 * MiB), within=20)  # DATA on the reset stream, frame after frame
    client.close()
    goaways = [goaway_code(p) for k, _, _, p in client.received if k == GOAWAY]
    assert goaways == [ENHANCE_YOUR_CALM]
    assert client.closed and client.sent < 64 * MiB
    grown = tap.rss_mib() - before
    assert grown < 16, f"the proxy grew by {grown:.0f} MiB"


def observe(channel: grpc.Channel, request: bytes, timeout: float = 10.0) -> list[Any]:
    """An Observe call with a request given as bytes (any size, any content)."""
    call = channel.unary_stream(
        "/io.linkerd.proxy.tap.Tap/Observe",
        request_serializer=lambda raw: raw,
        response_deserializer=tap_pb2.TapEvent.FromString,
    )
    return list(call(request, timeout=timeout))


@contextlib.contextmanager
def tap_channel(proxy: Any, identity: str = TAP_ID) -> Iterator[grpc.Channel]:
    tap, test_ca, root = proxy
    chain, key = test_ca.serving_cert(identity, root / "grpc" / identity)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=test_ca.anchors_pem.encode(),
        private_key=key.read_bytes(), certificate_chain=chain.read_bytes(),
    )  # fmt: skip
    options = [("grpc.ssl_target_name_override", PROXY_ID), ("grpc.enable_http_proxy", 0)]
    with grpc.secure_channel(f"127.0.0.1:{tap.control}", credentials, options) as channel:
        yield channel


def test_a_huge_match_is_refused_at_once_and_the_data_plane_flows(proxy: Any) -> None:
    tap = proxy[0]
    before = tap.rss_mib()
    with Probe(tap) as probe, tap_channel(proxy) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as huge:
            observe(channel, any_of(1_000_000))  # 2 MB on the wire
        assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the 65536-byte limit" in huge.value.details()
        with pytest.raises(grpc.RpcError) as wide:
            observe(channel, any_of(MAX_LEAVES + 1))
        assert wide.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wide.value.details() == f"the match has more than {MAX_LEAVES} leaves"
        with pytest.raises(grpc.RpcError) as dense:  # as many leaves as 64 KiB can hold
            observe(channel, any_of((LIMITS.max_message - 16) // 2))
        assert dense.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - started < 2
    assert probe.result["failures"] == 0
    assert probe.result["longest"] < 0.5, probe.result
    assert tap.rss_mib() - before < 16


def test_the_tap_controller_still_observes(proxy: Any) -> None:
    """A real grpcio client with the tap controller's certificate: its tap opens and sees the
    probe's requests, and a match of the most leaves is taken."""
    tap = proxy[0]
    Match = tap_pb2.ObserveRequest.Match
    Http = Match.Http
    leaves = [Match(http=Http(path=Http.StringMatch(prefix="/probe")))] * MAX_LEAVES
    request = tap_pb2.ObserveRequest(limit=2, match=Match(all=Match.Seq(matches=leaves)))
    with Probe(tap), tap_channel(proxy) as channel:
        events = observe(channel, request.SerializeToString())
    kinds = [e.http.WhichOneof("event") for e in events]
    assert kinds.count("request_init") == 2 and kinds.count("response_end") == 2
    assert {e.http.request_init.path for e in events if kinds} >= {"/probe"}
    ends = [e.http.response_end for e in events if e.http.HasField("response_end")]
    assert [end.response_bytes for end in ends] == [2, 2]  # the probe's upstream says "ok"


def test_a_rapid_reset_flood_gets_goaway_and_the_data_plane_flows(proxy: Any) -> None:
    """The tap controller's identity (no other gets this far), 3 connections each sending
    30,000 HEADERS + RST_STREAM pairs: each is closed with GOAWAY ENHANCE_YOUR_CALM, and
    requests through the proxy meanwhile are not held up."""
    tap = proxy[0]
    before = tap.rss_mib()
    clients = [RawH2(tap.control, context(proxy, TAP_ID)) for _ in range(3)]
    with Probe(tap) as probe:
        floods = [
            threading.Thread(target=client.exchange, args=(rapid_reset(30_000), 30))
            for client in clients
        ]
        for thread in floods:
            thread.start()
        for thread in floods:
            thread.join()
    for client in clients:
        client.close()
        goaways = [goaway_code(p) for k, _, _, p in client.received if k == GOAWAY]
        assert goaways == [ENHANCE_YOUR_CALM]
        assert client.closed
        assert client.sent < len(call_head(1)) * 30_000  # cut off long before the flood ended
    assert probe.result["failures"] == 0
    assert probe.result["longest"] < 1.0, probe.result
    assert tap.rss_mib() - before < 16
    assert tap.metric("tap_refused_total", reason="abuse") == 3
